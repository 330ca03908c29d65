"""`pf-trl pretokenize SOURCE OUTPUT_DIR [options]`: the offline door to `pretokenize()`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pf_trl.cli.flags import normalize_flags, one_line
from pf_trl.data.options import PretokenizeConfig, add_cli_arguments, config_from_values, parse_bool
from pf_trl.data.scan import check_json_lines
from pf_trl.data.sources import check_source_path
from pf_trl.data.tokenizer import default_tokenizer_for, resolve_tokenizer
from pf_trl.data.truncation import POLICY_HELP
from pf_trl.errors import PfTrlError
from pf_trl.storage import is_remote

_HELP = {
    "truncation": POLICY_HELP.replace("the sequence limit", "--max_seq_len"),
    "truncation_mode": "Which tokens 'truncate' keeps: keep_start (the first max_seq_len, TRL's default) or keep_end.",
}

class PretokenizeCLIError(PfTrlError, ValueError):
    """A bad flag; one line."""


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per data option (:class:`~pf_trl.data.options.PretokenizeConfig` is the single list of options)."""
    add_cli_arguments(parser)


def config_from_args(args: argparse.Namespace) -> PretokenizeConfig:
    """The config of the parsed flags (``--chat_template FILE`` read into the template text)."""
    return config_from_values({k: v for k, v in vars(args).items() if k != "trust_remote_code"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pf-trl pretokenize",
        description="Tokenize a local dataset (JSON/JSONL/Parquet/CSV or a save_to_disk directory) into a shards "
        "directory. Flags take dashes or underscores (--max-seq-len = --max_seq_len).",
        exit_on_error=False,
        allow_abbrev=False,
    )
    parser.add_argument("source", nargs="?", help="a data file or directory (or pass --data_config)")
    parser.add_argument("output_dir")
    parser.add_argument("--data_config", default=None,
                        help="a data config (alias --data_config_path): every dataset tokenized with its own options, "
                        "written as one shards directory that records each source and the mixing rule")
    parser.add_argument("--tokenizer_name_or_path", default=None,
                        help="tokenizer folder or embedded name (alias --tokenizer); default: the model's own")
    parser.add_argument("--model_name_or_path", default=None,
                        help="the model the data is for: its folder's tokenizer is the default tokenizer")
    parser.add_argument("--trust_remote_code", type=parse_bool, nargs="?", const=True, default=False,
                        help="run the tokenizer's or processor's own code (its auto_map), as TRL's "
                        "--trust_remote_code True does; without it such a tokenizer is refused")
    parser.add_argument("--num_proc", type=int, default=1)
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="local: this process (and --num_proc forked workers), one shards directory; ray: Ray Data "
                        "tasks on the cluster of RAY_ADDRESS (else a local one), written as a dataset of many parts "
                        "with the same rows in source order (needs pf-trl[ray]; docs/data.md)")
    parser.add_argument("--ray_workers", type=int, default=None,
                        help="with --engine ray: Ray workers, one CPU each (default: every CPU of the cluster)")
    parser.add_argument("--rows_per_part", type=int, default=None,
                        help="with --engine ray: source rows per part (default: about 4 parts per worker)")
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
        **({"sources": [{k: r.get(k) for k in ("name", "input_format", "weight", "rows", "counts")}
                        for r in manifest["sources"]], "mixture": manifest.get("mixture")}
           if manifest.get("sources") else {}),
        "lengths": {k: v for k, v in manifest["lengths"].items() if k != "histogram"},
    }


def _read_data_config(path: str):
    from pf_trl.data.data_config import DataConfigError, check_data_config_paths, read_data_config

    try:
        config = read_data_config(path)
        check_data_config_paths(config)
    except DataConfigError as exc:
        raise PretokenizeCLIError(f"--data_config {path}: {exc}") from exc
    if config.streaming:
        raise PretokenizeCLIError(f"--data_config {path} streams (dataprocessor.streaming: true): a stream is "
                                  "tokenized while training; set streaming: false to write shards")
    return config


