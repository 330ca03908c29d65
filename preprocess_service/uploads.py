"""Uploads as resources with a lifecycle: stored as ``uploads/<sha256>.<format>``, listed by usage, deleted by a
client or when unused for ``upload_ttl_s``, and bounded together by ``max_uploads_bytes``.

An upload's "last use" is its file's mtime: set when it is uploaded (again) and when a dataset is POSTed from it.
An upload that a queued or running job reads is never removed (DELETE answers 409, expiry waits).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from preprocess_service.security import ServiceError


def uploads_bytes(uploads_dir: Path) -> int:
    """Bytes held by all uploads."""
    total = 0
    for p in uploads_dir.iterdir():
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def in_use(store, upload_id: str) -> list[str]:
    """Ids of queued or running jobs that read this upload."""
    rows = store.query("SELECT id, request FROM jobs WHERE state IN ('queued', 'running')")
    return [r["id"] for r in rows if f"/uploads/{upload_id}\"" in r["request"]]


def touch(path: Path) -> None:
    """Mark an upload as used now (its expiry counts from here)."""
    try:
        os.utime(path)
    except OSError:
        pass


def delete_upload(uploads_dir: Path, store, upload_id: str) -> None:
    """Remove an upload; 404 when unknown, 409 while a queued or running job reads it."""
    path = uploads_dir / upload_id
    if not path.is_file():
        raise ServiceError(404, "Not Found", f"upload_id: no upload {upload_id!r}; GET /v1/uploads lists them",
                           kind="unknown-upload", field="upload_id")
    users = in_use(store, upload_id)
    if users:
        raise ServiceError(409, "Conflict", f"upload {upload_id} is read by job(s) {', '.join(users)}; cancel them "
                           "or wait until they end, then DELETE it", kind="upload-in-use", field="upload_id")
    path.unlink(missing_ok=True)


def expire_uploads(uploads_dir: Path, store, ttl_s: float, now: float | None = None) -> list[str]:
    """Delete uploads unused for ``ttl_s`` seconds (none that a queued or running job reads); their ids."""
    if ttl_s <= 0:
        return []
    now = time.time() if now is None else now
    gone = []
    for path in uploads_dir.iterdir():
        try:
            if now - path.stat().st_mtime <= ttl_s or in_use(store, path.name):
                continue
            path.unlink()
            gone.append(path.name)
        except OSError:
            continue
    return gone


def list_uploads(uploads_dir: Path, ttl_s: float) -> list[dict[str, Any]]:
    """``{upload_id, sha256, size_bytes, format, last_used_unix, expires_unix}`` of every upload, oldest first."""
    out = []
    for path in uploads_dir.iterdir():
        try:
            st = path.stat()
        except OSError:
            continue
        sha, _, fmt = path.name.partition(".")
        out.append({"upload_id": path.name, "sha256": sha, "size_bytes": st.st_size, "format": fmt,
                    "last_used_unix": st.st_mtime, "expires_unix": st.st_mtime + ttl_s if ttl_s > 0 else None})
    return sorted(out, key=lambda u: u["last_used_unix"])
