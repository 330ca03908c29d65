"""PaddingFreeKTOTrainer: TRL's KTOTrainer whose forwards run packed rows, exact against its padded run.

What changes against ``trl.KTOTrainer`` (everything else, the data preparation (prompt extraction, unpairing of
``chosen``/``rejected`` rows, EOS, tokenization, the ``max_length`` filter, the KL completions rotated within each
batch of ``per_device_train_batch_size`` rows), the reference model or ``precompute_ref_log_probs``, the loss types,
``desirable_weight`` / ``undesirable_weight`` and every metric, is TRL's own code):

- forwards: every fused-head call TRL makes (the completions and the mismatched KL completions, on the policy and on
  the reference model, and the reference precompute) runs its padded batch as one packed row (no pad token,
  ``position_ids`` restarting per sequence, varlen attention through :func:`pf_trl.attention.enable_padding_free`),
  the head scoring the completion tokens only, per-token values placed back where TRL's loss code reads them
  (:mod:`~pf_trl.trainer.preference.self_packed_forward`).
- batches: TRL's dataloader, sequential sampler and batch boundaries (the KL pairs are fixed per batch when the
  dataset is prepared); only the padding is gone. Token budgets are refused (:mod:`~pf_trl.trainer.preference.
  kto_config`): they would regroup the rows whose mean KL and loss TRL computes.
- pf-trl's token metrics (``real_tokens_per_second``, ``padding_share``, ...) counted on the completions' packed rows.

Refused in one line: a ``data_collator`` of one's own, vision datasets, prompt-learning PEFT, ``max_tokens_per_batch``.
"""

from __future__ import annotations

from typing import Any

from trl import KTOTrainer

from pf_trl.errors import ConfigError
from pf_trl.trainer.accounting import TokenAccountingMixin
from pf_trl.trainer.adapters import refuse_prompt_learning, transformers_model
from pf_trl.trainer.dpo_forward import check_head_against_trl
from pf_trl.trainer.packed import pack_padded
from pf_trl.trainer.preference.kto_config import check_kto_fields
from pf_trl.trainer.preference.precompute import refuse_in_memory_precompute
from pf_trl.trainer.preference.self_packed_forward import install_self_packed_forward
from pf_trl.trainer.resume import CheckpointCompleteCallback, ResumableTrainerMixin

__all__ = ["PaddingFreeKTOTrainer"]

# the per-token outputs TRL's __init__ asks the policy's fused head for (the reference's: log_probs only)
_POLICY_FIELDS = ("log_probs", "entropy", "mean_logits")


def _refuse_unsupported(model, data_collator, train_dataset, peft_config) -> None:
    if data_collator is not None:
        raise ConfigError("PaddingFreeKTOTrainer packs the batches of TRL's own collator; pass no data_collator")
    first = next(iter(train_dataset)) if train_dataset is not None else {}
    if "image" in first or "images" in first:
        raise ConfigError("PaddingFreeKTOTrainer trains text rows; vision datasets are refused (train them with TRL's "
                          "KTOTrainer)")
    refuse_prompt_learning(model, peft_config)


class PaddingFreeKTOTrainer(ResumableTrainerMixin, TokenAccountingMixin, KTOTrainer):
    """``trl.KTOTrainer`` on packed rows (see the module docstring). Arguments are KTOTrainer's; ``args`` is a
    :class:`~pf_trl.trainer.preference.kto_config.PaddingFreeKTOConfig` or a plain ``KTOConfig``."""

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, **kwargs):
        if args is None:
            from pf_trl.trainer.preference.kto_config import PaddingFreeKTOConfig

            args = PaddingFreeKTOConfig(output_dir="pf-trl-kto")
        check_kto_fields(args)
        _refuse_unsupported(model, data_collator, train_dataset, peft_config)
        refuse_in_memory_precompute(args, train_dataset, eval_dataset)
        self.pf_mode = getattr(args, "padding_free_mode", "huggingface")
        self._pf_packed_models: set[int] = set()
        super().__init__(model, ref_model=ref_model, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         **kwargs)
        self._pf_enable_models()  # (already done if the reference log-probs were precomputed in __init__)
        self._pf_init_metrics()
        self.add_callback(CheckpointCompleteCallback(self))  # each checkpoint committed: resume_from_checkpoint="auto"

    def _pf_enable_models(self) -> None:
        """Packed forwards on the policy and the reference model (each once)."""
        models = [(transformers_model(self.model), _POLICY_FIELDS)]
        if getattr(self, "ref_model", None) is not None:
            models.append((self.accelerator.unwrap_model(self.ref_model), ("log_probs",)))
        for model, fields in models:
            if id(model) in self._pf_packed_models:
                continue
            from pf_trl.attention import enable_padding_free

            enable_padding_free(model, mode=self.pf_mode, backend=getattr(self.args, "attention_backend", "auto"),
                                allow_unverified=getattr(self.args, "allow_unverified", False))
            install_self_packed_forward(model, fields, head=getattr(self.args, "lm_head_kernel", "auto"))
            # pf-trl's CPU head copies TRL's logit-scale / soft-cap rules: checked against TRL's head on this model
            check = check_head_against_trl(model)
            if fields is _POLICY_FIELDS:
                self.pf_head_check = check
            self._pf_packed_models.add(id(model))

    def compute_ref_log_probs(self, model, inputs):
        # TRL's precompute runs inside KTOTrainer.__init__, after it gave the models their fused heads: pack it too
        self._pf_enable_models()
        return super().compute_ref_log_probs(model, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.model.training:
            self._pf_observe_packed(inputs)
        return KTOTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs)

    def _pf_observe_packed(self, inputs: dict[str, Any]) -> None:
        """pf-trl's token metrics of the completions' packed row (the sequences the loss trains on)."""
        row = pack_padded(inputs["attention_mask"])
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        ids = inputs["input_ids"].reshape(-1).index_select(0, row.token_index).unsqueeze(0)
        self._pf_meter.observe({"input_ids": ids, "cu_seq_lens_q": row.cu_seq_lens, "labels": labels},
                               row.num_tokens)
