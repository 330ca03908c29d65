"""What the preference benchmarks (``dpo_throughput.py``, ``reward_throughput.py``, ``kto_throughput.py``) share:
the ShareGPT rows they train on, TRL's compact LM head switched on for a run, the figures of one run, the interleaved
repeats and their medians, and the printed table.

Every figure is measured by the same code in every mode (pf-trl's token metrics: real tokens / ``train_runtime``;
peak RSS during training); every ratio is taken within one repeat (the modes run in turn, in reversed order every
other repeat) and summarized as the median over the repeats, min and max beside it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable, Iterator

__all__ = ["compact_trl_head", "interleaved", "print_table", "run_figures", "sharegpt_pairs", "summarize"]


def sharegpt_pairs(n: int) -> list[dict]:
    """``n`` pairs of real, long-tailed lengths: a ShareGPT first turn (the shipped sample) as ``prompt`` and
    ``chosen``, the next row's response as ``rejected``."""
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    rows = [json.loads(line) for line in SHAREGPT_SAMPLE.read_text().splitlines()[: n + 1]]
    return [dict(prompt=rows[i]["prompt"], chosen=rows[i]["completion"], rejected=rows[i + 1]["completion"])
            for i in range(n)]


@contextlib.contextmanager
def compact_trl_head(enabled: bool = True) -> Iterator[None]:
    """TRL's fused LM head on its compact path (only the positions whose label is kept reach the head), as it runs on
    Triton devices (CUDA): ``trl.trainer.utils._use_triton`` reads true while inside (TRL's kernel still folds its
    tiles with its torch fallback on CPU)."""
    import trl.trainer.utils as trl_utils

    compact = trl_utils._use_triton
    if enabled:
        trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = compact


def run_figures(mode: str, trainer, metrics: dict) -> dict:
    """The figures of one trained run (``metrics``: ``trainer.train().metrics`` with pf-trl's token metrics)."""
    return dict(mode=mode, runtime_s=metrics["train_runtime"], steps=trainer.state.global_step,
                real_tokens=metrics["train_real_tokens"], processed_tokens=metrics["train_processed_tokens"],
                real_tokens_per_s=metrics["train_real_tokens"] / metrics["train_runtime"],
                padding_share=metrics["train_padding_share"], peak_rss_mb=metrics["train_mem_cpu_peak"] / 2**20,
                train_loss=metrics["train_loss"])


def interleaved(modes: tuple[str, ...], repeats: int, run_one: Callable[[str], dict]) -> list[list[dict]]:
    """``run_one(mode)`` for every mode, ``repeats`` times, the order reversed every other repeat; one list a repeat."""
    runs: list[list[dict]] = []
    for repeat in range(repeats):
        order = modes if repeat % 2 == 0 else modes[::-1]
        runs.append([run_one(mode) for mode in order])
        print(f"repeat {repeat}: " + ", ".join(f"{r['mode']} {r['real_tokens_per_s']:.0f} tok/s" for r in runs[-1]),
              flush=True)
    return runs


def summarize(runs: list[list[dict]], modes: tuple[str, ...], narrow: str = "trl-completions") -> list[dict]:
    """Per mode: the median run (by real tokens/s), the speedups over TRL's run of the same repeat, and over the
    ``narrow`` baseline's (TRL scoring only completions) when it ran."""

    def of(rep: list[dict], mode: str) -> dict:
        return next(r for r in rep if r["mode"] == mode)

    out = []
    for mode in modes:
        mine = [of(rep, mode) for rep in runs]
        ratios = sorted(of(rep, mode)["real_tokens_per_s"] / of(rep, "trl")["real_tokens_per_s"] for rep in runs)
        memory = [of(rep, mode)["peak_rss_mb"] / of(rep, "trl")["peak_rss_mb"] for rep in runs]
        median = sorted(mine, key=lambda r: r["real_tokens_per_s"])[len(mine) // 2]
        extra = {}
        if narrow in modes:
            against = sorted(of(rep, mode)["real_tokens_per_s"] / of(rep, narrow)["real_tokens_per_s"] for rep in runs)
            extra = dict(speedup_vs_trl_completions=statistics.median(against),
                         speedups_vs_trl_completions=against)
        out.append(dict(median, **extra, speedup_vs_trl=statistics.median(ratios), speedup_min=ratios[0],
                        speedup_max=ratios[-1], speedups=ratios, peak_rss_vs_trl=statistics.median(memory),
                        runs_real_tokens_per_s=[r["real_tokens_per_s"] for r in mine]))
    return out


def print_table(results: list[dict]) -> None:
    """The markdown table of :func:`summarize`'s results (the completions-only column where that baseline ran)."""
    narrow = any("speedup_vs_trl_completions" in r for r in results)
    print("| mode | steps | real tokens | processed | padding | real tok/s | vs TRL |"
          + (" vs TRL completions-only |" if narrow else "") + " peak RSS MB | vs TRL |")
    print("|---" * (9 + narrow) + "|")
    for r in results:
        against = r.get("speedup_vs_trl_completions")
        print(f"| {r['mode']} | {r['steps']} | {r['real_tokens']} | {r['processed_tokens']} | {r['padding_share']:.1%} "
              f"| {r['real_tokens_per_s']:.0f} | {r['speedup_vs_trl']:.2f}x ({r['speedup_min']:.2f}-"
              f"{r['speedup_max']:.2f}) |" + (f" {against:.2f}x |" if narrow else "")
              + f" {r['peak_rss_mb']:.0f} | {r['peak_rss_vs_trl']:.2f} |")
