"""How a distributed pf-trl run ends: torchrun with pf-trl's exit status, and the ranks leaving together.

**Exit status.** A worker's "bad input" (exit 2) stays exit 2 through the launcher.

torchrun exits 1 whenever a worker fails, whatever the worker's own status was, so a Kubernetes Job's
``podFailurePolicy`` rule "exit code 2: fail the Job, do not retry" (pf-trl's user errors: a wrong flag, a missing
manifest, wrong credentials) never matched a pod that ran torchrun: the Job retried a run that could only fail again.
:func:`run_torchrun` runs torchrun in this process (same PID, same signal handling and log) and, when it fails,
reads the exit status of the failure torchrun itself names as the root cause (the first one it observed, from its
``ChildFailedError``): 2 there gives exit 2; anything else (a crash, a signal, a collective that broke because a peer
died) stays exit 1, which the templates retry.

**Leaving together.** Without a last synchronization the ranks of a run leave one by one: after the final save the
other ranks exit while rank 0 is still writing the model, and their interpreters tear the process group down
(gloo's sockets and threads) while a peer still works on it, which now and then aborts the process ("terminate
called without an active exception", exit -6) on a loaded machine. The run's work is done, but torchrun on that
node then reports a failure and leaves without its exit barrier, and torchrun on rank 0's node waits that barrier's
300 s after "model saved": the job hangs, then fails. :func:`leave_process_group` ends every rank at a barrier (the
model is written) and destroys the process group on all of them, as torch asks before a program exits.
"""

from __future__ import annotations

import sys

USER_ERROR = 2  # pf-trl's exit status for bad input (a retry cannot help)
FAILED = 1  # torchrun's own status for a failed worker (retryable)


def exit_status(error) -> int:
    """The launcher's exit status for torchrun's ``ChildFailedError``: 2 when the root-cause failure (the first one
    torchrun observed; the workers it stopped itself afterwards come later) exited 2, else 1."""
    _, failure = error.get_first_failure()
    return USER_ERROR if failure.exitcode == USER_ERROR else FAILED


def run_torchrun(argv: list[str]) -> int:
    """Run ``torchrun ARGV`` in this process; its exit status, with a worker's exit 2 kept (:func:`exit_status`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)  # torchrun's own summary (ranks, exit codes)
        rank, failure = exc.get_first_failure()
        status = exit_status(exc)
        if status == USER_ERROR:
            print(f"pf-trl torchrun: rank {rank} exited {failure.exitcode} (bad input: its message is above); "
                  f"exit {USER_ERROR}, which the Kubernetes templates do not retry", file=sys.stderr, flush=True)
        return status
    return 0


def leave_process_group(wait_for_everyone=None) -> None:
    """The end of a run under torch.distributed: every rank waits until all are done (rank 0 may still be writing the
    model), then the process group is destroyed on every rank. ``wait_for_everyone``: the barrier to use (the
    trainer's ``accelerator.wait_for_everyone``, which knows its backend); ``torch.distributed.barrier`` when None.
    Nothing to do in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    (wait_for_everyone or dist.barrier)()
    dist.destroy_process_group()
