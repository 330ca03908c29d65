"""The service's life: at start-up the cache-dir lock (SQLite), the store reconciled with the disk, the worker
supervisor, the preflight sandboxes and the upload janitor, all put on ``app.state`` for the routes
(:mod:`preprocess_service.deps`); at shutdown the same stopped in reverse."""

from __future__ import annotations

import fcntl
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pf_trl._version import __version__
from preprocess_service import uploads as upload_store
from preprocess_service.forks import ForkServer
from preprocess_service.integrity import DatasetIntegrity
from preprocess_service.jobs import Supervisor, child_environment
from preprocess_service.preflight import PreflightPool
from preprocess_service.settings import Settings, SettingsError
from preprocess_service.store import log_event, open_store
from preprocess_service.submit import Submitter
from preprocess_service.views import DatasetViews

logger = logging.getLogger("preprocess_service")


def _lock_cache_dir(settings: Settings):
    """The lock file, held exclusively with SQLite (one service per cache dir); PostgreSQL replicas share it."""
    lock = open(settings.lock_path, "a+")
    if not settings.database_url:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock.close()
            raise SettingsError(f"another pf-trl service already runs on cache dir {settings.cache_dir}; "
                                "use one service per cache dir (or PostgreSQL, --database-url, for "
                                "several replicas)") from exc
    return lock


def _start_janitor(settings: Settings, store) -> threading.Event:
    """Uploads unused for upload_ttl_s go away (checked 4 times per TTL, at most each minute); set the event to stop."""
    stop = threading.Event()
    every = max(0.5, min(60.0, settings.upload_ttl_s / 4)) if settings.upload_ttl_s > 0 else 60.0

    def janitor() -> None:
        while not stop.wait(every):
            try:
                for gone in upload_store.expire_uploads(settings.uploads_dir, store, settings.upload_ttl_s):
                    log_event("upload_expired", upload_id=gone, replica=settings.replica_id)
            except Exception:
                logger.exception("upload expiry failed")

    threading.Thread(target=janitor, daemon=True, name="pf-upload-janitor").start()
    return stop


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the service's parts for ``app.state.settings``, stop them when the app stops."""
    settings: Settings = app.state.settings
    settings.make_dirs()
    lock = _lock_cache_dir(settings)
    for leftover in settings.scratch_dir.iterdir():  # temp builds of this replica's last run: never published
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    store = open_store(settings)
    store.clear_workers()
    actions = store.reconcile(datasets_dir=settings.datasets_dir, max_attempts=settings.max_attempts,
                              heartbeat_timeout_s=settings.heartbeat_timeout_s, startup=True)
    for job_id, action in actions:
        logger.warning("job %s was running when the service stopped: %s", job_id, action)
    # Workers and preflight sandboxes are forked from one template process that has imported torch, transformers
    # and datasets once; its environment is theirs (the caches inside cache_dir; no secret).
    child_env = child_environment(settings)
    forks = ForkServer(child_env)
    supervisor = Supervisor(settings, store, forks)
    supervisor.start()
    # Nothing a client names is parsed in this process: the preflight runs in sandboxed processes, warm
    # from the start (imports and the default tokenizer), like the workers.
    preflight = PreflightPool(settings, child_env, forks)
    preflight.start()
    log_event("service_started", **{**settings.describe(), "version": __version__})
    integrity = DatasetIntegrity(settings, store)
    state = app.state
    state.store, state.supervisor, state.preflight, state.integrity = store, supervisor, preflight, integrity
    state.submitter = Submitter(settings, store, preflight, integrity)
    state.views = DatasetViews(settings, store, integrity)
    state.started = time.time()
    stop_janitor = _start_janitor(settings, store)
    try:
        yield
    finally:
        stop_janitor.set()
        preflight.stop()
        supervisor.stop()
        forks.stop()
        log_event("service_stopped", replica=settings.replica_id)
        if not settings.database_url:
            fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
