"""Which flash-attention package is really installed, and what transformers should be asked for.

Three distributions put kernels under names that overlap:

- ``flash-attn`` (FA2): ``flash_attn.flash_attn_varlen_func``;
- ``flash-attn-3``: ``flash_attn_interface.flash_attn_varlen_func`` (Hopper);
- ``flash-attn-4`` (CuTe DSL, JIT-compiled at first call, SM90 and newer): only ``flash_attn/cute/``, so
  ``import flash_attn`` succeeds as a namespace package that has no ``flash_attn_varlen_func``.

A plain ``import flash_attn`` therefore proves nothing. :func:`installed_flash_kernels` imports the function each
package exports, and :func:`transformers_flash_implementation` maps the result to the ``attn_implementation`` that
transformers serves from a local package (``flash_attention_2`` / ``_3`` / ``_4``) without reaching for the
kernels hub (network), which it does when asked for a flash implementation whose package is missing.
"""

from __future__ import annotations

import importlib

# (name, module, transformers attn_implementation, minimum CUDA compute-capability major)
FLASH_KERNELS = (
    ("fa3", "flash_attn_interface", "flash_attention_3", 9),
    ("fa4", "flash_attn.cute", "flash_attention_4", 9),
    ("fa2", "flash_attn", "flash_attention_2", 8),
)


def _varlen_func(module: str):
    """``module.flash_attn_varlen_func`` or None (a namespace package or a broken install gives None)."""
    try:
        return getattr(importlib.import_module(module), "flash_attn_varlen_func", None)
    except Exception:  # an optional install that fails to import must not break anything else
        return None


def installed_flash_kernels() -> dict[str, bool]:
    """``{"fa3": bool, "fa4": bool, "fa2": bool}``: whether each package's ``flash_attn_varlen_func`` imports."""
    return {name: _varlen_func(module) is not None for name, module, _, _ in FLASH_KERNELS}


def transformers_flash_implementation(capability_major: int | None) -> tuple[str | None, str]:
    """(``attn_implementation`` or None, one line saying why) for a CUDA device of that compute capability.

    ``capability_major`` None means no CUDA device: no flash implementation. Preference on a device that runs
    several: FA3 (Hopper's own kernels), then FA4, then FA2.
    """
    if capability_major is None:
        return None, "no CUDA device (flash-attention runs on CUDA only)"
    found = installed_flash_kernels()
    for name, module, impl, major in FLASH_KERNELS:
        if found[name] and capability_major >= major:
            return impl, f"{module}.flash_attn_varlen_func is installed: attn_implementation={impl}"
    present = [f"{module} (needs sm{major}0+)" for name, module, _, major in FLASH_KERNELS if found[name]]
    if present:
        return None, f"{', '.join(present)} installed but this GPU is sm{capability_major}x"
    return None, "no flash-attention package with flash_attn_varlen_func is installed (flash-attn, flash-attn-3, " \
                 "flash-attn-4)"
