"""The padding-free modes, without importing TRL (the CLI checks ``--padding_free`` before anything heavy)."""

from __future__ import annotations

PADDING_FREE_MODES = ("huggingface", "internal", "none")
_TRUE = ("true", "yes", "1", "on")
_FALSE = ("false", "no", "0", "off", "")


def normalize_padding_free(value) -> str:
    """``huggingface`` | ``internal`` | ``none``; booleans (TRL style) map to ``huggingface`` / ``none``."""
    if isinstance(value, bool) or value is None:
        return "huggingface" if value else "none"
    text = str(value).strip().lower()
    if text in _TRUE:
        return "huggingface"
    if text in _FALSE or text == "none":
        return "none"
    if text in PADDING_FREE_MODES:
        return text
    raise ValueError(f"padding_free must be one of {', '.join(PADDING_FREE_MODES)} (or true/false), got {value!r}")
