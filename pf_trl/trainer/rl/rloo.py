"""PaddingFreeRLOOTrainer: TRL's RLOOTrainer whose log-probability forwards run packed rows (as
:mod:`pf_trl.trainer.rl.grpo` for GRPO)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import RLOOConfig, RLOOTrainer

from pf_trl.trainer.resume import CheckpointCompleteCallback, ResumableTrainerMixin
from pf_trl.trainer.rl.mixin import PackedLogProbsMixin

__all__ = ["PaddingFreeRLOOConfig", "PaddingFreeRLOOTrainer"]


@dataclass
class PaddingFreeRLOOConfig(RLOOConfig):
    """``RLOOConfig`` plus pf-trl's fields (a plain ``RLOOConfig`` gets their defaults)."""

    shared_prefix: str = field(default="auto", metadata={
        "help": "Forward each group's prompt once: 'auto' (where exact), 'on' (refuse where not) or 'off'."})
    attention_backend: str = field(default="auto", metadata={
        "help": "pf-trl's varlen attention kernel: auto, flash_attn, torch_varlen, flex or sdpa."})
    max_tokens_per_forward: int | None = field(default=None, metadata={
        "help": "Token budget of one packed forward: a micro-batch over it runs as several forwards (whole groups "
                "with shared prefixes, else whole sequences) whose losses add up to TRL's. Default: one forward "
                "per micro-batch."})


class PaddingFreeRLOOTrainer(ResumableTrainerMixin, PackedLogProbsMixin, RLOOTrainer):
    """``trl.RLOOTrainer`` on packed rows; arguments are RLOOTrainer's, ``args`` an ``RLOOConfig`` or
    :class:`PaddingFreeRLOOConfig`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pf_setup()
        self.add_callback(CheckpointCompleteCallback(self))  # each checkpoint committed: resume_from_checkpoint="auto"
