"""Preference trainers beyond DPO, padding-free over the shared packed-forward core (:mod:`pf_trl.trainer.packed`):
:class:`~pf_trl.trainer.preference.reward_trainer.PaddingFreeRewardTrainer` (TRL's ``RewardTrainer``) and its
:class:`~pf_trl.trainer.preference.reward_config.PaddingFreeRewardConfig`;
:class:`~pf_trl.trainer.preference.kto_trainer.PaddingFreeKTOTrainer` (TRL's ``KTOTrainer``) and its
:class:`~pf_trl.trainer.preference.kto_config.PaddingFreeKTOConfig`.

- :mod:`~pf_trl.trainer.preference.config_fields`: the padding-free config fields, declared once for every trainer;
- :mod:`~pf_trl.trainer.preference.collate`: TRL's padded collator plus the batch's packed row (DPO and reward);
- :mod:`~pf_trl.trainer.preference.budget`: token budgets of whole pairs (sampler, loss weighting, refusals);
- :mod:`~pf_trl.trainer.preference.reward_forward`: a sequence-classification model scored on the packed row;
- :mod:`~pf_trl.trainer.preference.self_packed_forward`: a causal LM's fused-head calls each packing their own padded
  batch (KTO's completions, KL completions and reference precompute).
"""

from __future__ import annotations

from pf_trl._lazy import lazy_exports

_EXPORTS = {
    "PaddingFreeKTOConfig": "pf_trl.trainer.preference.kto_config",
    "PaddingFreeKTOTrainer": "pf_trl.trainer.preference.kto_trainer",
    "PaddingFreeRewardConfig": "pf_trl.trainer.preference.reward_config",
    "PaddingFreeRewardTrainer": "pf_trl.trainer.preference.reward_trainer",
}

__all__ = ["PaddingFreeKTOConfig", "PaddingFreeKTOTrainer", "PaddingFreeRewardConfig", "PaddingFreeRewardTrainer"]

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
