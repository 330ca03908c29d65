"""PaddingFreeDPOConfig: TRL's DPOConfig plus the padding-free options of preference training."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import DPOConfig

from pf_trl.errors import ConfigError
from pf_trl.trainer.preference.config_fields import (
    PREFERENCE_MODES,
    PaddingFreePreferenceFields,
    check_preference_fields,
)

__all__ = ["DPO_MODES", "LM_HEAD_KERNELS", "PaddingFreeDPOConfig", "budget_refused_losses"]

DPO_MODES = PREFERENCE_MODES
# 'auto': pf-trl's CPU head where it applies (pf_trl.trainer.dpo_head), else TRL's; 'trl': TRL's fused head always
LM_HEAD_KERNELS = ("auto", "trl")
# loss types that are not a mean of per-pair terms: under a token budget their value depends on which pairs share a
# micro-batch (aot / aot_unpaired sort the micro-batch's pairs, sft is a token mean over the micro-batch)
_BATCH_COUPLED_LOSSES = ("aot", "aot_unpaired", "sft")


@dataclass
class PaddingFreeDPOConfig(PaddingFreePreferenceFields, DPOConfig):
    """:class:`trl.DPOConfig` plus the padding-free options of
    :class:`~pf_trl.trainer.preference.config_fields.PaddingFreePreferenceFields` and ``lm_head_kernel``. Every
    ``DPOConfig`` field keeps TRL's meaning; a plain ``DPOConfig`` given to
    :class:`~pf_trl.trainer.dpo_trainer.PaddingFreeDPOTrainer` trains with these defaults (fixed
    ``per_device_train_batch_size`` pairs per micro-batch, transformers' native packed attention)."""

    lm_head_kernel: str = field(
        default="auto",
        metadata={"help": "Which head scores the completion tokens: 'auto' (pf-trl's CPU head where it applies, "
                  "checked against TRL's head at start-up; TRL's fused head elsewhere) or 'trl' (TRL's fused head "
                  "always).", "choices": list(LM_HEAD_KERNELS)},
    )

    def __post_init__(self):
        super().__post_init__()
        check_pf_fields(self)


def check_pf_fields(args) -> None:
    """Refuse bad pf-trl fields of ``args`` (a PaddingFreeDPOConfig, or a DPOConfig: defaults), in one line each."""
    check_preference_fields(args, "DPOTrainer")
    kernel = getattr(args, "lm_head_kernel", "auto")
    if kernel not in LM_HEAD_KERNELS:
        raise ConfigError(f"lm_head_kernel must be one of {', '.join(LM_HEAD_KERNELS)}, got {kernel!r}")
    budget = getattr(args, "max_tokens_per_batch", None)
    refused = budget_refused_losses(args.loss_type) if budget is not None else []
    if refused:
        raise ConfigError(f"loss_type {', '.join(refused)} is not a mean of per-pair terms, so a token budget "
                          "would change it; use fixed pairs per micro-batch (unset max_tokens_per_batch)")


def budget_refused_losses(loss_types) -> list[str]:
    """The loss types of ``loss_types`` that token-budget batches cannot keep exact."""
    types = [loss_types] if isinstance(loss_types, str) else list(loss_types or [])
    return [t for t in types if t in _BATCH_COUPLED_LOSSES]
