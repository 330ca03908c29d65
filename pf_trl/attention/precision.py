"""Mixed precision at the one entry of pf-trl's attention kernels.

Under autocast (``bf16=True`` / ``fp16=True`` in the trainer) a transformers attention layer hands over tensors of
mixed dtypes: the projections ran in the autocast dtype, but the rotary tables (and whatever the model multiplies
with them) are float32, so ``query`` and ``key`` often arrive in float32 next to a bfloat16 ``value``. PyTorch's
``scaled_dot_product_attention`` (what transformers' ``sdpa`` and, for the matmuls, ``eager`` run) is on autocast's
lower-precision list: it casts all three to the autocast dtype and returns that dtype. pf-trl's kernels do the same,
in one place (:func:`autocast_qkv`, called by :func:`pf_trl.attention.dispatch.varlen_attention` and before
Ulysses' all-to-all), and then run with autocast off (:func:`autocast_off`), so their float32 accumulators and
softmax statistics (the log-sum-exp, the sink rescale) stay float32 instead of being cast down by autocast.

Outside autocast the three tensors must share a dtype (as sdpa requires); bf16 weights without autocast, float32 and
float64 runs pass through unchanged.
"""

from __future__ import annotations

import contextlib

import torch

from pf_trl.errors import AttentionArgumentError


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matmuls to on ``device_type`` (``None`` when autocast is off there)."""
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu"):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(q, k, v)`` in the dtype attention computes in: the autocast dtype under autocast (as sdpa casts them),
    else their common dtype; mixed dtypes outside autocast raise :class:`~pf_trl.errors.AttentionArgumentError`."""
    target = autocast_dtype(q.device.type)
    if target is not None and q.is_floating_point():
        return q.to(target), k.to(target), v.to(target)
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionArgumentError(
            f"query, key and value have different dtypes ({q.dtype}, {k.dtype}, {v.dtype}) outside autocast: load the "
            "model in one dtype (torch_dtype) or train under autocast (bf16=True / fp16=True)"
        )
    return q, k, v


def autocast_off(device_type: str):
    """A context where autocast is off on ``device_type`` (a no-op context when it already is): pf-trl's kernels pick
    their own compute dtypes (float32 accumulation and statistics) and must not have them cast down."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
