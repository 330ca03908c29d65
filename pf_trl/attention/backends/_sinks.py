"""Attention sinks (gpt-oss ``s_aux``, ``sinks``): one extra logit per head in the softmax denominator.

transformers' eager path (gpt-oss, DeepSeek-V4, Flint, MiMo-V2) appends the per-head sink ``s_h`` as one more
column of every query's scores, takes the softmax and drops that column; Granite SWA writes the same thing as a
post-attention scale ``sigmoid(lse - s_h)``. Both are, per query ``i`` and head ``h``::

    out_sink[i, h] = out[i, h] * exp(lse[i, h]) / (exp(lse[i, h]) + exp(s_h)) = out[i, h] * sigmoid(lse[i, h] - s_h)

where ``out`` and ``lse`` (natural-log log-sum-exp of the scaled, masked scores) are those of plain attention over
the query's own segment. So any kernel that returns its log-sum-exp applies a sink exactly by rescaling its output
(:func:`attend_with_sinks`). A query that sees no key has ``lse = -inf`` and outputs zeros, as eager does.

Gradients: the rescale depends on ``lse``. Kernels whose ``lse`` carries no gradient (flash-attn, PyTorch's varlen
op) get it from :func:`lse_with_gradient`: ``d lse_i / d q_i = scale * sum_j P_ij k_j`` and ``d lse_i / d k_j =
scale * P_ij q_i``, i.e. one more attention of the same kernel and mask with ``k`` as the values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (q, k, v) -> (out (T, H, Dv), lse (T, H)) of plain attention, and (q, k, v) -> out of the same kernel and mask
AttendWithLse = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``sigmoid(lse - sink)`` in float32, ``lse`` ``(T, H)``, ``sinks`` ``(H,)``: the share of the softmax mass
    the real keys keep next to the sink (0 for a query that sees no key)."""
    return torch.sigmoid(lse.float() - sinks.float().view(1, -1))


def lse_with_gradient(lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, attend: Attend, scale: float) -> torch.Tensor:
    """``lse`` (no gradient, from a kernel) with the gradient of the softmax's log-sum-exp towards ``q`` and ``k``.

    The value is ``lse`` exactly (every added term is ``x - x.detach()``, i.e. 0); only the backward pass sees them.
    ``attend`` must apply the same mask, window and scale as the kernel that produced ``lse``, with no dropout.
    No softcap: with ``softcap`` the scores are not linear in ``q . k`` (the backends refuse that combination).
    """
    lse = lse.detach()
    if not (q.requires_grad or k.requires_grad) or not torch.is_grad_enabled():
        return lse
    qd = q.detach()
    pk = attend(qd, k.detach(), k)  # sum_j P_ij k_j, differentiable towards k only (through the values)
    pk_const = pk.detach()
    return lse + scale * (((q - qd) * pk_const).sum(-1) + (qd * (pk - pk_const)).sum(-1)).float()


def attend_with_sinks(
    attend_lse: AttendWithLse,
    attend: Attend | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Attention of ``(T, H, D)`` tensors with per-head sinks ``(H,)``, from a kernel that returns its ``lse``.

    ``attend`` is ``None`` when ``attend_lse``'s ``lse`` already carries its gradient (explicit softmax, flex);
    otherwise it is the same kernel without sinks or dropout, used by :func:`lse_with_gradient`.
    """
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks must hold one value per query head ({q.shape[1]}), got shape {tuple(sinks.shape)}")
    out, lse = attend_lse(q, k, v)
    if attend is not None:
        lse = lse_with_gradient(lse, q, k, attend, scale)
    return (out.float() * sink_scale(lse, sinks.to(out.device)).unsqueeze(-1)).to(out.dtype)
