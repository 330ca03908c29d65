"""PaddingFreeRewardTrainer: TRL's RewardTrainer whose forwards run packed rows, exact against its padded run.

What changes against ``trl.RewardTrainer`` (everything else, the data preparation (EOS appended, tokenization, the
``max_length`` filter), the pad-token fallback to EOS, the loss with ``margin`` and ``center_rewards_coefficient``
and every metric, is TRL's own code):

- batches: :class:`~pf_trl.trainer.preference.collate.PackedRowCollator` wraps TRL's collator: the chosen and the
  rejected sequence of every pair of a micro-batch are separate sequences of one packed row
  (:mod:`pf_trl.trainer.packed`), and :mod:`~pf_trl.trainer.preference.reward_forward` scores the row, pooling each
  sequence where transformers pools the padded batch. TRL's ``[2n, L]`` batch stays as the layout its code reads.
- fixed pairs per step (default): TRL's dataloader, sampler and order; only the padding is gone.
- token budgets (``max_tokens_per_batch``): whole pairs bin-packed under the budget, each micro-batch's loss weighted
  by its share of the step's pairs (:mod:`~pf_trl.trainer.preference.budget`): a step's loss is the mean over all
  its pairs, as TRL's for one batch holding them. Metrics are per-micro-batch values averaged over the logging
  interval, as TRL logs them.
- pf-trl's token metrics (``real_tokens_per_second``, ``padding_share``, ...) counted on the packed rows.

Refused in one line: a model that is not a generic transformers ``*ForSequenceClassification``, a ``data_collator``
of one's own, prompt-learning PEFT (a ``peft_config`` or a ``PeftModel`` passed in), and under a budget an
``IterableDataset`` or a pair longer than the budget.
"""

from __future__ import annotations

from typing import Any

import datasets
import numpy as np
from trl import RewardTrainer

from pf_trl.errors import ConfigError
from pf_trl.trainer.accounting import TokenAccountingMixin
from pf_trl.trainer.adapters import refuse_prompt_learning, transformers_model
from pf_trl.trainer.ga_scaling import declare_loss_scaled_for_ga
from pf_trl.trainer.gather import gather_uneven_first_dim
from pf_trl.trainer.preference.budget import PairBudgetMixin, refuse_over_budget_pairs, refuse_streamed_under_budget
from pf_trl.trainer.preference.collate import PACKED_ROW_KEY, PackedRowCollator
from pf_trl.trainer.preference.reward_config import check_reward_fields
from pf_trl.trainer.preference.reward_forward import install_packed_reward_forward

__all__ = ["PaddingFreeRewardTrainer", "reward_pair_lengths"]


def reward_pair_lengths(dataset) -> np.ndarray:
    """Tokens of each pair of a tokenized reward dataset: ``chosen_ids`` plus ``rejected_ids``."""
    import pyarrow.compute as pc

    table = dataset.select_columns(["chosen_ids", "rejected_ids"]).with_format("arrow")[:]
    chosen, rejected = (pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False)
                        for c in ("chosen_ids", "rejected_ids"))
    return chosen.astype(np.int64) + rejected.astype(np.int64)


def _refuse_unsupported(model, data_collator, peft_config) -> None:
    if data_collator is not None:
        raise ConfigError("PaddingFreeRewardTrainer builds its own packed collator from TRL's; pass no data_collator")
    refuse_prompt_learning(model, peft_config)  # a peft_config, or a PeftModel passed in
    task = str(getattr(peft_config, "task_type", None) or "").split(".")[-1]  # a TaskType or its string
    if task in ("CAUSAL_LM", "SEQ_2_SEQ_LM"):  # TRL's own trainer fails deep inside PEFT on it (AttributeError)
        raise ConfigError(f"peft_config task_type={task} wraps a language model, but a reward model is a sequence "
                          "classifier; use task_type='SEQ_CLS' (`--lora_task_type SEQ_CLS`), which also trains its "
                          "score head")


class PaddingFreeRewardTrainer(PairBudgetMixin, TokenAccountingMixin, RewardTrainer):
    """``trl.RewardTrainer`` on packed rows (see the module docstring). Arguments are RewardTrainer's; ``args`` is a
    :class:`~pf_trl.trainer.preference.reward_config.PaddingFreeRewardConfig` or a plain ``RewardConfig``."""

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, **kwargs):
        if args is None:
            from pf_trl.trainer.preference.reward_config import PaddingFreeRewardConfig

            args = PaddingFreeRewardConfig(output_dir="pf-trl-reward")
        check_reward_fields(args)
        _refuse_unsupported(model, data_collator, peft_config)
        self.pf_token_budget = getattr(args, "max_tokens_per_batch", None)
        refuse_streamed_under_budget(self.pf_token_budget, train_dataset)
        self.pf_mode = getattr(args, "padding_free_mode", "huggingface")
        self._pf_resume_dir: str | None = None
        self._pf_packer = None  # (no streamed packer: resume reads the budget sampler's state)
        if self.pf_token_budget is not None:  # compute_loss weights each micro-batch by its share of the step's pairs
            declare_loss_scaled_for_ga(self)  # before Trainer.__init__: TRL's bridge for transformers < 5.19 reads it
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, peft_config=peft_config, **kwargs)
        self.data_collator = PackedRowCollator(self.data_collator)
        self._pf_enable(transformers_model(self.model))
        self._pf_init_metrics()
        from pf_trl.trainer.resume import CheckpointCompleteCallback, SamplerStateCallback

        self.add_callback(SamplerStateCallback(self))
        self.add_callback(CheckpointCompleteCallback(self))
        if self.pf_token_budget is not None and self.accelerator.num_processes > 1:
            gather_uneven_first_dim(self.accelerator)

    def _pf_enable(self, model) -> None:
        from pf_trl.attention import enable_padding_free

        install_packed_reward_forward(model)  # refuses a model it cannot score packed, before the attention patch
        # the backbone runs the row (and the self-check: the classifier's output is pooled, one position per row)
        enable_padding_free(getattr(model, model.base_model_prefix), mode=self.pf_mode,
                            backend=getattr(self.args, "attention_backend", "auto"),
                            allow_unverified=getattr(self.args, "allow_unverified", False))

    # ------------------------------------------------------------------ data

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        prepared = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if dataset_name == "train" and self.pf_token_budget is not None and isinstance(prepared, datasets.Dataset):
            # right after TRL's tokenization and max_length filter (evaluation batches are not budgeted)
            remedy = f"set max_length <= {self.pf_token_budget // 2} (TRL's RewardTrainer drops longer sequences)"
            refuse_over_budget_pairs(reward_pair_lengths(prepared), self.pf_token_budget, dataset_name,
                                     "chosen plus rejected", remedy)
        return prepared

    def _pf_pair_lengths(self, dataset) -> np.ndarray:
        return reward_pair_lengths(dataset)

    def _pf_batch_pairs(self, batch: dict[str, Any]) -> int:
        return int(batch["input_ids"].shape[0]) // 2

    # ------------------------------------------------------------------ loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        row = inputs.get(PACKED_ROW_KEY)
        if row is not None and self.model.training:
            self._pf_meter.observe({"input_ids": row.input_ids, "position_ids": row.position_ids,
                                    "cu_seq_lens_q": row.cu_seq_lens}, row.num_tokens)
        result = RewardTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs)
        return self._pf_weight_loss(result, self._pf_batch_pairs(inputs), num_items_in_batch)

    # resume: PairBudgetMixin.train records the checkpoint the sampler state is restored from
