"""A real Hugging Face Hub protocol server on 127.0.0.1 for the Hub tests: olah 0.5.4 (``scripts/olah.sh`` builds its
venv) started by ``tests/olah_launcher.py``, serving git repositories that the tests build under
``DIR/models/ORG/NAME`` and ``DIR/datasets/ORG/NAME`` (plain ``git init`` + commits, files as git blobs).

The code under test reaches it the way it reaches the Hub: ``HF_ENDPOINT`` in the environment of a ``pf-trl``
process (:meth:`HubServer.env`), a fresh ``HF_HOME``.

olah is required where ``PF_TRL_REQUIRE_OLAH=1`` (scripts/test.sh, i.e. CI) and the tests fail without it; elsewhere
they skip, naming ``bash scripts/olah.sh``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = Path(__file__).resolve().parent / "olah_launcher.py"
# the Hub's environment a test run must not inherit (scripts/test.sh sets offline flags for the rest of the suite)
HUB_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE",
           "HF_DATASETS_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")


def olah_python() -> str | None:
    """The python of olah's venv: ``$PF_TRL_OLAH_PYTHON``, else ``.venv-olah`` of this checkout, if installed."""
    given = os.environ.get("PF_TRL_OLAH_PYTHON")
    for candidate in (given, str(ROOT / ".venv-olah" / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def olah_or_skip() -> str:
    import pytest

    python = olah_python()
    if python is None:
        missing = "olah (a self-hosted Hub mirror) is not installed"
        if os.environ.get("PF_TRL_REQUIRE_OLAH"):
            pytest.fail(f"{missing}, and this run requires it (PF_TRL_REQUIRE_OLAH=1); run bash scripts/olah.sh")
        pytest.skip(f"{missing}: the Hub tests need a real Hub server; run `bash scripts/olah.sh` (or "
                    "scripts/test.sh, which does) to install it")
    return python


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


class HubServer:
    """olah serving ``root`` (``root/models/ORG/NAME``, ``root/datasets/ORG/NAME``) on a free port."""

    def __init__(self, python: str, root: Path):
        self.python, self.root = python, Path(root)
        self.rules = self.root / "rules.json"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ repositories

    def repo(self, repo_type: str, repo_id: str) -> Path:
        """The git repository of ``repo_id`` (``models`` / ``datasets``), created on ``main`` when missing."""
        path = self.root / "mirrors" / repo_type / repo_id
        if not (path / ".git").is_dir():
            path.mkdir(parents=True, exist_ok=True)
            _git(path, "init", "-q", "-b", "main")
        return path

    def commit(self, repo_type: str, repo_id: str, files: dict[str, bytes | str | Path], message: str = "c",
               *, tag: str | None = None) -> str:
        """Write ``files`` (bytes, text, or a file to copy) into the repository and commit them; returns the sha."""
        path = self.repo(repo_type, repo_id)
        for name, content in files.items():
            target = path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                target.write_bytes(content.read_bytes())
            elif isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content, encoding="utf-8")
        _git(path, "add", "-A")
        _git(path, "commit", "-q", "-m", message)
        if tag:
            _git(path, "tag", tag)
        return _git(path, "rev-parse", "HEAD")

    def repo_head(self, repo_type: str, repo_id: str, revision: str = "HEAD") -> str:
        """The commit ``revision`` names in the repository ``repo_id``."""
        return _git(self.repo(repo_type, repo_id), "rev-parse", revision)

    def set_rules(self, **rules) -> None:
        """The launcher's access rules (``gated={"ORG/NAME": token}``, ``busy=N``), read on each request."""
        self.rules.write_text(json.dumps(rules), encoding="utf-8")

    # ------------------------------------------------------------------ server

    def start(self, timeout_s: float = 60.0) -> HubServer:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        (self.root / "mirrors").mkdir(parents=True, exist_ok=True)
        self.set_rules()
        config = self.root / "olah.toml"
        config.write_text(
            f'[basic]\nhost = "127.0.0.1"\nport = {self.port}\nrepos-path = "{self.root / "olah-cache"}"\n'
            f'mirrors-path = ["{self.root / "mirrors"}"]\n\n[accessibility]\noffline = true\n', encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k not in HUB_ENV}
        env["PF_TRL_OLAH_RULES"] = str(self.rules)
        self.log = open(self.root / "olah.log", "wb")  # closed in stop()
        self.proc = subprocess.Popen([self.python, str(LAUNCHER), "--config", str(config)], cwd=self.root,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"olah exited with {self.proc.returncode}: {self.tail()}")
            try:
                urllib.request.urlopen(f"{self.url}/api/models/none/none", timeout=2)
            except urllib.error.HTTPError:
                return self  # it answers (404/401 for a repository it does not have)
            except OSError:
                time.sleep(0.2)
                continue
            return self
        self.stop()
        raise RuntimeError(f"olah did not answer within {timeout_s:.0f}s: {self.tail()}")

    def tail(self) -> str:
        try:
            return (self.root / "olah.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "log", None):
            self.log.close()

    def env(self, hf_home: Path, **extra: str) -> dict[str, str]:
        """The environment of a process that uses this server as its Hub (a fresh cache under ``hf_home``)."""
        env = {k: v for k, v in os.environ.items() if k not in HUB_ENV}
        env.update(HF_ENDPOINT=self.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_ETAG_TIMEOUT="10", HF_HUB_DOWNLOAD_TIMEOUT="20", **extra)
        return env


def closed_port() -> int:
    """A port nothing listens on (an unreachable Hub)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


PYTHON = sys.executable
