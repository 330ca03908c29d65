"""Rows of random token ids with the lengths and supervised positions of a real dataset (``benchmarks/data``).

A randomly initialised model does the same work whatever the ids are, so the GPU bench needs only each row's
shape: the alternating runs of unsupervised and supervised tokens (``benchmarks/gpu/make_lengths.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "data"


def load_shapes(name: str) -> dict[str, Any]:
    """The shapes document ``benchmarks/data/lengths_<name>.json``."""
    path = DATA_DIR / f"lengths_{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run python benchmarks/gpu/make_lengths.py")
    return json.loads(path.read_text())


def rows_from_shapes(shapes: list[list[int]], vocab_size: int, *, seed: int = 0,
                     max_len: int | None = None) -> list[dict[str, list[int]]]:
    """One ``{"input_ids", "labels"}`` row per shape (ids drawn from ``[3, vocab_size)``), cut at ``max_len``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for runs in shapes:
        ids = torch.randint(3, vocab_size, (sum(runs),), generator=g).tolist()
        labels, pos = [], 0
        for i, n in enumerate(runs):
            labels += ids[pos:pos + n] if i % 2 else [-100] * n
            pos += n
        if max_len:
            ids, labels = ids[:max_len], labels[:max_len]
        rows.append({"input_ids": ids, "labels": labels})
    return rows
