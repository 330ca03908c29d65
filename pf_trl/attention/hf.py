"""transformers integration: the ``pf_varlen`` attention implementation.

:func:`hf_varlen_attention` has the signature of transformers' ``AttentionInterface`` functions
(``(module, query, key, value, attention_mask, **kwargs) -> (output, None)`` with q/k/v as
``(batch, heads, seq, head_dim)`` and output ``(batch, seq, heads, head_dim)``). It decides the segment layout in
this order, and never lets two segments see each other:

1. a 2-D padding mask (what our mask function hands over): unpad, one segment per row; raises
   :class:`PackedAttentionMaskError` if the valid tokens of a row hold several segments (packed ``position_ids``);
2. ``cu_seq_lens_q/k`` (+ ``max_length_q/k``) from the collator, as transformers' flash path reads them. This is
   the hot path: no value is read on the host (no ``.item()``/``.tolist()``, the max lengths are Python ints from
   the collator), so a GPU stream never stalls and ``torch.compile`` traces the layer with no graph break;
3. otherwise ``position_ids`` (one host sync per layer to size the segments: eager only; for compile pass the
   collator's flash kwargs): a new segment starts wherever a position is not the previous one + 1 (transformers'
   ``find_packed_sequence_indices`` rule; a restart at 0 always qualifies) and at every row start;
4. with fewer queries than keys (KV cache holding past tokens): one segment per row, bottom-right causal.

A ``pf_shared_prefix`` layout (:mod:`pf_trl.attention.shared_prefix`) takes precedence over all of these: segments
that also see a prefix segment of the row.

This holds whether or not a KV cache exists, which closes the hole where transformers skips its packed-sequence
detection when ``use_cache=True`` (see :mod:`pf_trl.attention.enable`).

On transformers 5.x the mask builder (``masking_utils.create_causal_mask``) would return ``None`` for an
implementation it does not know, dropping any padding mask; :func:`pf_varlen_mask` is registered with
``AttentionMaskInterface`` so that the 2-D mask reaches us as-is and no dense (T x T) mask is ever built.
"""

from __future__ import annotations

import logging

import torch

from pf_trl.attention.dispatch import varlen_attention
from pf_trl.attention.errors import (
    PackedAttentionMaskError,
    PaddingFreeError,
    UnsupportedFeatureError,
    UnsupportedModelError,
)
from pf_trl.batching import packing

logger = logging.getLogger("pf_trl.attention")

PF_VARLEN = "pf_varlen"
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)


# ----------------------------------------------------------------------------------------------- segment helpers


