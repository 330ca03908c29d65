"""Supervised tokens: `pf-trl train` (CLI) vs `PaddingFreeSFTTrainer` (Python API) on the same rows, per format.

The same N rows of the shipped sample are written in each input format (prompt/completion, text + response
template, chat ``messages`` with a system turn and two exchanges, Alpaca, ShareGPT ``conversations``, TRL's
conversational prompt-completion). Each goes through

- the CLI's data path (``pf_trl.cli.train.build``: tokenizer, data, trainer), and
- the Python API: ``PaddingFreeSFTTrainer(model, train_dataset=datasets.Dataset.from_list(rows))``,

and the script counts the supervised labels (``labels != -100``) and all tokens of one epoch of each trainer's
train dataloader: what is actually trained. A format a path refuses is reported with its error's first line.

    python benchmarks/data_paths.py [--rows 12] [--out benchmarks/results/data_paths.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

SYSTEM = "You are a helpful assistant."
TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"


def sample_pairs(n: int) -> list[tuple[str, str]]:
    """(instruction, answer) pairs from the shipped sample (its prompts are '### Instruction:\\n...### Response:\\n')."""
    from pf_trl.data.samples import SHAREGPT_SAMPLE

    pairs = []
    with open(SHAREGPT_SAMPLE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            instruction = row["prompt"].removeprefix("### Instruction:\n").removesuffix("\n\n### Response:\n")
            pairs.append((instruction, row["completion"]))
            if len(pairs) == 2 * n:
                break
    return pairs


def rows_per_format(n: int) -> dict[str, list[dict[str, Any]]]:
    pairs = sample_pairs(n)
    single, second = pairs[:n], pairs[n:]
    alpaca_prompt = "### Instruction:\n{}\n\n### Response:\n"
    return {
        "prompt_completion": [{"prompt": alpaca_prompt.format(q), "completion": a} for q, a in single],
        "text": [{"text": alpaca_prompt.format(q) + a} for q, a in single],
        "messages": [
            {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q},
                          {"role": "assistant", "content": a}, {"role": "user", "content": q2},
                          {"role": "assistant", "content": a2}]}
            for (q, a), (q2, a2) in zip(single, second)
        ],
        "alpaca": [{"instruction": q, "input": "" if i % 2 else "Answer briefly.", "output": a}
                   for i, (q, a) in enumerate(single)],
        "sharegpt": [
            {"conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": q},
                               {"from": "gpt", "value": a}]}
            for q, a in single
        ],
        "conversational_prompt_completion": [
            {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in single
        ],
    }


def count_dataloader(trainer) -> dict[str, int]:
    supervised = tokens = 0
    for batch in trainer.get_train_dataloader():
        labels = batch["labels"]
        supervised += int((labels != -100).sum())
        tokens += int(batch["input_ids"].numel())
    return {"supervised": supervised, "tokens": tokens}


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def run(n: int) -> dict[str, Any]:
    import datasets

    from pf_trl.cli.train import build, parse_args
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PF_TRL_CACHE"] = str(Path(tmp) / "cache")
        for name, rows in rows_per_format(n).items():
            path = Path(tmp) / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
            entry: dict[str, Any] = {"rows": len(rows)}
            argv = ["--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides", TINY, "--training_data_path",
                    str(path), "--output_dir", str(Path(tmp) / "out"), "--report_to", "none", "--save_strategy", "no"]
            if name == "text":
                argv += ["--response_template", "### Response:"]
            try:
                entry["cli"] = count_dataloader(build(*parse_args(argv), quiet=True))
            except BaseException as exc:  # a refusal is a result here
                entry["cli"] = {"error": first_line(exc)}
            try:
                model = build_model("pf-trl/tiny-llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                    num_attention_heads=2, num_key_value_heads=1)
                config = PaddingFreeConfig(output_dir=str(Path(tmp) / "api"), report_to="none", save_strategy="no")
                kwargs: dict[str, Any] = {}
                if name == "text" and "pretokenize_config" in inspect.signature(PaddingFreeSFTTrainer).parameters:
                    from pf_trl.data.pretokenize import PretokenizeConfig

                    kwargs["pretokenize_config"] = PretokenizeConfig(response_template="### Response:")
                trainer = PaddingFreeSFTTrainer(model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                                                **kwargs)
                entry["api"] = count_dataloader(trainer)
            except BaseException as exc:
                entry["api"] = {"error": first_line(exc)}
            results[name] = entry
            print(f"{name:34s} cli {entry['cli']}  api {entry['api']}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {"rows": args.rows, "formats": run(args.rows)}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
