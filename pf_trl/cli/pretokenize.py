"""`pf-trl pretokenize SOURCE OUTPUT_DIR [options]`: the offline door to `pretokenize()`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize
from pf_trl.data.shards import ShardsError
from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, TokenizerLoadError


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per PretokenizeConfig field (the config dataclass is the single list of options)."""
    for f in dataclasses.fields(PretokenizeConfig):
        flag = "--" + f.name
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, type=_parse_bool, default=default, metavar="BOOL", help=f"(default {default})")
        elif f.name == "max_seq_len":
            parser.add_argument(flag, type=int, default=default, help=f"(default {default})")
        else:
            parser.add_argument(flag, default=default, help=f"(default {default!r})")


def config_from_args(args: argparse.Namespace) -> PretokenizeConfig:
    return PretokenizeConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PretokenizeConfig)})


def _parse_bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "y"):
        return True
    if lowered in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pf-trl pretokenize",
        description="Tokenize a local dataset (JSON/JSONL/Parquet/CSV or a save_to_disk directory) into a shards directory.",
    )
    parser.add_argument("source")
    parser.add_argument("output_dir")
    parser.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="embedded name or local folder")
    parser.add_argument("--num_proc", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no_progress", action="store_true")
    add_config_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = pretokenize(
            args.source,
            args.output_dir,
            config_from_args(args),
            tokenizer=args.tokenizer,
            num_proc=args.num_proc,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (PretokenizeError, ShardsError, TokenizerLoadError) as exc:
        print(f"pf-trl pretokenize: error: {exc}", file=sys.stderr)
        return 2
    summary = {"output_dir": args.output_dir, "counts": manifest["counts"],
               "lengths": {k: v for k, v in manifest["lengths"].items() if k != "histogram"}}
    print(json.dumps(summary, indent=2))
    return 0
