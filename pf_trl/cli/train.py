"""`pf-trl train`: fine-tune padding-free. Every TrainingArguments / SFTConfig / PaddingFreeConfig flag works
(HfArgumentParser) under TRL's names, plus the flags of the fms-acceleration seed command line (its other spellings,
such as ``--padding_free huggingface`` for ``--padding_free_mode huggingface``, are aliases in the one table of
:data:`pf_trl.cli.flags.FLAG_ALIASES`):

    pf-trl train --model_name_or_path pf-trl/tiny-llama --padding_free_mode huggingface --packing False \
        --max_seq_len 4096 --use_flash_attn True --response_template '### Response:' --dataset_text_field output \
        --include_tokens_per_second True --training_data_path data.json --output_dir out ...

Data (``--training_data_path`` / ``--validation_data_path``): a shards directory (used as is), a data file (JSON /
JSONL / Parquet / CSV) or a ``datasets.save_to_disk`` directory in any format of ``docs/data.md`` (auto-detected,
``--input_format`` to override), tokenized once into the content-addressed cache by :mod:`pf_trl.data.sources` (the
same data path as ``PaddingFreeSFTTrainer`` and the service). ``--dataset_service_url/--dataset_id`` read a dataset
built by the preprocessing service instead; ``--data_config FILE`` (alias ``--data_config_path``) several datasets,
mixed by weight (:mod:`pf_trl.data.data_config`). The tokenizer defaults to the model folder's own.

This module only handles arguments: cheap checks first, before transformers and TRL are imported (every flag and
value against the flag table of :mod:`pf_trl.cli.flag_table`, data paths and JSON lines, data options, lengths, the
output directory's checkpoints, the service), then the data path and the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

from pf_trl._compat import parser_actions
from pf_trl.cli import flag_table
from pf_trl.cli.flags import FlagAliasError, normalize_flags, one_line
from pf_trl.cli.train_args import DataArguments, ModelArguments, TrainCLIError, full_parser
from pf_trl.errors import PfTrlError

logger = logging.getLogger("pf_trl.cli.train")

DEFAULT_OUTPUT_DIR = "pf-trl-output"


def _parser():
    """The full parser; its flag table is kept in the user cache when no table fits the installed versions, so the
    next command line is checked without importing transformers."""
    parser = full_parser()
    flag_table.remember(parser)
    return parser


class NormalizedArgv(list):
    """A ``pf-trl train`` command line already through :func:`normalize_argv`: the checks and parsers that follow
    read it as it is, so a command line is normalized (and its deprecations warned about) once."""


def normalize_argv(argv: list[str]) -> NormalizedArgv:
    """Underscored flag names, the aliases of :data:`pf_trl.cli.flags.FLAG_ALIASES` mapped onto TRL's / pf-trl's
    names (``--padding_free internal``: ``--padding_free_mode internal``, one FutureWarning). Idempotent; a
    :class:`NormalizedArgv` is returned as it is."""
    if isinstance(argv, NormalizedArgv):
        return argv
    from pf_trl.cli.trl_config import expand_config

    argv = expand_config(argv)  # TRL's --config FILE.yaml: its keys as flags, before (overridden by) the command line
    try:
        argv = normalize_flags(argv, command="train")
    except FlagAliasError as exc:
        raise TrainCLIError(str(exc)) from exc
    for i, arg in enumerate(argv):  # what is left of --padding_free is TRL's switch: true / false (or nothing)
        if arg == "--padding_free" and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            _check_padding_free_value(argv[i + 1])
        elif arg.startswith("--padding_free="):
            _check_padding_free_value(arg.partition("=")[2])
    return NormalizedArgv(argv)


def _check_padding_free_value(value: str) -> None:
    from pf_trl.trainer.modes import PADDING_FREE_MODES, as_bool

    if as_bool(value) is None:
        raise TrainCLIError(f"--padding_free must be one of true, false (TRL's switch) or, deprecated, a mode of "
                            f"--padding_free_mode ({', '.join(PADDING_FREE_MODES)}), got {value!r}")


def _unknown(rest: list[str], known: list[str]) -> TrainCLIError:
    import difflib

    hints = []
    for arg in rest:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                hints.append(f"{close[0]} for {flag}")
    hint = f"; did you mean {', '.join(hints)}?" if hints else ""
    return TrainCLIError(f"unknown arguments: {' '.join(rest)}{hint} (see `pf-trl train --help`)")


def parse_args(argv: list[str]):
    """(ModelArguments, DataArguments, PaddingFreeConfig) from a command line; raises TrainCLIError."""
    argv = normalize_argv(argv)
    if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in argv):
        argv = [*argv, "--output_dir", DEFAULT_OUTPUT_DIR]
    parser = _parser()
    try:
        model_args, data_args, config, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except argparse.ArgumentError as exc:
        raise TrainCLIError(f"{exc} (see `pf-trl train --help`)") from exc
    except ValueError as exc:  # PaddingFreeConfig / TrainingArguments validation
        raise TrainCLIError(str(exc)) from exc
    if rest:
        raise _unknown(rest, [s for a in parser_actions(parser) for s in a.option_strings])
    one_sequence_limit(argv, data_args, config)
    from pf_trl.cli.trl_config import split_report_to

    split_report_to(config)
    return model_args, data_args, config


def one_sequence_limit(argv: list[str], data_args, config) -> None:
    """``--max_seq_len`` (pf-trl's, fms-hf-tuning's name) and ``--max_length`` (TRL's) are one limit: the one given
    becomes both (``config.max_length`` is what tokenizing and the trainer read); two different values are refused."""
    given = {flag for flag in ("--max_seq_len", "--max_length") for a in argv if a == flag or a.startswith(flag + "=")}
    if given == {"--max_seq_len", "--max_length"} and data_args.max_seq_len != config.max_length:
        raise TrainCLIError(f"--max_seq_len {data_args.max_seq_len} and --max_length {config.max_length} are the same "
                            "limit with two values; pass one of them")
    if "--max_seq_len" in given:
        config.max_length = data_args.max_seq_len
    elif "--max_length" in given:
        data_args.max_seq_len = config.max_length


def fast_parse(argv: list[str]) -> argparse.Namespace | None:
    """Every flag and value checked against the flag table (:mod:`pf_trl.cli.flag_table`) without importing
    transformers: the flags given (defaults are not filled in), or None when no table fits the installed versions
    (the full parser then decides). Raises TrainCLIError for an unknown flag or a bad value."""
    rows = flag_table.load()
    if rows is None:
        return None

    def error(message: str):
        raise TrainCLIError(f"{message} (see `pf-trl train --help`)")

    parser = flag_table.light_parser(rows, error=error)
    try:
        given, rest = parser.parse_known_args(normalize_argv(argv))
    except argparse.ArgumentError as exc:
        raise TrainCLIError(f"{exc} (see `pf-trl train --help`)") from exc
    if rest:
        raise _unknown(rest, [flag for row in rows for flag in row["flags"]])
    return given


# ------------------------------------------------------------------------------------------ cheap checks


def _light_args(argv: list[str]) -> argparse.Namespace:
    """The model and data flags alone, parsed without transformers (for the checks that run first)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)

    def error(message: str):
        raise TrainCLIError(f"{message} (see `pf-trl train --help`)")

    parser.error = error
    for f in (*dataclasses.fields(ModelArguments), *dataclasses.fields(DataArguments)):
        if f.type in (bool, "bool"):  # `--merge_adapter` alone means True, as HfArgumentParser reads it
            parser.add_argument(f"--{f.name}", default=f.default, nargs="?", const="true")
        elif f.name == "target_modules":
            parser.add_argument(f"--{f.name}", default=f.default, nargs="+")
        else:
            parser.add_argument(f"--{f.name}", default=f.default)
    for name in ("dataset_text_field", "max_tokens_per_batch", "max_eval_tokens_per_batch", "max_length", "truncation",
                 "truncation_mode", "eval_strategy", "chat_template_path", "max_steps", "model_init_kwargs"):
        parser.add_argument(f"--{name}", default=None)
    parser.add_argument("--trust_remote_code", default=None, nargs="?", const="true")  # SFTConfig's switch
    from pf_trl.cli.trl_fields import BOOL_FLAGS, FLAG_NAMES, LIST_FLAGS

    for name in FLAG_NAMES:  # trl sft's ModelConfig / ScriptArguments flags (their TRL defaults do not matter here)
        default = {"dataset_train_split": "train", "dataset_test_split": "test"}.get(name)
        if name in BOOL_FLAGS:
            parser.add_argument(f"--{name}", default=default, nargs="?", const="true")
        else:
            parser.add_argument(f"--{name}", default=default, nargs="+" if name in LIST_FLAGS else None)
    try:
        args, _ = parser.parse_known_args(normalize_argv(argv))
    except argparse.ArgumentError as exc:
        raise TrainCLIError(f"{exc} (see `pf-trl train --help`)") from exc
    return args


