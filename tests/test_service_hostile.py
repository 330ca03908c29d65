"""The service under hostile input and faults, against a real `pf-trl serve` (issue 18's table, each row a test):
files outside the data roots named by a source's metadata, rows that crash or swamp readers, text far longer than
max_seq_len, a decompression bomb, hard links, compressed files, a flipped byte in a published shard (both
stores), uploads' lifecycle and quota, a full disk, the database down, a per-client rate limit, and the first
seconds after start-up. Every case is a clear 4xx/5xx problem+json or a job that fails with a named reason, and
publishes nothing."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from test_service_support import (
    Postgres,
    Server,
    fill_disk,
    generated_rows,
    post_concurrently,
    postgres_bin,
    wait_state,
    write_rows,
)

pytestmark = pytest.mark.slow
TOKEN = "hostile-token"
SECRET = "TOP-SECRET-7741"


def _save_to_disk(folder: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    return folder


def _evil_folder(folder: Path, filename: str) -> Path:
    _save_to_disk(folder, generated_rows(3, "decoy"))
    state = json.loads((folder / "state.json").read_text())
    for p in folder.glob("*.arrow"):
        p.unlink()
    state["_data_files"] = [{"filename": filename}]
    (folder / "state.json").write_text(json.dumps(state))
    return folder


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    root, outside = base / "data", base / "outside"
    root.mkdir()
    outside.mkdir()
    server = Server(base / "cache", [root], token=TOKEN,
                    args=["--max-row-group-bytes", "64MB", "--max-uploads-bytes", "3MB", "--upload-ttl-s", "6"]).start()
    yield {"base": base, "root": root, "outside": outside, "server": server}
    server.stop()


@pytest.fixture()
def client(env):
    with httpx.Client(base_url=env["server"].url, headers=env["server"].headers, timeout=120) as c:
        yield c


def _refused(r: httpx.Response, status: int, text: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["status"] == status and text in body["detail"], body
    return body


def _published(env) -> set[str]:
    return set(os.listdir(env["server"].cache_dir / "datasets"))


class PeakRss(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.proc, self.peak, self.done = psutil.Process(pid), 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


# --------------------------------------------------------------------------------- reads outside the roots
def test_save_to_disk_naming_files_outside_is_refused_and_leaks_nothing(env, client):
    import datasets

    before = _published(env)
    secret_ds = env["outside"] / "secret_ds"
    datasets.Dataset.from_list([{"prompt": f"{SECRET}\n", "completion": SECRET}] * 3).save_to_disk(str(secret_ds))
    arrow = next(secret_ds.glob("*.arrow"))
    passwd = env["outside"] / "passwd"
    passwd.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 37)
    cases = {"rel": os.path.relpath(arrow, env["root"] / "evil_rel"), "abs": str(arrow),
             "passwd": os.path.relpath(passwd, env["root"] / "evil_passwd")}
    for name, filename in cases.items():
        folder = _evil_folder(env["root"] / f"evil_{name}", filename)
        body = _refused(client.post("/v1/datasets", json={"source": {"path": folder.name}}), 422,
                        "which lies outside the folder")
        text = json.dumps(body)
        assert SECRET not in text and str(int.from_bytes(b"root", "little")) not in text
        assert str(passwd.stat().st_size) not in text and str(arrow.stat().st_size) not in text
    assert client.get("/v1/datasets").json()["items"] == []
    assert _published(env) == before
    # Negative control: the same folder with its data file inside is accepted, its hash covering that file.
    good = _save_to_disk(env["root"] / "good_ds", generated_rows(20, "good"))
    r = client.post("/v1/datasets", json={"source": {"path": good.name}})
    assert r.status_code == 202, r.text
    assert wait_state(client, r.json()["id"])["state"] == "succeeded"


def test_hardlinks_are_refused(env, client):
    outside = write_rows(env["outside"] / "linked.jsonl", generated_rows(10, "linked"))
    os.link(outside, env["root"] / "linked.jsonl")
    _refused(client.post("/v1/datasets", json={"source": {"path": "linked.jsonl"}}), 403, "hard links")
    (env["root"] / "copied.jsonl").write_bytes(outside.read_bytes())  # negative control: a copy is fine
    assert client.post("/v1/datasets", json={"source": {"path": "copied.jsonl"}}).status_code == 202


def test_a_home_directory_that_does_not_exist_is_refused_not_a_server_error(env, client):
    # `~user` of a user the service's machine does not have: pathlib raises RuntimeError while expanding it
    ghost = "~pf-trl-no-such-user-0"
    _refused(client.post("/v1/datasets", json={"source": {"path": f"{ghost}/a.jsonl"}}), 422, "cannot resolve")
    write_rows(env["root"] / "home.jsonl", generated_rows(5, "home"))
    _refused(client.post("/v1/datasets", json={"source": {"path": "home.jsonl"}, "tokenizer": f"{ghost}/tok"}),
             422, "cannot resolve")
    _refused(client.post("/v1/mixtures", json={"tokenizer": ghost, "sources": [{"source": {"path": "home.jsonl"}}]}),
             422, "cannot resolve")
    assert client.get("/readyz").status_code == 200  # the API answered each and is alive


def test_compressed_sources_are_not_accepted(env, client):
    rows = "".join(json.dumps(r) + "\n" for r in generated_rows(10, "gz")).encode()
    (env["root"] / "rows.jsonl.gz").write_bytes(gzip.compress(rows))
    _refused(client.post("/v1/datasets", json={"source": {"path": "rows.jsonl.gz"}}), 422, "supported: .json")
    (env["root"] / "disguised.jsonl").write_bytes(gzip.compress(b'{"prompt": "' + b"a" * 10**8 + b'"}\n'))
    _refused(client.post("/v1/datasets", json={"source": {"path": "disguised.jsonl"}}), 422, "source")


# ------------------------------------------------------------------------------ rows that crash or swamp readers
def test_hostile_rows_among_the_first_are_refused_and_the_api_survives(env, client):
    server = env["server"]
    before = _published(env)
    rows = [json.dumps(r) for r in generated_rows(10, "head")]
    for kind, value in (("arrays", "[" * 20000 + "]" * 20000), ("objects", '{"a":' * 8000 + "1" + "}" * 8000)):
        src = env["root"] / f"deep_{kind}.jsonl"
        src.write_text("\n".join(rows[:3] + ['{"prompt": ' + value + ', "completion": "x"}'] + rows[3:]) + "\n")
        _refused(client.post("/v1/datasets", json={"source": {"path": src.name}}), 422,
                 "line 4 nests arrays/objects deeper than 64 levels (max_json_depth)")
    big = env["root"] / "line200.jsonl"
    with open(big, "w") as f:
        f.write('{"prompt": "')
        for _ in range(200):
            f.write("lorem ipsum " * (2**20 // 12))
        f.write('", "completion": "x"}\n')
    watch = PeakRss(server.proc.pid)
    r = client.post("/v1/datasets", json={"source": {"path": big.name}})
    peak = watch.stop()
    _refused(r, 422, "line 1 is longer than 33554432 bytes (max_row_bytes)")
    assert peak < 2**30, f"the API process reached {peak / 2**20:.0f} MiB on a 200 MB line"
    big.unlink()
    assert server.proc.poll() is None and client.get("/healthz").status_code == 200
    assert _published(env) == before


def test_hostile_rows_past_the_preflight_fail_the_job_with_the_line(env, client):
    rows = [json.dumps(r) for r in generated_rows(120, "late")]
    deep = env["root"] / "late_deep.jsonl"
    deep.write_text("\n".join(rows[:99] + ['{"prompt": ' + "[" * 5000 + "]" * 5000 + ', "completion": "x"}']
                              + rows[99:]) + "\n")
    long = env["root"] / "late_long.jsonl"
    with open(long, "w") as f:
        f.write("\n".join(rows[:99]) + '\n{"prompt": "' + "z" * (40 * 2**20) + '", "completion": "x"}\n')
    for src, reason in ((deep, "line 100 nests arrays/objects deeper than 64"), (long, "line 100 is longer than")):
        r = client.post("/v1/datasets", json={"source": {"path": src.name}})
        assert r.status_code == 202, r.text
        final = wait_state(client, r.json()["id"])
        assert final["state"] == "failed" and final["error"]["type"] == "invalid_data", final["error"]
        assert reason in final["error"]["message"], final["error"]
        assert not (env["server"].cache_dir / "datasets" / r.json()["id"]).exists()
    assert client.get("/healthz").status_code == 200


def test_long_strings_are_cut_before_tokenizing_and_kept_truncated(env, client):
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = [f"w{i % 977}" for i in range(1_000_000)]
    completions = [" ".join(words[i:] + words[:i])[: 5 * 10**6] for i in range(10)]
    src = env["root"] / "long.parquet"
    pq.write_table(pa.table({"prompt": ["Summarize:\n"] * 10, "completion": completions}), str(src), compression="none")
    assert src.stat().st_size > 45 * 10**6
    watch = PeakRss(env["server"].proc.pid)
    r = client.post("/v1/datasets", json={"source": {"path": src.name}, "options": {"max_seq_len": 1024}})
    peak = watch.stop()
    assert r.status_code == 202, r.text
    assert peak < 2**30, peak
    final = wait_state(client, r.json()["id"], timeout=300)
    assert final["state"] == "succeeded", final["error"]
    counts = final["manifest"]["counts"]
    assert counts["examples"] == 10 and counts["truncated"] == 10 and counts["tokens"] == 10 * 1024


def test_parquet_decompression_bomb_is_refused(env, client):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bomb = env["root"] / "bomb.parquet"
    pq.write_table(pa.table({"prompt": ["a" * (8 * 2**20)] * 12, "completion": ["b"] * 12}), str(bomb),
                   compression="zstd", use_dictionary=False)
    assert bomb.stat().st_size < 2**20
    _refused(client.post("/v1/datasets", json={"source": {"path": bomb.name}}), 422,
             "row group 0 holds")


# ----------------------------------------------------------------------------------------- integrity
def _flip_token(shards: Path) -> Path:
    from test_integrity import flip_token

    return flip_token(shards)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def store_server(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("integrity")
    root = base / "data"
    root.mkdir()
    env = {} if request.param == "sqlite" else {
        "PF_SERVICE_DATABASE_URL": request.getfixturevalue("postgres_server").create_database()}
    server = Server(base / "cache", [root], token=TOKEN, env=env).start()
    yield server, root
    server.stop()


@pytest.mark.parametrize("found_by", ["GET", "POST"])
def test_a_flipped_byte_is_never_served_and_the_dataset_is_rebuilt(store_server, found_by):
    from pf_trl.data.shards import load_shards

    server, root = store_server
    write_rows(root / f"flip_{found_by}.jsonl", generated_rows(200, "flip" + found_by))
    body = {"source": {"path": f"flip_{found_by}.jsonl"}}
    with server.client() as c:
        dataset_id = c.post("/v1/datasets", json=body).json()["id"]
        assert wait_state(c, dataset_id)["state"] == "succeeded"
        target = server.cache_dir / "datasets" / dataset_id
        arrow = _flip_token(target)
        if found_by == "GET":
            status = c.get(f"/v1/datasets/{dataset_id}").json()
            assert status["state"] == "failed" and status["error"]["type"] == "corrupt", status
            assert arrow.name in status["error"]["message"] and "POST the same request again" in status["error"]["message"]
            assert status["shards_path"] is None and not target.exists()
            from pf_trl.data.service_client import DatasetServiceError, wait_for_dataset

            with pytest.raises(DatasetServiceError, match="corrupt"):
                wait_for_dataset(server.url, dataset_id, token=TOKEN, progress=False, poll_s=0.1)
        r = c.post("/v1/datasets", json=body)
        assert r.status_code == 202, r.text  # rebuilt, not served
        final = wait_state(c, dataset_id)
        assert final["state"] == "succeeded"
        assert load_shards(final["shards_path"]).num_rows == 200
        assert c.post("/v1/datasets", json=body).status_code == 200  # intact again: served, no work
        assert 'pf_service_datasets_withdrawn_total' in c.get("/metrics").text


# ------------------------------------------------------------------------------------------- uploads
def test_uploads_can_be_listed_deleted_are_bounded_and_expire(env, client):
    one = b"".join(json.dumps(r).encode() + b"\n" for r in generated_rows(40000, "up1"))[: 2 * 10**6]
    one = one[: one.rindex(b"\n") + 1]
    assert len(one) > 1.9 * 10**6  # two of them pass the 3 MB quota
    r = client.post("/v1/uploads?format=jsonl", content=one)
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["expires_unix"] > time.time()
    listing = client.get("/v1/uploads").json()
    assert [u["upload_id"] for u in listing["items"]] == [first["upload_id"]] and listing["quota_bytes"] == 3 * 10**6
    two = one.replace(b"up1", b"up2")
    _refused(client.post("/v1/uploads?format=jsonl", content=two), 507, "above the quota")
    assert client.delete(f"/v1/uploads/{first['upload_id']}").status_code == 204
    _refused(client.delete(f"/v1/uploads/{first['upload_id']}"), 404, "no upload")
    _refused(client.delete("/v1/uploads/passwd"), 422, "upload_id")
    r = client.post("/v1/uploads?format=jsonl", content=two)
    assert r.status_code == 201, r.text
    # Unused for upload_ttl_s (6 s here): gone.
    deadline = time.time() + 30
    while client.get("/v1/uploads").json()["items"] and time.time() < deadline:
        time.sleep(0.5)
    assert client.get("/v1/uploads").json()["items"] == []


def test_an_upload_read_by_a_queued_job_is_kept(tmp_path):
    """DELETE answers 409 and expiry waits while a queued or running job reads an upload."""
    from preprocess_service.security import ServiceError
    from preprocess_service.settings import Settings
    from preprocess_service.store import open_store
    from preprocess_service.uploads import delete_upload, expire_uploads

    settings = Settings(cache_dir=tmp_path / "cache")
    settings.make_dirs()
    store = open_store(settings)
    upload = settings.uploads_dir / ("a" * 64 + ".jsonl")
    upload.write_text('{"prompt": "q", "completion": "a"}\n')
    store.submit("f" * 32, {"source_path": str(upload)}, max_queued=5, exists_ok=lambda r: True)
    with pytest.raises(ServiceError, match="is read by job"):
        delete_upload(settings.uploads_dir, store, upload.name)
    assert expire_uploads(settings.uploads_dir, store, ttl_s=1.0, now=time.time() + 3600) == []
    store.cancel("f" * 32)
    assert expire_uploads(settings.uploads_dir, store, ttl_s=1.0, now=time.time() + 3600) == [upload.name]


# ------------------------------------------------------------------------- the machine: disk, database, load
def test_full_disk_answers_507_and_readiness_503_and_a_burst_answers_429(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a 48 MB tmpfs here (needs CAP_SYS_ADMIN): the full-disk case needs a real full disk")
    root = tmp_path / "data"
    root.mkdir()
    write_rows(root / "rows.jsonl", generated_rows(50, "full"))
    server = Server(mnt / "cache", [root], token=TOKEN, log=tmp_path / "small.log",
                    args=["--min-free-bytes", "4MB", "--rate-limit", "8"]).start()
    try:
        with server.client() as c:
            filler = mnt / "filler"
            fill_disk(filler)
            _refused(c.post("/v1/datasets", json={"source": {"path": "rows.jsonl"}}), 507, "not enough disk space")
            _refused(c.post("/v1/uploads?format=jsonl", content=b'{"a": 1}\n' * 1000), 507, "disk")
            r = httpx.get(server.url + "/readyz")
            _refused(r, 503, "not ready")
            assert r.headers["retry-after"]
            filler.unlink()
            assert httpx.get(server.url + "/readyz").status_code == 200
            codes = [c.post("/v1/datasets", json={"source": {"path": "rows.jsonl"}}).status_code for _ in range(12)]
            assert 429 in codes and set(codes) <= {200, 202, 429}, codes
            r = c.post("/v1/datasets", json={"source": {"path": "rows.jsonl"}})
            _refused(r, 429, "too many requests")
            assert int(r.headers["retry-after"]) >= 1
    finally:
        server.stop()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_database_down_answers_503_problem_json(tmp_path):
    bindir = postgres_bin()
    if bindir is None:
        if os.environ.get("PF_TRL_REQUIRE_POSTGRES"):
            pytest.fail("PostgreSQL is required here (PF_TRL_REQUIRE_POSTGRES=1)")
        pytest.skip("PostgreSQL is not installed (bash scripts/postgres.sh)")
    pg = Postgres(bindir).start()
    root = tmp_path / "data"
    root.mkdir()
    write_rows(root / "rows.jsonl", generated_rows(20, "dbdown"))
    server = Server(tmp_path / "cache", [root], token=TOKEN, env={"PF_SERVICE_DATABASE_URL": pg.create_database()}).start()
    try:
        with server.client() as c:
            dataset_id = c.post("/v1/datasets", json={"source": {"path": "rows.jsonl"}}).json()["id"]
            wait_state(c, dataset_id)
            pg._run(pg.bindir / "pg_ctl", "-D", pg.dir / "data", "-m", "immediate", "-w", "stop")
            r = c.post("/v1/datasets", json={"source": {"path": "rows.jsonl"}, "options": {"max_seq_len": 99}})
            _refused(r, 503, "database")
            assert r.headers["retry-after"]
            _refused(c.get(f"/v1/datasets/{dataset_id}"), 503, "database")
            _refused(httpx.get(server.url + "/readyz"), 503, "not ready")
            assert c.get("/healthz").status_code == 200  # alive, just not ready
    finally:
        server.stop()
        import shutil

        shutil.rmtree(pg.dir, ignore_errors=True)


def test_no_valid_file_is_refused_right_after_start_up(tmp_path):
    """The first POSTs arrive while everything warms up: 100 valid files at once, none refused (the API process
    parses nothing, so no library initialises in its threads while requests run)."""
    root = tmp_path / "data"
    root.mkdir()
    names = [write_rows(root / f"race_{i:03d}.jsonl", generated_rows(3, f"race{i}")).name for i in range(100)]
    server = Server(tmp_path / "cache", [root], token=TOKEN, args=["--max-queued", "1000"]).start()
    try:
        results = post_concurrently(server, names)
    finally:
        server.stop()
    assert len(results) == 100
    assert all(code == 202 for code, _ in results), [t for code, t in results if code != 202][:3]


def test_a_sandbox_that_crashes_or_overruns_is_replaced(tmp_path):
    """The preflight sandbox, as the API drives it: a real SIGSEGV mid-request and a request past the time limit
    each answer with what happened, and the next request is served by a fresh sandbox."""
    import signal

    from preprocess_service.preflight import PreflightError, PreflightPool
    from preprocess_service.settings import Settings

    settings = Settings(cache_dir=tmp_path / "cache", preflight_timeout_s=30)
    settings.make_dirs()
    pool = PreflightPool(settings, {**os.environ, **settings.child_env()})
    pool.start()
    try:
        fingerprint = pool.call({"op": "tokenizer", "name": "pf-trl/mistral-7b-v0.1"}, what="t")["fingerprint"]
        assert fingerprint["vocab_size"] == 32000
        slow = tmp_path / "slow.json"  # a JSON array: its nesting is scanned in full (seconds)
        slow.write_text("[" + ",".join(['{"a": [[1, 2], {"b": "[x]"}]}'] * 1_500_000) + "]")
        request = {"op": "preflight", "path": str(slow), "shown": "slow.json", "tokenizer": "pf-trl/mistral-7b-v0.1",
                   "options": {}, "rows": 64, "limits": settings.limits().to_dict()}
        (pid,) = [p.popen.pid for p in pool._all]
        threading.Timer(0.5, os.kill, args=(pid, signal.SIGSEGV)).start()
        with pytest.raises(PreflightError, match=r"crashed the sandboxed check \(signal 11"):
            pool.call(request, what="source slow.json")
        assert pool.call({"op": "tokenizer", "name": "pf-trl/mistral-7b-v0.1"}, what="t")["fingerprint"] == fingerprint
        settings.preflight_timeout_s = 0.2
        with pytest.raises(PreflightError, match=r"took more than 0.2 s"):
            pool.call(request, what="source slow.json")
        settings.preflight_timeout_s = 60
        assert pool.call({"op": "tokenizer", "name": "pf-trl/mistral-7b-v0.1"}, what="t")["fingerprint"] == fingerprint
        assert pool.ready() == 1
    finally:
        pool.stop()
