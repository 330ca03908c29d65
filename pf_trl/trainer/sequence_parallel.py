"""The trainer's side of sequence parallelism (``sequence_parallel_size`` > 1, :mod:`pf_trl.parallel.ulysses`).

- data: the sampler counts groups, not ranks (``num_replicas`` = groups, ``rank`` = this rank's group), so the ranks
  of a group draw the same batch; the collator pads the row to a multiple of the group size (its dummy segment,
  labels -100);
- step: :func:`shard_inputs` checks that the group holds one row (a fingerprint all-reduced on the group), keeps this
  rank's tokens and adds the ``pf_sp`` keyword that the attention layers read;
- loss: each rank sums the objective over its own supervised positions; transformers' ``num_items_in_batch`` is
  gathered over all ranks from the whole rows, so :func:`global_token_count` divides it by the group size; the usual
  division by the world size (DDP averages gradients over all ranks) then gives every rank's share of the exact
  global mean, and the all-to-all's backward carries each token's gradient to the rank that holds it.
"""

from __future__ import annotations

from typing import Any

import torch

from pf_trl.parallel.ulysses import (
    SP_KWARG,
    SequenceParallelError,
    SequenceParallelGroup,
    check_kwargs_reach_attention,
    check_same_row,
    install,
    shard_batch,
)


def setup(model: torch.nn.Module, size: int) -> SequenceParallelGroup | None:
    """Process groups and the all-to-all attention for ``model`` (the transformers model); ``None`` when off."""
    if size <= 1:
        return None
    from pf_trl.attention.hf import has_attention_interface, has_mask_interface

    if not (has_attention_interface() and has_mask_interface()):
        raise SequenceParallelError("sequence_parallel_size needs transformers >= 4.53 (AttentionMaskInterface)")
    group = SequenceParallelGroup.create(size)
    install(model)
    check_kwargs_reach_attention(model)
    return group


def sampler_topology(sp: SequenceParallelGroup | None, world: int, rank: int) -> tuple[int, int]:
    """``(num_replicas, rank)`` for the token-budget sampler: groups of ranks share a batch."""
    if sp is None:
        return world, rank
    return sp.count, sp.index


def global_token_count(count: torch.Tensor, sp: SequenceParallelGroup | None) -> torch.Tensor:
    """Supervised tokens of the step, from counts gathered over all ranks of whole rows (each row ``size`` times)."""
    return count if sp is None else count // sp.size


def shard_inputs(inputs: dict[str, Any], sp: SequenceParallelGroup, device: torch.device) -> dict[str, Any]:
    """This rank's part of the group's packed row, with the ``pf_sp`` keyword for the attention layers."""
    check_same_row(inputs, sp, device)
    local = shard_batch(inputs, sp)
    local[SP_KWARG] = sp
    return local


def collator_multiple(pad_to_multiple_of: int | None, size: int) -> int | None:
    """``pad_to_multiple_of`` for the collator: a row must split evenly over the group."""
    if size <= 1:
        return pad_to_multiple_of
    base = pad_to_multiple_of or 1
    import math

    return base * size // math.gcd(base, size)
