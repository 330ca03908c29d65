"""The packed forward of preference training: TRL's fused LM head run on one packed row.

TRL's DPOTrainer scores its padded ``[2n, L]`` batch with ``model(..., labels=labels, fused_lm_head=True)``
(``trl.trainer.utils.add_fused_lm_head``: per-token log-probabilities computed in vocabulary tiles, never the full
logits). :func:`install_packed_preference_forward` wraps that forward: when the batch carries its packed row
(:data:`~pf_trl.batching.preference.PACKED_KEY`, from :class:`~pf_trl.batching.preference.PackedPreferenceCollator`),
the backbone and the fused head run on the ``[1, T]`` row instead (no pad token, ``position_ids`` restarting per
sequence, varlen attention through :func:`pf_trl.attention.enable_padding_free`), and every per-token output
(``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, ``log_sum_sq_probs``, ``label_mask``) is placed back at
its position in TRL's ``[2n, L - 1]`` layout, zero elsewhere, as TRL's head leaves padded positions. TRL's own loss
and metric code then reads exactly the tensors it reads in a padded run: the loss types, ``ld_alpha``, WPO weighting,
``sft`` and every metric are TRL's code, unchanged.

Only the index work (a gather of labels, a scatter of per-token scalars) is added; the vocabulary-sized work runs on
real tokens only. The first label of every packed sequence is ignored: with the causal shift it would be predicted
from the previous sequence's last token (TRL's padded rows never score a row's first token either).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from pf_trl.batching.packing import IGNORE_INDEX
from pf_trl.batching.preference import PACKED_KEY

__all__ = ["install_packed_preference_forward", "unpack_outputs"]

_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
_ATTR = "_pf_packed_preference_forward"


def unpack_outputs(outputs: Any, layout: dict[str, Any], rows: int, width: int) -> Any:
    """``outputs`` (a ``FusedCausalLMOutput`` of the packed row, per-token fields ``[1, T - 1]``) with every
    per-token field moved to TRL's ``[rows, width - 1]`` layout (zeros where no prediction lies)."""
    src, dst = layout["shift_src"], layout["shift_dst"]
    updates = {}
    for name in _PER_TOKEN:
        value = getattr(outputs, name, None)
        if value is None:
            continue
        flat = value.reshape(-1)
        target = flat.new_zeros(rows * (width - 1))
        updates[name] = target.index_copy(0, dst, flat.index_select(0, src)).view(rows, width - 1)
    for name, value in updates.items():
        outputs[name] = value  # ModelOutput: sets the key and the attribute
    return outputs


def _packed_call(inner, kwargs: dict[str, Any], layout: dict[str, Any]):
    input_ids = kwargs.pop("input_ids")
    kwargs.pop("attention_mask", None)
    labels = kwargs.pop("labels")
    rows, width = input_ids.shape
    index = layout["token_index"]
    packed_labels = labels.reshape(-1).index_select(0, index)
    starts = layout["cu_seq_lens_q"][:-1].to(device=packed_labels.device, dtype=torch.long)
    packed_labels = packed_labels.index_fill(0, starts, IGNORE_INDEX).unsqueeze(0)
    packed_ids = layout.get("input_ids")
    if packed_ids is None:
        packed_ids = input_ids.reshape(-1).index_select(0, index).unsqueeze(0)
    outputs = inner(
        input_ids=packed_ids.to(input_ids.device),
        position_ids=layout["position_ids"].to(input_ids.device),
        labels=packed_labels,
        cu_seq_lens_q=layout["cu_seq_lens_q"],
        cu_seq_lens_k=layout["cu_seq_lens_k"],
        max_length_q=layout["max_length_q"],
        max_length_k=layout["max_length_k"],
        **kwargs,
    )
    return unpack_outputs(outputs, layout, rows, width)


def install_packed_preference_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model.forward`` (a transformers model TRL gave a fused LM head) so that a call with
    ``fused_lm_head=True`` and the packed row runs the row; any other call drops the row and runs the forward as it
    was (padded; e.g. the logits TRL recomputes for ``compute_metrics``). Idempotent; returns ``model``."""
    if getattr(model, _ATTR, False):
        return model
    inner = model.forward

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        layout = kwargs.pop(PACKED_KEY, None)
        if layout is None or args or not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
            return inner(*args, **kwargs)
        return _packed_call(inner, kwargs, layout)

    model.forward = types.MethodType(forward, model)
    setattr(model, _ATTR, True)
    return model
