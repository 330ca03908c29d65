"""``pretokenize(..., engine="ray")``: the same tokenization as the single-process engine, run as Ray Data tasks,
written as a dataset of many parts (:mod:`pf_trl.data.parts`).

How a run goes:

1. The driver opens the source with the single-process engine's reader (:func:`pf_trl.data.pretokenize.load_source`:
   the same parser, schema and row order), its datasets cache inside a folder DEST (``DEST/.work``; a bucket DEST:
   the node's staging), resolves the input format and cuts the rows into fixed ranges (``rows_per_part``). The plan
   (``pf_plan.json``: ranges, source checksum, tokenizer, options) is written whole, never visible half-written.
2. One Ray Data task per range not yet committed: ``map_batches`` with a callable class, so each worker loads the
   tokenizer and memory-maps the source once, then tokenizes its ranges with the single-process engine's code
   (:class:`pf_trl.data.pretokenize._ChunkJob`, :func:`~pf_trl.data.pretokenize.summarize_tokenized`), writes the
   part into a local folder of this attempt, its manifest last, and commits it
   (:mod:`pf_trl.data.ray_destinations`: renamed to ``part-<first source row, 12 digits>`` in a folder, or uploaded
   into an attempt folder of a bucket, its manifest last). A part is known by its rows, so a retried task (its
   worker died) adds no second copy: the first committed attempt is the part.
3. The dataset's manifest, written last, lists the parts in source order: the rows are those the single-process
   engine writes, in the same order, with the same identity (tokenizer, input format, source checksum).

A run interrupted (driver or cluster gone) and started again with the same source and flags resumes: committed
parts are kept, the others tokenized. The cluster is ``RAY_ADDRESS`` when set, else an already initialised Ray,
else a local one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pf_trl.data.options import PretokenizeConfig, PretokenizeError
from pf_trl.data.ray_destinations import (
    PART_PREFIX,
    PLAN_FILE,
    WORK_DIR,
    BucketParts,
    FolderParts,
    destination,
    part_name,
)

logger = logging.getLogger(__name__)

__all__ = ["PART_PREFIX", "PLAN_FILE", "RAY_EXTRA_HINT", "WORK_DIR", "import_ray", "part_name", "pretokenize_ray"]

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


def plan_ranges(rows: int, rows_per_part: int) -> list[tuple[int, int]]:
    return [(a, min(a + rows_per_part, rows)) for a in range(0, rows, rows_per_part)]


def write_part(ds, start: int, stop: int, *, dest: FolderParts | BucketParts, tokenizer, input_format: str,
               config: PretokenizeConfig, source_record: dict[str, Any], plan_id: str) -> dict[str, Any]:
    """Tokenize source rows ``[start, stop)`` of ``ds`` into a committed part of ``dest``.

    The part is written into a fresh local folder of this attempt (its manifest last), then committed by ``dest``
    (renamed into place, or uploaded with its manifest last); when the part is committed already (another attempt
    finished first) nothing is written. Returns ``{"name", "error"}``; a refusal of the rows (a bad row, the
    ``refuse`` policy) is returned as ``error``, not raised, so that Ray does not retry what would fail again.
    """
    import shutil

    import datasets

    from pf_trl.data.formats import FormatError
    from pf_trl.data.pretokenize import _ChunkJob, summarize_tokenized
    from pf_trl.data.shards import FORMAT_VERSION, length_stats, write_manifest
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    done = dest.committed(start, plan_id)
    if done:
        return {"name": done, "error": ""}
    tmp = dest.attempt_dir(start)
    try:
        try:
            _, _, path, _ = _ChunkJob(ds, tokenizer, input_format, config, tmp)((start, stop))
            full = datasets.Dataset.from_file(path)
            tokenized = summarize_tokenized(full, config, stop - start, index_offset=start)
        except (FormatError, PretokenizeError, ValueError) as exc:  # ValueError: what the tokenizer raises on a row
            return {"name": part_name(start), "error": str(exc)}
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
        return {"name": dest.commit(shards, start, plan_id), "error": ""}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class PartWriter:
    """The Ray Data worker: loads the tokenizer and opens the source once, then writes the parts it is handed."""

    def __init__(self, *, source, dest: FolderParts | BucketParts, tokenizer, input_format: str,
                 config: PretokenizeConfig, source_record: dict[str, Any], plan_id: str) -> None:
        from pf_trl.data.pretokenize import load_source
        from pf_trl.data.remote import local_path

        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        # a bucket URI: this node's cache copy; the datasets cache of the source (a shared DEST's .work, or this
        # node's staging): memory-mapped, not re-parsed
        self.ds = load_source(local_path(source), dest.work_dir())
        self.kwargs = {"dest": dest, "tokenizer": tokenizer, "input_format": input_format, "config": config,
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


@contextmanager
def _ray_data_progress(on: bool) -> Iterator[None]:
    """Ray Data's progress bars and its "Starting execution" / "Execution plan" lines, off while this run executes
    when ``on`` is False (this process's DataContext and ``ray.data`` logger, restored after)."""
    if on:
        yield
        return
    import ray.data

    context = ray.data.DataContext.get_current()
    fields = ("enable_progress_bars", "enable_operator_progress_bars", "print_on_execution_start")
    saved = {name: getattr(context, name) for name in fields}
    # its console only: Ray Data's log file in the session folder keeps every line for debugging
    consoles = [h for h in logging.getLogger("ray.data").handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    levels = [h.level for h in consoles]
    for name in fields:
        setattr(context, name, False)
    for handler in consoles:
        handler.setLevel(max(handler.level, logging.WARNING))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(context, name, value)
        for handler, level in zip(consoles, levels):
            handler.setLevel(level)


def _open_and_plan(source, dest: FolderParts | BucketParts, config: PretokenizeConfig, tokenizer,
                   rows_per_part: int | None, source_fingerprint_value: str | None):
    """The source opened as the single-process engine opens it, its format, checksum, the tokenizer's fingerprint, and
    the run's plan (an interrupted run's when it matches)."""
    import datasets

    from pf_trl.data.pretokenize import load_source, resolve_format, source_fingerprint
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # Ray Data reports the progress
    try:
        ds = load_source(source, dest.work_dir())
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    input_format = resolve_format(ds, config)
    if input_format == "vision":
        raise PretokenizeError("--engine ray tokenizes text rows; this source has images: use --engine local")
    source_sha = source_fingerprint_value or source_fingerprint(source)
    fingerprint = tokenizer_fingerprint(tokenizer)
    plan = dest.open_plan({"source_sha256": source_sha, "rows": ds.num_rows, "input_format": input_format,
                           "tokenizer_sha256": fingerprint.get("sha256"), "options": config.to_dict(),
                           "rows_per_part": rows_per_part})  # an interrupted run's plan, or this run's
    return ds, input_format, source_sha, fingerprint, plan


def pretokenize_ray(source: Any, output_dir: str | Path, config: PretokenizeConfig | None = None, *,
                    tokenizer: Any, overwrite: bool = False, num_workers: int | None = None,
                    rows_per_part: int | None = None, source_fingerprint_value: str | None = None,
                    progress: bool = True) -> dict[str, Any]:
    """Tokenize ``source`` on a Ray cluster into the multi-part dataset ``output_dir``; returns its manifest.

    Args:
        source: what :func:`pf_trl.pretokenize` takes except images; a path must be readable from every Ray node
            (a shared volume), a bucket URI is fetched by each node.
        output_dir: the dataset: a folder every Ray node sees, or a bucket prefix (``s3://BUCKET/datasets/NAME``,
            parts uploaded by the workers, :class:`~pf_trl.data.ray_destinations.BucketParts`). An interrupted run
            there resumes.
        num_workers: Ray workers (each one CPU); default: every CPU of the cluster.
        rows_per_part: source rows per part (default ~4 parts per worker, 1,000 to 100,000 rows each).
        progress: Ray Data's progress bars and its execution lines at INFO (False: only its warnings and errors,
            as ``pf-trl pretokenize --no_progress``).

    Raises:
        PretokenizeError: Ray not installed, images, or what the single-process engine refuses (the first part's
            refusal, naming the source row).
        StorageError: a bucket that cannot be reached or written, or holds a dataset (without ``overwrite``).
    """
    from pf_trl._version import __version__
    from pf_trl.data import formats
    from pf_trl.data.pretokenize import (
        CHAT_FORMATS,
        _hub_record,
        describe_source,
    )
    from pf_trl.data.remote import local_path
    from pf_trl.data.tokenizer import load_tokenizer, with_chat_template

    ray = import_ray()
    if num_workers is not None and num_workers < 1:
        raise PretokenizeError(f"num_workers must be >= 1, got {num_workers}")
    if rows_per_part is not None and rows_per_part < 1:
        raise PretokenizeError(f"rows_per_part must be >= 1, got {rows_per_part}")
    config = config or PretokenizeConfig()
    given_source, source = source, local_path(source)  # the workers resolve a bucket URI on their own nodes
    dest = destination(output_dir)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))
    tokenizer = with_chat_template(tokenizer, config.chat_template)
    started = time.time()
    created = dest.prepare(overwrite)
    try:
        ds, input_format, source_sha, fingerprint, plan = _open_and_plan(
            source, dest, config, tokenizer, rows_per_part, source_fingerprint_value)
    except BaseException:
        dest.abandon(created)
        raise
    rows = ds.num_rows
    _connect(ray, num_workers)
    workers = num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    if plan["rows_per_part"] is None:  # a new run without --rows_per_part: ~4 parts per worker
        plan["rows_per_part"] = max(1000, min(100_000, -(-rows // (4 * workers))))
        dest.save_plan(plan)
    plan_id = f"{source_sha[:16]}-{plan['rows_per_part']}"
    ranges = plan_ranges(rows, plan["rows_per_part"])
    committed = dest.committed_parts(plan_id)
    pending = [(a, b) for a, b in ranges if a not in committed]
    source_record = {"path": describe_source(source), "sha256": source_sha, "input_format": input_format}
    errors: dict[str, str] = {}
    if pending:
        import contextlib
        import sys

        import ray.data

        items = ray.data.from_items([{"start": a, "stop": b} for a, b in pending], override_num_blocks=len(pending))
        # Ray prints the cluster's error messages (a worker that died: the faults this engine rides out) on the
        # driver's stdout; they go to stderr, so that stdout holds only what pf-trl prints (the CLI's JSON summary)
        with contextlib.redirect_stdout(sys.stderr), _ray_data_progress(progress):
            results = items.map_batches(
                PartWriter, batch_size=1, compute=ray.data.ActorPoolStrategy(size=min(workers, len(pending))),
                num_cpus=1, fn_constructor_kwargs={"source": given_source, "dest": dest, "tokenizer": tokenizer,
                                                   "input_format": input_format, "config": config,
                                                   "source_record": source_record, "plan_id": plan_id},
            ).take_all()
        errors = {r["name"]: r["error"] for r in results if r["error"]}
    if errors:
        first = min(errors)  # the refusal of the earliest rows, as the single-process engine reports the first row
        raise PretokenizeError(errors[first])
    committed = dest.committed_parts(plan_id)
    missing = [part_name(a) for a, _ in ranges if a not in committed]
    if missing:
        raise PretokenizeError(f"{len(missing)} part(s) were not written ({missing[0]}, ...): run the same command "
                               "again to resume")
    names = [committed[a] for a, _ in ranges]
    manifest = dest.finish(names, {
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
    logger.info("pretokenize (ray, %d workers): %d examples in %d parts -> %s", workers,
                manifest["counts"]["examples"], len(names), dest)
    return manifest
