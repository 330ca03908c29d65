"""Helpers for the service tests (no tests here): start `pf-trl serve` as a real subprocess on
127.0.0.1, wait for readiness, poll jobs, generate data."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m pf_trl.cli.main serve` on a free loopback port."""

    def __init__(self, cache_dir: Path, data_roots: list[Path], *, token: str | None = None,
                 env: dict[str, str] | None = None, args: list[str] | None = None, log: Path | None = None):
        self.cache_dir, self.data_roots, self.token = Path(cache_dir), data_roots, token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_env, self.args = env or {}, args or []
        self.log_path = log or (Path(cache_dir).parent / f"server-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def start(self, timeout: float = 90.0) -> "Server":
        cmd = [sys.executable, "-m", "pf_trl.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--cache-dir", str(self.cache_dir), "--log-level", "warning", *self.args]
        for root in self.data_roots:
            cmd += ["--data-root", str(root)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PF_SERVICE_")}
        env.update({"PYTHONPATH": str(REPO), **self.extra_env})
        if self.token:
            env["PF_SERVICE_TOKEN"] = self.token
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(REPO))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30, **kw)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()


def wait_state(client: httpx.Client, dataset_id: str, states=("succeeded", "failed"), timeout: float = 90.0,
               predicate=None) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = client.get(f"/v1/datasets/{dataset_id}")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["state"] in states and (predicate is None or predicate(body)):
            return body
        time.sleep(0.1)
    raise AssertionError(f"dataset {dataset_id} not in {states} after {timeout}s: {body}")


def write_rows(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def generated_rows(n: int, tag: str = "") -> list[dict]:
    """Short prompt/completion rows (fast to tokenize), unique per ``tag``."""
    return [{"prompt": f"### Instruction:\nRepeat number {i} {tag}.\n\n### Response:\n",
             "completion": f"The number is {i}."} for i in range(n)]


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in Path(path).rglob("*")} if Path(path).exists() else set()
