"""PyTorch's own variable-length attention op, ``torch.nn.attention.varlen.varlen_attn`` (CUDA only).

Detected by import: older torch builds lack it. Its keyword arguments changed across releases (``is_causal``
in the first release, ``window_size``/``enable_gqa`` later), so the call adapts to the signature it finds.
It has no dropout and no softcap; ``auto`` skips it for calls that need them. Attention sinks: its log-sum-exp
(``return_aux=AuxRequest(lse=True)``) rescales the output (:mod:`~pf_trl.attention.backends._sinks`).
"""

from __future__ import annotations

import inspect

import torch

from pf_trl.attention.backends import _sinks

NAME = "torch_varlen"
INSTALL_HINT = "needs a PyTorch build with torch.nn.attention.varlen.varlen_attn (torch >= 2.10, CUDA): pip install -U torch"


_OP: tuple | None = None


def _op():
    # a module global, not lru_cache: the backend's availability check (run for real when torch.compile resolves
    # the backend) fills it, and the traced forward then reads a constant instead of tracing an import
    global _OP
    if _OP is None:
        from torch.nn.attention.varlen import varlen_attn

        _OP = (varlen_attn, frozenset(inspect.signature(varlen_attn).parameters))
    return _OP


def _import_error() -> str | None:
    try:
        _op()
    except Exception as exc:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({type(exc).__name__})"
    return None


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    reason = _import_error()
    if reason:
        return reason
    if device.type != "cuda":
        return f"varlen_attn runs on CUDA only (got device {device.type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"varlen_attn (flash kernels) needs float16/bfloat16, got {dtype}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"varlen_attn needs compute capability >= 8.0 (got {major}.x)"
    return None


def unsupported(*, causal, window, softcap, dropout_p, head_dim, gqa, sinks=False, **_) -> str | None:
    reason = _import_error()
    if reason:
        return reason
    _, params = _op()
    if sinks and "return_aux" not in params:
        return "this torch's varlen_attn cannot return its log-sum-exp (return_aux), which attention sinks need"
    if dropout_p:
        return "varlen_attn has no attention dropout"
    if softcap:
        return "varlen_attn has no softcap"
    if window != (-1, -1) and "window_size" not in params:
        return "this torch's varlen_attn has no window_size (sliding window)"
    if not causal and "window_size" not in params and "is_causal" not in params:
        return "this torch's varlen_attn cannot express non-causal attention"
    if head_dim > 256 or head_dim % 8:
        return f"varlen_attn needs head_dim <= 256 and a multiple of 8 (got {head_dim})"
    return None


def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, sinks=None):
    if sinks is not None:
        def attend_lse(q, k, v):
            return _call(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window, with_lse=True)

        def attend(q, k, v):
            return _call(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window)

        return _sinks.attend_with_sinks(attend_lse, attend, q, k, v, sinks, scale=scale)
    return _call(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window)


def _call(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, with_lse=False):
    op, params = _op()
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:
        left, right = window
        if causal:
            right = 0
        kwargs["window_size"] = (left, right)  # (-1, 0) is plain causal for varlen_attn
    else:
        kwargs["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
    if with_lse:
        from torch.nn.attention.varlen import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    out = op(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)  # ints (or symbolic ints under compile)
    if with_lse:
        lse = out[1]  # (total_q, heads) as documented, natural log, without gradient
        return out[0], lse if lse.shape[0] == q.shape[0] else lse.transpose(0, 1)
    return out[0] if isinstance(out, tuple) else out
