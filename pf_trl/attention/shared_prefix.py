"""Shared prefixes in a packed row: the attention rule "this segment also sees that prefix segment".

A packed row holds segments; a segment may name an earlier segment of the row as its *prefix*. Such a segment's
queries attend to every key of its prefix and, causally, to its own keys: exactly the attention it would get as the
continuation of the prefix in a row of its own. GRPO and RLOO groups use it so that a prompt is forwarded once and
its ``G`` completions all see it (:mod:`pf_trl.trainer.rl`); the completions' ``position_ids`` continue from the
prefix length, as in the separate row.

The rule is carried by one keyword argument of the model call (:data:`SHARED_PREFIX_KEY`, a
:class:`SharedPrefixLayout`) that transformers passes down to the attention function; only pf-trl's ``pf_varlen``
attention reads it (:func:`pf_trl.attention.hf.hf_varlen_attention`), so a caller must check
:func:`shared_prefix_refusal` first: any other attention would ignore it and let the segments miss their prefix.

How every backend honours it (:func:`attend`): the keys and values of each segment with a prefix are laid out as
``[prefix keys, own keys]`` (one gather of the row's key/value tensors) and the call is a varlen attention with
``cu_seqlens_k`` differing from ``cu_seqlens_q``; causal attention is then bottom-right aligned, which puts query
``i`` of the segment at key position ``prefix_len + i``: the separate row's mask, windows included. The gather's
backward sums the gradients of the ``G`` uses of a prefix key into that key, as ``G`` copies of the prompt would sum
through the shared weights. Every varlen backend takes ``cu_seqlens_k != cu_seqlens_q`` (flash-attn's varlen kernels
and FlexAttention natively). On CPU the queries are laid out the same way (prefix copies, their outputs dropped), so
that PyTorch's fused flash kernel serves every segment (``attend(copy_queries=...)``).

Refused by name (:func:`shared_prefix_refusal`): models whose layers carry state along the row (conv, SSM, linear
attention: a completion would need the prefix's final state, which pf-trl does not split), chunked attention
(Llama 4), multimodal models, any attention implementation other than ``pf_varlen``, and, until a GPU run has checked
the bottom-right aligned path, models on an accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pf_trl.batching.packing import cu_seqlens_from_lengths
from pf_trl.errors import PackingError

__all__ = ["SHARED_PREFIX_KEY", "SharedPrefixLayout", "attend", "shared_prefix_layout", "shared_prefix_refusal"]

SHARED_PREFIX_KEY = "pf_shared_prefix"


@dataclass(frozen=True)
class SharedPrefixLayout:
    """Segments of one packed row of ``total`` tokens, some of which also see a prefix segment.

    Attributes:
        cu_seq_lens: int32 ``[n + 1]``, the queries of every segment (prefixes and the segments that see them).
        max_length: the longest segment (queries).
        key_index: long ``[total_k]``: the row token behind each key of the expanded key layout.
        cu_seq_lens_k: int32 ``[n + 1]``: each segment's keys in that layout (its prefix's, then its own).
        max_length_k: the most keys of one segment.
        own_rows: long ``[total]``: where each row token's own (not a prefix copy) entry sits in that layout.
    """

    cu_seq_lens: torch.Tensor
    max_length: int
    key_index: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_k: int
    own_rows: torch.Tensor

    def to(self, device: torch.device) -> SharedPrefixLayout:
        return SharedPrefixLayout(self.cu_seq_lens.to(device), self.max_length, self.key_index.to(device),
                                  self.cu_seq_lens_k.to(device), self.max_length_k, self.own_rows.to(device))


def shared_prefix_layout(lengths: Sequence[int], prefix_of: Sequence[int]) -> SharedPrefixLayout:
    """The layout of a row whose segments have ``lengths``; ``prefix_of[s]`` is the index of the earlier segment that
    segment ``s`` also sees, or ``-1``. A prefix must itself see no prefix (one level: a prompt and its answers)."""
    if len(lengths) != len(prefix_of):
        raise PackingError(f"{len(lengths)} segment lengths but {len(prefix_of)} prefix entries")
    starts = [0]
    for n in lengths:
        if int(n) <= 0:
            raise PackingError("a shared-prefix row holds an empty segment")
        starts.append(starts[-1] + int(n))
    pieces, key_lengths, own_rows = [], [], []
    expanded = 0
    for s, (n, p) in enumerate(zip(lengths, prefix_of)):
        own = torch.arange(starts[s], starts[s] + int(n))
        if p < 0:
            pieces.append(own)
            key_lengths.append(int(n))
            own_rows.append(torch.arange(expanded, expanded + int(n)))
            expanded += int(n)
            continue
        if not 0 <= p < s or prefix_of[p] >= 0:
            raise PackingError(f"segment {s} names {p} as its prefix: a prefix is an earlier segment without one")
        pieces.append(torch.cat([torch.arange(starts[p], starts[p + 1]), own]))
        key_lengths.append(int(lengths[p]) + int(n))
        own_rows.append(torch.arange(expanded + int(lengths[p]), expanded + key_lengths[-1]))
        expanded += key_lengths[-1]
    return SharedPrefixLayout(cu_seq_lens=cu_seqlens_from_lengths([int(n) for n in lengths]),
                              max_length=max(int(n) for n in lengths), key_index=torch.cat(pieces).long(),
                              cu_seq_lens_k=cu_seqlens_from_lengths(key_lengths), max_length_k=max(key_lengths),
                              own_rows=torch.cat(own_rows).long())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SharedPrefixLayout, *,
           copy_queries: bool | None = None, **options) -> torch.Tensor:
    """Varlen attention of one packed row under ``layout`` (see the module docstring): ``q`` ``(T, Hq, D)``, ``k``/``v``
    ``(T, Hkv, D)``; ``options`` are :func:`~pf_trl.attention.dispatch.varlen_attention`'s (``causal`` must be
    true: a non-causal segment seeing a prefix has no separate-row equivalent here).

    ``copy_queries`` (default: on CPU) also lays the queries out as ``[prefix queries, own queries]`` per segment, so
    that every segment has as many queries as keys and PyTorch's fused CPU flash kernel serves it (memory-linear,
    forward and backward); the prefix copies' outputs are dropped (their gradient is zero). It spends the attention
    scores of the prefix once more per segment (what a separate row spends) but no projection or MLP work; without
    it the segment's queries attend bottom-right aligned, which flash-attn and FlexAttention serve natively."""
    from pf_trl.attention.dispatch import varlen_attention

    if not options.get("causal", True):
        raise PackingError("shared prefixes need causal attention")
    index = layout.key_index.to(k.device)
    cu_q, cu_k = layout.cu_seq_lens.to(q.device), layout.cu_seq_lens_k.to(q.device)
    if copy_queries is None:
        copy_queries = q.device.type == "cpu"
    if not copy_queries:
        return varlen_attention(q, k.index_select(0, index), v.index_select(0, index), cu_q, cu_k, layout.max_length,
                                layout.max_length_k, **options)
    out = varlen_attention(q.index_select(0, index), k.index_select(0, index), v.index_select(0, index), cu_k, cu_k,
                           layout.max_length_k, layout.max_length_k, **options)
    return out.index_select(0, layout.own_rows.to(out.device))


