"""The end-to-end GPU bench: every arm of :mod:`pf_trl.benchmarking.arms` on the same rows, steady state.

Per dataset, ``repeats`` rounds; each round runs every arm once, the order rotated by one arm per round (the arm
that went first, paying any cold cache, goes last next time). Each arm: a fresh model and trainer, ``warmup_steps``
untimed steps, then synchronized steps until ``min_steps`` timed steps or ``min_seconds`` (whichever first), GPU
peaks reset at its start. The report is rewritten after every arm, so a run cut short keeps what it measured.

Everything in the report's ``table`` is recomputable from its ``runs`` (per-step seconds and tokens, the FLOP
parameters, the peak): :func:`recompute_table` does it, and the tests check that it gives the same table.
"""

from __future__ import annotations

import gc
import hashlib
import json
import platform
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pf_trl.benchmarking.arms import ARMS, SEED_ARMS, BenchSetup, build_trainer, skip_reason
from pf_trl.benchmarking.rows import DATA_DIR, load_shapes, rows_from_shapes
from pf_trl.benchmarking.steady import StepTimer, summarize

H200_BF16_DENSE_TFLOPS = 989.0  # the datasheet's dense bf16 peak, the MFU denominator on an H200
MFU_FORMULA = ("model FLOPs / timed seconds / peak; model FLOPs = 6 * P_body * real_tokens + 6 * P_head * "
               "supervised_tokens + 6 * layers * hidden * sum(example_length^2); P_body = parameters without the "
               "input embedding and the LM head (computed at the supervised positions only); causal attention "
               "forward + backward = 3 x forward, no recomputation (PaLM appendix B's 12*L*d*T per token, halved "
               "for the causal mask)")
HFU_FORMULA = ("hardware FLOPs / timed seconds / peak; hardware FLOPs = model FLOPs + 2 * P_body * real_tokens + "
               "2 * layers * hidden * sum(L^2) with activation checkpointing (the second forward) + 1 * layers * "
               "hidden * sum(L^2) for a fused attention kernel's recomputed scores (CUDA)")
