"""PaddingFreeCollator: concatenate a batch of examples into one row, no padding.

Output contract (what the attention layer and the trainer read):

- ``input_ids``, ``labels``, ``position_ids``: ``LongTensor[1, total]``;
- ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``IntTensor[n + 1]``, cumulative example lengths (flash-attn's
  ``cu_seqlens``), identical because this is self-attention;
- ``max_length_q`` / ``max_length_k``: ``int``, the longest example;
- no ``attention_mask``: its absence is what tells transformers the row is packed.

The layout is validated here, once per batch on the CPU (:func:`check_packed_batch`), so that the attention layers
never read ``cu_seqlens`` back from the device: no host sync in the forward, nothing for ``torch.compile`` to break
on. ``max_length_*`` are Python ints for the same reason.

The first label of every example is -100: with the causal shift, the token before it belongs to the
previous example, so no example learns to predict its own start from its neighbour.

Vision-language features (what :class:`pf_trl.data.vision.VisionFeatures` makes of a shard row) are packed too:
per-token keys (:data:`TOKEN_KEYS`: ``mm_token_type_ids``, ``token_type_ids``) are concatenated like ``input_ids``;
per-image keys (:data:`IMAGE_KEYS`: ``pixel_values``, ``image_grid_thw``) are concatenated along their first axis in
example order, exactly as a padded batch holds them. With ``rope_index`` (the model's multimodal rotary function,
:func:`pf_trl.attention.mrope.rope_index_function`) ``position_ids`` is ``[4, 1, total]``: per-example text positions
on top of each example's own three rotary streams.

Why not transformers' ``DataCollatorWithFlattening`` or TRL's ``DataCollatorForLanguageModeling(padding_free=True)``:
their text output is this collator's (``tests/test_packing.py`` compares them key by key), but building on either
would change what this one returns or refuses:

- padding: ``DataCollatorWithFlattening`` has no ``pad_to_multiple_of``; TRL's pads with position 0 on every pad
  token, which makes each pad token a segment of its own (``cu_seq_lens`` grows with the padding, and
  ``max_length`` / the compiled shapes with it) instead of one dummy segment with no loss;
- vision: neither packs per-token (``mm_token_type_ids``) or per-image (``pixel_values``, ``image_grid_thw``)
  features nor builds per-example mRoPE positions (TRL refuses padding-free training on vision datasets);
- checks: ``DataCollatorWithFlattening`` silently drops empty examples and takes labels of another length;
  neither validates the layout (:func:`check_packed_batch`), which lets the attention layers trust it without a
  host read;
- ``ignore_first_label=False`` has no equivalent (both always overwrite each example's first label), and TRL's
  always adds ``seq_idx`` (pf-trl's stateful layers derive it from ``cu_seq_lens`` when a kernel wants it).

The segment arithmetic itself (lengths -> ``cu_seq_lens`` / ``position_ids``, ``IGNORE_INDEX``) is
:mod:`pf_trl.batching.packing`'s, shared with the attention layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pf_trl.batching.packing import (
    IGNORE_INDEX,
    cu_seqlens_from_lengths,
    cu_seqlens_from_position_ids,
    lengths_from_cu_seqlens,
    packed_position_ids,
    position_ids_from_lengths,
)
from pf_trl.data.image_tokens import IMAGE_KEYS, TOKEN_TYPE_KEYS
from pf_trl.errors import PackingError

__all__ = [
    "FLASH_KWARGS",
    "IGNORE_INDEX",
    "IMAGE_KEYS",
    "PACKED_KEYS",
    "TOKEN_KEYS",
    "PaddingFreeCollator",
    "check_packed_batch",
    "cu_seqlens_from_position_ids",
    "mark_dynamic_lengths",
]

# Keys a packed batch carries besides the token tensors. The trainer keeps them through column removal.
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PACKED_KEYS = ("input_ids", "labels", "position_ids", *FLASH_KWARGS)
# vision-language features: one value per token / one row per image (video inputs are not packed)
TOKEN_KEYS = TOKEN_TYPE_KEYS  # per-token modality ids, concatenated like input_ids


class PaddingFreeCollator:
    """Collate features with ``input_ids`` (and optional ``labels``) into one padding-free row.

    Args:
        pad_to_multiple_of: if set, append one dummy segment (token ``pad_token_id``, labels all -100,
            positions from 0) so the row length is a multiple of this; it gives static shapes for
            ``torch.compile`` / CUDA graphs and changes neither the loss nor the other examples.
        pad_token_id: token id used for that dummy segment.
        return_flash_kwargs: emit ``cu_seq_lens_*`` / ``max_length_*`` (on by default).
        ignore_first_label: set the first label of every example to -100 (see module docstring).
        rope_index: the model's per-example multimodal rotary positions (mRoPE models), see the module docstring.
    """

    def __init__(
        self,
        pad_to_multiple_of: int | None = None,
        *,
        pad_token_id: int = 0,
        return_flash_kwargs: bool = True,
        ignore_first_label: bool = True,
        rope_index: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise PackingError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of}")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id
        self.return_flash_kwargs = return_flash_kwargs
        self.ignore_first_label = ignore_first_label
        self.rope_index = rope_index

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(features) == 0:
            raise PackingError("PaddingFreeCollator got an empty batch: the sampler yielded no indices")
        ids_parts: list[torch.Tensor] = []
        label_parts: list[torch.Tensor] = []
        lengths: list[int] = []
        for i, feature in enumerate(features):
            if "input_ids" not in feature:
                raise KeyError(f"feature {i} has no 'input_ids' (keys: {sorted(feature)})")
            ids = torch.as_tensor(feature["input_ids"], dtype=torch.long).reshape(-1)
            if ids.numel() == 0:
                raise PackingError(f"feature {i} has empty input_ids; drop empty examples before collation")
            labels = feature.get("labels")
            lab = ids.clone() if labels is None else torch.as_tensor(labels, dtype=torch.long).reshape(-1).clone()
            if lab.numel() != ids.numel():
                raise PackingError(f"feature {i}: labels has {lab.numel()} tokens but input_ids has {ids.numel()}")
            if self.ignore_first_label:
                lab[0] = IGNORE_INDEX
            ids_parts.append(ids)
            label_parts.append(lab)
            lengths.append(ids.numel())

        total = sum(lengths)
        if self.pad_to_multiple_of and total % self.pad_to_multiple_of:
            extra = self.pad_to_multiple_of - total % self.pad_to_multiple_of
            ids_parts.append(torch.full((extra,), self.pad_token_id, dtype=torch.long))
            label_parts.append(torch.full((extra,), IGNORE_INDEX, dtype=torch.long))
            lengths.append(extra)

        cu_seqlens = cu_seqlens_from_lengths(lengths)
        position_ids = position_ids_from_lengths(lengths)

        batch: dict[str, Any] = {
            "input_ids": torch.cat(ids_parts).unsqueeze(0),
            "labels": torch.cat(label_parts).unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
        }
        if any(key in f for f in features for key in (*TOKEN_KEYS, *IMAGE_KEYS)):
            batch.update(_pack_vision(features, ids_parts, lengths))
        if self.rope_index is not None:
            batch["position_ids"] = self._rope_positions(features, ids_parts, lengths, batch)
        if self.return_flash_kwargs:
            max_len = int(max(lengths))
            batch.update(
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens.clone(),
                max_length_q=max_len,
                max_length_k=max_len,
            )
            check_packed_batch(batch)
        return batch


    def _rope_positions(self, features, ids_parts, lengths, batch) -> torch.Tensor:
        """``[4, 1, total]``: per-example text positions, then each example's rotary streams from its own images."""
        types = batch.get("mm_token_type_ids")
        rotary, at = [], 0
        for i, n in enumerate(lengths):
            feature = features[i] if i < len(features) else {}
            grid = feature.get("image_grid_thw")
            grid = torch.as_tensor(grid).reshape(-1, 3) if grid is not None and len(grid) else None
            tokens = types[0, at:at + n] if types is not None else torch.zeros(n, dtype=torch.long)
            rotary.append(self.rope_index(ids_parts[i], tokens, image_grid_thw=grid))
            at += n
        return packed_position_ids(batch["position_ids"].reshape(-1), rotary)


