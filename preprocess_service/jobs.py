"""Durable job store (SQLite in WAL mode, inside the cache dir) and the supervisor of worker processes.

State machine: ``queued -> running -> succeeded | failed``. The queue *is* the ``jobs`` table: workers
claim the oldest queued job in a write transaction, so there is no in-memory queue to lose. A dataset
id is a primary key, so concurrent identical submissions (threads or processes) meet one row.

Crash safety: workers build shards under ``tmp/`` (pretokenize itself writes atomically there) and
publish them with one ``rename`` into ``datasets/<id>`` *inside* the transaction that marks the job
succeeded, so a dataset directory is either complete or absent, and a job row says succeeded only if
its directory was published. After a crash, :meth:`JobStore.reconcile` re-queues a job that was running
(up to ``max_attempts``) or fails it with the reason; ``tmp/`` is wiped at start-up.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

logger = logging.getLogger("preprocess_service")

STATES = ("queued", "running", "succeeded", "failed")
DURATION_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    updated_at REAL,
    heartbeat_at REAL,
    rows_done INTEGER NOT NULL DEFAULT 0,
    rows_total INTEGER,
    tokens_done INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    worker_pid INTEGER,
    error_type TEXT,
    error TEXT,
    manifest TEXT
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value REAL NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    pid INTEGER PRIMARY KEY, idx INTEGER, started_at REAL, ready_at REAL, heartbeat_at REAL
);
"""


class QueueFull(Exception):
    """More than ``max_queued`` jobs are waiting."""