def check_model_name(name: str, revision: str | None = None, *, trust_remote_code: bool = False) -> str:
    """``--model_name_or_path`` as pf-trl loads it: an embedded model name, a local folder (``~`` expanded), or the
    snapshot folder of a Hub id at ``--model_revision`` (downloaded by huggingface_hub, or from its cache); raises
    TrainCLIError in one line for anything else, and for a model that needs its repository's own code without
    ``--trust_remote_code True`` (a Hub id's config is checked before its weights are downloaded)."""
    from pf_trl.hub import HubError
    from pf_trl.models import pinned_revision, resolve_model_path
    from pf_trl.remote_code import RemoteCodeError
    from pf_trl.storage import StorageError

    try:
        return resolve_model_path(name, revision=pinned_revision(name, revision), trust_remote_code=trust_remote_code)
    except (HubError, RemoteCodeError, StorageError) as exc:
        raise TrainCLIError(str(exc)) from None


def _positive_int(value: Any, flag: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise TrainCLIError(f"{flag} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise TrainCLIError(f"{flag} must be a positive integer, got {value!r}")
    return number


def check_combinations(get) -> None:
    """Flags that only make sense together, checked from ``get(flag, default)`` (the flag table's values before the
    import, the parsed dataclasses after it)."""
    from pf_trl.models import is_embedded_model
    from pf_trl.trainer.modes import resolve_padding_free

    try:  # --padding_free false with --padding_free_mode internal, ... (aliases are mapped by now: no warning)
        resolve_padding_free(get("padding_free"), get("padding_free_mode"))
    except ValueError as exc:
        raise TrainCLIError(f"--{exc}") from exc
    strategy = get("eval_strategy", "no")
    strategy = str(getattr(strategy, "value", strategy))
    if strategy != "no" and not get("validation_data_path") and not get("dataset_name"):
        raise TrainCLIError(f"--eval_strategy {strategy} needs --validation_data_path (or --dataset_name with a test "
                            "split)")
    if get("merge_adapter", False) and get("peft_method", "none") == "none" and not get("use_peft", False):
        raise TrainCLIError("--merge_adapter needs --peft_method lora (or --use_peft)")
    if get("model_overrides") and not is_embedded_model(get("model_name_or_path", "pf-trl/tiny-llama")):
        raise TrainCLIError("--model_overrides only applies to embedded models")
    from pf_trl.cli.upstream import check_upstream

    check_upstream(get)  # reporters, liger, the Hub for push_to_hub: what upstream would fail on after the build


def _check_data_options(args: argparse.Namespace) -> int:
    """The data options given on the command line, checked as :class:`~pf_trl.data.options.PretokenizeConfig` checks
    them (one declaration), with the flag named (the sequence limit and its policy: :func:`_check_sequence_limit`)."""
    from pf_trl.data.options import OptionError, check_option, option_specs, option_type, parse_bool, read_template_file

    for name, (f, spec) in option_specs().items():
        value = getattr(args, name, None)
        if spec.trl_field or name == "max_seq_len" or value is None or not isinstance(value, str):
            continue  # TRL's own flags, and defaults, need no check here
        try:
            if spec.file:
                read_template_file(value, flag=f"--{name}")
                continue
            kind = option_type(f)
            if kind is int:
                try:
                    value = int(value)
                except ValueError:
                    raise OptionError(f"{name} must be a positive integer, got {value!r}", name) from None
            elif kind is bool:
                value = parse_bool(value)
            check_option(name, value)
        except (OptionError, argparse.ArgumentTypeError) as exc:
            text = str(exc)
            raise TrainCLIError(text if text.startswith("--") else f"--{text}") from exc


def _check_sequence_limit(args: argparse.Namespace) -> tuple[int | None, str, bool]:
    """``--truncation`` / ``--truncation_mode`` and the one limit of ``--max_seq_len`` / ``--max_length``: returns
    (the limit or None for no limit, the flag that set it, whether it was given)."""
    from pf_trl.data.truncation import TRUNCATION_MODES, TRUNCATION_POLICIES, normalize_policy

    if args.truncation is not None:
        try:
            normalize_policy(args.truncation)
        except ValueError:
            raise TrainCLIError(f"--truncation {args.truncation!r} is unknown; use {', '.join(TRUNCATION_POLICIES)}") from None
    if args.truncation_mode is not None and args.truncation_mode not in TRUNCATION_MODES:
        raise TrainCLIError(f"--truncation_mode {args.truncation_mode!r} is unknown; use {' or '.join(TRUNCATION_MODES)}")
    limit_flag = "--max_seq_len" if args.max_seq_len is not None else "--max_length"
    limit = args.max_seq_len if args.max_seq_len is not None else args.max_length
    given = limit is not None
    limit = 1024 if limit is None else limit  # TRL's default max_length
    if limit in ("None", "none"):
        return None, limit_flag, given
    return _positive_int(limit, limit_flag), limit_flag, given


def precheck(argv: list[str], *, say=print) -> None:
    """Checks that need no model and no transformers import: every flag and value (the flag table), data paths and
    their lines, data options, lengths, model and tokenizer folders, the output directory's checkpoints, the service.
    Raises TrainCLIError with a one-line reason and fix."""
    from pf_trl.cli.upstream import check_hub_ids
    from pf_trl.data.data_config import DataConfigError, check_data_config_paths, is_data_config_path, read_data_config
    from pf_trl.data.scan import JsonLinesError, check_json_lines
    from pf_trl.data.shards import is_shards_dir, read_manifest
    from pf_trl.data.sources import DataSourceError, check_source_path
    from pf_trl.data.tokenizer import TokenizerLoadError, default_tokenizer_for, resolve_tokenizer_path
    from pf_trl.trainer.output_dir import OutputDirError
    from pf_trl.trainer.remote_checkpoints import check_any_output_dir

    args = _light_args(argv)
    _check_data_choice(args)
    _precheck_trl_data(args)
    check_hub_ids({f"--{name}": getattr(args, name) for name in ("training_data_path", "validation_data_path")
                   if name not in args.pf_data_flags})
    if args.data_config:
        try:
            check_data_config_paths(read_data_config(args.data_config))
        except DataConfigError as exc:
            raise TrainCLIError(f"--data_config: {exc}") from exc
    local: dict[str, str] = {}  # a bucket URI -> its node-cache copy (fetched once per node, verified)
    for flag, path in (("--training_data_path", args.training_data_path),
                       ("--validation_data_path", args.validation_data_path)):
        flag = args.pf_data_flags.get(flag[2:], flag)  # the flag the user gave (--dataset_name)
        if path:
            try:
                if flag == "--validation_data_path" and is_data_config_path(path):
                    check_data_config_paths(read_data_config(path))  # eval on several datasets: all their rows
                else:  # the training set of a bucket: only its manifest and lengths now (read-ahead)
                    local[path] = str(check_source_path(path, flag=flag, read_ahead=path == args.training_data_path))
            except (DataSourceError, DataConfigError) as exc:
                raise TrainCLIError(f"{flag}: {exc}" if isinstance(exc, DataConfigError) else str(exc)) from exc
    _check_data_options(args)
    max_seq_len, limit_flag, given = _check_sequence_limit(args)
    for flag, path in (("max_tokens_per_batch", args.training_data_path),
                       ("max_eval_tokens_per_batch", args.validation_data_path)):
        if getattr(args, flag) is not None:
            budget = _positive_int(getattr(args, flag), f"--{flag}")
            path = local.get(path, path)
            if path and is_shards_dir(path):  # shards know their longest example: no need to wait for the data
                check_budget(types.SimpleNamespace(pf_manifest=read_manifest(path)), budget, f"--{flag}")
    given = fast_parse(argv)  # every other flag and value (None: no flag table for these versions)
    if given is not None:
        check_combinations(lambda flag, default=None: getattr(given, flag, default))
    trust = _precheck_model(argv, args, given)
    name = check_model_name(args.model_name_or_path, getattr(args, "model_revision", None), trust_remote_code=trust)
    positions = _max_positions(name)
    if positions is not None and max_seq_len is not None and max_seq_len > positions:
        raise TrainCLIError(
            f"{limit_flag} {max_seq_len}{'' if given else ' (the default)'} exceeds the model's max_position_embeddings "
            f"({positions}); {'lower' if given else 'pass'} {limit_flag}"
        )
    try:
        if args.tokenizer_name_or_path:
            resolve_tokenizer_path(args.tokenizer_name_or_path, code=trust)
        else:
            default_tokenizer_for(name, trust_remote_code=trust)
    except TokenizerLoadError as exc:
        flag = "--tokenizer_name_or_path" if args.tokenizer_name_or_path else "--model_name_or_path"
        raise TrainCLIError(f"{flag}: {exc}") from exc
    if given is not None:
        try:
            check_any_output_dir(getattr(given, "output_dir", DEFAULT_OUTPUT_DIR),
                             resume_from_checkpoint=getattr(given, "resume_from_checkpoint", None),
                             overwrite_output_dir=getattr(given, "overwrite_output_dir", False), cli=True)
        except OutputDirError as exc:
            raise TrainCLIError(str(exc)) from exc
    for flag, path in (("--training_data_path", args.training_data_path),
                       ("--validation_data_path", args.validation_data_path)):
        flag = args.pf_data_flags.get(flag[2:], flag)
        if path and not is_data_config_path(path):
            try:  # a streaming scan (once per file version): the first bad line, numbered, before any import
                check_json_lines(local.get(path, path), flag=flag)
            except JsonLinesError as exc:
                raise TrainCLIError(str(exc)) from exc
    if args.dataset_service_url:
        _probe_service(args, say)


def _precheck_trl_data(args: argparse.Namespace) -> None:
    """trl sft's data flags (:mod:`pf_trl.cli.trl_data`), checked before any import of transformers or tokenizing:
    the local dataset and its splits, a DatasetDict's evaluation split, ``--chat_template_path``."""
    from pf_trl.cli import trl_data

    trl_data.check_streaming(args, args.max_steps)  # a stream without --max_steps: refused before any data is read
    train, evalset, _ = trl_data.resolve(args, args.eval_strategy)
    args.pf_data_flags = {}  # checked under the flag the user gave
    if train is not None:  # a single path is checked below like --training_data_path (its lines scanned too)
        args.training_data_path = train if isinstance(train, str) else None
        args.pf_data_flags["training_data_path"] = "--dataset_name" if args.dataset_name else "--datasets"
        if isinstance(evalset, str):
            args.validation_data_path = evalset
            args.pf_data_flags["validation_data_path"] = "--dataset_name"
    trl_data.validation_split(args.validation_data_path)
    if args.chat_template_path:  # TRL's name for the same setting: checked as --chat_template below
        args.chat_template = trl_data.chat_template_path(args.chat_template_path, args.chat_template)


def _precheck_model(argv: list[str], args: argparse.Namespace, given: argparse.Namespace | None) -> bool:
    """The model and LoRA flags of both spellings (:mod:`pf_trl.cli.model_args`), before any import of
    transformers; returns ``trust_remote_code`` as TRL resolves it."""
    from pf_trl.cli.model_args import check_model_flags, given_flags, requested_trust

    values = vars(args) | (vars(given) if given is not None else {})
    flags = given_flags(normalize_argv(argv))

    def get(name: str, default: Any = None) -> Any:
        return values.get(name, default)

    check_model_flags(get, flags, model_name=args.model_name_or_path)
    return requested_trust(get, flags)


def _check_data_choice(args) -> None:
    from pf_trl.cli.trl_data import trl_data_flags

    given = [flag for flag, value in (("--training_data_path", args.training_data_path),
                                      ("--data_config", args.data_config),
                                      ("--dataset_service_url", args.dataset_service_url)) if value]
    given += trl_data_flags(args)
    if not given:
        raise TrainCLIError("no training data: pass --training_data_path PATH, --dataset_name PATH (TRL's flag, a local "
                            "dataset), --data_config FILE (several datasets) or --dataset_service_url URL --dataset_id ID")
    if len(given) > 1:
        raise TrainCLIError(f"pass one of {' / '.join(given)}, not several (a data config lists several datasets)")


def _max_positions(name: str) -> int | None:
    from pf_trl.models import EMBEDDED_MODELS

    if name in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name].get("max_position_embeddings")
    try:
        config = json.loads((Path(name).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) else None


def _service_message(exc: Exception) -> str:
    # the client speaks to Python callers (token=); here the flag is what the user can change
    return str(exc).replace("pass token= or set PF_SERVICE_TOKEN", "pass --dataset_service_token or set PF_SERVICE_TOKEN")


def _probe_service(args: argparse.Namespace, say) -> None:
    """One request before anything heavy: a wrong id or token fails now; an unreachable service is waited on."""
    from pf_trl.data.service_client import DatasetServiceError, get_dataset

    if not args.dataset_id:
        raise TrainCLIError("--dataset_service_url needs --dataset_id")
    if not str(args.dataset_service_url).startswith(("http://", "https://")):
        raise TrainCLIError(f"--dataset_service_url {args.dataset_service_url!r} must start with http:// or https://")
    try:
        timeout = float(args.dataset_service_timeout_s)
    except (TypeError, ValueError):
        raise TrainCLIError(f"--dataset_service_timeout_s must be a number, got {args.dataset_service_timeout_s!r}") from None
    try:
        status = get_dataset(args.dataset_service_url, args.dataset_id, args.dataset_service_token)
    except DatasetServiceError as exc:
        if exc.status is None or exc.status in (502, 503, 504):
            say(f"pf-trl: the dataset service is not answering yet ({one_line(exc)}); waiting up to {timeout:.0f}s "
                "(--dataset_service_timeout_s)")
            return
        raise TrainCLIError(_service_message(exc)) from exc
    if status.get("state") in ("queued", "running"):
        say(f"pf-trl: dataset {args.dataset_id} is {status['state']} at the service; waiting up to {timeout:.0f}s "
            "(--dataset_service_timeout_s)")


# ----------------------------------------------------------------------------------------------- data


def pretokenize_config(data_args, config):
    """The data options of a run (:func:`pf_trl.data.prepare.data_options`, the trainer's too): the data flags, and
    those TRL's config carries (``--dataset_text_field``, ``--completion_only_loss``, ``--assistant_only_loss``,
    ``--truncation_mode``; ``--truncation`` and the sequence limit from :class:`~pf_trl.trainer.PaddingFreeConfig`);
    ``--chat_template FILE`` is read into the template text."""
    from pf_trl.data.options import PretokenizeError, option_specs
    from pf_trl.data.prepare import data_options

    flags = {name: getattr(data_args, name) for name, (_, spec) in option_specs().items() if not spec.trl_field}
    try:
        return data_options(config, flags)
    except PretokenizeError as exc:
        raise TrainCLIError(str(exc)) from exc


def given_options(argv: list[str]) -> frozenset[str]:
    """The data options set on the command line (their flags, or TRL's ``--dataset_text_field`` /
    ``--completion_only_loss``)."""
    from pf_trl.data.options import option_specs

    flags = {a.split("=", 1)[0] for a in normalize_argv(argv) if a.startswith("--")}
    return frozenset(name for name, (_, spec) in option_specs().items()
                     if f"--{name}" in flags or (spec.trl_field and f"--{spec.trl_field}" in flags))


def _note_made_with_other_options(dataset, options, given: frozenset[str], say) -> None:
    """Shards used as they are (a shards directory, a service dataset) ignore the data flags: say so when a flag
    given differs from what the shards were made with."""
    from pf_trl.data.options import option_differences

    manifest = getattr(dataset, "pf_manifest", None) or {}
    made_with = manifest.get("options") or {}
    differences = option_differences(made_with, {k: v for k, v in options.to_dict().items() if k in given})
    if differences:
        where = manifest.get("source", {}).get("path", "the data")
        say(f"note: the shards of {where} were made with {', '.join(differences)}; data options apply only when "
            "tokenizing, so these shards are used as they are (pretokenize again to change them)")


def load_data(data_args: DataArguments, config, tokenizer, *, quiet: bool = False, given: frozenset[str] = frozenset()):
    """(train, eval) shards through :mod:`pf_trl.data.sources`; ``given``: the data options set on the command line
    (a note names those the shards were not made with)."""
    from pf_trl.data import sources
    from pf_trl.data.data_config import DataConfig, is_data_config_path

    say = (lambda *_: None) if quiet else (lambda msg: print(f"pf-trl: {msg}", flush=True))
    options = pretokenize_config(data_args, config)
    try:
        if data_args.data_config:
            train = _load_data_config(data_args, options, tokenizer, quiet=quiet, say=say)
        elif data_args.dataset_service_url:
            train = sources.load_service_dataset(
                data_args.dataset_service_url, data_args.dataset_id, tokenizer, token=data_args.dataset_service_token,
                timeout_s=data_args.dataset_service_timeout_s, progress=not quiet, say=say)
        else:
            train = sources.load_training_data(data_args.training_data_path, tokenizer, options,
                                               num_proc=data_args.pretokenize_num_proc, progress=not quiet, say=say,
                                               read_ahead=True)  # a bucket dataset: trained on while it downloads
        evalset = None
        if data_args.validation_data_path and (is_data_config_path(data_args.validation_data_path)
                                               or isinstance(data_args.validation_data_path, DataConfig)):
            evalset = _load_data_config(data_args, options, tokenizer, quiet=quiet, say=say,
                                        path=data_args.validation_data_path, streaming=False)
        elif data_args.validation_data_path:
            evalset = sources.load_training_data(data_args.validation_data_path, tokenizer, options,
                                                 num_proc=data_args.pretokenize_num_proc, progress=not quiet, say=say,
                                                 what="validation")
    except sources.DataSourceError as exc:
        raise TrainCLIError(_service_message(exc)) from exc
    for dataset in (train, evalset):
        _note_made_with_other_options(dataset, options, given, say)
    say_truncation(train, "training data", say)
    say_truncation(evalset, "validation data", say)
    return train, evalset


def say_truncation(dataset, what: str, say) -> None:
    """One line: how many examples the sequence limit cut or dropped, and the supervised tokens lost."""
    from pf_trl.data.truncation import report_from_manifest

    manifest = getattr(dataset, "pf_manifest", None)
    line = report_from_manifest(manifest).summary(what, limit_name="--max_seq_len") if manifest else None
    if line:
        say(line)


def _load_data_config(data_args: DataArguments, options, tokenizer, *, quiet: bool, say, path: str | None = None,
                      streaming: bool = True):
    """A data config: its sources loaded here (the trainer's own loader), or, when it streams, the config itself
    (the trainer opens the streams per rank)."""
    from pf_trl.data.data_config import DataConfigError, coerce_data_config
    from pf_trl.data.mixture import load_mixture

    try:
        config = coerce_data_config(path or data_args.data_config)  # a file, or one made from TRL's data flags
        if config.streaming and streaming:
            return config
        config.streaming = False
        return load_mixture(config, tokenizer, options, num_proc=data_args.pretokenize_num_proc, progress=not quiet,
                            say=say)
    except DataConfigError as exc:
        raise TrainCLIError(f"--data_config: {exc}") from exc


def check_budget(dataset, budget: int | None, flag: str) -> None:
    """A token budget must hold the longest example (the sampler never splits one)."""
    if budget is None or dataset is None:
        return
    manifest = getattr(dataset, "pf_manifest", None) or {}
    longest = (manifest.get("lengths") or {}).get("max")
    if longest is not None and budget < longest:
        raise TrainCLIError(
            f"{flag} {budget} is smaller than the longest example ({longest} tokens); raise {flag} to at least "
            f"{longest} or lower --max_seq_len"
        )


# ----------------------------------------------------------------------------------------------- model


def _parse_overrides(text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (text or "").split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise TrainCLIError(f"--model_overrides item {item!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def flash_attn_implementation() -> tuple[str | None, str]:
    """(transformers ``attn_implementation`` for the flash package really installed, or None; why), for
    ``--use_flash_attn`` (:mod:`pf_trl.attention.flash_packages`)."""
    import torch

    from pf_trl.attention.flash_packages import transformers_flash_implementation

    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None
    return transformers_flash_implementation(major)


def build(model_args: ModelArguments, data_args: DataArguments, config, *, quiet: bool = False,
          given: frozenset[str] = frozenset(), flags: frozenset[str] = frozenset()):
    """Model, tokenizer, datasets and trainer for the parsed arguments (the data before the model loads)."""
    import torch

    from pf_trl.data.tokenizer import TokenizerLoadError, resolve_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeSFTTrainer

    _check_data_choice(data_args)
    if data_args.dataset_service_url and not data_args.dataset_id:
        raise TrainCLIError("--dataset_service_url needs --dataset_id")
    from pf_trl.cli import model_args as model_flags

    def get(flag: str, default: Any = None) -> Any:
        return next((getattr(group, flag) for group in (model_args, data_args, config) if hasattr(group, flag)),
                    default)

    trust = model_flags.requested_trust(get, flags)
    name = check_model_name(model_args.model_name_or_path, getattr(model_args, "model_revision", None),
                            trust_remote_code=trust)
    check_combinations(get)
    overrides = _parse_overrides(model_args.model_overrides)
    cuda = torch.cuda.is_available() and not config.use_cpu
    if config.fp16 and not cuda:
        raise TrainCLIError("--fp16 needs a CUDA device; drop it on CPU")
    from pf_trl.cli import trl_data

    # dtype and attention from every flag that sets them (--torch_dtype / --dtype / --model_init_kwargs,
    # --attn_implementation / --use_flash_attn); unset, transformers picks (sdpa where supported, else eager)
    settings = model_flags.model_settings(model_args, config, flags, cuda=cuda, flash_choice=flash_attn_implementation if cuda else (
        lambda: (None, "training on CPU; flash-attention runs on CUDA only")), quiet=quiet)
    peft_config = model_flags.peft_config(model_args, flags)
    if config.model_init_kwargs:  # applied here: the trainer gets a built model (TRL would only warn)
        config.model_init_kwargs = None
    trl_data.apply(data_args, config, (lambda *_: None) if quiet else (lambda m: print(f"pf-trl: {m}", flush=True)))
    model_ref = name
    if overrides.get("vocab_size") is not None:
        model_ref = None  # an embedded model resized by --model_overrides: its vocabulary is checked below
    try:
        tokenizer = resolve_tokenizer(model_ref, model_args.tokenizer_name_or_path,
                                      chat_template_file=data_args.chat_template, trust_remote_code=trust)
    except TokenizerLoadError as exc:
        raise TrainCLIError(str(exc)) from exc
    if not quiet:
        from pf_trl.data.processor import text_tokenizer

        text = text_tokenizer(tokenizer)  # a vision-language model folder gives its processor
        print(f"pf-trl: tokenizer {getattr(tokenizer, 'pf_trl_name', None) or text.name_or_path} "
              f"(vocab {len(text)})", flush=True)
    train, evalset = load_data(data_args, config, tokenizer, quiet=quiet, given=given)
    check_budget(train, config.max_tokens_per_batch, "--max_tokens_per_batch")
    check_budget(evalset, config.max_eval_tokens_per_batch, "--max_eval_tokens_per_batch")

    model = build_model(name, torch_dtype=settings.dtype, attn_implementation=settings.attn_implementation,
                        seed=config.seed, quantization_config=settings.quantization_config,
                        trust_remote_code=trust, **overrides)
    made_with = (getattr(train, "pf_manifest", None) or {}).get("max_seq_len")
    if data_args.max_seq_len is None and config.max_length is not None and made_with and made_with > config.max_length:
        config.max_length = made_with  # no limit given: shards made with a longer one are trained as they are
    trainer = PaddingFreeSFTTrainer(model, args=config, train_dataset=train, eval_dataset=evalset,
                                    processing_class=tokenizer, peft_config=peft_config)
    return trainer


def final_step_eval(trainer) -> dict[str, Any] | None:
    """The metrics of the evaluation the trainer ran at its last step, if it ran one (evaluating again would cost the
    same time for the same numbers)."""
    state = trainer.state
    for entry in reversed(state.log_history):
        if "eval_loss" in entry:
            if entry.get("step") == state.global_step:
                return {k: v for k, v in entry.items() if k != "step"}
            return None
    return None


def format_metrics(metrics: dict[str, Any]) -> str:
    width = max(len(k) for k in metrics) if metrics else 0
    lines = []
    for key in sorted(metrics):
        value = metrics[key]
        if isinstance(value, float):
            value = f"{value:.6g}"
        lines.append(f"  {key:<{width}} = {value}")
    return "\n".join(lines)


def _fail(exc: BaseException) -> int:
    if os.environ.get("PF_TRL_DEBUG"):
        raise exc
    print(f"pf-trl train: error: {one_line(_service_message(exc))}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        from pf_trl.cli.flag_table import print_help

        print_help(full_parser)  # from the help table: no transformers import
        return 0
    from pf_trl._quiet import end_command, start_run

    start_run(command=True)  # one run: each warning once, on rank 0
    try:
        return _run(argv)
    finally:
        end_command()


def _run(argv: list[str]) -> int:
    from pf_trl.trainer.remote_checkpoints import check_any_output_dir

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        argv = normalize_argv(argv)  # once: what follows reads the normalized command line (no second warning)
        precheck(argv)  # before transformers / TRL are imported (seconds) and before the model loads
        model_args, data_args, config = parse_args(argv)
        check_any_output_dir(config.output_dir, resume_from_checkpoint=config.resume_from_checkpoint,
                         overwrite_output_dir=config.overwrite_output_dir, cli=True)
        from pf_trl.cli.model_args import given_flags

        trainer = build(model_args, data_args, config, given=given_options(argv), flags=given_flags(argv))
    except PfTrlError as exc:  # pf-trl's own refusals, PaddingFreeError (a model pf-trl refuses) included
        return _fail(exc)
    except ValueError as exc:  # upstream's checks (TrainingArguments / SFTConfig, from_pretrained, SFTTrainer) and the
        return _fail(exc)  # trainer's own checks that still raise a bare ValueError (pf_trl/trainer/)
    try:
        result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    except PfTrlError as exc:  # sampler budget or state (SamplerError): the message says what to change
        return _fail(exc)
    except ValueError as exc:  # a resume mismatch found by pf_trl/trainer/ (a bare ValueError there), or upstream's
        return _fail(exc)
    metrics = dict(result.metrics)
    if trainer.is_world_process_zero():
        print("***** train metrics *****")
        print(format_metrics(metrics))
        os.makedirs(trainer.args.output_dir, exist_ok=True)  # a bucket output_dir: its staging, uploaded below
        with open(os.path.join(trainer.args.output_dir, "train_results.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    if trainer.eval_dataset is not None and config.eval_strategy != "no":
        ev = final_step_eval(trainer) or trainer.evaluate()  # the last step's evaluation, when it ran one
        if trainer.is_world_process_zero():
            print("***** eval metrics *****")
            print(format_metrics(ev))
    if config.save_strategy != "no":
        # every rank: under FSDP / DeepSpeed ZeRO-3 gathering the weights is a collective (a rank-0-only call hangs);
        # Trainer.save_model writes on the main process only (args.should_save) and lets the others join the gather
        trainer.save_model()
        if trainer.is_world_process_zero():
            where = trainer.pf_remote_output.uri if trainer.pf_remote_output is not None else config.output_dir
            print(f"pf-trl: model saved to {where}", flush=True)
    elif trainer.is_world_process_zero():
        print("pf-trl: --save_strategy no: no model saved (pass --save_strategy steps|epoch to keep one)", flush=True)
    if model_args.merge_adapter and config.save_strategy != "no" and trainer.is_world_process_zero():
        from pf_trl.trainer.adapters import save_merged

        merged = save_merged(trainer, os.path.join(trainer.args.output_dir, "merged"))
        if trainer.pf_remote_output is not None:
            from pf_trl.trainer.remote_output import upload_final

            upload_final(trainer, trainer.pf_remote_output)
            merged = f"{config.output_dir}/merged"
        print(f"pf-trl: merged model saved to {merged}")
    # every rank returns when rank 0 has written the model; the `pf-trl` command then tears the process group down
    # on all ranks at once as the process ends (pf_trl.cli.main.run: a rank that exits while its peer still works can
    # abort in gloo's teardown, and its torchrun then holds the job 300 s)
    trainer.accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
