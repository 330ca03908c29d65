"""Before a multi-process run trains, every rank proves it sees the same ``output_dir``, and all take one decision on
the checkpoint to resume from.

Checkpoints are written by several ranks into one folder (rank 0 the model, optimizer and trainer state, every rank
its ``rng_state_<rank>.pth``): on a cluster that folder must be one shared volume mounted at the same path in every
pod. A per-pod volume (a ``ReadWriteOnce`` claim, an ``emptyDir``, a node's disk) trains without complaint and only
fails, obscurely, at the resume. So at the start rank 0 writes a file with a fresh random name into ``output_dir``,
sends the name to every rank, and each rank looks for it (waiting a little: a network filesystem may cache a
directory listing for up to a minute); if any rank does not see it, every rank stops with one line naming the
folder and the fix.

The same exchange carries rank 0's reading of ``resume_from_checkpoint="auto"``, so that all ranks resume from the
same checkpoint even when their views of a network filesystem lag behind each other.

``save_on_each_node=True`` means each node keeps its own copy on purpose: the file check is skipped, and the ranks
only compare the checkpoint each of them found.
"""

from __future__ import annotations

import os
import secrets
import socket
import time

from pf_trl.errors import PfTrlError
from pf_trl.trainer.checkpoints import is_auto, resolve_auto

__all__ = ["SharedOutputError", "WAIT_ENV", "agree_on_output_dir"]

WAIT_ENV = "PF_TRL_SHARED_DIR_WAIT_S"  # how long a rank looks for rank 0's file (default 60 s)
_PROBE = ".pf-trl-shared-{nonce}"


class SharedOutputError(PfTrlError, RuntimeError):
    """The ranks of one run do not see the same ``output_dir`` (or disagree on the checkpoint to resume from)."""


def _wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, "60")))
    except ValueError:
        return 60.0


def _sees(path: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if os.path.isfile(path):
            return True
        if time.monotonic() >= deadline:
            return False
        try:
            os.listdir(os.path.dirname(path) or ".")  # a fresh listing revalidates a cached one (NFS)
        except OSError:
            pass  # the folder itself is not there (yet): not shared, unless it appears in time
        time.sleep(0.5)


def agree_on_output_dir(output_dir: str, resume_from_checkpoint, *, save_on_each_node: bool = False,
                        save_total_limit: int | None = None):
    """``resume_from_checkpoint`` as every rank will use it (``"auto"`` resolved), after checking that all ranks of
    the process group share ``output_dir``. A single process only resolves ``"auto"``.

    Raises:
        SharedOutputError: a rank does not see rank 0's file in ``output_dir``, or (``save_on_each_node``) the
            ranks found different checkpoints.
    """
    import torch.distributed as dist

    auto = is_auto(resume_from_checkpoint)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return resolve_auto(output_dir, save_total_limit=save_total_limit) if auto else resume_from_checkpoint
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()
    say = print if rank == 0 else (lambda *_: None)
    if save_on_each_node:
        choice = resume_from_checkpoint
        if auto:
            choice = resolve_auto(output_dir, say=say, save_total_limit=save_total_limit)
        choices: list = [None] * world
        dist.all_gather_object(choices, (rank, host, os.path.basename(str(choice)) if choice else None))
        if len({c[2] for c in choices}) > 1:
            found = ", ".join(f"rank {r} ({h}): {c or 'none'}" for r, h, c in choices)
            raise SharedOutputError(f"save_on_each_node: the ranks found different checkpoints to resume from in "
                                    f"{output_dir} ({found}); give every node the same checkpoints or resume from a "
                                    "path")
        return choice
    payload: list = [None]
    probe = None
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, _PROBE.format(nonce=secrets.token_hex(8)))
        with open(probe, "w", encoding="utf-8") as f:
            f.write(host)
        payload = [{"probe": os.path.basename(probe), "host": host,
                    "choice": resolve_auto(output_dir, save_total_limit=save_total_limit) if auto
                    else resume_from_checkpoint}]
    dist.broadcast_object_list(payload, src=0)
    sent = payload[0]
    seen = True if rank == 0 else _sees(os.path.join(output_dir, sent["probe"]), _wait_s())
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, (rank, host, seen))
    if probe is not None:
        os.remove(probe)
    blind = [(r, h) for r, h, ok in verdicts if not ok]
    if blind:
        who = ", ".join(f"rank {r} on {h}" for r, h in blind[:4]) + (" ..." if len(blind) > 4 else "")
        raise SharedOutputError(
            f"output_dir {output_dir} is not shared: {who} cannot see the file rank 0 on {sent['host']} wrote there, "
            "so checkpoints would be split between pods and no resume could work; mount one ReadWriteMany volume "
            "(k8s/storage.yaml: pf-trl-outputs) at the same path in every pod (or set save_on_each_node if each "
            "node is meant to keep its own copy)")
    return sent["choice"]
