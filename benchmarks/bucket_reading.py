"""Training from a bucket vs from a local shards directory: time to first step, steady tokens/s, download MB/s,
cache size.

Against a real S3 server started here (SeaweedFS, ``weed mini`` on loopback: tests/s3_server.py), so the numbers
are those of pf-trl's own path (s3fs, the node cache's lock, size and checksum checks, memory-mapped Arrow), not of a
network: a real bucket adds its bandwidth and latency to the download. Steps:

1. ``--rows`` rows (default 1M): the shipped sample pretokenized (``--max_seq_len``, default 64) and repeated,
   written as one shards directory with its manifest (sizes and checksums).
2. Published to the bucket (:func:`pf_trl.data.remote.publish_shards`: writer folder, manifest last): upload MB/s.
3. Fetched into an empty node cache (:func:`pf_trl.data.remote.fetch_shards`): download MB/s, cache size.
4. ``PaddingFreeSFTTrainer`` (the tiny Llama, CPU) trained ``--steps`` steps from the local folder, then from the
   bucket URI with another empty cache: seconds from the data path's call to the end of the first step (the bucket
   run includes its download and verification), and steady tokens/s over the later steps.

Writes ``benchmarks/results/bucket_reading.json`` and prints a table.

    python benchmarks/bucket_reading.py [--rows 1000000] [--steps 12]
"""

from __future__ import annotations

from offline import REPO

# isort: split

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from s3_bench import s3_bench_server

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def make_dataset(where: Path, rows: int, max_seq_len: int) -> Path:
    """``rows`` rows of the shipped sample (pretokenized, repeated) as a shards directory with its manifest."""
    import datasets
    import numpy as np

    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.data.shards import read_manifest, write_manifest

    pretokenize(SHAREGPT_SAMPLE, where / "sample", PretokenizeConfig(max_seq_len=max_seq_len), progress=False)
    one = datasets.load_from_disk(str(where / "sample"))
    big = one.select(np.arange(rows) % len(one))
    out = where / "big"
    big.save_to_disk(str(out), max_shard_size="256MB")
    manifest = read_manifest(where / "sample")
    manifest["counts"] = {**manifest["counts"], "examples": rows,
                          "tokens": int(np.asarray(big.data.column("length")).sum())}
    write_manifest(out, manifest)
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def train_from(path: str, steps: int, output_dir: Path) -> dict:
    """Seconds from the data path's call to the end of step 1, and steady tokens/s over steps 2..``steps``."""
    from transformers import TrainerCallback

    from pf_trl.data.sources import load_training_data
    from pf_trl.data.tokenizer import resolve_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    tokenizer = resolve_tokenizer(None, None)
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    started = time.perf_counter()
    data = load_training_data(path, tokenizer)
    loaded = time.perf_counter()
    args = PaddingFreeConfig(output_dir=str(output_dir), report_to=[], logging_steps=1, disable_tqdm=True,
                             max_steps=steps, per_device_train_batch_size=16, use_cpu=True, save_strategy="no",
                             dataloader_num_workers=0, seed=0, padding_free_mode="internal", max_length=None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer,
                                    callbacks=[Clock()])
    trainer.train()
    seen = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    steady = (seen[-1] - seen[0]) / (marks[-1] - marks[0]) if len(marks) > 1 else None
    return {"data_ready_s": round(loaded - started, 2), "time_to_first_step_s": round(marks[0] - started, 2),
            "steady_tokens_per_s": round(steady, 1) if steady else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--max_seq_len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bucket_reading.json"))
    args = ap.parse_args(argv)
    from pf_trl.data.remote import fetch_shards, publish_shards

    with tempfile.TemporaryDirectory(prefix="pf-bucket-bench-", dir=os.environ.get("PF_BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        with s3_bench_server(tmp / "s3"):
            t0 = time.perf_counter()
            local = make_dataset(tmp / "data", args.rows, args.max_seq_len)
            build_s = time.perf_counter() - t0
            size = folder_bytes(local)
            uri = "s3://bench/datasets/big"
            t0 = time.perf_counter()
            publish_shards(local, uri)
            upload_s = time.perf_counter() - t0
            os.environ["PF_TRL_CACHE"] = str(tmp / "node-fetch")
            t0 = time.perf_counter()
            cached = fetch_shards(uri)
            download_s = time.perf_counter() - t0
            cache_bytes = folder_bytes(tmp / "node-fetch" / "remote")
            os.environ["PF_TRL_CACHE"] = str(tmp / "node-local")
            from_local = train_from(str(local), args.steps, tmp / "out-local")
            os.environ["PF_TRL_CACHE"] = str(tmp / "node-bucket")
            from_bucket = train_from(uri, args.steps, tmp / "out-bucket")
            assert Path(cached).is_dir()
    result = {
        "rows": args.rows, "max_seq_len": args.max_seq_len, "dataset_mb": round(size / 1e6, 1),
        "build_s": round(build_s, 1), "upload_mb_per_s": round(size / 1e6 / upload_s, 1),
        "download_mb_per_s": round(size / 1e6 / download_s, 1), "download_s": round(download_s, 2),
        "cache_mb": round(cache_bytes / 1e6, 1), "steps": args.steps, "local": from_local, "bucket": from_bucket,
        "server": "SeaweedFS weed mini on 127.0.0.1 (no network)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.rows} rows, {result['dataset_mb']} MB; upload {result['upload_mb_per_s']} MB/s, download "
          f"{result['download_mb_per_s']} MB/s, cache {result['cache_mb']} MB")
    print(f"{'source':8} {'data ready s':>13} {'first step s':>13} {'steady tok/s':>13}")
    for name, row in (("local", from_local), ("bucket", from_bucket)):
        print(f"{name:8} {row['data_ready_s']:>13} {row['time_to_first_step_s']:>13} "
              f"{row['steady_tokens_per_s']!s:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
