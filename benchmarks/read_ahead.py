"""Training from a bucket while it downloads (read-ahead) vs after the whole download vs from a local folder.

Against a real S3 server started here (SeaweedFS, ``weed mini`` on loopback: tests/s3_server.py), directly and through
a relay that paces the bucket's responses to ``--link_mb_s`` (tests/s3_relay.py, in its own process: a bucket across a
network link). Steps:

1. ``--rows`` rows (default 1M): the shipped sample pretokenized (``--max_seq_len``, default 64) and repeated, written
   as ``--files`` Arrow files (default 256) with its manifest (sizes, checksums, lengths and row layout).
2. Published to the bucket (:func:`pf_trl.data.remote.publish_shards`).
3. ``PaddingFreeSFTTrainer`` (the tiny Llama, CPU) trained ``--steps`` steps, each time with an empty node cache:
   from the local folder; from the bucket with ``PF_TRL_READ_AHEAD=0`` (whole download, then training); from the
   bucket with read-ahead (the default); and the two bucket runs again through the paced link.

Per run: seconds from the data path's call to the end of step 1 and of the last step, tokens/s over steps 2..N
(stalls included while files still arrive), when the last file was local, download MB/s, node cache size. A short
run from the local folder comes first, unmeasured, so that no measured run pays the process's first imports. Writes
``benchmarks/results/read_ahead.json`` and prints a table.

    python benchmarks/read_ahead.py [--rows 1000000] [--files 256] [--steps 40] [--link_mb_s 25]
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

from s3_bench import paced_relay, s3_bench_server

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def make_dataset(where: Path, rows: int, max_seq_len: int, files: int) -> Path:
    """``rows`` rows of the shipped sample (pretokenized, repeated) as a shards directory of ``files`` Arrow files."""
    import datasets
    import numpy as np

    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.data.shards import read_manifest, write_manifest

    pretokenize(SHAREGPT_SAMPLE, where / "sample", PretokenizeConfig(max_seq_len=max_seq_len), progress=False)
    one = datasets.load_from_disk(str(where / "sample"))
    big = one.select(np.arange(rows) % len(one))
    out = where / "big"
    datasets.disable_progress_bars()
    big.save_to_disk(str(out), num_shards=files)
    manifest = read_manifest(where / "sample")
    manifest["counts"] = {**manifest["counts"], "examples": rows,
                          "tokens": int(np.asarray(big.data.column("length")).sum())}
    write_manifest(out, manifest)  # lengths, row layout, checksums
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def train_from(path: str, steps: int, output_dir: Path, cache: Path) -> dict:
    """One run with an empty node cache ``cache``."""
    from transformers import TrainerCallback

    from pf_trl.data.lazy_shards import is_lazy
    from pf_trl.data.sources import load_training_data
    from pf_trl.data.tokenizer import resolve_tokenizer
    from pf_trl.models import build_model
    from pf_trl.storage import readahead
    from pf_trl.storage.filesystem import forget_filesystems
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    os.environ["PF_TRL_CACHE"] = str(cache)
    forget_filesystems()
    tokenizer = resolve_tokenizer(None, None)
    marks: list[float] = []
    complete: list[float] = []

    def all_local() -> bool:
        return any((cache / "remote").glob("*/.complete")) if (cache / "remote").is_dir() else True

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())
            if not complete and all_local():
                complete.append(time.perf_counter())

    started = time.perf_counter()
    data = load_training_data(path, tokenizer, read_ahead=True)
    loaded = time.perf_counter()
    lazy = is_lazy(data)
    args = PaddingFreeConfig(output_dir=str(output_dir), report_to=[], logging_steps=1, disable_tqdm=True,
                             max_steps=steps, per_device_train_batch_size=16, use_cpu=True, save_strategy="no",
                             dataloader_num_workers=0, seed=0, padding_free_mode="internal", max_length=None)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer,
                                    callbacks=[Clock()])
    trainer.train()
    stats = dict(data._ahead.stats) if lazy else {}
    if lazy:
        data._ahead.wait_all()  # the rest of the download (a run shorter than it): for the cache size
        stats = dict(data._ahead.stats)
    readahead.close_all()
    seen = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    steady = (seen[-1] - seen[0]) / (marks[-1] - marks[0]) if len(marks) > 1 else None
    row = {"read_ahead": lazy, "data_ready_s": round(loaded - started, 2),
           "time_to_first_step_s": round(marks[0] - started, 2), "time_to_last_step_s": round(marks[-1] - started, 2),
           "steady_tokens_per_s": round(steady, 1) if steady else None,
           "all_local_s": round((complete[0] if complete else time.perf_counter()) - started, 2),
           "losses_first3": [h["loss"] for h in trainer.state.log_history if "loss" in h][:3]}
    if lazy:
        took = (stats["complete_at"] or time.time()) - stats["started_at"]
        row.update(download_mb_per_s=round(stats["bytes_downloaded"] / 1e6 / max(took, 1e-6), 1),
                   waits=stats["waits"], waited_s=round(stats["waited_s"], 2))
    elif path.startswith("s3://"):
        row["download_mb_per_s"] = None  # filled by the caller from the whole download's own timing
    if (cache / "remote").is_dir():
        row["cache_mb"] = round(folder_bytes(cache / "remote") / 1e6, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--max_seq_len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--link_mb_s", type=float, default=25.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "read_ahead.json"))
    args = ap.parse_args(argv)
    from pf_trl.data.remote import fetch_shards, publish_shards
    from pf_trl.storage.filesystem import forget_filesystems

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pf-read-ahead-bench-", dir=os.environ.get("PF_BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        with s3_bench_server(tmp / "s3") as server:
            local = make_dataset(tmp / "data", args.rows, args.max_seq_len, args.files)
            size = folder_bytes(local)
            uri = "s3://bench/datasets/big"
            publish_shards(local, uri)
            train_from(str(local), 2, tmp / "out", tmp / "node-warm-up")  # imports and first calls, not measured
            with paced_relay(server.port, bytes_per_s=args.link_mb_s * 1e6) as relay_port:
                for link, endpoint in (("loopback", server.endpoint), (f"{args.link_mb_s:g} MB/s link",
                                                                       f"http://127.0.0.1:{relay_port}")):
                    os.environ["AWS_ENDPOINT_URL"] = endpoint
                    os.environ["PF_TRL_CACHE"] = str(tmp / f"fetch-{len(runs)}")
                    forget_filesystems()
                    t0 = time.perf_counter()
                    fetch_shards(uri)  # the whole download alone: its MB/s
                    whole_mb_s = round(size / 1e6 / (time.perf_counter() - t0), 1)
                    os.environ["PF_TRL_READ_AHEAD"] = "0"
                    runs[f"bucket, whole download ({link})"] = {
                        **train_from(uri, args.steps, tmp / "out", tmp / f"node-{len(runs)}"),
                        "download_mb_per_s": whole_mb_s}
                    os.environ.pop("PF_TRL_READ_AHEAD")
                    runs[f"bucket, read-ahead ({link})"] = train_from(uri, args.steps, tmp / "out",
                                                                       tmp / f"node-{len(runs)}")
                os.environ["AWS_ENDPOINT_URL"] = server.endpoint
                runs["local folder"] = train_from(str(local), args.steps, tmp / "out", tmp / "node-local")
    result = {
        "rows": args.rows, "files": args.files, "max_seq_len": args.max_seq_len, "dataset_mb": round(size / 1e6, 1),
        "steps": args.steps, "per_device_train_batch_size": 16, "runs": runs,
        "server": "SeaweedFS weed mini on 127.0.0.1; the paced link is a relay process (tests/s3_relay.py)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.rows} rows in {args.files} files, {result['dataset_mb']} MB; {args.steps} steps")
    print(f"{'run':42} {'first step s':>12} {'last step s':>11} {'all local s':>11} {'tok/s 2..N':>10} {'MB/s':>6} "
          f"{'cache MB':>8}")
    for name, row in runs.items():
        print(f"{name:42} {row['time_to_first_step_s']:>12} {row['time_to_last_step_s']:>11} {row['all_local_s']:>11} "
              f"{row['steady_tokens_per_s']!s:>10} {row.get('download_mb_per_s')!s:>6} {row.get('cache_mb')!s:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
