"""Preference pairs as packed rows: the collator of :class:`~pf_trl.trainer.dpo_trainer.PaddingFreeDPOTrainer`.

A micro-batch of ``n`` pairs is one packed row of ``2n`` sequences, in TRL's order: prompt+chosen of every pair, then
prompt+rejected of every pair (TRL's padded batch has these as its ``2n`` rows). ``position_ids`` restart at 0 on
every sequence and ``cu_seq_lens_*`` mark them (:mod:`pf_trl.batching.packing`), so the attention layers keep the
sequences apart. The pairs stay whole: the sampler batches pairs (:func:`pair_lengths`), never sequences.

:class:`PackedPreferenceCollator` wraps TRL's own preference collator (``DataCollatorForPreference``) and reads the
sequences from what it returns, so truncation (``max_length``, ``truncation_mode``), the completion mask and the
reference log-probabilities are TRL's by construction. TRL's batch stays in the output as the *index layout* the loss
code reads (``[2n, L]`` integers, no model work); the model runs the packed row under :data:`PACKED_KEY`:

- ``input_ids``, ``position_ids``: ``LongTensor[1, T]``, ``T`` the real tokens of the ``2n`` sequences;
- ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``IntTensor[2n + 1]``), ``max_length_q`` / ``max_length_k`` (ints);
- ``token_index``: ``LongTensor[T]``, where each packed token sits in the flattened ``[2n, L]`` layout;
- ``shift_src`` / ``shift_dst``: ``LongTensor``, for each next-token prediction inside a sequence, its position in the
  packed row's shifted outputs (``T - 1``) and in the layout's shifted outputs (``2n x (L - 1)``);
- ``num_pairs``: int.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pf_trl.batching.packing import cu_seqlens_from_lengths, position_ids_from_lengths
from pf_trl.errors import PackingError

__all__ = ["PACKED_KEY", "PackedPreferenceCollator", "pair_lengths"]

PACKED_KEY = "pf_packed"


def _truncated(n: int, max_length: int | None) -> int:
    return n if max_length is None else min(n, max_length)


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


def packed_layout(attention_mask: torch.Tensor) -> dict[str, Any]:
    """The packed row's layout of a right-padded ``[2n, L]`` batch (``attention_mask``: ones then zeros per row)."""
    if attention_mask.dim() != 2 or attention_mask.shape[0] % 2:
        raise PackingError(f"a preference batch has 2n rows (chosen, then rejected); got {tuple(attention_mask.shape)}")
    rows, width = attention_mask.shape
    lengths = attention_mask.sum(dim=1).tolist()
    if min(lengths) <= 0:
        raise PackingError("a preference batch holds an empty sequence; drop empty pairs before collation")
    expected = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    if not torch.equal(attention_mask.bool(), expected):
        raise PackingError("a preference batch must be right-padded (TRL's DataCollatorForPreference pads right)")
    token_index = torch.nonzero(expected.reshape(-1), as_tuple=True)[0]
    # shifted predictions inside each sequence: padded (i, j) -> packed start_i + j, for j < len_i - 1
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    src = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(starts, lengths)])
    dst = torch.cat([torch.arange(i * (width - 1), i * (width - 1) + n - 1) for i, n in enumerate(lengths)])
    cu = cu_seqlens_from_lengths(lengths)
    longest = int(max(lengths))
    return {
        "position_ids": position_ids_from_lengths(lengths).unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.clone(),
        "max_length_q": longest,
        "max_length_k": longest,
        "token_index": token_index,
        "shift_src": src.long(),
        "shift_dst": dst.long(),
        "num_pairs": rows // 2,
    }


class PackedPreferenceCollator:
    """Collate preference examples (``prompt_ids``, ``chosen_ids``, ``rejected_ids``, optional reference
    log-probabilities) into TRL's index layout plus one packed row (see the module docstring).

    Args:
        inner: TRL's preference collator (``trl.trainer.dpo_trainer.DataCollatorForPreference``) or any callable
            returning its right-padded ``input_ids`` / ``attention_mask`` / ``completion_mask``.
    """

    def __init__(self, inner: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.inner = inner

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(examples) == 0:
            raise PackingError("PackedPreferenceCollator got an empty batch: the sampler yielded no pairs")
        batch = self.inner(list(examples))
        layout = packed_layout(batch["attention_mask"])
        layout["input_ids"] = batch["input_ids"].reshape(-1)[layout["token_index"]].unsqueeze(0)
        batch[PACKED_KEY] = layout
        return batch
