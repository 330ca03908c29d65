"""Streamed vs map-style training on the same rows: real tokens/s, padding share and fill, interleaved repeats.

Three ways to feed the same rows of the shipped sample to ``PaddingFreeSFTTrainer`` (same model, seed, token budget,
``max_steps``):

- ``map``: shards (pretokenized once, before timing), planned by ``TokenBudgetBatchSampler``;
- ``stream_tokenized``: the same shards as a stream (``Dataset.to_iterable_dataset()``), packed by ``StreamPacker``;
- ``stream_raw``: the JSONL file as a stream (``load_dataset(..., streaming=True)``), tokenized while training.

Runs are interleaved (map, stream_tokenized, stream_raw, map, ...) so that a loaded machine slows every mode alike;
the ratios are taken per repeat and the median is reported. Real tokens/s is the trainer's own
``train_real_tokens_per_second`` (non-padding tokens / train runtime); the map path's pretokenize time is not in it.

    python benchmarks/streaming_throughput.py [--rows 400] [--steps 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("map", "stream_tokenized", "stream_raw")


def _rows(n: int) -> list[dict]:
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    rows = []
    with open(SHAREGPT_SAMPLE, encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


def run_once(mode: str, data: Path, shards: Path, args, tokenizer) -> dict:
    import datasets
    import torch

    from pf_trl.data.shards import load_shards
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    if mode == "map":
        train = load_shards(shards)
    elif mode == "stream_tokenized":
        train = load_shards(shards).to_iterable_dataset()
    else:
        train = datasets.load_dataset("json", data_files=str(data), split="train", streaming=True)
    torch.manual_seed(0)
    model = build_model("pf-trl/tiny-llama", seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                        intermediate_size=2 * args.hidden, num_attention_heads=4, num_key_value_heads=2)
    config = PaddingFreeConfig(output_dir=tempfile.mkdtemp(prefix="pf-bench-"), report_to=[], use_cpu=True,
                               max_length=args.max_seq_len, max_steps=args.steps, max_tokens_per_batch=args.budget,
                               save_strategy="no", disable_tqdm=True, logging_steps=10_000, seed=0,
                               padding_free_mode="internal", activation_checkpointing=False)
    trainer = PaddingFreeSFTTrainer(model, args=config, train_dataset=train, processing_class=tokenizer)
    metrics = trainer.train().metrics
    steps = trainer.state.global_step
    return {
        "real_tokens_per_second": metrics["train_real_tokens_per_second"],
        "real_tokens": metrics["train_real_tokens"],
        "padding_share": metrics["train_padding_share"],
        "fill": metrics["train_real_tokens"] / (steps * args.budget),
        "runtime_s": metrics["train_runtime"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--max_seq_len", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/streaming_throughput.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("PF_TRL_CACHE", tempfile.mkdtemp(prefix="pf-bench-cache-"))
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    work = Path(tempfile.mkdtemp(prefix="pf-bench-stream-"))
    data = work / "rows.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for row in _rows(args.rows):
            f.write(json.dumps(row) + "\n")
    shards = work / "shards"
    pretokenize(data, shards, PretokenizeConfig(max_seq_len=args.max_seq_len), tokenizer=tokenizer, progress=False)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            started = time.time()
            runs[mode].append(run_once(mode, data, shards, args, tokenizer))
            print(f"repeat {rep} {mode}: {runs[mode][-1]['real_tokens_per_second']:.0f} real tok/s "
                  f"({time.time() - started:.0f}s)", file=sys.stderr, flush=True)
    ratios = {m: statistics.median(runs[m][i]["real_tokens_per_second"] / runs["map"][i]["real_tokens_per_second"]
                                   for i in range(args.repeats)) for m in MODES}
    table = []
    for m in MODES:
        table.append({"mode": m,
                      "real_tokens_per_second_median": round(statistics.median(r["real_tokens_per_second"]
                                                                               for r in runs[m]), 1),
                      "ratio_to_map_median": round(ratios[m], 3),
                      "padding_share": max(r["padding_share"] for r in runs[m]),
                      "fill_min": round(min(r["fill"] for r in runs[m]), 4)})
    result = {"config": vars(args), "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
              "table": table, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("| mode | real tokens/s (median) | ratio to map (median of per-repeat ratios) | padding share | fill (min) |")
    print("| --- | --- | --- | --- | --- |")
    for row in table:
        print(f"| {row['mode']} | {row['real_tokens_per_second_median']:.0f} | {row['ratio_to_map_median']:.2f} | "
              f"{row['padding_share']} | {row['fill_min']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
