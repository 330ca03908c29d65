"""PaddingFreeDPOTrainer: TRL's DPOTrainer whose forwards run packed rows, exact against its padded run.

What changes against ``trl.DPOTrainer`` (everything else, including the data preparation, the reference model, the
loss types and the metrics, is TRL's own code):

- batches: :class:`~pf_trl.trainer.preference.collate.PackedRowCollator` wraps TRL's preference collator; the policy
  and the reference model run one packed row per micro-batch (prompt+chosen and prompt+rejected of every pair as
  separate sequences, ``position_ids`` restarting, no pad token) through :mod:`pf_trl.trainer.dpo_forward`, and the
  per-token outputs of TRL's fused LM head land where TRL's loss code reads them. The attention isolates the sequences
  through :func:`pf_trl.attention.enable_padding_free` (both models).
- fixed pairs per step (default): TRL's dataloader, sampler and order; only the padding is gone.
- token budgets (``max_tokens_per_batch``): whole pairs bin-packed by
  :class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` (rank-balanced, deterministic, resumed from the sampler
  state of each checkpoint). Each micro-batch's loss is TRL's mean over its pairs; it is weighted by its pair count
  over the pairs of the whole optimizer step (all accumulation micro-batches, all ranks), so the gradient of a step is
  the mean over its pairs, as TRL's with a fixed batch.
- metrics: TRL's (``rewards/*``, ``logps/*``, ``logits/*``, ...) from TRL's code, plus pf-trl's token metrics
  (``real_tokens_per_second``, ``padding_share``, ...) counted on the packed rows.

Refused in one line: vision datasets, prompt-learning PEFT (virtual tokens), a ``data_collator`` of one's own, and with
a token budget the loss types that are not per-pair means (``aot``, ``aot_unpaired``, ``sft``).
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
import numpy as np
import torch
from trl import DPOTrainer

from pf_trl.batching.preference import pair_lengths
from pf_trl.batching.sampler import TokenBudgetBatchSampler
from pf_trl.errors import ConfigError
from pf_trl.trainer.accounting import TokenAccountingMixin
from pf_trl.trainer.adapters import refuse_prompt_learning, transformers_model
from pf_trl.trainer.dpo_config import check_pf_fields
from pf_trl.trainer.dpo_forward import check_head_against_trl, install_packed_preference_forward
from pf_trl.trainer.ga_scaling import declare_loss_scaled_for_ga
from pf_trl.trainer.gather import gather_uneven_first_dim
from pf_trl.trainer.preference.budget import PairBudgetMixin, refuse_over_budget_pairs, refuse_streamed_under_budget
from pf_trl.trainer.preference.collate import PACKED_ROW_KEY, PackedRowCollator
from pf_trl.trainer.preference.precompute import refuse_in_memory_precompute

__all__ = ["PaddingFreeDPOTrainer", "gather_uneven_first_dim"]

logger = logging.getLogger("pf_trl.trainer")


def _refuse_unsupported(model, data_collator, train_dataset, peft_config, budget: int | None) -> None:
    if data_collator is not None:
        raise ConfigError("PaddingFreeDPOTrainer builds its own packed collator from TRL's; pass no data_collator")
    refuse_streamed_under_budget(budget, train_dataset)
    first = next(iter(train_dataset)) if train_dataset is not None else {}
    if "image" in first or "images" in first:
        raise ConfigError("PaddingFreeDPOTrainer trains text preference pairs; vision datasets are refused (train "
                          "them with TRL's DPOTrainer)")
    refuse_prompt_learning(model, peft_config)


def dataset_pair_lengths(dataset, max_length: int | None) -> np.ndarray:
    """The packed tokens of each pair of a tokenized DPO dataset (:func:`pair_lengths`, after TRL's truncation)."""
    import pyarrow.compute as pc

    table = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).with_format("arrow")[:]
    counts = [pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False)
              for c in ("prompt_ids", "chosen_ids", "rejected_ids")]
    return pair_lengths(*counts, max_length=max_length)


