"""`pf-trl inspect SHARDS_DIR`: manifest summary and how well the token-budget sampler packs it."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from pf_trl.data.shards import ShardsError, load_shards


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pf-trl inspect", description=__doc__)
    parser.add_argument("shards_dir")
    parser.add_argument("--max_tokens", type=int, nargs="*", default=[4096, 8192, 16384])
    parser.add_argument("--json", action="store_true", help="print the full manifest as JSON")
    args = parser.parse_args(argv)
    try:
        ds = load_shards(args.shards_dir)
    except ShardsError as exc:
        print(f"pf-trl inspect: error: {exc}", file=sys.stderr)
        return 2
    manifest = ds.pf_manifest
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    from pf_trl.sampler import TokenBudgetBatchSampler

    lengths = np.asarray(ds.data.column("length"))
    c, s = manifest["counts"], manifest["lengths"]
    print(f"{args.shards_dir}: {c['examples']} examples, {c['tokens']} tokens ({c['loss_tokens']} supervised), "
          f"{c['truncated']} truncated, {c['dropped']} dropped")
    print(f"tokenizer {manifest['tokenizer']['name']} (vocab {manifest['tokenizer']['vocab_size']}), "
          f"max_seq_len {manifest['max_seq_len']}, truncation {manifest['truncation']}")
    print(f"lengths: min {s['min']} mean {s['mean']} p50 {s['p50']} p90 {s['p90']} p99 {s['p99']} max {s['max']}")
    for budget in args.max_tokens:
        if budget < lengths.max():
            print(f"budget {budget}: smaller than the longest example ({lengths.max()})")
            continue
        sampler = TokenBudgetBatchSampler(lengths, budget, seed=0)
        print(f"budget {budget}: {len(sampler)} batches, fill {sampler.efficiency:.4f}")
    return 0
