"""``predict()`` one row per example, as TRL's padded run returns it.

A padding-free batch is one packed row; ``Trainer.prediction_step`` would hand ``evaluation_loop`` its logits and
labels as one ``[1, total]`` row for all the batch's examples. Here the test dataloader's collator also records each
example's length and first label (:class:`ExampleBounds`; the packed row masks every example's first label, which is
never a target), and :func:`per_example` cuts the row back into ``[examples, longest, ...]``: each example's logits
and labels, its own first label restored, padded with -100 to the longest example of the batch (what
``evaluation_loop`` pads across batches with). The result has the shape and the values of TRL's padded run at every
real position (its pad positions hold the model's logits for pad tokens, -100 here).
"""

from __future__ import annotations

from typing import Any

import torch

from pf_trl.batching.packing import IGNORE_INDEX

EXAMPLES_KEY = "_pf_examples"  # [(length, first label), ...] of a packed row, in order


class ExampleBounds:
    """A collator wrapper: the packed batch of ``inner`` plus :data:`EXAMPLES_KEY`."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, features):
        batch = self.inner(features)
        bounds = []
        for f in features:
            ids = f["input_ids"]
            labels = f.get("labels")
            first = (labels if labels is not None else ids)[0]
            bounds.append((len(ids), int(first)))
        batch[EXAMPLES_KEY] = bounds
        return batch


def _split(row: torch.Tensor, lengths: list[int], pad: float) -> torch.Tensor:
    """``row [1, total, ...]`` -> ``[len(lengths), max(lengths), ...]``, each piece right-padded with ``pad``."""
    flat = row.reshape(row.shape[1], *row.shape[2:]) if row.dim() >= 2 and row.shape[0] == 1 else row.reshape(-1)
    longest = max(lengths)
    out = flat.new_full((len(lengths), longest, *flat.shape[1:]), pad)
    at = 0
    for i, n in enumerate(lengths):
        out[i, :n] = flat[at:at + n]
        at += n
    return out


def per_example(logits: Any, labels: torch.Tensor | None, bounds: list[tuple[int, int]]):
    """The packed row's ``logits`` (a tensor or a tuple of them) and ``labels`` cut into one padded row per example
    (see the module docstring); anything not shaped like the row is returned as it is."""
    lengths = [n for n, _ in bounds]
    total = sum(lengths)

    def cut(t, pad):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] >= total:
            return _split(t[:, :total], lengths, pad)
        return t

    logits = tuple(cut(t, IGNORE_INDEX) for t in logits) if isinstance(logits, tuple) else cut(logits, IGNORE_INDEX)
    if labels is not None:
        labels = cut(labels, IGNORE_INDEX)
        if labels.dim() == 2 and labels.shape[0] == len(bounds):
            labels[:, 0] = torch.tensor([first for _, first in bounds], dtype=labels.dtype, device=labels.device)
    return logits, labels
