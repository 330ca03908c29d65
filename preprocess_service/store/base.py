"""The job store: one interface, two databases (SQLite embedded, PostgreSQL for several replicas).

State machine: ``queued -> running -> succeeded | failed | cancelled`` (``failed`` and ``cancelled``
jobs are queued again by a new POST of the same request). The queue *is* the ``jobs`` table: workers
claim the oldest queued job in a write transaction, so there is no in-memory queue to lose. A dataset
id is a primary key, so concurrent identical submissions (threads, processes or replicas) meet one row.

Every transition and every progress report appends a row to ``job_events`` in the same transaction
(the Server-Sent Events stream reads it; its ``seq`` is the SSE event id) and, once committed, writes
one JSON log line. Counters (``/metrics``) live in the database too, so replicas share them.

Crash safety: workers build shards under ``tmp/`` and publish them with one ``rename`` into
``datasets/<id>`` *inside* the transaction that marks the job succeeded (the row is locked), so a
dataset directory is either complete or absent, and a job row says succeeded only if its directory was
published. :meth:`JobStore.reconcile` re-queues a job whose worker is gone (up to ``max_attempts``) or
fails it with the reason.

Subclasses supply the connection, the transaction, the schema and the few statements that differ
(:mod:`.sqlite`, :mod:`.postgres`); everything else is written once here with ``?`` placeholders.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")
DURATION_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)
IDEMPOTENCY_TTL_S = 24 * 3600.0
"""How long an ``Idempotency-Key`` is remembered (documented in docs/service.md and the OpenAPI schema)."""

JOB_COLUMNS = {  # name -> portable type; used by both schemas and by the SQLite migration of old files
    "state": "TEXT NOT NULL", "request": "TEXT NOT NULL", "created_at": "DOUBLE PRECISION NOT NULL",
    "started_at": "DOUBLE PRECISION", "finished_at": "DOUBLE PRECISION", "updated_at": "DOUBLE PRECISION",
    "heartbeat_at": "DOUBLE PRECISION", "rows_done": "BIGINT NOT NULL DEFAULT 0", "rows_total": "BIGINT",
    "tokens_done": "BIGINT NOT NULL DEFAULT 0", "attempts": "INTEGER NOT NULL DEFAULT 0",
    "worker_pid": "INTEGER", "replica": "TEXT", "error_type": "TEXT", "error": "TEXT", "manifest": "TEXT",
}

events_log = logging.getLogger("preprocess_service.events")


class QueueFull(PfTrlError):
    """More than ``max_queued`` jobs are waiting."""


class IdempotencyMismatch(PfTrlError):
    """An ``Idempotency-Key`` was reused with another request body."""


def log_event(event: str, **fields: Any) -> None:
    """One JSON line on the ``preprocess_service.events`` logger (configured by :func:`setup_event_log`)."""
    record = {"ts": round(time.time(), 3), "event": event}
    record.update({k: v for k, v in fields.items() if v is not None})
    events_log.info(json.dumps(record, sort_keys=False, default=str))


def setup_event_log(level: str = "info") -> None:
    """Plain JSON lines on stderr, one per event, whatever the access log's format is."""
    if getattr(events_log, "_pf_configured", False):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    events_log.addHandler(handler)
    events_log.setLevel(level.upper() if level.upper() != "WARNING" else "INFO")
    events_log.propagate = False
    events_log._pf_configured = True  # type: ignore[attr-defined]


