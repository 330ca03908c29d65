"""Ulysses sequence parallelism over packed rows.

``sequence_parallel_size = P`` splits the world into groups of ``P`` consecutive ranks. Every rank of a group holds
the same packed row (the sampler counts groups, not ranks) and keeps ``1/P`` of its tokens through the model
(:func:`shard_batch`). In each attention layer an all-to-all turns "my tokens, all heads" into "all tokens, my
``H/P`` heads" (:func:`sequence_to_heads`), so the layer's own attention (pf-trl's varlen kernels, or transformers'
flash path) sees the whole packed row with its unchanged ``cu_seq_lens`` for a slice of heads; a second all-to-all
brings the output back (:func:`heads_to_sequence`). Both are differentiable
(``torch.distributed.nn.functional.all_to_all_single``), so the backward exchanges gradients the same way, and
every rank's parameter gradient holds the contribution of every token it touched: the usual data-parallel
gradient averaging over all ranks then yields the exact gradient of the global loss.

Where heads do not split evenly: query heads must be a multiple of ``P``; key/value heads either are too, or divide
``P`` (then each is repeated ``P / kv_heads`` times before the exchange, as DeepSpeed-Ulysses does); anything else is
refused. The exchange uses the group's own process group (gloo on CPU, NCCL on CUDA).

The layer learns that it runs sharded through a keyword argument, ``pf_sp``, that the trainer adds to the model call
and transformers forwards to the attention function (also when activation checkpointing recomputes a layer); a call
without it (generation, a probe) attends locally. :func:`check_kwargs_reach_attention` proves, once per model, that
every attention call receives it, else sequence parallelism is refused for that model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from pf_trl.attention.errors import PaddingFreeError
from pf_trl.attention.precision import autocast_dtype, autocast_qkv
from pf_trl.batching.packing import shift_labels

ULYSSES = "pf_ulysses"
SP_KWARG = "pf_sp"
_INNER_ATTR = "_pf_sp_inner"


class ParallelismError(PaddingFreeError, ValueError):
    """A parallelism setting pf-trl cannot keep exact (refused when the trainer is built)."""


class SequenceParallelError(ParallelismError):
    """A sequence-parallel setting pf-trl cannot keep exact, or ranks of a group that disagree."""


@dataclass(frozen=True)
class SequenceParallelGroup:
    """This rank's sequence-parallel group: ``size`` ranks, this one at ``rank``; ``index`` of ``count`` groups."""

    size: int
    rank: int
    index: int
    count: int
    group: Any = None  # torch.distributed ProcessGroup

    @classmethod
    def create(cls, size: int) -> SequenceParallelGroup:
        """Groups of ``size`` consecutive ranks (every rank must call this, in the same order)."""
        import torch.distributed as dist

        if size == 1:
            return cls(1, 0, dist.get_rank() if dist.is_initialized() else 0,
                       dist.get_world_size() if dist.is_initialized() else 1)
        if not (dist.is_available() and dist.is_initialized()):
            raise SequenceParallelError(
                f"sequence_parallel_size={size} needs {size} processes or more in one torch.distributed job; launch "
                f"with torchrun --nproc_per_node {size} (or more)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise SequenceParallelError(
                f"sequence_parallel_size={size} does not divide the world size {world}; use a divisor of it")
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = group
        return cls(size, rank % size, rank // size, world // size, mine)


# ------------------------------------------------------------------------------------------------ the exchange


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x (P, ...)``: block ``i`` goes to rank ``i`` of the group; returns the blocks received, by sender."""
    from torch.distributed.nn.functional import all_to_all_single

    x = x.contiguous()  # the collective reads and writes flat buffers: both must be contiguous
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    with warnings.catch_warnings():
        # torch points to its private _functional_collectives instead; the public autograd op still works
        warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)
        return all_to_all_single(out, x, group=group)


def sequence_to_heads(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``(1, H, T/P, D)`` (local tokens, all heads) -> ``(1, H/P, T, D)`` (all tokens, this rank's heads)."""
    _, heads, local, dim = x.shape
    blocks = x.reshape(sp.size, heads // sp.size, local, dim)  # block j: the heads of rank j
    received = _all_to_all(blocks, sp.group)  # block i: my heads on rank i's tokens
    return received.permute(1, 0, 2, 3).reshape(1, heads // sp.size, sp.size * local, dim)


def heads_to_sequence(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``(1, T, H/P, D)`` (all tokens, this rank's heads) -> ``(1, T/P, H, D)`` (local tokens, all heads)."""
    _, total, heads, dim = x.shape
    local = total // sp.size
    blocks = x.reshape(sp.size, local, heads, dim)  # block j: rank j's tokens
    received = _all_to_all(blocks, sp.group)  # block i: rank i's heads on my tokens
    return received.permute(1, 0, 2, 3).reshape(1, local, sp.size * heads, dim)


def _repeat_kv_for(x: torch.Tensor, size: int) -> torch.Tensor:
    kv = x.shape[1]
    return x if kv % size == 0 else x.repeat_interleave(size // kv, dim=1)


def _head_slice(value, sp: SequenceParallelGroup, heads: int):
    """A per-head tensor (attention sinks ``(H,)``) cut to this rank's heads."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == heads:
        per = heads // sp.size
        return value[sp.rank * per:(sp.rank + 1) * per]
    return value


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function: the model's own attention over the whole row for a slice of heads."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sp: SequenceParallelGroup | None = kwargs.pop(SP_KWARG, None)
    inner = ALL_ATTENTION_FUNCTIONS[getattr(module, _INNER_ATTR)]
    if sp is None or sp.size == 1:
        return inner(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None or query.shape[0] != 1:
        raise SequenceParallelError("sequence parallelism runs on one packed row without attention_mask")
    heads = query.shape[1]
    # under autocast, exchange q/k/v in the dtype attention computes in (half the bytes of a float32 rotary output;
    # the kernel would cast them the same way on arrival)
    if autocast_dtype(query.device.type) is not None:
        query, key, value = autocast_qkv(query, key, value)
    q = sequence_to_heads(query, sp)
    k = sequence_to_heads(_repeat_kv_for(key, sp.size), sp)
    v = sequence_to_heads(_repeat_kv_for(value, sp.size), sp)
    # the kernel finds the segments in the collator's cu_seq_lens of the whole row; the local position_ids only
    # served the rotary embedding
    kwargs.pop("position_ids", None)
    for name in ("s_aux", "sinks"):
        if name in kwargs:
            kwargs[name] = _head_slice(kwargs[name], sp, heads)
    out, _ = inner(module, q, k, v, None, **kwargs)
    return heads_to_sequence(out, sp), None


def install(model: torch.nn.Module) -> None:
    """Wrap the model's (padding-free) attention implementation in :func:`ulysses_attention` (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    impl = model.config._attn_implementation
    if impl == ULYSSES:
        return
    AttentionInterface.register(ULYSSES, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    for module in model.modules():
        setattr(module, _INNER_ATTR, impl)
    model.set_attn_implementation(ULYSSES)
    if model.config._attn_implementation != ULYSSES:
        raise SequenceParallelError(f"{type(model).__name__} cannot switch its attention implementation; it cannot "
                                    "run sequence parallel")


def check_heads(config, size: int) -> None:
    """Refuse head counts that cannot be split over ``size`` ranks (see the module docstring)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not heads or heads % size:
        raise SequenceParallelError(
            f"sequence_parallel_size={size} must divide the number of attention heads ({heads}): each rank attends "
            "to a whole number of heads")
    if kv % size and size % kv:
        raise SequenceParallelError(
            f"sequence_parallel_size={size} and {kv} key/value heads: one must divide the other")


def check_kwargs_reach_attention(model: torch.nn.Module) -> None:
    """A tiny forward that proves every attention call receives the ``pf_sp`` keyword (else: refused)."""
    calls = {"with": 0, "without": 0}
    from transformers.modeling_utils import AttentionInterface

    impl = model.config._attn_implementation

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls["with" if kwargs.get(SP_KWARG) is not None else "without"] += 1
        kwargs.pop(SP_KWARG, None)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[getattr(module, _INNER_ATTR)](module, query, key, value, attention_mask,
                                                                     **kwargs)

    AttentionInterface.register(ULYSSES, probe)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5]], device=device), use_cache=False,
                  **{SP_KWARG: SequenceParallelGroup(1, 0, 0, 1)})
    finally:
        model.train(was_training)
        AttentionInterface.register(ULYSSES, ulysses_attention)
    if impl != ULYSSES or calls["without"] or not calls["with"]:
        raise SequenceParallelError(
            f"{type(model).__name__} does not pass keyword arguments through to every attention call "
            f"({calls['with']} of {calls['with'] + calls['without']} did): it cannot run sequence parallel")


# ------------------------------------------------------------------------------------------------ the batch


def shard_batch(batch: dict[str, Any], sp: SequenceParallelGroup) -> dict[str, Any]:
    """This rank's share of a packed row (its length a multiple of ``sp.size``).

    ``input_ids`` / ``position_ids`` keep the rank's ``T/P`` consecutive tokens; ``labels`` become ``shift_labels``
    (the label each local position predicts, shifted over the whole row first so the targets across a rank border
    are kept); ``cu_seq_lens`` and ``max_length`` still describe the whole row (the attention sees it whole).
    """
    ids = batch["input_ids"]
    total = ids.shape[-1]
    if total % sp.size:
        raise SequenceParallelError(f"a packed row of {total} tokens does not split over {sp.size} ranks")
    local = total // sp.size
    lo, hi = sp.rank * local, (sp.rank + 1) * local
    out = dict(batch)
    out["input_ids"] = ids[:, lo:hi]
    out["position_ids"] = batch["position_ids"][:, lo:hi]
    labels = batch.get("labels")
    if labels is not None:
        out.pop("labels")
        out["shift_labels"] = shift_labels(labels)[:, lo:hi]
    return out


def row_fingerprint(batch: dict[str, Any]) -> torch.Tensor:
    """Two int64 numbers that differ between different packed rows (length and a position-weighted id sum)."""
    ids = batch["input_ids"].reshape(-1).to(torch.int64)
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64, device=ids.device) % 1_000_003
    return torch.stack([torch.tensor(ids.numel(), device=ids.device), (ids * weights).sum() % (2**61 - 1)])


def check_same_row(batch: dict[str, Any], sp: SequenceParallelGroup, device: torch.device | None = None) -> None:
    """Raise unless every rank of the group holds the same packed row (two small all-reduces on the group;
    ``device``: where the process group's backend wants the tensor, e.g. CUDA for NCCL)."""
    import torch.distributed as dist

    mine = row_fingerprint(batch).to(device or "cpu")
    high, low = mine.clone(), mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=sp.group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=sp.group)
    if not torch.equal(high, low):
        raise SequenceParallelError(
            f"the ranks of sequence-parallel group {sp.index} hold different packed rows (token counts "
            f"{int(low[0])}..{int(high[0])}): every rank of a group must get the same batch")
