"""Shared fixtures: the embedded tokenizer, the shipped sample, tiny models built from configs."""

from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path

import pytest

# Never reach the Hub from tests, even by accident (tests/test_hub.py runs its processes online against its own Hub
# server on 127.0.0.1: HF_ENDPOINT set, these unset).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _cheap_upstream_bookkeeping():
    """Two costs every trainer pays at construction made cheap for the session, without changing a result:
    datasets' fingerprint of a tokenizer, accelerate's package checks (tests/upstream_shortcuts.py says how)."""
    from upstream_shortcuts import install

    remove = install()
    yield
    remove()


@pytest.fixture(scope="module", autouse=True)
def _collect_only_young_objects():
    """Every ``Trainer.train()`` runs two full ``gc.collect()`` (accelerate's ``free_memory``), which in a test process
    holding torch, transformers, TRL and datasets walk half a million objects each (0.3-1 s a run, hundreds of runs in
    a suite). What exists when a module starts (imports, session fixtures, earlier modules' caches) is collected once
    and then left out of later collections (``gc.freeze``); each module's own objects are collected as usual."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session")
def tokenizer():
    from pf_trl.data.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def sample_path() -> Path:
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    return SHAREGPT_SAMPLE


@pytest.fixture(scope="session")
def sample_rows(sample_path) -> list[dict]:
    with open(sample_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def sample_shards(tmp_path_factory, sample_path) -> Path:
    """The shipped sample pretokenized once per test session (max_seq_len 1024)."""
    from pf_trl.data.pretokenize import pretokenize

    out = tmp_path_factory.mktemp("shards") / "sharegpt"
    pretokenize(sample_path, out, progress=False)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server for the service's PostgreSQL store (tests/test_service_support.py)."""
    from test_service_support import postgres_or_skip

    server = postgres_or_skip()
    yield server
    server.stop()


# Modules run whole on one pytest-xdist worker (scripts/test.sh: -n N --dist loadgroup): their tests share an
# expensive module fixture (a server, the coverage sweep, a torchrun reference) that another worker would rebuild.
ONE_WORKER_MODULES = frozenset({
    "tests/test_coverage.py", "tests/test_distributed.py", "tests/test_sequence_parallel.py", "tests/test_sharded.py",
    "tests/test_service.py", "tests/test_service_conventions.py", "tests/test_service_data_options.py",
    "tests/test_service_fuzz.py", "tests/test_service_hostile.py", "tests/test_k8s_object_storage.py",
    "tests/test_storage.py", "tests/test_bucket_training.py", "tests/test_read_ahead.py",
    "tests/test_bucket_models.py", "tests/test_bucket_throttling.py", "tests/test_checkpoint_uploads.py",
    "tests/test_bucket_gcs.py",
    "tests/test_hub.py", "tests/test_gpu_runbook_dry_run.py", "tests/test_dpo_distributed.py", "tests/test_parts.py",
})


@pytest.hookimpl(optionalhook=True)  # the legacy venv has no pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the modules above as groups and every other test on whichever worker is free.

    xdist's own loadgroup reads ``xdist_group`` marks by rewriting ``item._nodeid``, which pytest 9 no longer reads
    (node ids are ``NodeId`` objects): the marks would be silently ignored, so the groups are named here instead.
    Groups are handed out first (xdist orders work units by size), single tests after them.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModuleGroups(config, log)


class LogRecords(logging.Handler):
    """Every message logged to the logger it is added to (any level), for tests of what a run says."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())
