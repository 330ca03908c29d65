"""GRPO training-phase speed: TRL's GRPOTrainer (padded) against PaddingFreeGRPOTrainer, packed and shared-prefix.

Usage: python benchmarks/grpo_throughput.py [--repeats 5] [--groups 2] [--generations 8]
                                            [--out benchmarks/results/grpo_throughput.json]

The training phase of a GRPO step is what runs after generation: the reference model's log-probabilities (no
gradient), the policy's log-probabilities and entropies, TRL's loss and the backward. Each mode runs it on the same
generated batch in TRL's layout (``prompt_ids`` left-padded, ``completion_ids`` right-padded, ``G`` completions per
prompt), through the trainer's own ``_get_per_token_logps_and_entropies`` and ``compute_loss`` (``beta`` > 0, loss
type ``dapo``, float32, pf-trl's tiny Llama: 4 layers x 256, vocabulary 32,000, sdpa):

- ``trl``: TRL's GRPOTrainer, the padded ``[B, P + C]`` batch;
- ``pf-packed``: PaddingFreeGRPOTrainer with ``shared_prefix="off"``: one packed row, every sequence with its prompt;
- ``pf-shared``: PaddingFreeGRPOTrainer (``shared_prefix`` on by default): each group's prompt once in the row.

Scenarios: ``prompt-heavy`` (long prompts, short completions, G = 8: math, code, tool use) and ``completion-heavy``
(short prompts, long completions). Token lengths are drawn per group (prompts) and per sequence (completions).

The modes run in turn, ``--repeats`` times, in reversed order every other repeat; each speedup is the median over the
repeats of the ratio within a repeat. Peak memory is the resident-set high-water mark during the phase above the
resident set before it (``/proc/self/clear_refs``, Linux). Besides the measured times the JSON lists the tokens each
mode runs through the backbone and the positions its LM head projects: on CPU TRL's fused head projects every position
of the padded batch (prompt and padding included; on CUDA with Triton it projects the scored ones only), pf-trl only
the completion tokens. The ``expected_gpu_backbone_speedup`` is the ratio of backbone tokens (TRL's padded batch over
pf-trl's row), what a GPU whose step time follows the token count would give, before attention's quadratic share.
"""

from __future__ import annotations

from offline import REPO  # before any HF import: offline hub, the checkout's import path

# isort: split

import argparse
import json
import logging
import re
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

SCENARIOS = {
    "prompt-heavy": dict(prompt=(96, 128), completion=(4, 16)),
    "completion-heavy": dict(prompt=(8, 24), completion=(48, 96)),
}
MODES = ("trl", "pf-packed", "pf-shared")


def _hwm_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def generated_batch(scenario: str, groups: int, generations: int, pad: int, seed: int = 0) -> dict:
    """A generated batch in TRL's layout: ``groups`` prompts x ``generations`` completions."""
    spec = SCENARIOS[scenario]
    g = torch.Generator().manual_seed(seed)

    def draw(lo_hi):
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=g))

    prompts, completions = [], []
    for _ in range(groups):
        prompt = torch.randint(100, 30000, (draw(spec["prompt"]),), generator=g)
        for _ in range(generations):
            prompts.append(prompt)
            completions.append(torch.randint(100, 30000, (draw(spec["completion"]),), generator=g))
    P, C = max(len(p) for p in prompts), max(len(c) for c in completions)
    rows = len(prompts)
    prompt_ids = torch.full((rows, P), pad)
    prompt_mask = torch.zeros(rows, P, dtype=torch.long)
    completion_ids = torch.full((rows, C), pad)
    completion_mask = torch.zeros(rows, C, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = p, 1
        completion_ids[i, :len(c)], completion_mask[i, :len(c)] = c, 1
    advantages = torch.randn(rows, generator=g)
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=advantages,
                num_items_in_batch=completion_mask.sum().float())


def token_counts(batch: dict, generations: int) -> dict:
    p = batch["prompt_mask"].sum(1)
    c = batch["completion_mask"].sum(1)
    rows, width = batch["prompt_ids"].shape[0], batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    real = int((p + c).sum())
    shared = int(p[::generations].sum() + c.sum())
    return dict(sequences=rows, real_tokens=real, padded_tokens=rows * width, packed_tokens=real,
                shared_prefix_tokens=shared, padding_share=round(1 - real / (rows * width), 4),
                completion_tokens=int(c.sum()), trl_cpu_head_positions=rows * (width - 1),
                pf_head_positions=int(c.sum()))


