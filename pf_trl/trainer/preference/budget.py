"""Token budgets of whole pairs for the padding-free preference trainers whose loss is a mean over a micro-batch's
pairs (reward; DPO's per-pair loss types): the pairs are bin-packed under the budget by
:class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` (rank-balanced, deterministic, resumed from each
checkpoint's sampler state), and each micro-batch's loss is weighted by its pairs over the pairs of the whole
optimizer step (every accumulation micro-batch, every rank), so a step's gradient is the mean over its pairs, as
TRL's for one batch holding them. The loss is then already scaled for gradient accumulation
(:func:`pf_trl.trainer.ga_scaling.declare_loss_scaled_for_ga`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pf_trl.batching.sampler import TokenBudgetBatchSampler
from pf_trl.errors import ConfigError
from pf_trl.trainer.resume import ResumableTrainerMixin

__all__ = ["PairBudgetMixin", "refuse_over_budget_pairs", "refuse_streamed_under_budget"]


def refuse_streamed_under_budget(budget: int | None, dataset: Any) -> None:
    """One line when a token budget meets an ``IterableDataset`` (no lengths to plan micro-batches from)."""
    import datasets

    if budget is not None and isinstance(dataset, datasets.IterableDataset):
        raise ConfigError(f"max_tokens_per_batch={budget} plans micro-batches from the length of every pair, which an "
                          "IterableDataset does not have; pass a map-style datasets.Dataset (memory-mapped) or unset "
                          "max_tokens_per_batch (per_device_train_batch_size pairs per micro-batch)")


def refuse_over_budget_pairs(lengths: np.ndarray, budget: int, dataset_name: str, what: str, remedy: str) -> None:
    """One line when a pair (``lengths``: tokens of each pair, ``what`` says which) cannot fit a micro-batch of
    ``budget`` tokens, naming ``remedy`` (the trainer's own option) or a larger budget."""
    if len(lengths) and int(lengths.max()) > budget:
        longest = int(lengths.max())
        raise ConfigError(f"{int((lengths > budget).sum())} pair(s) of the {dataset_name} dataset hold more than "
                          f"max_tokens_per_batch={budget} tokens (the longest: {longest}, {what}); {remedy} or raise "
                          f"max_tokens_per_batch to {longest}")


class PairBudgetMixin(ResumableTrainerMixin):
    """Mix into a TRL preference trainer before it. The trainer provides ``pf_token_budget`` (``None``: TRL's
    batches), ``_pf_pair_lengths(dataset)`` and ``_pf_batch_pairs(batch)``; :meth:`_pf_weight_loss` is called on
    TRL's per-micro-batch mean. Resuming (``"auto"`` too) restores the sampler from the checkpoint's state
    (:class:`~pf_trl.trainer.resume.ResumableTrainerMixin`)."""

    pf_token_budget: int | None = None
    _pf_train_sampler: TokenBudgetBatchSampler | None = None

    def _pf_pair_lengths(self, dataset) -> np.ndarray:
        raise NotImplementedError

    def _pf_batch_pairs(self, batch: dict[str, Any]) -> int:
        raise NotImplementedError

    def get_train_dataloader(self):
        if self.pf_token_budget is None:
            return super().get_train_dataloader()  # TRL's sampler and order
        from pf_trl.trainer.data_inputs import packed_dataloader
        from pf_trl.trainer.resume import restore_sampler

        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        world = max(1, args.world_size)
        sampler = TokenBudgetBatchSampler(self._pf_pair_lengths(self.train_dataset), int(self.pf_token_budget),
                                          shuffle=True, seed=int(seed), num_replicas=world,
                                          rank=args.process_index if world > 1 else 0, drop_last=False)
        self._pf_train_sampler = sampler
        restore_sampler(self, sampler)
        dataset = self._remove_unused_columns(self.train_dataset, description="training")
        return packed_dataloader(self, dataset, sampler, training=True, collate_fn=self.data_collator)

    def _get_num_items_in_batch(self, batch_samples, device):
        if self.pf_token_budget is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        count = torch.tensor(sum(self._pf_batch_pairs(b) for b in batch_samples), device=device)
        if self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count

    def _pf_weight_loss(self, result, pairs: int, num_items_in_batch):
        """TRL's loss (a mean over this micro-batch's ``pairs``) weighted by its pairs over the step's pairs (DDP
        averages the ranks' gradients, hence the world size); as it is without a budget or outside training."""
        if self.pf_token_budget is None or num_items_in_batch is None or not self.model.training:
            return result
        scale = pairs * max(1, self.args.world_size) / num_items_in_batch
        if isinstance(result, tuple):
            return (result[0] * scale, *result[1:])
        return result * scale
