"""PaddingFreeKTOConfig: TRL's KTOConfig plus the padding-free options of KTO training."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import KTOConfig

from pf_trl.errors import ConfigError

__all__ = ["PaddingFreeKTOConfig", "check_kto_fields"]

_MODES = ("huggingface", "internal")
# the loss types whose batch-level KL estimate TRL computes (every one but apo_zero_unpaired)
_NO_KL_LOSSES = ("apo_zero_unpaired",)


@dataclass
class PaddingFreeKTOConfig(KTOConfig):
    """:class:`trl.KTOConfig` plus padding-free options; every ``KTOConfig`` field keeps TRL's meaning. A plain
    ``KTOConfig`` given to :class:`~pf_trl.trainer.preference.kto_trainer.PaddingFreeKTOTrainer` trains with these
    defaults (TRL's batches, transformers' native packed attention)."""

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
        metadata={"help": "Not available for KTO (kept so that the flag of pf-trl dpo / reward is refused with its "
                  "reason): KTO keeps TRL's batches of per_device_train_batch_size rows, over which it estimates the "
                  "KL term from completions paired when the dataset is prepared."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_kto_fields(self)


def check_kto_fields(args) -> None:
    """Refuse bad pf-trl fields of ``args`` (a PaddingFreeKTOConfig, or a KTOConfig: defaults), one line each."""
    mode = getattr(args, "padding_free_mode", "huggingface")
    if mode not in _MODES:
        raise ConfigError(f"padding_free_mode must be one of {', '.join(_MODES)} for KTO training, got {mode!r} "
                          "(padded KTO training is TRL's own KTOTrainer)")
    backend = getattr(args, "attention_backend", "auto")
    if mode == "huggingface" and backend not in ("auto", None):
        raise ConfigError(f"attention_backend={backend!r} selects one of pf-trl's kernels and needs "
                          "padding_free_mode='internal'")
    budget = getattr(args, "max_tokens_per_batch", None)
    if budget is None:
        return
    if budget <= 0:
        raise ConfigError(f"max_tokens_per_batch must be a positive integer, got {budget}")
    if args.loss_type not in _NO_KL_LOSSES:
        raise ConfigError(f"max_tokens_per_batch={budget} would change KTO's KL term: loss_type={args.loss_type!r} "
                          "estimates it over each batch of per_device_train_batch_size rows, from completions paired "
                          "with the prompts of that batch when the dataset is prepared; unset max_tokens_per_batch "
                          "(pf-trl packs TRL's batches without padding)")
    raise ConfigError(f"max_tokens_per_batch={budget}: loss_type={args.loss_type!r} has no KL term, but its loss and "
                      "its logged metrics are means over each batch of per_device_train_batch_size rows, which a "
                      "budget would regroup; unset max_tokens_per_batch (pf-trl packs TRL's batches without padding)")
