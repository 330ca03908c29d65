"""PostgreSQL job store: several service replicas (and their workers) on one database.

Workers claim with ``SELECT ... FOR UPDATE SKIP LOCKED`` (no two claim one job, none waits on another's
lock); a submission takes a transaction-scoped advisory lock on its dataset id, so concurrent identical
POSTs on any replica meet one row; ``finish_success`` publishes while holding the job row's lock.
Heartbeats and orphan recovery are the base class's: a job whose replica stopped heart-beating is
re-queued by whichever replica notices first (conditional on the attempt it read).

Why not procrastinate (a PostgreSQL task queue): its jobs are opaque task calls with their own schema,
worker loop and retry model, while here the job row *is* the API resource (content-addressed id,
progress, manifest, events, idempotency keys) and must behave the same on SQLite; the queue part is
one ``SKIP LOCKED`` statement. See docs/service.md.
"""

from __future__ import annotations

from preprocess_service.store.base import JOB_COLUMNS, JobStore

_SCHEMA_LOCK = 0x7066_7472_6C00  # advisory lock id: replicas creating the schema at once take turns


def _schema() -> list[str]:
    cols = ",\n    ".join(f"{name} {kind}" for name, kind in JOB_COLUMNS.items())
    return [
        f"CREATE TABLE IF NOT EXISTS jobs (seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL UNIQUE, {cols})",
        "CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, seq)",
        "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS job_events (seq BIGSERIAL PRIMARY KEY, job_id TEXT NOT NULL, kind TEXT NOT NULL, "
        "data TEXT NOT NULL, at DOUBLE PRECISION)",
        "CREATE INDEX IF NOT EXISTS job_events_job ON job_events(job_id, seq)",
        "CREATE TABLE IF NOT EXISTS idempotency_keys (key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, "
        "job_id TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS workers (pid INTEGER NOT NULL, replica TEXT NOT NULL, idx INTEGER, "
        "started_at DOUBLE PRECISION, ready_at DOUBLE PRECISION, heartbeat_at DOUBLE PRECISION, "
        "PRIMARY KEY (pid, replica))",
    ]


def redact(url: str) -> str:
    """``postgresql://user@host:port/db`` without the password (for logs and /readyz)."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(url)
    host = info.get("host", "")
    port = f":{info['port']}" if info.get("port") else ""
    user = f"{info['user']}@" if info.get("user") else ""
    return f"postgresql://{user}{host if '/' not in host else '[socket]'}{port}/{info.get('dbname', '')}"


class PostgresJobStore(JobStore):
    backend = "postgresql"
    for_update = " FOR UPDATE"

    def __init__(self, url: str, replica: str = "local"):
        super().__init__(replica)
        self._url = url
        with self.tx() as db:
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for stmt in _schema():
                db.execute(stmt)

    def _connect(self):
        import psycopg
        from psycopg.rows import dict_row

        return psycopg.connect(self._url, autocommit=True, row_factory=dict_row, connect_timeout=10)

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None and (conn.closed or conn.broken):  # the server restarted: reconnect
            self._local.conn = None
        return super()._conn()

    def _begin(self, conn) -> None:
        conn.execute("BEGIN")

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s")

    def _lock_id(self, db, job_id: str) -> None:
        db.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (job_id,))

    def _claim_sql(self) -> str:
        return "SELECT id FROM jobs WHERE state = 'queued' ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED"

    def describe(self) -> str:
        return redact(self._url)
