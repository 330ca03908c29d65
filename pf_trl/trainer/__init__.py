"""Padding-free training: :class:`PaddingFreeConfig`, :class:`PaddingFreeSFTTrainer`, :func:`derive_token_budget`;
preference training: :class:`PaddingFreeDPOConfig`, :class:`PaddingFreeDPOTrainer`.

The exports are imported on first use, so that light modules of this package (``output_dir``) can be imported by the
CLI's early checks without importing TRL and torch.
"""

from __future__ import annotations

from pf_trl._lazy import lazy_exports

_EXPORTS = {
    "PaddingFreeConfig": "pf_trl.trainer.config",
    "PADDING_FREE_MODES": "pf_trl.trainer.config",
    "to_padding_free_config": "pf_trl.trainer.config",
    "PaddingFreeSFTTrainer": "pf_trl.trainer.trainer",
    "PaddingFreeDPOConfig": "pf_trl.trainer.dpo_config",
    "PaddingFreeDPOTrainer": "pf_trl.trainer.dpo_trainer",
    "derive_token_budget": "pf_trl.data.prepare",
}

__all__ = ["PaddingFreeConfig", "PaddingFreeSFTTrainer", "PaddingFreeDPOConfig", "PaddingFreeDPOTrainer", "PADDING_FREE_MODES", "derive_token_budget", "to_padding_free_config"]


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
