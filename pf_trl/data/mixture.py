"""Data mixtures: several sources, each with its own format, mixed by weight.

A *data config* lists the sources. It reads fms-hf-tuning's data config files as they are (YAML or JSON)::

    dataprocessor:
      type: default
      streaming: false                     # true: the streaming path (pf_trl.data.streaming)
      seed: 42                             # fms-hf-tuning's `sampling_seed` is read too
      sampling_stopping_strategy: all_exhausted   # or first_exhausted (datasets.interleave_datasets' names)
      sample_by: examples                  # pf-trl: `examples` or `tokens` (what the weights are shares of)
    datasets:
      - name: alpaca
        sampling: 0.5
        data_paths: [data/alpaca.jsonl]
        input_format: alpaca               # pf-trl's own per-dataset options: any PretokenizeConfig field
      - name: chats
        sampling: 0.5
        data_paths: [data/chats/]          # a folder of JSON/JSONL/Parquet/CSV files, a glob, a shards directory...
        rename_columns: {dialog: messages}

``data_handlers`` are refused by name (pf-trl tokenizes each source itself, with the formats of docs/data.md).
Without any ``sampling`` the datasets are concatenated (fms-hf-tuning's rule); with it, every dataset needs one.

Each data path is tokenized with its dataset's options into its own content-addressed shards
(:func:`pf_trl.data.sources.cached_shards`); the loaded mixture is the concatenation of the sources' shards in config
order, and its manifest (:func:`mixture_manifest`) records every source (name, format, rows, counts, weight) plus
the mixing rule. The trainer draws each epoch from it with
:class:`~pf_trl.mixture_sampler.MixtureBatchSampler`. ``pf-trl pretokenize --data_config`` and the service write
the same thing as one shards directory (:func:`write_mixture_shards`).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pf_trl.data.pretokenize import SOURCE_SUFFIXES, PretokenizeConfig, PretokenizeError

Say = Callable[[str], None]

SAMPLE_BY = ("examples", "tokens")
STOPPING_STRATEGIES = ("all_exhausted", "first_exhausted")
DATA_CONFIG_SUFFIXES = (".yaml", ".yml")
_PROCESSOR_KEYS = {"type", "streaming", "seed", "sampling_seed", "sampling_stopping_strategy", "sample_by",
                   "chat_template"}
_DATASET_KEYS = {"name", "sampling", "data_paths", "builder", "rename_columns", "retain_columns", "data_handlers",
                 "split"}
_OPTION_KEYS = {f.name for f in dataclasses.fields(PretokenizeConfig)}


class DataConfigError(ValueError):
    """A data config (or a list of sources) cannot be used; the message names the entry and the fix."""


def _quiet(_: str) -> None:
    return None


@dataclass
class MixtureSource:
    """One dataset of a data config.

    Attributes:
        name: unique name (reported per source by the manifest and ``pf-trl inspect``).
        data_paths: files, folders, globs, shards or ``save_to_disk`` directories; concatenated in order.
        sampling: the weight (share of each epoch); ``None`` in a plain concatenation.
        options: :class:`~pf_trl.data.pretokenize.PretokenizeConfig` fields for this source (format, field names...).
        rename_columns: ``{old: new}``, applied when the rows are read (fms-hf-tuning's ``rename_columns``).
        retain_columns: columns kept after renaming (fms-hf-tuning's ``retain_columns``).
    """

    name: str
    data_paths: list[str]
    sampling: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    rename_columns: dict[str, str] | None = None
    retain_columns: list[str] | None = None


@dataclass
class DataConfig:
    """Sources and the mixing rule (see the module docstring)."""

    sources: list[MixtureSource]
    seed: int = 42
    streaming: bool = False
    stopping_strategy: str = "all_exhausted"
    sample_by: str = "examples"
    path: str | None = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise DataConfigError("the data config lists no datasets; add at least one under `datasets:`")
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise DataConfigError(f"datasets: names must be unique, {dupes} appear twice; rename one")
        given = [s.sampling is not None for s in self.sources]
        if any(given) and not all(given):
            missing = [s.name for s in self.sources if s.sampling is None]
            raise DataConfigError(f"datasets {missing} have no `sampling` while others do: give every dataset a "
                                  "sampling weight (a mixture) or none (a plain concatenation)")
        for s in self.sources:
            if s.sampling is not None and (isinstance(s.sampling, bool) or not isinstance(s.sampling, (int, float))
                                           or not s.sampling >= 0 or s.sampling == float("inf")):
                raise DataConfigError(f"dataset {s.name!r}: sampling must be a number >= 0, got {s.sampling!r}")
        if any(given) and sum(s.sampling for s in self.sources) <= 0:
            raise DataConfigError("the sampling weights sum to 0; give at least one dataset a positive weight")
        if self.sample_by not in SAMPLE_BY:
            raise DataConfigError(f"dataprocessor.sample_by {self.sample_by!r} is unknown; use examples or tokens")
        if self.stopping_strategy not in STOPPING_STRATEGIES:
            raise DataConfigError(f"dataprocessor.sampling_stopping_strategy {self.stopping_strategy!r} is unknown; "
                                  f"use {' or '.join(STOPPING_STRATEGIES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise DataConfigError(f"dataprocessor.seed must be a non-negative integer, got {self.seed!r}")

    @property
    def is_mixture(self) -> bool:
        """True when the sources carry sampling weights (else they are concatenated)."""
        return self.sources[0].sampling is not None

    def weights(self) -> list[float]:
        """The sampling weights normalised to sum to 1."""
        total = float(sum(s.sampling for s in self.sources))
        return [float(s.sampling) / total for s in self.sources]

    def rule(self) -> dict[str, Any] | None:
        """The mixing rule recorded in the manifest (None for a concatenation)."""
        if not self.is_mixture:
            return None
        return {"weights": self.weights(), "seed": self.seed, "sample_by": self.sample_by,
                "stopping_strategy": self.stopping_strategy}


# ----------------------------------------------------------------------------------------------- reading


def is_data_config_path(obj: Any) -> bool:
    """A path with a YAML suffix (``train_dataset="mix.yaml"``): read as a data config, not as rows."""
    return isinstance(obj, (str, os.PathLike)) and Path(obj).suffix.lower() in DATA_CONFIG_SUFFIXES


def read_data_config(path: str | os.PathLike) -> DataConfig:
    """Read a data config file (YAML, or JSON with a ``datasets`` key).

    Raises:
        DataConfigError: unreadable file, unknown keys, data handlers, bad weights; the message names the entry.
    """
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise DataConfigError(f"data config {path}: no such file")
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise DataConfigError(f"data config {path}: not valid YAML/JSON ({str(exc).splitlines()[0]})") from exc
    if not isinstance(raw, dict):
        raise DataConfigError(f"data config {path}: expected a mapping with `dataprocessor` and `datasets`")
    return parse_data_config(raw, base_dir=file.parent, path=str(file))


def parse_data_config(raw: dict[str, Any], *, base_dir: str | os.PathLike | None = None,
                      path: str | None = None) -> DataConfig:
    """A :class:`DataConfig` from the mapping of a data config file (fms-hf-tuning's schema + pf-trl options)."""
    where = f"data config {path}" if path else "data config"
    unknown = sorted(set(raw) - {"dataprocessor", "datapreprocessor", "datasets"})
    if unknown:
        raise DataConfigError(f"{where}: unknown top-level key(s) {unknown}; allowed: dataprocessor, datasets")
    processor = raw.get("dataprocessor", raw.get("datapreprocessor")) or {}
    if not isinstance(processor, dict):
        raise DataConfigError(f"{where}: `dataprocessor` must be a mapping")
    bad = sorted(set(processor) - _PROCESSOR_KEYS)
    if bad:
        raise DataConfigError(f"{where}: dataprocessor key(s) {bad} are unknown; allowed: {sorted(_PROCESSOR_KEYS)}")
    if processor.get("type", "default") != "default":
        raise DataConfigError(f"{where}: dataprocessor.type {processor.get('type')!r} is unknown; use default")
    if processor.get("chat_template") is not None:
        raise DataConfigError(
            f"{where}: dataprocessor.chat_template is not read from a data config by pf-trl: the template is part "
            "of the tokenizer's identity; write it to a file and pass --chat_template FILE (pf-trl train / "
            "pretokenize)")
    items = raw.get("datasets")
    if not isinstance(items, list) or not items:
        raise DataConfigError(f"{where}: `datasets` must be a non-empty list of datasets")
    base = Path(base_dir) if base_dir is not None else None
    sources = [_parse_dataset(item, i, base, where) for i, item in enumerate(items)]
    seed = processor.get("seed", processor.get("sampling_seed", 42))
    return DataConfig(sources=sources, seed=seed, streaming=bool(processor.get("streaming", False)),
                      stopping_strategy=processor.get("sampling_stopping_strategy", "all_exhausted"),
                      sample_by=processor.get("sample_by", "examples"), path=path)


def _parse_dataset(item: Any, i: int, base: Path | None, where: str) -> MixtureSource:
    if not isinstance(item, dict):
        raise DataConfigError(f"{where}: datasets[{i}] must be a mapping with name and data_paths")
    name = str(item.get("name") or f"dataset_{i}")
    here = f"{where}: dataset {name!r}"
    handlers = item.get("data_handlers") or []
    if handlers:
        names = [h.get("name") if isinstance(h, dict) else h for h in handlers]
        raise DataConfigError(
            f"{here}: data_handlers {names} are not implemented by pf-trl (it tokenizes each dataset itself, with "
            "the formats of docs/data.md); remove data_handlers and name the format with input_format and the field "
            "options (e.g. input_format: alpaca, instruction_field: question)")
    if item.get("builder") is not None:
        raise DataConfigError(f"{here}: builder {item['builder']!r} is not read by pf-trl: it reads data files by "
                              f"their suffix ({', '.join(sorted(SOURCE_SUFFIXES))}); remove builder")
    if item.get("split") not in (None, "train"):
        raise DataConfigError(f"{here}: split {item['split']!r}: pf-trl reads the train split of a data path")
    bad = sorted(set(item) - _DATASET_KEYS - _OPTION_KEYS)
    if bad:
        raise DataConfigError(f"{here}: unknown key(s) {bad}; allowed: {sorted(_DATASET_KEYS - {'data_handlers'})} "
                              f"and the pretokenize options {sorted(_OPTION_KEYS)}")
    paths = item.get("data_paths")
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise DataConfigError(f"{here}: data_paths must be a non-empty list of paths")
    resolved = [_resolve_path(p, base) for p in paths]
    rename = item.get("rename_columns")
    if rename is not None and not (isinstance(rename, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                     for k, v in rename.items())):
        raise DataConfigError(f"{here}: rename_columns must map old column names to new ones")
    retain = item.get("retain_columns")
    if retain is not None and not (isinstance(retain, list) and all(isinstance(c, str) for c in retain)):
        raise DataConfigError(f"{here}: retain_columns must be a list of column names")
    if rename and retain and set(rename) & set(retain):
        raise DataConfigError(f"{here}: retain_columns names {sorted(set(rename) & set(retain))}, which "
                              "rename_columns renames (renaming happens first); retain the new names")
    options = {k: item[k] for k in _OPTION_KEYS if k in item}
    try:
        PretokenizeConfig(**options)
    except (PretokenizeError, TypeError) as exc:
        raise DataConfigError(f"{here}: {exc}") from exc
    return MixtureSource(name=name, data_paths=resolved, sampling=item.get("sampling"), options=options,
                         rename_columns=rename, retain_columns=retain)


def _resolve_path(path: str, base: Path | None) -> str:
    """Relative data paths: from the working directory (fms-hf-tuning's rule), else from the config's folder."""
    p = Path(path).expanduser()
    if p.is_absolute() or base is None or p.exists() or glob.glob(str(p)):
        return str(p)
    beside = base / p
    return str(beside) if (beside.exists() or glob.glob(str(beside))) else str(p)


def data_config_from_sources(items: Sequence[Any], *, seed: int = 42, sample_by: str = "examples",
                             stopping_strategy: str = "all_exhausted") -> DataConfig:
    """The Python API's list of sources: ``[(path_or_dataset, weight), ...]``, ``[{"name", "data_paths",
    "sampling", ...}, ...]`` (data config entries) or :class:`MixtureSource` objects."""
    sources: list[MixtureSource] = []
    for i, item in enumerate(items):
        if isinstance(item, MixtureSource):
            sources.append(item)
        elif isinstance(item, dict):
            if "data_paths" not in item:
                raise DataConfigError(f"sources[{i}] has no data_paths: a list of sources names files with weights; "
                                      "to train on rows held in memory pass datasets.Dataset.from_list(rows)")
            sources.append(_parse_dataset(item, i, None, "sources"))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            path, weight = item
            if not isinstance(path, (str, os.PathLike)):
                raise DataConfigError(f"sources[{i}]: {type(path).__name__} is not a path; a mixture reads files, "
                                      "folders, shards or save_to_disk directories")
            sources.append(MixtureSource(name=Path(path).stem or f"dataset_{i}", data_paths=[str(path)],
                                         sampling=weight))
        else:
            raise DataConfigError(f"sources[{i}]: expected (path, weight), a data config entry (dict) or a "
                                  f"MixtureSource, got {type(item).__name__}")
    return DataConfig(sources=sources, seed=seed, sample_by=sample_by, stopping_strategy=stopping_strategy)


def coerce_data_config(obj: Any) -> DataConfig | None:
    """``obj`` as a :class:`DataConfig` when it is one, a YAML path or a list of sources; else None."""
    if isinstance(obj, DataConfig):
        return obj
    if is_data_config_path(obj):
        return read_data_config(obj)
    if isinstance(obj, (list, tuple)) and obj and not isinstance(obj, str):
        return data_config_from_sources(obj)
    return None


# ------------------------------------------------------------------------------------------ the data paths


def expand_data_path(path: str) -> list[Path]:
    """A data path as concrete sources: a file, a shards / ``save_to_disk`` directory, every readable file of a
    plain folder (sorted), or the matches of a glob (sorted)."""
    p = Path(path)
    if any(ch in path for ch in "*?[") and not p.exists():
        matches = sorted(Path(m) for m in glob.glob(path))
        if not matches:
            raise DataConfigError(f"data path {path}: the pattern matches nothing")
        return [m for q in matches for m in expand_data_path(str(q))]
    if not p.exists():
        raise DataConfigError(f"data path {path}: no such file or directory")
    if p.is_file():
        if p.suffix.lower() not in SOURCE_SUFFIXES:
            raise DataConfigError(f"data path {path}: suffix {p.suffix!r} is not read; use "
                                  f"{', '.join(sorted(SOURCE_SUFFIXES))}, a folder, a shards or save_to_disk directory")
        return [p]
    if any((p / marker).is_file() for marker in ("pf_manifest.json", "state.json", "dataset_dict.json")):
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SOURCE_SUFFIXES)
    if not files:
        raise DataConfigError(f"data path {path}: the folder holds no {', '.join(sorted(SOURCE_SUFFIXES))} file")
    return files


def source_config(base: PretokenizeConfig, source: MixtureSource) -> PretokenizeConfig:
    """The pretokenize options of one source: the run's, overridden by the source's own."""
    try:
        return PretokenizeConfig(**{**base.to_dict(), **source.options})
    except PretokenizeError as exc:
        raise DataConfigError(f"dataset {source.name!r}: {exc}") from exc


def check_data_config_paths(config: DataConfig) -> None:
    """Cheap checks (no tokenizer, no datasets import): every data path exists and is a readable kind."""
    for source in config.sources:
        for path in source.data_paths:
            try:
                expand_data_path(path)
            except DataConfigError as exc:
                raise DataConfigError(f"dataset {source.name!r}: {exc}") from exc


# --------------------------------------------------------------------------------------------- loading


def _renamed_rows(path: Path, source: MixtureSource):
    """The rows of ``path`` with the source's rename/retain applied (a Dataset), or ``path`` when there is none."""
    if not source.rename_columns and not source.retain_columns:
        return path
    from pf_trl.data.pretokenize import load_source
    from pf_trl.data.tokenizer import cache_root

    try:  # datasets' own cache of the parsed file lives beside pf-trl's (it backs the memory-mapped rows)
        ds = load_source(path, cache_root() / "sources")
    except PretokenizeError as exc:
        raise DataConfigError(f"dataset {source.name!r}: {exc}") from exc
    missing = [c for c in (source.rename_columns or {}) if c not in ds.column_names]
    if missing:
        raise DataConfigError(f"dataset {source.name!r}: rename_columns names {missing}, which {path} does not have "
                              f"(columns: {ds.column_names})")
    if source.rename_columns:
        ds = ds.rename_columns(source.rename_columns)
    if source.retain_columns:
        absent = [c for c in source.retain_columns if c not in ds.column_names]
        if absent:
            raise DataConfigError(f"dataset {source.name!r}: retain_columns names {absent}, which are not columns "
                                  f"after renaming ({ds.column_names})")
        ds = ds.select_columns(source.retain_columns)
    return ds


def _source_key(path: Path, source: MixtureSource) -> str:
    from pf_trl.data.pretokenize import source_fingerprint

    digest = hashlib.sha256(source_fingerprint(path).encode())
    digest.update(json.dumps({"rename": source.rename_columns, "retain": source.retain_columns}, sort_keys=True).encode())
    return digest.hexdigest()


def _load_one(path: Path, source: MixtureSource, tokenizer, config: PretokenizeConfig, *, num_proc: int,
              progress: bool, say: Say, what: str):
    """The loaded shards of one concrete data path (tokenized into the cache unless it is a shards directory)."""
    from pf_trl.data import sources as data_sources
    from pf_trl.data.shards import ShardsError, is_shards_dir, load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    expected = tokenizer_fingerprint(tokenizer)
    label = f"{what} data ({source.name})"
    try:
        if is_shards_dir(path):
            say(f"{label}: shards directory {path} (no tokenization)")
            return load_shards(path, expected_tokenizer=expected)
        rows = _renamed_rows(path, source)
        if rows is path:
            target = data_sources.cached_shards(path, tokenizer, config, num_proc=num_proc, progress=progress,
                                                say=say, what=label)
        else:
            target = _cached_renamed(rows, path, source, tokenizer, config, num_proc=num_proc, progress=progress,
                                     say=say, what=label)
        return load_shards(target, expected_tokenizer=expected)
    except (ShardsError, data_sources.DataSourceError) as exc:
        raise DataConfigError(f"dataset {source.name!r}: {exc}") from exc


def _cached_renamed(rows, path: Path, source: MixtureSource, tokenizer, config: PretokenizeConfig, *, num_proc: int,
                    progress: bool, say: Say, what: str) -> Path:
    """``cached_shards`` for renamed rows, addressed by the file's bytes and the rename (not datasets' fingerprint)."""
    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.shards import is_shards_dir
    from pf_trl.data.sources import dataset_cache_key
    from pf_trl.data.tokenizer import cache_root

    key = hashlib.sha256((_source_key(path, source) + dataset_cache_key(path, tokenizer, config.to_dict())).encode())
    target = cache_root() / "datasets" / key.hexdigest()
    if is_shards_dir(target):
        say(f"{what}: cache hit {target} (no tokenization)")
        return target
    say(f"{what}: tokenizing {path} (renamed columns) into the cache {target}")
    try:
        pretokenize(rows, target, config, tokenizer=tokenizer, num_proc=num_proc, progress=progress,
                    source_fingerprint_value=_source_key(path, source))
    except PretokenizeError as exc:
        if is_shards_dir(target):
            return target
        raise DataConfigError(f"dataset {source.name!r}: {exc}") from exc
    return target


def load_mixture(config: DataConfig, tokenizer, base: PretokenizeConfig | None = None, *, num_proc: int = 1,
                 progress: bool = True, say: Say = _quiet, what: str = "training"):
    """Every source of ``config`` as shards, concatenated in config order, with the mixture manifest attached.

    Returns:
        datasets.Dataset: columns ``input_ids``, ``labels``, ``length``; ``pf_manifest`` is :func:`mixture_manifest`.

    Raises:
        DataConfigError: a missing path, bad rows, shards made with another tokenizer (the message names the source).
    """
    import datasets

    if config.streaming:
        raise DataConfigError("this data config streams (dataprocessor.streaming: true); load it with "
                              "pf_trl.data.streaming.stream_mixture or train from it directly")
    base = base or PretokenizeConfig()
    parts, records = [], []
    for source in config.sources:
        options = source_config(base, source)
        loaded = []
        for path in source.data_paths:
            for concrete in expand_data_path(path):
                loaded.append(_load_one(concrete, source, tokenizer, options, num_proc=num_proc, progress=progress,
                                        say=say, what=what))
        part = datasets.concatenate_datasets(loaded) if len(loaded) > 1 else loaded[0]
        part.pf_manifest = loaded[0].pf_manifest if len(loaded) == 1 else None
        parts.append(part)
        records.append(_source_record(source, loaded))
    combined = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    combined.pf_manifest = mixture_manifest(records, config, tokenizer, base, combined)
    return combined


def _source_record(source: MixtureSource, loaded: list) -> dict[str, Any]:
    manifests = [ds.pf_manifest for ds in loaded]
    formats = sorted({m["source"].get("input_format") for m in manifests})
    counts = {k: sum(int(m["counts"].get(k, 0)) for m in manifests)
              for k in ("source_rows", "examples", "tokens", "loss_tokens", "truncated", "dropped")}
    return {
        "name": source.name,
        "input_format": formats[0] if len(formats) == 1 else "mixed:" + ",".join(formats),
        "data_paths": list(source.data_paths),
        "shards": [str(Path(ds.cache_files[0]["filename"]).parent) if ds.cache_files else None for ds in loaded],
        "source_sha256": [m["source"].get("sha256") for m in manifests],
        "options": source.options,
        "weight": source.sampling,
        "counts": counts,
    }


def mixture_manifest(records: list[dict[str, Any]], config: DataConfig, tokenizer, base: PretokenizeConfig,
                     combined) -> dict[str, Any]:
    """The manifest of a mixture: the shards manifest fields over all rows, plus ``sources`` (one record per source
    with its row range and share) and ``mixture`` (the rule; None for a concatenation)."""
    import numpy as np

    from pf_trl._version import __version__
    from pf_trl.data.shards import FORMAT_VERSION, length_stats
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    lengths = np.asarray(combined.data.column("length")) if combined._indices is None else np.asarray(combined["length"])
    start = 0
    weights = config.weights() if config.is_mixture else None
    for i, record in enumerate(records):
        n = record["counts"]["examples"]
        record["rows"] = [start, start + n]
        start += n
        record["weight"] = weights[i] if weights else None
    total_examples = sum(r["counts"]["examples"] for r in records)
    total_tokens = sum(r["counts"]["tokens"] for r in records)
    for record in records:
        record["share_of_rows"] = round(record["counts"]["examples"] / max(total_examples, 1), 6)
        record["share_of_tokens"] = round(record["counts"]["tokens"] / max(total_tokens, 1), 6)
    formats = sorted({r["input_format"] for r in records})
    digest = hashlib.sha256(json.dumps([[r["name"], r["source_sha256"], r["options"]] for r in records],
                                       sort_keys=True).encode())
    max_seq_len = max(int(source_config(base, s).max_seq_len) for s in config.sources)
    counts = {k: sum(int(r["counts"].get(k, 0)) for r in records)
              for k in ("source_rows", "examples", "tokens", "loss_tokens", "truncated", "dropped")}
    return {
        "format_version": FORMAT_VERSION,
        "pf_trl_version": __version__,
        "created_unix": round(time.time(), 3),
        "source": {
            "path": config.path or "sources given in Python",
            "sha256": digest.hexdigest(),
            "rows": counts["source_rows"],
            "input_format": formats[0] if len(formats) == 1 else "mixture",
        },
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": base.to_dict(),
        "max_seq_len": max_seq_len,
        "truncation": base.truncation,
        "counts": counts,
        "lengths": length_stats(lengths, max_seq_len),
        "columns": {"input_ids": "list<int32>", "labels": "list<int32>", "length": "int32"},
        "sources": records,
        "mixture": config.rule(),
    }


def write_mixture_shards(dataset, output_dir: str | os.PathLike, *, overwrite: bool = False,
                         shard_size: str = "500MB") -> dict[str, Any]:
    """Write a loaded mixture (:func:`load_mixture`) as one shards directory, atomically; returns its manifest.

    The directory is an ordinary shards directory (``load_shards`` opens it) whose manifest keeps ``sources`` and
    ``mixture``, so training from it draws the same batches as training from the data config."""
    from pf_trl.data.shards import write_manifest

    manifest = dict(dataset.pf_manifest)
    out = Path(output_dir)
    if out.exists() and not overwrite:
        raise DataConfigError(f"output {out} already exists; choose a new directory or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        shards = work / "shards"
        dataset.save_to_disk(str(shards), max_shard_size=shard_size)
        write_manifest(shards, manifest)  # last: a directory with a manifest is complete
        if out.exists():
            out.rename(work / "old")
        shards.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def mixture_of(dataset) -> dict[str, Any] | None:
    """The mixing rule and per-source row ranges of a loaded mixture (None when ``dataset`` is not one, or when it
    was re-indexed since: then its rows no longer match the recorded ranges)."""
    manifest = getattr(dataset, "pf_manifest", None)
    if not isinstance(manifest, dict):
        manifest = _manifest_beside(dataset)
    if not isinstance(manifest, dict) or not manifest.get("mixture") or not manifest.get("sources"):
        return None
    if getattr(dataset, "_indices", None) is not None or getattr(dataset, "num_rows", None) != manifest["counts"]["examples"]:
        return None
    rule = manifest["mixture"]
    return {"bounds": [tuple(s["rows"]) for s in manifest["sources"]], "names": [s["name"] for s in manifest["sources"]],
            "weights": rule["weights"], "seed": rule["seed"], "sample_by": rule["sample_by"],
            "stopping_strategy": rule["stopping_strategy"]}


def _manifest_beside(dataset) -> dict[str, Any] | None:
    """The manifest of a shards directory opened with ``datasets.load_from_disk`` (found next to its Arrow files)."""
    try:
        files = dataset.cache_files or []
    except Exception:  # noqa: BLE001
        return None
    dirs = {str(Path(f["filename"]).parent) for f in files if isinstance(f, dict) and f.get("filename")}
    if len(dirs) != 1:
        return None
    path = Path(next(iter(dirs))) / "pf_manifest.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
