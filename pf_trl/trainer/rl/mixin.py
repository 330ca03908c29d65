"""What PaddingFreeGRPOTrainer and PaddingFreeRLOOTrainer add to TRL's trainers: the packed log-probability forward.

Both TRL trainers compute every log-probability outside generation (policy, old policy, reference) through
``_get_per_token_logps_and_entropies``; :class:`PackedLogProbsMixin` replaces that one method by
:func:`~pf_trl.trainer.rl.forward.packed_logps_and_entropies`, so generation, rewards, advantages, the loss types, the
importance-sampling paths and every metric stay TRL's code.

With ``max_tokens_per_forward``, :meth:`PackedLogProbsMixin.compute_loss` splits a micro-batch over the budget into
several packed forwards (:func:`~pf_trl.trainer.rl.layout.plan_forwards`), each running TRL's loss on its rows,
weighted to its share of the micro-batch's loss (:mod:`pf_trl.trainer.rl.budget`) and backpropagated before the next
forward; TRL's loss code then runs once more on the whole micro-batch, from the per-token values the forwards gave
and without a model forward, so that the loss value and every logged metric are TRL's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from pf_trl._compat import attn_implementation
from pf_trl.attention.shared_prefix import shared_prefix_refusal
from pf_trl.errors import ConfigError
from pf_trl.trainer.rl.budget import budget_refusal, loss_type_of, piece_inputs, piece_weight
from pf_trl.trainer.rl.forward import attention_switched, packed_logps_and_entropies, unwrapped_model
from pf_trl.trainer.rl.layout import plan_forwards

__all__ = ["SHARED_PREFIX_CHOICES", "PackedLogProbsMixin"]

logger = logging.getLogger("pf_trl.trainer")

SHARED_PREFIX_CHOICES = ("auto", "on", "off")
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class PackedLogProbsMixin:
    """Mixed in before TRL's GRPOTrainer / RLOOTrainer (see the module docstring). Reads ``shared_prefix`` (``auto``:
    on where exact; ``on``: refuse where not; ``off``), ``attention_backend`` and ``max_tokens_per_forward`` from the
    config when it has them."""

    # per-token values of the current micro-batch's forwards (collected) and replayed into TRL's loss code
    _pf_collected: list | None = None
    _pf_replay: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _pf_setup(self) -> None:
        from pf_trl.attention import enable_padding_free
        choice = getattr(self.args, "shared_prefix", "auto")
        if choice not in SHARED_PREFIX_CHOICES:
            raise ConfigError(f"shared_prefix must be one of {', '.join(SHARED_PREFIX_CHOICES)}, got {choice!r}")
        backend = getattr(self.args, "attention_backend", "auto")
        models = [unwrapped_model(self.model)]
        if self.ref_model is not None:
            models.append(unwrapped_model(self.ref_model))
        refusal = None
        # generation keeps the policy's own attention implementation (_generate); every other forward is packed
        self._pf_generation_attention = attn_implementation(models[0].config)
        for model in models:
            enable_padding_free(model, mode="internal", backend=backend,
                                allow_unverified=getattr(self.args, "allow_unverified", False))
            refusal = refusal or shared_prefix_refusal(model)
        if choice == "on" and refusal is not None:
            raise ConfigError(f"shared_prefix='on' cannot be exact here: {refusal}; use shared_prefix='off'")
        self.pf_shared_prefix = choice != "off" and refusal is None
        if choice == "auto" and refusal is not None:
            logger.info("pf-trl: shared prefixes off (%s); every sequence carries its prompt", refusal)
        budget = getattr(self.args, "max_tokens_per_forward", None)
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
                raise ConfigError(f"max_tokens_per_forward must be a positive integer, got {budget!r}")
            why = budget_refusal(self)
            if why is not None:
                raise ConfigError(f"max_tokens_per_forward cannot keep TRL's loss here: {why}; drop "
                                  "max_tokens_per_forward (or that setting)")
        self.pf_max_tokens = budget

    def _generate(self, prompts):
        # TRL's generation, untouched: the model's own attention, not the packed forwards' pf_varlen
        with attention_switched(unwrapped_model(self.model), self._pf_generation_attention):
            return super()._generate(prompts)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ConfigError(f"{type(self).__name__} trains text models; got {', '.join(given)} (vision inputs): "
                              "train it with TRL's trainer")
        if compute_aux_loss:
            raise ConfigError(f"{type(self).__name__} does not compute the MoE load-balancing loss on packed rows "
                              "(its router statistics would count other tokens than TRL's padded batch); set "
                              "output_router_logits=False or train with TRL's trainer")
        if self._pf_replay is not None:  # TRL's loss on the whole micro-batch, from its forwards' values
            logps, entropies = self._pf_replay
            return logps, entropies if compute_entropy else None, None
        with self.accelerator.autocast():
            logps, entropies = packed_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          batch_size=batch_size, compute_entropy=compute_entropy,
                                                          shared_prefix=self.pf_shared_prefix,
                                                          max_tokens=getattr(self, "pf_max_tokens", None))
        if self._pf_collected is not None:
            self._pf_collected.append((logps.detach(), None if entropies is None else entropies.detach()))
        return logps, entropies, None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss; a micro-batch over ``max_tokens_per_forward`` runs as several packed forwards, each
        backpropagated in turn when training (see the module docstring)."""
        budget = getattr(self, "pf_max_tokens", None)
        forwards = None if budget is None or return_outputs else self._pf_plan(inputs, budget)
        if forwards is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        logged = {key: len(values) for key, values in self._metrics[mode].items()}
        width = inputs["completion_ids"].size(1)
        rows = inputs["completion_ids"].size(0)
        logps = inputs["completion_mask"].new_zeros((rows, width), dtype=torch.float32)
        entropies = torch.zeros_like(logps)
        training = torch.is_grad_enabled()
        loss = None
        for n, piece_rows in enumerate(forwards):
            piece = piece_inputs(inputs, piece_rows)
            with self._pf_collecting() as collected:
                loss = super().compute_loss(model, piece, num_items_in_batch=num_items_in_batch)
            loss = loss * piece_weight(loss_type_of(self), inputs, piece)
            index = torch.tensor(piece_rows, dtype=torch.long, device=logps.device)
            piece_logps, piece_entropies = collected[0]
            logps = logps.to(piece_logps.dtype).index_copy(0, index, piece_logps)
            if piece_entropies is not None:
                entropies = entropies.to(piece_entropies.dtype).index_copy(0, index, piece_entropies)
            if training and n < len(forwards) - 1:
                # the Trainer backpropagates the last piece's loss; each earlier one frees its activations now
                self.accelerator.backward(self._pf_scaled_for_backward(loss, num_items_in_batch))
        # the pieces' metrics out; TRL's loss code on the whole micro-batch logs TRL's metrics and gives its value
        for key, count in logged.items():
            del self._metrics[mode][key][count:]
        for key in [key for key in self._metrics[mode] if key not in logged]:
            del self._metrics[mode][key]
        with torch.no_grad(), self._pf_replaying(logps, entropies):
            whole = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss - loss.detach() + whole

    def _pf_plan(self, inputs, budget: int) -> list[list[int]] | None:
        """The rows of each packed forward of this micro-batch, or ``None`` for one forward; several ranks agree on
        the largest count (TRL's loss gathers its metrics across ranks once per forward)."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        width = inputs["completion_ids"].size(1)
        forwards = plan_forwards(ids, mask, width, budget, shared_prefix=self.pf_shared_prefix)
        if self.accelerator.num_processes > 1:
            count = torch.tensor([len(forwards)], device=self.accelerator.device)
            agreed = int(self.accelerator.gather(count).max())
            if agreed > len(forwards):
                forwards = plan_forwards(ids, mask, width, budget, shared_prefix=self.pf_shared_prefix,
                                         min_forwards=agreed)
        return forwards if len(forwards) > 1 else None

    def _pf_scaled_for_backward(self, loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """``loss`` as Trainer.training_step scales a compute_loss result before its backward."""
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        return loss if scaled else loss / self.current_gradient_accumulation_steps

    @contextlib.contextmanager
    def _pf_collecting(self) -> Iterator[list]:
        self._pf_collected = collected = []
        try:
            yield collected
        finally:
            self._pf_collected = None

    @contextlib.contextmanager
    def _pf_replaying(self, logps: torch.Tensor, entropies: torch.Tensor) -> Iterator[None]:
        self._pf_replay = (logps, entropies)
        try:
            yield
        finally:
            self._pf_replay = None
