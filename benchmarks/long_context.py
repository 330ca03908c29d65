"""Peak memory of one optimizer step on one long packed row: pf-trl (both modes) beside TRL ``padding_free=True``.

Each run is a fresh subprocess training one step (tiny Llama, 2 layers x 256, 8 heads of 32, 4 KV heads, float32,
activation checkpointing on, CPU) on one packed row of ``T`` tokens made of the segments listed below (random token
ids, every token supervised). The parent samples the child's resident memory every 20 ms and kills it above
``--limit-mb`` (reported as ``> limit``); a finished child reports its own peak (``ru_maxrss``) and its resident
memory just before the step (``baseline``: Python, torch, the model, the optimizer's empty state). The table gives
``peak - baseline``: what the step itself costs. Growth per doubling is read off that column.

    python benchmarks/long_context.py [--sizes 8k 16k 32k 64k 128k] [--modes huggingface internal trl]
                                       [--limit-mb 8192] [--out benchmarks/results/long_context_cpu.json]

Modes: ``huggingface`` / ``internal``: :class:`pf_trl.PaddingFreeSFTTrainer` with ``padding_free`` set so, the token
budget equal to the row; ``trl``: stock ``SFTTrainer`` with TRL's ``padding_free=True`` and a batch of all segments.
The machine is shared: runs go one at a time, and a run does not start unless the machine has ``--limit-mb`` plus
1 GB available.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K = 1024
# packed rows and their segments (tokens); 8k-64k as in issue 21's table, 128k spans 4k-64k segments
ROWS = {
    "8k": (4 * K, 4 * K),
    "16k": (4 * K, 4 * K, 8 * K),
    "32k": (4 * K, 4 * K, 8 * K, 16 * K),
    "64k": (4 * K, 12 * K, 16 * K, 32 * K),
    "128k": (4 * K, 12 * K, 16 * K, 32 * K, 64 * K),
}
MODES = ("huggingface", "internal", "trl")
TINY = dict(num_hidden_layers=2, max_position_embeddings=131072)


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


# ------------------------------------------------------------------------------------------------ child


def child(mode: str, size: str, out_dir: str) -> dict:
    """One optimizer step on one packed row; returns the measurements (printed as JSON by ``--child``)."""
    import torch
    from datasets import Dataset

    from pf_trl.models import build_model

    torch.manual_seed(0)
    segments = ROWS[size]
    total = sum(segments)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 32000, (n,), generator=g).tolist()} for n in segments]
    for r in rows:
        r["labels"] = list(r["input_ids"])
    ds = Dataset.from_list(rows)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    common = dict(output_dir=out_dir, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                  learning_rate=1e-4, seed=0, max_steps=1, max_length=None, use_cpu=True, dataloader_num_workers=0,
                  activation_checkpointing=True, bf16=False)
    if mode == "trl":
        from trl import SFTConfig, SFTTrainer

        from pf_trl.data.tokenizer import load_tokenizer

        args = SFTConfig(padding_free=True, per_device_train_batch_size=len(segments), **common)
        trainer = SFTTrainer(model, args=args, train_dataset=ds, processing_class=load_tokenizer())
    else:
        from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

        args = PaddingFreeConfig(padding_free=mode, max_tokens_per_batch=total, **common)
        trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=ds)
    baseline = _rss_mb(os.getpid())
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    loss = next(h["train_loss"] for h in trainer.state.log_history if "train_loss" in h)
    return {"mode": mode, "size": size, "tokens": total, "segments": list(segments), "baseline_mb": round(baseline),
            "peak_mb": round(peak), "step_mb": round(peak - baseline), "seconds": round(seconds, 1),
            "loss": loss, "status": "ok"}


# ------------------------------------------------------------------------------------------------ parent


def run_one(mode: str, size: str, limit_mb: float) -> dict:
    need = limit_mb + 1024
    if _available_mb() < need:
        return {"mode": mode, "size": size, "status": f"skipped: less than {need:.0f} MB available"}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        proc = subprocess.Popen([sys.executable, __file__, "--child", mode, size, tmp, str(result_file)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = 0.0
        killed = False
        while proc.poll() is None:
            rss = _rss_mb(proc.pid)
            seen = max(seen, rss)
            if rss > limit_mb:
                proc.kill()
                killed = True
                break
            time.sleep(0.02)
        output = proc.communicate()[0]
        if killed:
            return {"mode": mode, "size": size, "tokens": sum(ROWS[size]), "status": "killed",
                    "peak_mb": f"> {limit_mb:.0f}"}
        if proc.returncode != 0 or not result_file.is_file():
            return {"mode": mode, "size": size, "status": f"failed (rc={proc.returncode})", "log": output[-2000:]}
        return {**json.loads(result_file.read_text()), "sampled_peak_mb": round(seen)}


def table(results: list[dict], sizes: list[str], modes: list[str]) -> str:
    labels = {"huggingface": "pf-trl `huggingface`", "internal": "pf-trl `internal`", "trl": "TRL `padding_free=True`"}
    by = {(r["mode"], r["size"]): r for r in results}
    lines = ["| packed row (segments) | " + " | ".join(labels[m] for m in modes) + " |",
             "|---|" + "---|" * len(modes)]
    for size in sizes:
        segs = ", ".join(f"{n // K}k" for n in ROWS[size])
        cells = []
        for m in modes:
            r = by.get((m, size))
            if r is None:
                cells.append("-")
            elif r["status"] == "ok":
                cells.append(f"{r['step_mb']:,} MB ({r['peak_mb']:,} peak, {r['seconds']:.0f} s)")
            elif r["status"] == "killed":
                cells.append(f"{r['peak_mb']} MB (killed)")
            else:
                cells.append(r["status"].split(":")[0])
        lines.append(f"| {size} ({segs}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def growth(results: list[dict], mode: str, sizes: list[str]) -> list[float]:
    by = {r["size"]: r for r in results if r["mode"] == mode and r["status"] == "ok"}
    out = []
    for a, b in zip(sizes, sizes[1:]):
        if a in by and b in by and by[a]["step_mb"] > 0:
            out.append(round(by[b]["step_mb"] / by[a]["step_mb"], 2))
    return out


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, mode, size, tmp, result_file = sys.argv
        sys.path.insert(0, str(ROOT))
        Path(result_file).write_text(json.dumps(child(mode, size, tmp)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--limit-mb", type=float, default=8192)
    parser.add_argument("--skip-after-kill", action="store_true", default=True,
                        help="do not run a mode at larger sizes once it was killed (default)")
    parser.add_argument("--label", default="", help="a note stored with the results (e.g. before/after)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = []
    dead: set[str] = set()
    for size in args.sizes:
        for mode in args.modes:
            if mode in dead:
                results.append({"mode": mode, "size": size, "status": "not run: killed at a smaller row"})
                continue
            r = run_one(mode, size, args.limit_mb)
            print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
            if r["status"] != "ok" and "log" in r:
                print(r["log"], file=sys.stderr)
            if r["status"] == "killed" and args.skip_after_kill:
                dead.add(mode)
            results.append(r)
    print()
    print(table(results, args.sizes, args.modes))
    for mode in args.modes:
        print(f"growth per doubling of the step's memory ({mode}): {growth(results, mode, args.sizes)}")
    if args.out:
        import platform

        import torch
        import transformers
        import trl

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "label": args.label, "limit_mb": args.limit_mb, "rows": {s: list(ROWS[s]) for s in args.sizes},
            "model": "pf-trl/tiny-llama, 2 layers x 256, 8 heads of 32, 4 KV heads, float32, activation checkpointing",
            "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "trl": trl.__version__, "python": platform.python_version(), "cpus": os.cpu_count()},
            "results": results,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
