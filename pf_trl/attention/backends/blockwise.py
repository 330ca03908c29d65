"""Chunked online-softmax attention of one segment, in PyTorch ops: memory linear in the segment, every feature.

The general path of the ``sdpa`` backend, for what PyTorch's fused kernels lack: sliding windows, softcapping,
attention dropout, bottom-right alignment (fewer queries than keys), queries that see no key. Queries are processed
in blocks of :data:`BLOCK` rows and, inside a block, keys in blocks of :data:`BLOCK` columns with a running maximum
and sum (the flash-attention recurrence), so the largest temporary is ``heads x BLOCK x BLOCK`` scores whatever the
segment length, and only the keys a query block can see are visited (a window of ``W`` costs ``O(L x W)``).

The forward returns the output and the log-sum-exp of each query row; the backward recomputes each block's
probabilities from them (nothing of size ``L x L`` is saved between forward and backward) and accepts a gradient on
the log-sum-exp (used when attention sinks rescale the output). Semantics are those of
:mod:`pf_trl.attention.backends` (flash-attn's); GQA heads map ``h -> h // (Hq / Hkv)`` as ``repeat_interleave``.
Dropout masks are drawn per block from a generator seeded by ``(seed, segment, block)``, so the backward sees the
forward's mask without storing it.
"""

from __future__ import annotations

import math

import torch

