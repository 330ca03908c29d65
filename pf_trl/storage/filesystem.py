"""Bucket access: one fsspec filesystem per process and protocol, every call retried and translated into one line.

- **Credentials and endpoints** come only from each cloud's standard chain (s3fs / gcsfs / adlfs read it). With
  ``STORAGE_EMULATOR_HOST`` set, ``gs://`` goes to that GCS emulator with no credentials, as Google's own client
  library does, through gcsfs's JSON-API filesystem: gcsfs's default one first asks the Storage Control gRPC API,
  which no emulator serves, for each bucket's layout (failing, with a warning, on every operation).
- **Fork safety**: a filesystem is created in the process that uses it (keyed by pid, never fsspec's shared instance
  cache): the async loop behind an fsspec handle does not survive a fork, so a DataLoader worker or a service
  worker that forked from a parent holding one makes its own.
- **Retries in two layers, both bounded, with full-jitter exponential backoff** (:mod:`pf_trl.storage.retries`):
  each S3 request is retried by botocore's own retry mode (``standard`` by default, ``adaptive`` with
  ``AWS_RETRY_MODE=adaptive``; ``AWS_MAX_ATTEMPTS`` attempts, 3 by default): throttling (503 ``SlowDown``, 429), 5xx
  and dropped connections, one part of a multipart upload at a time; gcsfs and adlfs retry the same answers
  themselves. What still reaches Python (s3fs turns a ``ClientError`` into a plain ``OSError`` carrying the server's
  text, with the ``ClientError`` as its cause) is classified by :func:`~pf_trl.storage.retries.is_transient` and
  :func:`call` tries the whole operation :data:`ATTEMPTS` times. Every retry is one warning line. Connect timeout 5 s,
  read timeout 60 s: an unreachable endpoint fails in about 20 s, a missing bucket or wrong credentials at once.
- **One-line errors** (:class:`StorageError`) naming the URI, what failed and where credentials came from.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pf_trl.storage.credentials import credential_source, gcs_emulator
from pf_trl.storage.errors import RemoteNotFound, StorageError
from pf_trl.storage.retries import (
    botocore_retries,
    error_status,
    gcsfs_retry_lines,
    is_throttled,
    is_transient,
    s3_session,
)
from pf_trl.storage.uri import PACKAGES, RemoteURI, parse_uri

logger = logging.getLogger("pf_trl.storage")

ATTEMPTS = 4
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 8.0
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60

_FILESYSTEMS: dict[tuple[int, str], Any] = {}
T = TypeVar("T")


def _options(protocol: str) -> dict[str, Any]:
    if protocol == "s3":
        return {"config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
                                  "retries": botocore_retries()},
                "session": s3_session()}
    if protocol == "gcs":
        return {"requests_timeout": READ_TIMEOUT_S, **({"token": "anon"} if gcs_emulator() else {})}
    # adlfs: the account and credentials from AZURE_STORAGE_* / workload identity
    return {"anon": False, "connection_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}


def filesystem(uri: str | RemoteURI):
    """The fsspec filesystem serving ``uri``, made in this process (a forked child makes its own).

    Raises:
        StorageError: the protocol's package (s3fs, gcsfs, adlfs) is not installed.
    """
    protocol = parse_uri(uri).protocol
    key = (os.getpid(), protocol)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        import fsspec

        try:
            if protocol == "gcs" and gcs_emulator():
                from gcsfs.core import GCSFileSystem  # the JSON API only: no bucket-layout lookup over gRPC

                fs = GCSFileSystem(skip_instance_cache=True, use_listings_cache=False, **_options(protocol))
            else:
                fs = fsspec.filesystem(protocol, skip_instance_cache=True, use_listings_cache=False,
                                       **_options(protocol))
        except ImportError as exc:
            raise StorageError(f"{uri}: reading {protocol}:// needs the {PACKAGES[protocol]} package "
                               "(pip install 'pf-trl[cloud]')") from exc
        if protocol == "s3":
            fs.retries = 1  # s3fs's own loop off: botocore retries each request, call() the whole operation
        elif protocol == "gcs":
            gcsfs_retry_lines()  # gcsfs's retries of a request said in one line each, its give-up traceback not
        for stale in [k for k in _FILESYSTEMS if k[0] != key[0]]:
            del _FILESYSTEMS[stale]  # a parent's handles: never used in this process
        _FILESYSTEMS[key] = fs
    return fs


_status = error_status
_is_transient = is_transient


def _is_unreachable(exc: BaseException) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                         "ConnectionRefusedError"}) or isinstance(exc, ConnectionRefusedError)


def describe(uri: str | RemoteURI) -> str:
    """``"credentials from ..., endpoint ..."`` for ``uri``'s cloud."""
    return credential_source(parse_uri(uri).protocol)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def translate(uri: str | RemoteURI, what: str, exc: BaseException) -> StorageError:
    """``exc`` raised while doing ``what`` on ``uri`` as a one-line :class:`StorageError`."""
    uri = parse_uri(uri)
    where = describe(uri)
    text = _one_line(exc)
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, FileNotFoundError):
        if "bucket" in text.lower() or "container" in text.lower():
            return StorageError(f"{uri}: bucket {uri.bucket} does not exist ({what}; {where}); create it or fix the "
                                "URI")
        return RemoteNotFound(f"{uri}: not found ({what}; {where})")
    if isinstance(exc, PermissionError) or _status(exc) in (401, 403) or "AccessDenied" in text \
            or "SignatureDoesNotMatch" in text or "InvalidAccessKeyId" in text:
        return StorageError(f"{uri}: access denied ({text}) while {what}, with {where}; fix the credentials (a "
                            "Secret's keys, or the ServiceAccount's IRSA / Workload Identity annotation)")
    if is_throttled(exc):
        sdk_attempts = " or raise AWS_MAX_ATTEMPTS" if uri.protocol == "s3" else ""  # gcsfs's and adlfs's are fixed
        return StorageError(f"{uri}: the storage server kept refusing with throttling or server errors after "
                            f"{ATTEMPTS} tries ({text}) while {what}; {where}: lower the request rate (fewer ranks "
                            f"or dataloader workers reading at once){sdk_attempts}")
    if _is_unreachable(exc) or _is_transient(exc):
        endpoint = {"s3": "AWS_ENDPOINT_URL", "gcs": "STORAGE_EMULATOR_HOST"}.get(uri.protocol, "the account URL")
        return StorageError(f"{uri}: the storage endpoint is unreachable after {ATTEMPTS} tries ({text}) while "
                            f"{what}; {where}: check {endpoint} / the network")
    return StorageError(f"{uri}: {what} failed ({type(exc).__name__}: {text}); {where}")


