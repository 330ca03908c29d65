"""``varlen_attention``: one entry point over several exact variable-length attention kernels.

Backends (see :mod:`pf_trl.attention.backends`):

=============  ======================================================  ===================================
name           kernel                                                  where
=============  ======================================================  ===================================
flash_attn     ``flash_attn_varlen_func``: FA3 on Hopper, FA4 on SM90+   CUDA, fp16/bf16, ``pip install flash-attn``
               (``flash_attn.cute``), else FA2, whichever is installed  or ``pip install flash-attn-4``
torch_varlen   ``torch.nn.attention.varlen.varlen_attn``                CUDA sm80+, fp16/bf16, torch builds that ship it
flex           FlexAttention + document block mask (compiled on CUDA)   CUDA (auto); CPU only when asked, uncompiled
sdpa           per-segment ``scaled_dot_product_attention``             everywhere; exact reference
=============  ======================================================  ===================================

``backend="auto"`` takes the first entry of that order that runs on the tensors' device and dtype and supports
the requested features; on CPU that is always ``sdpa``. An explicitly named backend that cannot run raises
:class:`BackendUnavailableError` with the install hint; nothing ever falls back to an attention that mixes
segments.

Sliding window: ``sliding_window=W`` follows transformers' convention (``masking_utils.sliding_window_overlay``,
``kv_idx > q_idx - W``): with causal attention each query sees itself and the ``W - 1`` previous tokens of its
segment, which is flash-attn ``window_size=(W - 1, 0)``; transformers' flash path passes ``(W - 1, W - 1)``
together with ``causal=True``, which is the same mask. Non-causal: ``(W - 1, W - 1)``.

An argument no backend can take (an unknown backend name, shapes that do not fit, a window below 1) raises
:class:`~pf_trl.errors.AttentionArgumentError`, a ``ValueError``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

from pf_trl.attention.backends import BACKEND_MODULES
from pf_trl.attention.errors import BackendUnavailableError, UnsupportedFeatureError
from pf_trl.attention.precision import autocast_off, autocast_qkv
from pf_trl.errors import AttentionArgumentError

logger = logging.getLogger("pf_trl.attention")

BACKENDS = tuple(BACKEND_MODULES)
AUTO_ORDER = {"cuda": ("flash_attn", "torch_varlen", "flex", "sdpa")}
DEFAULT_AUTO_ORDER = ("sdpa",)
_logged_choices: set[tuple] = set()


_LOADED: dict[str, ModuleType] = {}


def _module(name: str) -> ModuleType:
    # a plain dict, not lru_cache: under torch.compile the lookup of an already imported backend is traced as a
    # dict read (resolve_backend, run at trace time, imports it first) instead of breaking the graph on importlib
    module = _LOADED.get(name)
    if module is None:
        if name not in BACKEND_MODULES:
            raise AttentionArgumentError(
                f"unknown varlen attention backend {name!r}; choose one of {('auto', *BACKENDS)}"
            )
        module = _LOADED[name] = importlib.import_module(BACKEND_MODULES[name])
    return module


@functools.cache
def _unavailable(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        return _module(name).unavailable(device, dtype)
    except Exception as exc:  # a broken optional install must not break the others
        return f"{type(exc).__name__}: {exc}"


def flash_window(causal: bool, sliding_window: int | None) -> tuple[int, int]:
    """flash-attn ``window_size`` for transformers' ``sliding_window`` (see module docstring)."""
    if sliding_window is None:
        return (-1, -1)
    w = int(sliding_window)
    if w < 1:
        raise AttentionArgumentError(f"sliding_window must be >= 1, got {sliding_window}")
    return (w - 1, 0) if causal else (w - 1, w - 1)


def backend_status(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, str | None]:
    """``{backend: None if it can run on (device, dtype) else the reason}``."""
    device = _normalize_device(torch.device(device))
    return {name: _unavailable(name, device, dtype) for name in BACKENDS}


