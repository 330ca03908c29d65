"""PaddingFreeSFTTrainer: TRL's SFTTrainer with token-budget batches, packed rows and an exact loss.

What changes against ``SFTTrainer`` (``padding_free_mode`` != ``"none"``, i.e. ``padding_free=True``):

- data: train and eval dataloaders batch with :class:`~pf_trl.sampler.TokenBudgetBatchSampler` (rank-aware: each
  rank gets disjoint, token-balanced batches and the same number of them) and collate with
  :class:`~pf_trl.collator.PaddingFreeCollator` (one ``[1, T]`` row, ``position_ids``, flash kwargs, no
  ``attention_mask``). Raw rows go through :mod:`pf_trl.data.sources` (the CLI's data path: same ids, same masks);
  TRL's ``completion_mask`` / ``assistant_masks`` columns become ``labels`` first, then columns are reduced to
  ``input_ids`` / ``labels`` before collation; ``position_ids`` and the flash kwargs are produced by the collator
  after that, so column removal cannot drop them.
- attention: :func:`pf_trl.attention.enable_padding_free` is applied to the model (self-checked; it also forces
  ``use_cache=False`` on packed inputs, so evaluation does not depend on the caller remembering it).
- loss: the model's own objective at the supervised positions only (:mod:`pf_trl.trainer.loss`; never the full
  ``[T, vocab]`` logits): its head transform (Granite ``logits_scaling``, Cohere ``logit_scale``, Gemma softcapping,
  checked at init against the model's own logits, else its own head via ``logits_to_keep``), adapters on the head,
  TRL's ``loss_type`` (``nll``/``dft``), ``label_smoothing_factor`` and ``compute_loss_func``, and the MoE
  load-balancing loss over the real tokens (logged as ``aux_loss``), combined exactly as TRL's padded
  ``compute_loss`` does. The token loss is divided by transformers' ``num_items_in_batch``: the count of shifted
  supervised labels over the whole accumulation window, summed over data-parallel ranks (and multiplied back by the
  world size, since DDP averages gradients). So the loss of an optimizer step is the mean over all its supervised
  tokens -- exactly what a padded run computes. ``neftune_noise_alpha`` is refused (its noise scales with the row).
- eval loss: token-weighted mean over all supervised tokens (transformers averages per-batch means; the padded
  mode of this trainer reports the token-weighted mean too, so the two are comparable).
- epochs: the sampler yields the same number of batches in every epoch (fixed once from the lengths), so Trainer's
  step count, taken from the first ``len()``, covers every example of every epoch exactly once.
- resume: the sampler state is written to each checkpoint (``pf_trl_sampler_state.json``, by
  :class:`~pf_trl.trainer.callbacks.SamplerStateCallback` in ``on_save``). On resume it is
  validated against the new sampler (same data lengths, budget, seed, world size) and its epoch restored;
  Trainer's own ``skip_first_batches`` then skips the consumed batches of that epoch (at the batch-sampler level:
  index lists only, no data is loaded). The sampler itself is *not* fast-forwarded, so nothing is skipped twice
  and nothing is replayed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from trl import SFTTrainer

from pf_trl.collator import PaddingFreeCollator, mark_dynamic_lengths
from pf_trl.data.vision import VISION_COLUMNS, VisionFeatures, image_column, text_tokenizer
from pf_trl.sampler import TokenBudgetBatchSampler
from pf_trl.parallel import check_parallelism
from pf_trl.sharding import full_shape
from pf_trl.trainer import sequence_parallel
from pf_trl.trainer.callbacks import SamplerStateCallback
from pf_trl.trainer.config import PaddingFreeConfig, to_padding_free_config
from pf_trl.trainer.data_identity import data_identity, describe_change
from pf_trl.trainer.fields import (
    apply_chat_template_path,
    apply_eos_token,
    hidden_from_trl,
    model_build_kwargs,
    say_mask_decisions,
    shuffle_once,
)
from pf_trl.trainer.loss import (
    aligned_supervised_positions,
    backbone_of,
    DEFAULT_CHUNK_SIZE,
    LOSS_TYPES,
    HeadPlan,
    objective_sum,
    plan_head,
    resolve_fused_loss,
    router_aux_loss,
    supervised_loss_terms,
    supervised_positions,
    terms_from_model_logits,
)
from pf_trl.trainer.metrics import REAL_TOKENS_KEY, TokenAccountingMixin

logger = logging.getLogger("pf_trl.trainer")

SAMPLER_STATE_NAME = "pf_trl_sampler_state.json"
_MODEL_COLUMNS = ("input_ids", "labels", *VISION_COLUMNS)


class _CountingCollator:
    """Wraps the padding-free collator: records the real token count (without a pad_to_multiple_of segment).
    ``prepare`` turns each row into model features first (a vision-language row's images -> pixel values)."""

    def __init__(self, inner: PaddingFreeCollator, prepare=None) -> None:
        self.inner = inner
        self.prepare = prepare

    def __call__(self, features):
        if self.prepare is not None:
            features = [self.prepare(f) for f in features]
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


@dataclass
class PFLossOptions:
    """What the ``pf_loss=True`` forward computes: the loss path (``impl``: chunked | none | liger), the token chunk of
    the ``module`` path, TRL's ``loss_type`` and the label smoothing factor."""

    impl: str = "chunked"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    loss_type: str = "nll"
    label_smoothing: float = 0.0


def install_pf_loss_forward(model: torch.nn.Module, impl: str = "chunked", chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                            options: PFLossOptions | None = None, probe: bool = True) -> HeadPlan:
    """Give ``model.forward`` a ``pf_loss=True`` path: backbone -> supervised positions -> the model's own objective.

    Returns the :class:`~pf_trl.trainer.loss.HeadPlan` (how the logits are reproduced). The patched forward returns
    ``{"loss_sum", "num_tokens", "correct", "aux_loss"}``: the sum over supervised tokens of the per-token objective,
    their count, top-1 hits, and the MoE load-balancing loss over the real tokens (``None`` unless the config sets
    ``output_router_logits``). Going through ``model.forward`` (not ``model.model``) keeps DDP/FSDP wrappers and
    ZeRO-3 hooks in the loop; other calls use the previous forward (generation is unchanged). ``model`` is the
    transformers model itself (PEFT's base model: adapters live inside its modules).
    """
    options = options or PFLossOptions(impl=impl, chunk_size=chunk_size)
    plan = plan_head(model, label_smoothing=options.label_smoothing, probe=probe)
    logger.info("pf-trl: loss path %s (%s)", plan.path, plan.reason)
    with_smooth = options.loss_type == "nll" and options.label_smoothing > 0
    text_config = model.config.get_text_config()
    vocab_size = int(getattr(text_config, "vocab_size", 0) or full_shape(model.get_output_embeddings().weight)[0])
    previous = model.forward
    backbone = backbone_of(model)

    @functools.wraps(type(model).forward)
    def forward(self, *args, pf_loss: bool = False, pf_real_tokens: int | None = None, **kwargs):
        if not pf_loss:
            return previous(*args, **kwargs)
        labels = kwargs.pop("labels", None)
        shift_labels = kwargs.pop("shift_labels", None)  # sequence parallel: targets already aligned (no shift)
        if (labels is None) == (shift_labels is None):
            raise ValueError("the pf_loss forward needs exactly one of labels / shift_labels")
        kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        if plan.path == "model":
            # the model's own head and post-processing, only at the supervised positions
            if shift_labels is not None:
                keep = shift_labels != -100
            else:
                keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
                keep[:, :-1] = labels[:, 1:] != -100
            out = previous(*args, logits_to_keep=keep, **kwargs)
        else:
            out = backbone(*args, **kwargs)
        return _objective(self, out, labels, plan, options, with_smooth=with_smooth, vocab_size=vocab_size,
                          with_router=bool(kwargs.get("output_router_logits")), pf_real_tokens=pf_real_tokens,
                          shift_labels=shift_labels)

    model.forward = types.MethodType(forward, model)
    return plan


def check_loss_options(args) -> None:
    """Refuse the combinations of SFTTrainer loss options pf-trl cannot reproduce on packed rows, naming each (single
    fields are refused by :func:`pf_trl.trainer.parity.check_config`)."""
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported with padding_free (supported: {', '.join(LOSS_TYPES)})")
    if loss_type == "dft" and getattr(args, "label_smoothing_factor", 0.0) > 0:
        raise ValueError(
            "label_smoothing_factor with loss_type='dft': TRL applies no smoothing to the DFT loss (it would be ignored "
            "in silence). Set label_smoothing_factor=0 or loss_type='nll'."
        )
    liger_config = getattr(args, "liger_kernel_config", None) or {}
    if getattr(args, "use_liger_kernel", False) and args.fused_loss not in ("auto", "liger"):
        raise ValueError(f"use_liger_kernel=True asks for Liger's fused cross-entropy, but fused_loss={args.fused_loss!r}")
    if liger_config.get("fused_linear_cross_entropy"):
        raise ValueError('liger_kernel_config={"fused_linear_cross_entropy": True} replaces the model forward; use '
                         "fused_loss='liger' for Liger's fused cross-entropy on the supervised positions")


@torch.compiler.disable(reason="data-dependent gather of supervised positions and a chunk loop over them")
def _objective(model, out, labels, plan: HeadPlan, options: PFLossOptions, *, with_smooth: bool, vocab_size: int,
               with_router: bool, pf_real_tokens: int | None, shift_labels=None) -> dict[str, Any]:
    """The objective after the backbone (or the model's own head): runs eagerly under torch.compile (one intended
    graph break after the backbone), since the number of supervised tokens changes every step and a traced gather +
    chunk loop would recompile each step."""
    if shift_labels is not None:
        index, targets = aligned_supervised_positions(shift_labels)
        labels = shift_labels
    else:
        index, targets = supervised_positions(labels)
    if plan.path == "model":
        terms = terms_from_model_logits(out.logits, targets.to(out.logits.device), with_smooth=with_smooth)
    else:
        head = model.get_output_embeddings()
        hidden = out.last_hidden_state
        device = head.weight.device
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.to(hidden.device)).to(device)
        terms = supervised_loss_terms(head, selected, targets.to(device), plan, impl=options.impl,
                                      chunk_size=options.chunk_size, with_smooth=with_smooth)
    router_logits = getattr(out, "router_logits", None)
    loss_sum = objective_sum(terms, loss_type=options.loss_type, label_smoothing=options.label_smoothing,
                             vocab_size=vocab_size)
    aux = None
    if with_router and router_logits is not None and len(router_logits) > 0:  # no MoE layer: no aux loss
        aux = router_aux_loss(model, router_logits, pf_real_tokens, labels.shape[-1])
    correct = terms.top1.sum() if options.impl != "liger" else torch.full((), -1, dtype=torch.int64)
    return {"loss_sum": loss_sum, "num_tokens": targets.new_tensor(targets.numel()), "correct": correct,
            "aux_loss": aux}


