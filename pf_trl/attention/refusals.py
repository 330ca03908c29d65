"""Layers pf-trl knows it cannot keep apart in a packed row, refused by name before any self-check.

- DeepSeek-V4's compressed attention (CSA / HCA, ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``): the
  compressor pools fixed windows of ``compress_rate`` tokens of the *row* into extra KV entries positioned by their
  window index. In a packed row the windows straddle example boundaries and count row positions, so an example
  attends to pooled tokens of its neighbours; and an attention without a dense mask (pf_varlen, flash) gets no
  causal bias for the pooled entries at all. Its attention sinks are exact (see ``backends/_sinks.py``): a
  configuration with sliding-window layers only is accepted.
- DeepSeek sparse attention in ``internal`` mode (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, HY-V4: an ``...Indexer`` with
  ``index_topk``): the indexer picks each query's top-k keys from transformers' dense 4-D mask, which pf_varlen
  never builds, and hands them to the attention as ``sparse_indices``, which pf_varlen's kernels do not take.
  transformers' own path (``huggingface`` mode) builds that mask with the packed positions.
"""

from __future__ import annotations

import torch


def structural_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be trained padding-free whatever the mode, or ``None``."""
    pooled = sorted({type(m).__name__ for m in model.modules()
                     if type(m).__name__.endswith("Compressor") and hasattr(m, "compress_rate")})
    if pooled:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        return (
            f"{model_type}'s compressed attention layers ({', '.join(pooled)}) pool fixed windows of the packed row "
            "into extra key/value entries: the windows straddle example boundaries and are positioned by the row, "
            "so packed examples would attend to each other. pf-trl applies its attention sinks exactly but cannot "
            "keep compressed layers apart; a configuration with sliding-window layers only is supported. Train it "
            "padded (padding_free='none')"
        )
    return None


def mode_refusal(model: torch.nn.Module, mode: str) -> str | None:
    """Why ``model`` cannot be trained padding-free in ``mode`` (but may be in the other), or ``None``."""
    if mode != "internal":
        return None
    indexers = sorted({type(m).__name__ for m in model.modules()
                       if type(m).__name__.endswith("Indexer") and hasattr(m, "index_topk")})
    if indexers:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        return (
            f"{model_type}'s sparse attention indexer ({', '.join(indexers)}) selects each query's top-k keys from "
            "transformers' dense attention mask and passes them to the attention kernel; pf_varlen builds no dense "
            "mask and takes no key selection, so mode 'internal' cannot run it. padding_free='huggingface' uses "
            "transformers' own masks"
        )
    return None
