"""PaddingFreeDPOConfig: TRL's DPOConfig plus the padding-free options of preference training."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig

from pf_trl.errors import ConfigError
from pf_trl.trainer.preference.config_fields import (
    LM_HEAD_KERNELS,
    PREFERENCE_MODES,
    FusedHeadFields,
    PaddingFreePreferenceFields,
    check_head_kernel,
    check_preference_fields,
)

__all__ = ["DPO_MODES", "LM_HEAD_KERNELS", "PaddingFreeDPOConfig", "budget_refused_losses"]

DPO_MODES = PREFERENCE_MODES
# loss types that are not a mean of per-pair terms: under a token budget their value depends on which pairs share a
# micro-batch (aot / aot_unpaired sort the micro-batch's pairs, sft is a token mean over the micro-batch)
_BATCH_COUPLED_LOSSES = ("aot", "aot_unpaired", "sft")


@dataclass
class PaddingFreeDPOConfig(FusedHeadFields, PaddingFreePreferenceFields, DPOConfig):
    """:class:`trl.DPOConfig` plus the padding-free options of
    :class:`~pf_trl.trainer.preference.config_fields.PaddingFreePreferenceFields` and ``lm_head_kernel``. Every
    ``DPOConfig`` field keeps TRL's meaning; a plain ``DPOConfig`` given to
    :class:`~pf_trl.trainer.dpo_trainer.PaddingFreeDPOTrainer` trains with these defaults (fixed
    ``per_device_train_batch_size`` pairs per micro-batch, transformers' native packed attention)."""

    def __post_init__(self):
        super().__post_init__()
        check_pf_fields(self)


def check_pf_fields(args) -> None:
    """Refuse bad pf-trl fields of ``args`` (a PaddingFreeDPOConfig, or a DPOConfig: defaults), in one line each."""
    check_preference_fields(args, "DPOTrainer")
    check_head_kernel(args)
    budget = getattr(args, "max_tokens_per_batch", None)
    refused = budget_refused_losses(args.loss_type) if budget is not None else []
    if refused:
        raise ConfigError(f"loss_type {', '.join(refused)} is not a mean of per-pair terms, so a token budget "
                          "would change it; use fixed pairs per micro-batch (unset max_tokens_per_batch)")


def budget_refused_losses(loss_types) -> list[str]:
    """The loss types of ``loss_types`` that token-budget batches cannot keep exact."""
    types = [loss_types] if isinstance(loss_types, str) else list(loss_types or [])
    return [t for t in types if t in _BATCH_COUPLED_LOSSES]
