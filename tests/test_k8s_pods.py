"""The multi-node PyTorchJob as a cluster runs it: rendered (kustomize when installed), then each replica started
as its pod would be (the container's command and args, the environment the Kubeflow training-operator injects:
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE; every volume a folder:
the claims shared between the pods, ConfigMaps filled from their generator files, emptyDirs per pod), two
``torchrun --nnodes 2`` processes on 127.0.0.1, CPU, gloo, a tiny model.

The job's args are edited only as docs/kubernetes.md tells a platform engineer to: the merged shards of the Indexed
Job instead of the service, and flags appended to the job's args (which override the ConfigMap's) to make the run
tiny. A pod is killed as a whole (SIGKILL to its torchrun and every process under it) like a preempted pod.

- uninterrupted: both pods train to the end; every checkpoint's completion marker lists both ranks' files, so one
  that lost rank 1's file (or its marker) is not taken by ``--resume_from_checkpoint auto``, and both ranks take rank
  0's choice; ranks whose output folders are not one volume are refused, every rank, naming the volume (checked on
  two plain ranks of one gloo group: seconds);
- (extended lane) killed after a checkpoint, restarted with the same command line: it resumes by itself and ends with
  the same step, tokens seen and weights as the uninterrupted run; a checkpoint cut short is not taken; beside it, a
  pod whose output volume is not the other's is refused at start, on both pods, with one line naming the volume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
MAX_STEPS, SAVE_STEPS = 6, 2


def _rendered_pytorchjob() -> dict:
    kubectl = shutil.which("kubectl") or shutil.which("kubectl", path=os.path.dirname(sys.executable))
    if kubectl:
        out = subprocess.run([kubectl, "kustomize", str(K8S / "multinode")], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    else:
        out = (K8S / "multinode" / "pytorchjob.yaml").read_text(encoding="utf-8")
    (job,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PyTorchJob"]
    return job


def _configmap_files() -> dict[str, dict[str, Path]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    out: dict[str, dict[str, Path]] = {}
    for gen in kustomization["configMapGenerator"]:
        out[gen["name"]] = {key: K8S / src for key, _, src in (e.partition("=") for e in gen["files"])}
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Folders for the volumes of the PyTorchJob's pods, and the pods' processes."""

    def __init__(self, root: Path, shards: Path):
        self.root = root
        self.job = _rendered_pytorchjob()
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.claims = root / "claims"
        for name, files in _configmap_files().items():
            folder = root / "configmaps" / name
            folder.mkdir(parents=True, exist_ok=True)
            for key, src in files.items():
                shutil.copy(src, folder / key)
        (self.claims / "pf-trl-cache" / "merged").mkdir(parents=True)
        shutil.copytree(shards, self.claims / "pf-trl-cache" / "merged" / "big")  # the merge Job's output

    def pod(self, rtype: str, rank: int, port: int, *, outputs: str = "pf-trl-outputs",
            own_outputs: bool = False) -> tuple[list[str], dict]:
        """(argv, env) of the pod of replica ``rtype`` (node rank ``rank``); ``outputs``: the folder standing for
        the output claim, ``own_outputs``: one such folder per pod."""
        spec = self.job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]
        (c,) = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {}
        for m in c["volumeMounts"]:
            v = volumes[m["name"]]
            if "configMap" in v:
                host = self.root / "configmaps" / v["configMap"]["name"]
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                if m["mountPath"] == "/outputs":
                    assert claim == "pf-trl-outputs"
                    # own_outputs: each pod its own copy (a ReadWriteOnce volume, a node's disk)
                    claim = f"{outputs}-pod{rank}" if own_outputs else outputs
                host = self.claims / claim
            else:
                host = self.root / f"pod{rank}" / m["name"]
            host.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = host

        def host_path(value: str) -> str:
            at = "@" if value.startswith("@/") else ""
            path = value[len(at):]
            for mount in sorted(mounts, key=len, reverse=True):
                if path == mount or path.startswith(mount + "/"):
                    return at + str(mounts[mount]) + path[len(mount):]
            return value

        injected = {  # the operator, nprocPerNode 1 (one CPU process per pod)
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
            "PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1",
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "TORCHELASTIC"))}
        env.update(injected)
        for e in c["env"]:
            env[e["name"]] = host_path(e["value"]) if "value" in e else f"<{e['name']}>"
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   PF_TRL_SHARED_DIR_WAIT_S="2", PYTHONFAULTHANDLER="1")  # a stuck process's stack: see _wait
        env.pop("CUDA_VISIBLE_DEVICES", None)
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in [*c["command"], *c["args"]]]
        # docs/kubernetes.md: the Indexed-Job route replaces the two --dataset_* flags with the merged shards
        i = argv.index("--dataset_service_url")
        assert argv[i + 2] == "--dataset_id"
        argv[i:i + 4] = ["--training_data_path", "/cache/merged/big"]
        # flags appended to the job's args override the ConfigMap's: a tiny CPU run
        argv += ["--model_overrides", TINY, "--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS),
                 "--logging_steps", "1", "--use_cpu", "True", "--include_num_input_tokens_seen", "true",
                 "--gradient_checkpointing", "False", "--dataloader_num_workers", "0",
                 "--per_device_train_batch_size", "1"]
        argv = [host_path(a) for a in argv]
        assert argv[:2] == ["python", str(mounts["/etc/pf-trl/scripts"] / "with_args_file.py")]
        assert argv[2:4] == ["pf-trl", "torchrun"]
        argv[0] = sys.executable
        argv[2] = shutil.which("pf-trl", path=os.path.dirname(sys.executable)) or "pf-trl"
        return argv, env

    def outputs(self, claim: str = "pf-trl-outputs") -> Path:
        """The host folder of the job's --output_dir on the folder ``claim`` standing for the output claim."""
        (c,) = self.job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
        return self.claims / claim / Path(c["args"][c["args"].index("--output_dir") + 1]).name

    def start(self, tag: str, **kw) -> list[subprocess.Popen]:
        """The two pods of the job (Master: node rank 0, Worker: 1), started at once."""
        port = _free_port()
        procs = self.procs[tag] = []
        for rank, rtype in enumerate(("Master", "Worker")):
            argv, env = self.pod(rtype, rank, port, **kw)
            log = open(self.root / f"{tag}-pod{rank}.log", "w")
            procs.append(subprocess.Popen(argv, env=env, cwd=str(self.root), stdout=log, stderr=subprocess.STDOUT))
        return procs

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL a pod: its torchrun and every process under it (torchrun starts its workers in their own
        sessions, as a container's processes are all killed with it)."""
        try:
            tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            tree = []
        for pid in tree:
            try:
                os.kill(pid, signal.SIGSTOP)  # frozen first: none of them can start another process meanwhile
            except ProcessLookupError:
                pass
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def log(self, tag: str, rank: int) -> str:
        return (self.root / f"{tag}-pod{rank}.log").read_text(encoding="utf-8", errors="replace")


def _wait(procs, tag, cluster, timeout=420) -> list[int]:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            stuck = _dump_stuck(procs)
            for q in procs:
                cluster.kill(q)
            pytest.fail(f"{tag} did not finish; still running: {stuck}\n"
                        + "\n".join(f"--- pod {rank} ---\n" + cluster.log(tag, rank)[-4000:] for rank in (0, 1)))
    return [p.returncode for p in procs]


def _dump_stuck(procs) -> list[str]:
    """The processes of the pods still running (torchrun and its workers), each made to print the Python stack of
    every thread into its pod's log (SIGABRT; PYTHONFAULTHANDLER is set in the pods) before the pods are killed."""
    alive = []
    for rank, p in enumerate(procs):
        try:
            tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in reversed(tree):  # the workers first, then their torchrun
            try:
                role = "torchrun" if proc.pid == p.pid else "worker"
                alive.append(f"pod {rank} {role} pid {proc.pid} ({proc.status()})")
                proc.send_signal(signal.SIGABRT)
            except psutil.NoSuchProcess:
                pass
        time.sleep(2)
    return alive


def _final(out: Path) -> dict:
    state = json.loads((out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    return {"global_step": state["global_step"], "num_input_tokens_seen": state["num_input_tokens_seen"],
            "losses": [h["loss"] for h in state["log_history"] if "loss" in h]}


def _weights(out: Path):
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def pods(tmp_path_factory, sample_shards):
    """The rendered job's two pods, run uninterrupted to the end (``whole``)."""
    if sys.platform != "linux":
        pytest.skip("loopback gloo and /proc: Linux")
    cluster = Cluster(tmp_path_factory.mktemp("k8s_pods"), sample_shards)
    try:
        cluster.rc = {"whole": _wait(cluster.start("whole", outputs="whole"), "whole", cluster)}
        yield cluster
    finally:  # no pod outlives the module
        _kill_all(cluster)


def _kill_all(cluster: Cluster) -> None:
    for procs in cluster.procs.values():
        for p in procs:
            if p.poll() is None:
                cluster.kill(p)


@pytest.mark.slow
def test_rendered_pods_train_and_a_volume_not_shared_is_refused(pods, tmp_path):
    from pf_trl.trainer.checkpoints import COMPLETE_MARKER, checkpoint_problem, latest_complete_checkpoint

    cluster = pods
    assert cluster.rc["whole"] == [0, 0], cluster.log("whole", 0)[-3000:]
    out = cluster.outputs("whole")
    assert "auto: no complete checkpoint" in cluster.log("whole", 0)  # the job's `--resume_from_checkpoint auto`
    whole = _final(out)
    assert whole["global_step"] == MAX_STEPS == len(whole["losses"]) and whole["num_input_tokens_seen"] > 0
    assert _weights(out)
    # every checkpoint of the two pods is complete: its marker, written once both ranks saved their part, lists the
    # files of both (rank 1's rng state included) ...
    steps = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert steps == [MAX_STEPS - SAVE_STEPS, MAX_STEPS], steps  # the job's --save_total_limit 2
    for step in steps:
        folder = out / f"checkpoint-{step}"
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
        assert marker["world_size"] == 2 and {"rng_state_0.pth", "rng_state_1.pth"} <= set(marker["files"]), marker
        assert checkpoint_problem(folder) is None
    # ... so a newest checkpoint that lost rank 1's file is not taken, nor one cut short before its marker (a copy)
    copy = tmp_path / "outputs"
    shutil.copytree(out, copy)
    (copy / f"checkpoint-{MAX_STEPS}" / "rng_state_1.pth").unlink()
    cut = copy / f"checkpoint-{MAX_STEPS + SAVE_STEPS}"
    shutil.copytree(copy / f"checkpoint-{MAX_STEPS - SAVE_STEPS}", cut)
    (cut / COMPLETE_MARKER).unlink()
    found, skipped = latest_complete_checkpoint(copy)
    assert found == copy / f"checkpoint-{MAX_STEPS - SAVE_STEPS}"
    assert [(f.name, why.split(" ")[0]) for f, why in skipped] == [
        (cut.name, "no"), (f"checkpoint-{MAX_STEPS}", "rng_state_1.pth")], skipped

    # what `pf-trl train` decides on two ranks before it trains: both take rank 0's reading of `auto` on the shared
    # folder; ranks whose output folders are not one volume (as a ReadWriteOnce claim mounts it) are refused, every
    # rank, naming the claim and the fix (the control: the same ranks on the shared folder go on)
    said = _agree(copy, tmp_path / "own", tmp_path)
    for rank in (0, 1):
        assert said[rank]["shared"] == {"choice": str(found)}, said
        error = said[rank]["own"].get("error", "")
        assert "is not shared" in error and "pf-trl-outputs" in error and "ReadWriteMany" in error, said
    assert not list((tmp_path / "own-pod0").iterdir())  # rank 0's probe file removed: nothing written


AGREE = """
import json, os, sys
import torch.distributed as dist
from pf_trl.trainer.shared_output import SharedOutputError, agree_on_output_dir
dist.init_process_group("gloo")
rank = dist.get_rank()
said = {}
for case, folder in (("shared", sys.argv[1]), ("own", f"{sys.argv[2]}-pod{rank}")):
    try:
        said[case] = {"choice": agree_on_output_dir(folder, "auto")}
    except SharedOutputError as exc:
        said[case] = {"error": str(exc)}
with open(os.path.join(sys.argv[3], f"agree_{rank}.json"), "w") as f:
    json.dump(said, f)
dist.barrier()
sys.stdout.flush()
os._exit(0)  # without gloo's C++ teardown (tests/test_distributed.py)
"""


def _agree(shared: Path, own: Path, out: Path) -> list[dict]:
    """What ``pf-trl train`` decides on two ranks before it trains (pf_trl/trainer/shared_output.py), in two plain
    processes of one gloo group (no trainer: seconds): ``shared`` for both ranks, then ``OWN-pod<rank>`` each."""
    script = out / "agree.py"
    script.write_text(AGREE, encoding="utf-8")
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MASTER_", "TORCHELASTIC"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   PF_TRL_SHARED_DIR_WAIT_S="0.5")
        procs.append(subprocess.Popen([sys.executable, str(script), str(shared), str(own), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    said = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], said
    return [json.loads((out / f"agree_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.extended
def test_pods_killed_and_restarted_resume_exactly(pods):
    """Both pods SIGKILLed after a checkpoint, restarted with the same command line: the run resumes by itself (a
    newer checkpoint cut short is not taken) and ends as the uninterrupted run of the ``pods`` fixture.

    Extended lane: its parts are proven in the main lane, faster: a run SIGKILLed (its whole process tree) after a
    checkpoint and restarted with the same command resumes from the latest complete checkpoint, skips one cut short,
    and ends with the uninterrupted run's losses (tests/test_bucket_training.py::test_two_nodes_share_only_a_bucket,
    tests/test_resume_auto.py::test_auto_resumes_from_the_latest_complete_checkpoint); two ranks resume exactly from
    their checkpoint (tests/test_sharded.py::test_resume_from_a_sharded_checkpoint_is_exact,
    tests/test_streaming.py::test_stream_under_ddp_two_ranks_packs_and_resumes_exactly); the two pods' markers list
    both ranks' files, and a checkpoint missing rank 1's file or its marker is not taken, and both ranks take rank 0's
    reading of ``auto`` (test_rendered_pods_train_and_a_volume_not_shared_is_refused above).

    Beside the restart, the rendered pods with an output volume each (a ReadWriteOnce claim) are refused at start;
    the main lane proves the parts: the ranks' refusal (the test above, two ranks of one gloo group), a worker's exit 2
    kept by `pf-trl torchrun` (tests/test_torchrun_exit.py::test_pf_trl_torchrun_keeps_a_workers_exit_2) and a
    refusal's one line ``pf-trl train: error: ...`` with exit 2 (tests/test_bucket_training.py's refusals)."""
    import torch

    cluster = pods
    assert cluster.rc["whole"] == [0, 0], cluster.log("whole", 0)[-3000:]
    try:
        _kill_and_restart(cluster, torch)
    finally:
        _kill_all(cluster)


def _kill_and_restart(cluster: Cluster, torch) -> None:
    out = cluster.outputs()
    victim = cluster.start("killed")
    # SIGKILL both pods (a preemption) once a complete checkpoint is on the shared volume
    deadline = time.time() + 300
    while not list(out.glob("checkpoint-*/pf_trl_checkpoint_complete.json")):
        assert time.time() < deadline and all(p.poll() is None for p in victim), cluster.log("killed", 0)[-3000:]
        time.sleep(0.05)
    for p in victim:
        cluster.kill(p)
    time.sleep(0.5)
    assert not [c for c in psutil.process_iter(["cmdline"]) if str(cluster.root) in " ".join(c.info["cmdline"] or [])
                and "pf_trl.cli.main" in " ".join(c.info["cmdline"] or [])
                and "pf-trl-outputs/" in " ".join(c.info["cmdline"] or [])], "a process of a killed pod survived"
    done = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert done and max(done) < MAX_STEPS and not (out / "train_results.json").exists(), "killed too late"
    # a save cut short by the kill (the kill may also have cut one itself): a newer checkpoint folder without its
    # marker and without a rank's file
    complete = max(int(p.parent.name.split("-")[1]) for p in out.glob("checkpoint-*/pf_trl_checkpoint_complete.json"))
    cut = out / f"checkpoint-{max(done) + SAVE_STEPS}"
    shutil.copytree(out / f"checkpoint-{complete}", cut)
    (cut / "pf_trl_checkpoint_complete.json").unlink()
    (cut / "rng_state_1.pth").unlink()
    # the operator restarts the pods: the same command line; beside them, pods whose output volumes are not shared
    restarted = cluster.start("restarted")
    rwo = cluster.start("rwo", outputs="rwo", own_outputs=True)
    # the pods without a shared output volume stopped at start, both, with one line naming the volume
    assert _wait(rwo, "rwo", cluster) == [2, 2]  # the worker's "bad input", kept by `pf-trl torchrun` (torchrun: 1)
    for rank in (0, 1):
        log = cluster.log("rwo", rank)
        assert re.search(r"exitcode\s*: 2 ", log), log[-3000:]  # the worker's: pf-trl's "bad input"
        lines = [line for line in log.splitlines() if "is not shared" in line]
        assert lines, log[-3000:]
        assert "pf-trl-outputs" in lines[0] and "ReadWriteMany" in lines[0] and lines[0].startswith("pf-trl train: ")
    assert not list((cluster.claims / "rwo-pod0").rglob("checkpoint-*")), "refused before the first step"
    assert _wait(restarted, "restarted", cluster) == [0, 0], cluster.log("restarted", 0)[-3000:]
    said = cluster.log("restarted", 0)
    assert f"{cut} is not complete" in said
    resumed_from = int(re.search(r"auto: resuming from \S*checkpoint-(\d+)", said).group(1))
    assert 0 < resumed_from < MAX_STEPS
    a, b = _final(cluster.outputs("whole")), _final(out)
    assert b["global_step"] == a["global_step"] == MAX_STEPS
    assert b["num_input_tokens_seen"] == a["num_input_tokens_seen"] > 0
    assert b["losses"][-(MAX_STEPS - resumed_from):] == pytest.approx(a["losses"][resumed_from:], rel=1e-4)
    wa, wb = _weights(cluster.outputs("whole")), _weights(out)
    assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6) for k in wa)
