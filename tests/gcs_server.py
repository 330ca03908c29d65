"""A real Google Cloud Storage API server for the ``gs://`` tests: the registry package ``gcp-storage-emulator`` (the
JSON API, media / multipart / resumable uploads, ranged downloads, listings and batch deletes, in pure Python).

Started on 127.0.0.1 on a free port, as a process of its own with its own data directory, and stopped by its pid.
The code under test gets the server the way a user's job gets an emulator: through ``STORAGE_EMULATOR_HOST`` (which
gcsfs reads for its endpoint, and with which pf-trl, like Google's own client library, sends no credentials),
never an argument.

Required wherever the tests run: a missing package fails the tests (the dev extra installs it) unless
``PF_TRL_SKIP_GCS=1`` says this machine has no GCS emulator.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from s3_server import stop_process_group  # the same way of stopping a server started in its own session

SKIP_ENV = "PF_TRL_SKIP_GCS"
PACKAGE = "gcp_storage_emulator"
# GCS's own answer when it is overloaded (the JSON API's error body), for tests/s3_relay.py's ``refusal``
BACKEND_ERROR = (503, "Service Unavailable", "application/json; charset=UTF-8", json.dumps(
    {"error": {"code": 503, "message": "Backend Error",
               "errors": [{"domain": "global", "reason": "backendError", "message": "Backend Error"}]}}).encode())


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class GCSServer:
    """One ``gcp-storage-emulator`` process; :meth:`env` is the environment that reaches it."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """What a process needs to reach this server (or ``endpoint``, a relay in front of it)."""
        return {"STORAGE_EMULATOR_HOST": endpoint or self.endpoint, "GOOGLE_APPLICATION_CREDENTIALS": ""}

    def start(self, timeout_s: float = 30.0) -> GCSServer:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        argv = [sys.executable, "-m", PACKAGE, "--data-dir", str(data), "start", "--host", "127.0.0.1", "--port",
                str(self.port), "--quiet"]
        log = open(self.directory / "emulator.log", "wb")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gcp-storage-emulator exited with {self.process.returncode}; see "
                                   f"{self.directory}/emulator.log")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).read()  # its health check
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not answer on {self.endpoint} within {timeout_s:.0f} s")

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
        return json.loads(raw) if raw else {}

    def make_bucket(self, name: str) -> str:
        self._json("POST", "/storage/v1/b?project=pf-trl-test", {"name": name})
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """One media upload (the test's own setup: the code under test makes its own requests)."""
        from urllib.parse import quote

        request = urllib.request.Request(
            f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}", data=data,
            method="POST", headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request, timeout=10).read()

    def get(self, bucket: str, key: str) -> bytes:
        from urllib.parse import quote

        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{bucket}/o/{quote(key, safe='')}?alt=media",
                                    timeout=10) as response:
            return response.read()

    def names(self, bucket: str, prefix: str = "") -> list[str]:
        from urllib.parse import quote

        listing = self._json("GET", f"/storage/v1/b/{bucket}/o?prefix={quote(prefix, safe='')}")
        return sorted(item["name"] for item in listing.get("items") or [])

    def delete(self, bucket: str, key: str) -> None:
        from urllib.parse import quote

        self._json("DELETE", f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}")

    def stop(self) -> None:
        stop_process_group(self.process)


def gcs_server_or_skip(directory: Path) -> GCSServer:
    """A started server; a missing ``gcp-storage-emulator`` fails the test unless ``PF_TRL_SKIP_GCS=1`` (then it
    skips)."""
    import pytest

    if os.environ.get(SKIP_ENV):
        pytest.skip(f"{SKIP_ENV} is set: this machine has no GCS emulator for the gs:// tests")
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.fail("gcp-storage-emulator is not installed: pip install -e '.[dev]' (scripts/setup.sh installs it), "
                    f"or set {SKIP_ENV}=1 where no GCS emulator can run")
    return GCSServer(directory).start()
