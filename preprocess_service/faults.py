"""Faults of the machine, not of the request, answered as what they are (RFC 9457 problem+json):

- a full disk (``ENOSPC`` / ``EDQUOT``, SQLite's "database or disk is full"): **507 Insufficient Storage**;
- the job database unreachable (PostgreSQL down, SQLite unopenable or locked past its timeout): **503** with
  ``Retry-After``.

:func:`classify` maps an exception (its cause chain included) to one of them; :func:`free_space_problem` is the
check done before accepting work, so that a full disk answers 507 before anything is written.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from preprocess_service.security import ServiceError

DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def insufficient_storage(detail: str) -> ServiceError:
    return ServiceError(507, "Insufficient Storage", detail, kind="insufficient-storage")


def database_unavailable(detail: str) -> ServiceError:
    return ServiceError(503, "Service Unavailable", detail, kind="database-unavailable", headers={"Retry-After": "5"})


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify(exc: BaseException, cache_dir: Path) -> ServiceError | None:
    """The 507 / 503 a machine fault deserves, or None when ``exc`` is not one."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return insufficient_storage(f"the service's disk is full ({e.strerror}) in {cache_dir}; nothing was "
                                        "kept: DELETE old datasets or uploads, or ask the operator for space, then retry")
        name = type(e).__module__.split(".")[0] + "." + type(e).__name__
        text = str(e).lower()
        if name == "sqlite3.OperationalError" and ("disk is full" in text or "disk i/o error" in text and "full" in text):
            return insufficient_storage(f"the job database's disk is full in {cache_dir}; DELETE old datasets or "
                                        "uploads, or ask the operator for space, then retry")
        if name in ("sqlite3.OperationalError", "sqlite3.DatabaseError") and (
                "unable to open" in text or "locked" in text or "disk i/o error" in text):
            return database_unavailable(f"the job database cannot be used ({str(e)[:120]}); retry shortly")
        if name.startswith("psycopg.") and type(e).__name__ in ("OperationalError", "InterfaceError"):
            return database_unavailable("the job database (PostgreSQL) is unreachable; retry shortly (the "
                                        "operator: check the database server)")
    return None


def fault_classes() -> tuple[type[BaseException], ...]:
    """Exception classes that may carry a machine fault: OS errors and the two databases' errors."""
    import sqlite3

    classes: list[type[BaseException]] = [OSError, sqlite3.Error]
    try:
        import psycopg

        classes.append(psycopg.Error)
    except ImportError:  # the PostgreSQL store is optional
        pass
    return tuple(classes)


def free_space_problem(cache_dir: Path, need: int, floor: int) -> ServiceError | None:
    """507 when writing ``need`` more bytes would leave less than ``floor`` free in ``cache_dir``."""
    free = shutil.disk_usage(cache_dir).free
    if free - need < floor:
        return insufficient_storage(f"not enough disk space: {free} bytes free in {cache_dir}, this needs {need} "
                                    f"and at least {floor} must stay free (--min-free-bytes); DELETE old datasets "
                                    "or uploads, or ask the operator for space, then retry")
    return None
