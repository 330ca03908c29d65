"""`pf-trl pretokenize SOURCE OUTPUT_DIR [options]`: the offline door to `pretokenize()`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from pf_trl.cli.flags import normalize_flags, one_line
from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize
from pf_trl.data.shards import ShardsError
from pf_trl.data.sources import DataSourceError, check_source_path
from pf_trl.data.tokenizer import TokenizerLoadError, default_tokenizer_for, resolve_tokenizer
from pf_trl.data.truncation import POLICY_HELP

_HELP = {
    "truncation": POLICY_HELP.replace("the sequence limit", "--max_seq_len"),
    "truncation_mode": "Which tokens 'truncate' keeps: keep_start (the first max_seq_len, TRL's default) or keep_end.",
}

# `pf-trl train` spellings of the same options.
ALIASES = {"--dataset_text_field": "--text_field", "--tokenizer": "--tokenizer_name_or_path"}


class PretokenizeCLIError(ValueError):
    """A bad flag; one line."""


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per PretokenizeConfig field (the config dataclass is the single list of options)."""
    for f in dataclasses.fields(PretokenizeConfig):
        flag = "--" + f.name
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, type=_parse_bool, default=default, metavar="BOOL", help=f"(default {default})")
        elif f.name == "max_seq_len":
            parser.add_argument(flag, type=int, default=default, help=f"(default {default})")
        elif f.name in _HELP:
            parser.add_argument(flag, default=default, help=f"{_HELP[f.name]} (default {default!r})")
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
        description="Tokenize a local dataset (JSON/JSONL/Parquet/CSV or a save_to_disk directory) into a shards "
        "directory. Flags take dashes or underscores (--max-seq-len = --max_seq_len).",
        exit_on_error=False,
    )
    parser.add_argument("source")
    parser.add_argument("output_dir")
    parser.add_argument("--tokenizer_name_or_path", default=None,
                        help="tokenizer folder or embedded name (alias --tokenizer); default: the model's own")
    parser.add_argument("--model_name_or_path", default=None,
                        help="the model the data is for: its folder's tokenizer is the default tokenizer")
    parser.add_argument("--chat_template", default=None, help="Jinja chat template FILE for chat formats")
    parser.add_argument("--num_proc", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no_progress", action="store_true")
    add_config_arguments(parser)

    def error(message: str):
        raise PretokenizeCLIError(f"{message} (see `pf-trl pretokenize --help`)")

    parser.error = error
    return parser


def summary(args: argparse.Namespace, manifest: dict) -> dict:
    source = manifest["source"]
    return {
        "output_dir": args.output_dir,
        "input_format": source["input_format"],
        "chat_mask": source.get("chat_mask"),
        "tokenizer": manifest["tokenizer"]["name"],
        "counts": manifest["counts"],
        "lengths": {k: v for k, v in manifest["lengths"].items() if k != "histogram"},
    }


def main(argv: list[str]) -> int:
    argv = normalize_flags(argv, ALIASES)
    try:
        parser = build_parser()
        if any(a in ("-h", "--help") for a in argv):
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
        check_source_path(args.source, flag="source")
        if args.chat_template and not os.path.isfile(args.chat_template):
            raise PretokenizeCLIError(f"--chat_template {args.chat_template}: no such file")
        config = config_from_args(args)
        if args.tokenizer_name_or_path is None:
            default_tokenizer_for(args.model_name_or_path)  # a model folder without a tokenizer fails here, cheaply
        tokenizer = resolve_tokenizer(args.model_name_or_path, args.tokenizer_name_or_path,
                                      chat_template_file=args.chat_template)
        manifest = pretokenize(args.source, args.output_dir, config, tokenizer=tokenizer, num_proc=args.num_proc,
                               overwrite=args.overwrite, progress=not args.no_progress)
    except (argparse.ArgumentError, PretokenizeCLIError, PretokenizeError, ShardsError, TokenizerLoadError,
            DataSourceError) as exc:
        if os.environ.get("PF_TRL_DEBUG"):
            raise
        print(f"pf-trl pretokenize: error: {one_line(exc)}", file=sys.stderr)
        return 2
    line = truncation_line(manifest)
    if line:  # a decision the user sees, not only a count in the JSON (stdout stays JSON)
        print(f"pf-trl pretokenize: {line}", file=sys.stderr)
    print(json.dumps(summary(args, manifest), indent=2))
    return 0


def truncation_line(manifest: dict) -> str | None:
    from pf_trl.data.truncation import report_from_manifest

    return report_from_manifest(manifest).summary("examples", limit_name="--max_seq_len")
