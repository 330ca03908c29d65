"""The padding-free modes and TRL's ``padding_free`` switch, without importing TRL (the CLI checks them before
anything heavy).

``padding_free`` keeps TRL's boolean meaning: ``True`` trains padding-free in ``padding_free_mode`` (default
:data:`DEFAULT_MODE`), ``False`` trains padded (TRL's own path, ``padding_free_mode='none'``). Older pf-trl code wrote
the mode into ``padding_free`` (``padding_free="internal"``, fms-hf-tuning's ``--padding_free huggingface``): such a
value is a deprecated alias of ``padding_free_mode``, accepted with one ``FutureWarning``.
"""

from __future__ import annotations

import warnings

from pf_trl.errors import ConfigError

PADDING_FREE_MODES = ("huggingface", "internal", "none")
DEFAULT_MODE = "huggingface"  # what padding_free=True (or unset) trains
_TRUE = ("true", "yes", "t", "y", "1", "on")
_FALSE = ("false", "no", "f", "n", "0", "off")


def as_bool(value) -> bool | None:
    """``True`` / ``False`` for a bool or a bool spelled as text (``"true"``, ``"0"``, ...), else ``None``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def legacy_mode(value) -> str | None:
    """The mode a pre-``padding_free_mode`` value of ``padding_free`` names (``"internal"``), else ``None``."""
    if isinstance(value, str) and value.strip().lower() in PADDING_FREE_MODES:
        return value.strip().lower()
    return None


def deprecation_message(mode: str, *, cli: bool = False) -> str:
    if cli:
        return (f"--padding_free {mode} is deprecated: pass --padding_free_mode {mode} (--padding_free is TRL's "
                "true/false switch: true trains padding-free in --padding_free_mode, false trains padded)")
    return (f"padding_free={mode!r} is deprecated: pass padding_free_mode={mode!r} (padding_free is TRL's bool: True "
            "trains padding-free in padding_free_mode, False trains padded)")


def resolve_padding_free(padding_free, mode, *, stacklevel: int = 2) -> tuple[bool, str]:
    """``(padding_free, padding_free_mode)``, consistent: the bool is ``mode != "none"``.

    ``padding_free``: ``None`` (unset: padding-free), a bool (TRL's meaning) or a mode name (deprecated alias of
    ``padding_free_mode``: one ``FutureWarning``). ``mode``: ``None`` (from ``padding_free``) or one of
    :data:`PADDING_FREE_MODES`. A bool or alias that contradicts ``mode`` is refused (``ValueError``).
    """
    if mode is not None:
        text = str(mode).strip().lower()
        if text not in PADDING_FREE_MODES:
            raise ConfigError(f"padding_free_mode must be one of {', '.join(PADDING_FREE_MODES)}, got {mode!r}")
        mode = text
    alias = legacy_mode(padding_free)
    if alias is not None:
        if mode is not None and mode != alias:
            raise ConfigError(
                f"padding_free={padding_free!r} (the old spelling of padding_free_mode={alias!r}) conflicts with "
                f"padding_free_mode={mode!r}: pass padding_free_mode alone")
        warnings.warn(deprecation_message(alias), FutureWarning, stacklevel=stacklevel + 1)
        return alias != "none", alias
    if padding_free is None:
        mode = mode or DEFAULT_MODE
        return mode != "none", mode
    switch = as_bool(padding_free)
    if switch is None:
        raise ConfigError(f"padding_free must be one of True, False (TRL's switch) or, deprecated, a mode of "
                         f"padding_free_mode ({', '.join(PADDING_FREE_MODES)}), got {padding_free!r}")
    if mode is None:
        return switch, DEFAULT_MODE if switch else "none"
    if switch != (mode != "none"):
        what = "padding-free" if switch else "padded (TRL's path)"
        raise ConfigError(f"padding_free={switch} trains {what} but padding_free_mode={mode!r} trains "
                         f"{'padded' if mode == 'none' else 'padding-free'}: pass one of them")
    return switch, mode
