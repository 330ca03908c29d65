"""Parameters sharded by DeepSpeed ZeRO-3 or FSDP2: their full sizes, and forwards run outside the training engine.

Under ZeRO-3 every parameter of a model loaded after the DeepSpeed config (``zero.Init``, the usual order) holds an
empty local tensor: only its owning module's forward, inside the DeepSpeed engine, materializes it. pf-trl reads
weights outside that engine in a few places (the padding-free self-check, the LM head probe, the FLOP count of the
metrics), so each goes through this module:

- :func:`full_numel` / :func:`full_shape`: a parameter's size as the model defines it (``ds_numel`` / ``ds_shape``
  under ZeRO-3; a ``DTensor``'s ``numel()`` and ``shape`` are already global);
- :func:`gathered_forward`: while a short forward runs outside the engine, each module gathers its own ZeRO-3
  partitions just before its forward and releases them right after (what the engine's hooks do): the peak is one
  module's weights, never the whole model. Every rank must run the same forward (the gathers are collectives), which
  holds where pf-trl uses it: each rank builds the trainer with the same model.

FSDP2 modules (``fully_shard``) gather their own shards in their forward hooks, with or without a trainer, so they
need nothing here beyond :func:`full_numel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["full_numel", "full_shape", "gathered_forward", "is_zero3_partitioned"]


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """True for a DeepSpeed ZeRO-3 parameter (it carries ``ds_id``; its local tensor is a partition or empty)."""
    return hasattr(param, "ds_id")


def full_numel(param: torch.Tensor) -> int:
    """Elements of ``param`` as the model defines it, whichever rank holds them."""
    if is_zero3_partitioned(param):
        return int(param.ds_numel)
    return int(param.numel())  # a DTensor's numel() is its global size


def full_shape(param: torch.Tensor) -> torch.Size:
    """Shape of ``param`` as the model defines it (ZeRO-3: ``ds_shape``; a DTensor's shape is global)."""
    if is_zero3_partitioned(param):
        return torch.Size(param.ds_shape)
    return param.shape


@contextlib.contextmanager
def gathered_forward(model: torch.nn.Module) -> Iterator[None]:
    """Let ``model`` run forwards outside the DeepSpeed engine while its parameters are ZeRO-3 partitions.

    Each module with partitioned parameters of its own gathers them (``deepspeed.zero.GatheredParameters``) in a
    forward pre-hook and partitions them again in a forward hook; on leaving the context every hook is removed and
    anything still gathered (a forward that raised) is released. A no-op when nothing is partitioned. For short,
    gradient-free forwards (``torch.no_grad``): the self-check and the head probe.
    """
    owners = [m for m in model.modules() if any(is_zero3_partitioned(p) for p in m.parameters(recurse=False))]
    if not owners:
        yield
        return
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    open_contexts: dict[int, list] = {}

    def gather(module, args):
        params = [p for p in module.parameters(recurse=False)
                  if is_zero3_partitioned(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        context = deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params))
        context.__enter__()
        open_contexts.setdefault(id(module), []).append(context)

    def release(module, args, output):
        stack = open_contexts.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = []
    for module in owners:
        handles.append(module.register_forward_pre_hook(gather))
        handles.append(module.register_forward_hook(release))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for stack in open_contexts.values():
            while stack:
                stack.pop().__exit__(None, None, None)