def _pack_vision(features: Sequence[Mapping[str, Any]], ids_parts: list[torch.Tensor], lengths: list[int]):
    """Per-token keys concatenated over the row (0 on a padding segment); per-image keys concatenated in example
    order (examples without images add nothing)."""
    out: dict[str, torch.Tensor] = {}
    for key in TOKEN_KEYS:
        if not any(key in f for f in features):
            continue
        parts = []
        for i, n in enumerate(lengths):
            value = features[i].get(key) if i < len(features) else None
            part = (torch.zeros(n, dtype=torch.long) if value is None
                    else torch.as_tensor(value, dtype=torch.long).reshape(-1))
            if part.numel() != n:
                raise PackingError(f"feature {i}: {key} has {part.numel()} values but input_ids has {n} tokens")
            parts.append(part)
        out[key] = torch.cat(parts).unsqueeze(0)
    for key in IMAGE_KEYS:
        parts = [torch.as_tensor(f[key]) for f in features if f.get(key) is not None and len(f[key])]
        if parts:
            out[key] = torch.cat(parts, dim=0)
    return out


def check_packed_batch(batch: Mapping[str, Any]) -> None:
    """Raise :class:`~pf_trl.errors.PackingError` (a ``ValueError``) unless a packed batch's flash kwargs describe
    its row exactly (CPU, once per batch).

    Checks that ``cu_seq_lens_q/k`` are equal 1-D int32 tensors starting at 0, strictly increasing and ending at the
    token count; that ``max_length_q/k`` are Python ints equal to the longest segment; and that ``position_ids``
    restart at 0 at every segment start and count up inside it. The attention layers trust all of this.
    Use it on batches from another collator (e.g. ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``).
    """
    input_ids = batch["input_ids"]
    total = int(input_ids.numel())
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        raise PackingError("a packed batch needs cu_seq_lens_q and cu_seq_lens_k tensors")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise PackingError(f"a packed batch is one row [1, total]; input_ids has shape {tuple(input_ids.shape)}")
    if cu_q.dim() != 1 or cu_q.dtype != torch.int32 or cu_q.numel() < 2:
        raise PackingError(
            f"cu_seq_lens_q must be a 1-D int32 tensor of n + 1 >= 2 offsets, got {cu_q.dtype} {tuple(cu_q.shape)}"
        )
    if not torch.equal(cu_q.cpu(), cu_k.cpu()):
        raise PackingError("cu_seq_lens_q and cu_seq_lens_k differ; a packed self-attention batch has one layout")
    lengths = lengths_from_cu_seqlens(cu_q)
    if int(cu_q[0]) != 0 or int(cu_q[-1]) != total or min(lengths) <= 0:
        raise PackingError(
            f"cu_seq_lens_q must start at 0, increase strictly and end at the token count {total}; "
            f"got {cu_q.tolist()}"
        )
    for name in ("max_length_q", "max_length_k"):
        value = batch.get(name)
        if type(value) is not int or value != max(lengths):
            raise PackingError(f"{name} must be the Python int {max(lengths)} (the longest segment), got {value!r}")
    position_ids = batch.get("position_ids")
    if position_ids is not None and position_ids.dim() == 3:
        position_ids = position_ids[0]  # mRoPE: the per-example text positions are the first row
    if position_ids is not None:
        expected = position_ids_from_lengths(lengths)
        if position_ids.numel() != total or not torch.equal(position_ids.reshape(-1).cpu().long(), expected):
            raise PackingError("position_ids do not restart at 0 at every cu_seq_lens_q offset and count up inside it")


def mark_dynamic_lengths(batch: Mapping[str, Any]) -> None:
    """Tell ``torch.compile`` that a packed batch's token count and segment count vary from batch to batch.

    Marks dim 1 of the ``[1, total]`` tensors and dim 0 of ``cu_seq_lens_*`` as dynamic, so the first compiled
    graph is already the general one; ``max_length_*`` (Python ints) turn symbolic on their first change. Together:
    at most two compilations over an epoch of varying packed lengths. Call it on the tensors the compiled model
    receives (after any device move: a copy loses the mark). A no-op for eager execution.
    """
    from pf_trl._compat import maybe_mark_dynamic

    for name in ("input_ids", "labels", "position_ids", *TOKEN_KEYS):
        value = batch.get(name)
        if isinstance(value, torch.Tensor) and value.dim() in (2, 3):
            maybe_mark_dynamic(value, value.dim() - 1)
    for name in FLASH_KWARGS[:2]:
        value = batch.get(name)
        if isinstance(value, torch.Tensor):
            maybe_mark_dynamic(value, 0)
