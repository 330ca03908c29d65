"""PaddingFreeSFTTrainer: TRL's SFTTrainer fed by the token-budget sampler and the padding-free collator.

What it changes, and only that:

- dataloaders: ``TokenBudgetBatchSampler`` (rank-aware, deterministic) + ``PaddingFreeCollator``;
- the model: ``enable_padding_free`` (isolated segments on every path, KV-cache hole closed);
- evaluation: token-weighted mean over all supervised tokens (HF averages per-batch means instead);
- checkpoints: the sampler's fingerprint is saved, and a resume onto other data or another budget is refused
  (batches are deterministic for (seed, epoch), so HF's skip of the consumed batches replays nothing twice);
- metrics: real/supervised tokens per second, padding share, tokens per step, memory, MFU.

The loss is TRL's: the fused LM head scores supervised positions in tiles (never the full logits), divided by
``num_items_in_batch``, which the HF Trainer counts over all micro-batches of the optimizer step and over all
ranks: the token mean a padded run computes.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import SFTTrainer

from pf_trl.collator import PaddingFreeCollator
from pf_trl.sampler import TokenBudgetBatchSampler
from pf_trl.trainer.config import PaddingFreeConfig
from pf_trl.trainer.metrics import ThroughputMeter, count_batch, detect_peak_tflops, flops_per_step_terms

logger = logging.getLogger(__name__)

SAMPLER_STATE_FILE = "pf_sampler_state.json"


class _MeterCallback(TrainerCallback):
    """Closes a step in the meter and points the sampler at the epoch the Trainer starts."""

    def __init__(self, trainer: "MeasuredTrainerMixin") -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.pf_meter.start()

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = getattr(self.trainer, "_pf_train_sampler", None)
        if sampler is not None:
            sampler.set_epoch(int(state.epoch or 0))

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.pf_meter.end_step()


class MeasuredTrainerMixin:
    """Counts every training batch as it enters ``training_step``; merges the honest metrics into the logs.

    Shared by pf-trl's trainer and the baselines of ``pf-trl bench``, so both are measured by the same code.
    """

    def _init_meter(self) -> None:
        args = self.args
        peak = getattr(args, "peak_tflops", None) or detect_peak_tflops()
        self.pf_meter = ThroughputMeter(
            flop_terms=flops_per_step_terms(self.model), peak_tflops=peak, world_size=max(1, args.world_size)
        )
        self.add_callback(_MeterCallback(self))

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.pf_meter.add(count_batch(inputs))
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training or "train_runtime" in logs:
            logs = {**logs, **self.pf_meter.metrics("train")}
        super().log(logs, start_time)

    def train(self, *args: Any, **kwargs: Any):
        output = super().train(*args, **kwargs)
        output.metrics.update(self.pf_meter.metrics("train"))
        return output


class MeasuredSFTTrainer(MeasuredTrainerMixin, SFTTrainer):
    """Stock SFTTrainer with pf-trl's token accounting (the baselines of ``pf-trl bench``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_meter()


def _ensure_length_column(dataset):
    """Shards carry ``length``; any other tokenized dataset gets it computed once (from input_ids sizes)."""
    if dataset is None or "length" in dataset.column_names:
        return dataset
    if "input_ids" not in dataset.column_names:
        raise ValueError(
            "PaddingFreeSFTTrainer needs a tokenized dataset (input_ids, optional labels); pretokenize it first: "
            "`pf-trl pretokenize SOURCE DIR` and `load_shards(DIR)`"
        )
    return dataset.map(lambda b: {"length": [len(x) for x in b["input_ids"]]}, batched=True, desc="lengths")


def dataset_lengths(dataset) -> np.ndarray:
    return np.asarray(dataset.select_columns(["length"]).with_format("numpy")["length"], dtype=np.int64)


