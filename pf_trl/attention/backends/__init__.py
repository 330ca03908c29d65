"""Varlen attention backends.

Every backend module exposes the same three functions:

- ``unavailable(device, dtype) -> str | None``: why it cannot run on that device/dtype (``None`` = it can);
- ``unsupported(*, causal, window, softcap, dropout_p, head_dim, gqa, sinks) -> str | None``: which requested
  feature it lacks (``None`` = it supports the call);
- ``forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, sinks=None) -> Tensor``.

Shared semantics (flash-attn's): q/k/v are ``(total_tokens, heads, head_dim)``; segment ``s`` owns query rows
``cu_q[s]:cu_q[s+1]`` and key rows ``cu_k[s]:cu_k[s+1]``. Inside a segment with ``lq`` queries and ``lk`` keys,
query ``i`` is aligned to key position ``a = i + lk - lq`` (bottom-right alignment) and sees key ``j`` iff
``(not causal or j <= a) and (left < 0 or j >= a - left) and (right < 0 or j <= a + right)`` where
``window = (left, right)``. ``softcap > 0`` replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)``.
A query that sees no key outputs zeros. ``sinks`` (``(heads,)``) adds ``exp(sinks[h])`` to every softmax
denominator of head ``h`` (attention sinks; the maths is in :mod:`~pf_trl.attention.backends._sinks`).
"""

from __future__ import annotations

__all__ = ["BACKEND_MODULES"]

BACKEND_MODULES = {
    "flash_attn": "pf_trl.attention.backends.flash_attn",
    "torch_varlen": "pf_trl.attention.backends.torch_varlen",
    "flex": "pf_trl.attention.backends.flex",
    "sdpa": "pf_trl.attention.backends.sdpa",
}
