"""Padding-free GRPO and RLOO: TRL's trainers whose log-probability forwards run one packed row per micro-batch,
a group's prompt forwarded once (shared prefixes) where that is exact."""

from __future__ import annotations

__all__ = ["PaddingFreeGRPOConfig", "PaddingFreeGRPOTrainer", "PaddingFreeRLOOConfig", "PaddingFreeRLOOTrainer"]


def __getattr__(name):
    # the trainers import TRL (and through it transformers): keep `import pf_trl.trainer.rl` light
    if name in ("PaddingFreeGRPOTrainer", "PaddingFreeGRPOConfig"):
        from pf_trl.trainer.rl import grpo

        return getattr(grpo, name)
    if name in ("PaddingFreeRLOOTrainer", "PaddingFreeRLOOConfig"):
        from pf_trl.trainer.rl import rloo

        return getattr(rloo, name)
    raise AttributeError(f"module 'pf_trl.trainer.rl' has no attribute {name!r}")