def training_phase(trainer, batch: dict) -> float:
    """Reference log-probs (no grad), TRL's loss (policy log-probs and entropies inside), backward; seconds."""
    inputs = dict(batch)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() each step
    trainer.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.no_grad():
        inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask,
                                                                                   width)[0]
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return time.perf_counter() - start


def build(mode: str, folder: str, data, tmp: Path, batch_size: int):
    from rl_support import reward_length
    from trl import GRPOConfig, GRPOTrainer

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.trainer.rl import PaddingFreeGRPOConfig, PaddingFreeGRPOTrainer

    cls, config_cls, extra = {"trl": (GRPOTrainer, GRPOConfig, {}),
                              "pf-packed": (PaddingFreeGRPOTrainer, PaddingFreeGRPOConfig, {"shared_prefix": "off"}),
                              "pf-shared": (PaddingFreeGRPOTrainer, PaddingFreeGRPOConfig, {})}[mode]
    args = config_cls(output_dir=str(tmp / mode), report_to=[], use_cpu=True, bf16=False, beta=0.04,
                      per_device_train_batch_size=batch_size, num_generations=8, gradient_checkpointing=False,
                      loss_type="dapo", disable_dropout=True, **extra)
    return cls(model=folder, reward_funcs=reward_length, args=args, train_dataset=data,
               processing_class=load_tokenizer(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "grpo_throughput.json"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import datasets

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model

    tmp = Path(tempfile.mkdtemp())
    folder = tmp / "tiny-llama"
    build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    data = datasets.Dataset.from_list([{"prompt": "a b c"}] * 8)
    rows = args.groups * args.generations
    trainers = {mode: build(mode, str(folder), data, tmp, rows) for mode in MODES}
    pad = trainers["trl"].processing_class.pad_token_id
    report = dict(model="pf-trl/tiny-llama (4 x 256, vocab 32000), float32, CPU", torch_threads=torch.get_num_threads(),
                  groups=args.groups, generations=args.generations, repeats=args.repeats, scenarios={})
    for scenario in SCENARIOS:
        batch = generated_batch(scenario, args.groups, args.generations, pad)
        for mode in MODES:
            training_phase(trainers[mode], batch)  # warm-up
        times = {mode: [] for mode in MODES}
        peaks = {mode: [] for mode in MODES}
        for r in range(args.repeats):
            for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
                before = _rss_kib()
                Path("/proc/self/clear_refs").write_text("5")
                times[mode].append(training_phase(trainers[mode], batch))
                peaks[mode].append(max(0, _hwm_kib() - before) / 1024)
        counts = token_counts(batch, args.generations)
        result = dict(tokens=counts, modes={})
        for mode in MODES:
            median = statistics.median(times[mode])
            backbone = {"trl": counts["padded_tokens"], "pf-packed": counts["packed_tokens"],
                        "pf-shared": counts["shared_prefix_tokens"]}[mode]
            ratios = [t / s for t, s in zip(times["trl"], times[mode])]
            result["modes"][mode] = dict(
                seconds_median=round(median, 4), real_tokens_per_second=round(counts["real_tokens"] / median, 1),
                speedup_vs_trl_median=round(statistics.median(ratios), 3),
                speedup_min=round(min(ratios), 3), speedup_max=round(max(ratios), 3),
                peak_memory_mib_median=round(statistics.median(peaks[mode]), 1), backbone_tokens=backbone,
                head_positions=counts["trl_cpu_head_positions"] if mode == "trl" else counts["pf_head_positions"],
                expected_gpu_backbone_speedup=round(counts["padded_tokens"] / backbone, 3))
        report["scenarios"][scenario] = result
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("| scenario | mode | phase s (median) | real tok/s | speedup vs TRL (min-max) | peak MiB | backbone tokens "
          "| head positions | GPU expected (tokens) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario, result in report["scenarios"].items():
        for mode, m in result["modes"].items():
            print(f"| {scenario} | {mode} | {m['seconds_median']} | {m['real_tokens_per_second']} | "
                  f"{m['speedup_vs_trl_median']}x ({m['speedup_min']}-{m['speedup_max']}) | "
                  f"{m['peak_memory_mib_median']} | {m['backbone_tokens']} | {m['head_positions']} | "
                  f"{m['expected_gpu_backbone_speedup']}x |")


if __name__ == "__main__":
    main()
