"""Packing: how a padding-free row marks its examples, in one place.

A packed batch holds several examples ("segments") side by side in one row. Their boundaries travel in four
equivalent forms, and every part of pf-trl converts between them here:

- ``lengths``: the token count of each segment (what the collator knows);
- ``cu_seqlens``: int32 ``[n + 1]`` cumulative lengths from 0 to the token count (flash-attn's ``cu_seqlens``,
  transformers' ``cu_seq_lens_q/k``); a segment ``s`` is ``cu[s]:cu[s + 1]``;
- ``position_ids``: positions that restart at every segment;
- ``seq_idx``: the segment number of every token (what causal-conv1d and mamba-ssm read).

Multimodal rotary models (mRoPE) take ``position_ids`` as ``[4, 1, T]``: the per-example text positions on top of
three rotary streams (:func:`packed_position_ids`; :mod:`pf_trl.attention.mrope` computes the streams).

Two rules find boundaries in ``position_ids``, and both are kept because both are contracts of upstream code:

- :func:`segment_starts` (transformers' ``masking_utils.find_packed_sequence_indices``): a segment starts at every
  row start and wherever a position is not the previous one + 1. The attention layers, the stateful mixers and the
  compressed-KV layers use it, since it is what transformers' own packed path sees.
- :func:`cu_seqlens_from_position_ids` (flash-attn's ``prepare_fa_kwargs_from_position_ids``, TRL's padding-free
  collator): a segment starts wherever the position is 0. The collator's public helper.

They agree on every row :func:`pf_trl.batching.collator.check_packed_batch` accepts (positions ``0, 1, ...`` per
segment).

Functions that say "host read" read tensor values on the CPU (a GPU sync: eager code, once per batch or layer);
:func:`token_segments` and :func:`segment_lengths` are tensor ops only, safe inside a compiled graph.

The label rule lives here too: :data:`IGNORE_INDEX` marks a label without loss (the value every Hugging Face loss
ignores), and :func:`shift_labels` aligns each position with the label it predicts over the whole row.

This module imports only :mod:`pf_trl.errors` and :mod:`pf_trl.data.labels` at load time, and torch inside the
functions that need it. :data:`IGNORE_INDEX` is defined in :mod:`pf_trl.data.labels` (the data code runs before torch
loads and sits below ``batching``: ``tests/test_fast_errors.py``) and re-exported here for the collator, the attention
layers and the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pf_trl.data.labels import IGNORE_INDEX
from pf_trl.errors import PackingError

if TYPE_CHECKING:
    import torch

__all__ = [
    "IGNORE_INDEX",
    "count_targets",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_position_ids",
    "cu_seqlens_from_positions",
    "cu_seqlens_from_starts",
    "lengths_from_cu_seqlens",
    "max_seqlen",
    "packed_position_ids",
    "position_ids_from_lengths",
    "rows_hold_several_segments",
    "segment_lengths",
    "segment_spans",
    "segment_starts",
    "segment_starts_from_seq_idx",
    "seq_idx_from_lengths",
    "shift_labels",
    "token_segments",
]


# ------------------------------------------------------------------------------------- from lengths (collator)


def cu_seqlens_from_lengths(lengths: Sequence[int] | torch.Tensor, *, device: torch.device | None = None
                            ) -> torch.Tensor:
    """int32 ``[n + 1]`` cumulative lengths ``0, l0, l0 + l1, ...`` (on ``lengths``' device for a tensor)."""
    import torch

    counts = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(list(lengths), dtype=torch.int64)
    cu = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=device or counts.device)
    cu[1:] = counts.reshape(-1).cumsum(0)
    return cu


def position_ids_from_lengths(lengths: Sequence[int], *, device: torch.device | None = None) -> torch.Tensor:
    """Long ``[total]``: ``0 .. l - 1`` for every segment, concatenated."""
    import torch

    return torch.cat([torch.arange(int(n), dtype=torch.long, device=device) for n in lengths])


def seq_idx_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """int32 ``[total]``: the segment number of every token."""
    import torch

    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(list(lengths)))


def packed_position_ids(text_positions: torch.Tensor, rotary: Sequence[torch.Tensor]) -> torch.Tensor:
    """``LongTensor[4, 1, T]`` (mRoPE): per-example text positions (row 0) on top of the per-example rotary streams
    (each ``[3, n]``)."""
    import torch

    return torch.cat([text_positions.reshape(1, 1, -1), torch.cat(list(rotary), dim=1).unsqueeze(1)], dim=0)


# ------------------------------------------------------------------------------------------------ from cu_seqlens