class JobStore:
    """Base class: all job logic over a DB-API connection (one per thread)."""

    backend = "base"
    for_update = ""  # " FOR UPDATE" where the database has row locks

    def __init__(self, replica: str = "local"):
        self.replica = replica
        self._local = threading.local()

    # ------------------------------------------------------------------------- backend hooks
    def _connect(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _begin(self, conn) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sql(self, sql: str) -> str:
        return sql

    def _lock_id(self, db, job_id: str) -> None:
        """Serialize submissions of one id across processes (SQLite: the write lock already does)."""

    def _claim_sql(self) -> str:
        return "SELECT id FROM jobs WHERE state = 'queued' ORDER BY seq LIMIT 1"

    def describe(self) -> str:
        """Where the store lives, without secrets (for the start-up log line and /readyz)."""
        return self.backend

    # ---------------------------------------------------------------------------------- plumbing
    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
        return conn

    def execute(self, db, sql: str, args: tuple = ()):
        return db.execute(self._sql(sql), args)

    def one(self, db, sql: str, args: tuple = ()) -> dict[str, Any] | None:
        row = self.execute(db, sql, args).fetchone()
        return dict(row) if row is not None else None

    @contextmanager
    def tx(self) -> Iterator[Any]:
        """A write transaction; JSON log lines queued inside it are written once it committed."""
        conn = self._conn()
        self._local.pending = []
        self._begin(conn)
        try:
            yield conn
        except BaseException:
            self._local.pending = []
            try:
                conn.execute("ROLLBACK")
            except Exception:  # a broken connection: the original error is the one to raise
                pass
            raise
        conn.execute("COMMIT")
        pending, self._local.pending = self._local.pending, []
        for event, fields in pending:
            log_event(event, **fields)

    def query(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        conn = self._conn()
        return [dict(r) for r in self.execute(conn, sql, args).fetchall()]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # ------------------------------------------------------------------------------------- reads
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
            counts[r["state"]] = int(r["n"])
        return counts

    def counters(self) -> dict[str, float]:
        return {r["name"]: float(r["value"]) for r in self.query("SELECT name, value FROM counters")}

    def events(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        """Events of one job with ``seq > after``, oldest first (the SSE stream)."""
        return self.query("SELECT seq, job_id, kind, data FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq",
                          (job_id, after))

    def running_on(self, pid: int) -> list[str]:
        """Ids of the jobs running on worker ``pid`` of this replica."""
        return [r["id"] for r in self.query("SELECT id FROM jobs WHERE state='running' AND worker_pid=? AND replica=?",
                                            (pid, self.replica))]

    def ready_worker_pids(self) -> set[int]:
        return {int(r["pid"]) for r in self.query("SELECT pid FROM workers WHERE ready_at IS NOT NULL AND replica=?",
                                                  (self.replica,))}

    # ------------------------------------------------------------------------------------ events
    def _event(self, db, job_id: str, kind: str, row: dict[str, Any] | None = None, *, log: bool = True,
               **extra: Any) -> None:
        """Append an event in this transaction; ``row`` (the job after the change) supplies state and counts."""
        data = dict(extra)
        if row is not None:
            data.update(state=row["state"], rows_done=row["rows_done"], rows_total=row["rows_total"],
                        tokens_done=row["tokens_done"], attempt=row["attempts"])
            if row.get("error_type") and row["state"] in ("failed", "cancelled", "queued"):
                data.update(error_type=row["error_type"], error=row["error"])
        self.execute(db, "INSERT INTO job_events (job_id, kind, data, at) VALUES (?, ?, ?, ?)",
                     (job_id, kind, json.dumps(data), time.time()))
        if log:
            self._local.pending.append((f"job_{kind}", {"job_id": job_id, "replica": self.replica, **data}))

    def _row(self, db, job_id: str, *, lock: bool = False) -> dict[str, Any] | None:
        return self.one(db, "SELECT * FROM jobs WHERE id = ?" + (self.for_update if lock else ""), (job_id,))

    # ------------------------------------------------------------------------------------ writes
    def submit(self, job_id: str, request: dict[str, Any], *, max_queued: int,
               exists_ok: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], bool]:
        """Create (or re-queue a failed / cancelled) job; return ``(row, created)``.

        ``exists_ok(row)`` says whether an existing row stands (e.g. succeeded with its directory present);
        if not, the job is queued again. Atomic, so N concurrent identical submissions create one job.
        ``request["rows_total"]`` (when the source tells it) is known from the start.
        """
        now = time.time()
        body = json.dumps(request, sort_keys=True)
        with self.tx() as db:
            self._lock_id(db, job_id)
            row = self._row(db, job_id, lock=True)
            if row is not None and row["state"] not in ("failed", "cancelled") and exists_ok(row):
                return row, False
            queued = self.one(db, "SELECT COUNT(*) AS n FROM jobs WHERE state = 'queued'")["n"]
            if queued >= max_queued:
                raise QueueFull(queued)
            rows_total = request.get("rows_total")
            self.execute(db, "DELETE FROM job_events WHERE job_id = ?", (job_id,))  # a new history (after a
            # failure, a cancel, or a DELETE whose `deleted` event is kept for streams still open)
            if row is None:
                self.execute(db, "INSERT INTO jobs (id, state, request, created_at, updated_at, rows_total) "
                             "VALUES (?, 'queued', ?, ?, ?, ?)", (job_id, body, now, now, rows_total))
            else:
                self.execute(
                    db, "UPDATE jobs SET state='queued', request=?, created_at=?, updated_at=?, started_at=NULL, "
                    "finished_at=NULL, heartbeat_at=NULL, rows_done=0, rows_total=?, tokens_done=0, attempts=0, "
                    "worker_pid=NULL, replica=NULL, error_type=NULL, error=NULL, manifest=NULL WHERE id=?",
                    (body, now, now, rows_total, job_id))
            out = self._row(db, job_id)
            self._event(db, job_id, "queued", out)
        return out, True

    def claim(self, pid: int) -> dict[str, Any] | None:
        """The oldest queued job, now running on worker ``pid`` of this replica."""
        now = time.time()
        with self.tx() as db:
            row = self.one(db, self._claim_sql())
            if row is None:
                return None
            self.execute(db, "UPDATE jobs SET state='running', attempts=attempts+1, worker_pid=?, replica=?, "
                         "started_at=?, heartbeat_at=?, updated_at=?, rows_done=0, tokens_done=0 WHERE id=?",
                         (pid, self.replica, now, now, now, row["id"]))
            out = self._row(db, row["id"])
            self._event(db, row["id"], "started", out, worker_pid=pid)
            return out

    def progress(self, job_id: str, pid: int, rows_done: int, rows_total: int | None, tokens_done: int) -> bool:
        """Record progress; False when the job is no longer ours (cancelled, deleted, re-queued)."""
        now = time.time()
        with self.tx() as db:
            cur = self.execute(db, "UPDATE jobs SET rows_done=?, rows_total=COALESCE(?, rows_total), tokens_done=?, "
                               "updated_at=?, heartbeat_at=? WHERE id=? AND worker_pid=? AND replica=? "
                               "AND state='running'", (rows_done, rows_total, tokens_done, now, now, job_id, pid,
                                                       self.replica))
            if cur.rowcount != 1:
                return False
            self._event(db, job_id, "progress", self._row(db, job_id), log=False)
        return True

    def download_progress(self, job_id: str, pid: int, **fields: Any) -> bool:
        """Record a step of the job's download of its Hub source (a ``downloading`` event with ``fields``: message,
        bytes and files done and in all); False when the job is no longer ours."""
        now = time.time()
        with self.tx() as db:
            cur = self.execute(db, "UPDATE jobs SET updated_at=?, heartbeat_at=? WHERE id=? AND worker_pid=? AND "
                               "replica=? AND state='running'", (now, now, job_id, pid, self.replica))
            if cur.rowcount != 1:
                return False
            self._event(db, job_id, "downloading", self._row(db, job_id), log=False, **fields)
        return True

    def heartbeat(self, job_id: str | None, pid: int) -> bool:
        """Worker and job heartbeat; False when ``job_id`` is given and is no longer ours."""
        now = time.time()
        with self.tx() as db:
            self.execute(db, "UPDATE workers SET heartbeat_at=? WHERE pid=? AND replica=?", (now, pid, self.replica))
            if job_id:
                cur = self.execute(db, "UPDATE jobs SET heartbeat_at=? WHERE id=? AND worker_pid=? AND replica=? "
                                   "AND state='running'", (now, job_id, pid, self.replica))
                return cur.rowcount == 1
        return True

    def finish_success(self, job_id: str, pid: int, manifest: dict[str, Any],
                       publish: Callable[[], dict[str, Any] | None]) -> bool:
        """Publish (rename into datasets/) and mark succeeded in one transaction (the row locked). False:
        the job is no longer ours (cancelled, deleted or re-queued meanwhile); the caller discards its output.
        ``publish`` may return the manifest of a dataset found already published (it is kept, and recorded)."""
        now = time.time()
        with self.tx() as db:
            row = self._row(db, job_id, lock=True)
            if row is None or row["state"] != "running" or row["worker_pid"] != pid or row["replica"] != self.replica:
                return False
            manifest = publish() or manifest
            counts = manifest.get("counts", {})
            rows, tokens = counts.get("source_rows", 0), counts.get("tokens", 0)
            self.execute(db, "UPDATE jobs SET state='succeeded', finished_at=?, updated_at=?, manifest=?, rows_done=?, "
                         "rows_total=?, tokens_done=?, error_type=NULL, error=NULL WHERE id=?",
                         (now, now, json.dumps(manifest), rows, rows, tokens, job_id))
            seconds = now - (row["started_at"] or now)
            self._count(db, "jobs_succeeded_total", 1)
            self._count(db, "rows_tokenized_total", rows)
            self._count(db, "tokens_tokenized_total", tokens)
            self._observe(db, seconds)
            self._event(db, job_id, "succeeded", self._row(db, job_id), seconds=round(seconds, 3),
                        examples=counts.get("examples"))
        return True

    def finish_failure(self, job_id: str, pid: int | None, error_type: str, message: str, *,
                       attempts: int | None = None) -> bool:
        """Mark failed with the reason. ``pid``: only if running on that worker of this replica;
        ``attempts``: only if still that attempt (orphan recovery racing another replica)."""
        now = time.time()
        with self.tx() as db:
            row = self._row(db, job_id, lock=True)
            if row is None or row["state"] not in ("running", "queued"):
                return False
            if pid is not None and (row["worker_pid"] != pid or row["replica"] != self.replica):
                return False
            if attempts is not None and (row["state"] != "running" or row["attempts"] != attempts):
                return False
            self.execute(db, "UPDATE jobs SET state='failed', finished_at=?, updated_at=?, error_type=?, error=? "
                         "WHERE id=?", (now, now, error_type, message, job_id))
            self._count(db, "jobs_failed_total", 1)
            seconds = (now - row["started_at"]) if row["started_at"] else None
            if seconds is not None:
                self._observe(db, seconds)
            self._event(db, job_id, "failed", self._row(db, job_id),
                        seconds=round(seconds, 3) if seconds is not None else None)
        return True

    def cancel(self, job_id: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Queued/running -> cancelled (kept for inspection, nothing published). Returns ``(before, after)``;
        ``after`` is None when the job was already done (the caller answers 409, or 200 if cancelled)."""
        now = time.time()
        with self.tx() as db:
            row = self._row(db, job_id, lock=True)
            if row is None or row["state"] not in ("queued", "running"):
                return row, None
            self.execute(db, "UPDATE jobs SET state='cancelled', finished_at=?, updated_at=?, error_type='cancelled', "
                         "error=? WHERE id=?",
                         (now, now, "cancelled by a client (POST .../cancel); POST the request again to rebuild",
                          job_id))
            self._count(db, "jobs_cancelled_total", 1)
            seconds = (now - row["started_at"]) if row["started_at"] else None
            if seconds is not None:
                self._observe(db, seconds)
            after = self._row(db, job_id)
            self._event(db, job_id, "cancelled", after, seconds=round(seconds, 3) if seconds is not None else None)
            return row, after

    def delete(self, job_id: str, on_delete: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Remove the row and its events; ``on_delete(row)`` runs inside the transaction (moves the dataset
        dir away). The SSE stream of a deleted job ends with a ``deleted`` event."""
        with self.tx() as db:
            row = self._row(db, job_id, lock=True)
            if row is None:
                return None
            on_delete(row)
            self.execute(db, "DELETE FROM job_events WHERE job_id=?", (job_id,))
            self.execute(db, "DELETE FROM jobs WHERE id=?", (job_id,))
            self._count(db, "jobs_deleted_total", 1)
            if row["state"] == "running" and row["started_at"]:
                self._observe(db, time.time() - row["started_at"])
            self._event(db, job_id, "deleted", None, state="deleted", previous_state=row["state"])
            return row

    def requeue(self, job_id: str, note: str, *, count_attempt: bool = True, attempts: int | None = None) -> bool:
        with self.tx() as db:
            row = self._row(db, job_id, lock=True)
            if row is None or row["state"] != "running" or (attempts is not None and row["attempts"] != attempts):
                return False
            self.execute(db, "UPDATE jobs SET state='queued', worker_pid=NULL, replica=NULL, updated_at=?, "
                         f"error_type='interrupted', error=?, attempts=attempts{'' if count_attempt else '-1'} "
                         "WHERE id=?", (time.time(), note, job_id))
            self._event(db, job_id, "requeued", self._row(db, job_id))
        return True

    def mark_recovered(self, job_id: str, manifest: dict[str, Any], *, attempts: int | None = None,
                       from_states: tuple[str, ...] = ("running",)) -> bool:
        """A job whose dataset was published before its worker died (a crash between the rename and the COMMIT):
        succeeded, with the published manifest."""
        now = time.time()
        counts = manifest.get("counts", {})
        with self.tx() as db:
            row = self._row(db, job_id, lock=True)
            if row is None or row["state"] not in from_states or (attempts is not None and row["attempts"] != attempts):
                return False
            self.execute(db, "UPDATE jobs SET state='succeeded', finished_at=?, updated_at=?, manifest=?, rows_done=?, "
                         "rows_total=?, tokens_done=?, error_type=NULL, error=NULL WHERE id=?",
                         (now, now, json.dumps(manifest), counts.get("source_rows", 0), counts.get("source_rows", 0),
                          counts.get("tokens", 0), job_id))
            self._count(db, "jobs_succeeded_total", 1)
            self._event(db, job_id, "succeeded", self._row(db, job_id), recovered=True)
        return True

    def mark_corrupt(self, job_id: str, message: str, move_away: Callable[[], None]) -> bool:
        """A succeeded job whose dataset no longer matches its checksums: ``failed`` (``corrupt``) with the reason,
        its directory moved away in the same transaction, so it is never served again (a new POST rebuilds it)."""
        now = time.time()
        with self.tx() as db:
            row = self._row(db, job_id, lock=True)
            if row is None or row["state"] != "succeeded":
                return False
            move_away()
            self.execute(db, "UPDATE jobs SET state='failed', finished_at=?, updated_at=?, error_type='corrupt', "
                         "error=? WHERE id=?", (now, now, message, job_id))
            self._count(db, "jobs_corrupt_total", 1)
            self._event(db, job_id, "failed", self._row(db, job_id))
        return True

    # --------------------------------------------------------------------------- idempotency keys
    def idempotent(self, key: str, fingerprint: str) -> str | None:
        """The job id remembered for ``key`` (None: unknown or expired); raises
        :class:`IdempotencyMismatch` if the key was used with another body."""
        rows = self.query("SELECT fingerprint, job_id, created_at FROM idempotency_keys WHERE key = ?", (key,))
        if not rows or time.time() - rows[0]["created_at"] > IDEMPOTENCY_TTL_S:
            return None
        if rows[0]["fingerprint"] != fingerprint:
            raise IdempotencyMismatch(key)
        return rows[0]["job_id"]

    def remember_key(self, key: str, fingerprint: str, job_id: str) -> str:
        """Store ``key`` (first writer wins; expired keys are dropped); returns the job id it names."""
        now = time.time()
        with self.tx() as db:
            self.execute(db, "DELETE FROM idempotency_keys WHERE created_at < ?", (now - IDEMPOTENCY_TTL_S,))
            old = self.one(db, "SELECT fingerprint, job_id FROM idempotency_keys WHERE key = ?" + self.for_update,
                           (key,))
            if old is None:
                self.execute(db, "INSERT INTO idempotency_keys (key, fingerprint, job_id, created_at) "
                             "VALUES (?, ?, ?, ?)", (key, fingerprint, job_id, now))
                return job_id
        if old["fingerprint"] != fingerprint:
            raise IdempotencyMismatch(key)
        return old["job_id"]

    # ------------------------------------------------------------------------------------ workers
    def register_worker(self, pid: int, idx: int) -> None:
        now = time.time()
        with self.tx() as db:
            self.execute(db, "DELETE FROM workers WHERE pid=? AND replica=?", (pid, self.replica))
            self.execute(db, "INSERT INTO workers (pid, replica, idx, started_at, heartbeat_at) VALUES (?, ?, ?, ?, ?)",
                         (pid, self.replica, idx, now, now))

    def worker_ready(self, pid: int) -> None:
        with self.tx() as db:
            self.execute(db, "UPDATE workers SET ready_at=? WHERE pid=? AND replica=?", (time.time(), pid, self.replica))

    def remove_worker(self, pid: int) -> None:
        with self.tx() as db:
            self.execute(db, "DELETE FROM workers WHERE pid=? AND replica=?", (pid, self.replica))

    def clear_workers(self) -> None:
        with self.tx() as db:
            self.execute(db, "DELETE FROM workers WHERE replica=?", (self.replica,))

    # ----------------------------------------------------------------------------------- counters
    def _count(self, db, name: str, by: float) -> None:
        self.execute(db, "INSERT INTO counters (name, value) VALUES (?, ?) "
                     "ON CONFLICT (name) DO UPDATE SET value = counters.value + excluded.value", (name, by))

    def _observe(self, db, seconds: float) -> None:
        for le in DURATION_BUCKETS:
            if seconds <= le:
                self._count(db, f"duration_bucket:{le}", 1)
        self._count(db, "duration_bucket:+Inf", 1)
        self._count(db, "duration_sum", seconds)

    # ----------------------------------------------------------------------------------- recovery
    def reconcile(self, *, datasets_dir: Path, max_attempts: int, heartbeat_timeout_s: float,
                  live_pids: set[int] = frozenset(), startup: bool = False) -> list[tuple[str, str]]:
        """Deal with running jobs whose worker is gone: published -> succeeded, else re-queue or fail.

        A job of this replica is orphaned when its worker is not one of ``live_pids`` and its heartbeat
        is older than ``heartbeat_timeout_s`` (at start-up, also when its pid is no longer alive). A job of
        another replica (PostgreSQL) is orphaned when its heartbeat is stale. Every change is conditional
        on the attempt read here, so two replicas reconciling at once act once. Returns ``[(id, action)]``.
        """
        from pf_trl.data.shards import ShardsError, is_shards_dir, read_manifest, verify_shards

        actions = []
        now = time.time()
        for row in self.query("SELECT * FROM jobs WHERE state = 'running'"):
            pid, ours = row["worker_pid"], row["replica"] in (self.replica, None)
            if ours and pid in live_pids:
                continue
            stale = now - (row["heartbeat_at"] or 0) > heartbeat_timeout_s
            if not stale and not (ours and startup and not pid_alive(pid)):
                continue
            attempt = row["attempts"]
            target = datasets_dir / row["id"]
            if is_shards_dir(target):
                try:
                    manifest = read_manifest(target)
                    verify_shards(target, manifest)
                    if self.mark_recovered(row["id"], manifest, attempts=attempt):
                        actions.append((row["id"], "recovered"))
                    continue
                except ShardsError:
                    pass
            reason = (f"the service stopped (crash or restart) while attempt {attempt} of this job was "
                      f"running (worker pid {pid}, replica {row['replica']})")
            if attempt < max_attempts:
                if self.requeue(row["id"], reason + "; re-queued", attempts=attempt):
                    actions.append((row["id"], "requeued"))
            elif self.finish_failure(row["id"], None, "interrupted",
                                     f"{reason}; gave up after {attempt} attempt(s) (max_attempts "
                                     f"{max_attempts}); POST the same request again to retry", attempts=attempt):
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
