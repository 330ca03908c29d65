"""What PaddingFreeGRPOTrainer and PaddingFreeRLOOTrainer add to TRL's trainers: the packed log-probability forward.

Both TRL trainers compute every log-probability outside generation (policy, old policy, reference) through
``_get_per_token_logps_and_entropies``; :class:`PackedLogProbsMixin` replaces that one method by
:func:`~pf_trl.trainer.rl.forward.packed_logps_and_entropies`, so generation, rewards, advantages, the loss types, the
importance-sampling paths and every metric stay TRL's code.
"""

from __future__ import annotations

import logging

from pf_trl._compat import attn_implementation
from pf_trl.attention.shared_prefix import shared_prefix_refusal
from pf_trl.errors import ConfigError
from pf_trl.trainer.rl.forward import attention_switched, packed_logps_and_entropies, unwrapped_model

__all__ = ["SHARED_PREFIX_CHOICES", "PackedLogProbsMixin"]

logger = logging.getLogger("pf_trl.trainer")

SHARED_PREFIX_CHOICES = ("auto", "on", "off")
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class PackedLogProbsMixin:
    """Mixed in before TRL's GRPOTrainer / RLOOTrainer (see the module docstring). Reads ``shared_prefix`` (``auto``:
    on where exact; ``on``: refuse where not; ``off``) and ``attention_backend`` from the config when it has them."""

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
        with self.accelerator.autocast():
            logps, entropies = packed_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          batch_size=batch_size, compute_entropy=compute_entropy,
                                                          shared_prefix=self.pf_shared_prefix)
        return logps, entropies, None