def _pretokenize_mixture(data_config, args: argparse.Namespace, config: PretokenizeConfig, tokenizer) -> dict:
    """Each dataset into its own content-addressed shards, then all of them as one shards directory
    (:func:`pf_trl.data.engines.pretokenize_data_config`, which ``pf_trl.pretokenize`` runs too)."""
    from pf_trl.data.engines import pretokenize_data_config

    say = (lambda *_: None) if args.no_progress else (lambda msg: print(f"pf-trl: {msg}", file=sys.stderr, flush=True))
    return pretokenize_data_config(data_config, args.output_dir, config, tokenizer, num_proc=args.num_proc,
                                   progress=not args.no_progress, overwrite=args.overwrite, say=say)


def _hub_source(args: argparse.Namespace):
    """SOURCE given as a Hub dataset id: its ``train`` split (downloaded by huggingface_hub): one file replaces
    ``args.source``, several files are returned as a data config (else None)."""
    from pf_trl.hub import looks_like_repo_id

    if not looks_like_repo_id(args.source):
        return None
    from pf_trl.data.data_config import DataConfig
    from pf_trl.data.local_datasets import LocalDatasetError, resolve_dataset_name

    try:
        data = resolve_dataset_name(args.source, config=None, train_split="train", test_split="test", evaluate=False,
                                    flag="source")
    except LocalDatasetError as exc:
        raise PretokenizeCLIError(str(exc)) from None
    if isinstance(data.train, DataConfig):
        return data.train
    args.source = data.train
    return None


def main(argv: list[str]) -> int:
    try:
        argv = normalize_flags(argv, command="pretokenize")  # `pf-trl train` spellings: pf_trl.cli.flags.FLAG_ALIASES
        parser = build_parser()
        if any(a in ("-h", "--help") for a in argv):
            parser.print_help()
            return 0
        args = parser.parse_args(argv)
        if args.engine == "ray":
            from pf_trl.data.ray_engine import import_ray

            import_ray()  # not installed: one line naming the extra, before any work
        if (args.source is None) == (args.data_config is None):
            raise PretokenizeCLIError("pass a SOURCE or --data_config FILE (not both) before OUTPUT_DIR")
        data_config = _read_data_config(args.data_config) if args.data_config else None
        if data_config is None:
            data_config = _hub_source(args)  # a Hub dataset id (a bucket URI or a local path is not one)
        if data_config is None:
            args.source = str(check_source_path(args.source, flag="source"))  # a bucket URI: its cached copy
        config = config_from_args(args)
        if data_config is None:
            check_json_lines(args.source)  # the first bad line, numbered, before the tokenizer loads
        trust = args.trust_remote_code
        model = args.model_name_or_path
        if args.tokenizer_name_or_path is None:  # a model folder without a tokenizer fails here, cheaply
            found = default_tokenizer_for(model, trust_remote_code=trust)
            if is_remote(model):  # a bucket model: its tokenizer files and config.json, fetched (not its weights)
                model = found
        tokenizer = resolve_tokenizer(model, args.tokenizer_name_or_path, trust_remote_code=trust)
        if args.engine == "ray":
            if data_config is not None:
                raise PretokenizeCLIError("--engine ray tokenizes one source; a data config (or a Hub dataset of "
                                          "several files) is tokenized with --engine local")
            if args.num_proc != 1:
                raise PretokenizeCLIError("--num_proc applies to --engine local; Ray's workers: --ray_workers")
        elif args.ray_workers is not None or args.rows_per_part is not None:
            raise PretokenizeCLIError("--ray_workers and --rows_per_part apply to --engine ray only")
        if data_config is not None:
            manifest = _pretokenize_mixture(data_config, args, config, tokenizer)
        else:
            from pf_trl.data.engines import pretokenize

            engine_options = ({"ray_workers": args.ray_workers, "rows_per_part": args.rows_per_part}
                              if args.engine == "ray" else {"num_proc": args.num_proc})
            manifest = pretokenize(args.source, args.output_dir, config, tokenizer=tokenizer, engine=args.engine,
                                   overwrite=args.overwrite, progress=not args.no_progress, **engine_options)
    # PfTrlError: pf-trl's refusals (flags, options, sources, tokenizer, shards); ValueError: what upstream raises on the
    # data (transformers' tokenizers, e.g. apply_chat_template; datasets) and the truncation policy check
    except (argparse.ArgumentError, PfTrlError, ValueError) as exc:
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
