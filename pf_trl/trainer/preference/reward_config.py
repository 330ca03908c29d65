"""PaddingFreeRewardConfig: TRL's RewardConfig plus the padding-free options of reward-model training."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import RewardConfig

from pf_trl.errors import ConfigError

__all__ = ["PaddingFreeRewardConfig", "check_reward_fields"]

_MODES = ("huggingface", "internal")


@dataclass
class PaddingFreeRewardConfig(RewardConfig):
    """:class:`trl.RewardConfig` plus padding-free options; every ``RewardConfig`` field keeps TRL's meaning. A plain
    ``RewardConfig`` given to :class:`~pf_trl.trainer.preference.reward_trainer.PaddingFreeRewardTrainer` trains with
    these defaults."""

    padding_free_mode: str = field(
        default="huggingface",
        metadata={"help": "Attention of the packed rows: 'huggingface' (transformers' native packed attention, "
                  "self-checked) or 'internal' (pf-trl's pf_varlen kernels)."},
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "Varlen kernel for padding_free_mode='internal': auto, flash_attn, torch_varlen, flex, "
                  "sdpa."},
    )
    allow_unverified: bool = field(
        default=False,
        metadata={"help": "Accept a model type that pf-trl's coverage sweep has no evidence for (docs/models.md), "
                  "relying on the runtime self-check alone."},
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": "Token budget of one micro-batch in whole pairs (chosen plus rejected). Unset: "
                  "per_device_train_batch_size pairs per micro-batch in TRL's order. Set: pairs are bin-packed under "
                  "the budget (rank-balanced, deterministic, resumable) and the loss of an optimizer step is the mean "
                  "over all its pairs."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_reward_fields(self)


def check_reward_fields(args) -> None:
    """Refuse bad pf-trl fields of ``args`` (a PaddingFreeRewardConfig, or a RewardConfig: defaults), one line each."""
    mode = getattr(args, "padding_free_mode", "huggingface")
    if mode not in _MODES:
        raise ConfigError(f"padding_free_mode must be one of {', '.join(_MODES)} for reward training, got {mode!r} "
                          "(padded reward training is TRL's own RewardTrainer)")
    backend = getattr(args, "attention_backend", "auto")
    if mode == "huggingface" and backend not in ("auto", None):
        raise ConfigError(f"attention_backend={backend!r} selects one of pf-trl's kernels and needs "
                          "padding_free_mode='internal'")
    budget = getattr(args, "max_tokens_per_batch", None)
    if budget is not None and budget <= 0:
        raise ConfigError(f"max_tokens_per_batch must be a positive integer, got {budget}")
