"""Masks shared by the exact backends (sdpa, flex), in tensor ops only (no host sync); the segment layout they read
comes from :mod:`pf_trl.batching.packing` (``token_segments``, ``segment_lengths``).

Under ``torch.compile`` the number of segments ``n`` is a symbolic size. No tensor here has a dimension (or a
numel) equal to ``n`` alone: PyTorch specializes a symbolic size of 1 (``n != 1`` guards on contiguity checks),
so such a tensor would recompile the graph for every batch that holds a single example. Everything reads ``cu``
itself (``n + 1`` entries) or works per token.
"""

from __future__ import annotations

import torch

from pf_trl.batching.packing import segment_lengths


def position_visibility(
    max_q: int, max_k: int, *, causal: bool, window: tuple[int, int], device: torch.device
) -> torch.Tensor | None:
    """Boolean ``(max_q, max_k)`` mask (True = attend) that depends on positions only, or ``None`` if all-visible.

    Exact for segments with as many queries as keys laid out as a padded batch, when ``causal``: a real query
    ``i < len`` only sees keys ``j <= i < len``, so the padding keys of its segment are never visible; padding
    queries see something (no NaN) and are dropped afterwards.
    """
    left, right = window
    if not causal and left < 0 and right < 0:
        return None
    i = torch.arange(max_q, device=device)[:, None]
    j = torch.arange(max_k, device=device)[None, :]
    mask = torch.ones(max_q, max_k, dtype=torch.bool, device=device)
    if causal:
        mask = mask & (j <= i)
    if left >= 0:
        mask = mask & (j >= i - left)
    if right >= 0:
        mask = mask & (j <= i + right)
    return mask


def padded_visibility(
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, *, causal: bool, window: tuple[int, int]
) -> torch.Tensor:
    """Boolean ``(segments, max_q, max_k)`` mask (True = attend) of segments laid out as a padded batch.

    The general case (query and key layouts differ, or non-causal). Query ``i`` of a segment with ``lq`` queries
    and ``lk`` keys sits at key position ``a = i + lk - lq`` (bottom-right alignment); padding rows and columns are
    never visible. Its first dimension is ``n`` (see the module docstring for what that costs under compile).
    """
    len_q = segment_lengths(cu_q).long()[:, None, None]
    len_k = segment_lengths(cu_k).long()[:, None, None]
    i = torch.arange(max_q, device=cu_q.device)[None, :, None]
    j = torch.arange(max_k, device=cu_q.device)[None, None, :]
    a = i + (len_k - len_q)
    mask = (i < len_q) & (j < len_k)
    left, right = window
    if causal:
        mask = mask & (j <= a)
    if left >= 0:
        mask = mask & (j >= a - left)
    if right >= 0:
        mask = mask & (j <= a + right)
    return mask
