"""PaddingFreeSFTTrainer: TRL's SFTTrainer with token-budget batches, packed rows and an exact loss.

What changes against ``SFTTrainer`` (``padding_free`` != ``"none"``):

- data: train and eval dataloaders batch with :class:`~pf_trl.sampler.TokenBudgetBatchSampler` (rank-aware: each
  rank gets disjoint, token-balanced batches and the same number of them) and collate with
  :class:`~pf_trl.collator.PaddingFreeCollator` (one ``[1, T]`` row, ``position_ids``, flash kwargs, no
  ``attention_mask``). Columns are reduced to ``input_ids`` / ``labels`` before collation; ``position_ids`` and the
  flash kwargs are produced by the collator after that, so column removal cannot drop them.
- attention: :func:`pf_trl.attention.enable_padding_free` is applied to the model (self-checked; it also forces
  ``use_cache=False`` on packed inputs, so evaluation does not depend on the caller remembering it).
- loss: hidden states from the backbone, then cross-entropy over the supervised positions only, in chunks
  (:mod:`pf_trl.trainer.loss`; never the full ``[T, vocab]`` logits). It is divided by transformers'
  ``num_items_in_batch``: the count of shifted supervised labels over the whole accumulation window, summed over
  data-parallel ranks (and multiplied back by the world size, since DDP averages gradients). So the loss of an
  optimizer step is the mean over all its supervised tokens -- exactly what a padded run computes.
- eval loss: token-weighted mean over all supervised tokens (transformers averages per-batch means; the padded
  mode of this trainer reports the token-weighted mean too, so the two are comparable).
- resume: the sampler state is written to each checkpoint (``pf_trl_sampler_state.json``). On resume it is
  validated against the new sampler (same data lengths, budget, seed, world size) and its epoch restored;
  Trainer's own ``skip_first_batches`` then skips the consumed batches of that epoch (at the batch-sampler level:
  index lists only, no data is loaded). The sampler itself is *not* fast-forwarded, so nothing is skipped twice
  and nothing is replayed.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from typing import Any

import numpy as np
import torch
from trl import SFTTrainer

from pf_trl.collator import PaddingFreeCollator, mark_dynamic_lengths
from pf_trl.sampler import TokenBudgetBatchSampler
from pf_trl.trainer.config import PaddingFreeConfig, normalize_padding_free
from pf_trl.trainer.loss import linear_cross_entropy, resolve_fused_loss
from pf_trl.trainer.metrics import REAL_TOKENS_KEY, TokenAccountingMixin

logger = logging.getLogger("pf_trl.trainer")

SAMPLER_STATE_NAME = "pf_trl_sampler_state.json"
_MODEL_COLUMNS = ("input_ids", "labels")


class _CountingCollator:
    """Wraps the padding-free collator: records the real token count (without a pad_to_multiple_of segment)."""

    def __init__(self, inner: PaddingFreeCollator) -> None:
        self.inner = inner

    def __call__(self, features):
        batch = self.inner(features)
        batch[REAL_TOKENS_KEY] = sum(len(f["input_ids"]) for f in features)
        return batch


def _dataset_lengths(dataset) -> np.ndarray:
    names = getattr(dataset, "column_names", None) or []
    if "length" in names:
        column = dataset.select_columns(["length"]).with_format("arrow")[:]["length"]
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.int64)
    if names:
        column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
        import pyarrow.compute as pc

        return np.asarray(pc.list_value_length(column).to_numpy(zero_copy_only=False), dtype=np.int64)
    return np.asarray([len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)


def derive_token_budget(lengths: np.ndarray, batch_size: int) -> int:
    """``batch_size x mean length`` (rounded up), at least the longest example."""
    return int(max(int(lengths.max()), math.ceil(float(lengths.mean()) * batch_size)))


def _has_logit_transform(model) -> bool:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return any(getattr(text, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def install_pf_loss_forward(model: torch.nn.Module, impl: str, chunk_size: int) -> None:
    """Give ``model.forward`` a ``pf_loss=True`` path: backbone -> supervised positions -> chunked CE.

    Returns ``{"loss_sum", "num_tokens", "correct"}``. Going through ``model.forward`` (not ``model.model``) keeps
    DDP/FSDP wrappers in the loop. Other calls use the previous forward (generation is unchanged).
    """
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, pf_loss: bool = False, **kwargs):
        if not pf_loss:
            return previous(*args, **kwargs)
        labels = kwargs.pop("labels")
        kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        backbone = getattr(self, self.base_model_prefix)
        hidden = backbone(*args, **kwargs).last_hidden_state
        return _supervised_loss(self, hidden, labels, impl, chunk_size)

    import types

    model.forward = types.MethodType(forward, model)


@torch.compiler.disable(reason="data-dependent gather of supervised positions and a chunk loop over them")
def _supervised_loss(model, hidden, labels, impl: str, chunk_size: int) -> dict[str, torch.Tensor]:
    # Runs eagerly under torch.compile (one intended graph break after the backbone): the number of supervised
    # tokens changes every step, so a traced gather + chunk loop would recompile each step.
    head = model.get_output_embeddings()
    targets = labels[:, 1:].to(head.weight.device)
    mask = targets != -100
    selected = hidden[:, :-1].to(head.weight.device)[mask]
    weight, bias = head.weight, head.bias
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):  # FSDP2 shards the head: gather it once for the chunk loop
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    loss_sum, correct = linear_cross_entropy(selected, weight, targets[mask], bias, impl=impl, chunk_size=chunk_size)
    return {"loss_sum": loss_sum, "num_tokens": mask.sum(), "correct": correct}


class PaddingFreeSFTTrainer(TokenAccountingMixin, SFTTrainer):
    """``SFTTrainer`` that trains on padding-free, token-budget batches with the exact padded loss.

    Args are those of ``SFTTrainer``; ``args`` should be a :class:`PaddingFreeConfig` (a plain ``SFTConfig`` or
    ``TrainingArguments`` is converted). ``model`` is a loaded ``PreTrainedModel``, an embedded pf-trl name
    (``pf-trl/tiny-llama``) or a local folder: pf-trl never downloads. ``processing_class`` defaults to the embedded
    tokenizer.
    """

    def __init__(self, model, args: PaddingFreeConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, **kwargs):
        if args is None:
            args = PaddingFreeConfig(output_dir="pf-trl-output")
        elif not isinstance(args, PaddingFreeConfig):
            values = {k: v for k, v in args.to_dict().items() if k in PaddingFreeConfig.__dataclass_fields__}
            values["padding_free"] = normalize_padding_free(values.get("padding_free", "huggingface"))
            args = PaddingFreeConfig(**values)
        if isinstance(model, str):
            from pf_trl.models import build_model

            model = build_model(model, seed=args.seed)
        if processing_class is None:
            from pf_trl.data.tokenizer import load_tokenizer

            processing_class = load_tokenizer()
        self.pf_mode = args.padding_free
        if self.pf_mode != "none":
            if data_collator is not None and not isinstance(data_collator, PaddingFreeCollator):
                raise ValueError(
                    f"padding_free={self.pf_mode!r} batches with PaddingFreeCollator; got a {type(data_collator).__name__}. "
                    "Pass no data_collator (or a PaddingFreeCollator), or use padding_free='none'."
                )
            from pf_trl.attention import enable_padding_free

            enable_padding_free(model, mode=self.pf_mode, backend=args.attention_backend)
            pad_id = processing_class.pad_token_id if processing_class.pad_token_id is not None else processing_class.eos_token_id
            data_collator = data_collator or PaddingFreeCollator(
                pad_to_multiple_of=args.pad_to_multiple_of, pad_token_id=int(pad_id or 0)
            )
            self._pf_collator = data_collator
            if _is_tokenized(train_dataset) and not (args.dataset_kwargs or {}).get("skip_prepare_dataset"):
                # pretokenized (pf-trl shards or input_ids/labels rows): TRL must not re-tokenize or re-truncate
                args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        # TRL reads `padding_free` as a bool (its own collator / max_length checks): hide our mode during its init
        saved = args.padding_free
        args.padding_free = False
        try:
            super().__init__(model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        finally:
            args.padding_free = saved
        if self.args.fsdp and not self.is_fsdp_enabled:
            # accelerate routes FSDP only on accelerator devices; elsewhere (e.g. CPU) it trains plain DDP silently
            logger.warning("pf-trl: fsdp was requested, but accelerate runs %s on this device: every rank holds the "
                           "whole model (plain data parallel), nothing is sharded", self.accelerator.distributed_type)
        self._pf_init_metrics()
        self._pf_train_sampler: TokenBudgetBatchSampler | None = None
        self._pf_resume_dir: str | None = None
        self.pf_token_budget: int | None = args.max_tokens_per_batch
        if self.pf_mode != "none":
            self.pf_loss_impl = resolve_fused_loss(args.fused_loss, self.args.device)
            if _has_logit_transform(self.model) and self.pf_loss_impl != "none":
                logger.warning("pf-trl: this model scales/softcaps its logits; using the plain cross-entropy path")
                self.pf_loss_impl = "none"
            unwrapped = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            install_pf_loss_forward(unwrapped, self.pf_loss_impl, args.loss_chunk_size)
            # our loss is always divided by num_items_in_batch over the accumulation window
            self.loss_is_scaled_for_ga = True

    # ------------------------------------------------------------------ data

    def _pf_sampler(self, dataset, budget: int | None, batch_size: int, *, shuffle: bool) -> TokenBudgetBatchSampler:
        lengths = _dataset_lengths(dataset)
        if budget is None:
            budget = derive_token_budget(lengths, batch_size)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        world = max(1, self.args.world_size)
        rank = self.args.process_index if world > 1 else 0
        return TokenBudgetBatchSampler(lengths, int(budget), shuffle=shuffle, seed=int(seed), num_replicas=world,
                                       rank=rank, drop_last=False)

    def _pf_dataloader(self, dataset, sampler, *, training: bool):
        from functools import partial

        from torch.utils.data import DataLoader
        from transformers.trainer_utils import seed_worker

        names = getattr(dataset, "column_names", None)
        if names:
            keep = [c for c in _MODEL_COLUMNS if c in names]
            if "input_ids" not in keep:
                raise ValueError(f"the dataset has no 'input_ids' column (columns: {names}); pretokenize it first")
            dataset = dataset.select_columns(keep)
        params: dict[str, Any] = dict(
            batch_sampler=sampler,
            collate_fn=_CountingCollator(self._pf_collator),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
        )
        if self.args.dataloader_num_workers > 0:
            params["prefetch_factor"] = self.args.dataloader_prefetch_factor
        if training:
            params["worker_init_fn"] = partial(seed_worker, num_workers=self.args.dataloader_num_workers,
                                               rank=self.args.process_index)
        loader = self.accelerator.prepare(DataLoader(dataset, **params))
        # our sampler is already rank-aware: make accelerate's BatchSamplerShard a passthrough
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes = 1
            shard.process_index = 0
        return loader

    def get_train_dataloader(self):
        if self.pf_mode == "none":
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        sampler = self._pf_sampler(self.train_dataset, self.args.max_tokens_per_batch,
                                   self.args.per_device_train_batch_size, shuffle=True)
        self.pf_token_budget = sampler.max_tokens
        if self.args.max_tokens_per_batch is None:
            logger.info("pf-trl: token budget %d = per_device_train_batch_size %d x mean length (min: longest example)",
                        sampler.max_tokens, self.args.per_device_train_batch_size)
        self._pf_train_sampler = sampler
        self._pf_restore_sampler(sampler)
        return self._pf_dataloader(self.train_dataset, sampler, training=True)

    def get_eval_dataloader(self, eval_dataset=None):
        if self.pf_mode == "none":
            return super().get_eval_dataloader(eval_dataset)
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        sampler = self._pf_sampler(eval_dataset, self.args.max_eval_tokens_per_batch,
                                   self.args.per_device_eval_batch_size, shuffle=False)
        return self._pf_dataloader(eval_dataset, sampler, training=False)

    # ------------------------------------------------------------------ loss

    def _get_num_items_in_batch(self, batch_samples, device):
        if self.pf_mode == "none":
            return super()._get_num_items_in_batch(batch_samples, device)
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        # shifted supervised labels of the whole accumulation window (a packed row's first label is -100 anyway)
        count = sum((b["labels"][..., 1:] != -100).sum() for b in batch_samples)
        count = torch.as_tensor(count, device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.pf_mode == "none":
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self._pf_observe(inputs)
        inputs = dict(inputs)
        inputs.pop("use_cache", None)
        if self.args.torch_compile:
            mark_dynamic_lengths(inputs)  # one general graph for all packed lengths (at most two compilations)
        out = model(**inputs, pf_loss=True)
        loss_sum, n_tok = out["loss_sum"], out["num_tokens"]
        if num_items_in_batch is None:
            loss = loss_sum / n_tok.clamp(min=1)
        else:
            loss = loss_sum / torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                loss = loss * self.accelerator.num_processes  # DDP averages gradients across ranks
        correct = int(out["correct"])
        if correct >= 0:
            self._pf_meter.add_accuracy(correct, int(n_tok)) if self.model.training else None
        if not self.model.training:
            self._pf_eval_add(loss_sum.detach(), int(n_tok))
        if return_outputs:
            with torch.no_grad():
                logits_inputs = {k: v for k, v in inputs.items() if k != "labels"}
                outputs = model(**logits_inputs, use_cache=False)
            return loss, outputs
        return loss

    # ------------------------------------------------------------------ epochs, checkpoints, resume

    def _run_epoch(self, *args, **kwargs):
        epoch = kwargs.get("epoch", args[1] if len(args) > 1 else None)
        if self._pf_train_sampler is not None and epoch is not None:
            self._pf_train_sampler.set_epoch(int(epoch))  # accelerate's skip wrapper does not forward set_epoch
        return super()._run_epoch(*args, **kwargs)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if resume_from_checkpoint is True or (isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() == "true"):
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True but no checkpoint found in {self.args.output_dir}")
        self._pf_resume_dir = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._pf_resume_dir = None

    def _pf_sampler_position(self) -> dict[str, int]:
        """Epoch and consumed batches implied by global_step, with Trainer's own resume arithmetic."""
        ga = self.args.gradient_accumulation_steps
        n = len(self._pf_train_sampler)
        per_epoch = max(n // ga + int(n % ga > 0), 1)
        step = self.state.global_step
        return {"epoch": step // per_epoch, "batches_yielded": min((step % per_epoch) * ga, n)}

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._pf_train_sampler is None or not self.args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if not os.path.isdir(folder):
            return
        pos = self._pf_sampler_position()
        sampler = self._pf_train_sampler
        state = {
            "sampler": {**sampler.state_dict(), **pos},
            "global_step": self.state.global_step,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "world_size": max(1, self.args.world_size),
            "max_tokens": sampler.max_tokens,
        }
        with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as f:
            json.dump(state, f, indent=2)

    def _pf_restore_sampler(self, sampler: TokenBudgetBatchSampler) -> None:
        if not self._pf_resume_dir:
            return
        path = os.path.join(self._pf_resume_dir, SAMPLER_STATE_NAME)
        if not os.path.isfile(path):
            logger.warning("pf-trl: %s has no %s; resuming with Trainer's skip only (epoch from global_step)",
                           self._pf_resume_dir, SAMPLER_STATE_NAME)
            return
        with open(path) as f:
            saved = json.load(f)
        ga = self.args.gradient_accumulation_steps
        if saved.get("gradient_accumulation_steps") != ga:
            raise ValueError(
                f"cannot resume from {self._pf_resume_dir}: it was trained with gradient_accumulation_steps="
                f"{saved.get('gradient_accumulation_steps')}, now {ga}; the same batches cannot be reproduced"
            )
        # validates lengths / budget / world size / seed (clear ValueError otherwise) and restores the epoch. The
        # position stays at 0: Trainer's skip_first_batches skips the consumed batches itself.
        sampler.load_state_dict({**saved["sampler"], "batches_yielded": 0})
        self._pf_resumed_state = saved


def _is_tokenized(dataset) -> bool:
    names = getattr(dataset, "column_names", None)
    return bool(names) and "input_ids" in names
