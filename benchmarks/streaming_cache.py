"""Training from a bucket through a node cache three times smaller than the dataset (streaming) vs from a local folder.

Against a real S3 server started here (SeaweedFS, ``weed mini`` on loopback: tests/s3_server.py). ``--rows`` rows of
the shipped sample (pretokenized, repeated) in ``--files`` Arrow files are published to the bucket; then
``PaddingFreeSFTTrainer`` (the tiny Llama, CPU) trains ``--steps`` steps, alternately from the local folder and from
the bucket with ``PF_TRL_REMOTE_CACHE_SIZE`` = dataset / ``--ratio`` (each bucket run from an empty node cache),
``--repeats`` times each, interleaved. Per run: steady tokens/s over steps 2..N, files downloaded and evicted, and the
node cache's size (every file under ``$PF_TRL_CACHE/remote``) sampled every 5 ms from a thread: its maximum and a
time series. The ratio reported is the median over the repeats. Writes ``benchmarks/results/streaming_cache.json``.

The streamed runs plan their batches shard-grouped (the files in a random order, rows shuffled within windows of the
files that fit half the cache: docs/storage.md), which the trainer picks because the dataset does not fit the cache;
the local runs keep the global shuffle. So their losses differ; each arm's repeats give the same losses.

    python benchmarks/streaming_cache.py [--rows 100000] [--files 256] [--steps 30] [--ratio 3] [--repeats 2]
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
import threading
import time
from pathlib import Path

from read_ahead import TINY, folder_bytes, make_dataset
from s3_bench import s3_bench_server


def train_from(path: str, steps: int, output_dir: Path, cache: Path) -> dict:
    """One run with an empty node cache ``cache``; the cache's size sampled from a thread meanwhile."""
    from transformers import TrainerCallback

    from pf_trl.data.lazy_shards import is_lazy
    from pf_trl.data.sources import load_training_data
    from pf_trl.data.tokenizer import resolve_tokenizer
    from pf_trl.models import build_model
    from pf_trl.storage import readahead
    from pf_trl.storage.filesystem import forget_filesystems
    from pf_trl.storage.space import held_bytes
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    os.environ["PF_TRL_CACHE"] = str(cache)
    forget_filesystems()
    tokenizer = resolve_tokenizer(None, None)
    marks: list[float] = []
    series: list[tuple[float, int]] = []
    stop = threading.Event()
    root = cache / "remote"

    def watch():
        while not stop.is_set():
            series.append((time.perf_counter(), held_bytes(root) if root.is_dir() else 0))
            stop.wait(0.005)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    watcher = threading.Thread(target=watch, daemon=True)
    started = time.perf_counter()
    watcher.start()
    data = load_training_data(path, tokenizer, read_ahead=True)
    args = PaddingFreeConfig(output_dir=str(output_dir), report_to=[], logging_steps=1, disable_tqdm=True,
                             max_steps=steps, per_device_train_batch_size=16, use_cpu=True, save_strategy="no",
                             dataloader_num_workers=0, seed=0, padding_free_mode="internal", max_length=None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer,
                                    callbacks=[Clock()])
    trainer.train()
    stop.set()
    watcher.join()
    stats = dict(data._ahead.stats) if is_lazy(data) else {}
    groups = trainer._pf_train_sampler.group_shards
    streaming = bool(is_lazy(data) and data._ahead.streaming)
    readahead.close_all()
    seen = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    every = max(1, len(series) // 200)
    return {"streaming": streaming, "group_shards": groups,
            "steady_tokens_per_s": round((seen[-1] - seen[0]) / (marks[-1] - marks[0]), 1),
            "time_to_first_step_s": round(marks[0] - started, 2),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "files_downloaded": stats.get("files_downloaded"), "files_evicted": stats.get("files_evicted"),
            "mb_downloaded": round(stats.get("bytes_downloaded", 0) / 1e6, 1),
            "cache_max_bytes": max((b for _, b in series), default=0),
            "cache_series_s_bytes": [(round(t - started, 3), b) for t, b in series[::every]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--max_seq_len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ratio", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "streaming_cache.json"))
    args = ap.parse_args(argv)
    from pf_trl.data.remote import publish_shards

    runs: dict[str, list[dict]] = {"local folder": [], "bucket, streamed": []}
    with tempfile.TemporaryDirectory(prefix="pf-stream-bench-", dir=os.environ.get("PF_BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        with s3_bench_server(tmp / "s3"):
            local = make_dataset(tmp / "data", args.rows, args.max_seq_len, args.files)
            size = folder_bytes(local)
            arrow = sum(p.stat().st_size for p in local.glob("*.arrow"))
            limit = int(arrow / args.ratio)
            uri = "s3://bench/datasets/big"
            publish_shards(local, uri)
            train_from(str(local), 2, tmp / "out", tmp / "node-warm-up")  # imports and first calls, not measured
            for i in range(args.repeats):  # interleaved: a load change hits both alike
                runs["local folder"].append(train_from(str(local), args.steps, tmp / "out", tmp / f"node-l{i}"))
                os.environ["PF_TRL_REMOTE_CACHE_SIZE"] = str(limit)
                runs["bucket, streamed"].append(train_from(uri, args.steps, tmp / "out", tmp / f"node-b{i}"))
                os.environ.pop("PF_TRL_REMOTE_CACHE_SIZE")
    local_tps = statistics.median(r["steady_tokens_per_s"] for r in runs["local folder"])
    bucket_tps = statistics.median(r["steady_tokens_per_s"] for r in runs["bucket, streamed"])
    same = all(r["losses"] == rs[0]["losses"] for rs in runs.values() for r in rs)
    result = {
        "rows": args.rows, "files": args.files, "max_seq_len": args.max_seq_len, "dataset_mb": round(size / 1e6, 1),
        "arrow_mb": round(arrow / 1e6, 1), "cache_limit_bytes": limit, "steps": args.steps,
        "per_device_train_batch_size": 16, "repeats": args.repeats,
        "median_steady_tokens_per_s": {"local folder": local_tps, "bucket, streamed": bucket_tps},
        "bucket_over_local": round(bucket_tps / local_tps, 3),
        "cache_max_bytes": max(r["cache_max_bytes"] for r in runs["bucket, streamed"]),
        "cache_never_over_limit": all(r["cache_max_bytes"] <= limit for r in runs["bucket, streamed"]),
        "group_shards": runs["bucket, streamed"][-1]["group_shards"],
        "rows_read_per_run": args.steps * 16,
        "mb_downloaded_per_bucket_run": [r["mb_downloaded"] for r in runs["bucket, streamed"]],
        "same_losses_within_each_arm": same, "runs": runs,
        "server": "SeaweedFS weed mini on 127.0.0.1 (loopback)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.rows} rows in {args.files} files, Arrow {result['arrow_mb']} MB; cache limit {limit / 1e6:.1f} MB "
          f"(1/{args.ratio:g}); {args.steps} steps x {args.repeats} interleaved repeats")
    print(f"{'run':20} {'tok/s (median)':>15} {'files down':>10} {'evicted':>8} {'MB down':>8} {'cache max MB':>12}")
    for name, rows in runs.items():
        last = rows[-1]
        print(f"{name:20} {statistics.median(r['steady_tokens_per_s'] for r in rows):>15} "
              f"{last['files_downloaded']!s:>10} {last['files_evicted']!s:>8} {last['mb_downloaded']!s:>8} "
              f"{last['cache_max_bytes'] / 1e6:>12.2f}")
    print(f"bucket / local: {result['bucket_over_local']}; cache never over the limit: "
          f"{result['cache_never_over_limit']}; shard-grouped in windows of {result['group_shards']} files; "
          f"{args.steps * 16} rows read per run, {result['mb_downloaded_per_bucket_run']} MB downloaded of "
          f"{result['arrow_mb']} MB; each arm's repeats give the same losses: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
