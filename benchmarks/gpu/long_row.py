"""One 131,072-token packed row of a ~1B Llama on one GPU: peak memory and tokens/s of an optimizer step.

``PaddingFreeSFTTrainer`` (``padding_free="internal"``, varlen backend ``auto``: flash-attn when installed, else
PyTorch's varlen attention or FlexAttention), bf16, activation checkpointing, AdamW; the row holds segments of 4k to
64k tokens (every token supervised). Three steps on the same row length: the first warms up (allocator, kernels),
the table reports the last two (tokens/s) and the peak of ``torch.cuda.max_memory_allocated`` over the run.

    python benchmarks/gpu/long_row.py [--out DIR] [--backend auto] [--dry-run]

``--dry-run``: the tiny Llama on CPU with a 2,048-token row (checks the script; memory is the process's peak RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
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
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.models import build_model

    cuda = torch.cuda.is_available() and not args.dry_run
    segments = DRY_SEGMENTS if args.dry_run else SEGMENTS
    name = "pf-trl/tiny-llama" if args.dry_run else "pf-trl/llama-1b"
    total = sum(segments)
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(3):  # one row per step, all of the same composition
        for n in segments:
            ids = torch.randint(3, 4096 if args.dry_run else 32000, (n,), generator=g).tolist()
            rows.append({"input_ids": ids, "labels": ids})
    overrides = dict(num_hidden_layers=2, vocab_size=4096) if args.dry_run else {}
    model = build_model(name, attn_implementation="sdpa", seed=0, max_position_embeddings=total,
                        torch_dtype=torch.bfloat16 if cuda else None, **overrides)
    step_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - self.t)

    config = PaddingFreeConfig(
        output_dir=str(args.out / "long_row"), report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        padding_free="internal", attention_backend=args.backend, max_tokens_per_batch=total, max_steps=3,
        learning_rate=1e-5, max_length=None, bf16=cuda, use_cpu=not cuda, dataloader_num_workers=0,
        activation_checkpointing=True, seed=0)
    trainer = PaddingFreeSFTTrainer(model, args=config, train_dataset=Dataset.from_list(rows),
                                    callbacks=[StepTimer()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if cuda:
        peak_gb = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    from pf_trl.attention.dispatch import resolve_backend

    device = torch.device("cuda" if cuda else "cpu")
    backend = resolve_backend(args.backend, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    timed = step_times[1:] or step_times
    result = {
        "model": name, "device": torch.cuda.get_device_name() if cuda else "cpu", "backend": backend,
        "row_tokens": total, "segments": list(segments), "steps": len(step_times),
        "step_seconds": [round(t, 3) for t in step_times], "tokens_per_second": round(total * len(timed) / sum(timed)),
        "peak_memory_gb": round(peak_gb, 2), "memory": "cuda max_memory_allocated" if cuda else "peak RSS",
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    print("| model | device | backend | row (tokens) | peak memory (GB) | tokens/s | step (s) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {name} | {result['device']} | {backend} | {total:,} | {result['peak_memory_gb']} | "
          f"{result['tokens_per_second']:,} | {', '.join(map(str, result['step_seconds']))} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_row.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
