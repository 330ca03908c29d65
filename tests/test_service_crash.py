"""Crash safety: kill -9 the server mid-job, restart on the same cache dir; plus the job store's
recovery rules and disk-full handling, exercised in-process."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest

from test_service_support import Server, files_under, generated_rows, wait_state, write_rows


def _alive(pid: int) -> bool:
    from preprocess_service.jobs import pid_alive

    return pid_alive(pid)


@pytest.fixture(params=["sqlite", "postgres"])
def database_env(request) -> dict[str, str]:
    """The environment that points a server at a store: nothing (SQLite in its cache dir) or a fresh
    PostgreSQL database (the URL, password included, reaches the server through its environment)."""
    if request.param == "sqlite":
        return {}
    return {"PF_SERVICE_DATABASE_URL": request.getfixturevalue("postgres_server").create_database()}


@pytest.mark.slow
def test_kill_9_mid_job_then_restart(tmp_path, database_env):
    from pf_trl.data.shards import load_shards

    db = database_env
    root, cache = tmp_path / "data", tmp_path / "cache"
    root.mkdir()
    write_rows(root / "earlier.jsonl", generated_rows(300, "earlier"))
    write_rows(root / "big.jsonl", generated_rows(6000, "big"))  # 8 progress chunks of 750 rows

    # 1. An earlier dataset, built normally; graceful stop.
    s1 = Server(cache, [root], env=db).start()
    with s1.client() as c:
        earlier = c.post("/v1/datasets", json={"source": {"path": "earlier.jsonl"}}).json()["id"]
        assert wait_state(c, earlier)["state"] == "succeeded"
    s1.stop()
    earlier_manifest = json.loads((cache / "datasets" / earlier / "pf_manifest.json").read_text())

    # 2. A slow job (TEST-ONLY hook: each progress callback sleeps 3 s), killed with SIGKILL mid-way.
    s2 = Server(cache, [root], env={**db, "PF_SERVICE_DEBUG_PROGRESS_DELAY_S": "3"}).start()
    try:  # a failed check must not leave the server running
        with s2.client() as c:
            r = c.post("/v1/datasets", json={"source": {"path": "big.jsonl"}})
            assert r.status_code == 202
            big = r.json()["id"]
            # The API stays responsive while the worker tokenizes; progress reaches it from the worker.
            latencies, deadline, running = [], time.time() + 60, None
            while time.time() < deadline:
                t0 = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                status = c.get(f"/v1/datasets/{big}").json()
                latencies.append(time.perf_counter() - t0)
                if status["state"] == "running" and status["progress"]["rows_done"] > 0:
                    running = status
                    break
                time.sleep(0.05)
            assert running is not None, "the job never reported progress"
            for _ in range(5):  # and it keeps answering fast while the job runs (each chunk sleeps 3 s)
                t0 = time.perf_counter()
                assert c.get(f"/v1/datasets/{big}").json()["state"] == "running"
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
            assert running["progress"]["rows_total"] == 6000 and 0 < running["progress"]["rows_done"] < 6000
            assert running["progress"]["tokens_done"] > 0 and running["progress"]["fraction"] < 1
            # an API blocked by the job would take a chunk's 3 s sleep to answer; a busy machine adds well under that
            assert len(latencies) >= 5 and max(latencies) < 2.5, latencies
            worker_pid = running["worker_pid"]
            assert worker_pid and _alive(worker_pid)
    except BaseException:
        s2.stop()
        raise
    s2.kill9()

    # The worker dies with the server (parent watchdog), and nothing partial is visible.
    deadline = time.time() + 30  # its watchdog polls the parent; a busy machine may take a few seconds
    while _alive(worker_pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(worker_pid), f"worker {worker_pid} outlived the killed server"
    assert sorted(os.listdir(cache / "datasets")) == [earlier]

    # 3. Restart: the interrupted job is re-run (attempt 2) and succeeds; the earlier dataset is intact.
    s3 = Server(cache, [root], env=db).start()
    try:
        with s3.client() as c:
            final = wait_state(c, big, timeout=120)
            assert final["state"] == "succeeded", final
            assert final["attempts"] == 2
            ds = load_shards(cache / "datasets" / big)
            assert ds.num_rows == 6000
            again = c.post("/v1/datasets", json={"source": {"path": "earlier.jsonl"}})
            assert again.status_code == 200 and again.json()["manifest"] == earlier_manifest
        assert load_shards(cache / "datasets" / earlier).num_rows == 300
        # Only the scratch dirs of workers (w<pid>) and of the preflight sandbox (empty between requests) remain.
        assert not [p for p in files_under(cache / "tmp") if not p.split("/")[-1].startswith(("w", "r-", "preflight"))]
    finally:
        s3.stop()


# ----------------------------------------------------------------------------- store, in-process
@pytest.fixture(params=["sqlite", "postgres"])
def store_settings(request, tmp_path):
    """``(settings, store)`` on each store: SQLite in the cache dir, or a fresh PostgreSQL database."""
    from preprocess_service.settings import Settings
    from preprocess_service.store import open_store

    url = request.getfixturevalue("postgres_server").create_database() if request.param == "postgres" else None
    settings = Settings(cache_dir=tmp_path / "cache", database_url=url)
    settings.make_dirs()
    return settings, open_store(settings)


def _claimed(store, job_id, pid, request=None):
    row, created = store.submit(job_id, request or {"x": 1}, max_queued=10, exists_ok=lambda r: True)
    assert created
    claimed = store.claim(pid)
    assert claimed["id"] == job_id and claimed["state"] == "running"
    return claimed


DEAD_PID = 2**22 + 12345  # above the default pid_max: never a live process


def test_reconcile_requeues_then_fails_with_reason(store_settings):
    settings, store = store_settings
    _claimed(store, "a" * 32, DEAD_PID)
    kw = dict(datasets_dir=settings.datasets_dir, max_attempts=2, heartbeat_timeout_s=10.0, startup=True)
    assert store.reconcile(**kw) == [("a" * 32, "requeued")]
    assert store.get("a" * 32)["state"] == "queued"
    store.claim(DEAD_PID)
    assert store.reconcile(**kw) == [("a" * 32, "failed")]
    row = store.get("a" * 32)
    assert row["state"] == "failed" and row["error_type"] == "interrupted"
    assert "gave up after 2 attempt(s)" in row["error"] and "POST the same request again" in row["error"]


def test_reconcile_keeps_a_job_with_a_fresh_heartbeat_and_live_pid(store_settings):
    settings, store = store_settings
    _claimed(store, "b" * 32, os.getpid())  # alive, heartbeat just written
    assert store.reconcile(datasets_dir=settings.datasets_dir, max_attempts=2, heartbeat_timeout_s=10.0,
                           startup=True) == []
    # ...but once its heartbeat is stale it is an orphan.
    assert store.reconcile(datasets_dir=settings.datasets_dir, max_attempts=2, heartbeat_timeout_s=-1.0) == [
        ("b" * 32, "requeued")]


def test_reconcile_recovers_a_job_published_before_the_crash(store_settings, sample_shards):
    import shutil

    settings, store = store_settings
    _claimed(store, "c" * 32, DEAD_PID)
    shutil.copytree(sample_shards, settings.datasets_dir / ("c" * 32))
    assert store.reconcile(datasets_dir=settings.datasets_dir, max_attempts=1, heartbeat_timeout_s=10.0,
                           startup=True) == [("c" * 32, "recovered")]
    row = store.get("c" * 32)
    assert row["state"] == "succeeded" and json.loads(row["manifest"])["counts"]["examples"] > 0


def test_submit_is_idempotent_and_bounded(store_settings):
    from preprocess_service.store import QueueFull

    settings, store = store_settings
    row, created = store.submit("d" * 32, {}, max_queued=1, exists_ok=lambda r: True)
    assert created
    again, created = store.submit("d" * 32, {}, max_queued=1, exists_ok=lambda r: True)
    assert not created and again["seq"] == row["seq"]
    with pytest.raises(QueueFull):
        store.submit("e" * 32, {}, max_queued=1, exists_ok=lambda r: True)


def _request(settings, src: Path):
    from pf_trl.data.pretokenize import source_fingerprint
    from pf_trl.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    tok = load_tokenizer()
    from pf_trl.data.pretokenize import PretokenizeConfig

    return {"source_path": str(src), "source_size": src.stat().st_size, "source_sha256": source_fingerprint(src),
            "tokenizer": "pf-trl/mistral-7b-v0.1", "tokenizer_sha256": tokenizer_fingerprint(tok)["sha256"],
            "options": PretokenizeConfig().to_dict()}


def _mixture_request(settings, sources: list[Path]):
    """A mixture job's request, as POST /v1/mixtures records it: every source with its hash, and the rule."""
    from pf_trl.data.pretokenize import source_fingerprint

    single = _request(settings, sources[0])
    parts = [{"name": f"part{i}", "source_path": str(src), "source_shown": {"path": str(src)},
              "source_sha256": source_fingerprint(src), "source_size": src.stat().st_size,
              "options": single["options"], "weight": 1.0} for i, src in enumerate(sources)]
    return {**single, "kind": "mixture", "sources": parts, "source_path": None,
            "source_size": sum(p["source_size"] for p in parts),
            "mixture": {"seed": 42, "sample_by": "examples", "stopping_strategy": "all_exhausted"}}


