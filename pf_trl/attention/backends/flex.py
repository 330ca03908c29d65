"""FlexAttention with a document block mask.

On CUDA ``flex_attention`` is compiled (``torch.compile``, cached per process) and only the blocks that
intersect a segment's causal band are computed. On CPU it may be requested explicitly and then runs
uncompiled (PyTorch's dense reference implementation of flex: exact, slow, memory O(T^2)); ``auto`` never
picks it on CPU.
"""

from __future__ import annotations

import warnings

import torch

from pf_trl.attention.backends import _sinks
from pf_trl.batching.packing import segment_lengths, token_segments

NAME = "flex"
INSTALL_HINT = "needs PyTorch >= 2.5 with torch.nn.attention.flex_attention (pip install -U torch)"


_FLEX: dict[str, object] = {}


def _import():
    # module globals, not lru_cache: filled by the availability check, read as constants under torch.compile
    if "flex" not in _FLEX:
        from torch.nn.attention import flex_attention as flex_module
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _FLEX.update(flex=flex_attention, block_mask=create_block_mask,
                     aux_request=getattr(flex_module, "AuxRequest", None))
    return _FLEX["flex"], _FLEX["block_mask"]


def _import_error() -> str | None:
    try:
        _import()
    except Exception as exc:  # pragma: no cover - depends on the torch build
        return f"torch {torch.__version__} has no usable flex_attention ({type(exc).__name__}: {exc})"
    return None


def _compiled_flex():
    if "compiled" not in _FLEX:
        flex_attention, _ = _import()
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX["compiled"]


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    reason = _import_error()
    if reason:
        return reason
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except Exception:
            return "compiled FlexAttention on CUDA needs triton (pip install triton)"
    return None


def unsupported(*, causal, window, softcap, dropout_p, head_dim, gqa, device=None, requires_grad=False,
                **_) -> str | None:
    if dropout_p:
        return "FlexAttention has no attention dropout"
    if requires_grad and device is not None and device.type != "cuda":
        return "uncompiled FlexAttention has no backward off CUDA (forward/eval only)"
    if softcap and device is not None and device.type == "cuda":
        # seen on an H200 (torch 2.11, benchmarks/gpu/attention_check.py): the compiled kernel with the tanh
        # score_mod fails inside torch.compile ("all unwrapped values must be FakeTensor..."); sdpa serves it exactly
        return "compiled FlexAttention fails with a logit softcap on CUDA (torch.compile error); use sdpa or flash_attn"
    return None


def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, sinks=None):
    flex_attention, create_block_mask = _import()
    tq, tk = q.shape[0], k.shape[0]
    cu_q = cu_q.to(q.device)
    cu_k = cu_k.to(q.device)
    seg_q, pos_q = token_segments(cu_q, tq)
    seg_k, pos_k = token_segments(cu_k, tk)
    # bottom-right alignment: query i of a segment sits at key position i + (lk - lq)
    offset = (segment_lengths(cu_k) - segment_lengths(cu_q)).long()
    aligned_q = pos_q + offset[seg_q]
    left, right = window

    def mask_mod(b, h, q_idx, kv_idx):
        a = aligned_q[q_idx]
        j = pos_k[kv_idx]
        m = seg_q[q_idx] == seg_k[kv_idx]
        if causal:
            m = m & (j <= a)
        if left >= 0:
            m = m & (j >= a - left)
        if right >= 0:
            m = m & (j <= a + right)
        return m

    score_mod = None
    if softcap:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    # eager on CUDA: compile flex ourselves. Inside a torch.compile'd model: the plain functions, which the outer
    # compilation captures and lowers (a nested torch.compile would break its graph).
    inner = torch.compiler.is_compiling()
    compiled = q.device.type == "cuda" and not inner
    block_mask = create_block_mask(mask_mod, 1, None, tq, tk, device=q.device, _compile=compiled)
    fn = _compiled_flex() if compiled else flex_attention

    def attend_lse(q, k, v):
        # flex's lse is differentiable (its backward takes grad_logsumexp) and includes the softcap score_mod
        out, lse = _run(fn, inner, q, k, v, score_mod, block_mask, scale, with_lse=True)
        return out.squeeze(0).transpose(0, 1), lse.squeeze(0).transpose(0, 1)

    if sinks is not None:
        return _sinks.attend_with_sinks(attend_lse, None, q, k, v, sinks, scale=scale)
    return _run(fn, inner, q, k, v, score_mod, block_mask, scale).squeeze(0).transpose(0, 1)


def _run(fn, inner, q, k, v, score_mod, block_mask, scale, *, with_lse=False):
    if inner:
        return _call(fn, q, k, v, score_mod, block_mask, scale, with_lse=with_lse)
    with warnings.catch_warnings():
        # CPU: the unfused reference is what we want here; do not tell the user to compile it
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _call(fn, q, k, v, score_mod, block_mask, scale, with_lse=with_lse)


def _call(fn, q, k, v, score_mod, block_mask, scale, *, with_lse=False):
    gqa = q.shape[1] != k.shape[1]
    extra = {}
    if with_lse:
        # torch >= 2.9: return_aux=AuxRequest(lse=True) -> (out, AuxOutput); before: return_lse=True -> (out, lse)
        aux_request = _FLEX.get("aux_request")
        extra = {"return_aux": aux_request(lse=True)} if aux_request is not None else {"return_lse": True}
    out = fn(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=gqa,
        **extra,
    )
    if not with_lse:
        return out
    out, aux = out
    return out, getattr(aux, "lse", aux)
