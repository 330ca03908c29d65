"""The job-API conventions, secrets and observability, against a real `pf-trl serve` subprocess:
no secret in any process's argv or worker environment, Idempotency-Key, ETag / If-None-Match, the
Server-Sent Events stream (resumable, ending at a terminal state), cancel, /metrics for every end state,
JSON transition log lines; the client following the stream; and two replicas on one PostgreSQL
database and one cache volume building a dataset once for 20 concurrent identical POSTs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_service_support import REPO, Server, generated_rows, wait_state, write_rows

pytestmark = pytest.mark.slow
TOKEN = "tok-7f3a9c1e5b2d4680-do-not-leak"


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            except OSError:
                pass
    return out


def _holding(secret: str) -> list[str]:
    return [f"{pid}: {cmd[:200]}" for pid, cmd in _cmdlines().items() if secret in cmd]


def _environ_has(pid: int, secret: str) -> bool:
    return secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (the service's template process, the workers and sandboxes forked from it)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parent_of.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


@pytest.fixture(scope="module")
def pg_env(tmp_path_factory, postgres_server):
    """A token-protected service on PostgreSQL (URL with a password, through the environment) whose
    jobs are slowed down (each progress report sleeps 1 s) so that they can be watched mid-way."""
    base = tmp_path_factory.mktemp("conv")
    root = base / "data"
    root.mkdir()
    write_rows(root / "slow.jsonl", generated_rows(3000, "slow"))  # several progress reports
    write_rows(root / "small.jsonl", generated_rows(200, "small"))
    url = postgres_server.create_database()
    server = Server(base / "cache", [root], token=TOKEN, env={"PF_SERVICE_DATABASE_URL": url,
                                                              "PF_SERVICE_DEBUG_PROGRESS_DELAY_S": "1"},
                    args=["--log-level", "info"]).start()
    yield {"server": server, "root": root, "db_url": url, "password": postgres_server.PASSWORD}
    server.stop()


def _sse(client: httpx.Client, dataset_id: str, last_event_id: str | None = None, timeout: float = 120):
    """All events of one stream until the server ends it: [(id, kind, data)]."""
    headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last_event_id} if last_event_id else {})}
    events, current = [], {}
    with client.stream("GET", f"/v1/datasets/{dataset_id}/events", headers=headers, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if not line:
                if "data" in current:
                    events.append((current.get("id"), current.get("event"), json.loads(current["data"])))
                current = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                current[name] = value[1:] if value.startswith(" ") else value
    return events


# ----------------------------------------------------------------------------------------- secrets
def test_no_secret_in_any_argv_or_worker_environment_while_a_job_runs(pg_env):
    server = pg_env["server"]
    # Negative control: the scan finds a secret that *is* on a command line. The decoy says "ready" once it runs:
    # before that, a loaded machine may still show the forked parent's argv in /proc (the exec has not happened).
    decoy = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)", TOKEN],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert decoy.stdout.readline().strip() == "ready"
        assert _holding(TOKEN), "the /proc scan cannot see argv"
    finally:
        decoy.kill()
        decoy.wait()
    with server.client() as c:
        r = c.post("/v1/datasets", json={"source": {"path": "slow.jsonl"}, "options": {"max_seq_len": 300}})
        assert r.status_code == 202, r.text
        job = wait_state(c, r.json()["id"], ("running",), predicate=lambda b: b["progress"]["rows_done"] > 0)
        workers = _descendants(server.proc.pid)
        assert job["worker_pid"] in workers and len(workers) >= 3  # the template, the worker, a preflight sandbox
        for secret in (TOKEN, pg_env["password"]):
            assert _holding(secret) == [], secret  # no argv (ps) on the machine holds it
            for pid in workers:  # nor the environment of any process of the service but the API's own
                assert not _environ_has(pid, secret), (pid, secret)
        # The worker is connected to PostgreSQL (the URL reached it through its stdin pipe).
        assert c.get(f"/v1/datasets/{job['id']}").json()["progress"]["rows_done"] > 0
        # a slow machine may have finished the job meanwhile: cancelling it then is a no-op
        assert c.post(f"/v1/datasets/{job['id']}/cancel").json()["state"] in ("cancelled", "succeeded")


# ------------------------------------------------------------------------------------- conventions
def test_idempotency_key(pg_env):
    with pg_env["server"].client() as c:
        body = {"source": {"path": "small.jsonl"}, "options": {"max_seq_len": 128}}
        first = c.post("/v1/datasets", json=body, headers={"Idempotency-Key": '"retry-1"'})
        assert first.status_code in (200, 202), first.text
        again = c.post("/v1/datasets", json=body, headers={"Idempotency-Key": '"retry-1"'})
        assert again.status_code in (200, 202) and again.json()["id"] == first.json()["id"]
        other = c.post("/v1/datasets", json={**body, "options": {"max_seq_len": 64}},
                       headers={"Idempotency-Key": '"retry-1"'})
        assert other.status_code == 422 and other.headers["content-type"].startswith("application/problem+json")
        assert "already used with another request body" in other.json()["detail"]
        assert other.json()["errors"][0]["field"] == "header.idempotency-key"
        assert c.post("/v1/datasets", json=body, headers={"Idempotency-Key": "x" * 300}).status_code == 422
        assert wait_state(c, first.json()["id"])["state"] == "succeeded"
        schema = c.get("/openapi.json").json()
        params = {p["name"]: p for p in schema["paths"]["/v1/datasets"]["post"]["parameters"]}
        assert "24 hours" in params["Idempotency-Key"]["description"]


def test_etag_and_if_none_match(pg_env):
    with pg_env["server"].client() as c:
        dataset_id = c.post("/v1/datasets", json={"source": {"path": "small.jsonl"}}).json()["id"]
        status = wait_state(c, dataset_id)
        r = c.get(f"/v1/datasets/{dataset_id}")
        tag = r.headers["etag"]
        assert r.status_code == 200 and r.json() == status and tag.startswith('"')
        unchanged = c.get(f"/v1/datasets/{dataset_id}", headers={"If-None-Match": tag})
        assert unchanged.status_code == 304 and unchanged.content == b"" and unchanged.headers["etag"] == tag
        assert c.get(f"/v1/datasets/{dataset_id}", headers={"If-None-Match": '"stale"'}).status_code == 200
        schema = c.get("/openapi.json").json()
        assert "304" in schema["paths"]["/v1/datasets/{dataset_id}"]["get"]["responses"]


def test_events_stream_resumes_and_ends_at_the_terminal_state(pg_env):
    with pg_env["server"].client() as c:
        r = c.post("/v1/datasets", json={"source": {"path": "slow.jsonl"}, "options": {"max_seq_len": 200}})
        dataset_id = r.json()["id"]
        assert r.json()["progress"]["rows_total"] == 3000  # known from the line count, before any progress
        events = _sse(c, dataset_id)
        kinds = [k for _, k, _ in events]
        assert kinds[0] == "queued" and kinds[1] == "started" and kinds[-1] == "succeeded", kinds
        progress = [d for _, k, d in events if k == "progress"]
        assert len(progress) >= 2 and progress[-1]["rows_done"] == 3000
        assert all(d["rows_total"] == 3000 for _, _, d in events)
        assert [d["rows_done"] for d in progress] == sorted(d["rows_done"] for d in progress)
        assert events[-1][2]["state"] == "succeeded" and events[-1][2]["seconds"] > 0
        ids = [int(i) for i, _, _ in events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        # Resume after the second event: exactly the rest.
        rest = _sse(c, dataset_id, last_event_id=events[1][0])
        assert rest == events[2:]
        # Resuming after the terminal event: that event once more (no id), then the end; not an endless stream.
        (again,) = _sse(c, dataset_id, last_event_id=events[-1][0], timeout=30)
        assert again[0] is None and again[1] == "succeeded" and again[2]["rows_done"] == 3000
        assert c.get(f"/v1/datasets/{dataset_id}").json()["done"] is True
        assert c.get("/v1/datasets/feedface/events").status_code == 404


def test_cancel_keeps_the_job_publishes_nothing_and_a_new_post_rebuilds(pg_env):
    server = pg_env["server"]
    with server.client() as c:
        body = {"source": {"path": "slow.jsonl"}, "options": {"max_seq_len": 400}}
        dataset_id = c.post("/v1/datasets", json=body).json()["id"]
        wait_state(c, dataset_id, ("running",))
        cancelled = c.post(f"/v1/datasets/{dataset_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        assert cancelled.json()["done"] is True and cancelled.json()["error"]["type"] == "cancelled"
        time.sleep(2.0)  # the killed worker would have published by now if it were still running
        kept = c.get(f"/v1/datasets/{dataset_id}").json()
        assert kept["state"] == "cancelled" and kept["shards_path"] is None
        assert not (server.cache_dir / "datasets" / dataset_id).exists()
        assert _sse(c, dataset_id)[-1][1] == "cancelled"
        assert c.post(f"/v1/datasets/{dataset_id}/cancel").json()["state"] == "cancelled"  # a no-op
        assert c.get("/v1/datasets", params={"state": "cancelled"}).json()["items"]
        assert c.post("/v1/datasets", json=body).status_code == 202  # queued again
        assert wait_state(c, dataset_id, timeout=120)["state"] == "succeeded"
        done = c.post(f"/v1/datasets/{dataset_id}/cancel")
        assert done.status_code == 409 and "already succeeded" in done.json()["detail"]
        assert c.post("/v1/datasets/feedface/cancel").status_code == 404


def test_metrics_count_every_end_state_and_the_log_has_json_lines(pg_env):
    server = pg_env["server"]
    with server.client() as c:
        write_rows(pg_env["root"] / "to_delete.jsonl", generated_rows(20, "metrics-delete"))
        gone = c.post("/v1/datasets", json={"source": {"path": "to_delete.jsonl"}}).json()["id"]
        wait_state(c, gone)
        assert c.delete(f"/v1/datasets/{gone}").status_code == 204
        assert c.get(f"/v1/datasets/{gone}/events").status_code == 404
        # POSTed again after the DELETE: a new history (not the old `deleted` event first).
        assert c.post("/v1/datasets", json={"source": {"path": "to_delete.jsonl"}}).json()["id"] == gone
        kinds = [k for _, k, _ in _sse(c, gone)]
        assert kinds[0] == "queued" and kinds[-1] == "succeeded" and "deleted" not in kinds, kinds
        text = c.get("/metrics").text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    for result in ("succeeded", "failed", "cancelled", "deleted"):
        assert f'pf_service_jobs_finished_total{{result="{result}"}}' in values
    assert float(values['pf_service_jobs_finished_total{result="deleted"}']) >= 1
    assert float(values['pf_service_jobs_finished_total{result="succeeded"}']) >= 1
    assert "# TYPE pf_service_job_duration_seconds histogram" in text
    assert float(values["pf_service_job_duration_seconds_count"]) >= 2
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.startswith("{")]
    start = next(rec for rec in lines if rec["event"] == "service_started")
    assert start["auth"] == "on" and start["database"].startswith("postgresql://pftrl@127.0.0.1")
    assert start["workers"] == 1 and start["data_roots"] == [str(pg_env["root"])] and "cache_dir" in start
    events = {rec["event"] for rec in lines}
    assert {"job_queued", "job_started", "job_succeeded", "job_cancelled", "job_deleted"} <= events, events
    ok = next(rec for rec in lines if rec["event"] == "job_succeeded")
    assert ok["rows_done"] > 0 and ok["tokens_done"] > 0 and ok["seconds"] > 0 and len(ok["job_id"]) == 32
    log = server.log_path.read_text()
    assert TOKEN not in log and pg_env["password"] not in log


# ------------------------------------------------------------------------------------------ client
def test_client_follows_the_stream_not_the_poll(pg_env):
    from pf_trl.data.service_client import wait_for_dataset

    server = pg_env["server"]
    with server.client() as c:
        dataset_id = c.post("/v1/datasets", json={"source": {"path": "slow.jsonl"},
                                                  "options": {"max_seq_len": 100}}).json()["id"]
    t0 = time.monotonic()
    # poll_s=600: a polling client would sleep 600 s after its first look (past timeout_s); the stream ends when the
    # job does, within seconds (a generous bound: the machine may be busy).
    path = wait_for_dataset(server.url, dataset_id, token=TOKEN, poll_s=600, timeout_s=300, progress=False)
    assert time.monotonic() - t0 < 240 and path.name == dataset_id
    # A job that takes longer than timeout_s: "timed out" with the last state, stream or not.
    from pf_trl.data.service_client import DatasetServiceError

    with server.client() as c:
        slow = c.post("/v1/datasets", json={"source": {"path": "slow.jsonl"}, "options": {"max_seq_len": 90}}).json()
    for follow in (True, False):
        with pytest.raises(DatasetServiceError, match="timed out after 2s waiting for dataset .*last state"):
            wait_for_dataset(server.url, slow["id"], token=TOKEN, timeout_s=2, poll_s=0.2, progress=False,
                             follow_events=follow)
    # ...and polling (with If-None-Match) still works where the stream is not used.
    assert wait_for_dataset(server.url, dataset_id, token=TOKEN, follow_events=False, progress=False) == path


def test_progress_bar_rate_counts_only_rows_seen_progressing(capsys):
    from pf_trl.data.service_client import _RowsBar

    bar = _RowsBar("a" * 32, enabled=True)
    bar.show("succeeded", {"rows_done": 70_532_017, "rows_total": 70_532_017, "tokens_done": 1})
    rate = bar.bar.format_dict["rate"] or (bar.bar.n - bar.bar.format_dict["initial"]) / max(
        bar.bar.format_dict["elapsed"], 1e-9)
    assert rate == 0  # joining a finished job: no rows were seen being tokenized
    bar.close()
    bar = _RowsBar("b" * 32, enabled=True)
    bar.show("running", {"rows_done": 1000, "rows_total": 5000})
    time.sleep(0.5)
    bar.show("running", {"rows_done": 1500, "rows_total": 5000})
    d = bar.bar.format_dict
    assert d["n"] == 1500 and d["total"] == 5000
    assert (d["n"] - d["initial"]) / d["elapsed"] < 1500  # 500 rows in >= 0.5 s, not 1500 in ~0 s
    bar.close()


def test_train_says_one_line_when_the_service_is_unreachable(tmp_path):
    """`pf-trl train` turns every DatasetServiceError (401, 404, unreachable, failed: their one-line
    messages are checked in test_service.py::test_client_errors_are_clear) into one line and exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "pf_trl.cli.main", "train", "--model_name_or_path", "pf-trl/tiny-llama",
         "--dataset_service_url", "http://127.0.0.1:9", "--dataset_id", "feedface", "--dataset_service_timeout_s",
         "3", "--max_steps", "1", "--output_dir", str(tmp_path / "out")],
        env={**os.environ, "PF_SERVICE_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=300, cwd=str(REPO))
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and errors[-1].startswith("pf-trl train: error: "), proc.stderr[-2000:]
    assert "cannot reach the dataset service at http://127.0.0.1:9" in errors[-1], errors[-1]
    assert "check the URL (--dataset_service_url)" in errors[-1]


# ------------------------------------------------------------------------------ two replicas, one DB
def test_two_replicas_one_database_twenty_identical_posts_one_build(tmp_path, postgres_server):
    root, cache = tmp_path / "data", tmp_path / "cache"
    root.mkdir()
    write_rows(root / "shared.jsonl", generated_rows(1500, "replicas"))
    url = postgres_server.create_database()
    replicas = [Server(cache, [root], env={"PF_SERVICE_DATABASE_URL": url, "PF_SERVICE_REPLICA_ID": f"replica-{i}"},
                       args=["--log-level", "info"]) for i in range(2)]
    threads = [threading.Thread(target=r.start, kwargs={"timeout": 300}) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(r.proc and r.proc.poll() is None for r in replicas)
        body = {"source": {"path": "shared.jsonl"}, "options": {"max_seq_len": 256}}
        results, barrier = [], threading.Barrier(20)

        def one(i: int) -> None:
            with replicas[i % 2].client() as c:
                barrier.wait()
                results.append(c.post("/v1/datasets", json=body))

        t0 = time.perf_counter()
        posts = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for t in posts:
            t.start()
        for t in posts:
            t.join()
        post_s = time.perf_counter() - t0
        assert len(results) == 20 and {r.status_code for r in results} <= {200, 202}, [r.text for r in results]
        (dataset_id,) = {r.json()["id"] for r in results}
        with replicas[1].client() as c:
            final = wait_state(c, dataset_id, timeout=120)
            total_s = time.perf_counter() - t0
            assert final["state"] == "succeeded" and final["attempts"] == 1
            items = c.get("/v1/datasets", params={"limit": 200}).json()["items"]
        with replicas[0].client() as c:
            assert c.get(f"/v1/datasets/{dataset_id}").json()["manifest"] == final["manifest"]
        assert [i["id"] for i in items] == [dataset_id]  # one job in the shared database
        logs = [json.loads(line) for r in replicas for line in r.log_path.read_text().splitlines()
                if line.startswith("{")]
        builds = [rec for rec in logs if rec["event"] == "job_started" and rec["job_id"] == dataset_id]
        assert len(builds) == 1, builds  # one build, on one replica
        assert sorted(os.listdir(cache / "datasets")) == [dataset_id]
        from pf_trl.data.shards import load_shards

        assert load_shards(cache / "datasets" / dataset_id).num_rows == 1500
        print(json.dumps({"two_replicas": {"posts": 20, "jobs": len(items), "builds": len(builds),
                                           "built_on": builds[0]["replica"], "posts_s": round(post_s, 2),
                                           "post_to_succeeded_s": round(total_s, 2)}}))
    finally:
        for r in replicas:
            r.stop()
