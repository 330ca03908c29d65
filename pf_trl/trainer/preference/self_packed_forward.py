"""A fused-head forward that packs the padded batch it is called with: for TRL trainers whose loss code calls the model
several times per batch on differently padded tensors, none of which can carry a packed row in the batch.

TRL's KTOTrainer calls ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)`` on the completions, on the
mismatched KL completions (another ``[B, L']`` batch), on the policy and on the reference model, and once more per
batch in its reference precompute (``compute_ref_log_probs``). :func:`install_self_packed_forward` wraps the forward
that :func:`pf_trl.trainer.dpo_forward.install_packed_preference_forward` already gives a model (the backbone on one
packed row, the head on the scored tokens only, every per-token field placed back in TRL's ``[B, L - 1]`` layout): a
fused-head call with ``labels`` and an ``attention_mask`` but no packed row gets the row of its own
``attention_mask`` (:func:`pf_trl.trainer.packed.pack_padded`), so every such call runs packed and TRL's loss and
metric code reads what it reads in a padded run. Any other call (no fused head, e.g. the logits TRL recomputes for
``compute_metrics``) runs the forward as it was.
"""

from __future__ import annotations

import functools
import types

import torch

from pf_trl.trainer.dpo_forward import install_packed_preference_forward
from pf_trl.trainer.packed import pack_padded
from pf_trl.trainer.preference.collate import PACKED_ROW_KEY

__all__ = ["install_self_packed_forward"]

_ATTR = "_pf_self_packed_forward"


def install_self_packed_forward(model: torch.nn.Module, fields: tuple[str, ...] = ("log_probs",),
                                head: str = "auto") -> torch.nn.Module:
    """Give ``model`` (a transformers model TRL gave a fused LM head) the packed preference forward (``fields``,
    ``head``: as :func:`~pf_trl.trainer.dpo_forward.install_packed_preference_forward`), and make every fused-head
    call with ``labels`` and an ``attention_mask`` pack its own batch (see the module docstring). Idempotent (the
    latest ``fields`` and ``head`` count); returns ``model``."""
    install_packed_preference_forward(model, fields, head)
    if getattr(model, _ATTR, False):
        return model
    inner = model.forward

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        mask = kwargs.get("attention_mask")
        if (not args and PACKED_ROW_KEY not in kwargs and kwargs.get("fused_lm_head")
                and kwargs.get("labels") is not None and mask is not None and kwargs.get("input_ids") is not None):
            kwargs[PACKED_ROW_KEY] = pack_padded(mask, kwargs["input_ids"])
        return inner(*args, **kwargs)

    model.forward = types.MethodType(forward, model)
    setattr(model, _ATTR, True)
    return model
