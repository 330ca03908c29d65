"""Exceptions raised by the padding-free attention layer.

Every condition under which attention could silently let packed examples see each other raises one of
these instead of falling back.
"""

from __future__ import annotations

from pf_trl.errors import PfTrlError


class PaddingFreeError(PfTrlError, RuntimeError):
    """Base class for padding-free attention errors."""


class BackendUnavailableError(PaddingFreeError):
    """An explicitly requested varlen backend cannot run here (missing package, wrong device or dtype)."""


class UnsupportedFeatureError(PaddingFreeError):
    """The requested attention features (softcap, dropout, window, ...) are not supported by the backend."""


class UnsupportedModelError(PaddingFreeError, ValueError):
    """The model cannot be made padding-free (unknown architecture, remote code, multimodal rotary...)."""


class PackedAttentionMaskError(PaddingFreeError, ValueError):
    """An ``attention_mask`` was passed together with packed ``position_ids`` (several segments in a row)."""
