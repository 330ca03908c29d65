"""Job stores behind one interface: :class:`~.base.JobStore` (all logic), :class:`~.sqlite.SqliteJobStore`
(embedded default), :class:`~.postgres.PostgresJobStore` (several replicas on one database)."""

from __future__ import annotations

from preprocess_service.store.base import (
    DURATION_BUCKETS,
    IDEMPOTENCY_TTL_S,
    STATES,
    TERMINAL,
    IdempotencyMismatch,
    JobStore,
    QueueFull,
    log_event,
    pid_alive,
    setup_event_log,
)

__all__ = ["DURATION_BUCKETS", "IDEMPOTENCY_TTL_S", "STATES", "TERMINAL", "IdempotencyMismatch", "JobStore",
           "QueueFull", "describe_database", "log_event", "open_store", "pid_alive", "setup_event_log"]


def describe_database(settings) -> str:
    """The store in use, without secrets."""
    if settings.database_url:
        from preprocess_service.store.postgres import redact

        return redact(settings.database_url)
    return f"sqlite:{settings.db_path}"


def open_store(settings) -> JobStore:
    """The store ``settings`` name: PostgreSQL when ``database_url`` is set, else SQLite in the cache dir."""
    if settings.database_url:
        from preprocess_service.store.postgres import PostgresJobStore

        return PostgresJobStore(settings.database_url, replica=settings.replica_id)
    from preprocess_service.store.sqlite import SqliteJobStore

    return SqliteJobStore(settings.db_path)
