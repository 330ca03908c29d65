"""SQLite job store (the embedded default): one file in the cache dir, WAL mode, one service per cache dir."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from preprocess_service.store.base import JOB_COLUMNS, JobStore


def _schema() -> str:
    cols = ",\n    ".join(f"{name} {kind}" for name, kind in JOB_COLUMNS.items())
    return f"""
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    {cols}
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value REAL NOT NULL);
CREATE TABLE IF NOT EXISTS job_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL, at REAL
);
CREATE INDEX IF NOT EXISTS job_events_job ON job_events(job_id, seq);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, job_id TEXT NOT NULL, created_at REAL NOT NULL
);
"""


_WORKERS = """CREATE TABLE IF NOT EXISTS workers (
    pid INTEGER NOT NULL, replica TEXT NOT NULL, idx INTEGER, started_at REAL, ready_at REAL, heartbeat_at REAL,
    PRIMARY KEY (pid, replica)
)"""


class SqliteJobStore(JobStore):
    """SQLite in WAL mode; ``BEGIN IMMEDIATE`` takes the write lock up front, which serializes claims."""

    backend = "sqlite"

    def __init__(self, db_path: Path, replica: str = "local"):
        super().__init__(replica)
        self.db_path = Path(db_path)
        conn = self._conn()
        conn.executescript(_schema())  # idempotent; executescript manages its own transaction
        self._migrate(conn)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.db_path), timeout=30.0, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL+NORMAL: durable across process crashes
        conn.execute("PRAGMA busy_timeout=30000")
        return conn

    def _begin(self, conn) -> None:
        conn.execute("BEGIN IMMEDIATE")

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        """Bring a jobs.sqlite3 of an earlier version up to date (new columns; workers are transient)."""
        have = {r[1] for r in conn.execute("PRAGMA table_info(jobs)")}
        for name, kind in JOB_COLUMNS.items():
            if name not in have:
                conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind.replace(' NOT NULL', '')}")
        if "replica" not in {r[1] for r in conn.execute("PRAGMA table_info(workers)")}:
            conn.execute("DROP TABLE IF EXISTS workers")
        conn.execute(_WORKERS)

    def describe(self) -> str:
        return f"sqlite:{self.db_path}"
