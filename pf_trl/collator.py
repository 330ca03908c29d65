"""PaddingFreeCollator: concatenate a batch of examples into one row, no padding.

Output contract (what the attention layer and the trainer read):

- ``input_ids``, ``labels``, ``position_ids``: ``LongTensor[1, total]``;
- ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``IntTensor[n + 1]``, cumulative example lengths (flash-attn's
  ``cu_seqlens``), identical because this is self-attention;
- ``max_length_q`` / ``max_length_k``: ``int``, the longest example;
- no ``attention_mask``: its absence is what tells transformers the row is packed.

The first label of every example is -100: with the causal shift, the token before it belongs to the
previous example, so no example learns to predict its own start from its neighbour.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

IGNORE_INDEX = -100

# Keys a packed batch carries besides the token tensors. The trainer keeps them through column removal.
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
PACKED_KEYS = ("input_ids", "labels", "position_ids", *FLASH_KWARGS)


class PaddingFreeCollator:
    """Collate features with ``input_ids`` (and optional ``labels``) into one padding-free row.

    Args:
        pad_to_multiple_of: if set, append one dummy segment (token ``pad_token_id``, labels all -100,
            positions from 0) so the row length is a multiple of this; it gives static shapes for
            ``torch.compile`` / CUDA graphs and changes neither the loss nor the other examples.
        pad_token_id: token id used for that dummy segment.
        return_flash_kwargs: emit ``cu_seq_lens_*`` / ``max_length_*`` (on by default).
        ignore_first_label: set the first label of every example to -100 (see module docstring).
    """

    def __init__(
        self,
        pad_to_multiple_of: int | None = None,
        *,
        pad_token_id: int = 0,
        return_flash_kwargs: bool = True,
        ignore_first_label: bool = True,
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of}")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id
        self.return_flash_kwargs = return_flash_kwargs
        self.ignore_first_label = ignore_first_label

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(features) == 0:
            raise ValueError("PaddingFreeCollator got an empty batch: the sampler yielded no indices")
        ids_parts: list[torch.Tensor] = []
        label_parts: list[torch.Tensor] = []
        lengths: list[int] = []
        for i, feature in enumerate(features):
            if "input_ids" not in feature:
                raise KeyError(f"feature {i} has no 'input_ids' (keys: {sorted(feature)})")
            ids = torch.as_tensor(feature["input_ids"], dtype=torch.long).reshape(-1)
            if ids.numel() == 0:
                raise ValueError(f"feature {i} has empty input_ids; drop empty examples before collation")
            labels = feature.get("labels")
            lab = ids.clone() if labels is None else torch.as_tensor(labels, dtype=torch.long).reshape(-1).clone()
            if lab.numel() != ids.numel():
                raise ValueError(f"feature {i}: labels has {lab.numel()} tokens but input_ids has {ids.numel()}")
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

        lengths_t = torch.tensor(lengths, dtype=torch.int32)
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lengths_t, dim=0, out=cu_seqlens[1:])
        position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])

        batch: dict[str, Any] = {
            "input_ids": torch.cat(ids_parts).unsqueeze(0),
            "labels": torch.cat(label_parts).unsqueeze(0),
            "position_ids": position_ids.unsqueeze(0),
        }
        if self.return_flash_kwargs:
            max_len = int(max(lengths))
            batch.update(
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens.clone(),
                max_length_q=max_len,
                max_length_k=max_len,
            )
        return batch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Derive flash-attn ``cu_seqlens`` (int32) and the max segment length from packed ``position_ids``.

    A new segment starts wherever the position is 0. ``position_ids`` is ``[1, T]`` or ``[T]``.
    """
    flat = position_ids.reshape(-1)
    if flat.numel() == 0:
        raise ValueError("position_ids is empty")
    starts = torch.nonzero(flat == 0, as_tuple=False).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed position_ids must start at 0 (each segment restarts at 0)")
    total = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
    cu = torch.cat([starts, total]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    return cu, max_len
