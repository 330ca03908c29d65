"""Checkpoint-heavy training into a bucket over a capped uplink: with saves vs without, uploads in the background.

Against a real S3 server started here (SeaweedFS, ``weed mini`` on loopback: tests/s3_server.py), reached through a
relay process that reads request bodies at ``--link_mb_s`` (tests/s3_relay.py: an uplink shared by every upload).
``PaddingFreeSFTTrainer`` (the tiny Llama, CPU, batch 8) trains ``--steps`` steps from a local copy of the shipped
sample into ``s3://bench/runs/...``:

- **no saves** (``save_strategy="no"``);
- **saves** every ``--save_steps`` steps: each checkpoint (model, optimizer, scheduler, rng, trainer and sampler
  state) uploaded in the background while training goes on, committed by its marker; the run ends when the last is.

The two are interleaved ``--repeats`` times (medians reported). Per run: wall seconds of ``train()`` (the wait for
the last upload included), the checkpoints' size, and the seconds each upload took (from its start to its marker):
their sum is what the same saves would cost if each upload blocked training. A short run first, unmeasured, pays the
process's first imports. Writes ``benchmarks/results/checkpoint_uploads.json`` and prints a table.

    python benchmarks/checkpoint_uploads.py [--steps 40] [--save_steps 10] [--link_mb_s 20] [--repeats 3]
"""

from __future__ import annotations

from offline import REPO

# isort: split

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from s3_bench import paced_relay, s3_bench_server

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def train_into(data: Path, uri: str, steps: int, save_steps: int | None, cache: Path) -> dict:
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import resolve_tokenizer
    from pf_trl.models import build_model
    from pf_trl.storage.filesystem import forget_filesystems
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.trainer.remote_output import RemoteCheckpointCallback

    os.environ["PF_TRL_CACHE"] = str(cache)
    forget_filesystems()
    saving = dict(save_strategy="steps", save_steps=save_steps) if save_steps else dict(save_strategy="no")
    args = PaddingFreeConfig(output_dir=uri, report_to=[], logging_steps=1, disable_tqdm=True, max_steps=steps,
                             per_device_train_batch_size=8, use_cpu=True, learning_rate=1e-3,
                             dataloader_num_workers=0, seed=0, max_length=None, **saving)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=load_shards(data),
                                    processing_class=resolve_tokenizer(None, None))
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, RemoteCheckpointCallback)]
    uploads = cb.uploader.history if cb.uploader else []
    staged = trainer.pf_remote_output.staging
    sizes = [sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) for f in staged.glob("checkpoint-*")]
    return {"wall_s": round(wall, 2), "checkpoints": len(uploads),
            "checkpoint_mb": round(sizes[0] / 1e6, 2) if sizes else None,
            "upload_s": [round(u.committed - u.started, 2) for u in uploads],
            "losses_last": [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save_steps", type=int, default=10)
    ap.add_argument("--link_mb_s", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint_uploads.json"))
    args = ap.parse_args(argv)
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    runs: dict[str, list[dict]] = {"no saves": [], "saves, uploads in the background": []}
    with tempfile.TemporaryDirectory(prefix="pf-ckpt-upload-bench-", dir=os.environ.get("PF_BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        with s3_bench_server(tmp / "s3") as server:
            data = tmp / "data"
            pretokenize(SHAREGPT_SAMPLE, data, PretokenizeConfig(max_seq_len=256), progress=False)
            with paced_relay(server.port, upload_bytes_per_s=args.link_mb_s * 1e6) as port:
                os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
                train_into(data, "s3://bench/runs/warm-up", 4, 2, tmp / "node-warm-up")  # imports, first calls
                n = 0
                for _ in range(args.repeats):
                    for name, save_steps in (("no saves", None),
                                             ("saves, uploads in the background", args.save_steps)):
                        n += 1
                        runs[name].append(train_into(data, f"s3://bench/runs/r{n}", args.steps, save_steps,
                                                     tmp / f"node-{n}"))
    base = statistics.median(r["wall_s"] for r in runs["no saves"])
    saved = runs["saves, uploads in the background"]
    summary = {
        "no_saves_s": base,
        "saves_s": statistics.median(r["wall_s"] for r in saved),
        "uploads_sum_s": round(statistics.median(sum(r["upload_s"]) for r in saved), 2),
        "last_upload_s": statistics.median(r["upload_s"][-1] for r in saved),
    }
    summary["ratio_saves_vs_none"] = round(summary["saves_s"] / base, 3)
    summary["ratio_if_uploads_blocked"] = round((base + summary["uploads_sum_s"]) / base, 3)
    result = {"steps": args.steps, "save_steps": args.save_steps, "link_mb_s": args.link_mb_s,
              "repeats": args.repeats, "per_device_train_batch_size": 8, "summary": summary, "runs": runs,
              "server": "SeaweedFS weed mini on 127.0.0.1 behind a relay process reading uploads at link_mb_s",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_1m": round(os.getloadavg()[0], 2)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ckpt = saved[0]["checkpoint_mb"]
    print(f"{args.steps} steps, a save every {args.save_steps} ({len(saved[0]['upload_s'])} checkpoints of {ckpt} MB), "
          f"uplink {args.link_mb_s:g} MB/s, medians of {args.repeats} interleaved repeats")
    print(f"{'run':36} {'wall s':>7} {'x no saves':>10}")
    print(f"{'no saves':36} {base:>7} {1.0:>10}")
    print(f"{'saves, uploads in the background':36} {summary['saves_s']:>7} {summary['ratio_saves_vs_none']:>10}")
    print(f"{'(saves if each upload blocked)':36} {round(base + summary['uploads_sum_s'], 2):>7} "
          f"{summary['ratio_if_uploads_blocked']:>10}")
    print(f"sum of upload times {summary['uploads_sum_s']} s, last upload {summary['last_upload_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