class JobStore:
    """SQLite access shared by the API (one connection per thread) and the workers (one each)."""

    def __init__(self, db_path: Path):
        self.db_path = Path(db_path)
        self._local = threading.local()
        self._conn().executescript(_SCHEMA)  # idempotent; executescript manages its own transaction

    # ----------------------------------------------------------------------------------- plumbing
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(str(self.db_path), timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL+NORMAL: durable across process crashes
            conn.execute("PRAGMA busy_timeout=30000")
            self._local.conn = conn
        return conn

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE: takes the write lock up front, no upgrade deadlocks)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def query(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self._conn().execute(sql, args).fetchall()]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -------------------------------------------------------------------------------------- reads
    def get(self, job_id: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return rows[0] if rows else None

    def list(self, *, limit: int, after_seq: int = 0, state: str | None = None) -> list[dict[str, Any]]:
        if state:
            return self.query("SELECT * FROM jobs WHERE seq > ? AND state = ? ORDER BY seq LIMIT ?",
                              (after_seq, state, limit))
        return self.query("SELECT * FROM jobs WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))

    def counts_by_state(self) -> dict[str, int]:
        counts = {s: 0 for s in STATES}
        for r in self.query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state"):
            counts[r["state"]] = r["n"]
        return counts

    def counters(self) -> dict[str, float]:
        return {r["name"]: r["value"] for r in self.query("SELECT name, value FROM counters")}

    # ------------------------------------------------------------------------------------- writes
    def submit(self, job_id: str, request: dict[str, Any], *, max_queued: int,
               exists_ok: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], bool]:
        """Create (or re-queue a failed) job; return ``(row, created)``.

        ``exists_ok(row)`` says whether an existing row stands (e.g. succeeded with its directory present);
        if not, the job is queued again. Atomic, so N concurrent identical submissions create one job.
        """
        now = time.time()
        with self.tx() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is not None and row["state"] != "failed" and exists_ok(dict(row)):
                return dict(row), False
            queued = db.execute("SELECT COUNT(*) FROM jobs WHERE state = 'queued'").fetchone()[0]
            if queued >= max_queued:
                raise QueueFull(queued)
            if row is None:
                db.execute("INSERT INTO jobs (id, state, request, created_at, updated_at) VALUES (?, 'queued', ?, ?, ?)",
                           (job_id, json.dumps(request, sort_keys=True), now, now))
            else:
                db.execute(
                    "UPDATE jobs SET state='queued', request=?, created_at=?, updated_at=?, started_at=NULL, "
                    "finished_at=NULL, heartbeat_at=NULL, rows_done=0, rows_total=NULL, tokens_done=0, attempts=0, "
                    "worker_pid=NULL, error_type=NULL, error=NULL, manifest=NULL WHERE id=?",
                    (json.dumps(request, sort_keys=True), now, now, job_id))
            out = dict(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
        return out, True

    def claim(self, pid: int) -> dict[str, Any] | None:
        """The oldest queued job, now running on ``pid``."""
        now = time.time()
        with self.tx() as db:
            row = db.execute("SELECT id FROM jobs WHERE state = 'queued' ORDER BY seq LIMIT 1").fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET state='running', attempts=attempts+1, worker_pid=?, started_at=?, "
                       "heartbeat_at=?, updated_at=?, rows_done=0, tokens_done=0 WHERE id=?",
                       (pid, now, now, now, row["id"]))
            return dict(db.execute("SELECT * FROM jobs WHERE id = ?", (row["id"],)).fetchone())

    def progress(self, job_id: str, pid: int, rows_done: int, rows_total: int | None, tokens_done: int) -> None:
        now = time.time()
        with self.tx() as db:
            db.execute("UPDATE jobs SET rows_done=?, rows_total=?, tokens_done=?, updated_at=?, heartbeat_at=? "
                       "WHERE id=? AND worker_pid=? AND state='running'",
                       (rows_done, rows_total, tokens_done, now, now, job_id, pid))

    def heartbeat(self, job_id: str | None, pid: int) -> None:
        now = time.time()
        with self.tx() as db:
            db.execute("UPDATE workers SET heartbeat_at=? WHERE pid=?", (now, pid))
            if job_id:
                db.execute("UPDATE jobs SET heartbeat_at=? WHERE id=? AND worker_pid=? AND state='running'",
                           (now, job_id, pid))

    def finish_success(self, job_id: str, pid: int, manifest: dict[str, Any], publish: Callable[[], None]) -> bool:
        """Publish (rename into datasets/) and mark succeeded in one transaction. False: the job is no
        longer ours (deleted or re-queued meanwhile); the caller discards its output."""
        now = time.time()
        with self.tx() as db:
            row = db.execute("SELECT state, worker_pid, started_at FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None or row["state"] != "running" or row["worker_pid"] != pid:
                return False
            publish()
            counts = manifest.get("counts", {})
            db.execute("UPDATE jobs SET state='succeeded', finished_at=?, updated_at=?, manifest=?, rows_done=?, "
                       "rows_total=?, tokens_done=?, error_type=NULL, error=NULL WHERE id=?",
                       (now, now, json.dumps(manifest), counts.get("source_rows", 0), counts.get("source_rows", 0),
                        counts.get("tokens", 0), job_id))
            self._count(db, "jobs_succeeded_total", 1)
            self._count(db, "rows_tokenized_total", counts.get("source_rows", 0))
            self._count(db, "tokens_tokenized_total", counts.get("tokens", 0))
            self._observe(db, now - (row["started_at"] or now))
        return True

    def finish_failure(self, job_id: str, pid: int | None, error_type: str, message: str) -> bool:
        now = time.time()
        with self.tx() as db:
            row = db.execute("SELECT state, worker_pid, started_at FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None or row["state"] not in ("running", "queued") or (pid is not None and row["worker_pid"] != pid):
                return False
            db.execute("UPDATE jobs SET state='failed', finished_at=?, updated_at=?, error_type=?, error=? WHERE id=?",
                       (now, now, error_type, message, job_id))
            self._count(db, "jobs_failed_total", 1)
            if row["started_at"]:
                self._observe(db, now - row["started_at"])
        return True

    def delete(self, job_id: str, on_delete: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Remove the row; ``on_delete(row)`` runs inside the transaction (moves the dataset dir away)."""
        with self.tx() as db:
            row = db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                return None
            on_delete(dict(row))
            db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
            return dict(row)

    def requeue(self, job_id: str, note: str, *, count_attempt: bool = True) -> None:
        with self.tx() as db:
            db.execute("UPDATE jobs SET state='queued', worker_pid=NULL, updated_at=?, error_type='interrupted', "
                       f"error=?, attempts=attempts{'' if count_attempt else '-1'} WHERE id=? AND state='running'",
                       (time.time(), note, job_id))

    def mark_recovered(self, job_id: str, manifest: dict[str, Any]) -> None:
        now = time.time()
        counts = manifest.get("counts", {})
        with self.tx() as db:
            db.execute("UPDATE jobs SET state='succeeded', finished_at=?, updated_at=?, manifest=?, rows_done=?, "
                       "rows_total=?, tokens_done=?, error_type=NULL, error=NULL WHERE id=? AND state='running'",
                       (now, now, json.dumps(manifest), counts.get("source_rows", 0), counts.get("source_rows", 0),
                        counts.get("tokens", 0), job_id))

    def register_worker(self, pid: int, idx: int) -> None:
        now = time.time()
        with self.tx() as db:
            db.execute("INSERT OR REPLACE INTO workers (pid, idx, started_at, heartbeat_at) VALUES (?, ?, ?, ?)",
                       (pid, idx, now, now))

    def worker_ready(self, pid: int) -> None:
        with self.tx() as db:
            db.execute("UPDATE workers SET ready_at=? WHERE pid=?", (time.time(), pid))

    def remove_worker(self, pid: int) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM workers WHERE pid=?", (pid,))

    def clear_workers(self) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM workers")

    @staticmethod
    def _count(db, name: str, by: float) -> None:
        db.execute("INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value=value+?",
                   (name, by, by))

    def _observe(self, db, seconds: float) -> None:
        for le in DURATION_BUCKETS:
            if seconds <= le:
                self._count(db, f"duration_bucket:{le}", 1)
        self._count(db, "duration_bucket:+Inf", 1)
        self._count(db, "duration_sum", seconds)

    # ---------------------------------------------------------------------------------- recovery
    def reconcile(self, *, datasets_dir: Path, max_attempts: int, heartbeat_timeout_s: float,
                  live_pids: set[int] = frozenset(), startup: bool = False) -> list[tuple[str, str]]:
        """Deal with running jobs whose worker is gone: published -> succeeded, else re-queue or fail.

        A job is orphaned when its worker is not one of ``live_pids`` and its heartbeat is older than
        ``heartbeat_timeout_s`` (at start-up, also when its pid is no longer alive). Returns
        ``[(id, action)]``.
        """
        from pf_trl.data.shards import ShardsError, is_shards_dir, read_manifest

        actions = []
        now = time.time()
        for row in self.query("SELECT * FROM jobs WHERE state = 'running'"):
            pid = row["worker_pid"]
            if pid in live_pids:
                continue
            stale = now - (row["heartbeat_at"] or 0) > heartbeat_timeout_s
            if not stale and not (startup and not pid_alive(pid)):
                continue
            target = datasets_dir / row["id"]
            if is_shards_dir(target):
                try:
                    self.mark_recovered(row["id"], read_manifest(target))
                    actions.append((row["id"], "recovered"))
                    continue
                except ShardsError:
                    pass
            reason = (f"the service stopped (crash or restart) while attempt {row['attempts']} of this job was "
                      f"running (worker pid {pid})")
            if row["attempts"] < max_attempts:
                self.requeue(row["id"], reason + "; re-queued")
                actions.append((row["id"], "requeued"))
            else:
                self.finish_failure(row["id"], None, "interrupted",
                                    f"{reason}; gave up after {row['attempts']} attempt(s) (max_attempts "
                                    f"{max_attempts}); POST the same request again to retry")
                actions.append((row["id"], "failed"))
        return actions


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (dead child not yet reaped) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class Supervisor:
    """Starts ``settings.workers`` worker processes, restarts the ones that die (failing their job with
    the reason), kills one on request (DELETE of a running job) and detects orphaned jobs."""

    def __init__(self, settings, store: JobStore):
        self.settings, self.store = settings, store
        self.procs: dict[int, subprocess.Popen] = {}
        self.index_of: dict[int, int] = {}
        self.cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.deaths: list[float] = []

    def _spawn(self, idx: int) -> None:
        cmd = [sys.executable, "-m", "preprocess_service.worker", "--settings", json.dumps(self.settings.to_json()),
               "--api-pid", str(os.getpid()), "--index", str(idx)]
        env = {**os.environ, **self.settings.child_env()}
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, close_fds=True)
        self.procs[proc.pid] = proc
        self.index_of[proc.pid] = idx
        logger.info("worker %d started (pid %d)", idx, proc.pid)

    def start(self) -> None:
        with self._lock:
            for idx in range(self.settings.workers):
                self._spawn(idx)
        self._thread = threading.Thread(target=self._monitor, name="pf-supervisor", daemon=True)
        self._thread.start()

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
            for row in self.store.query("SELECT id FROM jobs WHERE state='running' AND worker_pid=?", (pid,)):
                if pid in self.cancelled:
                    continue
                self.store.finish_failure(row["id"], pid, "worker_died",
                                          f"the worker process {pid} died with {how}{hint}; POST again to retry")
            shutil.rmtree(self.settings.tmp_dir / f"w{pid}", ignore_errors=True)
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
                self._spawn(idx)
        self.store.reconcile(datasets_dir=self.settings.datasets_dir, max_attempts=self.settings.max_attempts,
                             heartbeat_timeout_s=self.settings.heartbeat_timeout_s, live_pids=self.live_pids())

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
            for row in self.store.query("SELECT id FROM jobs WHERE state='running' AND worker_pid=?", (pid,)):
                self.store.requeue(row["id"], "the service was stopped while this job ran; re-queued",
                                   count_attempt=False)
            shutil.rmtree(self.settings.tmp_dir / f"w{pid}", ignore_errors=True)
        self.store.clear_workers()
