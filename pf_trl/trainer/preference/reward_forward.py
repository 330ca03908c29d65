"""A sequence-classification model scored on a packed row: the backbone runs the row, the score head only the pooled
positions.

transformers' ``*ForSequenceClassification`` (``GenericForSequenceClassification``) runs its backbone on the padded
``[B, L]`` batch, projects every position through ``score`` and pools, per row, the rightmost token that is not
``config.pad_token_id`` (TRL's RewardTrainer sets it: the tokenizer's pad token, else its EOS). With the packed row
(:data:`~pf_trl.trainer.preference.collate.PACKED_ROW_KEY` in the call), :func:`install_packed_reward_forward`'s
forward runs the backbone on ``[1, T]`` (varlen attention through :func:`pf_trl.attention.enable_padding_free`),
reads each sequence's hidden state at the position transformers pools in the padded run
(:meth:`~pf_trl.trainer.packed.PackedRow.last_index` of the padded ``input_ids``: with pad = EOS, the token before
the trailing EOS) and projects those ``B`` states only. The output's ``logits`` are the padded run's ``[B,
num_labels]`` pooled logits (equal to float rounding: the score is a per-position linear map), so TRL's loss and
metric code reads what it reads in a padded run.
"""

from __future__ import annotations

import functools
import types

import torch

from pf_trl.errors import ConfigError
from pf_trl.trainer.preference.collate import PACKED_ROW_KEY

__all__ = ["install_packed_reward_forward", "reward_model_refusal"]

_ATTR = "_pf_packed_reward_forward"


def reward_model_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be scored on a packed row (``None``: it can)."""
    from transformers.modeling_layers import GenericForSequenceClassification

    if not isinstance(model, GenericForSequenceClassification):
        return (f"{type(model).__name__} is not one of transformers' generic *ForSequenceClassification models "
                "(backbone + score head pooling the last non-pad token); train it with TRL's RewardTrainer")
    return None


def _pooled_logits(model: torch.nn.Module, kwargs: dict, row) -> torch.Tensor:
    input_ids = kwargs["input_ids"]
    device = input_ids.device
    row = row.to(device)
    pad = model.config.get_text_config().pad_token_id
    if pad is None and input_ids.shape[0] != 1:
        # transformers' own refusal, its words; a ConfigError is a ValueError too, as transformers raises it
        raise ConfigError("Cannot handle batch sizes > 1 if no padding token is defined: set the model config's "
                          "pad_token_id to the tokenizer's pad token id")
    positions = row.last_index(input_ids, pad)
    backbone = getattr(model, model.base_model_prefix)
    passed = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "use_cache", "margin")}
    hidden = backbone(**row.model_kwargs(), use_cache=False, **passed).last_hidden_state
    return model.score(hidden[0].index_select(0, positions))


def install_packed_reward_forward(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``model.forward`` (a generic transformers ``*ForSequenceClassification``) so that a call carrying the
    batch's packed row runs it (see the module docstring); any other call runs the forward as it was. Idempotent."""
    refusal = reward_model_refusal(model)
    if refusal is not None:
        raise ConfigError(refusal)
    if getattr(model, _ATTR, False):
        return model
    inner = model.forward

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        row = kwargs.pop(PACKED_ROW_KEY, None)
        if row is None or args:
            return inner(*args, **kwargs)
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast

        return SequenceClassifierOutputWithPast(logits=_pooled_logits(self, kwargs, row))

    model.forward = types.MethodType(forward, model)
    setattr(model, _ATTR, True)
    return model
