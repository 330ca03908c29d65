"""Time to the first optimizer step when training from a bucket, for datasets of two sizes (1M vs 10M rows by default).

Against a real S3 server started here (SeaweedFS, ``weed mini`` on loopback: tests/s3_server.py). Each dataset is
synthetic token rows (4 to 16 random token ids each) written straight into Arrow shard files of ``--rows_per_file``
rows (no tokenization), with the manifest, lengths and row layout ``pf-trl pretokenize`` writes, published to the
bucket. Then, from an empty node cache each time, sizes interleaved, ``--repeats`` times: ``PaddingFreeSFTTrainer``
(the tiny Llama, CPU) trains one step, timed in phases:

- ``open``: ``load_training_data(s3://...)``: the manifest and the lengths file downloaded, the dataset opened lazily;
- ``trainer``: the trainer built;
- ``plan``: ``train()`` until ``on_train_begin``: the token-budget sampler's fixed batch count and epoch plan, the
  read-ahead ordered by it (this is where the dataset's size shows);
- ``first step``: from there to the end of step 1 (the first batch's files downloaded, one forward and backward).

Writes ``benchmarks/results/first_step.json`` and prints a table.

    python benchmarks/first_step.py [--sizes 1000000 10000000] [--repeats 1]
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

from read_ahead import TINY
from s3_bench import s3_bench_server


def synthetic_shards(where: Path, rows: int, rows_per_file: int, template: dict, seed: int = 0) -> Path:
    """``rows`` random token rows as a shards directory (Arrow files of ``rows_per_file`` rows, then the manifest)."""
    import datasets
    import numpy as np
    import pyarrow as pa

    from pf_trl.data.shards import shard_features, write_manifest

    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 17, rows).astype(np.int32)
    offsets = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(3, 32000, int(offsets[-1]), dtype=np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    table = pa.table({"input_ids": ids, "labels": ids, "length": pa.array(lengths)})
    datasets.disable_progress_bars()
    out = where / f"rows-{rows}"
    dataset = datasets.Dataset(table).cast(shard_features())
    dataset.save_to_disk(str(out), num_shards=max(1, rows // rows_per_file))
    manifest = dict(template)
    manifest["counts"] = {**template["counts"], "examples": rows, "tokens": int(offsets[-1])}
    write_manifest(out, manifest)
    return out


def first_step(uri: str, cache: Path, output_dir: Path) -> dict:
    """One run from an empty node cache: the phases of the module docstring, in seconds."""
    from transformers import TrainerCallback

    from pf_trl.data.sources import load_training_data
    from pf_trl.data.tokenizer import resolve_tokenizer
    from pf_trl.models import build_model
    from pf_trl.storage import readahead
    from pf_trl.storage.filesystem import forget_filesystems
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    os.environ["PF_TRL_CACHE"] = str(cache)
    forget_filesystems()
    tokenizer = resolve_tokenizer(None, None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            marks.setdefault("step_1", time.perf_counter())

    started = time.perf_counter()
    data = load_training_data(uri, tokenizer, read_ahead=True)
    opened = time.perf_counter()
    args = PaddingFreeConfig(output_dir=str(output_dir), report_to=[], logging_steps=1, disable_tqdm=True,
                             max_steps=1, per_device_train_batch_size=16, use_cpu=True, save_strategy="no",
                             dataloader_num_workers=0, seed=0, max_length=None)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer,
                                    callbacks=[Clock()])
    built = time.perf_counter()
    trainer.train()
    readahead.close_all(2.0)
    return {"open_s": round(opened - started, 2), "trainer_s": round(built - opened, 2),
            "plan_s": round(marks["train_begin"] - built, 2),
            "first_step_s": round(marks["step_1"] - marks["train_begin"], 2),
            "total_s": round(marks["step_1"] - started, 2), "batches_per_epoch": len(trainer._pf_train_sampler)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--rows_per_file", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "first_step.json"))
    args = ap.parse_args(argv)
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.remote import publish_shards
    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.data.shards import read_manifest

    runs: dict[int, list[dict]] = {n: [] for n in args.sizes}
    built: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pf-first-step-", dir=os.environ.get("PF_BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        with s3_bench_server(tmp / "s3"):
            pretokenize(SHAREGPT_SAMPLE, tmp / "sample", PretokenizeConfig(max_seq_len=64), progress=False)
            template = read_manifest(tmp / "sample")  # the tokenizer's identity, as a real dataset carries it
            for n in args.sizes:
                t = time.perf_counter()
                local = synthetic_shards(tmp / "data", n, args.rows_per_file, template)
                made = time.perf_counter()
                publish_shards(local, f"s3://bench/rows-{n}")
                built[n] = {"write_s": round(made - t, 1), "publish_s": round(time.perf_counter() - made, 1),
                            "files": len(list(local.glob("*.arrow"))),
                            "mb": round(sum(p.stat().st_size for p in local.rglob("*") if p.is_file()) / 1e6, 1)}
            first_step(f"s3://bench/rows-{args.sizes[0]}", tmp / "warm", tmp / "out")  # imports, first calls
            for i in range(args.repeats):  # interleaved: a load change hits every size alike
                for n in args.sizes:
                    runs[n].append(first_step(f"s3://bench/rows-{n}", tmp / f"node-{n}-{i}", tmp / "out"))
    phases = ("open_s", "trainer_s", "plan_s", "first_step_s", "total_s")
    medians = {n: {p: statistics.median(r[p] for r in rs) for p in phases} for n, rs in runs.items()}
    small, large = args.sizes[0], args.sizes[-1]
    result = {"sizes": args.sizes, "rows_per_file": args.rows_per_file, "repeats": args.repeats, "datasets": built,
              "median_s": medians, "large_over_small": {p: round(medians[large][p] / max(medians[small][p], 1e-9), 2)
                                                        for p in phases},
              "runs": runs, "server": "SeaweedFS weed mini on 127.0.0.1 (loopback)",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_1m": round(os.getloadavg()[0], 2)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"time to the first optimizer step from a bucket, median of {args.repeats} (seconds)")
    print(f"{'rows':>10} {'files':>6} {'MB':>7} " + " ".join(f"{p[:-2]:>11}" for p in phases))
    for n in args.sizes:
        print(f"{n:>10} {built[n]['files']:>6} {built[n]['mb']:>7} "
              + " ".join(f"{medians[n][p]:>11}" for p in phases))
    print(f"{large} / {small} rows: " + ", ".join(f"{p[:-2]} {v}x" for p, v in result["large_over_small"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