def backoff_s(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): full jitter, uniform in ``[0, min(cap, base * 2**n)]``
    (clients throttled together do not come back together)."""
    return random.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt))


def call(uri: str | RemoteURI, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, retried on transient errors (throttling, 5xx, dropped or refused connections; bounded:
    :data:`ATTEMPTS` tries, :func:`backoff_s`), one warning line per retry; any failure raised as a one-line
    :class:`StorageError` (:class:`RemoteNotFound` for a missing object)."""
    for attempt in range(ATTEMPTS):
        try:
            return fn()
        except Exception as exc:
            if isinstance(exc, StorageError):
                raise
            if is_transient(exc) and attempt + 1 < ATTEMPTS:
                delay = backoff_s(attempt)
                logger.warning("pf-trl: %s: %s: %s; retry %d of %d in %.1f s", uri, what, _one_line(exc),
                               attempt + 1, ATTEMPTS - 1, delay)
                time.sleep(delay)
                continue
            raise translate(uri, what, exc) from exc
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------- operations on one URI


def exists(uri: str | RemoteURI) -> bool:
    u = parse_uri(uri)
    return call(u, "checking it exists", lambda: filesystem(u).exists(u.path))


def read_bytes(uri: str | RemoteURI) -> bytes:
    u = parse_uri(uri)
    return call(u, "reading it", lambda: filesystem(u).cat_file(u.path))


def write_bytes(uri: str | RemoteURI, data: bytes) -> None:
    """One PUT (atomic on S3, GCS and Azure: readers see the old object or the whole new one)."""
    u = parse_uri(uri)
    call(u, "writing it", lambda: filesystem(u).pipe_file(u.path, data))


def upload(local: str | os.PathLike, uri: str | RemoteURI) -> None:
    u = parse_uri(uri)
    call(u, f"uploading {local}", lambda: filesystem(u).put_file(os.fspath(local), u.path))


def download(uri: str | RemoteURI, local: str | os.PathLike) -> None:
    u = parse_uri(uri)
    call(u, f"downloading to {local}", lambda: filesystem(u).get_file(u.path, os.fspath(local)))


def list_files(uri: str | RemoteURI) -> dict[str, int]:
    """``{path relative to uri: size}`` of every object under prefix ``uri`` (empty when there is none)."""
    u = parse_uri(uri)

    def find():
        fs = filesystem(u)
        try:
            found = fs.find(u.path, detail=True)
        except FileNotFoundError as exc:
            if "bucket" in str(exc).lower():
                raise
            return {}
        base = u.path.rstrip("/") + "/"
        return {p[len(base):]: int(info.get("size") or 0) for p, info in found.items()
                if p.startswith(base) and info.get("type", "file") != "directory"}

    return call(u, "listing it", find)


def remove(uri: str | RemoteURI, *, recursive: bool = False) -> None:
    u = parse_uri(uri)

    def rm():
        try:
            filesystem(u).rm(u.path, recursive=recursive)
        except FileNotFoundError as exc:
            if "bucket" in str(exc).lower():
                raise

    call(u, "deleting it", rm)


def check_access(uri: str | RemoteURI) -> None:
    """Fail now, in one line, when the bucket of ``uri`` is missing, the credentials are refused or the endpoint
    is unreachable (a listing of the prefix: the cheapest request that needs all three)."""
    list_files(parse_uri(uri))


def forget_filesystems() -> None:
    """Drop this process's filesystems: the next call makes new ones from the environment as it is now (after
    credentials rotate, or in tests that change them)."""
    _FILESYSTEMS.clear()


# a forked child (a DataLoader worker) never holds its parent's handles, not even unused ones
os.register_at_fork(after_in_child=_FILESYSTEMS.clear)
