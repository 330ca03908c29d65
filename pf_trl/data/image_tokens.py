"""The image features of a packed row, as the vision data path writes them and the collator and the model read them.

- :data:`TOKEN_TYPE_KEYS`: per-token modality ids (``mm_token_type_ids`` for Qwen-VL, ``token_type_ids`` for
  Gemma 3), one value per token;
- :data:`IMAGE_KEYS`: per-image features (``pixel_values``, ``image_grid_thw``), one row per image, concatenated in
  example order by the collator;
- :func:`image_groups`: how many images one example's modality ids hold, counted as the models' own
  ``get_rope_index`` counts them.

Shared by :mod:`pf_trl.data.vision` (checking a row against its images), :mod:`pf_trl.batching.collator` and
:mod:`pf_trl.attention.mrope`; it sits below all three and imports nothing of pf-trl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TOKEN_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")
# video inputs are not packed: images only
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def image_groups(token_types: torch.Tensor, modality: int = 1) -> int:
    """Number of images (runs of ``modality`` tokens) in one example's token types, as ``get_rope_index`` counts."""
    is_mod = token_types.reshape(-1) == modality
    if not bool(is_mod.any()):
        return 0
    starts = is_mod.clone()
    starts[1:] &= ~is_mod[:-1]
    return int(starts.sum())
