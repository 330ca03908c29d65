"""pf-trl: padding-free fine-tuning for Hugging Face TRL.

Public API (imported lazily so that ``import pf_trl`` stays cheap and the sampler works without torch):

- data: :func:`pretokenize`, :class:`PretokenizeConfig`, :func:`load_shards`, :func:`load_tokenizer`; mixtures:
  :class:`DataConfig`, :class:`MixtureSource`, :func:`read_data_config`, :func:`load_mixture`
- batching: :class:`TokenBudgetBatchSampler`, :class:`MixtureBatchSampler`, :class:`StreamPacker`,
  :class:`PaddingFreeCollator`
- attention: :func:`enable_padding_free`, :func:`varlen_attention`
- training: :class:`PaddingFreeConfig`, :class:`PaddingFreeSFTTrainer`; preference training:
  :class:`PaddingFreeDPOConfig`, :class:`PaddingFreeDPOTrainer`, :class:`PaddingFreeRewardConfig`,
  :class:`PaddingFreeRewardTrainer`, :class:`PackedPreferenceCollator` (their collator), :class:`PaddingFreeKTOConfig`,
  :class:`PaddingFreeKTOTrainer`; reinforcement learning: :class:`PaddingFreeGRPOConfig`,
  :class:`PaddingFreeGRPOTrainer`, :class:`PaddingFreeRLOOConfig`,
  :class:`PaddingFreeRLOOTrainer`
- errors: :class:`PfTrlError`, the root of every exception pf-trl raises on purpose (``pf_trl.errors``)
"""

from __future__ import annotations

from pf_trl._lazy import lazy_exports
from pf_trl._version import __version__
from pf_trl.errors import PfTrlError

_EXPORTS = {
    "pretokenize": "pf_trl.data.engines",
    "PretokenizeConfig": "pf_trl.data.options",
    "load_shards": "pf_trl.data.shards",
    "ShardsError": "pf_trl.data.shards",
    "load_tokenizer": "pf_trl.data.tokenizer",
    "DataConfig": "pf_trl.data.data_config",
    "MixtureSource": "pf_trl.data.data_config",
    "read_data_config": "pf_trl.data.data_config",
    "load_mixture": "pf_trl.data.mixture",
    "MixtureBatchSampler": "pf_trl.batching.mixture_sampler",
    "StreamPacker": "pf_trl.batching.stream_sampler",
    "TokenBudgetBatchSampler": "pf_trl.batching.sampler",
    "PaddingFreeCollator": "pf_trl.batching.collator",
    "enable_padding_free": "pf_trl.attention",
    "varlen_attention": "pf_trl.attention",
    "PaddingFreeConfig": "pf_trl.trainer",
    "PaddingFreeSFTTrainer": "pf_trl.trainer",
    "PaddingFreeDPOConfig": "pf_trl.trainer",
    "PaddingFreeDPOTrainer": "pf_trl.trainer",
    "PaddingFreeRewardConfig": "pf_trl.trainer.preference",
    "PaddingFreeRewardTrainer": "pf_trl.trainer.preference",
    "PaddingFreeKTOConfig": "pf_trl.trainer.preference",
    "PaddingFreeKTOTrainer": "pf_trl.trainer.preference",
    "PackedPreferenceCollator": "pf_trl.trainer.preference.collate",
    "PaddingFreeGRPOConfig": "pf_trl.trainer.rl",
    "PaddingFreeGRPOTrainer": "pf_trl.trainer.rl",
    "PaddingFreeRLOOConfig": "pf_trl.trainer.rl",
    "PaddingFreeRLOOTrainer": "pf_trl.trainer.rl",
}

__all__ = ["__version__", "PfTrlError", *_EXPORTS]


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
