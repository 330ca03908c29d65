"""``pretokenize(..., engine="ray")``: the same tokenization as the single-process engine, run as Ray Data tasks,
written as a dataset of many parts (:mod:`pf_trl.data.parts`).

How a run goes:

1. The driver opens the source with the single-process engine's reader (:func:`pf_trl.data.pretokenize.load_source`:
   the same parser, schema and row order), its datasets cache inside DEST (``DEST/.work``), resolves the input
   format and cuts the rows into fixed ranges (``rows_per_part``). The plan (``DEST/pf_plan.json``: ranges, source
   checksum, tokenizer, options) is written whole to a temporary name and renamed, never visible half-written.
2. One Ray Data task per range not yet committed: ``map_batches`` with a callable class, so each worker loads the
   tokenizer and memory-maps the source once, then tokenizes its ranges with the single-process engine's code
   (:class:`pf_trl.data.pretokenize._ChunkJob`, :func:`~pf_trl.data.pretokenize.summarize_tokenized`) and writes
   the part ``part-<first source row, 12 digits>`` into a temporary sibling, its manifest last, then renames it
   into place. A part's name comes from its rows, so a retried task (its worker died) writes the same part once:
   the first complete copy wins, a later one is discarded.
3. The dataset's manifest, written last, lists the parts in source order: the rows are those the single-process
   engine writes, in the same order, with the same identity (tokenizer, input format, source checksum).

A run interrupted (driver or cluster gone) and started again with the same source and flags resumes: committed
parts are kept, the others tokenized. The cluster is ``RAY_ADDRESS`` when set, else an already initialised Ray,
else a local one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from pf_trl.data.options import PretokenizeConfig, PretokenizeError

logger = logging.getLogger(__name__)

PLAN_FILE = "pf_plan.json"
WORK_DIR = ".work"
PART_PREFIX = "part-"
RAY_EXTRA_HINT = "pip install 'pf-trl[ray]'"


def import_ray():
    """``ray`` and ``ray.data``, or a PretokenizeError naming the extra that installs them."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise PretokenizeError(f"--engine ray needs Ray Data, which is not installed: {RAY_EXTRA_HINT} "
                               "(or use the default --engine local)") from None
    return ray


def part_name(start: int) -> str:
    """The part holding source rows from ``start``: named by its rows, so every attempt at it writes the same name."""
    return f"{PART_PREFIX}{start:012d}"