STEP_TIME = ("a step's seconds run from the end of the step before (the start of training for the first) to its "
             "end, CUDA-synchronized: fetching and collating its batch included (data_seconds: that part alone)")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "triton", "flash-attn", "flash-attn-4",
                 "nvidia-cutlass-dsl", "liger-kernel"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def machine(cuda: bool) -> dict[str, Any]:
    import os

    import torch

    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "cuda": cuda}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gb=round(p.total_memory / 2**30, 1))
    return info


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """``arms`` rotated left by ``round_index``: every arm takes every position over ``len(arms)`` rounds."""
    k = round_index % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def run_arm(arm: str, setup: BenchSetup, rows: list[dict], *, budget: int, cuda: bool, warmup_steps: int,
            min_steps: int, min_seconds: float, max_steps: int | None = None) -> dict[str, Any]:
    """One arm: train, time, return its record (or the error, with the arm's traceback tail)."""
    import torch

    from pf_trl.trainer.metrics import detect_peak_tflops, model_flop_params

    reason = skip_reason(arm, cuda)
    if reason:
        return {"arm": arm, "skipped": reason}
    held: dict[str, Any] = {}  # the trainer, for the timer's meter reads; dropped at the end to free the GPU
    timer = StepTimer(lambda: held["trainer"].pf_metrics.meter, warmup_steps=warmup_steps, min_steps=min_steps,
                      min_seconds=min_seconds, cuda=cuda)
    started = time.perf_counter()
    # what an earlier arm left allocated (should be ~0): it would also sit inside this arm's peak
    leftover = int(torch.cuda.memory_allocated()) if cuda else 0
    try:
        steps = max_steps if max_steps is not None else warmup_steps + min_steps
        with tempfile.TemporaryDirectory(prefix=f"pf-e2e-{arm}-") as out:
            trainer, described = build_trainer(arm, setup, rows, budget=budget, max_steps=steps, cuda=cuda,
                                               output_dir=out, callbacks=[timer])
            held["trainer"] = trainer
            flop_params = model_flop_params(trainer.model)
            peak = detect_peak_tflops(torch.device("cuda"), getattr(torch, setup.dtype)) if cuda else None
            result = trainer.train()
        # what the GPU recomputes (HFU): checkpointing's second forward; every fused attention kernel on CUDA
        # (flash, memory-efficient sdpa, varlen, flex) recomputes the scores in its backward, CPU's math path not
        recompute = {"activation_checkpointing": bool(setup.activation_checkpointing), "flash_recompute": cuda}
        record = {**described, **timer.record(), "recompute": recompute, "flop_params": list(flop_params),
                  "peak_tflops": peak,
                  "gpu_allocated_before_build_bytes": leftover,
                  "train_runtime_s": round(float(result.metrics.get("train_runtime", 0.0)), 3),
                  "wall_s": round(time.perf_counter() - started, 2),
                  "final_loss": result.metrics.get("train_loss")}
        record["summary"] = summarize(record, flop_params=flop_params, peak_tflops=peak)
        return record
    except Exception as exc:  # one arm failing (a kernel missing on this GPU) must not lose the others
        return {"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-3000:], "steps": timer.steps}
    finally:
        held.clear()
        trainer = None  # the last reference: the model and optimizer go with it
        gc.collect()
        if arm == "pf-trl-compile":
            torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()


def recompute_table(runs: list[dict[str, Any]], datasets: list[str]) -> list[dict[str, Any]]:
    """Per (dataset, arm): medians over the repeats of each figure, ratios to ``trl-padded`` (same dataset)."""
    table = []
    for ds in datasets:
        by_arm: dict[str, list[dict]] = {}
        for r in runs:
            if r["dataset"] == ds and "steps" in r and "summary" in r:
                s = summarize(r, flop_params=tuple(r["flop_params"]), peak_tflops=r["peak_tflops"])
                by_arm.setdefault(r["arm"], []).append({**s, "_record": r})
        base = None
        for arm in [a for a in ARMS if a in by_arm]:
            ss = by_arm[arm]
            tps = [s["real_tokens_per_second"] for s in ss]

            keys = ("real_tokens_per_second", "supervised_tokens_per_second", "gpu_max_allocated_gb",
                    "gpu_max_reserved_gb", "mfu", "hfu", "tflops", "padding_share", "data_seconds_share",
                    "timed_steps", "timed_seconds")
            row = {"dataset": ds, "arm": arm, "repeats": len(ss), **{k: _median(ss, k) for k in keys},
                   "real_tokens_per_second_runs": tps,
                   "attention": ss[0]["_record"].get("varlen_kernel") or ss[0]["_record"].get("varlen_backend")
                   or ss[0]["_record"].get("attn_implementation")}
            if arm == "trl-padded":
                base = row["real_tokens_per_second"]
            row["ratio_to_padded"] = round(row["real_tokens_per_second"] / base, 3) if base else None
            table.append(row)
    return table


def _median(summaries: list[dict[str, Any]], key: str) -> float | None:
    vals = [s[key] for s in summaries if s.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def format_table(table: list[dict[str, Any]]) -> str:
    head = ["dataset", "arm", "attention", "real tok/s", "supervised tok/s", "x padded", "MFU", "HFU", "padding",
            "GPU alloc / reserved (GB)", "timed steps x repeats"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        hfu = "-" if r.get("hfu") is None else f"{100 * r['hfu']:.1f}%"
        mem = ("-" if r["gpu_max_allocated_gb"] is None
               else f"{r['gpu_max_allocated_gb']:.1f} / {r['gpu_max_reserved_gb']:.1f}")
        ratio = "-" if r["ratio_to_padded"] is None else f"{r['ratio_to_padded']:.2f}x"
        lines.append("| " + " | ".join(str(x) for x in [
            r["dataset"], r["arm"], r["attention"], f"{r['real_tokens_per_second']:,.0f}",
            f"{r['supervised_tokens_per_second']:,.0f}", ratio, mfu, hfu, f"{100 * r['padding_share']:.1f}%", mem,
            f"{r['timed_steps']:.0f} x {r['repeats']}"]) + " |")
    return "\n".join(lines)


def bench(setup: BenchSetup, *, datasets: dict[str, list[str]], repeats: int, rows_per_dataset: int,
          warmup_steps: int, min_steps: int, min_seconds: float, cuda: bool, out_path: Path,
          deadline: float | None = None, max_len: int | None = None,
          repeat_arms: list[str] | None = None, round_offset: int = 0) -> dict[str, Any]:
    """Run every (dataset, round, arm); write ``out_path`` after each arm; return the report.

    ``deadline`` (a ``time.time()``): no arm starts that would end after it, judged by the longest arm so far.
    ``round_offset``: the first round's index (a second call that continues an earlier call's rounds: its arm
    order is rotated on, and its records merge with the earlier ones, :func:`merge_reports`).

    ``repeat_arms``: the arms of the rounds after the first (default: all), for a run that has time for every arm
    once but for the main ones only twice; the table says how many runs each figure is the median of.
    """
    from pf_trl.data.prepare import derive_token_budget

    report: dict[str, Any] = {
        "bench": "pf-trl end-to-end, steady state", "setup": asdict(setup), "versions": versions(),
        "machine": machine(cuda), "repeats": repeats, "warmup_steps": warmup_steps, "min_steps": min_steps,
        "min_seconds": min_seconds, "repeat_arms": repeat_arms, "round_offset": round_offset,
        "peak_tflops_note": f"dense bf16 peak, H200: {H200_BF16_DENSE_TFLOPS} TFLOP/s",
        "mfu_formula": MFU_FORMULA, "hfu_formula": HFU_FORMULA,
        "step_time": STEP_TIME,
        "datasets": {}, "runs": [], "table": [],
    }
    import numpy as np

    for ds_name, arms in datasets.items():
        doc = load_shapes(ds_name)
        shapes = doc["shapes"][:rows_per_dataset]
        from pf_trl.models import embedded_config

        vocab = embedded_config(setup.model, **setup.model_overrides).vocab_size
        rows = rows_from_shapes(shapes, vocab, seed=setup.seed, max_len=max_len)
        lengths = np.asarray([len(r["input_ids"]) for r in rows])
        budget = derive_token_budget(lengths, setup.batch_size)
        path = DATA_DIR / f"lengths_{ds_name}.json"
        report["datasets"][ds_name] = {
            **{k: v for k, v in doc.items() if k != "shapes"}, "file": f"benchmarks/data/{path.name}",
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rows_used": len(rows),
            "mean_length_used": round(float(lengths.mean()), 1), "pf_trl_token_budget": int(budget)}
        for rnd in range(repeats):
            this_round = list(arms) if rnd == 0 or repeat_arms is None else [a for a in arms if a in repeat_arms]
            for arm in arm_order(this_round, round_offset + rnd):
                why = _no_time(deadline, report["runs"])
                if why:
                    report["cut_short"] = f"{why} before {ds_name} round {round_offset + rnd + 1} {arm}"
                    break
                print(f"e2e: {ds_name} round {round_offset + rnd + 1}: {arm}", flush=True)
                rec = run_arm(arm, setup, rows, budget=budget, cuda=cuda, warmup_steps=warmup_steps,
                              min_steps=min_steps, min_seconds=min_seconds)
                rec.update(dataset=ds_name, round=round_offset + rnd)
                report["runs"].append(rec)
                status = rec.get("skipped") or rec.get("error") or rec["summary"]
                print(f"e2e:   -> {status}", flush=True)
                report["table"] = recompute_table(report["runs"], list(datasets))
                out_path.write_text(json.dumps(report, indent=1))
    report["table_markdown"] = format_table(report["table"])
    out_path.write_text(json.dumps(report, indent=1))
    return report


def _no_time(deadline: float | None, runs: list[dict[str, Any]]) -> str | None:
    """Why no further arm may start (None: it may): the deadline is past, or the longest arm so far would end
    after it."""
    if deadline is None:
        return None
    now = time.time()
    if now >= deadline:
        return "deadline reached"
    longest = max((r["wall_s"] for r in runs if "wall_s" in r), default=0.0)
    if now + longest > deadline:
        return f"{deadline - now:.0f} s left, the longest arm so far took {longest:.0f} s"
    return None


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Reports of the same bench from several calls (the second continuing the first's rounds) as one: their runs
    together, the table recomputed from them."""
    merged = {**reports[0], "runs": [r for rep in reports for r in rep["runs"]], "merged_from": len(reports)}
    datasets = list(dict.fromkeys(d for rep in reports for d in rep["datasets"]))
    merged["table"] = recompute_table(merged["runs"], datasets)
    merged["table_markdown"] = format_table(merged["table"])
    return merged


SEED_DATA_NOTE = ("ShareGPT first turns in an Alpaca-style '### Instruction:/### Response:' template (the shapes of "
                  "pf-trl's shipped ShareGPT sample, random token ids), NOT the Alpaca dataset the seed used: no "
                  "Alpaca data ships in a registry package here")


def seed_experiment(setup: BenchSetup, *, dataset: str, steps: int, cuda: bool, out_path: Path,
                    warmup_steps: int = 3, arms: tuple[str, ...] = SEED_ARMS, max_len: int | None = None,
                    deadline: float | None = None) -> dict[str, Any]:
    """The seed's experiment, as the seed ran it: ``steps`` padded steps of ``batch_size`` rows (``trl-padded``, the
    rows in dataset order) against the same steps of the same rows with the padding removed and nothing else
    changed (``pf-trl-same-batches``: step i packs the padded arm's step-i rows into one row), then pf-trl's token
    budget over the same rows (``pf-trl``: ``batch_size`` x mean length, one pass; our improvement beside it).

    Runtime = the sum of every synchronized step (warm-up included, as a user's ``train_runtime``); tokens/s, MFU
    and HFU over the steps after ``warmup_steps``. ``deadline``: no arm starts that would end after it."""
    import numpy as np

    from pf_trl.data.prepare import derive_token_budget

    doc = load_shapes(dataset)
    from pf_trl.models import embedded_config

    vocab = embedded_config(setup.model, **setup.model_overrides).vocab_size
    setup = BenchSetup(**{**asdict(setup), "sequential": True})
    rows = rows_from_shapes(doc["shapes"][: steps * setup.batch_size], vocab, seed=setup.seed, max_len=max_len)
    lengths = np.asarray([len(r["input_ids"]) for r in rows])
    budget = derive_token_budget(lengths, setup.batch_size)
    path = DATA_DIR / f"lengths_{dataset}.json"
    report: dict[str, Any] = {
        "bench": "the seed's experiment: padded vs padding removed (nothing else changed), and pf-trl's token budget",
        "setup": asdict(setup), "versions": versions(), "machine": machine(cuda),
        "data": {"name": dataset, "what": SEED_DATA_NOTE, "file": f"benchmarks/data/{path.name}",
                 "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                 **{k: v for k, v in doc.items() if k not in ("shapes", "name")}},
        "dataset": {"name": dataset, "what": SEED_DATA_NOTE, **{k: v for k, v in doc.items() if k not in ("shapes",
                                                                                                       "name")}},
        "rows": len(rows), "real_tokens": int(lengths.sum()), "mean_length": round(float(lengths.mean()), 1),
        "max_length": int(lengths.max()), "optimizer_steps": steps, "examples_per_step": setup.batch_size,
        "pf_trl_token_budget": int(budget), "mfu_formula": MFU_FORMULA, "hfu_formula": HFU_FORMULA,
        "step_time": STEP_TIME,
        "seed_reference": {"padded_s": 79.4, "padding_free_s": 57.8, "speedup": 1.37,
                           "what": "Mistral-7B, Alpaca, 1 GPU, batch 4, 100 steps (the seed's figures)"},
        "comparison_with_seed": (
            "the same: a Mistral-7B shape, bf16 weights, batch 4, 100 optimizer steps over the same 400 rows in "
            "both arms, activation checkpointing, AdamW, one GPU, runtime = the sum of the steps. What differs: the "
            "rows (" + SEED_DATA_NOTE + f"; mean {float(lengths.mean()):.0f} tokens, max {int(lengths.max())}), so "
            "the padding share and the ratio differ with them; random init instead of pretrained weights (the same "
            "FLOPs); the GPU and software stack (this JSON's machine and versions); the seed's padding-free "
            "implementation. Compare speedup_runtime (padding removed, same batches) with the seed's 1.37x; "
            "speedup_token_budget is pf-trl's own batching, not part of the seed's experiment."),
        "runs": [],
    }
    for arm in arms:
        why = _no_time(deadline, report["runs"])
        if why:
            report["runs"].append({"arm": arm, "skipped": why})
            print(f"seed: {arm} skipped ({why})", flush=True)
            continue
        print(f"seed: {arm}", flush=True)
        rec = run_arm(arm, setup, rows, budget=budget, cuda=cuda, warmup_steps=warmup_steps, min_steps=10**9,
                      min_seconds=float("inf"), max_steps=-1 if arm == "pf-trl" else steps)
        if "steps" in rec and "summary" in rec:
            rec["runtime_all_steps_s"] = round(sum(s["seconds"] for s in rec["steps"]), 3)
            rec["real_tokens_all_steps"] = int(sum(s["real"] for s in rec["steps"]))
            rec["optimizer_steps"] = len(rec["steps"])
            rec["examples_per_step"] = sorted({int(s["examples"]) for s in rec["steps"]})
        report["runs"].append(rec)
        print(f"seed:   -> {rec.get('error') or rec.get('skipped') or rec.get('runtime_all_steps_s')}", flush=True)
        out_path.write_text(json.dumps(report, indent=1))
    done = {r["arm"]: r for r in report["runs"] if "runtime_all_steps_s" in r}
    padded = done.get("trl-padded")
    for arm, key in (("pf-trl-same-batches", "speedup_runtime"), ("pf-trl", "speedup_token_budget")):
        if padded and arm in done:
            report[key] = round(padded["runtime_all_steps_s"] / done[arm]["runtime_all_steps_s"], 3)
    if padded and "pf-trl-same-batches" in done:
        ours = done["pf-trl-same-batches"]
        report["same_tokens"] = padded["real_tokens_all_steps"] == ours["real_tokens_all_steps"]
        # step by step the same rows: each step's real tokens and examples agree
        report["same_batches"] = ([(s["real"], s["examples"]) for s in padded["steps"]]
                                  == [(s["real"], s["examples"]) for s in ours["steps"]])
    if padded and "pf-trl" in done:
        report["same_tokens_token_budget"] = padded["real_tokens_all_steps"] == done["pf-trl"]["real_tokens_all_steps"]
    out_path.write_text(json.dumps(report, indent=1))
    return report
