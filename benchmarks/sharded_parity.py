"""Sharded training parity on CPU: pf-trl under DeepSpeed ZeRO-2/3 and FSDP2 against DDP and one process.

    python benchmarks/sharded_parity.py            # ~2 min on 2 cores; table on stdout, JSON in benchmarks/results/

Two ranks under ``torchrun`` (gloo), a tiny Llama (and a tied, soft-capped Gemma 2; LoRA on q/v and the head), 3
optimizer steps with gradient accumulation 2, the trainings of ``tests/sharded_harness.py`` (the harness of ``tests/test_sharded.py``).
For each run: how it is sharded, and the largest loss and parameter differences against plain DDP and against one
process accumulating both ranks' micro-batches on the same data. A resumed run is compared with the uninterrupted
one; the negative control is a ZeRO-3 run whose loss forgets the data-parallel world-size factor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "sharded_harness.py"
sys.path.insert(0, str(HARNESS.parent))
from sharded_harness import job, save_models  # noqa: E402  (the runs of tests/test_sharded.py)

RESULTS = ROOT / "benchmarks" / "results" / "sharded_parity_cpu.json"
MODES = ("internal", "huggingface")


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")


def measure(work: Path) -> list[dict]:
    models = save_models(work / "models")
    out = work / "runs"
    two_rank = [
        *[job(f"{s}_sgd_{m}", s, m) for m in MODES for s in ("ddp", "zero3", "fsdp2")],
        job("zero3_preloaded_sgd_internal", "zero3_preloaded"), job("zero2_sgd_internal", "zero2"),
        *[job(f"{s}_adamw_internal", s, optim="adamw", save_steps=1) for s in ("ddp", "zero3", "fsdp2")],
        *[job(f"{s}_adamw_resumed", s, optim="adamw", resume_from=str(out / f"{s}_adamw_internal" / "checkpoint-1"))
          for s in ("zero3", "fsdp2")],
        *[job(f"{s}_sgd_gemma2", s, model="gemma2") for s in ("ddp", "zero3")],
        *[job(f"{s}_sgd_lora", s, lora=True) for s in ("ddp", "zero3")],
        job("zero3_sgd_no_world_scale", "zero3", fault="no_world_scale"),
    ]
    single = [*[job(f"single_sgd_{m}", "single", m) for m in MODES], job("single_adamw_internal", "single",
                                                                             optim="adamw")]
    common = {"model": models["llama"], "models": models, "out": str(out), "zero3": str(ROOT / "k8s/deepspeed/zero3.json"),
              "zero2": str(ROOT / "k8s/deepspeed/zero2.json")}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "GLOO_SOCKET_IFNAME": "lo", "PF_TRL_CACHE": str(work / "cache")}
    for name, jobs in (("two_rank", two_rank), ("single", single)):
        (work / f"{name}.json").write_text(json.dumps({**common, "jobs": jobs}))
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    _run([torchrun, "--standalone", "--nproc_per_node", "2", str(HARNESS), str(work / "two_rank.json")], env)
    _run([sys.executable, str(HARNESS), str(work / "single.json")], env)

    def result(name):
        return json.loads((out / name / "result_0.json").read_text())

    def weights(name):
        return torch.load(out / name / "weights.pt")

    def diff(a, b):
        ra, rb, wa, wb = result(a), result(b), weights(a), weights(b)
        return (max(abs(x - y) for x, y in zip(ra["losses"], rb["losses"])),
                max(float((wa[k] - wb[k]).abs().max()) for k in wa))

    def sharding(r):
        if r["zero_stage"] == 3:
            at = f"{r['partitioned_at_load']} at load" if r["partitioned_at_load"] else "by deepspeed.initialize"
            return f"ZeRO-3: {r['ds_partitioned']}/{r['parameters']} params partitioned ({at}), local numel {r['local_numel']}"
        if r["zero_stage"] == 2:
            return "ZeRO-2: optimizer state partitioned" if r["zero2_partitioned_optimizer"] else "ZeRO-2: NOT partitioned"
        if r["is_fsdp_enabled"]:
            return f"FSDP2: {r['dtensor_local_smaller']}/{r['parameters']} DTensor params sharded"
        return "none (DDP)"

    rows = []
    for name, ddp, single_ref, tol in [
        *[(f"{s}_sgd_{m}", f"ddp_sgd_{m}", f"single_sgd_{m}", 1e-7) for m in MODES for s in ("zero3", "fsdp2")],
        ("zero3_preloaded_sgd_internal", "ddp_sgd_internal", "single_sgd_internal", 1e-7),
        ("zero2_sgd_internal", "ddp_sgd_internal", "single_sgd_internal", 1e-7),
        *[(f"{s}_adamw_internal", "ddp_adamw_internal", "single_adamw_internal", 1e-5) for s in ("zero3", "fsdp2")],
        ("zero3_sgd_gemma2", "ddp_sgd_gemma2", None, 1e-7),
        ("zero3_sgd_lora", "ddp_sgd_lora", None, 1e-7),
        ("zero3_sgd_no_world_scale", "ddp_sgd_internal", "single_sgd_internal", 1e-7),
    ]:
        r = result(name)
        loss_ddp, param_ddp = diff(name, ddp)
        loss_one, param_one = diff(name, single_ref) if single_ref else (None, None)
        rows.append({"run": name, "sharding": sharding(r), "loss_vs_ddp": loss_ddp, "param_vs_ddp": param_ddp,
                     "loss_vs_one_process": loss_one, "param_vs_one_process": param_one, "tolerance": tol,
                     "flop_params": r["flop_params"], "flop_params_sharded_model": r["flop_params_sharded_model"]})
    for s in ("zero3", "fsdp2"):
        loss, param = diff(f"{s}_adamw_resumed", f"{s}_adamw_internal")
        rows.append({"run": f"{s}_adamw_resumed (from checkpoint-1, vs uninterrupted)", "sharding": sharding(
            result(f"{s}_adamw_resumed")), "loss_vs_ddp": loss, "param_vs_ddp": param, "loss_vs_one_process": None,
                     "param_vs_one_process": None, "tolerance": 1e-7})
    return rows


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(RESULTS), help="JSON results file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pf-trl-sharded-") as tmp:
        rows = measure(Path(tmp))
    print("| run | sharding | max abs loss diff vs DDP | max abs param diff vs DDP | vs one process (loss / param) "
          "| tolerance |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['run']} | {r['sharding']} | {_fmt(r['loss_vs_ddp'])} | {_fmt(r['param_vs_ddp'])} | "
              f"{_fmt(r['loss_vs_one_process'])} / {_fmt(r['param_vs_one_process'])} | {_fmt(r['tolerance'])} |")
    Path(args.output).write_text(json.dumps({"setup": "2 CPU ranks (gloo), tiny Llama 2x64 (Gemma 2 tied), 3 steps, "
                                            "GA 2, token budget 120, SGD lr 0.05 / AdamW lr 1e-3",
                                             "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
