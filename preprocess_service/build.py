"""What every job build shares, single source or mixture (:mod:`preprocess_service.worker`,
:mod:`preprocess_service.mixtures`): the job's own errors, the test-only crash points, the checks that the
accepted source and tokenizer are still what the request was accepted with, the free-space check, the progress
report that notices an abandoned job, and the publishing rename."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

logger = logging.getLogger("preprocess_service.worker")


class JobAbandoned(PfTrlError):
    """The job is no longer ours (cancelled, deleted or re-queued elsewhere): stop, publish nothing."""


class JobError(PfTrlError):
    """The job fails with ``kind`` (the status's ``error.type``) and the message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def crash_point(settings, step: str) -> None:
    """TEST-ONLY (``PF_SERVICE_DEBUG_CRASH_AT``): die here as ``kill -9`` would, to test that state and disk agree
    after a crash at any step of a job (claimed, written, renamed, committed)."""
    if settings.debug_crash_at == step:
        logger.warning("debug_crash_at=%s: killing this worker (test hook)", step)
        os.kill(os.getpid(), signal.SIGKILL)


def ensure_free_space(settings, source_bytes: int) -> None:
    """Fail early (``disk_full``) when the cache dir has less than about twice the sources free."""
    free = shutil.disk_usage(settings.cache_dir).free
    need = max(settings.min_free_bytes, 2 * source_bytes)
    if free < need:
        raise JobError("disk_full", f"disk full: {free} bytes free in {settings.cache_dir}, this job needs about "
                       f"{need} (2x the source, at least min_free_bytes); free space or DELETE old datasets, "
                       "then POST again")


def ensure_source_unchanged(source: Path, sha256: str, stat: list | None, what: str) -> None:
    """The source still holds the bytes the request was accepted with. Its status when it was hashed (``stat``)
    spares hashing it again; a changed status (or none recorded) means hashing it."""
    from pf_trl.data.integrity import content_stat
    from pf_trl.data.pretokenize import source_fingerprint

    if not source.exists():
        raise JobError("invalid_data", f"{what} disappeared after the request was accepted; POST again")
    if stat is not None and content_stat(source) == stat:
        return
    if source_fingerprint(source) != sha256:
        raise JobError("invalid_data", f"{what} changed after the request was accepted (its sha256 differs), so it "
                       "no longer matches this dataset id; POST again to get the new id")


def tokenizer_for(tokenizers, request: dict[str, Any]):
    """The job's tokenizer from the worker's :class:`pf_trl.data.tokenizer.TokenizerCache`, refused when its
    fingerprint is no longer the one the request was accepted with."""
    name = request["tokenizer"]
    if tokenizers.fingerprint(name)["sha256"] != request["tokenizer_sha256"]:
        raise JobError("invalid_data", f"tokenizer {name} changed after the request was accepted; POST again to get "
                       "the new dataset id")
    return tokenizers.get(name)


def progress_reporter(store, job_id: str, pid: int, abandon: threading.Event | None, *, delay_s: float = 0.0,
                      base: tuple[int, int] = (0, 0), total: int | None = None) -> Callable[[int, int, int], None]:
    """A ``pretokenize`` progress callback: reports to the store, stops the job (:class:`JobAbandoned`) when it is
    no longer ours. ``base``/``total``: rows and tokens of earlier parts, the whole job's rows (a mixture)."""

    def on_progress(rows_done: int, rows_total: int, tokens_done: int) -> None:
        reported_total = rows_total if total is None else (total or None)
        if not store.progress(job_id, pid, base[0] + rows_done, reported_total, base[1] + tokens_done) or (
                abandon and abandon.is_set()):
            raise JobAbandoned(job_id)
        if delay_s > 0:  # TEST-ONLY hook (PF_SERVICE_DEBUG_PROGRESS_DELAY_S); 0 in production
            time.sleep(delay_s)

    return on_progress


def tokenize_files(settings, files: list[Path], out: Path, config, tokenizer, *, name: str, shown: list[str],
                   path: str, report: Callable[[tuple[int, int]], Callable[[int, int, int], None]]) -> dict[str, Any]:
    """A source of several files (a Hub split) into ``out`` as ``pf-trl pretokenize ORG/NAME`` writes it: each file
    tokenized on its own (into ``out``'s sibling ``OUT-files/``), then concatenated in order as the one dataset
    ``name`` of a data config (:func:`pf_trl.data.mixture.write_mixture_shards`): the same rows, and the same
    ``source.sha256`` (the dataset's name, the files' bytes, its options). The manifest names the files by
    ``shown`` (their ``hf://`` URLs) and the whole by ``path``, not the job's scratch folders. ``report(base)``:
    the progress callback of a file, given the rows and tokens of the files before it. Returns the manifest."""
    from pf_trl.data.data_config import DataConfig, MixtureSource
    from pf_trl.data.mixture import load_mixture, write_mixture_shards
    from pf_trl.data.pretokenize import pretokenize

    done_rows = done_tokens = 0
    parts = []
    for i, file in enumerate(files):
        part = out.with_name(f"{out.name}-files") / f"file-{i}"
        manifest = pretokenize(file, part, config, tokenizer=tokenizer, num_proc=settings.num_proc, progress=False,
                               progress_callback=report((done_rows, done_tokens)), limits=settings.limits())
        done_rows += manifest["counts"]["source_rows"]
        done_tokens += manifest["counts"]["tokens"]
        parts.append(str(part))
    data_config = DataConfig(sources=[MixtureSource(name=name, data_paths=parts)], path=path)
    loaded = load_mixture(data_config, tokenizer, config, progress=False)
    record = loaded.pf_manifest["sources"][0]
    record["data_paths"], record["shards"] = list(shown), None
    return write_mixture_shards(loaded, out, shard_size=config.shard_size)


def publisher(settings, built: Path, target: Path, scratch: Path) -> Callable[[], dict[str, Any] | None]:
    """The publish step handed to ``store.finish_success``: rename ``built`` to ``target`` (atomic). The same dataset
    published already (a crash after its rename, another replica) is kept, with its manifest, when its files are
    intact, else replaced."""

    def publish() -> dict[str, Any] | None:
        from pf_trl.data.shards import ShardsError, is_shards_dir, read_manifest, verify_shards

        kept = None
        try:
            os.rename(built, target)
        except OSError:
            if not is_shards_dir(target):
                raise
            try:
                verify_shards(target)
                kept = read_manifest(target)
            except ShardsError:
                os.rename(target, scratch / "replaced")
                os.rename(built, target)
        if settings.publish_uri:
            upload_dataset(settings, target)
        if kept is not None:
            return kept
        crash_point(settings, "renamed")
        return None

    return publish


def upload_dataset(settings, folder: Path) -> str:
    """The published dataset ``folder`` uploaded to ``<publish_uri>/<id>`` (manifest last), unless the bucket already
    holds this very dataset (the same checksums: a retried job, another replica). Returns the URI."""
    from pf_trl.data.remote import publish_shards, read_remote_manifest
    from pf_trl.data.shards import read_manifest
    from pf_trl.storage import StorageError

    uri = settings.reported_shards_path(folder.name)
    try:
        if read_remote_manifest(uri).get("checksums") == read_manifest(folder).get("checksums"):
            return uri
    except StorageError:
        pass  # not there yet (or unreadable: written again below, and a real access problem fails there)
    try:
        publish_shards(folder, uri, overwrite=True)
    except StorageError as exc:
        raise JobError("storage", f"the dataset was built but not uploaded to {uri}: {exc}") from exc
    logger.info("dataset %s uploaded to %s", folder.name, uri)
    return uri
