"""PaddingFreeGRPOTrainer: TRL's GRPOTrainer whose log-probability forwards run packed rows.

Generation, rewards, advantages, the loss types and every metric are TRL's code; the policy, old-policy and reference
log-probabilities come from one packed row per micro-batch (:mod:`pf_trl.trainer.rl.mixin`), a group's prompt held
once where that is exact (``shared_prefix``, :mod:`pf_trl.attention.shared_prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig, GRPOTrainer

from pf_trl.trainer.resume import CheckpointCompleteCallback, ResumableTrainerMixin
from pf_trl.trainer.rl.mixin import PackedLogProbsMixin

__all__ = ["PaddingFreeGRPOConfig", "PaddingFreeGRPOTrainer"]


@dataclass
class PaddingFreeGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus pf-trl's fields (a plain ``GRPOConfig`` gets their defaults)."""

    shared_prefix: str = field(default="auto", metadata={
        "help": "Forward each group's prompt once: 'auto' (where exact), 'on' (refuse where not) or 'off'."})
    attention_backend: str = field(default="auto", metadata={
        "help": "pf-trl's varlen attention kernel: auto, flash_attn, torch_varlen, flex or sdpa."})
    max_tokens_per_forward: int | None = field(default=None, metadata={
        "help": "Token budget of one packed forward: a micro-batch over it runs as several forwards (whole groups "
                "with shared prefixes, else whole sequences) whose losses add up to TRL's. Default: one forward "
                "per micro-batch."})


class PaddingFreeGRPOTrainer(ResumableTrainerMixin, PackedLogProbsMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` on packed rows (see the module docstring); arguments are GRPOTrainer's, ``args`` a
    ``GRPOConfig`` or :class:`PaddingFreeGRPOConfig`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pf_setup()
        self.add_callback(CheckpointCompleteCallback(self))  # each checkpoint committed: resume_from_checkpoint="auto"
