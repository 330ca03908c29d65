"""Worker process: claims queued jobs from the job store and runs :func:`pf_trl.data.pretokenize.pretokenize`.

Started by the supervisor as ``python -m preprocess_service.worker``; its settings (with the database
URL, a secret) arrive as JSON on stdin, never in argv or the environment. A watchdog thread exits the
process when the API process that started it is gone (its parent pid changes), so a ``kill -9`` of the
server leaves no worker behind; a heartbeat in the job row lets a restarted server (or another replica)
detect orphans. A job cancelled or deleted elsewhere (another replica) is noticed by the heartbeat or
the next progress report, and abandoned.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError
from preprocess_service.settings import Settings
from preprocess_service.store import JobStore, open_store, setup_event_log

logger = logging.getLogger("preprocess_service.worker")

_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class JobAbandoned(PfTrlError):
    """The job is no longer ours (cancelled, deleted or re-queued elsewhere): stop, publish nothing."""


class JobError(PfTrlError):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def crash_point(settings: Settings, step: str) -> None:
    """TEST-ONLY (``PF_SERVICE_DEBUG_CRASH_AT``): die here as ``kill -9`` would, to test that state and disk agree
    after a crash at any step of a job (claimed, written, renamed, committed)."""
    if settings.debug_crash_at == step:
        logger.warning("debug_crash_at=%s: killing this worker (test hook)", step)
        os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(api_pid: int) -> None:
    while True:
        if os.getppid() != api_pid:
            os._exit(3)  # the API process died: leave nothing running behind it
        time.sleep(0.25)


class _TokenizerCache:
    """Loaded tokenizers by name, reloaded when their files change (fingerprint check per job)."""

    def __init__(self):
        self._cache: dict[str, Any] = {}

    def get(self, name: str):
        from pf_trl.data.tokenizer import load_tokenizer

        tok = self._cache.get(name)
        if tok is None:
            tok = load_tokenizer(name)
            self._cache[name] = tok
        return tok

    def drop(self, name: str) -> None:
        self._cache.pop(name, None)


def run_job(settings: Settings, store: JobStore, job: dict[str, Any], tokenizers: _TokenizerCache, pid: int,
            abandon: threading.Event | None = None) -> str:
    """Run one claimed job to succeeded/failed; returns the final state. Never raises for job errors.
    ``abandon`` (set by the heartbeat when the job is no longer ours) stops it at the next progress report."""
    from pf_trl.data.options import for_service
    from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize
    from preprocess_service.submit import content_sha256
    from pf_trl.data.shards import ShardsError, is_shards_dir, read_manifest, verify_shards
    from pf_trl.data.tokenizer import TokenizerLoadError, tokenizer_fingerprint

    job_id = job["id"]
    request = json.loads(job["request"])
    work = settings.scratch_dir / f"w{pid}" / job_id
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    target = settings.datasets_dir / job_id
    delay = settings.debug_progress_delay_s
    try:
        if request.get("kind") == "mixture":  # several sources as one dataset (preprocess_service.mixtures)
            from preprocess_service.mixtures import build_mixture, publish_to

            manifest = build_mixture(settings, store, job_id, pid, request, tokenizers, work, abandon)
            if not store.finish_success(job_id, pid, manifest, lambda: publish_to(work, target)):
                return "discarded"
            return "succeeded"
        source = Path(request["source_path"])
        if not source.exists():
            raise JobError("invalid_data", f"source {source} disappeared after the request was accepted; POST again")
        size = request["source_size"]
        free = shutil.disk_usage(settings.cache_dir).free
        need = max(settings.min_free_bytes, 2 * size)
        if free < need:
            raise JobError("disk_full", f"disk full: {free} bytes free in {settings.cache_dir}, this job needs about "
                           f"{need} (2x the source, at least min_free_bytes); free space or DELETE old datasets, then POST again")
        if content_sha256(source) != request["source_sha256"]:
            raise JobError("invalid_data", f"source {source} changed after the request was accepted (its sha256 "
                           "differs), so it no longer matches this dataset id; POST again to get the new id")
        tok = tokenizers.get(request["tokenizer"])
        if tokenizer_fingerprint(tok)["sha256"] != request["tokenizer_sha256"]:
            tokenizers.drop(request["tokenizer"])
            tok = tokenizers.get(request["tokenizer"])
            if tokenizer_fingerprint(tok)["sha256"] != request["tokenizer_sha256"]:
                raise JobError("invalid_data", f"tokenizer {request['tokenizer']} changed after the request was "
                               "accepted; POST again to get the new dataset id")
        config = PretokenizeConfig(**request["options"])

        def on_progress(rows_done: int, rows_total: int, tokens_done: int) -> None:
            if not store.progress(job_id, pid, rows_done, rows_total, tokens_done) or (abandon and abandon.is_set()):
                raise JobAbandoned(job_id)
            if delay > 0:  # TEST-ONLY hook (PF_SERVICE_DEBUG_PROGRESS_DELAY_S); 0 in production
                time.sleep(delay)

        manifest = pretokenize(source, work / "out", config, tokenizer=tok, num_proc=settings.num_proc,
                               progress=False, progress_callback=on_progress,
                               source_fingerprint_value=request["source_sha256"], limits=settings.limits(),
                               image_roots=(str(source.parent), *map(str, settings.data_roots)))
        crash_point(settings, "written")

        def publish() -> dict[str, Any] | None:
            try:
                os.rename(work / "out", target)
            except OSError:
                if not is_shards_dir(target):
                    raise
                # The same dataset was published already (a crash after its rename, another replica): keep it,
                # and its manifest, if its files are intact; else replace it.
                try:
                    verify_shards(target)
                    return read_manifest(target)
                except ShardsError:
                    trash = work / "replaced"
                    os.rename(target, trash)
                    os.rename(work / "out", target)
            crash_point(settings, "renamed")
            return None

        if not store.finish_success(job_id, pid, manifest, publish):
            logger.info("job %s is no longer ours (cancelled, deleted or re-queued); output discarded", job_id)
            return "discarded"
        crash_point(settings, "committed")
        return "succeeded"
    except JobAbandoned:
        logger.info("job %s is no longer ours (cancelled, deleted or re-queued); stopped", job_id)
        return "discarded"
    except JobError as exc:
        kind, message = exc.kind, str(exc)
    except (PretokenizeError, TokenizerLoadError, ShardsError) as exc:
        kind, message = "invalid_data", for_service(str(exc))  # the request's field names, not the CLI's flags
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            kind, message = "disk_full", (f"disk full while writing shards under {settings.cache_dir} ({exc.strerror}); "
                                          "free space or DELETE old datasets, then POST again")
        else:
            kind, message = "io_error", f"I/O error: {exc}"
    except Exception as exc:  # a job must end failed with a reason, whatever happened
        logger.exception("job %s crashed", job_id)
        kind, message = "internal", f"internal error {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    store.finish_failure(job_id, pid, kind, message)
    return "failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preprocess_service.worker")
    parser.add_argument("--api-pid", type=int, required=True)
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    # Settings arrive as JSON on stdin (a pipe from the supervisor): secrets never show in argv or environ.
    settings = Settings.from_json(json.loads(sys.stdin.read()))
    sys.stdin.close()
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s worker{args.index} %(levelname)s %(message)s")
    setup_event_log(settings.log_level)
    threading.Thread(target=_watch_parent, args=(args.api_pid,), daemon=True).start()
    pid = os.getpid()
    store = open_store(settings)
    store.register_worker(pid, args.index)
    current: dict[str, Any] = {"job": None, "abandon": threading.Event()}

    def beat() -> None:
        while True:
            job_id, abandon = current["job"], current["abandon"]
            try:  # the store keeps one connection per thread: this thread has its own
                if not store.heartbeat(job_id, pid) and job_id == current["job"]:
                    abandon.set()
            except Exception:  # a busy database must not kill the heartbeat
                pass
            time.sleep(1.0)

    threading.Thread(target=beat, daemon=True).start()
    tokenizers = _TokenizerCache()
    try:  # warm up: the imports and the default tokenizer cost seconds, once per worker
        import datasets  # noqa: F401

        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER
        tokenizers.get(DEFAULT_TOKENIZER)
    except Exception:  # a job that needs it will fail with the reason
        logger.exception("warm-up failed")
    store.worker_ready(pid)
    while True:
        job = store.claim(pid)
        if job is None:
            time.sleep(0.05)  # an indexed SELECT on an idle queue: cheap, and a new job starts within 50 ms
            continue
        current["abandon"] = threading.Event()
        current["job"] = job["id"]
        crash_point(settings, "claimed")
        started = time.time()
        state = run_job(settings, store, job, tokenizers, pid, current["abandon"])
        current["job"] = None
        logger.info("job %s %s in %.2fs", job["id"], state, time.time() - started)


if __name__ == "__main__":
    sys.exit(main())
