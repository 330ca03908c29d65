"""Packing efficiency: padded fixed-size batches vs length grouping vs TokenBudgetBatchSampler.

For each strategy, over one epoch of the same lengths:

- ``fill``: real tokens / allocated tokens. Padded batches allocate ``batch_size x longest`` per batch;
  the token-budget sampler allocates ``max_tokens`` per batch (its padding-free rows hold no pad
  tokens at all, so its ``1 - fill`` is unused budget, which matters for static shapes and memory
  planning rather than wasted compute);
- ``padding_share``: ``1 - fill``;
- ``batches`` (optimizer micro-steps per epoch), mean examples and real tokens per batch, and the
  largest allocation of one batch (the peak activation memory a step must fit).

Lengths come from ``--shards DIR`` (the ``length`` column of a pretokenized shards directory), or by
default from the shipped ShareGPT sample pretokenized once into ``$PF_TRL_CACHE`` (``max_seq_len``
1024), or from ``--synthetic N`` ShareGPT-like lengths. Deterministic for a given ``--seed``; runs in
seconds once the sample is pretokenized.

    python benchmarks/packing_efficiency.py [--shards DIR | --synthetic N] [--out FILE] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from pf_trl.batching.sampler import TokenBudgetBatchSampler  # noqa: E402

PADDED_BATCH_SIZES = (4, 8, 16)
GROUPED_BATCH_SIZE = 8
GROUPED_MEGABATCH_MULT = 50  # HF Trainer's group_by_length: mega-batches of 50 x batch size
TOKEN_BUDGETS = (4096, 8192, 16384)


def sharegpt_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """ShareGPT-like synthetic lengths: lognormal (median 394) clipped to [8, 1024], ~13% at 1024, mean ~475."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(394.0), 0.85, n)), 8, 1024).astype(np.int64)


def lengths_from_shards(path: str | Path) -> np.ndarray:
    """Read the ``length`` column of a shards directory (never the token ids)."""
    from pf_trl.data.shards import load_shards

    dataset = load_shards(path)
    return np.asarray(dataset.select_columns(["length"]).with_format("arrow")[:]["length"].to_numpy(), dtype=np.int64)


def sample_shards(max_seq_len: int) -> Path:
    """Pretokenize the shipped ShareGPT sample once (cached by source hash and max_seq_len)."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize, source_fingerprint
    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.data.shards import is_shards_dir
    from pf_trl.data.tokenizer import cache_root

    fp = source_fingerprint(SHAREGPT_SAMPLE)[:16]
    out = cache_root() / "benchmarks" / f"sharegpt-sample-{fp}-msl{max_seq_len}"
    if not is_shards_dir(out):
        pretokenize(SHAREGPT_SAMPLE, out, PretokenizeConfig(max_seq_len=max_seq_len), progress=False, overwrite=out.exists())
    return out


def _summary(name: str, real: np.ndarray, allocated: np.ndarray, examples: np.ndarray, **extra: Any) -> dict[str, Any]:
    fill = float(real.sum() / allocated.sum())
    return {
        "strategy": name,
        **extra,
        "batches": int(len(real)),
        "mean_examples_per_batch": float(examples.mean()),
        "mean_real_tokens_per_batch": float(real.mean()),
        "max_allocated_tokens_per_batch": int(allocated.max()),
        "fill": fill,
        "padding_share": 1.0 - fill,
    }


def padded_random(lengths: np.ndarray, batch_size: int, seed: int) -> dict[str, Any]:
    """Shuffled fixed-size batches, each padded to its longest example (last batch kept, smaller)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    return _padded(lengths, order, batch_size, f"random bs={batch_size} (padded)")