def _row_positions(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    if position_ids.dim() != 2:
        raise UnsupportedModelError(
            f"pf_varlen needs 2-D position_ids (batch, seq); got shape {tuple(position_ids.shape)}. Multimodal rotary "
            "positions (e.g. Qwen2-VL mrope, 3 x batch x seq) cannot be made padding-free by pf-trl."
        )
    if position_ids.shape[-1] != length:
        raise PaddingFreeError(
            f"position_ids cover {position_ids.shape[-1]} tokens but the attention layer sees {length} queries"
        )
    if position_ids.shape[0] != batch:
        position_ids = position_ids.expand(batch, -1)
    return position_ids


def rows_hold_several_segments(position_ids: torch.Tensor | None, valid: torch.Tensor | None = None) -> bool:
    """True if, among the valid tokens of any row, positions are not one consecutive run (i.e. packed)."""
    if position_ids is None:
        return False
    if position_ids.dim() != 2:
        raise UnsupportedModelError(
            f"pf-trl needs 2-D position_ids; got shape {tuple(position_ids.shape)} (multimodal rotary positions?)"
        )
    return packing.rows_hold_several_segments(position_ids, valid)


def attention_chunk(module: torch.nn.Module) -> int | None:
    """Chunk size of a chunked-attention layer (Llama 4: ``layer_types[i] == "chunked_attention"``), else None.

    transformers expresses chunked attention only in the mask it builds (each query sees the keys of its own chunk
    of ``attention_chunk_size`` positions); pf_varlen gets no mask, so it reads the layer's type itself.
    """
    config = getattr(module, "config", None)
    idx = getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if idx is None or not isinstance(types, (list, tuple)) or not 0 <= idx < len(types):
        return None
    if types[idx] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def split_into_chunks(cu: torch.Tensor, total: int, max_len, chunk: int) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` with every segment cut at multiples of ``chunk`` of its own positions (chunked attention is
    attention within those pieces); reads the layout on the host (``nonzero``), once per chunked layer."""
    _, pos = packing.token_segments(cu, total)
    return packing.cu_seqlens_from_starts(pos % chunk == 0), min(max_len, chunk)


# ------------------------------------------------------------------------------------------ attention function


def hf_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    backend: str | None = None,
    pf_shared_prefix=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function ``pf_varlen`` (see module docstring)."""
    if kwargs.get("output_attentions"):
        _warn_once("output_attentions", "pf_varlen does not return attention weights (output_attentions ignored)")
    backend = backend or getattr(module, "_pf_varlen_backend", "auto")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    b, hq, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    dv = value.shape[-1]
    q = query.transpose(1, 2)  # (b, lq, h, d)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    common = dict(causal=causal, softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap)
    common.update(dropout_p=float(dropout), backend=backend, sinks=s_aux)  # s_aux: gpt-oss style attention sinks
    chunk = attention_chunk(module)
    if pf_shared_prefix is not None:  # segments that also see a prefix segment (pf_trl.attention.shared_prefix)
        if attention_mask is not None or b != 1 or lq != lk or chunk is not None:
            raise PaddingFreeError(
                "a shared-prefix layout needs one packed row without attention_mask or KV cache, and no chunked "
                "attention layer; pass the layout only as pf_trl.trainer.rl builds it"
            )
        from pf_trl.attention.shared_prefix import attend

        out = attend(q[0], k[0], v[0], pf_shared_prefix, **common)
        return out.unsqueeze(0), None

    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise PaddingFreeError(
                f"pf_varlen got a {attention_mask.dim()}-D attention mask; it only understands 2-D padding masks "
                "(batch, kv_len). Custom 4-D masks cannot be made padding-free."
            )
        if attention_mask.shape[-1] != lk:
            raise PaddingFreeError(
                f"pf_varlen got a padding mask over {attention_mask.shape[-1]} keys for {lk} keys "
                "(static/sliding caches are not supported by pf_varlen; generate with sdpa)"
            )
        kmask = attention_mask.to(torch.bool)
        qmask = kmask[:, -lq:]
        multi = cu_seq_lens_q is not None and cu_seq_lens_q.numel() - 1 > b
        if multi or rows_hold_several_segments(position_ids, qmask):
            raise PackedAttentionMaskError(
                "attention_mask was passed together with packed position_ids (several sequences in one row). "
                "Padding-free batches must not carry an attention_mask: transformers would let the packed "
                "sequences attend to each other. Drop attention_mask (PaddingFreeCollator emits none)."
            )
        idx_q = qmask.reshape(-1).nonzero().reshape(-1)
        idx_k = kmask.reshape(-1).nonzero().reshape(-1)
        cu_q = packing.cu_seqlens_from_lengths(qmask.sum(-1))
        cu_k = packing.cu_seqlens_from_lengths(kmask.sum(-1))
        max_q, max_k = int(qmask.sum(-1).max()), int(kmask.sum(-1).max())
        if chunk is not None and _chunks_apply(lq, lk, chunk):
            cu_q, max_q = split_into_chunks(cu_q, idx_q.numel(), max_q, chunk)
            cu_k, max_k = cu_q, max_q
        out = varlen_attention(
            q.reshape(b * lq, hq, d).index_select(0, idx_q),
            k.reshape(b * lk, hkv, d).index_select(0, idx_k),
            v.reshape(b * lk, hkv, dv).index_select(0, idx_k),
            cu_q,
            cu_k,
            max_q,
            max_k,
            **common,
        )
        full = out.new_zeros(b * lq, hq, dv).index_copy(0, idx_q, out)
        return full.reshape(b, lq, hq, dv), None

    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        cu_q = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
        cu_k = cu_seq_lens_k.to(device=q.device, dtype=torch.int32)
        # The collator validated the layout (pf_trl.batching.collator.check_packed_batch). This last check reads no
        # value on the host: an asynchronous assert (raises at once on CPU, a device-side assert on CUDA), traced by
        # torch.compile like any op.
        torch._assert_async(
            (cu_q[-1] == b * lq) & (cu_k[-1] == b * lk),
            "pf_varlen: cu_seq_lens_q/k do not end at the number of query/key tokens the layer sees (a KV cache "
            "with past tokens cannot be combined with a packed batch)",
        )
        # Python ints from the collator; deriving them from cu_seqlens is a host sync (eager-only fallback)
        max_q = max_length_q if max_length_q is not None else packing.max_seqlen(cu_q)
        if lq == lk and cu_q.shape == cu_k.shape:
            # self-attention over the packed row: one layout (check_packed_batch checked max_length_k too). Handing
            # the kernel one tensor and one int lets it know so without reading values (the sdpa fast path). Not
            # comparing the two ints matters under compile: an equality between two symbolic int inputs made
            # inductor (torch 2.13) emit code that uses the dropped one.
            torch._assert_async(
                (cu_q == cu_k).all(), "pf_varlen: cu_seq_lens_q and cu_seq_lens_k differ for a self-attention batch"
            )
            cu_k, max_k = cu_q, max_q
        else:
            max_k = max_length_k if max_length_k is not None else packing.max_seqlen(cu_k)
    elif lq == lk:
        if position_ids is None:
            if b > 1:  # one row without positions is one sequence (an mRoPE model's plain forward passes none)
                _warn_once(
                    "no_position_ids",
                    "pf_varlen got neither position_ids nor cu_seq_lens: each row is treated as one sequence",
                )
            cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * lq
            max_q = lq
        else:
            cu_q, max_q = packing.cu_seqlens_from_positions(_row_positions(position_ids.to(q.device), b, lq))
        cu_k, max_k = cu_q, max_q
    else:
        # fewer queries than keys: a KV cache holds past tokens (generation); one sequence per row
        if position_ids is not None and rows_hold_several_segments(_row_positions(position_ids, b, lq)):
            raise PaddingFreeError(
                "packed position_ids together with a KV cache that holds past tokens: pf-trl cannot tell which "
                "cached keys belong to which sequence. Use use_cache=False for packed batches."
            )
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * lq
        cu_k = torch.arange(b + 1, dtype=torch.int32, device=q.device) * lk
        max_q, max_k = lq, lk
    if chunk is not None and _chunks_apply(lq, lk, chunk):
        cu_q, max_q = split_into_chunks(cu_q, b * lq, max_q, chunk)
        cu_k, max_k = cu_q, max_q
    out = varlen_attention(
        q.reshape(b * lq, hq, d),
        k.reshape(b * lk, hkv, d),
        v.reshape(b * lk, hkv, dv),
        cu_q,
        cu_k,
        max_q,
        max_k,
        **common,
    )
    return out.reshape(b, lq, hq, dv), None


def _chunks_apply(lq: int, lk: int, chunk: int) -> bool:
    """Self-attention: cut the segments into chunks. With a KV cache (fewer queries than keys) all keys must lie
    in the first chunk, where chunked attention is plain causal attention."""
    if lq == lk:
        return True
    if lk > chunk:
        raise UnsupportedFeatureError(
            f"pf_varlen: a chunked-attention layer (chunk {chunk}) with a KV cache longer than one chunk ({lk} keys) "
            "is not supported; generate with attn_implementation='sdpa'"
        )
    return False


def pf_varlen_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """``AttentionMaskInterface`` entry for ``pf_varlen``: hand the 2-D padding mask through (or ``None``).

    Like transformers' ``flash_attention_mask`` but an all-ones mask is kept, so that a mask passed with packed
    ``position_ids`` is still seen (and refused) by :func:`hf_varlen_attention`. Never builds a dense mask.
    """
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] > kv_length:
        attention_mask = attention_mask[:, -kv_length:]
    return attention_mask


def has_attention_interface() -> bool:
    try:
        from transformers.modeling_utils import AttentionInterface  # noqa: F401
    except ImportError:
        return False
    return True


def has_mask_interface() -> bool:
    try:
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError:
        return False
    return True


def register() -> bool:
    """Register ``pf_varlen`` with transformers (idempotent). False on transformers without AttentionInterface."""
    if not has_attention_interface():
        return False
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(PF_VARLEN, hf_varlen_attention)
    if has_mask_interface():
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(PF_VARLEN, pf_varlen_mask)
    return True
