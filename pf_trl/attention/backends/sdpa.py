"""Exact varlen attention from one batched ``scaled_dot_product_attention``: the CPU path and the reference.

The packed segments are scattered into a padded batch, attended with a mask that keeps every segment to itself
(causal, window, padding) and gathered back. Everything is tensor arithmetic on ``cu_seqlens`` plus the two Python
ints ``max_q``/``max_k`` carried from the collator: no ``.tolist()``, no ``.item()``, so there is no host sync and
``torch.compile`` traces it into one graph. Memory is that of a padded batch (``segments x max_len^2`` scores per
head), never the dense ``T x T`` block mask.

Hot path (training, prefill): query and key layouts are the same tensor and attention is causal. Then the mask
depends on positions only (see :func:`~pf_trl.attention.backends._masks.position_visibility`) and segments are
folded into the head dimension, ``(segments * heads, max_len, head_dim)``, so no tensor has a dimension equal to
the number of segments and a batch holding a single example compiles into the same graph. Otherwise (decode with
fewer queries than keys, non-causal) a per-segment mask is built.

Scores with softcap go through an explicit fp32 softmax; a query that sees no key outputs zeros, as flash-attn
does. Attention sinks (``sinks``) take the same explicit path, which also yields the log-sum-exp that
:mod:`~pf_trl.attention.backends._sinks` rescales by (with its gradient, by autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pf_trl.attention.backends import _sinks
from pf_trl.attention.backends._masks import padded_visibility, position_visibility, token_segments

NAME = "sdpa"
INSTALL_HINT = "built into PyTorch; nothing to install"


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def unsupported(*, causal, window, softcap, dropout_p, head_dim, gqa, **_) -> str | None:
    return None


def _attend(q, k, v, mask, *, scale, softcap, dropout_p, group, with_lse=False):
    """Attention over the last two dims; heads on dim -3 (``k``/``v`` have ``1/group`` of them, GQA).

    ``with_lse``: also return the float32 log-sum-exp of the masked scores (``-inf`` where a query sees no key).
    """
    if not softcap and not with_lse:
        # fully masked rows (starved queries, padding rows) come out as zeros from PyTorch's sdpa (safe softmax)
        kwargs = {"enable_gqa": True} if group > 1 else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **kwargs)
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        lse = torch.logsumexp(scores, dim=-1) if with_lse else None
        probs = torch.softmax(scores, dim=-1)
    else:
        scores = scores.masked_fill(~mask, float("-inf"))
        seen = mask.any(dim=-1, keepdim=True)  # rows with no visible key output zeros (flash-attn semantics)
        lse = None
        if with_lse:
            lse = torch.logsumexp(scores.masked_fill(~seen, 0.0), dim=-1).masked_fill(~seen[..., 0], float("-inf"))
        probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1).masked_fill(~seen, 0.0)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, v.float()).to(q.dtype)
    return (out, lse) if with_lse else out


def _folded_index(cu: torch.Tensor, total: int, heads: int, max_len: int) -> torch.Tensor:
    """Row of each (token, head) in the ``(segments * heads * max_len)`` padded layout, flattened ``(total * heads)``."""
    seg, pos = token_segments(cu, total)
    head = torch.arange(heads, device=cu.device)
    return ((seg[:, None] * heads + head[None, :]) * max_len + pos[:, None]).reshape(-1)


def _fold(x: torch.Tensor, index: torch.Tensor, rows: int, max_len: int) -> torch.Tensor:
    d = x.shape[-1]
    padded = x.new_zeros(rows, d).index_copy(0, index, x.reshape(-1, d))
    return padded.view(-1, max_len, d)


def _forward_same_layout(q, k, v, cu, max_len, *, causal, scale, window, softcap, dropout_p, with_lse=False):
    total, hq, hkv, dv = q.shape[0], q.shape[1], k.shape[1], v.shape[-1]
    rows = (cu.shape[0] - 1) * max_len
    index_q = _folded_index(cu, total, hq, max_len)
    index_k = index_q if hkv == hq else _folded_index(cu, total, hkv, max_len)
    qp = _fold(q, index_q, rows * hq, max_len)  # (segments * hq, max_len, d)
    kp = _fold(k, index_k, rows * hkv, max_len)
    vp = _fold(v, index_k, rows * hkv, max_len)
    mask = position_visibility(max_len, max_len, causal=causal, window=window, device=q.device)
    out = _attend(qp, kp, vp, mask, scale=scale, softcap=softcap, dropout_p=dropout_p, group=hq // hkv, with_lse=with_lse)
    if with_lse:
        out, lse = out
        lse = lse.reshape(-1).index_select(0, index_q).view(total, hq)
        return out.reshape(-1, dv).index_select(0, index_q).view(total, hq, dv), lse
    return out.reshape(-1, dv).index_select(0, index_q).view(total, hq, dv)


def _forward_general(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, with_lse=False):
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    segments = cu_q.shape[0] - 1
    seg_q, pos_q = token_segments(cu_q, q.shape[0])
    seg_k, pos_k = token_segments(cu_k, k.shape[0])
    index_q = seg_q * max_q + pos_q
    index_k = seg_k * max_k + pos_k
    qp = q.new_zeros(segments * max_q, hq, d).index_copy(0, index_q, q).view(segments, max_q, hq, d).transpose(1, 2)
    kp = k.new_zeros(segments * max_k, hkv, d).index_copy(0, index_k, k).view(segments, max_k, hkv, d).transpose(1, 2)
    vp = v.new_zeros(segments * max_k, hkv, dv).index_copy(0, index_k, v).view(segments, max_k, hkv, dv).transpose(1, 2)
    mask = padded_visibility(cu_q, cu_k, max_q, max_k, causal=causal, window=window).unsqueeze(1)
    out = _attend(qp, kp, vp, mask, scale=scale, softcap=softcap, dropout_p=dropout_p, group=hq // hkv, with_lse=with_lse)
    if with_lse:
        out, lse = out
        lse = lse.transpose(1, 2).reshape(segments * max_q, hq).index_select(0, index_q)
        return out.transpose(1, 2).reshape(segments * max_q, hq, dv).index_select(0, index_q), lse
    return out.transpose(1, 2).reshape(segments * max_q, hq, dv).index_select(0, index_q)


def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, sinks=None, with_lse=False):
    if sinks is not None:
        # the explicit softmax's lse carries its gradient: no second attention needed (attend=None)
        def attend_lse(q, k, v):
            return forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window,
                           softcap=softcap, dropout_p=dropout_p, with_lse=True)

        return _sinks.attend_with_sinks(attend_lse, None, q, k, v, sinks, scale=scale)
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if cu_q.shape != cu_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same number of segments")
    if q.shape[0] == 0:
        out = q.new_zeros(0, hq, v.shape[-1])
        return (out, q.new_zeros(0, hq, dtype=torch.float32)) if with_lse else out
    # one tensor for both layouts (pf_varlen passes it so for self-attention): decided by identity, no value read
    if cu_k is cu_q and causal and q.shape[0] == k.shape[0] and max_q == max_k:
        return _forward_same_layout(
            q, k, v, cu_q.to(q.device), max_q,
            causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p, with_lse=with_lse,
        )
    return _forward_general(
        q, k, v, cu_q.to(q.device), cu_k.to(q.device), max_q, max_k,
        causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p, with_lse=with_lse,
    )
