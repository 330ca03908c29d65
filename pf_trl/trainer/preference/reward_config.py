"""PaddingFreeRewardConfig: TRL's RewardConfig plus the padding-free options of reward-model training."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RewardConfig

from pf_trl.trainer.preference.config_fields import PaddingFreePreferenceFields, check_preference_fields

__all__ = ["PaddingFreeRewardConfig", "check_reward_fields"]


@dataclass
class PaddingFreeRewardConfig(PaddingFreePreferenceFields, RewardConfig):
    """:class:`trl.RewardConfig` plus the padding-free options of
    :class:`~pf_trl.trainer.preference.config_fields.PaddingFreePreferenceFields`; every ``RewardConfig`` field keeps
    TRL's meaning. A plain ``RewardConfig`` given to
    :class:`~pf_trl.trainer.preference.reward_trainer.PaddingFreeRewardTrainer` trains with these defaults."""

    def __post_init__(self):
        super().__post_init__()
        check_reward_fields(self)


def check_reward_fields(args) -> None:
    """Refuse bad pf-trl fields of ``args`` (a PaddingFreeRewardConfig, or a RewardConfig: defaults), one line each."""
    check_preference_fields(args, "RewardTrainer")
