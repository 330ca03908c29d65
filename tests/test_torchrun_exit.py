"""`pf-trl torchrun`: a worker's exit 2 (pf-trl's "bad input") is the launcher's exit 2, so the Kubernetes templates'
podFailurePolicy rule (exit 2: fail the Job, no retry) fires through torchrun; a crash stays a retryable 1.

Real torchrun launches (static rendezvous on 127.0.0.1, as the multi-node templates start it) of a tiny worker that
imports nothing heavy; the negative control is plain torchrun, which exits 1 for the same worker.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
# rank 0 waits (it is stopped by torchrun when its peer fails); rank 1 ends as told
WORKER = textwrap.dedent("""
    import os, signal, sys, time
    how = sys.argv[1]
    rank = int(os.environ["RANK"])
    if how == "all-exit-2" or (how == "rank1-exit-2" and rank == 1):
        print(f"pf-trl train: error: rank {rank}: bad input", file=sys.stderr, flush=True)
        sys.exit(2)
    if how == "rank1-crash" and rank == 1:
        raise RuntimeError("a worker crash")
    if how == "rank1-killed" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, a segfault
    time.sleep(60)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(launcher: list[str], worker: Path, how: str, tmp_path: Path) -> subprocess.CompletedProcess:
    argv = [*launcher, "--nnodes=1", "--node_rank=0", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}", "--monitor_interval=0.1", str(worker), how]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "TORCHELASTIC"))}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env, check=False)


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("torchrun") / "worker.py"
    path.write_text(WORKER, encoding="utf-8")
    return path


def _pf_trl() -> list[str]:
    exe = shutil.which("pf-trl", path=str(BIN))
    return [exe, "torchrun"] if exe else [sys.executable, "-m", "pf_trl.cli.main", "torchrun"]


@pytest.mark.slow
@pytest.mark.parametrize("how,status", [("all-exit-2", 2), ("rank1-exit-2", 2), ("rank1-crash", 1),
                                        ("rank1-killed", 1)])
def test_pf_trl_torchrun_keeps_a_workers_exit_2(worker, tmp_path, how, status):
    """A worker's exit 2 stays 2, a crash or a kill stays 1 (a success exits 0: the launch of
    test_ranks_leave_together_and_tear_the_group_down)."""
    proc = _launch(_pf_trl(), worker, how, tmp_path)
    assert proc.returncode == status, proc.stderr[-3000:]
    if status == 2:
        line = [x for x in proc.stderr.splitlines() if x.startswith("pf-trl torchrun: ")]
        assert line and "exited 2 (bad input" in line[0], proc.stderr[-3000:]
        assert "ChildFailedError" in proc.stderr  # torchrun's own summary is still there
    elif status == 1:
        assert "pf-trl torchrun: " not in proc.stderr and "ChildFailedError" in proc.stderr


@pytest.mark.slow
def test_plain_torchrun_exits_1_for_a_workers_exit_2(worker, tmp_path):
    """The negative control: why the templates launch through `pf-trl torchrun`."""
    torchrun = shutil.which("torchrun", path=str(BIN)) or shutil.which("torchrun")
    proc = _launch([torchrun], worker, "all-exit-2", tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"exitcode\s*: 2 ", proc.stderr), proc.stderr[-3000:]  # the worker's status, in its summary


@pytest.mark.slow  # imports torch's elastic launcher (seconds)
def test_exit_status_reads_the_root_cause():
    """The first failure torchrun observed decides (a peer it stopped itself afterwards, -15, does not)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pf_trl.parallel.launch import exit_status

    def failure(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")

    assert exit_status(ChildFailedError("w", {1: failure(1, 2), 0: failure(0, -15)})) == 2
    assert exit_status(ChildFailedError("w", {1: failure(1, -9), 0: failure(0, 2)})) == 1
    assert exit_status(ChildFailedError("w", {0: failure(0, 1)})) == 1


LEAVER = textwrap.dedent("""
    import json, os, sys, time
    import torch.distributed as dist
    from pf_trl.parallel.launch import leave_process_group
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(float(sys.argv[1]))  # still writing, as rank 0 writes the model at the end of a run
    start = time.monotonic()
    leave_process_group()
    json.dump({"waited": time.monotonic() - start, "initialized": dist.is_initialized()},
              open(f"rank{rank}.json", "w"))
""")


@pytest.mark.slow
def test_ranks_leave_together_and_tear_the_group_down(tmp_path):
    """pf-trl train's last call: a rank that is done waits for the one still working, then every rank destroys the
    process group (none leaves while a peer still works on it)."""
    import json

    script = tmp_path / "leaver.py"
    script.write_text(LEAVER, encoding="utf-8")
    proc = _launch(_pf_trl(), script, "1.5", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["waited"] >= 1.0 > r1["waited"]  # rank 0 left only when rank 1 was done
    assert r0["initialized"] is False and r1["initialized"] is False
