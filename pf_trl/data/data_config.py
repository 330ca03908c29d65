"""Data configs: several datasets, each with its own options, and how they are mixed.

A data config reads fms-hf-tuning's data config files as they are (YAML or JSON; see docs/data.md, Mixtures)::

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
This module only reads and checks the config (no tokenizer, no ``datasets`` import); :mod:`pf_trl.data.mixture`
loads it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pf_trl.data.pretokenize import SOURCE_SUFFIXES, PretokenizeConfig, PretokenizeError
from pf_trl.errors import PfTrlError

SAMPLE_BY = ("examples", "tokens")
STOPPING_STRATEGIES = ("all_exhausted", "first_exhausted")
DATA_CONFIG_SUFFIXES = (".yaml", ".yml")
_PROCESSOR_KEYS = {"type", "streaming", "seed", "sampling_seed", "sampling_stopping_strategy", "sample_by",
                   "chat_template"}
_DATASET_KEYS = {"name", "sampling", "data_paths", "builder", "rename_columns", "retain_columns", "data_handlers",
                 "split"}
_OPTION_KEYS = {f.name for f in dataclasses.fields(PretokenizeConfig)}


class DataConfigError(PfTrlError, ValueError):
    """A data config (or a list of sources) cannot be used; the message names the entry and the fix."""


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
    """Relative data paths: from the working directory (fms-hf-tuning's rule), else from the config's folder. A bucket
    URI is kept as written."""
    from pf_trl.storage import is_remote

    if is_remote(path):
        return path
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
    plain folder (sorted), or the matches of a glob (sorted). A bucket URI (a data file or a committed dataset) is
    its node-cache copy (:func:`pf_trl.data.remote.local_path`)."""
    from pf_trl.storage import is_remote

    if is_remote(path):
        from pf_trl.data.remote import local_path
        from pf_trl.data.shards import ShardsError
        from pf_trl.storage import StorageError

        try:
            return [Path(local_path(path, purpose="a data config's source: its rows are mixed as a whole"))]
        except (StorageError, ShardsError) as exc:
            raise DataConfigError(f"data path {exc}") from exc
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