def shared_prefix_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot attend shared prefixes exactly (``None``: it can). The model must have been made
    padding-free with ``mode="internal"`` (pf-trl's ``pf_varlen`` attention reads the layout)."""
    import pf_trl.attention.multimodal as multimodal
    from pf_trl.attention.stateful import stateful_mixers

    config = model.config
    if multimodal.is_multimodal(config):
        return f"{type(model).__name__} is a multimodal model; shared prefixes cover text models"
    if stateful_mixers(model):
        return (f"{type(model).__name__} has layers that carry state along the row (conv, SSM or linear attention); "
                "a completion would need its prompt's final state, which pf-trl does not split")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "chunked_attention" in (getattr(text, "layer_types", None) or ()):
        return f"{type(model).__name__} has chunked-attention layers, whose chunks would cross the prompt boundary"
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cpu":
        # the GPU kernels take the layout (bottom-right aligned causal varlen), but no GPU run has checked it yet
        return (f"shared prefixes are checked on CPU only so far, not on {device.type}; pf-trl packs every sequence "
                "with its prompt there (shared_prefix='off')")
    if getattr(model, "_pf_padding_free", {}).get("mode") != "internal":
        return "the model is not padding-free with mode='internal' (pf-trl's pf_varlen attention reads the layout)"
    return None
