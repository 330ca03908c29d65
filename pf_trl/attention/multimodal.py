"""Vision-language models on packed rows: which families, and what each packed forward needs besides the attention.

pf-trl makes four vision-language families padding-free, images included (:data:`VISION_TYPES`):

- ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``: 3-D multimodal rotary positions. Each packed example gets its own
  positions from the model's ``get_rope_index`` (:mod:`pf_trl.attention.mrope`); the row carries them as
  ``position_ids[4, 1, T]`` (per-example text positions on top), which transformers' text model reads for both the
  rotary embedding and the packed-sequence attention. The vision tower keeps its own per-image attention: the
  images of the row are the images of the padded batch, in the same order, with the same ``image_grid_thw``.
- ``gemma3`` (``Gemma3ForConditionalGeneration``): image tokens attend to each other in both directions inside one
  image. transformers (5.24) builds that overlay for a packed row from positions that restart per example but reads
  the image blocks at those restarted positions in its sliding-window mask, i.e. at another example's tokens. pf-trl
  builds the two masks itself with transformers' own mask functions, composed as Gemma 3's padded forward composes
  them (``sliding AND (causal OR same image)``) and cut to one example (``AND same example``).
  pf-trl's ``pf_varlen`` kernels (``padding_free='internal'``) are causal per example and have no such overlay: a
  Gemma 3 batch with images is refused there (text-only batches run).

Text-only data on these models (no images) needs nothing of this beyond the mRoPE text positions: it is the
text-only sweep's business (``support.json``).
"""

from __future__ import annotations

from typing import Any

import torch

import pf_trl.attention.mrope as mrope
from pf_trl.attention.errors import UnsupportedFeatureError
from pf_trl.batching.packing import cu_seqlens_from_starts

VISION_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def is_multimodal(config) -> bool:
    """True when the config has a vision or audio tower."""
    return getattr(config, "vision_config", None) is not None or getattr(config, "audio_config", None) is not None


