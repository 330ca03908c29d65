"""TRL's padded preference batch plus its packed row: the collator of the padding-free preference trainers (DPO,
reward)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pf_trl.errors import PackingError
from pf_trl.trainer.packed import pack_padded

__all__ = ["PACKED_ROW_KEY", "PackedPreferenceCollator", "PackedRowCollator"]

# the batch key of the :class:`~pf_trl.trainer.packed.PackedRow` (the model's forward pops it)
PACKED_ROW_KEY = "pf_packed_row"


class PackedRowCollator:
    """Collate with ``inner`` (TRL's own collator: its padding, truncation and extra columns, e.g. ``margin``), then
    add the packed row of its ``input_ids`` / ``attention_mask`` under :data:`PACKED_ROW_KEY`. TRL's padded tensors
    stay in the batch as the layout its loss and metric code reads; the model runs the row."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.inner = inner

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(examples) == 0:
            raise PackingError("PackedRowCollator got an empty batch: the sampler yielded no examples")
        batch = self.inner(list(examples))
        batch[PACKED_ROW_KEY] = pack_padded(batch["attention_mask"], batch["input_ids"])
        return batch


# the public name of the preference trainers' collator (pf_trl.PackedPreferenceCollator)
PackedPreferenceCollator = PackedRowCollator
