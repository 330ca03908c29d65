"""Metric gathers across ranks for trainers whose micro-batches hold different numbers of rows per rank."""

from __future__ import annotations

import torch

__all__ = ["gather_uneven_first_dim"]


def gather_uneven_first_dim(accelerator) -> None:
    """Let ``accelerator.gather`` take tensors whose first dimension differs across ranks: the result is every
    rank's tensor in rank order, as for equal sizes.

    Under a token budget the ranks' micro-batches hold different numbers of pairs, and TRL gathers its per-pair
    metrics (``rewards/*``, ``logps/*``) with ``accelerator.gather``, whose all-gather needs equal shapes (gloo
    aborts on a size mismatch). Scalars and equal sizes take accelerate's own path; otherwise the sizes are gathered
    first, each tensor is padded to the largest and the padding dropped after the gather."""
    plain = accelerator.gather

    def gather(tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return plain(tensor)
        sizes = plain(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        if len(set(sizes)) == 1:
            return plain(tensor)
        width = max(sizes)
        padded = torch.cat([tensor, tensor.new_zeros((width - tensor.shape[0], *tensor.shape[1:]))])
        gathered = plain(padded)
        return torch.cat([gathered[r * width:r * width + n] for r, n in enumerate(sizes)])

    accelerator.gather = gather
