"""Segment masks shared by the exact backends (sdpa, flex)."""

from __future__ import annotations

import torch


def segment_visibility(
    lq: int, lk: int, *, causal: bool, window: tuple[int, int], device: torch.device
) -> torch.Tensor | None:
    """Boolean ``(lq, lk)`` mask (True = attend) for one segment, or ``None`` when everything is visible."""
    left, right = window
    if not causal and left < 0 and right < 0:
        return None
    i = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)  # aligned query position
    j = torch.arange(lk, device=device).unsqueeze(0)
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def token_segments(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token segment id and position inside its segment for cumulative lengths ``cu``."""
    lengths = (cu[1:] - cu[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=total)
    pos = torch.arange(total, device=cu.device) - cu[:-1].long()[seg]
    return seg, pos
