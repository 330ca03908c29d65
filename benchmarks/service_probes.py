"""The preprocessing service under hostile input and faults: each probe of issue 18, against a real `pf-trl serve`.

Every probe starts what it needs (a server on a free loopback port, a 50 MB tmpfs cache when the machine allows a
mount, a throwaway PostgreSQL server), does what an attacker or a careless client would, and records what happened:
the HTTP answer, the job's end state and reason, whether anything was published, the API process's peak RSS, and
whether the API survived. Heavy probes are bounded (a server whose API passes ``--rss-cap`` or ``--time-cap`` is
killed and the probe says so), so the script is safe on a shared machine even against a service that does not hold.

Prints a table; writes ``benchmarks/results/service_probes_<label>.json``.

    python benchmarks/service_probes.py --label after [--only line_200mb parquet_long_strings] [--rss-cap 3GiB]
"""

from __future__ import annotations

from offline import REPO

# isort: split

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from test_service_support import (
    Postgres,
    Server,
    fill_disk,
    generated_rows,
    post_concurrently,
    postgres_bin,
    write_rows,
)

SECRET = "TOP-SECRET-PAYLOAD-4242"


class Watch:
    """Samples the RSS of the API process every 50 ms; kills the server past ``cap`` bytes."""

    def __init__(self, server: Server, cap: int):
        self.server, self.cap, self.peak, self.killed = server, cap, 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        proc = psutil.Process(self.server.proc.pid)
        while not self._stop.is_set():
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            if rss > self.cap:
                self.killed = True
                self.server.proc.send_signal(signal.SIGKILL)
                return
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        return self.peak


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def _alive(server: Server) -> bool:
    if server.proc.poll() is not None:
        return False
    try:
        return httpx.get(server.url + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _final(client: httpx.Client, dataset_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.time() + timeout
    body: dict[str, Any] = {}
    while time.time() < deadline:
        body = client.get(f"/v1/datasets/{dataset_id}").json()
        if body.get("state") in ("succeeded", "failed", "cancelled"):
            return body
        time.sleep(0.2)
    return body


def _post(server: Server, body: dict, timeout: float) -> tuple[int | str, dict | str, float]:
    t0 = time.perf_counter()
    try:
        r = httpx.post(server.url + "/v1/datasets", json=body, headers=server.headers, timeout=timeout)
        answer: dict | str = r.json() if r.headers.get("content-type", "").endswith("json") else r.text[:300]
        return r.status_code, answer, time.perf_counter() - t0
    except httpx.TimeoutException:
        return "timeout", f"no answer after {timeout:.0f}s", time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return "connection error", f"{type(exc).__name__}: {exc}", time.perf_counter() - t0


def _describe(status, answer, server: Server | None = None, client=None) -> dict[str, Any]:
    out: dict[str, Any] = {"http": status}
    if isinstance(answer, dict):
        if "detail" in answer:
            out["detail"] = answer["detail"][:300]
        if "id" in answer and client is not None and status in (200, 202):
            final = _final(client, answer["id"])
            out["job"] = final.get("state")
            if final.get("error"):
                out["job_error"] = f"{final['error']['type']}: {final['error']['message'][:300]}"
            out["published"] = bool(final.get("shards_path"))
            out["dataset_id"] = answer["id"]
    else:
        out["detail"] = str(answer)[:300]
    return out


def _secret_arrow(where: Path) -> Path:
    """A save_to_disk dataset with the secret, outside the data root; returns its Arrow file."""
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": f"{SECRET} prompt {i}\n", "completion": f"{SECRET} {i}"}
                                     for i in range(4)])
    ds.save_to_disk(str(where))
    return next(where.glob("*.arrow"))


def _evil_save_to_disk(folder: Path, filename: str) -> None:
    """A save_to_disk folder whose state.json names ``filename`` as its data file."""
    import datasets

    datasets.Dataset.from_list(generated_rows(3, "decoy")).save_to_disk(str(folder))
    state = json.loads((folder / "state.json").read_text())
    for p in folder.glob("*.arrow"):
        p.unlink()
    state["_data_files"] = [{"filename": filename}]
    (folder / "state.json").write_text(json.dumps(state))


def _decoded_shards(path: str) -> str:
    import datasets

    from pf_trl.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    ds = datasets.load_from_disk(path)
    return "\n".join(tok.decode(row) for row in ds["input_ids"])


