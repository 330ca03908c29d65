"""Padding-free training: :class:`PaddingFreeConfig`, :class:`PaddingFreeSFTTrainer`, chunked cross-entropy, metrics."""

from pf_trl.trainer.config import PADDING_FREE_MODES, PaddingFreeConfig, to_padding_free_config
from pf_trl.trainer.trainer import PaddingFreeSFTTrainer, derive_token_budget

__all__ = ["PaddingFreeConfig", "PaddingFreeSFTTrainer", "PADDING_FREE_MODES", "derive_token_budget", "to_padding_free_config"]
