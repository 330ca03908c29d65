"""A token budget per packed training forward: one TRL micro-batch split into several forwards whose losses add up
to TRL's.

TRL's ``_compute_loss`` normalises the loss of a micro-batch of ``B`` sequences per ``loss_type``. Run on a piece of
``n`` of its sequences, it normalises by the piece instead; :func:`piece_weight` is the factor that turns the piece's
loss into its share of the micro-batch's, so that the pieces' losses (and their gradients) sum to TRL's:

- per sequence (``grpo``, ``sapo``, ``dr_grpo``, ``luspo``, and RLOO's loss): a mean over the sequences (``dr_grpo``:
  a sum over ``n x max_completion_length``), so ``n / B``;
- per token of the micro-batch (``bnpo``): a sum over the piece's tokens divided by their count, so
  ``piece tokens / micro-batch tokens``;
- per token of the generation batch (``dapo``, ``cispo``, ``vespo``): divided by ``num_items_in_batch``, which is the
  same for every piece, so ``1``.

What a piece cannot reproduce is refused (:func:`budget_refusal`): the entropy bonus (a token mean over the whole
micro-batch beside a policy term normalised otherwise, and an adaptive controller fed once per micro-batch),
``top_entropy_quantile < 1`` (a quantile over the whole micro-batch's tokens), DeepSpeed (which counts every backward
as an accumulation step) and any loss type not listed here.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LOSS_NORMALISATION", "budget_refusal", "piece_inputs", "piece_weight"]

# loss_type -> how TRL 1.16 normalises the loss of a micro-batch ("rloo": RLOOTrainer's single loss)
LOSS_NORMALISATION = {"grpo": "sequences", "sapo": "sequences", "dr_grpo": "sequences", "luspo": "sequences",
                      "rloo": "sequences", "bnpo": "tokens", "dapo": "generation batch", "cispo": "generation batch",
                      "vespo": "generation batch"}


def loss_type_of(trainer: Any) -> str:
    """The trainer's ``loss_type`` (``"rloo"`` for RLOOTrainer, which has one loss)."""
    return getattr(trainer, "loss_type", None) or "rloo"


def budget_refusal(trainer: Any) -> str | None:
    """Why a budget that splits a micro-batch would change this trainer's loss, or ``None`` (see the module
    docstring)."""
    loss_type = loss_type_of(trainer)
    if loss_type not in LOSS_NORMALISATION:
        return f"loss_type={loss_type!r} has a normalisation pf-trl does not know how to split"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return ("the entropy bonus (entropy_coef / use_adaptive_entropy) is a token mean over the whole micro-batch "
                f"beside a {loss_type} policy term normalised otherwise")
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        return "top_entropy_quantile < 1 keeps the highest-entropy tokens of the whole micro-batch"
    if str(getattr(trainer.accelerator.distributed_type, "value", "")).upper() == "DEEPSPEED":
        return "DeepSpeed counts every backward of a split micro-batch as a gradient accumulation step"
    return None


def _mask(inputs: dict[str, Any]) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def piece_weight(loss_type: str, inputs: dict[str, Any], piece: dict[str, Any]) -> float:
    """The factor of ``piece``'s TRL loss in the loss of its micro-batch ``inputs`` (see the module docstring)."""
    kind = LOSS_NORMALISATION[loss_type]
    if kind == "sequences":
        return piece["completion_mask"].size(0) / inputs["completion_mask"].size(0)
    if kind == "tokens":
        return float(_mask(piece).sum().clamp(min=1.0)) / float(_mask(inputs).sum().clamp(min=1.0))
    return 1.0


def piece_inputs(inputs: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """TRL's micro-batch ``inputs`` narrowed to ``rows``: every per-sequence tensor (and list) indexed, the rest (such
    as ``num_items_in_batch``) kept."""
    total = inputs["completion_mask"].size(0)
    index = torch.tensor(rows, dtype=torch.long, device=inputs["completion_mask"].device)
    piece = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.size(0) == total:
            piece[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list) and len(value) == total:
            piece[key] = [value[i] for i in rows]
        else:
            piece[key] = value
    return piece