class PaddingFreeDPOTrainer(PairBudgetMixin, TokenAccountingMixin, DPOTrainer):
    """``trl.DPOTrainer`` on packed rows (see the module docstring). Arguments are DPOTrainer's; ``args`` is a
    :class:`~pf_trl.trainer.dpo_config.PaddingFreeDPOConfig` or a plain ``DPOConfig`` (pf-trl's defaults)."""

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, **kwargs):
        if args is None:
            from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig

            args = PaddingFreeDPOConfig(output_dir="pf-trl-dpo")
        check_pf_fields(args)
        budget = getattr(args, "max_tokens_per_batch", None)
        _refuse_unsupported(model, data_collator, train_dataset, peft_config, budget)
        refuse_in_memory_precompute(args, train_dataset, eval_dataset)
        if args.padding_free:  # TRL would warn that its padding_free is disabled; here every batch is packed
            args.padding_free = False
        self.pf_mode = getattr(args, "padding_free_mode", "huggingface")
        self.pf_token_budget: int | None = getattr(args, "max_tokens_per_batch", None)
        self._pf_train_sampler: TokenBudgetBatchSampler | None = None
        self._pf_packer = None
        self._pf_resume_dir: str | None = None
        if self.pf_token_budget is not None:  # compute_loss weights each micro-batch by its share of the step's pairs
            declare_loss_scaled_for_ga(self)  # before Trainer.__init__: TRL's bridge for transformers < 5.19 reads it
        super().__init__(model, ref_model=ref_model, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         **kwargs)
        # TRL's collator made the precomputed reference log-probs during __init__ (padded, once); from here on every
        # forward of training, evaluation and later precomputes runs the packed row
        self.data_collator = PackedRowCollator(self.data_collator)
        self._pf_enable(transformers_model(self.model), self._pf_policy_fields())
        if self.ref_model is not None:
            self._pf_enable(self.accelerator.unwrap_model(self.ref_model), ("log_probs",))
        # pf-trl's CPU head copies TRL's logit-scale / soft-cap rules: checked against TRL's head on this model, once
        self.pf_head_check = check_head_against_trl(transformers_model(self.model))
        if self.ref_model is not None:
            check_head_against_trl(self.accelerator.unwrap_model(self.ref_model))
        self._pf_init_metrics()
        from pf_trl.trainer.resume import CheckpointCompleteCallback, SamplerStateCallback

        self.add_callback(SamplerStateCallback(self))
        self.add_callback(CheckpointCompleteCallback(self))
        if self.pf_token_budget is not None and self.accelerator.num_processes > 1:
            gather_uneven_first_dim(self.accelerator)

    def _pf_policy_fields(self) -> tuple[str, ...]:
        # the per-token outputs TRL's __init__ asks the policy's fused head for (the reference's: log_probs only)
        fields = ("log_probs", "entropy", "mean_logits", "is_top1")
        return fields + ("log_sum_sq_probs",) if self.use_weighting else fields

    def _pf_enable(self, model: torch.nn.Module, fields: tuple[str, ...]) -> None:
        from pf_trl.attention import enable_padding_free

        enable_padding_free(model, mode=self.pf_mode, backend=getattr(self.args, "attention_backend", "auto"),
                            allow_unverified=getattr(self.args, "allow_unverified", False))
        install_packed_preference_forward(model, fields, head=getattr(self.args, "lm_head_kernel", "auto"))

    # ------------------------------------------------------------------ data

    def _pf_pair_lengths(self, dataset) -> np.ndarray:
        return dataset_pair_lengths(dataset, self.args.max_length)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        prepared = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if dataset_name == "train" and self.pf_token_budget is not None and isinstance(prepared, datasets.Dataset):
            # right after TRL's tokenization, before any reference precompute or training (evaluation batches are
            # per_device_eval_batch_size pairs, not budgeted)
            refuse_over_budget_pairs(dataset_pair_lengths(prepared, args.max_length), self.pf_token_budget,
                                     dataset_name, "prompt+chosen plus prompt+rejected",
                                     f"set max_length <= {self.pf_token_budget // 2} (truncation_mode keeps the start "
                                     "or the end)")
        return prepared

    def _pf_batch_pairs(self, batch: dict[str, Any]) -> int:
        return int(batch["input_ids"].shape[0]) // 2  # TRL's rows: the chosen of every pair, then the rejected

    # ------------------------------------------------------------------ loss (the budget's dataloader and pair
    # count: PairBudgetMixin)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        row = inputs.get(PACKED_ROW_KEY)
        if row is not None and self.model.training:
            self._pf_observe_packed(inputs, row)
        result = DPOTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs)
        if row is None:
            return result
        return self._pf_weight_loss(result, self._pf_batch_pairs(inputs), num_items_in_batch)

    def _pf_observe_packed(self, inputs: dict[str, Any], row) -> None:
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        packed = {"input_ids": row.input_ids, "position_ids": row.position_ids, "labels": labels}
        self._pf_meter.observe(packed, row.num_tokens)

    # resume: PairBudgetMixin.train records the checkpoint the sampler state is restored from
