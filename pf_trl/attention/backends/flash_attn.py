"""flash-attention kernels: FA3 (``flash_attn_interface``) on Hopper, FA4 (``flash_attn.cute``) on SM90 and newer,
else FA2 (``flash_attn``), in that order of preference, whichever is installed.

``flash_attn_varlen_func`` takes q/k/v as ``(total_tokens, heads, head_dim)`` with int32 ``cu_seqlens``,
supports GQA natively, ``window_size=(left, right)`` and (FA2 >= 2.6, FA3, FA4) ``softcap``. FA3 and FA4 have no
dropout: a call with dropout falls back to FA2 when that is installed. Attention sinks: the kernel's log-sum-exp
(``return_attn_probs=True``; FA4 ``return_lse=True``) rescales its output (:mod:`~pf_trl.attention.backends._sinks`).

FA4 (the ``flash-attn-4`` wheel, CuTe DSL) is called with keywords only: its ``flash_attn_varlen_func`` has ``qv``
as the fourth positional parameter, takes ``window_size`` as ``(None, None)`` for "no window", always returns
``(out, lse)`` and compiles each new configuration at its first call (seconds).
"""

from __future__ import annotations

import inspect

import torch

from pf_trl.attention.backends import _sinks

NAME = "flash_attn"
INSTALL_HINT = "pip install flash-attn --no-build-isolation (FA2; FA3 for Hopper: build hopper/ from the flash-attention repo)"


# Module globals, not lru_cache: the availability checks (run for real when torch.compile resolves the backend)
# fill them, and the traced forward reads constants instead of tracing imports and device queries.
_IMPORTS: dict[str, tuple] = {}
_MAJOR: dict[int | None, int] = {}


def _import(module: str, label: str) -> tuple:
    if module not in _IMPORTS:
        try:
            fn = __import__(module, fromlist=["flash_attn_varlen_func"]).flash_attn_varlen_func
            _IMPORTS[module] = (fn, frozenset(inspect.signature(fn).parameters))
        except Exception as exc:
            _IMPORTS[module] = (None, f"{label} is not importable ({type(exc).__name__}: {exc})")
    return _IMPORTS[module]


def _fa2():
    return _import("flash_attn", "flash-attn")


def _fa3():
    return _import("flash_attn_interface", "flash_attn_interface (FA3)")


def _fa4():
    return _import("flash_attn.cute", "flash_attn.cute (FA4, the flash-attn-4 wheel)")


def _major(device: torch.device) -> int:
    """CUDA compute-capability major of ``device`` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    if device.index not in _MAJOR:
        _MAJOR[device.index] = torch.cuda.get_device_capability(device)[0] if torch.cuda.is_available() else 0
    return _MAJOR[device.index]


def _is_hopper(device: torch.device) -> bool:
    return _major(device) == 9


def kernel_for(device: torch.device, dropout_p: float = 0.0):
    """(name, fn, params) of the kernel this device would use, or (None, reason, None)."""
    fa3, p3 = _fa3()
    if fa3 is not None and _is_hopper(device) and not dropout_p:
        return "fa3", fa3, p3
    fa4, p4 = _fa4()
    if fa4 is not None and _major(device) >= 9 and not dropout_p:
        return "fa4", fa4, p4
    fa2, p2 = _fa2()
    if fa2 is not None:
        return "fa2", fa2, p2
    if (fa3 is not None and _is_hopper(device)) or (fa4 is not None and _major(device) >= 9):
        return None, "FA3/FA4 have no attention dropout and FA2 (flash-attn) is not installed", None
    if fa4 is not None:
        return None, f"FA4 (flash_attn.cute) needs an SM90+ GPU; this one is sm{_major(device)}x ({p2})", None
    return None, p2, None


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        if all(fn is None for fn, _ in (_fa2(), _fa3(), _fa4())):
            return "flash-attn is not installed (and it runs on CUDA only)"
        return f"flash-attn runs on CUDA only (got device {device.type})"
    name, reason, _ = kernel_for(device)
    if name is None:
        return reason
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16/bfloat16, got {dtype}"
    return None


def unsupported(*, causal, window, softcap, dropout_p, head_dim, gqa, device=None, sinks=False, **_) -> str | None:
    name, fn, params = kernel_for(device or torch.device("cuda"), dropout_p)
    if name is None:
        return fn
    if sinks and softcap:
        return "attention sinks together with softcap (the sink rescale's gradient assumes uncapped scores)"
    if sinks and "return_attn_probs" not in params and "return_lse" not in params:
        return "this flash-attn cannot return its log-sum-exp (return_attn_probs), which attention sinks need"
    if window != (-1, -1) and "window_size" not in params:
        return "this flash-attn has no window_size (needs >= 2.3)"
    if softcap and "softcap" not in params:
        return "this flash-attn has no softcap (needs >= 2.6)"
    if head_dim > 256:
        return f"flash-attn supports head_dim <= 256 (got {head_dim})"
    if name == "fa4" and head_dim % 8:
        return f"FA4 needs head_dim divisible by 8 (got {head_dim})"
    return None


def forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, sinks=None):
    if sinks is not None:
        def attend_lse(q, k, v):
            out, lse = _call(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window,
                             softcap=softcap, dropout_p=dropout_p, with_lse=True)
            # flash-attn's varlen lse is (heads, total_q), natural log, without gradient
            return out, lse.transpose(0, 1) if lse.shape[0] == q.shape[1] else lse

        def attend(q, k, v):
            return _call(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window,
                         softcap=softcap, dropout_p=0.0)

        return _sinks.attend_with_sinks(attend_lse, attend, q, k, v, sinks, scale=scale)
    return _call(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window, softcap=softcap,
                 dropout_p=dropout_p)


def _call(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, dropout_p, with_lse=False):
    name, fn, params = kernel_for(q.device, dropout_p)
    if name is None:
        raise RuntimeError(fn)
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    if name == "fa4":
        return _call_fa4(fn, q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, window=window,
                         softcap=softcap, with_lse=with_lse)
    kwargs = {"softmax_scale": scale, "causal": causal}
    if window != (-1, -1):
        kwargs["window_size"] = tuple(window)
    if softcap:
        kwargs["softcap"] = float(softcap)
    if name == "fa2":
        kwargs["dropout_p"] = dropout_p
    if with_lse:
        kwargs["return_attn_probs"] = True  # (out, softmax_lse, ...); FA2 allocates the probabilities only with dropout
    out = fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)  # ints (or symbolic ints under compile)
    if with_lse:
        return out[0], out[1]
    return out[0] if isinstance(out, tuple) else out


def fa4_window(window: tuple[int, int]) -> tuple[int | None, int | None]:
    """FA4's ``window_size``: ``None`` where flash-attn 2/3 say -1 (no limit on that side)."""
    return tuple(None if w < 0 else int(w) for w in window)


def _call_fa4(fn, q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, window, softcap, with_lse):
    out, lse = fn(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                  softmax_scale=scale, causal=causal, window_size=fa4_window(window), softcap=float(softcap or 0.0),
                  return_lse=with_lse)
    return (out, lse) if with_lse else out
