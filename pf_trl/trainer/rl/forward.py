"""The packed log-probability forward of GRPO and RLOO: one packed row in, TRL's ``[B, C]`` per-token values out.

:func:`packed_logps_and_entropies` is what TRL's ``_get_per_token_logps_and_entropies`` computes (per-token
log-probabilities of the completion tokens under the temperature TRL's fused LM head applies, and optionally their
entropies), from the packed row of :func:`~pf_trl.trainer.rl.layout.rl_packed_layout` instead of the padded batch:

- the backbone runs the row (no pad token, ``position_ids`` per sequence, varlen attention through pf-trl's
  ``pf_varlen`` implementation, which the trainers keep on the models outside generation: a gradient-checkpointed
  layer recomputes its forward during the backward, with the attention it had);
- TRL's own fused head (``add_fused_lm_head``: temperature, softcapping, logit scale, fp32 head cast) scores only the
  completion predictions: a forward hook narrows the backbone's last hidden state to those positions and the head is
  given them as pre-shifted ``shift_labels``;
- the values are placed at their positions of TRL's ``[B, C]`` layout, zero elsewhere, as TRL's head leaves the
  positions it does not score.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from pf_trl._compat import attn_implementation
from pf_trl.attention.shared_prefix import SHARED_PREFIX_KEY
from pf_trl.trainer.adapters import transformers_model
from pf_trl.trainer.rl.layout import plan_forwards, rl_packed_layout

__all__ = ["attention_switched", "packed_chunk", "packed_logps_and_entropies", "unwrapped_model"]


def unwrapped_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model TRL gave its fused head (inside DDP / accelerate and PEFT wrappers)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return transformers_model(model)


@contextlib.contextmanager
def attention_switched(model: torch.nn.Module, implementation: str) -> Iterator[None]:
    """While open, ``model`` attends with ``implementation``; its current one comes back after."""
    original = attn_implementation(model.config)
    if original == implementation:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


@contextlib.contextmanager
def _narrowed(backbone: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """While open, ``backbone``'s ``last_hidden_state`` ``[1, T, H]`` comes out as its rows at ``positions``."""

    def narrow(module, args, output):
        output.last_hidden_state = output.last_hidden_state.index_select(1, positions)
        return output

    handle = backbone.register_forward_hook(narrow)
    try:
        yield
    finally:
        handle.remove()


def _scatter(values: torch.Tensor, dst: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return values.new_zeros(rows * width).index_copy(0, dst, values.reshape(-1)).view(rows, width)


def packed_chunk(model: torch.nn.Module, inner: torch.nn.Module, layout: dict[str, Any], device: torch.device,
                 compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log-probs, entropies or None)`` ``[B, C]`` of one :func:`~pf_trl.trainer.rl.layout.rl_packed_layout` row;
    ``model`` is what TRL calls, ``inner`` the transformers model inside it."""
    call = dict(input_ids=layout["input_ids"].to(device), position_ids=layout["position_ids"].to(device),
                cu_seq_lens_q=layout["cu_seq_lens_q"].to(device), cu_seq_lens_k=layout["cu_seq_lens_k"].to(device),
                max_length_q=layout["max_length_q"], max_length_k=layout["max_length_k"])
    if layout["shared_prefix"] is not None:
        call[SHARED_PREFIX_KEY] = layout["shared_prefix"].to(device)
    src, dst = layout["src"].to(device), layout["dst"].to(device)
    with _narrowed(inner.base_model, src):
        outputs = model(**call, shift_labels=layout["targets"].to(device).unsqueeze(0), fused_lm_head=True)
    rows, width = layout["rows"], layout["width"]
    logps = _scatter(outputs.log_probs, dst, rows, width)
    entropies = _scatter(outputs.entropy, dst, rows, width) if compute_entropy else None
    return logps, entropies


def packed_logps_and_entropies(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               logits_to_keep: int, *, batch_size: int | None = None, compute_entropy: bool = False,
                               shared_prefix: bool = False,
                               max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's ``(per_token_logps [B, C], entropies [B, C] or None)`` of ``model`` on its padded batch, computed on one
    packed row per chunk of ``batch_size`` sequences (TRL's chunking; all at once without it), each chunk split
    further into rows of at most ``max_tokens`` tokens (:func:`~pf_trl.trainer.rl.layout.plan_forwards`).

    ``model`` is what TRL calls (possibly wrapped by accelerate or PEFT) and must have TRL's fused LM head and have
    been made padding-free with ``mode="internal"``; ``shared_prefix``: sequences with the same prompt share it
    (:mod:`pf_trl.attention.shared_prefix`), which the caller has checked is exact for this model."""
    inner = unwrapped_model(model)
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies, order = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        end = min(start + batch_size, input_ids.size(0))
        ids, mask = input_ids[start:end], attention_mask[start:end]
        forwards = [list(range(end - start))] if max_tokens is None else plan_forwards(
            ids, mask, logits_to_keep, max_tokens, shared_prefix=shared_prefix)
        for rows in forwards:
            index = torch.tensor(rows, dtype=torch.long, device=input_ids.device)
            layout = rl_packed_layout(ids.index_select(0, index), mask.index_select(0, index), logits_to_keep,
                                      shared_prefix=shared_prefix)
            logps, entropies = packed_chunk(model, inner, layout, input_ids.device, compute_entropy)
            all_logps.append(logps)
            all_entropies.append(entropies)
            order.extend(start + r for r in rows)
    # back to the batch's row order (differentiable: the rows' gradients flow to their own forwards)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    inverse = inverse.to(input_ids.device)
    logps = torch.cat(all_logps, dim=0).index_select(0, inverse)
    return logps, torch.cat(all_entropies, dim=0).index_select(0, inverse) if compute_entropy else None
