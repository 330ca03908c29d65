"""Exact padding-free attention: a varlen dispatcher, its transformers registration and the model patch."""

from __future__ import annotations

from pf_trl.attention.dispatch import available_backends, backend_status, varlen_attention
from pf_trl.attention.errors import (
    BackendUnavailableError,
    PackedAttentionMaskError,
    PaddingFreeError,
    UnsupportedFeatureError,
    UnsupportedModelError,
)

__all__ = [
    "varlen_attention",
    "enable_padding_free",
    "available_backends",
    "backend_status",
    "BackendUnavailableError",
    "PackedAttentionMaskError",
    "PaddingFreeError",
    "UnsupportedFeatureError",
    "UnsupportedModelError",
]


def __getattr__(name):
    # enable_padding_free imports transformers: keep `import pf_trl.attention` light for kernel-only users.
    if name == "enable_padding_free":
        from pf_trl.attention.enable import enable_padding_free

        return enable_padding_free
    raise AttributeError(f"module 'pf_trl.attention' has no attribute {name!r}")
