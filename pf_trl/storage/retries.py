"""Which storage errors are worth another try, for each backend, and botocore's own retries made visible.

Object stores throttle under load (S3 and its clones answer ``503 SlowDown`` or ``429``, GCS ``429`` /
``rateLimitExceeded``, Azure ``503 ServerBusy``) and fail now and then with ``500`` / ``502`` / ``504``; all of these
succeed when tried again a little later. They reach pf-trl in several shapes:

- **botocore** (s3fs): retried per request by its retry mode, configured here (:func:`botocore_retries`) from the
  standard ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` variables; a :func:`s3_session` logs each of those retries as
  one warning line. After its last attempt s3fs turns the ``ClientError`` into a plain ``OSError`` carrying only the
  server's message ("Please reduce your request rate."), with the ``ClientError`` (code and HTTP status) as its
  ``__cause__``: :func:`is_transient` follows that chain.
- **gcsfs**: ``gcsfs.retry.HttpError`` with an integer ``code`` (gcsfs has already retried it itself: 6 tries of each
  request, its own fixed backoff of 1, 2, 4, 8, 16 s plus up to 1 s; no setting changes them). gcsfs says its retries
  only at DEBUG and its giving up as an ERROR with a traceback; :class:`GcsfsRetryLines` makes each retry one warning
  line and drops the traceback (the exception reaches pf-trl, which retries the operation or fails in one line).
- **adlfs** / azure-core: ``HttpResponseError`` with ``status_code``; ``ServiceRequestError`` /
  ``ServiceResponseError`` for a connection that failed (azure-core's retry policy has already retried them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("pf_trl.storage")

__all__ = ["DEFAULT_MAX_ATTEMPTS", "GcsfsRetryLines", "botocore_retries", "error_status", "gcsfs_retry_lines",
           "is_throttled", "is_transient", "s3_session"]

DEFAULT_MAX_ATTEMPTS = 3
RETRY_MODES = ("standard", "adaptive", "legacy")
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# the error codes (S3, GCS, Azure) and message fragments of throttling and of server errors
THROTTLING = ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
              "TooManyRequestsException", "RequestThrottled", "rateLimitExceeded", "userRateLimitExceeded",
              "ServerBusy", "reduce your request rate", "Throttl")
SERVER_ERRORS = ("InternalError", "ServiceUnavailable", "RequestTimeout", "backendError", "OperationTimedOut",
                 "InternalServerError", "BadGateway", "GatewayTimeout")
CONNECTION_ERRORS = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
    "ClientConnectorError", "ServerDisconnectedError", "ClientPayloadError", "ServiceUnavailableError",
    "TransportError", "IncompleteRead", "ResponseStreamingError", "ServiceRequestError", "ServiceResponseError",
    "FSTimeoutError"})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _own_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    for name in ("status_code", "code", "status"):  # azure-core, gcsfs, aiohttp
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _own_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code") or "")
    return str(getattr(exc, "error_code", "") or "")


def error_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc`` (looked for along its cause chain), or None."""
    for e in _chain(exc):
        status = _own_status(e)
        if status is not None:
            return status
    return None


def is_throttled(exc: BaseException) -> bool:
    """True when the server throttled or failed on its side (429, 5xx, a throttling or server error code)."""
    for e in _chain(exc):
        status = _own_status(e)
        if status is not None and status in TRANSIENT_STATUS:
            return True
        text = f"{_own_code(e)} {e}"
        if any(word in text for word in THROTTLING + SERVER_ERRORS):
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """True when trying again later can succeed: throttling, a server error, a refused, dropped or timed-out
    connection. False for what another try cannot change (missing object or bucket, access denied, a bad request)."""
    if is_throttled(exc):
        return True
    for e in _chain(exc):
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if {c.__name__ for c in type(e).__mro__} & CONNECTION_ERRORS:
            return True
    return False


