"""One 131,072-token packed row of a ~1B Llama on one GPU: peak memory, tokens/s and MFU of each optimizer step.

``PaddingFreeSFTTrainer`` (``padding_free_mode="internal"``, varlen backend ``auto``), bf16 weights, activation
checkpointing, AdamW; every row holds the same segments, 4k + 12k + 16k + 32k + 64k tokens (every token
supervised), packed in dataset order (``train_sampling_strategy="sequential"``), so every step has the same
composition. One warm-up step (allocator, kernel JIT), then ``--steps`` timed steps (default 3), each
CUDA-synchronized (:class:`pf_trl.benchmarking.steady.StepTimer`). The JSON holds every step's seconds, tokens and
MFU; the headline tokens/s is over all timed steps. MFU: model FLOPs (6 x body parameters x tokens + 6 x LM head
parameters x supervised tokens + 6 x layers x hidden x sum of squared segment lengths, no recomputation) / seconds /
989 TFLOP/s (H100 / H200 dense bf16); HFU adds the recomputation (checkpointing's second forward, the scores
recomputed by the flash backward): :mod:`pf_trl.trainer.metrics`.

    python benchmarks/gpu/long_row.py [--out DIR] [--backend auto] [--steps 3] [--dry-run]

``--dry-run``: the tiny Llama on CPU with a 960-token row (checks the script; memory is the process's peak RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

K = 1024
SEGMENTS = (4 * K, 12 * K, 16 * K, 32 * K, 64 * K)  # 131,072 tokens
DRY_SEGMENTS = (64, 128, 256, 512)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the one warm-up step")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.attention.dispatch import resolve_backend
    from pf_trl.benchmarking.e2e import HFU_FORMULA, MFU_FORMULA, versions
    from pf_trl.benchmarking.steady import StepTimer, summarize
    from pf_trl.models import build_model
    from pf_trl.trainer.metrics import detect_peak_tflops, model_flop_params

    cuda = torch.cuda.is_available() and not args.dry_run
    segments = DRY_SEGMENTS if args.dry_run else SEGMENTS
    name = "pf-trl/tiny-llama" if args.dry_run else "pf-trl/llama-1b"
    total = sum(segments)
    steps = 1 + args.steps
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(steps):  # one row per step, each the same segments in the same order
        for n in segments:
            ids = torch.randint(3, 4096 if args.dry_run else 32000, (n,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": ids})
    overrides = dict(num_hidden_layers=2, vocab_size=4096) if args.dry_run else {}
    model = build_model(name, attn_implementation="sdpa", seed=0, max_position_embeddings=total,
                        torch_dtype=torch.bfloat16 if cuda else None, **overrides)
    if cuda:
        model = model.cuda()
    config = PaddingFreeConfig(
        output_dir=str(args.out / "long_row"), report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        padding_free_mode="internal", attention_backend=args.backend, max_tokens_per_batch=total, max_steps=steps,
        train_sampling_strategy="sequential", learning_rate=1e-5, max_length=None, bf16=cuda, use_cpu=not cuda,
        dataloader_num_workers=0, activation_checkpointing=True, seed=0)
    held = {}
    timer = StepTimer(lambda: held["trainer"].pf_metrics.meter, warmup_steps=1, min_steps=args.steps,
                      min_seconds=float("inf"), cuda=cuda)
    trainer = held["trainer"] = PaddingFreeSFTTrainer(model, args=config, train_dataset=Dataset.from_list(rows),
                                                      callbacks=[timer])
    flop_params = model_flop_params(trainer.model)
    peak = detect_peak_tflops(torch.device("cuda"), torch.bfloat16) if cuda else None
    trainer.train()
    record = {**timer.record(), "recompute": {"activation_checkpointing": True, "flash_recompute": cuda}}
    summary = summarize(record, flop_params=flop_params, peak_tflops=peak)
    per_step = [summarize({"warmup_steps": 0, "steps": [s], "gpu_memory_bytes": {}, "recompute": record["recompute"]},
                          flop_params=flop_params, peak_tflops=peak) for s in record["steps"]]
    device = torch.device("cuda" if cuda else "cpu")
    backend = resolve_backend(args.backend, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                              head_dim=model.config.hidden_size // model.config.num_attention_heads, gqa=True,
                              requires_grad=True)
    kernel = None
    if backend == "flash_attn":
        from pf_trl.attention.backends.flash_attn import kernel_for

        kernel = kernel_for(device)[0]
    composition = [s["examples"] for s in record["steps"]]
    result = {
        "model": name, "device": torch.cuda.get_device_name() if cuda else "cpu", "backend": backend,
        "flash_kernel": kernel, "versions": versions(), "row_tokens": total, "segments": list(segments),
        "order": "sequential (train_sampling_strategy='sequential'): every step the same segments",
        "segments_per_step": composition, "warmup_steps": 1, "timed_steps": args.steps,
        "flop_params": list(flop_params), "peak_tflops": peak,
        "steps": record["steps"], "step_seconds": [round(s["seconds"], 3) for s in record["steps"]],
        "step_mfu": [p["mfu"] for p in per_step], "step_hfu": [p["hfu"] for p in per_step],
        "recompute": record["recompute"], "hfu": summary["hfu"], "mfu_formula": MFU_FORMULA,
        "hfu_formula": HFU_FORMULA,
        "step_tokens_per_second": [p["real_tokens_per_second"] for p in per_step],
        "tokens_per_second": summary["real_tokens_per_second"], "mfu": summary["mfu"], "tflops": summary["tflops"],
        "gpu_memory_bytes": record["gpu_memory_bytes"],
        "peak_memory_gb": summary["gpu_max_allocated_gb"] if cuda else round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "memory": "cuda max_memory_allocated (reserved in gpu_memory_bytes)" if cuda else "peak RSS",
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    if any(c != len(segments) for c in composition):
        print(f"long_row: a step did not hold exactly the {len(segments)} segments: {composition}", file=sys.stderr)
        return 1
    mfu = "-" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    print("| model | device | backend | row (tokens) | peak memory (GB) | tokens/s (timed steps) | MFU | step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {name} | {result['device']} | {kernel or backend} | {total:,} | {result['peak_memory_gb']} | "
          f"{result['tokens_per_second']:,.0f} | {mfu} | {', '.join(map(str, result['step_seconds']))} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_row.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
