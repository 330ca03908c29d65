"""Bearer-token auth, request body limits, a per-client rate limit (pure ASGI middlewares) and path confinement
to the data roots."""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError
from preprocess_service.schemas import MAX_MIXTURE_SOURCES, PROBLEM_JSON, problem_body

PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
UPLOAD_PATH = "/v1/uploads"
MIXTURES_PATH = "/v1/mixtures"
MIXTURE_BODY_FACTOR = 2 * MAX_MIXTURE_SOURCES  # a source can be as large as a dataset request, twice over


class ServiceError(PfTrlError):
    """An error answered as problem+json: ``status``, short ``title``, ``detail`` naming the field and the fix."""

    def __init__(self, status: int, title: str, detail: str, *, kind: str, field: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.title, self.detail, self.kind, self.field = status, title, detail, kind, field
        self.headers = headers or {}

    def body(self, instance: str | None = None) -> dict[str, Any]:
        errors = [{"field": self.field, "message": self.detail}] if self.field else None
        return problem_body(self.status, self.title, self.detail, kind=self.kind, instance=instance, errors=errors)


async def send_problem(send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class BearerAuthMiddleware:
    """Requires ``Authorization: Bearer <token>`` on every route except /healthz and /readyz.

    The comparison is constant-time (hmac.compare_digest). Unknown routes need the token too, so an
    unauthenticated client learns nothing about the API surface.
    """

    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.token is None or scope.get("path") in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        header = _header(scope, b"authorization")
        problem = None
        if header is None:
            problem = "missing Authorization header; send `Authorization: Bearer <token>` (the PF_SERVICE_TOKEN of the service)"
        else:
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not given:
                problem = "Authorization header must be `Bearer <token>`"
            elif not hmac.compare_digest(given.strip().encode(), self.token):
                problem = "wrong bearer token; use the service's PF_SERVICE_TOKEN"
        if problem is None:
            return await self.app(scope, receive, send)
        await send_problem(
            send, 401,
            problem_body(401, "Unauthorized", problem, kind="unauthorized", instance=scope.get("path"),
                         errors=[{"field": "header.authorization", "message": problem}]),
            headers={"WWW-Authenticate": 'Bearer realm="pf-trl"'},
        )


class BodyLimitMiddleware:
    """413 for request bodies above the limit: ``max_body_bytes`` for JSON routes (buffered here, so a
    chunked body is counted too), ``max_upload_bytes`` for ``POST /v1/uploads`` (Content-Length checked
    here; the route counts the streamed bytes as it writes them)."""

    def __init__(self, app, max_body_bytes: int, max_upload_bytes: int):
        self.app, self.max_body, self.max_upload = app, max_body_bytes, max_upload_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        is_upload = scope.get("path") == UPLOAD_PATH
        limit = self.max_upload if is_upload else self.max_body
        if scope.get("path") == MIXTURES_PATH:  # a mixture lists up to MAX_MIXTURE_SOURCES sources
            limit *= MIXTURE_BODY_FACTOR
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await send_problem(send, 400, problem_body(
                    400, "Bad Request", f"Content-Length {length!r} is not an integer", kind="bad-request",
                    errors=[{"field": "header.content-length", "message": "must be an integer"}]))
            if declared > limit:
                return await self._too_large(send, scope, declared, limit, is_upload)
        if is_upload:
            return await self.app(scope, receive, send)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                return await self._too_large(send, scope, total, limit, is_upload)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        buffered = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        done = False

        async def replay():
            nonlocal done
            if not done:
                done = True
                return buffered
            return await receive()

        return await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(send, scope, size: int, limit: int, is_upload: bool):
        what = "upload" if is_upload else "request body"
        fix = ("split the data or ask the operator to raise --max-upload-bytes (PF_SERVICE_MAX_UPLOAD_BYTES)"
               if is_upload else "send a smaller JSON body (large data goes through POST /v1/uploads or a data-root path)")
        detail = f"{what} is {size} bytes (or more), above the limit of {limit} bytes; {fix}"
        await send_problem(send, 413, problem_body(413, "Content Too Large", detail, kind="too-large",
                                                   instance=scope.get("path"),
                                                   errors=[{"field": "body", "message": detail}]),
                           headers={"Connection": "close"})


class RateLimitMiddleware:
    """429 for a client (its address) that sends more than ``per_minute`` POST/DELETE requests a minute.

    A token bucket per address: it holds a minute's worth and refills continuously, so bursts up to
    ``per_minute`` pass. Reads (GET: polling, event streams) are not limited; writes cost work (hashing,
    a preflight, a job). Behind a proxy every client shares its address: give each tenant its own replica or
    limit at the proxy.
    """

    def __init__(self, app, per_minute: int):
        self.app, self.per_minute = app, per_minute
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def _take(self, key: str) -> float:
        """0 when a request may pass, else the seconds until one may."""
        rate = self.per_minute / 60.0
        now = time.monotonic()
        with self._lock:
            if len(self._buckets) > 10_000:  # forget idle clients (their buckets are full again anyway)
                self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < 60.0}
            tokens, then = self._buckets.get(key, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - then) * rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.per_minute or scope.get("method") not in ("POST", "DELETE", "PUT",
                                                                                        "PATCH"):
            return await self.app(scope, receive, send)
        client = scope.get("client") or ("unknown", 0)
        wait = self._take(str(client[0]))
        if wait <= 0:
            return await self.app(scope, receive, send)
        retry = max(1, math.ceil(wait))
        detail = (f"too many requests from {client[0]}: more than {self.per_minute} POST/DELETE a minute "
                  f"(--rate-limit); retry in {retry} s")
        await send_problem(send, 429, problem_body(429, "Too Many Requests", detail, kind="rate-limited",
                                                   instance=scope.get("path")), headers={"Retry-After": str(retry)})


def _is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def confine(raw: str, roots: list[Path], *, field: str, what: str = "source") -> Path:
    """See :func:`_confine`; any OS-level refusal (name too long, permission denied) is a 422 too."""
    try:
        return _confine(raw, roots, field=field, what=what)
    except OSError as exc:
        raise ServiceError(422, "Unprocessable Content", f"{field}: cannot use {raw[:200]!r}: {exc.strerror or exc}",
                           kind="invalid-path", field=field) from exc


def _confine(raw: str, roots: list[Path], *, field: str, what: str = "source") -> Path:
    """Resolve ``raw`` (symlinks followed) and require it to lie inside one of ``roots``.

    Confinement is checked before existence, so a client cannot probe for files outside the roots.
    Directories are checked file by file: a symlink inside a root pointing out of it is refused too.
    """
    if not roots:
        raise ServiceError(403, "Forbidden", f"{field}: this service has no data roots, so only uploads are "
                           "accepted; use POST /v1/uploads and `source.upload_id`, or start it with --data-root",
                           kind="path-forbidden", field=field)
    if "\x00" in raw:
        raise ServiceError(422, "Unprocessable Content", f"{field}: path contains a NUL byte", kind="invalid-path",
                           field=field)
    try:
        candidate = Path(raw).expanduser()  # `~user` of no such user (or no HOME): RuntimeError
        if not candidate.is_absolute():
            candidate = roots[0] / candidate
        resolved = candidate.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # symlink loops, an unknown home directory
        raise ServiceError(422, "Unprocessable Content", f"{field}: cannot resolve {raw!r} ({exc})",
                           kind="invalid-path", field=field) from exc
    if not any(_is_within(resolved, r) for r in roots):
        raise ServiceError(403, "Forbidden", f"{field}: {raw!r} resolves outside the data roots "
                           f"({', '.join(map(str, roots))}); put the {what} under a data root (symlinks are "
                           "followed and must stay inside)", kind="path-forbidden", field=field)
    if not resolved.exists():
        raise ServiceError(422, "Unprocessable Content", f"{field}: {raw!r} does not exist (resolved to "
                           f"{resolved}); check the path as seen by the service", kind="path-not-found", field=field)
    if resolved.is_dir():
        for p in resolved.rglob("*"):
            if p.is_symlink() and not any(_is_within(p.resolve(), r) for r in roots):
                raise ServiceError(403, "Forbidden", f"{field}: {p} inside {raw!r} links outside the data roots; "
                                   "copy the data instead of linking it", kind="path-forbidden", field=field)
    return resolved