def test_mixture_below_min_free_fails_before_tokenizing(tmp_path, monkeypatch, store_settings):
    """The early free-space check of a single source holds for a mixture (all its sources counted)."""
    import pf_trl.data.pretokenize as pt
    from pf_trl.data.tokenizer import TokenizerCache
    from preprocess_service.worker import run_job

    settings, store = store_settings
    sources = [write_rows(tmp_path / f"mix{i}.jsonl", generated_rows(10, f"mix{i}")) for i in range(2)]
    job = _claimed(store, "d" * 32, os.getpid(), _mixture_request(settings, sources))
    monkeypatch.setattr(pt, "pretokenize", lambda *a, **kw: pytest.fail("tokenized despite a full disk"))
    settings.min_free_bytes = 1 << 62
    assert run_job(settings, store, job, TokenizerCache(), os.getpid()) == "failed"
    row = store.get("d" * 32)
    assert row["state"] == "failed" and row["error_type"] == "disk_full", (row["error_type"], row["error"])
    assert "disk full" in row["error"] and "free space" in row["error"]
    assert not (settings.datasets_dir / ("d" * 32)).exists()


@pytest.mark.parametrize("how", ["enospc-while-writing", "below-min-free"])
def test_disk_full_fails_the_job_and_leaves_other_datasets(tmp_path, monkeypatch, sample_shards, how, store_settings):
    import shutil

    import pf_trl.data.pretokenize as pt
    from pf_trl.data.tokenizer import TokenizerCache
    from preprocess_service.worker import run_job

    settings, store = store_settings
    other = settings.datasets_dir / ("0" * 32)
    shutil.copytree(sample_shards, other)
    before = files_under(other)
    src = write_rows(tmp_path / "rows.jsonl", generated_rows(20, how))
    job = _claimed(store, "f" * 32, os.getpid(), _request(settings, src))
    if how == "enospc-while-writing":
        real = pt.pretokenize

        def full_disk(source, output_dir, *a, **kw):
            Path(output_dir).parent.mkdir(parents=True, exist_ok=True)
            (Path(output_dir).parent / "partial.arrow").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(pt, "pretokenize", full_disk)
        assert real is not full_disk
    else:
        settings.min_free_bytes = 1 << 62
    assert run_job(settings, store, job, TokenizerCache(), os.getpid()) == "failed"
    row = store.get("f" * 32)
    assert row["state"] == "failed" and row["error_type"] == "disk_full"
    assert "disk full" in row["error"] and "free space" in row["error"]
    assert not (settings.datasets_dir / ("f" * 32)).exists()
    assert files_under(other) == before
    assert not [p for p in files_under(settings.scratch_dir) if p.count("/") >= 1], files_under(settings.scratch_dir)


