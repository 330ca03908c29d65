"""PaddingFreeKTOConfig: TRL's KTOConfig plus the padding-free options of KTO training."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import KTOConfig

from pf_trl.errors import ConfigError
from pf_trl.trainer.preference.config_fields import (
    FusedHeadFields,
    PaddingFreePreferenceFields,
    check_head_kernel,
    check_preference_fields,
)

__all__ = ["PaddingFreeKTOConfig", "check_kto_fields"]

# the loss types whose batch-level KL estimate TRL computes (every one but apo_zero_unpaired)
_NO_KL_LOSSES = ("apo_zero_unpaired",)


@dataclass
class PaddingFreeKTOConfig(FusedHeadFields, PaddingFreePreferenceFields, KTOConfig):
    """:class:`trl.KTOConfig` plus the padding-free options of
    :class:`~pf_trl.trainer.preference.config_fields.PaddingFreePreferenceFields` and ``lm_head_kernel``
    (:class:`~pf_trl.trainer.preference.config_fields.FusedHeadFields`); every ``KTOConfig`` field keeps
    TRL's meaning. A plain ``KTOConfig`` given to :class:`~pf_trl.trainer.preference.kto_trainer.PaddingFreeKTOTrainer`
    trains with these defaults (TRL's batches, transformers' native packed attention)."""

    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": "Not available for KTO (kept so that the flag of pf-trl dpo / reward is refused with its "
                  "reason): KTO keeps TRL's batches of per_device_train_batch_size rows, over which it estimates the "
                  "KL term from completions paired when the dataset is prepared."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_kto_fields(self)


def check_kto_fields(args) -> None:
    """Refuse bad pf-trl fields of ``args`` (a PaddingFreeKTOConfig, or a KTOConfig: defaults), one line each."""
    check_preference_fields(args, "KTOTrainer")
    check_head_kernel(args)
    budget = getattr(args, "max_tokens_per_batch", None)
    if budget is None:
        return
    if args.loss_type not in _NO_KL_LOSSES:
        raise ConfigError(f"max_tokens_per_batch={budget} would change KTO's KL term: loss_type={args.loss_type!r} "
                          "estimates it over each batch of per_device_train_batch_size rows, from completions paired "
                          "with the prompts of that batch when the dataset is prepared; unset max_tokens_per_batch "
                          "(pf-trl packs TRL's batches without padding)")
    raise ConfigError(f"max_tokens_per_batch={budget}: loss_type={args.loss_type!r} has no KL term, but its loss and "
                      "its logged metrics are means over each batch of per_device_train_batch_size rows, which a "
                      "budget would regroup; unset max_tokens_per_batch (pf-trl packs TRL's batches without padding)")
