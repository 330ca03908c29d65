"""Cross-entropy on a bare ``(weight, bias)`` head, for the loss tests: TRL's chunked kernel as the trainer's loss
calls it (:func:`chunked_cross_entropy`) and the plain full-logits reference (:func:`plain_cross_entropy`).

Test helpers, not pf-trl's API: the trainer computes its loss through :mod:`pf_trl.trainer.loss` (the model's
forward with ``pf_loss=True``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pf_trl.trainer.loss import VOCAB_CHUNK, HeadPlan, _fused_terms, _liger_terms, apply_head_transform, loss_dtype


def chunked_cross_entropy(hidden, weight, targets, bias=None, *, chunk_size: int = VOCAB_CHUNK,
                          logit_scale: float = 1.0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``cross_entropy(transform(hidden @ weight.T + bias), targets)`` and the count of top-1 hits.

    TRL's chunked log-prob kernel: ``hidden [N, H]`` (already shifted), ``weight [V, H]``, ``targets [N]`` without
    -100; ``chunk_size`` vocabulary columns per tile. Never builds the ``[N, V]`` logits.
    """
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    head = _LinearView(weight, bias)
    plan = HeadPlan("linear", logit_scale, softcap)
    if hidden.shape[0] == 0:
        zero = (hidden.sum() * 0.0 + weight.sum() * 0.0).float()
        return zero, torch.zeros((), dtype=torch.int64, device=hidden.device)
    terms = _fused_terms(head, hidden, targets, plan.scale, plan.softcap, chunk_size)
    return terms.nll.sum(), terms.top1.sum()


def plain_cross_entropy(hidden, weight, targets, bias=None, *, logit_scale: float = 1.0,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path: the full logits, fp32 cross-entropy (sum) and top-1 hits."""
    logits = apply_head_transform(F.linear(hidden, weight, bias), logit_scale, softcap)
    logits = logits.to(loss_dtype(logits.dtype))
    loss = F.cross_entropy(logits, targets, reduction="sum")
    correct = (logits.detach().argmax(-1) == targets).sum()
    return loss, correct


class _LinearView:
    """A ``(weight, bias)`` pair with the attributes the fused path reads from a head."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


def linear_cross_entropy(hidden, weight, targets, bias=None, *, impl: str = "chunked", chunk_size: int = VOCAB_CHUNK):
    """Dispatch to ``chunked`` / ``none`` (plain) for a bare ``(weight, bias)``. Returns ``(loss_sum, correct)``."""
    if impl == "chunked":
        return chunked_cross_entropy(hidden, weight, targets, bias, chunk_size=chunk_size)
    if impl == "none":
        return plain_cross_entropy(hidden, weight, targets, bias)
    if impl == "liger":
        terms = _liger_terms(_LinearView(weight, bias), hidden, targets, HeadPlan("linear"))
        return terms.nll.sum(), torch.full((), -1, dtype=torch.int64, device=hidden.device)
    raise ValueError(f"unknown cross-entropy implementation {impl!r}")
