"""Packed-row lengths beyond which a model stops being exact, because transformers reads the row position.

Llama 4 (``llama4``, ``llama4_text``): attention temperature tuning scales the queries of its NoPE layers by
``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, where transformers 5.24-5.25 take ``p`` from
``arange(row length)``, not from ``position_ids``. In a packed row an example starting at row position ``s`` is
scaled as if its tokens sat at ``s + i`` instead of ``i``. The factor is 1 below ``p + 1 = floor_scale``, so a
packed row of at most ``floor_scale - 1`` tokens (8,191 with the released configs) is exact; a longer one is
refused before training (the sampler's token budget) and on the first such batch of a direct call.
"""

from __future__ import annotations

import torch

from pf_trl.attention.errors import UnsupportedModelError


def packed_row_limit(model: torch.nn.Module) -> tuple[int, str] | None:
    """``(longest exact packed row in tokens, why)`` for ``model``, or ``None`` when its rows may be any length."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    floor_scale = getattr(text, "floor_scale", None)
    nope_layers = [i for i, rope in enumerate(getattr(text, "no_rope_layers", None) or []) if not rope]
    if getattr(text, "attn_temperature_tuning", False) and isinstance(floor_scale, int) and nope_layers:
        return floor_scale - 1, (
            f"{getattr(config, 'model_type', type(model).__name__)} scales the queries of its NoPE layers by the "
            "token's position in the row (attention temperature tuning, which transformers computes from the row, "
            f"not from position_ids): a packed row longer than floor_scale - 1 = {floor_scale - 1} tokens would "
            "rescale the examples that start after its beginning"
        )
    return None


def check_packed_rows(model: torch.nn.Module, tokens: int) -> None:
    """Raise :class:`UnsupportedModelError` if packed rows of ``tokens`` tokens cannot be exact for ``model``."""
    limit = packed_row_limit(model)
    if limit is not None and tokens > limit[0]:
        raise UnsupportedModelError(
            f"{limit[1]}. Packed rows here hold up to {tokens} tokens: set max_tokens_per_batch <= {limit[0]} "
            "(and keep examples that short), or train padded (padding_free='none')."
        )
