"""Parallelism settings pf-trl cannot keep exact, refused when the trainer is built, each by name.

- ``parallelism_config`` (accelerate's ``ParallelismConfig``): data-parallel dimensions (``dp_replicate_size``,
  ``dp_shard_size``) are what pf-trl's sampler and loss normalisation already handle. Context parallelism
  (``cp_size`` > 1) splits ``input_ids`` but not ``cu_seq_lens`` and its ranks would get different rows; tensor
  parallelism (``tp_size`` > 1) and accelerate's own sequence parallelism (``sp_size`` > 1) are not verified with
  packed rows; any field this version of pf-trl does not know is refused rather than guessed at. In every mode,
  ``padding_free="none"`` included (TRL's own packing guard does not see pf-trl's batches).
- A model sharded for tensor parallelism at load time (``tp_plan``), DeepSpeed AutoTP.
- ``sequence_parallel_size`` > 1 (pf-trl's Ulysses, :mod:`pf_trl.parallel.ulysses`) together with something that
  breaks its exactness: padded batches, FSDP, DeepSpeed ZeRO-3, ``torch_compile``, per-rank token averaging, a
  ``compute_loss_func`` (it would see one rank's logits), the MoE load-balancing loss (a function of the whole row's
  routing), or heads that do not split over the group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pf_trl.parallel.ulysses import ParallelismError, SequenceParallelError, check_heads

# ParallelismConfig fields whose meaning pf-trl knows (accelerate 1.12 - 1.16)
_DATA_PARALLEL = ("dp_replicate_size", "dp_shard_size")
_REFUSED = {
    "cp_size": "context parallelism (cp_size > 1) splits input_ids but not cu_seq_lens, and the sampler would give "
               "the ranks of a group different rows",
    "tp_size": "tensor parallelism (tp_size > 1) is not verified with packed rows",
    "sp_size": "accelerate's sequence parallelism (sp_size > 1, DeepSpeed ALST) is not verified with packed rows; "
               "pf-trl's own Ulysses sequence parallelism is sequence_parallel_size",
}
_SECONDARY = ("cp_backend", "sp_backend", "tp_handler", "cp_handler", "sp_handler")


def parallelism_config_refusal(pc: Any) -> str | None:
    """Why pf-trl refuses accelerate's ``ParallelismConfig`` ``pc`` (``None``: accepted)."""
    if pc is None:
        return None
    for name, why in _REFUSED.items():
        size = getattr(pc, name, None)
        if size is not None and int(size) > 1:
            return f"parallelism_config.{name}={size}: {why}"
    known = set(_DATA_PARALLEL) | set(_REFUSED) | set(_SECONDARY)
    fields = [f.name for f in dataclasses.fields(pc)] if dataclasses.is_dataclass(pc) else list(vars(pc))
    for name in fields:
        value = getattr(pc, name, None)
        if name not in known and name != "total_size" and value not in (None, 1, False):
            return (f"parallelism_config.{name}={value!r} is a setting this pf-trl does not know, so it cannot "
                    "promise the loss stays exact")
    return None


def _tensor_parallel(model, args) -> str | None:
    size = getattr(model, "_tp_size", None) or getattr(model, "tp_size", None)
    if size is not None and int(size) > 1:
        return f"the model is sharded for tensor parallelism (tp_size={size})"
    ds = getattr(args, "hf_deepspeed_config", None)
    config = getattr(ds, "config", None) or {}
    autotp = (config.get("tensor_parallel") or {}).get("autotp_size", 1) if isinstance(config, dict) else 1
    if autotp and int(autotp) > 1:
        return f"DeepSpeed AutoTP (tensor_parallel.autotp_size={autotp})"
    return None


def _zero3(args) -> bool:
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is not None and hasattr(ds, "is_zero3"):
        return bool(ds.is_zero3())
    return False


def sequence_parallel_refusal(args, model=None) -> str | None:
    """Why ``sequence_parallel_size`` cannot be kept exact with these ``args`` / ``model`` (``None``: it can)."""
    size = int(getattr(args, "sequence_parallel_size", 1) or 1)
    if size == 1:
        return None
    name = f"sequence_parallel_size={size}"
    if getattr(args, "padding_free_mode", args.padding_free) == "none":
        return f"{name} runs on packed rows; it needs padding_free_mode='internal' or 'huggingface'"
    if getattr(args, "fsdp", None):
        return f"{name} with FSDP is not exact yet (sharded parameters across the sequence group); use DDP"
    if _zero3(args):
        return f"{name} with DeepSpeed ZeRO-3 is not exact yet; use DDP"
    if getattr(args, "torch_compile", False):
        return f"{name} with torch_compile is not supported (the all-to-all is not traced)"
    if not getattr(args, "average_tokens_across_devices", True):
        return (f"{name} needs average_tokens_across_devices=True: a packed row's tokens are split across the "
                "ranks of its group, so only the global token count gives the padded run's loss")
    if model is not None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "output_router_logits", False):
            return (f"{name} with the MoE load-balancing loss (output_router_logits): the loss is a function of the "
                    "whole row's routing, and each rank routes its own tokens")
        from pf_trl.attention.multimodal import is_multimodal
        from pf_trl.attention.stateful import stateful_mixers

        if is_multimodal(model.config):
            return (f"{name} with a vision-language model: only the text tokens are split over the group (an image's "
                    "tokens and its features would land on different ranks)")
        mixers = stateful_mixers(model)
        if mixers:
            return (f"{name} with recurrent / convolutional layers ({type(mixers[0][1]).__name__}): each rank would "
                    "run them over its own slice of the row; only attention layers see the whole row")
        try:
            check_heads(model.config, size)
        except SequenceParallelError as exc:
            return str(exc)
    return None


def check_parallelism(args, model=None, *, compute_loss_func=None) -> None:
    """Raise :class:`ParallelismError` naming the first parallelism setting pf-trl cannot keep exact."""
    reason = parallelism_config_refusal(getattr(args, "parallelism_config", None))
    reason = reason or (_tensor_parallel(model, args) if model is not None else None)
    reason = reason or sequence_parallel_refusal(args, model)
    if reason is None and compute_loss_func is not None and int(getattr(args, "sequence_parallel_size", 1) or 1) > 1:
        reason = (f"sequence_parallel_size={args.sequence_parallel_size} with compute_loss_func: the function would "
                  "see one rank's share of the row's logits")
    size = int(getattr(args, "sequence_parallel_size", 1) or 1)
    if reason is None and size > 1 and int(getattr(args, "world_size", 1) or 1) < size:
        # refused before any data is prepared: one process cannot hold a group
        reason = (f"sequence_parallel_size={size} needs {size} processes or more in one torch.distributed job; "
                  f"launch with torchrun --nproc_per_node {size} (or more)")
    if reason is not None:
        raise ParallelismError(f"pf-trl cannot keep this run exact: {reason}.")
