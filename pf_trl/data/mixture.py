"""Loading a data config: each source tokenized with its own options into its own content-addressed shards, then
all of them as one dataset that records every source and the mixing rule.

Each data path is tokenized with its dataset's options (:func:`pf_trl.data.sources.cached_shards`); the loaded
mixture is the concatenation of the sources' shards in config order, and its manifest (:func:`mixture_manifest`)
records every source (name, format, rows, counts, weight) plus the mixing rule. The trainer draws each epoch from it
with :class:`~pf_trl.batching.mixture_sampler.MixtureBatchSampler`. ``pf-trl pretokenize --data_config`` and the service
write the same thing as one shards directory (:func:`write_mixture_shards`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pf_trl._compat import dataset_indices
from pf_trl.data.data_config import DataConfig, DataConfigError, MixtureSource, expand_data_path, source_config
from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError

Say = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


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

    lengths = np.asarray(combined.data.column("length")) if dataset_indices(combined) is None else np.asarray(combined["length"])
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
    if dataset_indices(dataset) is not None or getattr(dataset, "num_rows", None) != manifest["counts"]["examples"]:
        return None
    rule = manifest["mixture"]
    return {"bounds": [tuple(s["rows"]) for s in manifest["sources"]], "names": [s["name"] for s in manifest["sources"]],
            "weights": rule["weights"], "seed": rule["seed"], "sample_by": rule["sample_by"],
            "stopping_strategy": rule["stopping_strategy"]}


def _manifest_beside(dataset) -> dict[str, Any] | None:
    """The manifest of a shards directory opened with ``datasets.load_from_disk`` (found next to its Arrow files)."""
    try:
        files = dataset.cache_files or []
    except Exception:
        return None
    dirs = {str(Path(f["filename"]).parent) for f in files if isinstance(f, dict) and f.get("filename")}
    if len(dirs) != 1:
        return None
    path = Path(next(iter(dirs))) / "pf_manifest.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
