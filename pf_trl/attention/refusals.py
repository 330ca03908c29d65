"""Layers pf-trl knows it cannot keep apart in a packed row in one mode, refused by name before any self-check.

In ``internal`` mode (``pf_varlen``, which takes no dense mask):

- DeepSeek-V4's compressed attention (CSA / HCA, ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``): the
  compressed key/value entries come with a per-query bias that reaches attention only through transformers' dense
  4-D mask. ``huggingface`` mode computes them per example (:mod:`pf_trl.attention.compressed_kv`) and is exact.
- DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, HY-V4: an ``...Indexer`` with ``index_topk``): the
  indexer picks each query's top-k keys from transformers' dense 4-D mask, which pf_varlen never builds, and hands
  them to the attention as ``sparse_indices``, which pf_varlen's kernels do not take. transformers' own path
  (``huggingface`` mode) builds that mask with the packed positions.
"""

from __future__ import annotations

import torch


def mode_refusal(model: torch.nn.Module, mode: str) -> str | None:
    """Why ``model`` cannot be trained padding-free in ``mode`` (but may be in the other), or ``None``."""
    if mode != "internal":
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    from pf_trl.attention.compressed_kv import is_compressor

    pooled = sorted({type(m).__name__ for m in model.modules() if is_compressor(m)})
    if pooled:
        return (
            f"{model_type}'s compressed attention layers ({', '.join(pooled)}) add key/value entries whose per-query "
            "mask reaches attention only through transformers' dense mask, which pf_varlen does not take, so mode "
            "'internal' cannot run them. padding_free='huggingface' computes them per example and is exact"
        )
    indexers = sorted({type(m).__name__ for m in model.modules()
                       if type(m).__name__.endswith("Indexer") and hasattr(m, "index_topk")})
    if indexers:
        return (
            f"{model_type}'s sparse attention indexer ({', '.join(indexers)}) selects each query's top-k keys from "
            "transformers' dense attention mask and passes them to the attention kernel; pf_varlen builds no dense "
            "mask and takes no key selection, so mode 'internal' cannot run it. padding_free='huggingface' uses "
            "transformers' own masks"
        )
    return None
