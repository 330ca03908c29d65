"""Shared fixtures: the embedded tokenizer, the shipped sample, tiny models built from configs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Never reach a hub from tests, even by accident.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