def derive_token_budget(lengths: np.ndarray, per_device_batch_size: int, requested: int | None) -> int:
    """The token budget of a device step: the requested one, or batch size x mean length (comparable runs).

    It never goes below the longest example, which must fit in one batch.
    """
    longest = int(lengths.max())
    if requested is not None:
        if requested < longest:
            raise ValueError(
                f"max_tokens_per_batch={requested} is smaller than the longest example ({longest} tokens); raise it "
                f"or pretokenize with --max_seq_len <= {requested}"
            )
        return int(requested)
    return max(longest, int(math.ceil(per_device_batch_size * float(lengths.mean()))))


class PaddingFreeSFTTrainer(MeasuredTrainerMixin, SFTTrainer):
    """``SFTTrainer`` with token-budget batches, padding-free rows and exact loss (see module docstring).

    Args:
        model: a causal LM module (build one with :func:`pf_trl.models.build_model`).
        args: :class:`PaddingFreeConfig`.
        train_dataset / eval_dataset: tokenized datasets with ``input_ids`` and ``labels`` (shards from
            :func:`pf_trl.load_shards`; a ``length`` column is added when missing).
        kwargs: the rest of ``SFTTrainer``'s arguments (``processing_class``, ``callbacks``, ...).
    """

    def __init__(self, model, args: PaddingFreeConfig, train_dataset=None, eval_dataset=None, **kwargs: Any) -> None:
        if not isinstance(args, PaddingFreeConfig):
            raise TypeError(f"PaddingFreeSFTTrainer needs a PaddingFreeConfig, got {type(args).__name__}")
        if isinstance(model, str):
            raise TypeError("pass a model object (e.g. pf_trl.models.build_model(name)); pf-trl never loads by hub id")
        self.pf_config = args
        self.pf_mode = args.padding_free
        if self.pf_mode != "none":
            from pf_trl.attention import enable_padding_free

            backend = args.attention_backend if self.pf_mode == "internal" else "auto"
            enable_padding_free(model, mode=self.pf_mode, backend=backend)
            kwargs.setdefault("data_collator", PaddingFreeCollator())
            train_dataset = _ensure_length_column(train_dataset)
            if isinstance(eval_dataset, dict):
                eval_dataset = {k: _ensure_length_column(v) for k, v in eval_dataset.items()}
            else:
                eval_dataset = _ensure_length_column(eval_dataset)
        # TRL's own boolean padding_free would reject our collator and re-collate: hand TRL a copy with it off.
        trl_args = copy.copy(args)
        trl_args.padding_free = False
        trl_args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        super().__init__(model=model, args=trl_args, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        self._pf_train_sampler: TokenBudgetBatchSampler | None = None
        self.max_tokens_per_batch: int | None = None
        if self.pf_mode != "none" and self.train_dataset is not None:
            self.max_tokens_per_batch = derive_token_budget(
                dataset_lengths(self.train_dataset), args.per_device_train_batch_size, args.max_tokens_per_batch
            )
        self._init_meter()

    # ------------------------------------------------------------------------------------ dataloaders

    def _make_sampler(self, dataset, *, shuffle: bool, max_tokens: int) -> TokenBudgetBatchSampler:
        args = self.args
        return TokenBudgetBatchSampler.from_dataset(
            dataset,
            max_tokens,
            shuffle=shuffle,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            num_replicas=max(1, args.world_size),
            rank=args.process_index,
            drop_last=args.dataloader_drop_last,
        )

    def _packed_dataloader(self, dataset, sampler: TokenBudgetBatchSampler, description: str) -> DataLoader:
        dataset = self._remove_unused_columns(dataset, description=description)
        args = self.args
        params: dict[str, Any] = {
            "batch_sampler": sampler,
            "collate_fn": self.data_collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
        }
        if args.dataloader_num_workers > 0 and args.dataloader_prefetch_factor is not None:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
        dataloader = self.accelerator.prepare(DataLoader(dataset, **params))
        # The sampler is already rank-aware: make accelerate's BatchSamplerShard a pass-through (as transformers
        # does for its BatchRebalanceSampler), or it would shard the batches a second time and drop data.
        shard = getattr(dataloader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes = 1
            shard.process_index = 0
        return dataloader

    def get_train_dataloader(self) -> DataLoader:
        if self.pf_mode == "none":
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("training requires a train_dataset")
        self._pf_train_sampler = self._make_sampler(self.train_dataset, shuffle=True, max_tokens=self.max_tokens_per_batch)
        logger.info(
            "pf-trl: %d batches per rank per epoch, budget %d tokens, fill %.4f",
            len(self._pf_train_sampler), self.max_tokens_per_batch, self._pf_train_sampler.efficiency,
        )
        return self._packed_dataloader(self.train_dataset, self._pf_train_sampler, "training")

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if self.pf_mode == "none":
            return super().get_eval_dataloader(eval_dataset)
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = _ensure_length_column(eval_dataset if eval_dataset is not None else self.eval_dataset)
        if dataset is None:
            raise ValueError("evaluation requires an eval_dataset")
        lengths = dataset_lengths(dataset)
        budget = max(int(lengths.max()), self.max_tokens_per_batch or 0)
        sampler = self._make_sampler(dataset, shuffle=False, max_tokens=budget)
        return self._packed_dataloader(dataset, sampler, "evaluation")

    # ------------------------------------------------------------------------------------- evaluation

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Eval loss = sum of token losses / supervised tokens, over the whole set and all ranks.

        A padded HF evaluation averages per-batch means; with batches of unequal token counts that is a
        different number. This is the definition both pf-trl and its tests use.
        """
        if self.pf_mode == "none":
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        dataloader = self.get_eval_dataloader(eval_dataset)
        model = self.model
        was_training = model.training
        model.eval()
        start = time.perf_counter()
        totals = torch.zeros(3, dtype=torch.float64, device=self.args.device)  # loss sum, supervised, real tokens
        with torch.no_grad():
            for inputs in dataloader:
                inputs = self._prepare_inputs(inputs)
                with self.compute_loss_context_manager():
                    outputs = model(**inputs, use_cache=False, fused_lm_head=True)
                totals[0] += (-outputs.log_probs).sum().double()
                totals[1] += outputs.label_mask.sum()
                totals[2] += inputs["input_ids"].numel()
        totals = self.accelerator.reduce(totals, reduction="sum")
        runtime = time.perf_counter() - start
        loss = (totals[0] / totals[1].clamp_min(1)).item()
        metrics = {
            f"{metric_key_prefix}_loss": loss,
            f"{metric_key_prefix}_runtime": round(runtime, 4),
            f"{metric_key_prefix}_supervised_tokens": int(totals[1].item()),
            f"{metric_key_prefix}_real_tokens_per_second": round(totals[2].item() / max(runtime, 1e-9), 3),
        }
        model.train(was_training)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._pf_train_sampler is None or not self.args.should_save:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        steps_per_epoch = max(1, len(self._pf_train_sampler) // self.args.gradient_accumulation_steps)
        consumed = (self.state.global_step % steps_per_epoch) * self.args.gradient_accumulation_steps
        state = self._pf_train_sampler.state_dict(batches_yielded=consumed)
        state["max_tokens_per_batch"] = self.max_tokens_per_batch
        with open(os.path.join(folder, SAMPLER_STATE_FILE), "w") as f:
            json.dump(state, f, indent=2, default=int)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint and self.pf_mode != "none":
            folder = (
                get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
            )
            path = os.path.join(folder, SAMPLER_STATE_FILE) if folder else None
            if path and os.path.isfile(path):
                with open(path) as f:
                    state = json.load(f)
                # Validate only: HF skips the consumed batches itself; loading here would skip them twice.
                probe = self._make_sampler(self.train_dataset, shuffle=True, max_tokens=self.max_tokens_per_batch)
                try:
                    probe.load_state_dict(state)
                except ValueError as exc:
                    raise ValueError(
                        f"cannot resume from {folder}: the data, token budget or world size differ from the run "
                        f"that wrote it ({exc}); resume with the same dataset and --max_tokens_per_batch "
                        f"{state.get('max_tokens_per_batch')}"
                    ) from exc
        return super().train(resume_from_checkpoint, *args, **kwargs)
