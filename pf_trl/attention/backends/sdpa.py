"""Exact varlen attention segment by segment, memory linear in the packed row: the CPU path and the reference.

Each segment of the row is attended on its own, so nothing of size ``T x T`` (nor ``segments x max_len^2``) exists:

- the common case (causal self-attention whose window, if any, spans the segment; or non-causal without window),
  on CPU, is one call of PyTorch's fused flash kernel per segment
  (``aten._scaled_dot_product_flash_attention_for_cpu`` on a ``(1, H, L, D)`` view, ``is_causal``, GQA native, no
  mask), which keeps ``O(L)`` memory and returns the log-sum-exp its backward reuses;
- everything else (a window shorter than the segment, softcap, attention dropout, fewer queries than keys, other
  devices) goes through :mod:`pf_trl.attention.backends.blockwise`, a chunked online-softmax kernel with the same
  ``O(L)`` memory.

The segments are read from ``cu_seqlens`` on the host inside one custom operator (``pf_trl::varlen_sdpa``, with its
own backward operator), so ``torch.compile`` sees a single opaque node with shapes known from ``q``: no graph break,
no recompilation when the number or lengths of segments change. :func:`forward_with_lse` also returns the per-query
log-sum-exp ``(heads, total_q)`` (differentiable), for callers that rescale the output (attention sinks).

Attention sinks (``sinks``) rescale this output by the same log-sum-exp
(:mod:`~pf_trl.attention.backends._sinks`); its gradient flows through the custom operator's backward (``dlse``),
so no second attention is needed.
"""

from __future__ import annotations

import torch

from pf_trl.attention.backends import _sinks, blockwise
from pf_trl.batching.packing import segment_spans

NAME = "sdpa"
INSTALL_HINT = "built into PyTorch; nothing to install"
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    return None


def unsupported(*, causal, window, softcap, dropout_p, head_dim, gqa, **_) -> str | None:
    return None


def _fused(q: torch.Tensor, lq: int, lk: int, causal: bool, left: int, right: int, softcap: float,
           dropout_p: float) -> bool:
    """Whether PyTorch's fused CPU flash kernel computes this segment exactly (is_causal is top-left aligned)."""
    if q.device.type != "cpu" or q.dtype not in _FUSED_DTYPES or softcap or dropout_p or lq == 0 or lk == 0:
        return False
    if causal:
        return lq == lk and (left < 0 or left >= lq - 1)
    return left < 0 and right < 0


def _as_bhld(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # (L, H, D) -> (1, H, L, D), a view


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """``(q0, q1, k0, k1)`` of every segment: its query rows and its key rows."""
    return [(*q, *k) for q, k in zip(segment_spans(cu_q), segment_spans(cu_k))]


def _seed_value(seed: torch.Tensor | None) -> int:
    return int(seed.item()) if seed is not None else 0


@torch.library.custom_op("pf_trl::varlen_sdpa", mutates_args=())
def varlen_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                causal: bool, scale: float, left: int, right: int, softcap: float, dropout_p: float,
                seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (total_q, Hq, Dv), lse (Hq, total_q))`` of packed segments; see the module docstring."""
    total_q, hq = q.shape[0], q.shape[1]
    out = q.new_zeros(total_q, hq, v.shape[-1])
    lse = torch.full((hq, total_q), float("-inf"), dtype=blockwise.compute_dtype(q.dtype), device=q.device)
    rng = _seed_value(seed)
    for s, (q0, q1, k0, k1) in enumerate(_segments(cu_q, cu_k)):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if _fused(q, lq, lk, causal, left, right, softcap, dropout_p):
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                _as_bhld(q[q0:q1]), _as_bhld(k[k0:k1]), _as_bhld(v[k0:k1]), 0.0, causal, scale=scale)
            out[q0:q1] = o[0].transpose(0, 1)
            lse[:, q0:q1] = l[0]
        else:
            o, l = blockwise.forward(q[q0:q1], k[k0:k1], v[k0:k1], causal=causal, scale=scale, left=left, right=right,
                                     softcap=softcap, dropout_p=dropout_p, seed=rng, segment=s)
            out[q0:q1] = o
            lse[:, q0:q1] = l
    return out, lse


@varlen_sdpa.register_fake
def _(q, k, v, cu_q, cu_k, causal, scale, left, right, softcap, dropout_p, seed):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=blockwise.compute_dtype(q.dtype))


@torch.library.custom_op("pf_trl::varlen_sdpa_backward", mutates_args=())
def varlen_sdpa_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, scale: float,
                         left: int, right: int, softcap: float, dropout_p: float, seed: torch.Tensor | None,
                         dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if dlse is not None and not bool(dlse.any()):
        dlse = None  # a zero gradient on the log-sum-exp (no caller used it): the fused backward applies
    rng = _seed_value(seed)
    for s, (q0, q1, k0, k1) in enumerate(_segments(cu_q, cu_k)):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        if dlse is None and _fused(q, lq, lk, causal, left, right, softcap, dropout_p):
            g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                _as_bhld(dout[q0:q1]), _as_bhld(q[q0:q1]), _as_bhld(k[k0:k1]), _as_bhld(v[k0:k1]),
                _as_bhld(out[q0:q1]), lse[None, :, q0:q1].to(torch.float32) if q.dtype != torch.float64
                else lse[None, :, q0:q1], 0.0, causal, scale=scale)
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (x[0].transpose(0, 1) for x in g)
        else:
            g = blockwise.backward(dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], out[q0:q1], lse[:, q0:q1],
                                   causal=causal, scale=scale, left=left, right=right, softcap=softcap,
                                   dropout_p=dropout_p, seed=rng, segment=s,
                                   dlse=None if dlse is None else dlse[:, q0:q1])
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g
    return dq, dk, dv


@varlen_sdpa_backward.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, left, right, softcap, dropout_p, seed, dlse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, causal, scale, left, right, softcap, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed)
    ctx.params = (causal, scale, left, right, softcap, dropout_p)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, seed = ctx.saved_tensors
    causal, scale, left, right, softcap, dropout_p = ctx.params
    dq, dk, dv = varlen_sdpa_backward(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, causal, scale, left, right,
                                      softcap, dropout_p, seed, dlse)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


varlen_sdpa.register_autograd(_backward, setup_context=_setup_context)


def forward_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p):
    """:func:`forward` plus the per-query log-sum-exp ``(Hq, total_q)`` (float32; float64 for float64 inputs)."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if cu_q.shape != cu_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same number of segments")
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64) if dropout_p else None
    return varlen_sdpa(q, k, v, cu_q, cu_k, bool(causal), float(scale), int(window[0]), int(window[1]),
                       float(softcap or 0.0), float(dropout_p), seed)


def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, sinks=None,
            with_lse=False):
    """Packed attention ``(total_q, Hq, Dv)``; ``with_lse``: with the log-sum-exp ``(total_q, Hq)`` (float32);
    ``sinks`` ``(Hq,)``: per-head attention sinks (the output rescaled by ``sigmoid(lse - sink)``)."""
    if sinks is not None:
        def attend_lse(q, k, v):  # the op's lse carries its gradient: no second attention needed (attend=None)
            return forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window,
                           softcap=softcap, dropout_p=dropout_p, with_lse=True)

        return _sinks.attend_with_sinks(attend_lse, None, q, k, v, sinks, scale=scale)
    out, lse = forward_with_lse(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window,
                                softcap=softcap, dropout_p=dropout_p)
    return (out, lse.transpose(0, 1)) if with_lse else out
