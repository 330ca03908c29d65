"""``huggingface`` mode with ``sdpa``: packed rows attended segment by segment, never through a dense mask.

transformers' native packed path builds, for ``sdpa`` (and ``eager``), one boolean ``[batch, 1, T, T]`` mask per
mask type from the packed ``position_ids`` (``masking_utils.create_causal_mask`` ->
``find_packed_sequence_indices`` -> ``sdpa_mask``), and sdpa given an explicit mask takes its unfused path, which
also stores the full score matrix: attention memory grows with the square of the row (a 64k-token row does not fit
in 8 GB on CPU). Only the flash-attention implementations read the segments from ``cu_seq_lens`` /
``position_ids`` instead.

pf-trl registers ``pf_packed_sdpa`` with transformers' public hooks (``AttentionInterface`` and
``AttentionMaskInterface``) and switches an ``sdpa`` model to it in ``huggingface`` mode:

- the mask function returns ``None`` for an unpadded self-attention call (what ``flash_attention_mask`` does), so no
  dense mask is built; any other call (a padding mask, a KV cache) gets transformers' own ``sdpa_mask``;
- the attention function sends a call without mask and with as many queries as keys to
  :func:`pf_trl.attention.hf.hf_varlen_attention` (segments from ``cu_seq_lens`` or ``position_ids``, the layer's
  ``sliding_window``, exactly as transformers' flash path reads them), whose CPU kernel is memory-linear
  (:mod:`pf_trl.attention.backends.sdpa`); every other call goes to transformers' own ``sdpa_attention_forward``
  unchanged (including its refusal of ``softcap``).

It applies where transformers' packed sdpa path would: a causal text model whose attention goes through
``AttentionInterface``, with full and sliding-window attention layers only (chunked attention and other mask overlays are
expressed in the mask function alone, so those models keep the dense mask: :func:`reroute_refusal` says why).
``enable_padding_free`` then self-checks the model as always, and keeps transformers' dense path if the rerouted one
fails the check.
"""

from __future__ import annotations

import torch

from pf_trl._compat import attn_implementation, can_set_attn_implementation

PACKED_SDPA = "pf_packed_sdpa"
# layer types whose attention pattern the attention function knows from its kwargs (full, sliding_window), or that
# take no attention mask at all (recurrent / convolutional mixers, MLP kinds)
_LAYER_TYPES = {"full_attention", "sliding_attention", "linear_attention", "mamba", "conv", "recurrent", "dense",
                "sparse", "moe"}


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: unmasked self-attention per segment, anything else as transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = all(kwargs.get(name) is None for name in ("position_bias", "softcap", "s_aux", "sinks"))
    if attention_mask is None and plain and query.shape[2] == key.shape[2]:
        from pf_trl.attention.hf import hf_varlen_attention

        return hf_varlen_attention(module, query, key, value, None, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def packed_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                     mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """``AttentionMaskInterface`` function: ``None`` for unpadded self-attention (no cache), else ``sdpa_mask``."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    no_cache = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and q_length == kv_length
    if attention_mask is None and no_cache:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function or causal_mask_function, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register ``pf_packed_sdpa`` with transformers (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)


def reroute_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` keeps transformers' dense packed mask in ``huggingface`` mode (``None``: it is rerouted)."""
    from pf_trl.attention.hf import has_attention_interface, has_mask_interface

    config = model.config
    impl = attn_implementation(config)
    if impl != "sdpa":
        return f"attention implementation {impl!r} is not sdpa"
    if not (has_attention_interface() and has_mask_interface()):
        return "this transformers has no AttentionMaskInterface"
    if not can_set_attn_implementation(model):
        return f"{type(model).__name__} does not route its attention through AttentionInterface"
    if any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config")):
        return "a multimodal model: its encoders attend without the text's packed segments"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "is_causal", True) or not getattr(config, "is_causal", True):
        return "the model is configured bidirectional (is_causal=False)"
    if getattr(text, "attention_chunk_size", None):
        return "chunked attention (attention_chunk_size) lives in the mask only"
    other = set(getattr(text, "layer_types", None) or ()) - _LAYER_TYPES
    if other:
        return f"layer types {sorted(other)} are expressed in the mask only"
    return None


def reroute(model: torch.nn.Module) -> bool:
    """Switch an ``sdpa`` model to ``pf_packed_sdpa`` when :func:`reroute_refusal` allows; True if switched."""
    if reroute_refusal(model) is not None:
        return False
    register()
    model.set_attn_implementation(PACKED_SDPA)
    return attn_implementation(model.config) == PACKED_SDPA


def restore(model: torch.nn.Module) -> None:
    """Back to transformers' own ``sdpa`` (its dense packed mask)."""
    if attn_implementation(model.config) == PACKED_SDPA:
        model.set_attn_implementation("sdpa")
