"""Padded vs padding-free real tokens/s on a tiny vision-language model with mixed image counts (CPU).

Model: a tiny Qwen2-VL (``pf_trl_dev.tiny_vlm``, language model widened to ``--hidden`` x ``--layers``) with
its processor (PIL image processor, Mistral v1 tokenizer + Qwen's image tokens, Qwen's chat template). Data:
``--rows`` conversations whose user turn is a ShareGPT instruction (the shipped sample) and whose reply is its answer,
cut to ``--max-words``, each with 0 to 3 random images of varied sizes (so 0 to a few hundred image tokens per row).

Modes, same examples, same seed, one epoch each:

- ``padded``: TRL's ``SFTTrainer`` with its ``DataCollatorForVisionLanguageModeling`` (images processed on the fly,
  rows padded to the longest of the batch), ``per_device_train_batch_size`` = ``--batch-size``;
- ``pf_trl``: ``PaddingFreeSFTTrainer`` in each of ``--modes`` (``huggingface``: transformers' packed sdpa path;
  ``internal``: pf-trl's ``pf_varlen`` kernels), the same rows pretokenized once (not timed: a cache hit after the
  first run), token budget = batch size x mean length.

Both train every example once, so "real tokens" (non-padding tokens, images included) are the same in both and
real tokens/s = those tokens / epoch seconds. The modes alternate (``--repeats`` rounds: padded, then each pf-trl
mode) and each ratio is taken within its round, because the machine is shared and its speed drifts; the table shows
each round and the median ratio.

    python benchmarks/vlm_padding_free.py [--rows 48] [--repeats 3] [--out benchmarks/results/vlm_qwen2vl_cpu.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

SIZES = ((56, 84), (112, 112), (84, 168), (168, 224), (56, 56), (224, 112))


def build_rows(n: int, max_words: int, seed: int = 0) -> list[dict]:
    """``n`` chats from the shipped ShareGPT sample, each with 0-3 random images (the counts cycle 0, 1, 3, 2...)."""
    import random

    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl_dev.tiny_vlm import random_images

    rng = random.Random(seed)
    rows = []
    with open(SHAREGPT_SAMPLE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            question = row["prompt"].removeprefix("### Instruction:\n").removesuffix("\n\n### Response:\n")
            ask = " ".join(question.split()[: rng.randint(5, max_words)])
            answer = " ".join(row["completion"].split()[: rng.randint(5, max_words)])
            count = (0, 1, 3, 2, 1, 0, 2, 1)[len(rows) % 8]
            images = random_images(count, seed=len(rows), sizes=SIZES[len(rows) % 3:] + SIZES[: len(rows) % 3])
            rows.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}],
                         "images": images})
            if len(rows) == n:
                return rows
    return rows


def run_padded(model, processor, dataset, batch_size: int, work: str) -> dict:
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=work, report_to=[], use_cpu=True, assistant_only_loss=True, max_length=None,
                     per_device_train_batch_size=batch_size, num_train_epochs=1, save_strategy="no",
                     logging_strategy="no", disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=processor)
    start = time.perf_counter()
    trainer.train()
    return {"seconds": time.perf_counter() - start}


def run_pf(model, processor, dataset, batch_size: int, work: str, mode: str = "huggingface") -> dict:
    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=work, report_to=[], use_cpu=True, padding_free=mode, max_length=None,
                             per_device_train_batch_size=batch_size, num_train_epochs=1, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=dataset, processing_class=processor)
    start = time.perf_counter()
    trainer.train()
    return {"seconds": time.perf_counter() - start, "token_budget": trainer.pf_token_budget,
            "steps": trainer.state.global_step}


def real_and_padded_tokens(processor, rows, batch_size: int) -> tuple[int, int]:
    """Tokens of the examples (images included) and the padded tokens of batches of ``batch_size`` in row order
    (TRL's sampler shuffles: the padded count is the expectation's order of magnitude, not exact)."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collate = DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)
    lengths = [collate([copy.deepcopy(r)])["input_ids"].shape[1] for r in rows]
    padded = sum(max(lengths[i:i + batch_size]) * len(lengths[i:i + batch_size])
                 for i in range(0, len(lengths), batch_size))
    return sum(lengths), padded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-words", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["huggingface", "internal"], choices=["huggingface", "internal"],
                        help="pf-trl padding_free modes, each timed after the padded run of the same repeat")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vlm_qwen2vl_cpu.json")
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("pf_trl").setLevel(logging.ERROR)

    import torch
    from datasets import Dataset

    from pf_trl_dev.tiny_vlm import tiny_vlm

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, processor = tiny_vlm("qwen2_vl", hidden_size=args.hidden, num_hidden_layers=args.layers)
    rows = build_rows(args.rows, args.max_words)
    dataset = Dataset.from_list(rows)
    real, padded = real_and_padded_tokens(processor, rows, args.batch_size)
    images = sum(len(r["images"]) for r in rows)
    modes = args.modes
    pairs = []
    with tempfile.TemporaryDirectory(prefix="pf-trl-vlm-bench-") as work:
        run_pf(copy.deepcopy(model), processor, dataset, args.batch_size, work)  # warm-up: pretokenize into the cache
        for i in range(args.repeats):
            pad = run_padded(copy.deepcopy(model), processor, dataset, args.batch_size, work)
            pair = {"padded_s": pad["seconds"], "padded_real_tok_s": real / pad["seconds"]}
            for mode in modes:
                pf = run_pf(copy.deepcopy(model), processor, dataset, args.batch_size, work, mode)
                pair.update({f"{mode}_s": pf["seconds"], f"{mode}_real_tok_s": real / pf["seconds"],
                             f"{mode}_ratio": pad["seconds"] / pf["seconds"], "pf_trl_steps": pf["steps"],
                             "token_budget": pf["token_budget"]})
            pairs.append(pair)
            print(f"repeat {i + 1}: padded {pair['padded_real_tok_s']:.0f} real tok/s, " + ", ".join(
                f"pf-trl {m} {pair[m + '_real_tok_s']:.0f} ({pair[m + '_ratio']:.2f}x)" for m in modes), flush=True)
    result = {
        "model": f"tiny qwen2_vl (language model {args.hidden} x {args.layers} layers, vision depth 1), float32, CPU",
        "rows": args.rows, "images": images, "batch_size": args.batch_size, "real_tokens": real,
        "padded_tokens_row_order": padded, "padding_share_row_order": round(1 - real / padded, 3),
        "torch_threads": torch.get_num_threads(), "load_average_at_end": list(os.getloadavg()), "modes": modes,
        "repeats": pairs,
        "median_ratio": {m: statistics.median(p[f"{m}_ratio"] for p in pairs) for m in modes},
    }
    head = " | ".join(f"pf-trl {m} real tok/s (x padded)" for m in modes)
    print(f"\n| repeat | padded real tok/s | {head} |\n|---|---|" + "---|" * len(modes))
    for i, p in enumerate(pairs, 1):
        cells = " | ".join(f"{p[m + '_real_tok_s']:.0f} ({p[m + '_ratio']:.2f}x)" for m in modes)
        print(f"| {i} | {p['padded_real_tok_s']:.0f} | {cells} |")
    print("| median ratio | | " + " | ".join(f"{result['median_ratio'][m]:.2f}x" for m in modes) + " |")
    print(f"\n{args.rows} rows, {images} images, {real} real tokens; batches of {args.batch_size} padded to their "
          f"longest in row order: {result['padding_share_row_order']:.0%} padding")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
