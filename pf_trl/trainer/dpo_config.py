"""PaddingFreeDPOConfig: TRL's DPOConfig plus the padding-free options of preference training."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import DPOConfig

from pf_trl.errors import ConfigError

__all__ = ["DPO_MODES", "PaddingFreeDPOConfig", "budget_refused_losses"]

DPO_MODES = ("huggingface", "internal")
# loss types that are not a mean of per-pair terms: under a token budget their value depends on which pairs share a
# micro-batch (aot / aot_unpaired sort the micro-batch's pairs, sft is a token mean over the micro-batch)
_BATCH_COUPLED_LOSSES = ("aot", "aot_unpaired", "sft")


@dataclass
class PaddingFreeDPOConfig(DPOConfig):
    """:class:`trl.DPOConfig` plus padding-free options. Every ``DPOConfig`` field keeps TRL's meaning; a plain
    ``DPOConfig`` given to :class:`~pf_trl.trainer.dpo_trainer.PaddingFreeDPOTrainer` trains with these defaults
    (fixed ``per_device_train_batch_size`` pairs per micro-batch, transformers' native packed attention)."""

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
        metadata={"help": "Token budget of one micro-batch in whole pairs (prompt+chosen plus prompt+rejected, after "
                  "max_length truncation). Unset: per_device_train_batch_size pairs per micro-batch in TRL's order. "
                  "Set: pairs are bin-packed under the budget (rank-balanced, deterministic, resumable) and the loss "
                  "of an optimizer step is the mean over all its pairs."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_pf_fields(self)


def check_pf_fields(args) -> None:
    """Refuse bad pf-trl fields of ``args`` (a PaddingFreeDPOConfig, or a DPOConfig: defaults), in one line each."""
    mode = getattr(args, "padding_free_mode", "huggingface")
    if mode not in DPO_MODES:
        raise ConfigError(f"padding_free_mode must be one of {', '.join(DPO_MODES)} for preference training, got "
                          f"{mode!r} (padded preference training is TRL's own DPOTrainer)")
    backend = getattr(args, "attention_backend", "auto")
    if mode == "huggingface" and backend not in ("auto", None):
        raise ConfigError(f"attention_backend={backend!r} selects one of pf-trl's kernels and needs "
                          "padding_free_mode='internal'")
    budget = getattr(args, "max_tokens_per_batch", None)
    if budget is not None:
        if budget <= 0:
            raise ConfigError(f"max_tokens_per_batch must be a positive integer, got {budget}")
        refused = budget_refused_losses(args.loss_type)
        if refused:
            raise ConfigError(f"loss_type {', '.join(refused)} is not a mean of per-pair terms, so a token budget "
                              "would change it; use fixed pairs per micro-batch (unset max_tokens_per_batch)")


def budget_refused_losses(loss_types) -> list[str]:
    """The loss types of ``loss_types`` that token-budget batches cannot keep exact."""
    types = [loss_types] if isinstance(loss_types, str) else list(loss_types or [])
    return [t for t in types if t in _BATCH_COUPLED_LOSSES]