def botocore_retries() -> dict[str, Any]:
    """botocore's ``retries`` config: ``AWS_RETRY_MODE`` (``standard`` by default: exponential backoff with full
    jitter, a retry quota; ``adaptive`` adds client-side rate limiting) and ``AWS_MAX_ATTEMPTS`` (3 by default)."""
    mode = (os.environ.get("AWS_RETRY_MODE") or "standard").strip().lower()
    if mode not in RETRY_MODES:
        from pf_trl.storage.errors import StorageError

        raise StorageError(f"AWS_RETRY_MODE={mode!r} is not a botocore retry mode; use one of {', '.join(RETRY_MODES)}")
    raw = os.environ.get("AWS_MAX_ATTEMPTS") or str(DEFAULT_MAX_ATTEMPTS)
    try:
        attempts = int(raw)
    except ValueError:
        attempts = 0
    if attempts < 1:
        from pf_trl.storage.errors import StorageError

        raise StorageError(f"AWS_MAX_ATTEMPTS={raw!r} is not a positive number of attempts")
    # total_max_attempts counts the first request too (botocore's ``max_attempts`` key counts only the retries)
    return {"mode": mode, "total_max_attempts": attempts}


def _remember_failure(attempts: int = 0, response=None, caught_exception=None, request_dict=None, **_) -> None:
    """``needs-retry``: keep what this attempt failed with, for the warning when botocore sends the request again."""
    if request_dict is None:
        return
    if caught_exception is not None:
        what = f"{type(caught_exception).__name__}: {caught_exception}"
    elif response is not None:
        http, parsed = response
        if http.status_code < 400:
            return
        error = (parsed or {}).get("Error", {}) if isinstance(parsed, dict) else {}
        code = str(error.get("Code") or "")
        what = f"{http.status_code} {code if code != str(http.status_code) else ''}".strip()
    else:
        return
    request_dict.setdefault("context", {})["pf_trl_failure"] = " ".join(what.split())[:200]


def _warn_retry(request=None, operation_name: str = "", **_) -> None:
    """``request-created``: botocore builds a request again for each retry; one warning line names it."""
    context = getattr(request, "context", None) or {}
    attempt = (context.get("retries") or {}).get("attempt", 1)
    if attempt > 1:
        url = getattr(request, "url", "") or ""
        path = url.split("://", 1)[-1].partition("/")[2].split("?", 1)[0]
        logger.warning("pf-trl: s3: %s /%s answered %s; botocore retry %d of %d", operation_name, path,
                       context.get("pf_trl_failure", "an error"), attempt - 1,
                       botocore_retries()["total_max_attempts"] - 1)


def s3_session():
    """An aiobotocore session (the standard credential chain) whose clients log each botocore retry (one line)."""
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register("needs-retry.s3", _remember_failure)
    session.register("request-created.s3", _warn_retry)
    return session


GCSFS_RETRIES = 6  # gcsfs.core.GCSFileSystem.retries: the tries of each request (fixed when gcsfs is imported)


class GcsfsRetryLines(logging.Filter):
    """On gcsfs's logger: its ``"<call> retrying after exception: <error>"`` (DEBUG) said as one warning line, its
    ``"out of retries"`` / ``"non-retriable exception"`` records (ERROR, with a traceback) dropped: the exception is
    raised to pf-trl, which retries the operation (one line) or fails in one line. Its other records below WARNING
    pass only when someone asked for them (:func:`gcsfs_retry_lines` lowers the logger's level only when unset)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level  # what the logger's level let through before DEBUG was opened for the retry records

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.levelno >= logging.ERROR and (" out of retries on exception: " in text
                                                or " non-retriable exception: " in text):
            return False
        if " retrying after exception: " in text:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            error = " ".join(text.split(": ", 1)[-1].split())[:200] or "an error"  # gcsfs's 502 has no text
            record.msg = f"pf-trl: gcs: a request answered {error}; gcsfs tries it again (up to {GCSFS_RETRIES} tries)"
            record.args = ()
            return True
        return record.levelno >= self.level


def gcsfs_retry_lines() -> None:
    """Install :class:`GcsfsRetryLines` on gcsfs's logger (once); its DEBUG retry records are created only when the
    logger lets DEBUG through, so an unset level becomes DEBUG, the filter keeping the rest at the effective level."""
    log = logging.getLogger("gcsfs")
    if any(isinstance(f, GcsfsRetryLines) for f in log.filters):
        return
    level = log.getEffectiveLevel()
    if log.level == logging.NOTSET:
        # its modules' own loggers (gcsfs.credentials, ...; made when gcsfs is imported) keep the level they had:
        # a logger's filter does not see its children's records
        for name, child in list(logging.root.manager.loggerDict.items()):
            if name.startswith("gcsfs.") and isinstance(child, logging.Logger) and child.level == logging.NOTSET:
                child.setLevel(level)
        log.setLevel(logging.DEBUG)
    log.addFilter(GcsfsRetryLines(level))