def segment_lengths(cu: torch.Tensor) -> torch.Tensor:
    """``[n]`` segment lengths of ``cu_seqlens`` (tensor op, no host read)."""
    return cu[1:] - cu[:-1]


def max_seqlen(cu: torch.Tensor) -> int:
    """The longest segment of ``cu_seqlens`` as a Python int (host read)."""
    return int(segment_lengths(cu).max())


def lengths_from_cu_seqlens(cu: torch.Tensor) -> list[int]:
    """Segment lengths of ``cu_seqlens`` as Python ints (host read); not validated."""
    bounds = [int(b) for b in cu.reshape(-1).tolist()]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def segment_spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of every segment of ``cu_seqlens`` (host read)."""
    bounds = [int(b) for b in cu.reshape(-1).tolist()]
    return list(zip(bounds, bounds[1:]))


def token_segments(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token segment id and position inside its segment for cumulative lengths ``cu`` (long tensors).

    ``searchsorted`` keeps every shape static in ``total`` (no data-dependent output size), so this traces under
    ``torch.compile`` and never reads ``cu`` on the host.
    """
    import torch

    cu = cu.long()
    tokens = torch.arange(total, device=cu.device)
    seg = torch.searchsorted(cu, tokens, right=True) - 1
    return seg, tokens - cu[seg]


# ---------------------------------------------------------------------------------- from position_ids / seq_idx


def _starts(ids: torch.Tensor, step: int) -> torch.Tensor:
    import torch

    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1] + step
    return starts


def segment_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool, the shape of ``position_ids`` (``(rows, seq)`` or ``(seq,)``): True where a segment starts (row start,
    or position != previous + 1; transformers' rule)."""
    return _starts(position_ids, 1)


def segment_starts_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """Bool, the shape of ``seq_idx``: True at every row start and wherever the segment number changes."""
    return _starts(seq_idx, 0)


def cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """int32 ``cu_seqlens`` over the flattened grid of a segment-start mask (host read: the output size)."""
    import torch

    idx = starts.reshape(-1).nonzero().reshape(-1)
    return torch.cat([idx, idx.new_tensor([starts.numel()])]).to(torch.int32)


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int32 ``cu_seqlens`` over the flattened ``(rows, seq)`` grid and the longest segment, by
    :func:`segment_starts` (host read)."""
    cu = cu_seqlens_from_starts(segment_starts(position_ids))
    return cu, max_seqlen(cu)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flash-attn ``cu_seqlens`` (int32) and the longest segment of packed ``position_ids`` ``[1, T]`` or ``[T]``.

    A new segment starts wherever the position is 0 (flash-attn's rule, see the module docstring); the row must
    start at 0. Raises :class:`~pf_trl.errors.PackingError` otherwise.
    """
    flat = position_ids.reshape(-1)
    if flat.numel() == 0:
        raise PackingError("position_ids is empty")
    starts = flat == 0
    if not bool(starts[0]):
        raise PackingError("packed position_ids must start at 0 (each segment restarts at 0)")
    cu = cu_seqlens_from_starts(starts)
    return cu, max_seqlen(cu)


def rows_hold_several_segments(position_ids: torch.Tensor, valid: torch.Tensor | None = None) -> bool:
    """True if the (valid) tokens of some row of 2-D ``position_ids`` are not one consecutive run (host read).

    ``valid`` (bool ``(rows, seq)``, e.g. a padding mask) leaves the other tokens out: the valid tokens of a
    left-padded row still count as one run.
    """
    if valid is None:
        return bool(segment_starts(position_ids)[:, 1:].any())
    b, length = valid.shape
    pos = position_ids.expand(b, -1) if position_ids.shape[0] != b else position_ids
    idx = valid.reshape(-1).nonzero().reshape(-1)
    if idx.numel() < 2:
        return False
    p = pos.reshape(-1)[idx]
    rows = idx // length
    return bool(((rows[1:] == rows[:-1]) & (p[1:] != p[:-1] + 1)).any())


# ------------------------------------------------------------------------------------------------------- labels


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` moved one position left along the row, :data:`IGNORE_INDEX` in the last slot: position ``t``
    holds the label it predicts. Shifting the whole packed row keeps every target; the collator's
    :data:`IGNORE_INDEX` on each example's first label is what stops the last token of one example from
    predicting the first of the next."""
    import torch

    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """The supervised targets of ``labels`` (rows or one packed row): labels after each row's first position that are
    not :data:`IGNORE_INDEX` (with the causal shift, position ``t`` predicts label ``t + 1``). A 0-d tensor, no host
    read; what the loss is divided by and what the token metrics count."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()