def length_grouped(lengths: np.ndarray, batch_size: int, seed: int) -> dict[str, Any]:
    """HF ``group_by_length``: shuffle, sort mega-batches of 50 x bs by length, longest batch first."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    mega = batch_size * GROUPED_MEGABATCH_MULT
    chunks = [order[i : i + mega] for i in range(0, len(order), mega)]
    chunks = [c[np.argsort(-lengths[c], kind="stable")] for c in chunks]
    grouped = np.concatenate(chunks)
    return _padded(lengths, grouped, batch_size, f"length-grouped bs={batch_size} (padded)")


def _padded(lengths: np.ndarray, order: np.ndarray, batch_size: int, name: str) -> dict[str, Any]:
    starts = np.arange(0, len(order), batch_size)
    ordered = lengths[order]
    real = np.add.reduceat(ordered, starts)
    longest = np.maximum.reduceat(ordered, starts)
    sizes = np.diff(np.append(starts, len(order)))
    return _summary(name, real, longest * sizes, sizes, batch_size=batch_size)


def token_budget(lengths: np.ndarray, max_tokens: int, seed: int, num_replicas: int, timing: bool) -> dict[str, Any]:
    started = time.perf_counter()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=seed, num_replicas=num_replicas)
    stats = sampler.stats()  # plans the epoch
    pack_ms = (time.perf_counter() - started) * 1000
    real = sampler.batch_token_counts().ravel()
    examples = sampler.batch_example_counts().ravel()
    extra: dict[str, Any] = {"max_tokens": max_tokens, "num_replicas": num_replicas}
    row = _summary(f"token-budget {max_tokens}", real, np.full(len(real), max_tokens), examples, **extra)
    row["steps_per_rank"] = stats["batches_per_rank"]
    row["rank_token_spread"] = stats["rank_token_spread"]
    row["num_split_bins"] = stats["num_split_bins"]
    assert abs(row["fill"] - sampler.efficiency) < 1e-12
    if timing:
        row["plan_ms"] = round(pack_ms, 2)
    return row


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        "| strategy | batches | mean ex/batch | mean real tok/batch | max alloc tok/batch | fill | padding share |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['batches']} | {r['mean_examples_per_batch']:.2f} | "
            f"{r['mean_real_tokens_per_batch']:.0f} | {r['max_allocated_tokens_per_batch']} | "
            f"{r['fill']:.4f} | {100 * r['padding_share']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shards", type=Path, help="shards directory (read its `length` column)")
    source.add_argument("--synthetic", type=int, metavar="N", help="use N ShareGPT-like synthetic lengths")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="for pretokenizing the shipped sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-replicas", type=int, default=1, help="ranks for the token-budget sampler")
    parser.add_argument("--timing", action="store_true", help="add planning times (makes the JSON non-deterministic)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "packing_efficiency.json")
    args = parser.parse_args(argv)

    if args.shards is not None:
        lengths, source_desc = lengths_from_shards(args.shards), f"shards {args.shards}"
    elif args.synthetic is not None:
        lengths, source_desc = sharegpt_like_lengths(args.synthetic, args.seed), f"synthetic ShareGPT-like n={args.synthetic}"
    else:
        lengths = lengths_from_shards(sample_shards(args.max_seq_len))
        source_desc = f"shipped ShareGPT sample, pretokenized (max_seq_len={args.max_seq_len})"

    rows = [padded_random(lengths, bs, args.seed) for bs in PADDED_BATCH_SIZES]
    rows.append(length_grouped(lengths, GROUPED_BATCH_SIZE, args.seed))
    for mt in TOKEN_BUDGETS:
        if mt < lengths.max():  # the sampler refuses examples longer than its budget
            print(f"skipping token-budget {mt}: the longest example has {lengths.max()} tokens")
            continue
        rows.append(token_budget(lengths, mt, args.seed, args.num_replicas, args.timing))

    data = {
        "source": source_desc,
        "seed": args.seed,
        "lengths": {
            "examples": int(len(lengths)),
            "tokens": int(lengths.sum()),
            "mean": float(lengths.mean()),
            "median": float(np.median(lengths)),
            "max": int(lengths.max()),
            "share_at_max": float(np.mean(lengths == lengths.max())),
        },
        "results": rows,
    }
    ls = data["lengths"]
    header = (
        f"Packing efficiency on {source_desc}: {ls['examples']} examples, {ls['tokens']} tokens, mean "
        f"{ls['mean']:.1f}, median {ls['median']:.0f}, max {ls['max']} ({100 * ls['share_at_max']:.1f}% at max), seed {args.seed}"
    )
    print(markdown(rows, header))
    if args.timing:
        for r in rows:
            if "plan_ms" in r:
                print(f"{r['strategy']}: planned in {r['plan_ms']:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
