"""The padding-free fields every pf-trl preference config adds to TRL's (DPO, reward, ...), declared once, and their
one-line refusals."""

from __future__ import annotations

from dataclasses import dataclass, field

from pf_trl.errors import ConfigError

__all__ = ["LM_HEAD_KERNELS", "PREFERENCE_MODES", "FusedHeadFields", "PaddingFreePreferenceFields",
           "check_head_kernel", "check_preference_fields"]

PREFERENCE_MODES = ("huggingface", "internal")
# 'auto': pf-trl's CPU head where it applies (pf_trl.trainer.dpo_head), else TRL's; 'trl': TRL's fused head always
LM_HEAD_KERNELS = ("auto", "trl")


@dataclass
class PaddingFreePreferenceFields:
    """Mix into a TRL preference config *before* it (``class C(PaddingFreePreferenceFields, DPOConfig)``): its fields
    then come after TRL's, and TRL's ``__post_init__`` runs as always."""

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
        metadata={"help": "Token budget of one micro-batch in whole pairs (every sequence of a pair, after "
                  "max_length truncation). Unset: per_device_train_batch_size pairs per micro-batch in TRL's order. "
                  "Set: pairs are bin-packed under the budget (rank-balanced, deterministic, resumable) and the loss "
                  "of an optimizer step is the mean over all its pairs."},
    )


@dataclass
class FusedHeadFields:
    """The head option of the preference trainers whose loss reads TRL's fused LM head (DPO, KTO); mixed in before
    :class:`PaddingFreePreferenceFields`."""

    lm_head_kernel: str = field(
        default="auto",
        metadata={"help": "Which head scores the completion tokens: 'auto' (pf-trl's CPU head where it applies, "
                  "checked against TRL's head at start-up; TRL's fused head elsewhere) or 'trl' (TRL's fused head "
                  "always).", "choices": list(LM_HEAD_KERNELS)},
    )


def check_head_kernel(args) -> None:
    """Refuse a bad ``lm_head_kernel`` of ``args`` (a config with :class:`FusedHeadFields`, or TRL's: the default)."""
    kernel = getattr(args, "lm_head_kernel", "auto")
    if kernel not in LM_HEAD_KERNELS:
        raise ConfigError(f"lm_head_kernel must be one of {', '.join(LM_HEAD_KERNELS)}, got {kernel!r}")


def check_preference_fields(args, padded_trainer: str) -> None:
    """Refuse bad padding-free fields of ``args`` (a config with :class:`PaddingFreePreferenceFields`, or TRL's plain
    config: the defaults), one line each; ``padded_trainer`` names TRL's trainer for the padded run."""
    mode = getattr(args, "padding_free_mode", "huggingface")
    if mode not in PREFERENCE_MODES:
        raise ConfigError(f"padding_free_mode must be one of {', '.join(PREFERENCE_MODES)} for preference training, "
                          f"got {mode!r} (padded training is TRL's own {padded_trainer})")
    backend = getattr(args, "attention_backend", "auto")
    if mode == "huggingface" and backend not in ("auto", None):
        raise ConfigError(f"attention_backend={backend!r} selects one of pf-trl's kernels and needs "
                          "padding_free_mode='internal'")
    budget = getattr(args, "max_tokens_per_batch", None)
    if budget is not None and budget <= 0:
        raise ConfigError(f"max_tokens_per_batch must be a positive integer, got {budget}")
