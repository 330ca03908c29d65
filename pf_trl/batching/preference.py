"""Token counts of preference pairs as the padding-free preference trainers pack them.

A micro-batch of ``n`` pairs is one packed row of ``2n`` sequences, in TRL's order: prompt+chosen of every pair, then
prompt+rejected of every pair (the collator is :class:`~pf_trl.trainer.preference.collate.PackedRowCollator`, the row
:class:`~pf_trl.trainer.packed.PackedRow`). The pairs stay whole: the sampler batches pairs (:func:`pair_lengths`),
never sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["pair_lengths"]


def pair_lengths(prompt: Sequence[int], chosen: Sequence[int], rejected: Sequence[int],
                 max_length: int | None = None) -> np.ndarray:
    """Tokens of each pair in a packed row: prompt+chosen plus prompt+rejected, each cut to ``max_length`` as TRL's
    collator cuts it. Arguments are per-pair token counts."""
    p = np.asarray(prompt, dtype=np.int64)
    c = np.asarray(chosen, dtype=np.int64)
    r = np.asarray(rejected, dtype=np.int64)
    if max_length is None:
        return 2 * p + c + r
    return np.minimum(p + c, max_length) + np.minimum(p + r, max_length)
