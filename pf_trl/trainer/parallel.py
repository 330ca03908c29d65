"""Launch checks for data-parallel and sharded runs (DDP, DeepSpeed ZeRO, FSDP2), made when the config is built,
before the model loads.

- **Every process started is one rank.** ``torchrun --nproc_per_node N`` on a machine without a GPU and without
  ``use_cpu=True`` leaves accelerate with no distributed backend: each process would train alone, on the same
  batches. Refused, naming ``--use_cpu``.
- **DeepSpeed sees the same world as accelerate.** With ``use_cpu=True`` accelerate starts the gloo process group
  itself and leaves DeepSpeed's communication layer unset; a model loaded next under ZeRO-3 (``zero.Init``, the usual
  order) would size DeepSpeed's batch settings for one process and fail. DeepSpeed is handed the running process
  group (``deepspeed.comm.init_distributed``, which adopts an initialized one).
- **Sequence parallelism with ZeRO / FSDP is refused by name** (``sequence_parallel_size > 1`` together with
  ``deepspeed`` or ``fsdp``): its exactness with sharded parameters is not established.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("pf_trl.trainer")

__all__ = ["check_launch"]


def check_launch(args) -> None:
    """Raise ``ValueError`` for a launch pf-trl would train wrongly; connect DeepSpeed to the process group."""
    launched = _launched_world_size()
    if launched > 1 and args.world_size == 1:
        raise ValueError(
            f"{launched} processes were launched (WORLD_SIZE={launched}), but accelerate runs one: there is no GPU "
            "and use_cpu is not set, so each process would train the whole model alone on the same batches. Pass "
            "--use_cpu True (use_cpu=True) to train data-parallel on CPUs (gloo), or launch one process."
        )
    sp = int(getattr(args, "sequence_parallel_size", 1) or 1)
    if sp > 1 and (args.deepspeed or args.fsdp):
        from pf_trl.parallel.ulysses import ParallelismError

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
