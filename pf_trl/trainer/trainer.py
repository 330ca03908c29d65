"""PaddingFreeSFTTrainer: TRL's SFTTrainer with token-budget batches, packed rows and an exact loss.

What changes against ``SFTTrainer`` (``padding_free_mode`` != ``"none"``, i.e. ``padding_free=True``):

- data: train and eval dataloaders batch with :class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` (rank-aware: each
  rank gets disjoint, token-balanced batches and the same number of them) and collate with
  :class:`~pf_trl.batching.collator.PaddingFreeCollator` (one ``[1, T]`` row, ``position_ids``, flash kwargs, no
  ``attention_mask``). Data of any kind goes through :func:`pf_trl.data.prepare.prepare_dataset` (the CLI's data
  path: same ids, same masks).
- attention: :func:`pf_trl.attention.enable_padding_free` is applied to the model (self-checked; it also forces
  ``use_cache=False`` on packed inputs, so evaluation does not depend on the caller remembering it).
- loss: the model's own objective at the supervised positions only, behind the model's forward
  (:func:`pf_trl.trainer.loss.install_pf_loss_forward`; never the full ``[T, vocab]`` logits), divided by
  transformers' ``num_items_in_batch`` (the shifted supervised labels of the whole accumulation window, summed over
  data-parallel ranks and multiplied back by the world size, since DDP averages gradients): the loss of an optimizer
  step is the mean over all its supervised tokens, exactly what a padded run computes. ``neftune_noise_alpha`` is
  refused (its noise scales with the row).
- eval loss: token-weighted mean over all supervised tokens (the padded mode of this trainer reports it too).
- epochs: the sampler yields the same number of batches in every epoch (fixed once from the lengths), so Trainer's
  step count, taken from the first ``len()``, covers every example of every epoch exactly once.
- resume: the sampler state in each checkpoint, checked and restored on resume (:mod:`pf_trl.trainer.resume`); a
  completion marker written last, ``resume_from_checkpoint="auto"`` (:mod:`pf_trl.trainer.checkpoints`); every rank
  sees the same ``output_dir`` (:mod:`pf_trl.trainer.shared_output`).

This module orchestrates: data preparation is :func:`pf_trl.data.prepare.prepare_dataset`, batching
:mod:`pf_trl.trainer.data_inputs`, the loss :mod:`pf_trl.trainer.loss`, the parallelism checks
:func:`pf_trl.parallel.check_parallelism`, the metrics :mod:`pf_trl.trainer.accounting`.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from trl import SFTTrainer

from pf_trl.batching.collator import PaddingFreeCollator, mark_dynamic_lengths
from pf_trl.data.prepare import is_tokenized, prepare_dataset, prepare_train_and_eval, resolve_processing_class
from pf_trl.data.vision import text_tokenizer
from pf_trl.errors import ConfigError, TrainingDataError
from pf_trl.batching.packing import count_targets
from pf_trl.parallel import check_parallelism
from pf_trl.batching.sampler import TokenBudgetBatchSampler
from pf_trl.trainer import data_inputs, sequence_parallel, trl_metrics
from pf_trl.trainer.accounting import TokenAccountingMixin
from pf_trl.trainer.adapters import transformers_model
from pf_trl.trainer.config import PaddingFreeConfig, to_padding_free_config
from pf_trl.trainer.ga_scaling import declare_loss_scaled_for_ga, restore_compute_loss_func
from pf_trl.trainer.fields import (
    admit_head_adapters,
    apply_chat_template_path,
    apply_eos_token,
    hidden_from_trl,
    model_build_kwargs,
)
from pf_trl.trainer.loss import (
    PFLossOptions,
    check_loss_options,
    custom_loss,
    install_pf_loss_forward,
    loss_divisor,
    resolve_fused_loss,
)
from pf_trl.trainer.metrics import REAL_TOKENS_KEY
from pf_trl.trainer.predict import EXAMPLES_KEY
from pf_trl.trainer.resume import (
    CheckpointCompleteCallback,
    SamplerStateCallback,
    resolve_resume,
    restore_sampler,
    resume_dir_for_call,
)

logger = logging.getLogger("pf_trl.trainer")


class PaddingFreeSFTTrainer(TokenAccountingMixin, SFTTrainer):
    """``SFTTrainer`` that trains on padding-free, token-budget batches with the exact padded loss.

    Args are those of ``SFTTrainer``; ``args`` should be a :class:`PaddingFreeConfig` (a plain ``SFTConfig`` or
    ``TrainingArguments`` is converted). ``model`` is a loaded ``PreTrainedModel``, an embedded pf-trl name
    (``pf-trl/tiny-llama``), a local folder or a Hugging Face Hub id (``ORG/NAME``; ``model_init_kwargs={"revision":
    ...}`` pins a revision), downloaded by huggingface_hub. ``processing_class`` defaults to the model's tokenizer (the
    embedded one for embedded / in-memory models) and must fit the model's embeddings.
    ``train_dataset`` / ``eval_dataset`` may be shards, raw rows in any format of ``docs/data.md``, a path, a Hub
    dataset id (its ``train`` split; the ``test`` split for ``eval_dataset``) or a ``DatasetDict``, a data config (``"mix.yaml"``, a list of ``(path, weight)``: a mixture) or a
    ``datasets.IterableDataset`` (a stream; see :mod:`pf_trl.data.inputs`); ``pretokenize_config``
    (:class:`~pf_trl.data.pretokenize.PretokenizeConfig`) sets the data options the trainer config does not carry
    (response template, field names, format).
    """

    def __init__(self, model, args: PaddingFreeConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, pretokenize_config=None, **kwargs):
        from pf_trl._quiet import start_run

        start_run()  # each warning once per run, on rank 0; no DeepSpeed banner unless DeepSpeed is used
        if args is None:
            args = PaddingFreeConfig(output_dir="pf-trl-output")
        elif not isinstance(args, PaddingFreeConfig):
            args = to_padding_free_config(args)  # field by field (to_dict() masks *_token fields)
        if args.padding_free_mode != "none":
            from pf_trl.trainer.parity import check_config  # (imported here: `python -m` runs that module)

            check_config(args)  # every SFTConfig / TrainingArguments value pf-trl cannot reproduce, by name
        build_kwargs = model_build_kwargs(args)
        trust = build_kwargs["trust_remote_code"]
        if isinstance(model, str):  # a Hub id: its snapshot folder, read as a local folder from here on
            from pf_trl.models import resolve_model_path

            # custom code without trust_remote_code is refused here, before a Hub id's weights are downloaded
            model = resolve_model_path(model, revision=build_kwargs.get("revision"), flag="model",
                                       trust_remote_code=trust)
        processing_class = resolve_processing_class(model, processing_class, trust_remote_code=trust)
        if pretokenize_config is not None and getattr(pretokenize_config, "chat_template", None):
            from pf_trl.data.tokenizer import with_chat_template

            # the data's template is the model's: the fingerprints agree and the saved tokenizer carries it
            processing_class = with_chat_template(processing_class, pretokenize_config.chat_template)
        apply_chat_template_path(args, processing_class)
        apply_eos_token(args, processing_class)
        if isinstance(model, str):
            from pf_trl.models import build_model

            model = build_model(model, seed=args.seed, **{k: v for k, v in build_kwargs.items() if k != "revision"})
        # every parallelism setting pf-trl cannot keep exact, refused before any data is prepared (every mode)
        check_parallelism(args, transformers_model(model), compute_loss_func=kwargs.get("compute_loss_func"))
        if kwargs.get("formatting_func") is None:  # a formatting_func makes text rows: TRL applies it and tokenizes
            train_dataset, eval_dataset = prepare_train_and_eval(train_dataset, eval_dataset, tokenizer=processing_class,
                                                                 model=model, args=args, options=pretokenize_config)
        from pf_trl.data.streaming import TokenizedStream

        pf_stream = train_dataset if isinstance(train_dataset, TokenizedStream) else None
        if pf_stream is not None:
            train_dataset = pf_stream.dataset  # Trainer sees the stream (no length: max_steps); the packer reads it
        self.pf_mode = args.padding_free_mode
        if self.pf_mode != "none":
            if data_collator is not None and not isinstance(data_collator, PaddingFreeCollator):
                raise ConfigError(
                    f"padding_free_mode={self.pf_mode!r} batches with PaddingFreeCollator; got a "
                    f"{type(data_collator).__name__}. Pass no data_collator (or a PaddingFreeCollator), or use "
                    "padding_free=False (TRL's padded path)."
                )
            from pf_trl.attention import enable_padding_free

            check_loss_options(args)
            # a PeftModel: make its transformers model padding-free (the adapters live inside its modules)
            enable_padding_free(transformers_model(model), mode=self.pf_mode, backend=args.attention_backend,
                                allow_unverified=args.allow_unverified)
            from pf_trl.attention import multimodal
            from pf_trl.attention.mrope import rope_index_function

            multimodal.check_training_data(transformers_model(model), self.pf_mode, train_dataset, eval_dataset)
            tokenizer = text_tokenizer(processing_class)
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            data_collator = data_collator or PaddingFreeCollator(
                pad_to_multiple_of=sequence_parallel.collator_multiple(args.pad_to_multiple_of,
                                                                       args.sequence_parallel_size),
                pad_token_id=int(pad_id or 0),
                rope_index=rope_index_function(transformers_model(model)),  # mRoPE: per-example positions
            )
            self._pf_collator = data_collator
        # TRL would act on padding_free=True (its own collator, its max_length check), checks assistant_only_loss
        # against raw rows and would prepare (re-truncate, re-shuffle) the rows pf-trl has prepared: hidden during its
        # init (see hidden_from_trl)
        from pf_trl.storage import is_remote
        from pf_trl.trainer.remote_output import stage_output_dir

        # a bucket output_dir: Trainer writes into node-local staging, pf-trl uploads (remote_output)
        if is_remote(args.output_dir):
            args = copy.copy(args)  # the caller's config keeps its URI (a second trainer from it stages again)
        self.pf_remote_output = stage_output_dir(args)
        tokenized = is_tokenized(train_dataset)
        from pf_trl.data.lazy_shards import is_lazy, stand_in

        # shards read while they download: TRL's init takes only a datasets.Dataset and reads its first row (it would
        # wait for the first file); it gets a one-row stand-in, the dataset is put back right after
        lazy = train_dataset if is_lazy(train_dataset) else None
        if self.pf_mode != "none":  # our loss is always divided by num_items_in_batch over the accumulation window
            declare_loss_scaled_for_ga(self)  # before Trainer.__init__: TRL's bridge for transformers < 5.19 reads it
        with hidden_from_trl(args, active=tokenized, skip_prepare=tokenized and self.pf_mode != "none"), \
                admit_head_adapters(self.pf_mode != "none"):
            super().__init__(model, args=args, data_collator=data_collator,
                             train_dataset=stand_in(lazy) if lazy is not None else train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        if lazy is not None:
            self.train_dataset = lazy
        if self.args.fsdp and not self.is_fsdp_enabled:
            # accelerate routes FSDP only on accelerator devices; elsewhere (e.g. CPU) it trains plain DDP silently
            logger.warning("pf-trl: fsdp was requested, but accelerate runs %s on this device: every rank holds the "
                           "whole model (plain data parallel), nothing is sharded", self.accelerator.distributed_type)
        self._pf_pretokenize_options = pretokenize_config
        self._pf_init_metrics()
        self.add_callback(SamplerStateCallback(self))
        self.add_callback(CheckpointCompleteCallback(self))  # after the sampler state: the marker comes last
        if self.pf_remote_output is not None:
            from pf_trl.trainer.remote_output import RemoteCheckpointCallback

            self.add_callback(RemoteCheckpointCallback(self, self.pf_remote_output))  # uploads, then its marker
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
            self.pf_head_plan = install_pf_loss_forward(transformers_model(self.model), options=options)
            self._pf_sp = sequence_parallel.setup(transformers_model(self.model), args.sequence_parallel_size)
            restore_compute_loss_func(self, kwargs.get("compute_loss_func"))

    # ------------------------------------------------------------------ data

    def _pf_sampler(self, dataset, budget: int | None, batch_size: int, *, shuffle: bool,
                    ordered: bool = False) -> TokenBudgetBatchSampler:
        """The batch sampler of ``dataset`` (a hook: tests and harnesses wrap it)."""
        return data_inputs.token_budget_sampler(self, dataset, budget, batch_size, shuffle=shuffle, ordered=ordered)

    def get_train_dataloader(self):
        if self.pf_mode == "none":
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise TrainingDataError("Trainer: training requires a train_dataset.")
        if self._pf_stream is not None:
            return data_inputs.stream_dataloader(self, data_inputs.CountingCollator(self._pf_collator))
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
        restore_sampler(self, sampler)
        data_inputs.read_ahead(self, self.train_dataset, sampler)  # shards still downloading: in this rank's order
        return data_inputs.packed_dataloader(self, self.train_dataset, sampler, training=True)

    def get_eval_dataloader(self, eval_dataset=None):
        if self.pf_mode == "none":
            return super().get_eval_dataloader(eval_dataset)
        if eval_dataset is None and self.eval_dataset is None:
            raise TrainingDataError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        elif not self._pf_is_prepared(eval_dataset):
            eval_dataset = self._pf_prepare_passed(eval_dataset)
        sampler = self._pf_sampler(eval_dataset, self.args.max_eval_tokens_per_batch,
                                   self.args.per_device_eval_batch_size, shuffle=False)
        from pf_trl.trainer.predict import ExampleBounds

        # compute_metrics gets one row per example
        return data_inputs.packed_dataloader(self, eval_dataset, sampler, training=False, wrap_collator=ExampleBounds)

    def get_test_dataloader(self, test_dataset):
        """Trainer's (examples in order, ``eval_batch_size`` a batch, one packed row each), its collator recording
        each example's bounds so that :meth:`prediction_step` returns one row per example; a dataset not prepared
        yet goes through the data path first, as in ``evaluate()``."""
        if self.pf_mode == "none":
            return super().get_test_dataloader(test_dataset)
        from pf_trl.trainer.predict import ExampleBounds

        if not self._pf_is_prepared(test_dataset):
            test_dataset = self._pf_prepare_passed(test_dataset)
        collator = self.data_collator
        self.data_collator = ExampleBounds(collator)
        try:
            return super().get_test_dataloader(test_dataset)
        finally:
            self.data_collator = collator

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        from pf_trl.trainer.predict import per_example

        bounds = inputs.pop(EXAMPLES_KEY, None) if self.pf_mode != "none" else None
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if bounds is None or logits is None:
            return loss, logits, labels
        return (loss, *per_example(logits, labels, bounds))  # one row per example, as TRL's padded run

    def _pf_is_prepared(self, dataset) -> bool:
        known = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        return any(dataset is d for d in known)

    def _pf_prepare_passed(self, dataset):
        """A dataset passed to ``evaluate()`` goes through the data path of ``__init__`` (tokenized, cut to
        ``max_length``), as TRL's ``evaluate`` prepares it; prepared once per dataset object."""
        cached = getattr(self, "_pf_passed_eval", None)
        if cached is not None and cached[0] is dataset:
            return cached[1]
        prepared = prepare_dataset(dataset, tokenizer=self.processing_class, model=transformers_model(self.model),
                                   args=self.args, options=self._pf_pretokenize_options, what="evaluation")
        self._pf_passed_eval = (dataset, prepared)
        return prepared

    # ------------------------------------------------------------------ loss

    def _get_num_items_in_batch(self, batch_samples, device):
        if self.pf_mode == "none":
            return super()._get_num_items_in_batch(batch_samples, device)
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        # shifted supervised labels of the whole accumulation window (a packed row's first label is -100 anyway)
        count = sum(count_targets(b["labels"]) for b in batch_samples)
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
        inputs.pop(EXAMPLES_KEY, None)  # an eval batch's example bounds (prediction_step reads them), never the model's
        if self._pf_sp is not None:
            inputs = sequence_parallel.shard_inputs(inputs, self._pf_sp, self.args.device)
        # TRL's num_tokens: the real tokens of the row, counted by the group's first rank under sequence parallelism
        seen = real if real is not None else inputs["input_ids"].numel()
        trl_metrics.record_num_tokens(self, 0 if self._pf_sp is not None and self._pf_sp.rank else seen)
        if self.compute_loss_func is not None:
            return custom_loss(self, model, inputs, return_outputs, num_items_in_batch)
        if self.args.torch_compile:
            mark_dynamic_lengths(inputs)  # one general graph for all packed lengths (at most two compilations)
        out = model(**inputs, pf_loss=True, pf_real_tokens=None if real is None else int(real))
        loss_sum, n_tok = out["loss_sum"], out["num_tokens"]
        trl_metrics.record_step_metrics(self, out)  # TRL's entropy (and eval accuracy), from the supervised terms
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
        """The loss divisor (:func:`pf_trl.trainer.loss.loss_divisor`; a hook: the sharded harness checks it)."""
        return loss_divisor(self, num_items_in_batch, n_tok, device)

    # ------------------------------------------------------------------ epochs, checkpoints, resume

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """``Trainer.save_model`` without transformers' "Writing model shards" bar (one bar per save, checkpoints
        included, each a fraction of a second: noise in the log; the CLI prints one line where the model went)."""
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            result = super().save_model(output_dir, _internal_call)
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()
        if self.is_world_process_zero() and self.args.should_save:
            from pf_trl.trainer.model_card import is_adapter, write_model_card

            if is_adapter(self.model):  # PEFT rewrote the card on save (base_model: '' without a Hub id)
                write_model_card(self, tags=list(getattr(self, "_tag_names", [])),
                                 output_dir=output_dir or self.args.output_dir)
        remote = getattr(self, "pf_remote_output", None)
        if remote is not None and not _internal_call and (output_dir is None or Path(output_dir) == remote.staging):
            from pf_trl.trainer.remote_output import upload_final

            upload_final(self, remote)  # the final model into the bucket (rank 0)
        return result

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

    def _pf_prepare_remote(self, resume_from_checkpoint):
        """A bucket ``output_dir``: the overwrite check against the bucket's checkpoints, then the checkpoint to
        resume from downloaded into staging (:func:`pf_trl.trainer.remote_output.prepare_resume`)."""
        from pf_trl.trainer.remote_checkpoints import check_remote_output, remove_remote_checkpoints
        from pf_trl.trainer.remote_output import prepare_resume

        remote = self.pf_remote_output
        stale = check_remote_output(str(remote.uri), resume_from_checkpoint=resume_from_checkpoint,
                                    overwrite_output_dir=self.args.overwrite_output_dir, cli=False)
        if stale and self.is_world_process_zero():
            remove_remote_checkpoints(stale)
            print(f"pf-trl: overwrite_output_dir: removed {len(stale)} checkpoint(s) of an earlier run from "
                  f"{remote.uri}", flush=True)
        return prepare_resume(self, remote, resume_from_checkpoint)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if trial is None and self.pf_remote_output is not None:  # a bucket output_dir
            resume_from_checkpoint = self._pf_prepare_remote(resume_from_checkpoint)
        elif trial is None:  # a hyperparameter search trains each trial in its own folder
            from pf_trl.trainer.output_dir import check_output_dir, remove_checkpoints

            stale = check_output_dir(self.args.output_dir, resume_from_checkpoint=resume_from_checkpoint,
                                     overwrite_output_dir=self.args.overwrite_output_dir)
            if stale and self.is_world_process_zero():
                remove_checkpoints(stale)
                print(f"pf-trl: overwrite_output_dir: removed {len(stale)} checkpoint(s) of an earlier run from "
                      f"{self.args.output_dir}", flush=True)
            # every rank sees output_dir (else one line naming the volume), "auto" is rank 0's reading for all
            resume_from_checkpoint = resolve_resume(self, resume_from_checkpoint)
        with resume_dir_for_call(self, resume_from_checkpoint):
            try:
                return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                     ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            finally:
                if hasattr(self, "_pf_saved_ignore_data_skip"):  # set while a stream resumed from its saved position
                    self.args.ignore_data_skip = self._pf_saved_ignore_data_skip
                    del self._pf_saved_ignore_data_skip

def _untied_missing_keys(model, missing: list[str]) -> list[str]:
    """The missing checkpoint keys whose parameter is not shared with a parameter that was loaded (tied weights share
    one tensor: loading its other name filled it)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(p) for name, p in params.items() if name not in missing}
    return [key for key in missing if key not in params or id(params[key]) not in loaded]
