"""An HTTP relay in front of the test S3 server: holds requests back (a gate), slows them (a bandwidth limit) or
throttles them (answers a share with S3's ``503 SlowDown``).

The relay forwards each request as it came, the ``Host`` header included, so the client's SigV4 signature (made for
the relay's address) still verifies at the server. What the tests of read-ahead need from it:

- ``gate``: a function called with the method and the object path before a request is forwarded; it may block
  (a file held back until the test lets it through: deterministic "not local yet");
- ``bytes_per_s``: responses paced to that rate (a bucket across a network, for the benchmark);
- ``upload_bytes_per_s``: request bodies (uploads) read at that rate, all of them sharing it (one uplink);
- ``throttle``: the share of requests answered ``503 SlowDown`` with S3's XML error body instead of being forwarded
  (drawn from a seeded generator; settable while the relay runs); ``throttled`` counts them, ``refused`` lists them;
- ``refusal``: that answer as ``(status, reason, content type, body)``, S3's by default (tests/gcs_server.py has the
  GCS JSON API's: the relay serves the GCS emulator the same way);
- ``throttle_first``: every distinct request (method and path) answered ``503 SlowDown`` that many times before it is
  forwarded (a burst longer than the SDK's own retries);
- ``throttled_paths``: a function of the method and the path saying which requests ``throttle`` and
  ``throttle_first`` apply to (all of them by default);
- ``log``: every (method, path) forwarded, in order.

Point a process at it with ``AWS_ENDPOINT_URL=relay.endpoint``.
"""

from __future__ import annotations

import http.client
import random
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
             b'request rate.</Message><RequestId>pf-trl-relay</RequestId></Error>')
SLOW_DOWN_REFUSAL = (503, "Slow Down", "application/xml", SLOW_DOWN)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that went away (a read cancelled, a kept-alive connection closed): nothing to say
        super().handle_error(request, client_address)


class S3Relay:
    """A relay on a free port of 127.0.0.1 to ``upstream`` (``host:port``); :meth:`stop` ends it."""

    def __init__(self, upstream_port: int, *, gate: Callable[[str, str], None] | None = None,
                 bytes_per_s: float | None = None, upload_bytes_per_s: float | None = None,
                 throttle: float = 0.0, seed: int = 0, throttle_first: int = 0,
                 refusal: tuple[int, str, str, bytes] = SLOW_DOWN_REFUSAL,
                 throttled_paths: Callable[[str, str], bool] | None = None) -> None:
        self.upstream_port, self.gate, self.bytes_per_s = upstream_port, gate, bytes_per_s
        self.upload_bytes_per_s, self.throttle, self.throttle_first = upload_bytes_per_s, throttle, throttle_first
        self.refusal, self.throttled_paths = refusal, throttled_paths
        self._seen: dict[tuple[str, str], int] = {}
        self.log: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []
        self.throttled = 0
        self._pace = threading.Lock()
        self._uplink = threading.Lock()
        self._draw = random.Random(seed)
        self._draw_lock = threading.Lock()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = relay._receive(self.rfile, length) if length else None
                path = self.path.split("?", 1)[0]
                if relay._should_throttle(self.command, path):
                    status, reason, content_type, text = relay.refusal
                    self.send_response_only(status, reason)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(text)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(text)
                    return
                relay.log.append((self.command, path))
                if relay.gate is not None:
                    relay.gate(self.command, path)
                upstream = http.client.HTTPConnection("127.0.0.1", relay.upstream_port, timeout=120)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP:
                            upstream.putheader(name, value)
                    upstream.endheaders(body)
                    response = upstream.getresponse()
                    data = response.read()
                    self.send_response_only(response.status, response.reason)
                    for name, value in response.getheaders():
                        if name.lower() not in _HOP and name.lower() != "content-length":
                            self.send_header(name, value)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", response.getheader("Content-Length") or "0")
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        relay._send(self.wfile, data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _should_throttle(self, method: str, path: str) -> bool:
        if self.throttled_paths is not None and not self.throttled_paths(method, path):
            return False
        with self._draw_lock:
            if self.throttle_first:
                seen = self._seen[(method, path)] = self._seen.get((method, path), 0) + 1
                if seen <= self.throttle_first:
                    self.throttled += 1
                    self.refused.append((method, path))
                    return True
            if self.throttle and self._draw.random() < self.throttle:
                self.throttled += 1
                self.refused.append((method, path))
                return True
        return False

    def _receive(self, rfile, length: int) -> bytes:
        if not self.upload_bytes_per_s:
            return rfile.read(length)
        chunk, parts = 256 * 1024, []
        with self._uplink:  # one uplink: concurrent uploads share its rate
            while length > 0:
                started = time.monotonic()
                part = rfile.read(min(chunk, length))
                if not part:
                    break
                parts.append(part)
                length -= len(part)
                left = len(part) / self.upload_bytes_per_s - (time.monotonic() - started)
                if left > 0:
                    time.sleep(left)
        return b"".join(parts)

    def _send(self, out, data: bytes) -> None:
        if not self.bytes_per_s:
            out.write(data)
            return
        chunk = 256 * 1024
        with self._pace:  # one link: concurrent responses share its rate
            for i in range(0, len(data), chunk):
                started = time.monotonic()
                out.write(data[i:i + chunk])
                left = len(data[i:i + chunk]) / self.bytes_per_s - (time.monotonic() - started)
                if left > 0:
                    time.sleep(left)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Gate:
    """Holds GETs of objects whose name ends with ``suffix`` until :meth:`allow` names them or :meth:`open` lets
    everything through. Requests wait at most ``timeout_s`` (then go through: a test fails on its assertions, never
    hangs)."""

    def __init__(self, suffix: str = ".arrow", timeout_s: float = 60.0) -> None:
        self.suffix, self.timeout_s = suffix, timeout_s
        self._allowed: set[str] = set()
        self._open = False
        self._cond = threading.Condition()
        self.held: list[str] = []

    def __call__(self, method: str, path: str) -> None:
        name = path.rsplit("/", 1)[-1]
        if method != "GET" or not name.endswith(self.suffix):
            return
        with self._cond:
            if not (self._open or name in self._allowed):
                self.held.append(name)
            self._cond.wait_for(lambda: self._open or name in self._allowed, timeout=self.timeout_s)

    def allow(self, names) -> None:
        with self._cond:
            self._allowed.update(names)
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()
