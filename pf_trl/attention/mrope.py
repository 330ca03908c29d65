"""Multimodal rotary positions (mRoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) for packed rows, per example.

These models rotate each token by three position streams (temporal, height, width). Their own
``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, ...)`` numbers text tokens 0, 1, 2... and lays each
image out on its grid, continuing after it. In a padded batch it runs once per row, i.e. once per example. In a
packed row it would run once over all examples, so every example after the first would continue the previous one's
numbering. pf-trl calls the same function once per example (with that example's images) and concatenates, then
prepends the plain per-example text positions (0..n-1 per example) as a fourth row: transformers' mRoPE text models
read a ``[4, batch, seq]`` tensor as ``text positions`` (packed-sequence detection, attention masks) + the three
rotary streams.

:class:`RopeIndex` holds only the config and the model class (not the weights), so a collator that carries it pickles
cheaply into DataLoader workers.
"""

from __future__ import annotations

import torch

from pf_trl.batching import packing
from pf_trl.batching.packing import packed_position_ids  # the [4, 1, T] layout, with the other forms of a packed row
from pf_trl.data.image_tokens import image_groups
from pf_trl.errors import PackingError


class RopeIndex:
    """The model's own ``get_rope_index``, callable on one example without the model's weights.

    ``get_rope_index`` reads only ``self.config`` and calls other methods of the model class, so it is bound to a
    light host object that has the config and the class's functions.
    """

    def __init__(self, model_class: type, config) -> None:
        self.model_class = model_class
        self.config = config

    def __getattr__(self, name: str):
        # the class's other methods (get_vision_position_ids...) bound to this host; never the weights
        if name in ("model_class", "config") or name.startswith("__"):
            raise AttributeError(name)  # not set yet (unpickling) or a protocol probe: no recursion
        attr = getattr(self.model_class, name, None)
        if callable(attr):
            return attr.__get__(self)
        raise AttributeError(name)

    def __getstate__(self):
        return {"model_class": self.model_class, "config": self.config}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    def __call__(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, *, image_grid_thw=None,
                 video_grid_thw=None) -> torch.Tensor:
        """``LongTensor[3, n]``: the rotary positions of one example of ``n`` tokens (1-D ``input_ids``)."""
        ids = input_ids.reshape(1, -1)
        types = mm_token_type_ids.reshape(1, -1)
        if image_grid_thw is None and video_grid_thw is None:
            # the model's text-only convention (compute_3d_position_ids without images): 0..n-1 on all three streams
            return torch.arange(ids.shape[1], device=ids.device).expand(3, -1).clone()
        positions, _ = self.model_class.get_rope_index(self, ids, types, image_grid_thw=image_grid_thw,
                                                       video_grid_thw=video_grid_thw)
        return positions[:, 0]


def _inner_with_rope_index(model: torch.nn.Module):
    """The sub-module that defines ``get_rope_index`` (``model.model`` of a ``...ForConditionalGeneration``)."""
    for module in (model, getattr(model, "model", None)):
        if isinstance(module, torch.nn.Module) and callable(getattr(type(module), "get_rope_index", None)):
            return module
    return None


def rope_index_function(model: torch.nn.Module) -> RopeIndex | None:
    """The per-example mRoPE function of ``model``, or None when the model does not use multimodal positions."""
    inner = _inner_with_rope_index(model)
    if inner is None:
        return None
    return RopeIndex(type(inner), inner.config)




def positions_for_packed_row(rope_index: RopeIndex, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
                             cu_seqlens: torch.Tensor, *, image_grid_thw=None, video_grid_thw=None) -> torch.Tensor:
    """``[4, 1, T]`` positions of an already packed row: each segment of ``cu_seqlens`` gets its own rotary positions,
    with the grid rows of its own images (images are stored in row order, one grid row per image)."""
    ids = input_ids.reshape(-1)
    types = mm_token_type_ids.reshape(-1)
    spans = packing.segment_spans(cu_seqlens)
    grids = {1: image_grid_thw, 2: video_grid_thw}
    taken = {1: 0, 2: 0}
    rotary = []
    for a, b in spans:
        mine = {}
        for modality, grid in grids.items():
            n = image_groups(types[a:b], modality)
            if n and grid is None:
                raise PackingError(f"a packed example holds {'image' if modality == 1 else 'video'} tokens but the "
                                 "batch has no grid for them")
            mine[modality] = None if not n else grid[taken[modality]: taken[modality] + n]
            taken[modality] += n
        rotary.append(rope_index(ids[a:b], types[a:b], image_grid_thw=mine[1], video_grid_thw=mine[2]))
    for modality, grid in grids.items():
        if grid is not None and taken[modality] != grid.shape[0]:
            raise PackingError(f"the packed row has {taken[modality]} {'images' if modality == 1 else 'videos'} in its "
                             f"tokens but {grid.shape[0]} grid rows")
    text = packing.position_ids_from_lengths([b - a for a, b in spans], device=ids.device)
    return packed_position_ids(text, rotary)