def available_backends(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    return [name for name, reason in backend_status(device, dtype).items() if reason is None]


def _normalize_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


@torch.compiler.assume_constant_result
def resolve_backend(
    backend: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    head_dim: int = 64,
    gqa: bool = False,
    requires_grad: bool = False,
    sinks: bool = False,
) -> str:
    """Name of the backend that will serve such a call; raises if an explicit one cannot.

    Its arguments are fixed for a compiled graph (device, dtype, head size, grad mode are guarded by torch.compile),
    so torch.compile runs it once at trace time and keeps the answer as a constant
    (``torch.compiler.assume_constant_result``): the backend choice costs nothing in the graph.
    """
    device = _normalize_device(device)
    features = dict(
        causal=causal,
        window=window,
        softcap=softcap,
        dropout_p=dropout_p,
        head_dim=head_dim,
        gqa=gqa,
        device=device,
        requires_grad=requires_grad,
        sinks=sinks,
    )
    if backend != "auto":
        mod = _module(backend)
        reason = _unavailable(backend, device, dtype)
        if reason is not None:
            raise BackendUnavailableError(
                f"varlen attention backend {backend!r} is not available on {device.type}/{dtype}: {reason}. "
                f"Install: {mod.INSTALL_HINT}. Or use backend='auto' (available here: "
                f"{available_backends(device, dtype)})."
            )
        reason = mod.unsupported(**features)
        if reason is not None:
            raise UnsupportedFeatureError(f"varlen attention backend {backend!r} cannot serve this call: {reason}")
        return backend
    skipped = []
    for name in AUTO_ORDER.get(device.type, DEFAULT_AUTO_ORDER):
        reason = _unavailable(name, device, dtype) or _module(name).unsupported(**features)
        if reason is None:
            key = (device.type, dtype, name, tuple(skipped))
            if key not in _logged_choices:
                _logged_choices.add(key)
                logger.info(
                    "pf-trl varlen attention: using backend %r on %s/%s%s",
                    name,
                    device.type,
                    str(dtype).replace("torch.", ""),
                    f" (skipped: {'; '.join(skipped)})" if skipped else "",
                )
            return name
        skipped.append(f"{name}: {reason}")
    raise BackendUnavailableError(f"no varlen attention backend can serve this call: {'; '.join(skipped)}")


def _as_size(n) -> int:
    # keep ints (and torch.compile's symbolic ints) as they are: int() on a symbolic int would specialize the graph
    # on its value and recompile for every new max length
    return n if isinstance(n, (int, torch.SymInt)) else int(n)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of packed segments: no token attends outside its own segment.

    Args:
        q: ``(total_q, heads, head_dim)``; k, v: ``(total_k, kv_heads, head_dim)`` with ``heads % kv_heads == 0``
            (GQA/MQA when fewer KV heads).
        cu_seqlens_q, cu_seqlens_k: int32 ``(n_segments + 1,)`` cumulative lengths, starting at 0 and ending at
            the total token count (flash-attn's ``cu_seqlens``).
        max_seqlen_q, max_seqlen_k: the longest segment, a Python int (carried from the collator: reading it from
            ``cu_seqlens`` would be a host sync).
        causal: causal mask inside each segment, bottom-right aligned when a segment has fewer queries than keys.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        sliding_window: transformers' convention, each query sees at most ``sliding_window`` keys (itself
            included); flash-attn ``window_size=(sliding_window - 1, 0)``.
        softcap: ``softcap * tanh(score / softcap)`` on the scaled scores (Gemma-2 style); ``None``/0 = off.
        dropout_p: attention dropout probability (pass 0.0 in eval).
        backend: ``"auto"`` or one of ``flash_attn``, ``torch_varlen``, ``flex``, ``sdpa``.
        sinks: attention sinks, one logit per query head ``(heads,)`` (gpt-oss ``s_aux``): each query's softmax
            gets one more term ``exp(sinks[h])`` in its denominator, whose value is zero
            (:mod:`pf_trl.attention.backends._sinks`). ``None`` = no sinks.

    Under autocast q/k/v are cast to the autocast dtype first (as ``scaled_dot_product_attention`` casts them) and
    the kernel runs with autocast off: its softmax statistics stay float32 (:mod:`pf_trl.attention.precision`).

    Returns:
        ``(total_q, heads, head_dim)`` in q's dtype (the autocast dtype under autocast).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise AttentionArgumentError(
            f"q/k/v must be (total_tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise AttentionArgumentError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise AttentionArgumentError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise AttentionArgumentError(
            f"cu_seqlens_q/k must be 1-D of the same length, got {tuple(cu_seqlens_q.shape)} and "
            f"{tuple(cu_seqlens_k.shape)}"
        )
    if softcap is not None and softcap < 0:
        raise AttentionArgumentError(f"softcap must be positive, got {softcap}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1]):
        raise AttentionArgumentError(
            f"sinks must be 1-D with one value per query head ({q.shape[1]}), got {tuple(sinks.shape)}"
        )
    # under autocast: q/k/v in the autocast dtype, as sdpa casts them; the kernel then runs with autocast off so its
    # float32 statistics stay float32 (pf_trl.attention.precision)
    q, k, v = autocast_qkv(q, k, v)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    window = flash_window(causal, sliding_window)
    cap = float(softcap or 0.0)
    name = resolve_backend(
        backend,
        device=q.device,
        dtype=q.dtype,
        causal=causal,
        window=window,
        softcap=cap,
        dropout_p=float(dropout_p),
        head_dim=q.shape[-1],
        gqa=q.shape[1] != k.shape[1],
        requires_grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        sinks=sinks is not None,
    )
    extra = {} if sinks is None else {"sinks": sinks}  # a backend's forward need not know sinks to serve calls without
    with autocast_off(q.device.type):
        return _module(name).forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            _as_size(max_seqlen_q),
            _as_size(max_seqlen_k),
            causal=causal,
            scale=scale,
            window=window,
            softcap=cap,
            dropout_p=float(dropout_p),
            **extra,
        )
