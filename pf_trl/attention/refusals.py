"""Layers pf-trl knows it cannot keep apart in a packed row, refused by name before any self-check.

- DeepSeek-V4's compressed attention (CSA / HCA, ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``): the
  compressor pools fixed windows of ``compress_rate`` tokens of the *row* into extra KV entries positioned by their
  window index. In a packed row the windows straddle example boundaries and count row positions, so an example
  attends to pooled tokens of its neighbours; and an attention without a dense mask (pf_varlen, flash) gets no
  causal bias for the pooled entries at all. Its attention sinks are exact (see ``backends/_sinks.py``): a
  configuration with sliding-window layers only is accepted.
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
