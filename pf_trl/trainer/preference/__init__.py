"""Preference trainers beyond DPO, padding-free over the shared packed-forward core (:mod:`pf_trl.trainer.packed`):
:class:`~pf_trl.trainer.preference.reward_trainer.PaddingFreeRewardTrainer` (TRL's ``RewardTrainer``) and its
:class:`~pf_trl.trainer.preference.reward_config.PaddingFreeRewardConfig`.

- :mod:`~pf_trl.trainer.preference.config_fields`: the padding-free config fields, declared once for every trainer;
- :mod:`~pf_trl.trainer.preference.collate`: TRL's padded collator plus the batch's packed row (DPO and reward);
- :mod:`~pf_trl.trainer.preference.budget`: token budgets of whole pairs (sampler, loss weighting, refusals);
- :mod:`~pf_trl.trainer.preference.reward_forward`: a sequence-classification model scored on the packed row.
"""

from __future__ import annotations

from pf_trl._lazy import lazy_exports

_EXPORTS = {
    "PaddingFreeRewardConfig": "pf_trl.trainer.preference.reward_config",
    "PaddingFreeRewardTrainer": "pf_trl.trainer.preference.reward_trainer",
}

__all__ = ["PaddingFreeRewardConfig", "PaddingFreeRewardTrainer"]

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
