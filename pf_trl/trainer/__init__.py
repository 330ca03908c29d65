"""Training: PaddingFreeConfig (configuration) and PaddingFreeSFTTrainer (behaviour)."""

from pf_trl.trainer.config import PaddingFreeConfig
from pf_trl.trainer.trainer import MeasuredSFTTrainer, PaddingFreeSFTTrainer

__all__ = ["PaddingFreeConfig", "PaddingFreeSFTTrainer", "MeasuredSFTTrainer"]