def structural_refusal(model: torch.nn.Module, uses_mrope: bool) -> str | None:
    """Why ``model`` cannot be made padding-free whatever the sweep says (None: it can be checked further)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if uses_mrope and mrope.rope_index_function(model) is None:
        return (f"{model_type} uses multimodal rotary position ids (mrope: 3 position streams per token) and has no "
                "get_rope_index pf-trl could call per packed example, so its positions would not restart per "
                "example. Train it padded.")
    if is_multimodal(config) and model_type not in VISION_TYPES:
        return (f"{model_type} is multimodal; pf-trl makes these vision-language families padding-free: "
                f"{', '.join(VISION_TYPES)}. Load the text model alone (AutoModelForCausalLM on its text config) or "
                "train it padded.")
    return None


def _packed_text_positions(kwargs: dict[str, Any], length: int, device) -> torch.Tensor | None:
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:
        return position_ids
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        bounds = cu.tolist()
        return torch.cat([torch.arange(b - a, device=device) for a, b in zip(bounds, bounds[1:])])[None]
    return None


def needs_preparing(model: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """True when a forward of ``model`` with ``kwargs`` may need :func:`prepare_packed` (reads no tensor value)."""
    return (getattr(model, "_pf_rope_index", None) is not None or kwargs.get("token_type_ids") is not None
            or any(kwargs.get(k) is not None for k in VIDEO_KEYS))


def prepare_packed(model: torch.nn.Module, kwargs: dict[str, Any], mode: str) -> None:
    """Complete the inputs of a packed vision-language forward in place (called by pf-trl's forward pre-hook).

    - video inputs: refused (not verified padding-free);
    - mRoPE models: ``position_ids`` become ``[4, 1, T]`` per-example positions when they are not already (a
      ``PaddingFreeCollator`` with the model's ``RopeIndex`` computes them on the CPU; this is the fallback for
      direct calls); three rotary rows without the text row are refused (transformers could not tell the examples
      apart);
    - Gemma 3 with image tokens: per-example attention masks with the in-image bidirectional overlay
      (``huggingface`` mode), refused in ``internal`` mode.
    """
    present = [k for k in VIDEO_KEYS if kwargs.get(k) is not None]
    if present:
        raise UnsupportedFeatureError(
            f"video inputs ({', '.join(present)}) are not verified padding-free by pf-trl; train video data padded "
            "(padding_free='none')")
    rope_index = getattr(model, "_pf_rope_index", None)
    input_ids = kwargs.get("input_ids")
    if rope_index is not None and isinstance(input_ids, torch.Tensor):
        _complete_mrope(rope_index, kwargs, input_ids)
    token_types = kwargs.get("token_type_ids")
    if getattr(model.config, "model_type", None) == "gemma3" and isinstance(token_types, torch.Tensor) and bool(
        (token_types == 1).any()
    ):
        if mode == "internal":
            raise UnsupportedFeatureError(
                "Gemma 3 attends in both directions inside an image; pf-trl's pf_varlen kernels "
                "(padding_free='internal') are causal per example. padding_free='huggingface' is exact on it.")
        if not isinstance(kwargs.get("attention_mask"), dict):
            kwargs["attention_mask"] = gemma3_packed_masks(model, token_types, kwargs)


def _complete_mrope(rope_index: mrope.RopeIndex, kwargs: dict[str, Any], input_ids: torch.Tensor) -> None:
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        if position_ids.shape[0] == 4:
            return
        raise UnsupportedFeatureError(
            f"a packed row with {position_ids.shape[0]} rotary position rows and no text-position row: transformers "
            "cannot tell its examples apart. Pass position_ids [4, 1, T] (per-example text positions first), as "
            "PaddingFreeCollator(rope_index=...) makes them, or only the per-example text positions [1, T].")
    text = _packed_text_positions(kwargs, input_ids.shape[-1], input_ids.device)
    if text is None:
        return
    types = kwargs.get("mm_token_type_ids")
    if types is None:
        types = torch.zeros_like(input_ids)
    cu = kwargs.get("cu_seq_lens_q")
    cu = cu if isinstance(cu, torch.Tensor) else cu_seqlens_from_starts(text.reshape(-1) == 0)
    kwargs["position_ids"] = mrope.positions_for_packed_row(
        rope_index, input_ids, types, cu, image_grid_thw=kwargs.get("image_grid_thw"),
        video_grid_thw=kwargs.get("video_grid_thw")).to(input_ids.device)


def gemma3_packed_masks(model: torch.nn.Module, token_type_ids: torch.Tensor, kwargs: dict[str, Any]) -> dict:
    """Gemma 3's ``{"full_attention", "sliding_attention"}`` masks for one packed row, image blocks included.

    Composed as Gemma 3's padded forward composes them, then cut to one example: full ``(causal OR same image) AND
    same example``; sliding ``(causal OR same image) AND window AND same example``. Built by transformers'
    ``create_causal_mask`` for the model's attention implementation (absolute indices: no position remapping).
    """
    from transformers.masking_utils import and_masks, blockwise_overlay, create_causal_mask, sliding_window_overlay
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    text_config = model.config.get_text_config()
    device = token_type_ids.device
    length = token_type_ids.shape[-1]
    text = _packed_text_positions(kwargs, length, device)
    if text is None:
        raise UnsupportedFeatureError("a packed Gemma 3 row needs per-example position_ids or cu_seq_lens")
    example = (text.reshape(1, -1) == 0).cumsum(-1)  # example index of every token

    def same_example(batch_idx, head_idx, q_idx, kv_idx):
        return example[batch_idx, q_idx] == example[batch_idx, kv_idx]

    blocks = get_block_sequence_ids_for_mask(token_type_ids.reshape(1, -1), device=device)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    shape_only = torch.empty((1, length, 1), dtype=dtype, device=device)  # create_causal_mask reads shape/dtype/device
    common = dict(config=text_config, inputs_embeds=shape_only, attention_mask=None, cache=None, position_ids=None,
                  or_mask_function=blockwise_overlay(blocks))
    masks = {"full_attention": create_causal_mask(**common, and_mask_function=same_example)}
    window = getattr(text_config, "sliding_window", None)
    if window is not None:
        masks["sliding_attention"] = create_causal_mask(
            **common, and_mask_function=and_masks(sliding_window_overlay(window), same_example))
    return masks


def check_training_data(model: torch.nn.Module, mode: str, *datasets_) -> None:
    """Refuse, before training, vision-language data a padding-free ``mode`` cannot train exactly on ``model``."""
    from pf_trl.data.vision import image_column

    with_images = [d for d in datasets_ if d is not None and image_column(getattr(d, "column_names", None) or [])]
    if not with_images:
        return
    model_type = getattr(model.config, "model_type", None)
    if model_type not in VISION_TYPES:
        raise UnsupportedFeatureError(
            f"the data has images, but {model_type} ({type(model).__name__}) is not a vision-language family pf-trl "
            f"makes padding-free ({', '.join(VISION_TYPES)})")
    if model_type == "gemma3" and mode == "internal":
        raise UnsupportedFeatureError(
            "Gemma 3 attends in both directions inside an image; pf-trl's pf_varlen kernels "
            "(padding_free='internal') are causal per example. padding_free='huggingface' is exact on it.")