def plan_ranges(rows: int, rows_per_part: int) -> list[tuple[int, int]]:
    return [(a, min(a + rows_per_part, rows)) for a in range(0, rows, rows_per_part)]


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` whole to a temporary name, then rename it: a reader sees no file or the complete one."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def part_committed(out: Path, name: str, plan_id: str) -> bool:
    """True when ``out/name`` is a committed part of this plan (its manifest says so)."""
    from pf_trl.data.shards import MANIFEST_FILE

    path = out / name / MANIFEST_FILE
    if not path.is_file():
        return False
    try:
        return (json.loads(path.read_text(encoding="utf-8")).get("part") or {}).get("plan") == plan_id
    except (OSError, ValueError):
        return False


def write_part(ds, start: int, stop: int, *, out: Path, tokenizer, input_format: str, config: PretokenizeConfig,
               source_record: dict[str, Any], plan_id: str) -> dict[str, Any]:
    """Tokenize source rows ``[start, stop)`` of ``ds`` into the committed part ``out/part-<start>``.

    The part is written into a temporary sibling (its manifest last) and renamed into place; when the part is there
    already (another attempt finished first) this attempt's copy is discarded. Returns ``{"name", "error"}``; a
    refusal of the rows (a bad row, the ``refuse`` policy) is returned as ``error``, not raised, so that Ray does not
    retry what would fail again.
    """
    import datasets

    from pf_trl.data.formats import FormatError
    from pf_trl.data.pretokenize import _ChunkJob, summarize_tokenized
    from pf_trl.data.shards import FORMAT_VERSION, length_stats, write_manifest
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    name = part_name(start)
    if part_committed(out, name, plan_id):
        return {"name": name, "error": ""}
    tmp = out / f".{name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        try:
            _, _, path, _ = _ChunkJob(ds, tokenizer, input_format, config, tmp)((start, stop))
            full = datasets.Dataset.from_file(path)
            tokenized = summarize_tokenized(full, config, stop - start, index_offset=start)
        except (FormatError, PretokenizeError, ValueError) as exc:  # ValueError: what the tokenizer raises on a row
            return {"name": name, "error": str(exc)}
        shards = tmp / "shards"
        tokenized.kept.save_to_disk(str(shards), max_shard_size=config.shard_size)
        write_manifest(shards, {
            "format_version": FORMAT_VERSION,
            "source": {**source_record, "rows": stop - start},
            "part": {"plan": plan_id, "source_rows": [start, stop]},
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "options": config.to_dict(),
            "max_seq_len": config.max_seq_len,
            "truncation": config.truncation,
            "counts": tokenized.counts,
            "lengths": length_stats(tokenized.lengths, config.max_seq_len),
            "columns": {"input_ids": "list<int32>", "labels": "list<int32>", "length": "int32"},
        })
        try:
            os.rename(shards, out / name)  # atomic: the part appears whole, or not at all
        except OSError:
            if not part_committed(out, name, plan_id):
                raise
            # another attempt at the same rows committed it first: the part is written once
        return {"name": name, "error": ""}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class PartWriter:
    """The Ray Data worker: loads the tokenizer and opens the source once, then writes the parts it is handed."""

    def __init__(self, *, source, cache_dir: str, out: str, tokenizer, input_format: str, config: PretokenizeConfig,
                 source_record: dict[str, Any], plan_id: str) -> None:
        from pf_trl.data.pretokenize import load_source
        from pf_trl.data.remote import local_path

        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        # a bucket URI: this node's cache copy; the driver's datasets cache (DEST/.work): memory-mapped, not re-parsed
        self.ds = load_source(local_path(source), Path(cache_dir))
        self.kwargs = {"out": Path(out), "tokenizer": tokenizer, "input_format": input_format, "config": config,
                       "source_record": source_record, "plan_id": plan_id}

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        import datasets

        datasets.disable_progress_bars()
        results = [write_part(self.ds, int(a), int(b), **self.kwargs) for a, b in zip(batch["start"], batch["stop"])]
        return {"name": [r["name"] for r in results], "error": [r["error"] for r in results]}


def _connect(ray, num_workers: int | None) -> None:
    """Join ``RAY_ADDRESS``'s cluster, or the Ray already initialised in this process, or start a local one."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_workers, include_dashboard=False, log_to_driver=False)


def _check_plan(out: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan of this run: a new one, or the interrupted run's when it is the same source and flags."""
    from pf_trl.data.shards import MANIFEST_FILE

    path = out / PLAN_FILE
    if (out / MANIFEST_FILE).is_file():
        raise PretokenizeError(f"output {out} already exists; choose a new directory or pass overwrite=True "
                               "(--overwrite)")
    if path.is_file():
        existing = json.loads(path.read_text(encoding="utf-8"))
        if {k: v for k, v in existing.items() if k != "rows_per_part"} != \
                {k: v for k, v in plan.items() if k != "rows_per_part"}:
            raise PretokenizeError(f"{out} holds an interrupted run of another source, tokenizer or flags; pass "
                                   "--overwrite to start over, or choose a new directory")
        return existing  # resumed: its ranges, whatever rows_per_part this run asked for
    if out.exists() and any(p.name != WORK_DIR for p in out.iterdir()):
        raise PretokenizeError(f"output {out} already exists and is not a pf-trl run; choose a new directory or "
                               "pass overwrite=True (--overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, plan)
    return plan


def _open_and_plan(source, out: Path, work: Path, config: PretokenizeConfig, tokenizer, rows_per_part: int | None,
                   source_fingerprint_value: str | None):
    """The source opened as the single-process engine opens it, its format, checksum, the tokenizer's fingerprint, and
    the run's plan (an interrupted run's when it matches)."""
    import datasets

    from pf_trl.data.pretokenize import load_source, resolve_format, source_fingerprint
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # Ray Data reports the progress
    try:
        ds = load_source(source, work)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    input_format = resolve_format(ds, config)
    if input_format == "vision":
        raise PretokenizeError("--engine ray tokenizes text rows; this source has images: use --engine local")
    source_sha = source_fingerprint_value or source_fingerprint(source)
    fingerprint = tokenizer_fingerprint(tokenizer)
    plan = _check_plan(out, {"source_sha256": source_sha, "rows": ds.num_rows, "input_format": input_format,
                             "tokenizer_sha256": fingerprint.get("sha256"), "options": config.to_dict(),
                             "rows_per_part": rows_per_part})  # an interrupted run's plan, or this run's
    return ds, input_format, source_sha, fingerprint, plan


def pretokenize_ray(source: Any, output_dir: str | Path, config: PretokenizeConfig | None = None, *,
                    tokenizer: Any, overwrite: bool = False, num_workers: int | None = None,
                    rows_per_part: int | None = None, source_fingerprint_value: str | None = None) -> dict[str, Any]:
    """Tokenize ``source`` on a Ray cluster into the multi-part dataset ``output_dir``; returns its manifest.

    Args:
        source: what :func:`pf_trl.pretokenize` takes except images; a path must be readable from every Ray node
            (a shared volume), as must ``output_dir``.
        output_dir: the dataset directory (a local or shared folder). An interrupted run there resumes.
        num_workers: Ray workers (each one CPU); default: every CPU of the cluster.
        rows_per_part: source rows per part (default ~4 parts per worker, 1,000 to 100,000 rows each).

    Raises:
        PretokenizeError: Ray not installed, a bucket destination, images, or what the single-process engine
            refuses (the first part's refusal, naming the source row).
    """
    from pf_trl._version import __version__
    from pf_trl.data import formats
    from pf_trl.data.parts import write_parts_manifest
    from pf_trl.data.pretokenize import (
        CHAT_FORMATS,
        _hub_record,
        describe_source,
    )
    from pf_trl.data.remote import local_path
    from pf_trl.data.tokenizer import load_tokenizer, with_chat_template
    from pf_trl.storage import is_remote

    ray = import_ray()
    if is_remote(output_dir):
        raise PretokenizeError(f"--engine ray writes its parts to a folder every Ray node sees, not a bucket "
                               f"({output_dir}); write to a shared volume, or use --engine local for a bucket")
    if num_workers is not None and num_workers < 1:
        raise PretokenizeError(f"num_workers must be >= 1, got {num_workers}")
    if rows_per_part is not None and rows_per_part < 1:
        raise PretokenizeError(f"rows_per_part must be >= 1, got {rows_per_part}")
    config = config or PretokenizeConfig()
    given_source, source = source, local_path(source)  # the workers resolve a bucket URI on their own nodes
    out = Path(output_dir).absolute()
    if overwrite and out.exists():
        shutil.rmtree(out)  # not atomic with this engine: the old dataset is gone before the new one is whole
    if (out / "pf_manifest.json").is_file():
        raise PretokenizeError(f"output {out} already exists; choose a new directory or pass overwrite=True "
                               "(--overwrite)")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))
    tokenizer = with_chat_template(tokenizer, config.chat_template)
    started = time.time()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    work = out / WORK_DIR
    try:
        ds, input_format, source_sha, fingerprint, plan = _open_and_plan(
            source, out, work, config, tokenizer, rows_per_part, source_fingerprint_value)
    except BaseException:
        if created and not (out / PLAN_FILE).exists():  # refused before any plan: leave nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    rows = ds.num_rows
    _connect(ray, num_workers)
    workers = num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    if plan["rows_per_part"] is None:  # a new run without --rows_per_part: ~4 parts per worker
        plan["rows_per_part"] = max(1000, min(100_000, -(-rows // (4 * workers))))
        write_json_atomic(out / PLAN_FILE, plan)
    plan_id = f"{source_sha[:16]}-{plan['rows_per_part']}"
    ranges = plan_ranges(rows, plan["rows_per_part"])
    pending = [(a, b) for a, b in ranges if not part_committed(out, part_name(a), plan_id)]
    source_record = {"path": describe_source(source), "sha256": source_sha, "input_format": input_format}
    errors: dict[str, str] = {}
    if pending:
        import ray.data

        items = ray.data.from_items([{"start": a, "stop": b} for a, b in pending], override_num_blocks=len(pending))
        results = items.map_batches(
            PartWriter, batch_size=1, compute=ray.data.ActorPoolStrategy(size=min(workers, len(pending))), num_cpus=1,
            fn_constructor_kwargs={"source": given_source, "cache_dir": str(work), "out": str(out),
                                   "tokenizer": tokenizer, "input_format": input_format, "config": config,
                                   "source_record": source_record, "plan_id": plan_id},
        ).take_all()
        errors = {r["name"]: r["error"] for r in results if r["error"]}
    if errors:
        first = min(errors)  # the refusal of the earliest rows, as the single-process engine reports the first row
        raise PretokenizeError(errors[first])
    names = [part_name(a) for a, _ in ranges]
    missing = [n for n in names if not part_committed(out, n, plan_id)]
    if missing:
        raise PretokenizeError(f"{len(missing)} part(s) were not written ({missing[0]}, ...): run the same command "
                               "again to resume")
    for stale in out.glob(f".{PART_PREFIX}*.tmp-*"):  # attempts of workers that died mid-part
        shutil.rmtree(stale, ignore_errors=True)
    examples = sum(json.loads((out / n / "pf_manifest.json").read_text(encoding="utf-8"))["counts"]["examples"]
                   for n in names)
    if examples == 0:
        raise PretokenizeError("no example left after tokenization; check max_seq_len and the loss masking options")
    manifest = write_parts_manifest(out, names, {
        "pf_trl_version": __version__,
        "created_unix": round(started, 3),
        "tokenize_seconds": round(time.time() - started, 3),
        "engine": {"name": "ray", "workers": workers, "rows_per_part": plan["rows_per_part"]},
        "source": {
            "path": describe_source(source),
            "hub": _hub_record(source),
            "sha256": source_sha,
            "rows": rows,
            "input_format": input_format,
            "chat_mask": formats.chat_mask_method(tokenizer) if input_format in CHAT_FORMATS else None,
            "mask_columns": [c for c in formats.MASK_COLUMNS if c in ds.column_names]
            if input_format == "pretokenized" else [],
        },
        "tokenizer": fingerprint,
        "options": config.to_dict(),
    })
    (out / PLAN_FILE).unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    logger.info("pretokenize (ray, %d workers): %d examples in %d parts -> %s", workers,
                manifest["counts"]["examples"], len(names), out)
    return manifest