# ------------------------------------------------------------------------------------------ probes
def probe_state_json_outside(ctx) -> dict[str, Any]:
    """A save_to_disk folder in the data root whose state.json names an Arrow file outside it."""
    results = {}
    arrow = _secret_arrow(ctx.outside / "secret_ds")
    for variant, name in (("relative", os.path.relpath(arrow, ctx.root / "evil_rel")), ("absolute", str(arrow))):
        folder = ctx.root / f"evil_{variant[:3]}"
        _evil_save_to_disk(folder, name)
        status, answer, _ = _post(ctx.server, {"source": {"path": folder.name}}, 120)
        out = _describe(status, answer, ctx.server, ctx.client)
        if out.get("published"):
            out["secret_in_shards"] = SECRET in _decoded_shards(str(ctx.server.cache_dir / "datasets" / out["dataset_id"]))
        results[variant] = out
    return results


def probe_state_json_non_arrow(ctx) -> dict[str, Any]:
    """The same, naming a non-Arrow file outside: does the error leak its bytes or size?"""
    secret = ctx.outside / "passwd"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" + b"daemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n" * 28)
    folder = ctx.root / "evil_passwd"
    _evil_save_to_disk(folder, os.path.relpath(secret, folder))
    status, answer, _ = _post(ctx.server, {"source": {"path": folder.name}}, 120)
    out = _describe(status, answer, ctx.server, ctx.client)
    text = json.dumps(out)
    first4 = str(int.from_bytes(b"root", "little"))
    out["leaks_first_bytes"] = first4 in text
    out["leaks_size"] = str(secret.stat().st_size) in text
    return out


def probe_deep_nesting(ctx) -> dict[str, Any]:
    """A ~40 KB JSONL row of 20,000 nested brackets (arrays, then objects) among the first 64 rows."""
    results = {}
    for kind, value in (("arrays", "[" * 20000 + "]" * 20000), ("objects", '{"a":' * 8000 + "1" + "}" * 8000)):
        src = ctx.root / f"deep_{kind}.jsonl"
        rows = [json.dumps(r) for r in generated_rows(10, "deep" + kind)]
        rows.insert(3, '{"prompt": ' + value + ', "completion": "x"}')
        src.write_text("\n".join(rows) + "\n")
        status, answer, seconds = _post(ctx.server, {"source": {"path": src.name}}, 120)
        out = _describe(status, answer, ctx.server, ctx.client if isinstance(status, int) else None)
        out["seconds"] = round(seconds, 2)
        out["api_alive_after"] = _alive(ctx.server)
        results[kind] = out
    return results


def probe_line_200mb(ctx) -> dict[str, Any]:
    """One 200 MB line: the API's peak RSS and the answer."""
    src = ctx.root / "line200.jsonl"
    with open(src, "w") as f:
        f.write('{"prompt": "')
        block = "lorem ipsum dolor sit amet " * 40000
        written = 0
        while written < 200 * 2**20:
            f.write(block)
            written += len(block)
        f.write('", "completion": "x"}\n')
    watch = Watch(ctx.server, ctx.rss_cap)
    status, answer, seconds = _post(ctx.server, {"source": {"path": src.name}}, ctx.time_cap)
    out = _describe(status, answer, ctx.server, ctx.client if isinstance(status, int) and not watch.killed else None)
    out.update(seconds=round(seconds, 2), api_peak_rss_mib=_mib(watch.stop()), killed_at_rss_cap=watch.killed,
               api_alive_after=_alive(ctx.server))
    src.unlink()
    return out


