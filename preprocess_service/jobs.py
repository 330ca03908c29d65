"""The supervisor of worker processes (the job store lives in :mod:`preprocess_service.store`).

Workers are local processes of this replica, forked from its template process (:mod:`preprocess_service.forks`:
the heavy imports are paid once per replica, not per worker). Their settings (which may hold the database URL, a
secret) reach them through a pipe on stdin, never argv or the environment: ``ps`` and
``/proc/*/cmdline`` show no secret. The bearer token is not given to workers at all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time

from preprocess_service.forks import ForkedProcess, ForkServer
from preprocess_service.store import DURATION_BUCKETS, STATES, QueueFull, pid_alive  # noqa: F401 (re-exported)
from preprocess_service.store.base import JobStore as _BaseStore
from preprocess_service.store.sqlite import SqliteJobStore as JobStore  # noqa: F401 (the embedded default)

logger = logging.getLogger("preprocess_service")

SECRET_ENV = ("PF_SERVICE_TOKEN", "PF_SERVICE_DATABASE_URL")
"""Environment variables never passed on to worker processes."""


def child_environment(settings) -> dict[str, str]:
    """The environment of the replica's template process, hence of its workers and preflight sandboxes: this
    process's without the secrets, with every cache inside ``cache_dir`` (``settings.child_env()``)."""
    return {**{k: v for k, v in os.environ.items() if k not in SECRET_ENV}, **settings.child_env()}


class Supervisor:
    """Starts ``settings.workers`` worker processes, restarts the ones that die (failing their job with
    the reason), kills one on request (DELETE of a running job) and detects orphaned jobs."""

    def __init__(self, settings, store: _BaseStore, forks: ForkServer | None = None):
        self.settings, self.store = settings, store
        # the workers are forked from the replica's template process; without one given, the supervisor has its own
        self._own_forks = forks is None
        self.forks = forks if forks is not None else ForkServer(child_environment(settings))
        self.procs: dict[int, ForkedProcess] = {}
        self.index_of: dict[int, int] = {}
        self.cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.deaths: list[float] = []
        self._missing: list[int] = list(range(settings.workers))  # worker indices to (re)start

    def _spawn(self, idx: int) -> None:
        proc = self.forks.spawn("preprocess_service.worker", ["--index", str(idx)], stdin=True, name=f"pf-worker{idx}")
        try:  # the settings (database URL included) go through the pipe; the token stays here
            proc.stdin.write(json.dumps(self.settings.worker_json()).encode())
            proc.stdin.close()
        except OSError:  # the worker died at once; the monitor restarts it
            pass
        self.procs[proc.pid] = proc
        self.index_of[proc.pid] = idx
        logger.info("worker %d started (pid %d)", idx, proc.pid)

    def start(self) -> None:
        """Start the workers and their monitor in the background (the template process imports for seconds)."""
        self._thread = threading.Thread(target=self._monitor, name="pf-supervisor", daemon=True)
        self._thread.start()

    def _respawn_missing(self) -> None:
        """Start the workers not running (at start-up, after a death); one that cannot start is tried again at the
        next check."""
        with self._lock:
            while self._missing and not self._stop.is_set():
                try:
                    self._spawn(self._missing[0])
                except OSError:
                    logger.exception("could not start worker %d; trying again", self._missing[0])
                    return
                self._missing.pop(0)

    def live_pids(self) -> set[int]:
        with self._lock:
            return {pid for pid, p in self.procs.items() if p.poll() is None}

    def kill(self, pid: int | None) -> bool:
        with self._lock:
            proc = self.procs.get(pid) if pid else None
            if proc is None or proc.poll() is not None:
                return False
            self.cancelled.add(pid)
            proc.send_signal(signal.SIGKILL)
            return True

    def _monitor(self) -> None:
        self._respawn_missing()
        while not self._stop.wait(0.5):
            try:
                self._check()
            except Exception:  # the monitor must survive a transient DB error
                logger.exception("supervisor check failed")

    def _check(self) -> None:
        with self._lock:
            dead = [(pid, p) for pid, p in self.procs.items() if p.poll() is not None]
        for pid, proc in dead:
            code = proc.returncode
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            hint = " (SIGKILL: often the out-of-memory killer; lower --workers/--num-proc)" if code == -9 else ""
            for job_id in self.store.running_on(pid):
                if pid in self.cancelled:
                    continue
                if self._recover_published(job_id):
                    continue  # it died after publishing, before its COMMIT: the dataset is complete
                self.store.finish_failure(job_id, pid, "worker_died",
                                          f"the worker process {pid} died with {how}{hint}; POST again to retry")
            shutil.rmtree(self.settings.scratch_dir / f"w{pid}", ignore_errors=True)
            self.store.remove_worker(pid)
            with self._lock:
                idx = self.index_of.pop(pid)
                self.procs.pop(pid)
                was_cancelled = pid in self.cancelled
                self.cancelled.discard(pid)
                if self._stop.is_set():
                    continue
                now = time.time()
                if not was_cancelled:
                    self.deaths = [t for t in self.deaths if now - t < 60] + [now]
                if not was_cancelled and len(self.deaths) > 5 * self.settings.workers:
                    logger.error("workers keep dying; waiting before restarting worker %d", idx)
                    time.sleep(2.0)
                self._missing.append(idx)
        self._respawn_missing()
        self.store.reconcile(datasets_dir=self.settings.datasets_dir, max_attempts=self.settings.max_attempts,
                             heartbeat_timeout_s=self.settings.heartbeat_timeout_s, live_pids=self.live_pids())

    def _recover_published(self, job_id: str) -> bool:
        """Mark a dead worker's job succeeded when its dataset directory was published whole and verifies."""
        from pf_trl.data.shards import ShardsError, is_shards_dir, read_manifest, verify_shards

        target = self.settings.datasets_dir / job_id
        if not is_shards_dir(target):
            return False
        try:
            manifest = read_manifest(target)
            verify_shards(target, manifest)
        except ShardsError:
            return False
        row = self.store.get(job_id)
        return bool(row) and self.store.mark_recovered(job_id, manifest, attempts=row["attempts"])

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop: running jobs go back to the queue without using up an attempt."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2.0)
        with self._lock:
            procs = list(self.procs.items())
        for _, p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + timeout
        for _, p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid, _ in procs:
            try:
                for job_id in self.store.running_on(pid):
                    self.store.requeue(job_id, "the service was stopped while this job ran; re-queued",
                                       count_attempt=False)
            except Exception:
                logger.exception("could not re-queue the jobs of worker %d; the next start-up reconciles them", pid)
            shutil.rmtree(self.settings.scratch_dir / f"w{pid}", ignore_errors=True)
        try:
            self.store.clear_workers()
        except Exception:
            logger.exception("could not clear this replica's workers from the store")
        if self._own_forks:
            self.forks.stop()
