"""Exact varlen attention from per-segment ``scaled_dot_product_attention``: the CPU path and the reference.

Each segment is attended on its own (no token can see another segment), so the result is exact for any
segment layout; the cost is a Python loop over segments, cheap for training batches (tens of examples).
Scores with softcap, or segments where some query sees no key, go through an explicit fp32 softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pf_trl.attention.backends._masks import segment_visibility

NAME = "sdpa"
INSTALL_HINT = "built into PyTorch; nothing to install"


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def unsupported(*, causal, window, softcap, dropout_p, head_dim, gqa, **_) -> str | None:
    return None


def _math_segment(q, k, v, mask, scale, softcap, dropout_p):
    # q: (H, lq, D), k/v: (H, lk, D) with heads already matched.
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
        seen = mask.any(dim=-1, keepdim=True)  # rows with no visible key output zeros (flash-attn semantics)
        scores = scores.masked_fill(~seen, 0.0)
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(~seen, 0.0)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v.float()).to(q.dtype)


def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p):
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    group = hq // hkv
    bounds_q = cu_q.tolist()
    bounds_k = cu_k.tolist()
    if len(bounds_q) != len(bounds_k):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same number of segments")
    parts = []
    for s in range(len(bounds_q) - 1):
        sq, eq, sk, ek = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        lq, lk = eq - sq, ek - sk
        if lq == 0:
            continue
        if lk == 0:
            parts.append(q.new_zeros(lq, hq, v.shape[-1]))
            continue
        qs = q[sq:eq].transpose(0, 1)  # (H, lq, D)
        ks = k[sk:ek].transpose(0, 1)
        vs = v[sk:ek].transpose(0, 1)
        mask = segment_visibility(lq, lk, causal=causal, window=window, device=q.device)
        starved = mask is not None and not bool(mask.any(dim=-1).all())
        if softcap or starved:
            if group > 1:
                ks = ks.repeat_interleave(group, dim=0)
                vs = vs.repeat_interleave(group, dim=0)
            out = _math_segment(qs, ks, vs, mask, scale, softcap, dropout_p)
        else:
            kwargs = {"enable_gqa": True} if group > 1 else {}
            if causal and lq == lk and window[0] < 0:  # plain causal (a right window adds nothing to causal)
                out = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, dropout_p=dropout_p, scale=scale, **kwargs
                )
            else:
                out = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, dropout_p=dropout_p, scale=scale, **kwargs
                )
        parts.append(out.transpose(0, 1))
    if not parts:
        return q.new_zeros(q.shape[0], hq, v.shape[-1])
    out = torch.cat(parts, dim=0)
    if out.shape[0] != q.shape[0]:
        raise ValueError(
            f"cu_seqlens_q covers {out.shape[0]} query tokens but q has {q.shape[0]}; "
            "cu_seqlens must end at the total token count"
        )
    return out