def probe_parquet_long_strings(ctx) -> dict[str, Any]:
    """A ~49 MB Parquet of 10 strings of 5 MB: POST time, API peak RSS, the job."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))) for _ in range(5000)]
    prompts = [" ".join(rng.choice(words) for _ in range(900_000))[: 5 * 10**6] for _ in range(10)]
    src = ctx.root / "long.parquet"
    # Long completions (supervised text): kept, truncated to max_seq_len, as TRL would.
    pq.write_table(pa.table({"prompt": ["Summarize:\n"] * 10, "completion": prompts}), str(src), compression="none")
    watch = Watch(ctx.server, ctx.rss_cap)
    status, answer, seconds = _post(ctx.server, {"source": {"path": src.name}}, ctx.time_cap)
    out = _describe(status, answer, ctx.server, ctx.client if isinstance(status, int) and not watch.killed else None)
    out.update(file_mb=round(src.stat().st_size / 1e6, 1), post_seconds=round(seconds, 2),
               api_peak_rss_mib=_mib(watch.stop()), killed_at_rss_cap=watch.killed, api_alive_after=_alive(ctx.server))
    return out


def _flip_token(shards: Path) -> tuple[Path, int]:
    """Change one token id in the input_ids data of a shard (one byte), keeping the file a valid Arrow stream."""
    import pyarrow as pa

    arrow = sorted(shards.glob("*.arrow"))[0]
    data = bytearray(arrow.read_bytes())
    with pa.memory_map(str(arrow)) as source:
        table = pa.ipc.open_stream(source).read_all()
    import numpy as np

    values = table.column("input_ids").chunk(0).values
    needle = np.asarray(values[5:9]).astype("<i4").tobytes()
    at = bytes(data).find(needle)
    assert at > 0, "token bytes not found"
    data[at] ^= 0x01
    arrow.write_bytes(bytes(data))
    return arrow, at


def probe_flipped_byte(ctx) -> dict[str, Any]:
    """One flipped byte in a published shard: POST again, GET, load_shards, the trainer's data path."""
    from pf_trl.data.shards import load_shards
    from pf_trl.data.sources import DataSourceError, load_training_data
    from pf_trl.data.tokenizer import load_tokenizer

    write_rows(ctx.root / "flip.jsonl", generated_rows(200, "flip"))
    body = {"source": {"path": "flip.jsonl"}}
    status, answer, _ = _post(ctx.server, body, 60)
    first = _final(ctx.client, answer["id"])
    assert first["state"] == "succeeded", first
    shards = ctx.server.cache_dir / "datasets" / answer["id"]
    arrow, at = _flip_token(shards)
    out: dict[str, Any] = {"flipped": f"{arrow.name} byte {at}"}
    copy = ctx.base / "flipped_copy"  # what a training node sees, whatever the service does next
    shutil.copytree(shards, copy)
    for name, call in (("load_shards", lambda: load_shards(copy)),
                       ("train_data_path", lambda: load_training_data(str(copy), load_tokenizer()))):
        try:
            call()
            out[name] = "opened, no error"
        except (ValueError, DataSourceError) as exc:
            out[name] = f"refused: {str(exc)[:200]}"
    got = ctx.client.get(f"/v1/datasets/{answer['id']}").json()
    out["get"] = {"state": got.get("state"), "error": (got.get("error") or {}).get("message", "")[:200]}
    status, again, _ = _post(ctx.server, body, 60)
    out["post_again"] = {"http": status, "state": again.get("state") if isinstance(again, dict) else again,
                         "error": (again.get("error") or {}).get("message", "")[:200] if isinstance(again, dict) else ""}
    return out


def probe_startup_race(ctx) -> dict[str, Any]:
    """Right after start-up: 100 valid files POSTed at once (10 threads)."""
    server = Server(ctx.base / "race-cache", [ctx.root], token=ctx.token, args=["--max-queued", "1000"]).start()
    try:
        paths = []
        for i in range(100):
            p = ctx.root / f"race_{i:03d}.jsonl"
            write_rows(p, generated_rows(3, f"race{i}"))
            paths.append(p.name)
        results = post_concurrently(server, paths)
        refused = [t for s, t in results if s >= 400]
        return {"posts": len(results), "refused": len(refused), "examples": refused[:2]}
    finally:
        server.stop()