BLOCK = 512


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _key_range(a0: int, a1: int, lk: int, causal: bool, left: int, right: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that queries aligned at ``a0..a1`` can see at all."""
    lo, hi = 0, lk
    if causal:
        hi = min(hi, a1 + 1)
    if right >= 0:
        hi = min(hi, a1 + right + 1)
    if left >= 0:
        lo = max(lo, a0 - left)
    return lo, max(lo, hi)


def _query_blocks(lq: int, lk: int, causal: bool, left: int, right: int):
    """``(i0, i1, a0, a1, lo, hi)`` per block of queries ``[i0, i1)`` (aligned at ``a0..a1``, bottom-right) that sees
    at least one key, ``[lo, hi)`` being the keys it can see: the one iteration of the forward and the backward."""
    off = lk - lq
    for i0 in range(0, lq, BLOCK):
        i1 = min(lq, i0 + BLOCK)
        a0, a1 = i0 + off, i1 - 1 + off
        lo, hi = _key_range(a0, a1, lk, causal, left, right)
        if lo < hi:
            yield i0, i1, a0, a1, lo, hi


def _visible(a: torch.Tensor, j: torch.Tensor, causal: bool, left: int, right: int) -> torch.Tensor | None:
    """``(bq, bk)`` bool mask of query positions ``a`` (aligned) against key positions ``j``; ``None`` = all."""
    mask = None

    def _and(m, x):
        return x if m is None else m & x

    a, j = a[:, None], j[None, :]
    if causal:
        mask = _and(mask, j <= a)
    if left >= 0:
        mask = _and(mask, j >= a - left)
    if right >= 0:
        mask = _and(mask, j <= a + right)
    return mask


def _block_fully_visible(a0, a1, j0, j1, causal, left, right) -> bool:
    ok = True
    if causal:
        ok &= j1 - 1 <= a0
    if left >= 0:
        ok &= j0 >= a1 - left
    if right >= 0:
        ok &= j1 - 1 <= a0 + right
    return ok


def _keep_mask(shape, p: float, seed: int, segment: int, i0: int, j0: int, device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + segment * 65_537 + i0 * 8_191 + j0) % (2**63 - 1))
    return torch.rand(shape, generator=g, device=device) >= p


def _scores(qb, kb, scale, softcap):
    """Scaled (and soft-capped) scores ``(Hkv, G, bq, bk)`` and the tanh needed by the softcap backward."""
    raw = torch.matmul(qb, kb.transpose(-1, -2).unsqueeze(1)) * scale
    if not softcap:
        return raw, None
    t = torch.tanh(raw / softcap)
    return softcap * t, t


def forward(q, k, v, *, causal: bool, scale: float, left: int, right: int, softcap: float, dropout_p: float = 0.0,
            seed: int = 0, segment: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment: ``q (lq, Hq, D)``, ``k (lk, Hkv, D)``, ``v (lk, Hkv, Dv)`` -> ``out (lq, Hq, Dv)`` in q's dtype
    and ``lse (Hq, lq)`` in the compute dtype (``-inf`` for a query that sees no key; its output is zero)."""
    lq, hq, d = q.shape
    lk, hkv, dv = v.shape[0], v.shape[1], v.shape[2]
    group = hq // hkv
    ct = compute_dtype(q.dtype)
    out = q.new_zeros(lq, hq, dv)
    lse = torch.full((hq, lq), -math.inf, dtype=ct, device=q.device)
    if lq == 0 or lk == 0:
        return out, lse
    qh = q.to(ct).reshape(lq, hkv, group, d).permute(1, 2, 0, 3)  # (Hkv, G, lq, D)
    kh = k.to(ct).permute(1, 0, 2)  # (Hkv, lk, D)
    vh = v.to(ct).permute(1, 0, 2)
    off = lk - lq
    positions = torch.arange(max(lq, lk) + 1, device=q.device)
    for i0, i1, a0, a1, lo, hi in _query_blocks(lq, lk, causal, left, right):
        qb = qh[:, :, i0:i1]
        m = torch.full((hkv, group, i1 - i0), -math.inf, dtype=ct, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(hkv, group, i1 - i0, dv, dtype=ct, device=q.device)
        a = positions[i0:i1] + off
        for j0 in range(lo, hi, BLOCK):
            j1 = min(hi, j0 + BLOCK)
            s, _ = _scores(qb, kh[:, j0:j1], scale, softcap)
            if not _block_fully_visible(a0, a1, j0, j1, causal, left, right):
                vis = _visible(a, positions[j0:j1], causal, left, right)
                s = s.masked_fill(~vis, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - shift[..., None])
            corr = torch.exp(m - shift)
            l = l * corr + p.sum(-1)
            if dropout_p:
                keep = _keep_mask(p.shape, dropout_p, seed, segment, i0, j0, q.device)
                p = p * keep / (1.0 - dropout_p)
            acc = acc * corr[..., None] + torch.matmul(p, vh[:, j0:j1].unsqueeze(1))
            m = m_new
        seen = l > 0
        ob = torch.where(seen[..., None], acc / l.clamp(min=torch.finfo(ct).tiny)[..., None], torch.zeros_like(acc))
        out[i0:i1] = ob.permute(2, 0, 1, 3).reshape(i1 - i0, hq, dv).to(out.dtype)
        lse[:, i0:i1] = torch.where(seen, m + torch.log(l.clamp(min=torch.finfo(ct).tiny)),
                                    torch.full_like(m, -math.inf)).reshape(hq, i1 - i0)
    return out, lse


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, left: int, right: int, softcap: float,
             dropout_p: float = 0.0, seed: int = 0, segment: int = 0, dlse: torch.Tensor | None = None):
    """Gradients ``(dq, dk, dv)`` of one segment from the forward's ``out`` and ``lse`` (``dlse``: gradient on lse)."""
    lq, hq, d = q.shape
    lk, hkv, dv_dim = v.shape[0], v.shape[1], v.shape[2]
    group = hq // hkv
    ct = compute_dtype(q.dtype)
    dq = torch.zeros(hkv, group, lq, d, dtype=ct, device=q.device)
    dk = torch.zeros(hkv, lk, d, dtype=ct, device=q.device)
    dvv = torch.zeros(hkv, lk, dv_dim, dtype=ct, device=q.device)
    if lq and lk:
        qh = q.to(ct).reshape(lq, hkv, group, d).permute(1, 2, 0, 3)
        kh = k.to(ct).permute(1, 0, 2)
        vh = v.to(ct).permute(1, 0, 2)
        doh = dout.to(ct).reshape(lq, hkv, group, dv_dim).permute(1, 2, 0, 3)
        oh = out.to(ct).reshape(lq, hkv, group, dv_dim).permute(1, 2, 0, 3)
        lse_h = lse.to(ct).reshape(hkv, group, lq)
        # a query that saw no key: p = exp(s - inf) = 0 everywhere, so it contributes nothing
        lse_h = torch.where(torch.isinf(lse_h), torch.full_like(lse_h, math.inf), lse_h)
        delta = (doh * oh).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(ct).reshape(hkv, group, lq)
        off = lk - lq
        positions = torch.arange(max(lq, lk) + 1, device=q.device)
        for i0, i1, a0, a1, lo, hi in _query_blocks(lq, lk, causal, left, right):
            qb, dob = qh[:, :, i0:i1], doh[:, :, i0:i1]
            lb, db = lse_h[:, :, i0:i1, None], delta[:, :, i0:i1, None]
            a = positions[i0:i1] + off
            for j0 in range(lo, hi, BLOCK):
                j1 = min(hi, j0 + BLOCK)
                kb, vb = kh[:, j0:j1], vh[:, j0:j1]
                s, t = _scores(qb, kb, scale, softcap)
                p = torch.exp(s - lb)
                if not _block_fully_visible(a0, a1, j0, j1, causal, left, right):
                    p = p.masked_fill(~_visible(a, positions[j0:j1], causal, left, right), 0.0)
                dp = torch.matmul(dob, vb.transpose(-1, -2).unsqueeze(1))
                if dropout_p:
                    keep = _keep_mask(p.shape, dropout_p, seed, segment, i0, j0, q.device) / (1.0 - dropout_p)
                    dvv[:, j0:j1] += torch.matmul((p * keep).transpose(-1, -2), dob).sum(1)
                    dp = dp * keep
                else:
                    dvv[:, j0:j1] += torch.matmul(p.transpose(-1, -2), dob).sum(1)
                ds = p * (dp - db)
                if softcap:
                    ds = ds * (1.0 - t * t)
                ds = ds * scale
                dq[:, :, i0:i1] += torch.matmul(ds, kb.unsqueeze(1))
                dk[:, j0:j1] += torch.matmul(ds.transpose(-1, -2), qb).sum(1)
    dq = dq.permute(2, 0, 1, 3).reshape(lq, hq, d).to(q.dtype)
    return dq, dk.permute(1, 0, 2).to(k.dtype), dvv.permute(1, 0, 2).to(v.dtype)