class PaddingFreeSFTTrainer(TokenAccountingMixin, SFTTrainer):
    """``SFTTrainer`` that trains on padding-free, token-budget batches with the exact padded loss.

    Args are those of ``SFTTrainer``; ``args`` should be a :class:`PaddingFreeConfig` (a plain ``SFTConfig`` or
    ``TrainingArguments`` is converted). ``model`` is a loaded ``PreTrainedModel``, an embedded pf-trl name
    (``pf-trl/tiny-llama``) or a local folder: pf-trl never downloads. ``processing_class`` defaults to the model
    folder's tokenizer (the embedded one for embedded / in-memory models) and must fit the model's embeddings.
    ``train_dataset`` / ``eval_dataset`` may be shards, raw rows in any format of ``docs/data.md``, a path or a
    ``DatasetDict``, a data config (``"mix.yaml"``, a list of ``(path, weight)``: a mixture) or a
    ``datasets.IterableDataset`` (a stream; see :mod:`pf_trl.trainer.data_inputs`); ``pretokenize_config`` (:class:`~pf_trl.data.pretokenize.PretokenizeConfig`) sets the data
    options the trainer config does not carry (response template, field names, format).
    """

    def __init__(self, model, args: PaddingFreeConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, pretokenize_config=None, **kwargs):
        if args is None:
            args = PaddingFreeConfig(output_dir="pf-trl-output")
        elif not isinstance(args, PaddingFreeConfig):
            args = to_padding_free_config(args)  # field by field (to_dict() masks *_token fields)
        if args.padding_free_mode != "none":
            from pf_trl.trainer.parity import check_config  # (imported here: `python -m` runs that module)

            check_config(args)  # every SFTConfig / TrainingArguments value pf-trl cannot reproduce, by name
        processing_class = _pf_resolve_tokenizer(model, processing_class)
        if pretokenize_config is not None and getattr(pretokenize_config, "chat_template", None):
            from pf_trl.data.tokenizer import with_chat_template

            # the data's template is the model's: the fingerprints agree and the saved tokenizer carries it
            processing_class = with_chat_template(processing_class, pretokenize_config.chat_template)
        apply_chat_template_path(args, processing_class)
        apply_eos_token(args, processing_class)
        if isinstance(model, str):
            from pf_trl.models import build_model

            model = build_model(model, seed=args.seed, **model_build_kwargs(args))
        # every parallelism setting pf-trl cannot keep exact, refused before any data is prepared (every mode)
        check_parallelism(args, _transformers_model(model), compute_loss_func=kwargs.get("compute_loss_func"))
        if kwargs.get("formatting_func") is None:  # a formatting_func makes text rows: TRL applies it and tokenizes
            prepare = functools.partial(_pf_prepare_dataset, tokenizer=processing_class, model=model, args=args,
                                        pretokenize_config=pretokenize_config)
            train_dataset = prepare(train_dataset, what="training")
            if isinstance(eval_dataset, dict):
                eval_dataset = {k: prepare(v, what=f"evaluation {k}") for k, v in eval_dataset.items()}
            else:
                eval_dataset = prepare(eval_dataset, what="evaluation")
            if args.padding_free_mode != "none":  # padded: TRL's own preparation shuffles
                train_dataset = shuffle_once(train_dataset, args)
                eval_dataset = ({k: shuffle_once(v, args) for k, v in eval_dataset.items()}
                                if isinstance(eval_dataset, dict) else shuffle_once(eval_dataset, args))
        from pf_trl.data.streaming import TokenizedStream

        pf_stream = train_dataset if isinstance(train_dataset, TokenizedStream) else None
        if pf_stream is not None:
            train_dataset = pf_stream.dataset  # Trainer sees the stream (no length: max_steps); the packer reads it
        self.pf_mode = args.padding_free_mode
        if self.pf_mode != "none":
            if data_collator is not None and not isinstance(data_collator, PaddingFreeCollator):
                raise ValueError(
                    f"padding_free_mode={self.pf_mode!r} batches with PaddingFreeCollator; got a "
                    f"{type(data_collator).__name__}. Pass no data_collator (or a PaddingFreeCollator), or use "
                    "padding_free=False (TRL's padded path)."
                )
            from pf_trl.attention import enable_padding_free

            check_loss_options(args)
            # a PeftModel: make its transformers model padding-free (the adapters live inside its modules)
            enable_padding_free(_transformers_model(model), mode=self.pf_mode, backend=args.attention_backend,
                                allow_unverified=args.allow_unverified)
            from pf_trl.attention import multimodal
            from pf_trl.attention.mrope import rope_index_function

            multimodal.check_training_data(_transformers_model(model), self.pf_mode, train_dataset, eval_dataset)
            tokenizer = text_tokenizer(processing_class)
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            data_collator = data_collator or PaddingFreeCollator(
                pad_to_multiple_of=sequence_parallel.collator_multiple(args.pad_to_multiple_of,
                                                                       args.sequence_parallel_size),
                pad_token_id=int(pad_id or 0),
                rope_index=rope_index_function(_transformers_model(model)),  # mRoPE: per-example positions
            )
            self._pf_collator = data_collator
        # TRL would act on padding_free=True (its own collator, its max_length check), checks assistant_only_loss
        # against raw rows and would prepare (re-truncate, re-shuffle) the rows pf-trl has prepared: hidden during its
        # init (see hidden_from_trl)
        tokenized = _is_tokenized(train_dataset)
        with hidden_from_trl(args, active=tokenized, skip_prepare=tokenized and self.pf_mode != "none"), \
                _admit_head_adapters(self.pf_mode != "none"):
            super().__init__(model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        if self.args.fsdp and not self.is_fsdp_enabled:
            # accelerate routes FSDP only on accelerator devices; elsewhere (e.g. CPU) it trains plain DDP silently
            logger.warning("pf-trl: fsdp was requested, but accelerate runs %s on this device: every rank holds the "
                           "whole model (plain data parallel), nothing is sharded", self.accelerator.distributed_type)
        self._pf_pretokenize_options = pretokenize_config
        self._pf_init_metrics()
        self.add_callback(SamplerStateCallback(self))
        self._pf_train_sampler: TokenBudgetBatchSampler | None = None
        self._pf_resume_dir: str | None = None
        self._pf_stream, self._pf_packer = pf_stream, None  # a streamed train set and its packer (data_inputs)
        self.pf_token_budget: int | None = args.max_tokens_per_batch
        self._pf_sp = None  # this rank's sequence-parallel group (sequence_parallel_size > 1)
        if self.pf_mode != "none":
            self.pf_loss_impl = resolve_fused_loss(args.fused_loss, self.args.device,
                                                   use_liger_kernel=bool(args.use_liger_kernel))
            smoothing = float(args.label_smoothing_factor) if self.label_smoother is not None else 0.0
            options = PFLossOptions(impl=self.pf_loss_impl, chunk_size=args.loss_chunk_size, loss_type=args.loss_type,
                                    label_smoothing=smoothing)
            self.pf_head_plan = install_pf_loss_forward(_transformers_model(self.model), options=options)
            self._pf_sp = sequence_parallel.setup(_transformers_model(self.model), args.sequence_parallel_size)
            # our loss is always divided by num_items_in_batch over the accumulation window
            self.loss_is_scaled_for_ga = True

    # ------------------------------------------------------------------ data

    def _pf_sampler(self, dataset, budget: int | None, batch_size: int, *, shuffle: bool,
                    ordered: bool = False) -> TokenBudgetBatchSampler:
        lengths = _dataset_lengths(dataset)
        if budget is None:
            budget = derive_token_budget(lengths, batch_size)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        world = max(1, self.args.world_size)
        rank = self.args.process_index if world > 1 else 0
        world, rank = sequence_parallel.sampler_topology(self._pf_sp, world, rank)
        from pf_trl.attention.row_limits import check_packed_rows

        check_packed_rows(_transformers_model(self.model), int(budget))  # before the first step (Llama 4)
        if shuffle:  # a mixture draws each epoch's rows by its weights
            from pf_trl.trainer import data_inputs

            mixed = data_inputs.mixture_sampler(dataset, lengths, int(budget), seed=int(seed), args=self.args,
                                                 topology=(world, rank))
            if mixed is not None:
                return mixed
        return TokenBudgetBatchSampler(lengths, int(budget), shuffle=shuffle, seed=int(seed), num_replicas=world,
                                       rank=rank, drop_last=False, ordered=ordered)

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
            collate_fn=_CountingCollator(self._pf_collator, prepare=VisionFeatures(self.processing_class)
                                         if names and "images" in names else None),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
            in_order=self.args.dataloader_in_order,
        )
        if self.args.dataloader_num_workers > 0:
            params["prefetch_factor"] = self.args.dataloader_prefetch_factor
            params["multiprocessing_context"] = self.args.dataloader_multiprocessing_context
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
        from pf_trl.trainer import data_inputs

        if self._pf_stream is not None:
            return data_inputs.stream_dataloader(self, _CountingCollator(self._pf_collator))
        # train_sampling_strategy: 'sequential' packs and yields in dataset order (group_by_length / batch_rebalance
        # only cut padding: warned at construction, see parity.py)
        sequential = {"ordered": True} if self.args.train_sampling_strategy == "sequential" else {}
        sampler = self._pf_sampler(self.train_dataset, self.args.max_tokens_per_batch,
                                   self.args.per_device_train_batch_size, shuffle=not sequential, **sequential)
        data_inputs.apply_partial_epoch(self.args, sampler)
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
        elif not self._pf_is_prepared(eval_dataset):
            eval_dataset = self._pf_prepare_passed(eval_dataset)
        sampler = self._pf_sampler(eval_dataset, self.args.max_eval_tokens_per_batch,
                                   self.args.per_device_eval_batch_size, shuffle=False)
        return self._pf_dataloader(eval_dataset, sampler, training=False)

    def _pf_is_prepared(self, dataset) -> bool:
        known = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        return any(dataset is d for d in known)

    def _pf_prepare_passed(self, dataset):
        """A dataset passed to ``evaluate()`` goes through the data path of ``__init__`` (tokenized, cut to
        ``max_length``), as TRL's ``evaluate`` prepares it; prepared once per dataset object."""
        cached = getattr(self, "_pf_passed_eval", None)
        if cached is not None and cached[0] is dataset:
            return cached[1]
        prepared = _pf_prepare_dataset(dataset, tokenizer=self.processing_class, model=_transformers_model(self.model),
                                       args=self.args, pretokenize_config=self._pf_pretokenize_options,
                                       what="evaluation")
        self._pf_passed_eval = (dataset, prepared)
        return prepared

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
        return sequence_parallel.global_token_count(count, self._pf_sp)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.pf_mode == "none":
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        real = inputs.get(REAL_TOKENS_KEY)
        if self._pf_sp is not None and self._pf_sp.rank:
            inputs = dict(inputs)  # the group's first rank counts the row's tokens, once per group
            inputs.pop(REAL_TOKENS_KEY, None)
            self._pf_meter.last_real = 0
        else:
            self._pf_observe(inputs)
        inputs = dict(inputs)
        inputs.pop("use_cache", None)
        if self._pf_sp is not None:
            inputs = sequence_parallel.shard_inputs(inputs, self._pf_sp, self.args.device)
        if self.compute_loss_func is not None:
            return self._pf_custom_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.args.torch_compile:
            mark_dynamic_lengths(inputs)  # one general graph for all packed lengths (at most two compilations)
        out = model(**inputs, pf_loss=True, pf_real_tokens=None if real is None else int(real))
        loss_sum, n_tok = out["loss_sum"], out["num_tokens"]
        loss = loss_sum / self._pf_divisor(num_items_in_batch, n_tok, loss_sum.device)
        aux = out.get("aux_loss")
        if aux is not None and self.aux_loss_enabled:
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux.detach()).mean().item())
            # as TRL's padded loss: a per-micro-batch mean (averaged over the accumulation steps when the CE is
            # normalized by num_items_in_batch), and not added on the label-smoothing path, where TRL drops it too
            if self.label_smoother is None:
                steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device) / steps
        correct = int(out["correct"])
        if correct >= 0 and self.model.training:
            self._pf_meter.add_accuracy(correct, int(n_tok))
        if not self.model.training:
            extra = self.router_aux_loss_coef * aux.detach() * n_tok if aux is not None and self.aux_loss_enabled else 0
            self._pf_eval_add(loss_sum.detach() + extra, int(n_tok))
        if return_outputs:
            with torch.no_grad():
                logits_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
                outputs = model(**logits_inputs, use_cache=False)
            return loss, outputs
        return loss

    def _pf_divisor(self, num_items_in_batch, n_tok, device) -> torch.Tensor:
        """The loss divisor: the step's supervised tokens (all ranks, divided by the world size since DDP averages
        gradients), or this micro-batch's when transformers passes none."""
        if num_items_in_batch is None:
            return n_tok.to(device).clamp(min=1)
        divisor = torch.as_tensor(num_items_in_batch, device=device).clamp(min=1)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            divisor = divisor / self.accelerator.num_processes
        return divisor

    def _pf_custom_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """``compute_loss_func`` as TRL calls it: the model's own outputs (full logits of the packed ``[1, T]`` row,
        position_ids restarting per example) and the row's labels (-100 at each example's first token)."""
        labels = inputs["labels"]
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
        loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes
        if not self.model.training:
            n_tok = int((labels[:, 1:] != -100).sum())
            self._pf_eval_add(loss.detach().float() * n_tok, n_tok)
        return (loss, outputs) if return_outputs else loss

    # ------------------------------------------------------------------ epochs, checkpoints, resume

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """``Trainer.save_model`` without transformers' "Writing model shards" bar (one bar per save, checkpoints
        included, each a fraction of a second: noise in the log; the CLI prints one line where the model went)."""
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            return super().save_model(output_dir, _internal_call)
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None):
        """pf-trl's card (:mod:`pf_trl.trainer.model_card`): names the base model as it was given (local folder,
        embedded config or Hub id) and the training data, where TRL's card writes ``None`` for a local folder."""
        if not self.is_world_process_zero():
            return
        from pf_trl.trainer.model_card import write_model_card

        extra = [tags] if isinstance(tags, str) else list(tags or [])
        write_model_card(self, model_name=model_name, tags=[*extra, *getattr(self, "_tag_names", [])])

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """transformers warns about every key missing from a checkpoint, including a head tied to the embeddings (a
        checkpoint stores a tied tensor once): "missing keys ['lm_head.weight']" reads as damage. Keys whose parameter
        is the very tensor of a loaded one are dropped from the warning; any other missing key is still reported.
        (Private upstream hook; see docs/training.md.)"""
        missing = list(getattr(load_result, "missing_keys", []) or [])
        if missing:
            untied = _untied_missing_keys(self.model, missing)
            if len(untied) != len(missing):
                load_result = type(load_result)(untied, list(load_result.unexpected_keys))
        return super()._issue_warnings_after_load(load_result)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if trial is None:  # a hyperparameter search trains each trial in its own folder
            from pf_trl.trainer.output_dir import check_output_dir, remove_checkpoints

            stale = check_output_dir(self.args.output_dir, resume_from_checkpoint=resume_from_checkpoint,
                                     overwrite_output_dir=self.args.overwrite_output_dir)
            if stale and self.is_world_process_zero():
                remove_checkpoints(stale)
                print(f"pf-trl: overwrite_output_dir: removed {len(stale)} checkpoint(s) of an earlier run from "
                      f"{self.args.output_dir}", flush=True)
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
            if hasattr(self, "_pf_saved_ignore_data_skip"):  # set while a stream resumed from its saved position
                self.args.ignore_data_skip = self._pf_saved_ignore_data_skip
                del self._pf_saved_ignore_data_skip

    def _pf_sampler_position(self) -> dict[str, int]:
        """Epoch and consumed batches implied by global_step, with Trainer's own resume arithmetic."""
        ga = self.args.gradient_accumulation_steps
        n = len(self._pf_train_sampler)
        per_epoch = max(n // ga + int(n % ga > 0), 1)
        step = self.state.global_step
        return {"epoch": step // per_epoch, "batches_yielded": min((step % per_epoch) * ga, n)}

    def _pf_write_sampler_state(self, folder: str) -> None:
        """Write the train sampler's position into checkpoint ``folder`` (called by :class:`SamplerStateCallback`)."""
        if self._pf_packer is not None:
            from pf_trl.trainer.data_inputs import write_stream_state

            return write_stream_state(self, folder)  # every rank: each reads its own part of the stream
        if self._pf_train_sampler is None or not self.args.should_save or not os.path.isdir(folder):
            return
        pos = self._pf_sampler_position()
        sampler = self._pf_train_sampler
        state = {
            "sampler": {**sampler.state_dict(), **pos},
            "data": self._pf_data_identity(),
            "global_step": self.state.global_step,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "world_size": max(1, self.args.world_size),
            "max_tokens": sampler.max_tokens,
        }
        with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as f:
            json.dump(state, f, indent=2)

    def _pf_data_identity(self) -> dict[str, Any]:
        """Examples, tokens and content digest of the train dataset (once per run; see data_identity.py)."""
        cached = getattr(self, "_pf_identity_cache", None)
        if cached is None or cached[0] is not self.train_dataset:
            cached = (self.train_dataset, data_identity(self.train_dataset))
            self._pf_identity_cache = cached
        return cached[1]

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
        change = describe_change(saved.get("data") or {}, self._pf_data_identity())
        if change:
            raise ValueError(f"cannot resume from {self._pf_resume_dir}: the training data is incompatible with the "
                             f"checkpoint's: {change}; resume with the data it was trained on, or start a new run")
        # validates lengths / budget / world size / seed (clear ValueError otherwise) and restores the epoch. The
        # position stays at 0: Trainer's skip_first_batches skips the consumed batches itself.
        sampler.load_state_dict({**saved["sampler"], "batches_yielded": 0})
        self._pf_resumed_state = saved
        if self.is_world_process_zero():
            pos = saved["sampler"]
            print(f"pf-trl: resuming from {self._pf_resume_dir}: step {saved.get('global_step')}, epoch "
                  f"{pos.get('epoch', 0) + 1}, after batch {pos.get('batches_yielded', 0)} of {len(sampler)} "
                  "(those batches are skipped, not replayed)", flush=True)


# ---------------------------------------------------------------------- data preparation (pf_trl.data.sources)


def _pf_resolve_tokenizer(model, processing_class):
    """``processing_class`` or the model's own tokenizer (folder), the embedded one for embedded/in-memory models
    (same rules as ``pf-trl train``). Its vocabulary is checked against the model where data is tokenized with it
    (:func:`_pf_prepare_dataset`); tokenized rows have their ids checked instead."""
    from pf_trl.data.tokenizer import resolve_tokenizer

    if processing_class is not None and not hasattr(processing_class, "backend_tokenizer") and not isinstance(
        processing_class, str
    ):
        return processing_class  # a processor (multimodal): not pf-trl's to check
    return resolve_tokenizer(model, processing_class, check_vocab=False)


def _pf_pretokenize_config(args, pretokenize_config):
    """The data options: the caller's :class:`PretokenizeConfig`, else derived from the trainer config."""
    from pf_trl.data.pretokenize import PretokenizeConfig

    if pretokenize_config is not None:
        return pretokenize_config
    from pf_trl.trainer.sequence_limit import pretokenize_limits

    return PretokenizeConfig(
        text_field=args.dataset_text_field or "text",
        completion_only_loss=args.completion_only_loss is not False,
        assistant_only_loss=args.assistant_only_loss is not False,
        **pretokenize_limits(args),  # max_length, truncation_mode, the truncation policy: as TRL, see sequence_limit
    )


def _pf_prepare_dataset(dataset, *, tokenizer, model, args, pretokenize_config, what: str):
    """Raw rows (or a path) -> pf-trl shards through the same data path as ``pf-trl train`` (the tokenizer must fit
    the model's embeddings); tokenized rows keep their ids (checked against the embeddings), with TRL's
    ``completion_mask`` / ``assistant_masks`` folded into ``labels`` before any column is dropped."""
    if dataset is None:
        return dataset
    from pf_trl.trainer import data_inputs

    config = _pf_pretokenize_config(args, pretokenize_config)
    dataset, done = data_inputs.prepare(dataset, tokenizer=tokenizer, args=args, config=config, what=what,
                                         model=model)
    if not done:
        dataset = _pf_prepare_rows(dataset, tokenizer=tokenizer, model=model, args=args, config=config, what=what)
    return data_inputs.finish(dataset, tokenizer=tokenizer, args=args, what=what)


def _pf_prepare_rows(dataset, *, tokenizer, model, args, config, what: str):
    """One source: raw rows or a path through pf-trl's data path, tokenized rows as they are."""
    from pf_trl.data import sources
    from pf_trl.data.tokenizer import check_vocab_fits, model_vocab_size

    vocab = model_vocab_size(model)
    made_with = (getattr(dataset, "pf_manifest", None) or {}).get("tokenizer", {}).get("vocab_size")
    if _is_tokenized(dataset) and hasattr(dataset, "data") and not (made_with and vocab and made_with <= vocab):
        sources.check_token_ids(dataset, vocab)  # shards made with a tokenizer that fits need no scan
    if (args.dataset_kwargs or {}).get("skip_prepare_dataset") and not _has_masks(dataset):
        return dataset
    from pf_trl.trainer.sequence_limit import apply_sequence_limit, log_manifest_truncation

    if isinstance(dataset, (str, os.PathLike)) or (hasattr(dataset, "column_names") and not _is_tokenized(dataset)):
        import datasets

        if isinstance(dataset, datasets.IterableDataset):
            return dataset  # streamed rows: left to TRL
        if args.padding_free == "none" and image_column(getattr(dataset, "column_names", None) or []):
            return dataset  # padded vision-language rows: TRL's own collator processes them on the fly
        check_vocab_fits(tokenizer, vocab)
        try:
            dataset = sources.load_training_data(dataset, tokenizer, config, num_proc=args.dataset_num_proc or 1,
                                                 progress=False, say=lambda msg: logger.info("pf-trl: %s", msg),
                                                 what=what)
        except sources.DataSourceError as exc:
            raise ValueError(str(exc)) from exc
        log_manifest_truncation(dataset, what=f"{what} data")  # cut while tokenizing: say so
        say_mask_decisions(dataset, args, what=f"{what} data")
    else:
        say_mask_decisions(dataset, args, what=f"{what} data",
                           had_completion_mask="completion_mask" in sources.mask_columns_present(dataset))
        if _has_masks(dataset):
            dataset = sources.fold_mask_columns(dataset, completion_only_loss=args.completion_only_loss)
    # TRL's max_length / truncation_mode on tokenized rows and shards (labels are final by now, as in TRL)
    from pf_trl.data.mixture import mixture_of

    mixed = mixture_of(dataset) is not None
    limited = apply_sequence_limit(dataset, args, what=f"{what} data")[0]
    if mixed and mixture_of(limited) is None:  # rows dropped: the mixture's per-source row ranges no longer hold
        raise ValueError(f"{what} data: max_length {args.max_length} with truncation={args.truncation!r} removes rows "
                         "of a dataset mixture, whose sources are recorded as row ranges; tokenize the data config "
                         "with the same limit (--max_seq_len) or use truncation='truncate'")
    return limited


def _has_masks(dataset) -> bool:
    from pf_trl.data.sources import mask_columns_present

    return bool(mask_columns_present(dataset))


@contextlib.contextmanager
def _admit_head_adapters(active: bool):
    """Let SFTTrainer accept a PEFT adapter on ``lm_head`` while it initializes (pf-trl modes only).

    TRL refuses one because its fused head reads ``lm_head.weight`` and would bypass the adapter; pf-trl's loss calls
    the adapted head module itself (the ``module`` path), so the adapter trains. TRL's check is an ``isinstance``
    against ``BaseTunerLayer`` in its module: it is pointed at a class nothing is an instance of, for the duration of
    ``SFTTrainer.__init__`` only. The padded mode (``padding_free=False``) keeps TRL's refusal.
    """
    import trl.trainer.sft_trainer as sft_module

    if not active or not hasattr(sft_module, "BaseTunerLayer"):
        yield
        return
    original = sft_module.BaseTunerLayer
    sft_module.BaseTunerLayer = type("_NoHeadAdapterCheck", (), {})
    try:
        yield
    finally:
        sft_module.BaseTunerLayer = original


def _untied_missing_keys(model, missing: list[str]) -> list[str]:
    """The missing checkpoint keys whose parameter is not shared with a parameter that was loaded (tied weights share
    one tensor: loading its other name filled it)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(p) for name, p in params.items() if name not in missing}
    return [key for key in missing if key not in params or id(params[key]) not in loaded]


def _transformers_model(model):
    """The transformers model inside a PEFT wrapper (adapters are injected into its modules), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _is_tokenized(dataset) -> bool:
    names = getattr(dataset, "column_names", None)
    return bool(names) and "input_ids" in names