def probe_uploads_and_disk_full(ctx) -> dict[str, Any]:
    """A 50 MB cache (tmpfs): three 20 MB uploads, a delete route, then POST and /readyz on the full disk."""
    mnt = ctx.base / "small-cache"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mnt)], capture_output=True).returncode:
        return {"skipped": "cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)"}
    server = None
    try:
        server = Server(mnt / "cache", [ctx.root], token=ctx.token, log=ctx.base / "small.log",
                        args=["--min-free-bytes", "4MB"]).start()
        out: dict[str, Any] = {"uploads": []}
        import random

        for i in range(3):
            payload = b"".join(json.dumps({"prompt": f"{i} {random.random()} " + "x" * 200, "completion": "y"}).encode()
                               + b"\n" for _ in range(20 * 2**20 // 240))
            try:
                r = httpx.post(server.url + "/v1/uploads?format=jsonl", content=payload, headers=server.headers,
                               timeout=60)
                out["uploads"].append(f"{r.status_code} {r.text[:160]}")
                if i == 0 and r.status_code in (200, 201):
                    first = r.json()["upload_id"]
            except httpx.HTTPError as exc:
                out["uploads"].append(f"error {exc}")
        d = httpx.delete(server.url + f"/v1/uploads/{first}", headers=server.headers, timeout=30)
        out["delete_upload"] = d.status_code
        # Fill the disk to the brim, then ask for work.
        fill_disk(mnt / "filler")
        write_rows(ctx.root / "small_disk.jsonl", generated_rows(50, "disk"))
        status, answer, _ = _post(server, {"source": {"path": "small_disk.jsonl"}}, 60)
        out["post_when_full"] = _describe(status, answer)
        r = httpx.get(server.url + "/readyz", timeout=10)
        out["readyz_when_full"] = f"{r.status_code} {r.headers.get('content-type')}"
        return out
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def probe_database_down(ctx) -> dict[str, Any]:
    """PostgreSQL store; the database server stops: POST and /readyz."""
    bindir = postgres_bin()
    if bindir is None:
        return {"skipped": "PostgreSQL is not installed (bash scripts/postgres.sh)"}
    pg = Postgres(bindir).start()
    server = None
    try:
        url = pg.create_database()
        server = Server(ctx.base / "pg-cache", [ctx.root], token=ctx.token, env={"PF_SERVICE_DATABASE_URL": url}).start()
        write_rows(ctx.root / "db_down.jsonl", generated_rows(20, "dbdown"))
        pg._run(pg.bindir / "pg_ctl", "-D", pg.dir / "data", "-m", "immediate", "-w", "stop")
        status, answer, _ = _post(server, {"source": {"path": "db_down.jsonl"}}, 60)
        r = httpx.get(server.url + "/readyz", timeout=30)
        return {"post": _describe(status, answer), "readyz": f"{r.status_code} {r.headers.get('content-type')}"}
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(pg.dir, ignore_errors=True)


def probe_crash_after_rename(ctx) -> dict[str, Any]:
    """A worker killed after the publish rename, before COMMIT (the supervisor then handles the dead worker)."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from preprocess_service.jobs import Supervisor
    from preprocess_service.settings import Settings
    from preprocess_service.store import open_store

    settings = Settings(cache_dir=ctx.base / "crash-cache", workers=1)
    settings.make_dirs()
    store = open_store(settings)
    job_id = "c" * 32
    store.submit(job_id, {"x": 1}, max_queued=10, exists_ok=lambda r: True)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    store.claim(victim.pid)
    src = write_rows(ctx.base / "crash.jsonl", generated_rows(30, "crash"))
    pretokenize(src, settings.scratch_dir / "built", PretokenizeConfig(), progress=False)
    os.rename(settings.scratch_dir / "built", settings.datasets_dir / job_id)  # the rename happened; COMMIT did not
    victim.kill()
    victim.wait()
    sup = Supervisor(settings, store)
    sup.procs[victim.pid] = victim
    sup.index_of[victim.pid] = 0
    sup._spawn = lambda idx: None  # do not start a real worker in this probe
    sup._check()
    row = store.get(job_id)
    resubmit, created = store.submit(job_id, {"x": 1}, max_queued=10,
                                     exists_ok=lambda r: True)
    return {"state_after_crash": row["state"], "error": (row["error"] or "")[:160],
            "dataset_dir_complete": (settings.datasets_dir / job_id / "pf_manifest.json").is_file(),
            "resubmit_requeues": bool(created and resubmit["state"] == "queued")}


PROBES: dict[str, Callable] = {
    "state_json_outside": probe_state_json_outside,
    "state_json_non_arrow": probe_state_json_non_arrow,
    "deep_nesting": probe_deep_nesting,
    "line_200mb": probe_line_200mb,
    "parquet_long_strings": probe_parquet_long_strings,
    "flipped_byte": probe_flipped_byte,
    "uploads_and_disk_full": probe_uploads_and_disk_full,
    "database_down": probe_database_down,
    "startup_race": probe_startup_race,
    "crash_after_rename": probe_crash_after_rename,
}


class Context:
    def __init__(self, base: Path, rss_cap: int, time_cap: float):
        self.base, self.rss_cap, self.time_cap = base, rss_cap, time_cap
        self.root, self.outside = base / "data", base / "outside"
        self.root.mkdir()
        self.outside.mkdir()
        self.token = "probe-token"
        self._server: Server | None = None
        self._client: httpx.Client | None = None

    @property
    def server(self) -> Server:
        if self._server is None or self._server.proc.poll() is not None:
            if self._server is not None:
                self._server.stop()
            self._server = Server(self.base / "cache", [self.root], token=self.token).start()
            self._client = httpx.Client(base_url=self._server.url, headers=self._server.headers, timeout=120)
        return self._server

    @property
    def client(self) -> httpx.Client:
        self.server  # noqa: B018 - (re)started when needed
        return self._client

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()


def main(argv: list[str] | None = None) -> int:
    from preprocess_service.settings import parse_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--only", nargs="*", choices=list(PROBES))
    ap.add_argument("--rss-cap", default="3GiB", help="kill the server when its API process passes this RSS")
    ap.add_argument("--time-cap", type=float, default=150.0, help="seconds to wait for one POST")
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="pf-probes-"))
    ctx = Context(base, parse_size(args.rss_cap, "--rss-cap"), args.time_cap)
    results: dict[str, Any] = {}
    try:
        for name in args.only or PROBES:
            t0 = time.time()
            try:
                results[name] = PROBES[name](ctx)
            except Exception as exc:
                results[name] = {"probe_error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"{name} ({time.time() - t0:.0f}s): {json.dumps(results[name], default=str)}", flush=True)
    finally:
        ctx.close()
        shutil.rmtree(base, ignore_errors=True)
    out = REPO / "benchmarks" / "results" / f"service_probes_{args.label}.json"
    existing = json.loads(out.read_text()) if out.exists() and args.only else {}
    out.write_text(json.dumps({**existing, **results}, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
