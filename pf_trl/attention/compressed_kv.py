"""Compressed key/value entries (DeepSeek-V4's CSA / HCA layers) computed once per packed example.

A DeepSeek-V4 compressor pools fixed windows of ``compress_rate`` tokens, counted from the start of the sequence,
into extra key/value entries, and returns them with a per-query bias (``-inf`` where a query may not see an entry:
the entry's window is not complete before the query, or the CSA indexer did not pick it). On a packed row the
windows would be counted from the row start and straddle examples. :func:`install` wraps each compressor so that,
on a packed row without a cache, it runs once per example (positions restart at 0 there, as in a padded row) and
the entries of the row are those of its examples side by side, with a bias that hides every example's entries from
the others' queries: the padded computation, exactly (padded rows compress windows of padding too, but no real
query can see them).

The bias only reaches attention through a dense 4-D mask: transformers' eager path (``huggingface`` mode) has one,
``pf_varlen`` does not, so ``internal`` mode refuses these layers (:mod:`pf_trl.attention.refusals`).
"""

from __future__ import annotations

import types

import torch

from pf_trl.attention.errors import PaddingFreeError
from pf_trl.batching import packing

_WRAPPED = "_pf_per_example"


def is_compressor(module: torch.nn.Module) -> bool:
    """A module that pools windows of the row into key/value entries (DeepSeek-V4 CSA / HCA)."""
    return type(module).__name__.endswith("Compressor") and hasattr(module, "compress_rate")


def _per_example_forward(self, hidden_states, q_residual, position_ids, cache=None, layer_idx=None, **kwargs):
    original = self._pf_original_forward
    if cache is not None or position_ids is None or position_ids.dim() != 2:
        return original(hidden_states, q_residual, position_ids, cache, layer_idx, **kwargs)
    if position_ids.shape[0] != 1:
        if packing.rows_hold_several_segments(position_ids):
            raise PaddingFreeError(f"{type(self).__name__}: packed examples must come as one row per batch")
        return original(hidden_states, q_residual, position_ids, cache, layer_idx, **kwargs)
    # the examples of the row (host read: once per layer)
    spans = packing.segment_spans(packing.cu_seqlens_from_starts(packing.segment_starts(position_ids)))
    if len(spans) == 1:  # one example: nothing to separate
        return original(hidden_states, q_residual, position_ids, cache, layer_idx, **kwargs)
    entries, biases = [], []
    for start, end in spans:
        kv, bias = original(hidden_states[:, start:end], q_residual[:, start:end], position_ids[:, start:end], None,
                            layer_idx, **kwargs)
        entries.append(kv)
        biases.append(bias)
    compressed = torch.cat(entries, dim=2)  # (1, 1, entries of the row, head_dim)
    total = compressed.shape[2]
    if total == 0:
        return compressed, None
    block_bias = compressed.new_full((1, 1, spans[-1][1], total), float("-inf"))
    offset = 0
    for (start, end), kv, bias in zip(spans, entries, biases):
        n = kv.shape[2]
        if n:  # an example's own entries, as its compressor masked them (None: all visible)
            block_bias[..., start:end, offset:offset + n] = 0.0 if bias is None else bias
        offset += n
    return compressed, block_bias


def install(model: torch.nn.Module) -> list[str]:
    """Make every compressor of ``model`` compute its entries per packed example (idempotent); their class names."""
    names = []
    for module in model.modules():
        if is_compressor(module) and not getattr(module, _WRAPPED, False):
            module._pf_original_forward = module.forward
            module.forward = types.MethodType(_per_example_forward, module)
            setattr(module, _WRAPPED, True)
            names.append(type(module).__name__)
    return sorted(set(names))