def test_settings_from_env_and_flags(tmp_path):
    from preprocess_service.settings import Settings, SettingsError

    root = tmp_path / "r"
    root.mkdir()
    env = {"PF_SERVICE_CACHE_DIR": str(tmp_path / "c"), "PF_SERVICE_DATA_ROOTS": str(root),
           "PF_SERVICE_MAX_UPLOAD_BYTES": "2MiB", "PF_SERVICE_WORKERS": "3", "PF_SERVICE_TOKEN": "t"}
    s = Settings.load({"workers": 2}, env=env)
    assert s.workers == 2 and s.max_upload_bytes == 2 * 2**20 and s.data_roots == [root.resolve()] and s.token == "t"
    with pytest.raises(SettingsError, match="PF_SERVICE_MAX_UPLOAD_BYTES"):
        Settings.load(env={**env, "PF_SERVICE_MAX_UPLOAD_BYTES": "lots"})
    with pytest.raises(SettingsError, match="overlaps the cache dir"):
        Settings.load(env={**env, "PF_SERVICE_CACHE_DIR": str(root / "cache")})


def test_concurrent_claims_never_take_a_job_twice(store_settings):
    """Two replicas' stores (PostgreSQL: SKIP LOCKED; SQLite: the write lock), four claiming threads each:
    every queued job is claimed exactly once."""
    import threading

    from preprocess_service.store import open_store

    settings, store = store_settings
    for i in range(40):
        store.submit(f"{i:032x}", {"i": i}, max_queued=100, exists_ok=lambda r: True)
    other = open_store(settings)
    if settings.database_url:
        other.replica = "replica-b"  # a second replica on the same database
    claimed: list[tuple[str, str]] = []
    lock = threading.Lock()

    def claimer(s, pid: int) -> None:
        while (job := s.claim(pid)) is not None:
            with lock:
                claimed.append((job["id"], s.replica))

    threads = [threading.Thread(target=claimer, args=(s, 1000 + k)) for k, s in enumerate([store, other] * 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [job_id for job_id, _ in claimed]
    assert sorted(ids) == sorted(f"{i:032x}" for i in range(40)) and len(set(ids)) == 40
    assert store.counts_by_state()["running"] == 40
    started = [e for i in range(40) for e in store.events(f"{i:032x}") if e["kind"] == "started"]
    assert len(started) == 40  # one start event per job


# ------------------------------------------------------------------- crash-point injection (real workers)
def _wait_terminal(store, job_id: str, timeout: float = 120.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        row = store.get(job_id)
        if row["state"] in ("succeeded", "failed"):
            return row
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {store.get(job_id)['state']} after {timeout}s")


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """One template process for the module's supervisors (the service has one per replica): forked workers start
    warm, so each crash case pays for its crash, not for a template's imports. Its environment's caches are the
    module's; the jobs read local files with the embedded tokenizer."""
    from preprocess_service.forks import ForkServer
    from preprocess_service.jobs import child_environment
    from preprocess_service.settings import Settings

    server = ForkServer(child_environment(Settings(cache_dir=tmp_path_factory.mktemp("forks"))))
    yield server
    server.stop()


def _run_workers(settings, store, job_id: str, forks) -> dict:
    """Real worker processes under a supervisor, until the job ends; its row."""
    from preprocess_service.jobs import Supervisor

    supervisor = Supervisor(settings, store, forks)
    supervisor.start()
    try:
        return _wait_terminal(store, job_id)
    finally:
        supervisor.stop()


def _agree(settings, row) -> None:
    """State and disk agree: succeeded <=> a complete dataset that verifies against the recorded manifest."""
    from pf_trl.data.shards import is_shards_dir, read_manifest, verify_shards

    target = settings.datasets_dir / row["id"]
    assert (row["state"] == "succeeded") == is_shards_dir(target), (row["state"], row["error"], files_under(target))
    if row["state"] == "succeeded":
        recorded = json.loads(row["manifest"])
        assert read_manifest(target) == recorded
        assert verify_shards(target, recorded) > 0
    leftovers = [p for p in files_under(settings.scratch_dir) if row["id"] in p]
    assert not leftovers, leftovers


@pytest.mark.slow
@pytest.mark.parametrize("kind,step,expected", [
    *[("dataset", step, expected) for step, expected in (("claimed", "failed"), ("written", "failed"),
                                                         ("renamed", "succeeded"), ("committed", "succeeded"))],
    ("mixture", "written", "failed"), ("mixture", "renamed", "succeeded"),  # the two sides of a mixture's publish
])
def test_state_and_disk_agree_after_a_worker_crash_at_any_step(store_settings, tmp_path, step, expected, kind, forks):
    """A worker SIGKILLs itself (TEST-ONLY hook) after claiming, after writing the shards, after the publish rename
    (before COMMIT), after COMMIT; the supervisor handles the dead worker. Then the same request again: a
    succeeded job is not run again, a failed one is rebuilt (by a worker without the hook). Mixture jobs pass the
    crash points on either side of their publish rename (the others are the dataset's code path)."""
    settings, store = store_settings
    if kind == "mixture":
        request = _mixture_request(settings, [write_rows(tmp_path / f"rows{i}.jsonl", generated_rows(20, f"{step}{i}"))
                                              for i in range(2)])
    else:
        request = _request(settings, write_rows(tmp_path / "rows.jsonl", generated_rows(40, step)))
    job_id = f"{kind[0]}{step:0>31}"[-32:]
    store.submit(job_id, request, max_queued=10, exists_ok=lambda r: True)
    settings.debug_crash_at = step
    row = _run_workers(settings, store, job_id, forks)
    assert row["state"] == expected, (row["state"], row["error"])
    if expected == "failed":
        assert row["error_type"] == "worker_died" and "signal 9" in row["error"]
    else:
        assert row["attempts"] == 1  # published once; the supervisor recorded it, nothing re-ran
    _agree(settings, row)
    from pf_trl.data.shards import is_shards_dir

    again, created = store.submit(job_id, request, max_queued=10,
                                  exists_ok=lambda r: r["state"] != "succeeded" or is_shards_dir(settings.datasets_dir / job_id))
    assert created == (expected == "failed")
    if created:
        settings.debug_crash_at = ""
        row = _run_workers(settings, store, job_id, forks)
        assert row["state"] == "succeeded"
        _agree(settings, row)
