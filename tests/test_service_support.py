"""Helpers for the service tests (no tests here): start `pf-trl serve` as a real subprocess on
127.0.0.1, wait for readiness, poll jobs, generate data."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from conftest import write_jsonl as write_rows  # noqa: F401  (the tests' one JSONL writer, re-exported)

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

    def start(self, timeout: float = 240.0) -> Server:
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
        # a POST waits for its preflight check: seconds, more on a loaded machine
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw)

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


def wait_state(client: httpx.Client, dataset_id: str, states=("succeeded", "failed"), timeout: float = 240.0,
               predicate=None, interval: float = 0.1) -> dict:
    """The dataset's status once its state is one of ``states`` (and ``predicate`` holds), polled every
    ``interval`` seconds; AssertionError after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = client.get(f"/v1/datasets/{dataset_id}")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["state"] in states and (predicate is None or predicate(body)):
            return body
        time.sleep(interval)
    raise AssertionError(f"dataset {dataset_id} not in {states} after {timeout}s: {body}")


def post_concurrently(server: Server, names: list[str], threads: int = 10) -> list[tuple[int, str]]:
    """POST each of ``names`` (files under the server's data root) as a dataset, from ``threads`` threads at once;
    the (status, start of body) of every response."""
    results: list[tuple[int, str]] = []
    lock = threading.Lock()

    def post(batch: list[str]) -> None:
        with server.client() as client:
            for name in batch:
                r = client.post("/v1/datasets", json={"source": {"path": name}})
                with lock:
                    results.append((r.status_code, r.text[:300]))

    workers = [threading.Thread(target=post, args=(names[k::threads],)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


def fill_disk(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full (a small tmpfs in the disk-full tests)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
        except OSError:
            pass


def generated_rows(n: int, tag: str = "") -> list[dict]:
    """Short prompt/completion rows (fast to tokenize), unique per ``tag``."""
    return [{"prompt": f"### Instruction:\nRepeat number {i} {tag}.\n\n### Response:\n",
             "completion": f"The number is {i}."} for i in range(n)]


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in Path(path).rglob("*")} if Path(path).exists() else set()


# ----------------------------------------------------------------------------------- PostgreSQL
def postgres_bin() -> Path | None:
    """The directory of PostgreSQL's server binaries (initdb, pg_ctl, postgres), or None."""
    import glob
    import shutil

    candidates = [os.environ.get("PF_TRL_POSTGRES_BIN", "")]
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    which = shutil.which("pg_ctl")
    candidates += [str(Path(which).resolve().parent)] if which else []
    for d in candidates:
        if d and all(os.access(Path(d) / b, os.X_OK) for b in ("initdb", "pg_ctl", "postgres")):
            return Path(d)
    return None


class Postgres:
    """A throwaway PostgreSQL server: ``initdb`` into a private temp dir, started with ``pg_ctl`` on a free
    loopback port, password auth over TCP. PostgreSQL refuses to run as root, so as root it runs as the
    ``postgres`` user (Debian's package creates it)."""

    USER, PASSWORD = "pftrl", "pg-s3cret-in-url"

    def __init__(self, bindir: Path):
        import tempfile

        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="pf-trl-pg-"))  # not under pytest's 0700 root-owned tree
        self.port = free_port()
        self._as_user: tuple[int, int] | None = None
        if os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam("postgres")
            self._as_user = (entry.pw_uid, entry.pw_gid)
            os.chown(self.dir, *self._as_user)

    def _run(self, *args: str, timeout: float = 60) -> None:
        def drop():
            if self._as_user:
                os.setgid(self._as_user[1])
                os.setuid(self._as_user[0])

        proc = subprocess.run([str(a) for a in args], preexec_fn=drop, capture_output=True, text=True,
                              timeout=timeout, cwd=str(self.dir), env={"PATH": os.environ.get("PATH", ""),
                                                                       "LANG": "C", "LC_ALL": "C"})
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def start(self) -> Postgres:
        pwfile = self.dir / "pw"
        pwfile.write_text(self.PASSWORD)
        os.chmod(pwfile, 0o600)
        if self._as_user:
            os.chown(pwfile, *self._as_user)
        data = self.dir / "data"
        self._run(self.bindir / "initdb", "-D", data, "-U", self.USER, "--pwfile", pwfile, "--auth-host",
                  "scram-sha-256", "--auth-local", "trust", "-E", "UTF8", "--no-sync")
        pwfile.unlink()
        self._run(self.bindir / "pg_ctl", "-D", data, "-l", self.dir / "log", "-w", "-t", "60", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                  "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200", "start")
        return self

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{self.USER}:{self.PASSWORD}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self) -> str:
        """A fresh, empty database; its URL (password included)."""
        import uuid

        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        import shutil

        try:
            self._run(self.bindir / "pg_ctl", "-D", self.dir / "data", "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def postgres_or_skip() -> Postgres:
    """Start a server; skip with the reason where PostgreSQL is not installed, unless the run requires
    it (``PF_TRL_REQUIRE_POSTGRES=1``, set by scripts/test.sh, i.e. CI): then fail."""
    import pytest

    bindir = postgres_bin()
    missing = None
    if bindir is None:
        missing = "PostgreSQL server binaries (initdb, pg_ctl) are not installed"
    else:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            missing = "psycopg is not installed (pip install 'pf-trl[postgres]')"
    if missing:
        if os.environ.get("PF_TRL_REQUIRE_POSTGRES"):
            pytest.fail(f"{missing}, and this run requires PostgreSQL (PF_TRL_REQUIRE_POSTGRES=1); "
                        "run bash scripts/postgres.sh to install it")
        pytest.skip(f"{missing}: the PostgreSQL store's tests need a real server; run `bash scripts/postgres.sh` "
                    "(or scripts/test.sh, which does) to install it")
    return Postgres(bindir).start()
