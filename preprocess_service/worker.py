"""Worker process: claims queued jobs from the job store and runs :func:`pf_trl.data.pretokenize.pretokenize`.

Started by the supervisor as ``python -m preprocess_service.worker`` would be, forked from the service's template
process (:mod:`preprocess_service.forks`); its settings (with the database URL, a secret) arrive as JSON on stdin,
never in argv or the environment. A watchdog thread exits the process when its parent is gone (the template leaves
with the API process), so a ``kill -9`` of the server leaves no worker behind; a heartbeat in the job row lets a
restarted server (or another replica) detect orphans. A job cancelled or deleted elsewhere (another replica) is
noticed by the heartbeat or the next progress report, and abandoned.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pf_trl.data.tokenizer import TokenizerCache
from preprocess_service.build import (
    JobAbandoned,
    JobError,
    crash_point,
    ensure_free_space,
    ensure_source_unchanged,
    progress_reporter,
    publisher,
    tokenize_files,
    tokenizer_for,
)
from preprocess_service.hub_fetch import fetch_hub_sources
from preprocess_service.mixtures import build_mixture
from preprocess_service.settings import Settings
from preprocess_service.store import JobStore, open_store, setup_event_log

logger = logging.getLogger("preprocess_service.worker")

_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # the service (or its template process) died: leave nothing running behind it
        time.sleep(0.25)


def run_job(settings: Settings, store: JobStore, job: dict[str, Any], tokenizers: TokenizerCache, pid: int,
            abandon: threading.Event | None = None) -> str:
    """Run one claimed job to succeeded/failed; returns the final state. Never raises for job errors.
    ``abandon`` (set by the heartbeat when the job is no longer ours) stops it at the next progress report."""
    from pf_trl.data.options import for_service
    from pf_trl.data.pretokenize import PretokenizeError
    from pf_trl.data.shards import ShardsError
    from pf_trl.data.tokenizer import TokenizerLoadError

    job_id = job["id"]
    request = json.loads(job["request"])
    work = settings.scratch_dir / f"w{pid}" / job_id
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        from pf_trl.hub import one_commit_per_repository

        build = build_mixture if request.get("kind") == "mixture" else build_dataset
        with one_commit_per_repository():  # a job reads each Hub repository at one commit
            manifest = build(settings, store, job_id, pid, request, tokenizers, work, abandon)
        crash_point(settings, "written")
        if not store.finish_success(job_id, pid, manifest, publisher(settings, work / "out",
                                                                     settings.datasets_dir / job_id, work)):
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


def build_dataset(settings: Settings, store: JobStore, job_id: str, pid: int, request: dict[str, Any],
                  tokenizers: TokenizerCache, work: Path, abandon: threading.Event | None) -> dict[str, Any]:
    """Tokenize the job's one source into ``work/out`` (a Hub split of several files: :func:`tokenize_files`);
    returns its manifest."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    fetch = request.get("hub_fetch")
    if fetch is not None:  # a Hub source: downloaded here, within hub_max_download_bytes (the commit fixes its bytes)
        ensure_free_space(settings, request["source_size"])
        files = fetch_hub_sources(settings, store, job_id, pid, [fetch], abandon)[0]
        if len(files) > 1:  # a split of several files: concatenated as `pf-trl pretokenize ORG/NAME` does
            tok = tokenizer_for(tokenizers, request)
            shown = request["source_shown"]
            return tokenize_files(settings, files, work / "out", PretokenizeConfig(**request["options"]), tok,
                                  name=fetch["name"], shown=shown["files"], path=shown["path"],
                                  report=lambda base: progress_reporter(store, job_id, pid, abandon, base=base, total=0,
                                                                        delay_s=settings.debug_progress_delay_s))
        source = files[0]
        fingerprint = None  # the bytes' own hash, computed by pretokenize for the manifest
    else:
        source = Path(request["source_path"])
        if not source.exists():
            raise JobError("invalid_data", f"source {source} disappeared after the request was accepted; POST again")
        ensure_free_space(settings, request["source_size"])
        ensure_source_unchanged(source, request["source_sha256"], request.get("source_stat"), f"source {source}")
        fingerprint = request["source_sha256"]
    tok = tokenizer_for(tokenizers, request)
    on_progress = progress_reporter(store, job_id, pid, abandon, delay_s=settings.debug_progress_delay_s)
    return pretokenize(source, work / "out", PretokenizeConfig(**request["options"]), tokenizer=tok,
                       num_proc=settings.num_proc, progress=False, progress_callback=on_progress,
                       source_fingerprint_value=fingerprint, limits=settings.limits(),
                       image_roots=(str(source.parent), *map(str, settings.data_roots)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preprocess_service.worker")
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    # Settings arrive as JSON on stdin (a pipe from the supervisor): secrets never show in argv or environ.
    settings = Settings.from_json(json.loads(sys.stdin.read()))
    sys.stdin.close()
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s worker{args.index} %(levelname)s %(message)s")
    setup_event_log(settings.log_level)
    # its parent: the service's template process (preprocess_service.forks), which leaves with the service
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
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
    tokenizers = TokenizerCache()
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
