"""Padding-free patch for transformers without ``AttentionInterface`` (< 4.48; written against 4.43.x).

transformers 4.43 has no attention registry and its sdpa/eager attention ignores packed ``position_ids``
(native packed-sequence support arrived in 4.44, flash-attn only). This module replaces, on one model
instance, the ``forward`` of every decoder attention module with :func:`_attention_forward`, which keeps the
model's own projections, rotary embedding and KV cache update and then calls :func:`hf_varlen_attention`, and
makes the base model hand the raw 2-D padding mask to its layers instead of a dense 4-D mask
(``_update_causal_mask`` is overridden on the instance).

4.43 attention forwards have three rotary styles, all handled:

- Llama: the model passes ``position_embeddings=(cos, sin)`` (or ``rotary_emb(x, position_ids)``);
- Mistral: ``cos, sin = rotary_emb(x, position_ids)``, ``apply_rotary_pos_emb(q, k, cos, sin)``;
- Qwen2 / Mixtral: ``cos, sin = rotary_emb(x, seq_len=kv_len)``, ``apply_rotary_pos_emb(q, k, cos, sin, position_ids)``.

Sliding window: Mistral/Mixtral use ``config.sliding_window``; Qwen2 only when ``config.use_sliding_window`` and
``layer_idx >= config.max_window_layers`` (its flash path's rule; its 4.43 sdpa/eager paths have no window).
We follow the eager/sdpa mask convention of 4.43 (``W`` keys per query, itself included), which is also the
convention of current transformers; 4.43's own flash path passed ``window_size=(W, W)`` (``W + 1`` keys).
"""

from __future__ import annotations

import inspect
import sys
import types

import torch

from pf_trl._compat import replace_causal_mask_builder
from pf_trl.attention.hf import hf_varlen_attention

LEGACY_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "granite")
_PATCH_FLAG = "_pf_legacy_patched"


def _is_attention_module(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")) and hasattr(
        module, "layer_idx"
    )


def _sliding_window(module) -> int | None:
    cfg = module.config
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    if getattr(cfg, "model_type", None) == "qwen2":
        if not getattr(cfg, "use_sliding_window", False):
            return None
        if module.layer_idx < getattr(cfg, "max_window_layers", 0):
            return None
    return int(window)


def _rotary(module, query, key, value, position_ids, past_key_value, position_embeddings):
    modeling = sys.modules[type(module).__module__]
    apply_rotary = modeling.apply_rotary_pos_emb
    if position_embeddings is not None:
        cos, sin = position_embeddings
        return (*apply_rotary(query, key, cos, sin), cos, sin)
    rotary = module.rotary_emb
    params = inspect.signature(rotary.forward).parameters
    if "position_ids" in params:
        cos, sin = rotary(value, position_ids)
        return (*apply_rotary(query, key, cos, sin), cos, sin)
    kv_len = key.shape[-2]
    if past_key_value is not None:
        kv_len += past_key_value.get_usable_length(kv_len, module.layer_idx)
    if position_ids is not None:
        kv_len = max(kv_len, int(position_ids.max()) + 1)
    cos, sin = rotary(value, seq_len=kv_len)
    return (*apply_rotary(query, key, cos, sin, position_ids), cos, sin)


def _attention_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_value=None,
    output_attentions: bool = False,
    use_cache: bool = False,
    cache_position: torch.LongTensor | None = None,
    position_embeddings=None,
    **kwargs,
):
    bsz, q_len, _ = hidden_states.shape
    head_dim = self.head_dim
    n_heads = getattr(self, "num_heads", None) or self.config.num_attention_heads
    n_kv = getattr(self, "num_key_value_heads", None) or self.config.num_key_value_heads
    query = self.q_proj(hidden_states).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
    key = self.k_proj(hidden_states).view(bsz, q_len, n_kv, head_dim).transpose(1, 2)
    value = self.v_proj(hidden_states).view(bsz, q_len, n_kv, head_dim).transpose(1, 2)
    if position_ids is None:
        past = past_key_value.get_seq_length(self.layer_idx) if past_key_value is not None else 0
        position_ids = torch.arange(past, past + q_len, device=hidden_states.device).unsqueeze(0)
    query, key, cos, sin = _rotary(self, query, key, value, position_ids, past_key_value, position_embeddings)
    if past_key_value is not None:
        cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
        key, value = past_key_value.update(key, value, self.layer_idx, cache_kwargs)
    scaling = getattr(self, "scaling", None) or head_dim**-0.5
    out, _ = hf_varlen_attention(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=scaling,
        sliding_window=_sliding_window(self),
        position_ids=position_ids,
    )
    out = self.o_proj(out.reshape(bsz, q_len, -1))
    return out, None, past_key_value


def _passthrough_causal_mask(self, attention_mask, *args, **kwargs):
    # Hand the 2-D padding mask (or None) to the layers: pf_varlen unpads from it, no dense mask is built.
    return attention_mask


def patch_model(model: torch.nn.Module, backend: str) -> int:
    """Patch ``model`` in place; returns the number of attention modules patched."""
    patched = 0
    for module in model.modules():
        if _is_attention_module(module):
            module.forward = types.MethodType(_attention_forward, module)
            module._pf_varlen_backend = backend
            setattr(module, _PATCH_FLAG, True)
            patched += 1
        replace_causal_mask_builder(module, _passthrough_causal_mask)
    return patched
