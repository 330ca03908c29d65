"""Parallelism settings pf-trl cannot keep exact, refused by name: at launch (:func:`check_launch`, when the config is
built, before the model loads) and when the trainer is built (:func:`check_parallelism`).

At launch (DDP, DeepSpeed ZeRO, FSDP2):

- **Every process started is one rank.** ``torchrun --nproc_per_node N`` on a machine without a GPU and without
  ``use_cpu=True`` leaves accelerate with no distributed backend: each process would train alone, on the same
  batches. Refused, naming ``--use_cpu``.
- **DeepSpeed sees the same world as accelerate.** With ``use_cpu=True`` accelerate starts the gloo process group
  itself and leaves DeepSpeed's communication layer unset; a model loaded next under ZeRO-3 (``zero.Init``, the usual
  order) would size DeepSpeed's batch settings for one process and fail. DeepSpeed is handed the running process
  group (``deepspeed.comm.init_distributed``, which adopts an initialized one).
- **Sequence parallelism with ZeRO / FSDP** (``sequence_parallel_size > 1`` together with ``deepspeed`` or
  ``fsdp``): its exactness with sharded parameters is not established.

When the trainer is built:

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
import logging
import os
from typing import Any

from pf_trl.parallel.ulysses import ParallelismError, SequenceParallelError, check_heads

__all__ = ["check_launch", "check_parallelism", "parallelism_config_refusal", "sequence_parallel_refusal"]

logger = logging.getLogger("pf_trl.trainer")

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


# ---------------------------------------------------------------------------------------------- at launch


def check_launch(args) -> None:
    """Raise :class:`ParallelismError` for a launch pf-trl would train wrongly; connect DeepSpeed to the process
    group. Called by the config (before the model loads: ZeRO-3 partitions it at load with DeepSpeed's world size)."""
    launched = _launched_world_size()
    if launched > 1 and args.world_size == 1:
        raise ParallelismError(
            f"{launched} processes were launched (WORLD_SIZE={launched}), but accelerate runs one: there is no GPU "
            "and use_cpu is not set, so each process would train the whole model alone on the same batches. Pass "
            "--use_cpu True (use_cpu=True) to train data-parallel on CPUs (gloo), or launch one process."
        )
    sp = int(getattr(args, "sequence_parallel_size", 1) or 1)
    if sp > 1 and (args.deepspeed or args.fsdp):
        with_what = "deepspeed (ZeRO)" if args.deepspeed else "fsdp"
        raise ParallelismError(
            f"sequence_parallel_size={sp} with {with_what} is not supported by pf-trl: the sharded parameters under "
            "sequence parallelism are not tested exact. Use sequence_parallel_size=1 with ZeRO / FSDP, or sequence "
            "parallelism with plain data parallelism."
        )
    if args.deepspeed:
        _adopt_process_group_for_deepspeed()


def _launched_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def _adopt_process_group_for_deepspeed() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return  # a single process, or accelerate lets DeepSpeed start the group itself (GPUs)
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        return
    # adopts the running group (no second rendezvous): DeepSpeed's world is then accelerate's
    ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    logger.info("pf-trl: DeepSpeed uses the running %s process group (%d ranks)", dist.get_backend(),
                dist.get_world_size())
