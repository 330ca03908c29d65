"""`pf-trl train`: fine-tune padding-free. Every TrainingArguments / SFTConfig / PaddingFreeConfig flag works
(HfArgumentParser), plus the flags of the fms-acceleration seed command line:

    pf-trl train --model_name_or_path pf-trl/tiny-llama --padding_free huggingface --packing False \
        --max_seq_len 4096 --use_flash_attn True --response_template '### Response:' --dataset_text_field output \
        --include_tokens_per_second True --training_data_path data.json --output_dir out ...

Data (``--training_data_path`` / ``--validation_data_path``): a shards directory (used as is), a data file (JSON /
JSONL / Parquet / CSV) or a ``datasets.save_to_disk`` directory in any format of ``docs/data.md`` (auto-detected,
``--input_format`` to override), tokenized once into the content-addressed cache by :mod:`pf_trl.data.sources` (the
same data path as ``PaddingFreeSFTTrainer`` and the service). ``--dataset_service_url/--dataset_id`` read a dataset
built by the preprocessing service instead. The tokenizer defaults to the model folder's own.

This module only handles arguments: cheap checks first (paths, formats, lengths, the service), before transformers
and TRL are imported, then the data path and the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pf_trl.cli.flags import ALIASES, normalize_flags, one_line

logger = logging.getLogger("pf_trl.cli.train")

DTYPES = ("auto", "float32", "float16", "bfloat16")
SERVICE_WAIT_S = 600.0


class TrainCLIError(ValueError):
    """A bad flag or data path; the message says what to change."""


@dataclass
class PeftArguments:
    """fms-hf-tuning's adapter flags (part of ModelArguments)."""

    peft_method: str = field(default="none", metadata={"help": "none (full fine-tuning) or lora.",
                                                        "choices": ["none", "lora"]})
    r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Modules to adapt, e.g. q_proj v_proj (add lm_head to adapt the head), or all-linear. "
                  "Default: peft's choice for the architecture."},
    )
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "After training, also save the adapter merged into the base weights, in <output_dir>/merged."},
    )


@dataclass
class ModelArguments(PeftArguments):
    model_name_or_path: str = field(
        default="pf-trl/tiny-llama",
        metadata={"help": "Embedded model name (pf-trl/tiny-llama, ...: random init from a config) or a local folder. "
                  "Never downloaded."},
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "Model weights dtype: auto, float32, float16, bfloat16. On CPU float16 becomes float32 "
                  "(CPU fp16 training is slow and unstable; a notice is printed).", "choices": list(DTYPES)},
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder. Default: the model folder's own tokenizer (the embedded Mistral "
                  "tokenizer for embedded models)."},
    )
    model_overrides: str | None = field(
        default=None,
        metadata={"help": "Config overrides for embedded models, e.g. 'num_hidden_layers=2,hidden_size=64'."},
    )


@dataclass
class DataArguments:
    training_data_path: str | None = field(default=None, metadata={"help": "Shards dir, a data file or a save_to_disk dir."})
    validation_data_path: str | None = field(default=None, metadata={"help": "Same kinds as --training_data_path."})
    max_seq_len: int = field(default=1024, metadata={"help": "Longest example (tokens) when pretokenizing."})
    response_template: str | None = field(default=None, metadata={"help": "Text format: loss starts after it."})
    input_format: str = field(
        default="auto",
        metadata={"help": "auto, pretokenized, text, prompt_completion, messages, conversational_prompt_completion, "
                  "alpaca, sharegpt."},
    )
    chat_template: str | None = field(default=None, metadata={"help": "Jinja chat template FILE for chat formats."})
    truncation: str = field(default="truncate", metadata={"help": "truncate, drop or error (longer than max_seq_len)."})
    prompt_field: str = field(default="prompt", metadata={"help": "Column of the prompt (prompt-completion formats)."})
    completion_field: str = field(default="completion", metadata={"help": "Column of the completion."})
    messages_field: str = field(default="messages", metadata={"help": "Column of chat messages."})
    conversations_field: str = field(default="conversations", metadata={"help": "Column of ShareGPT conversations."})
    instruction_field: str = field(default="instruction", metadata={"help": "Alpaca instruction column."})
    input_field: str = field(default="input", metadata={"help": "Alpaca input column (optional per row)."})
    output_field: str = field(default="output", metadata={"help": "Alpaca output column (the supervised answer)."})
    pretokenize_num_proc: int = field(default=1, metadata={"help": "Tokenizer processes for the cache build."})
    dataset_service_url: str | None = field(default=None, metadata={"help": "Preprocessing service base URL."})
    dataset_id: str | None = field(default=None, metadata={"help": "Dataset id at the service."})
    dataset_service_token: str | None = field(default=None, metadata={"help": "Bearer token (or $PF_SERVICE_TOKEN)."})
    dataset_service_timeout_s: float = field(
        default=SERVICE_WAIT_S, metadata={"help": "Wait at most this long (seconds) for the service's dataset."}
    )


def _parser():
    from transformers import HfArgumentParser

    from pf_trl.trainer.config import PaddingFreeConfig

    parser = HfArgumentParser((ModelArguments, DataArguments, PaddingFreeConfig))
    parser.exit_on_error = False

    def error(message: str):  # argparse would print usage and exit; a user error is one line here
        raise TrainCLIError(f"{message} (see `pf-trl train --help`)")

    parser.error = error
    return parser


def normalize_argv(argv: list[str]) -> list[str]:
    return normalize_flags(argv, ALIASES)


def parse_args(argv: list[str]):
    """(ModelArguments, DataArguments, PaddingFreeConfig) from a command line; raises TrainCLIError."""
    argv = normalize_argv(argv)
    if not any(a == "--output_dir" or a.startswith("--output_dir=") for a in argv):
        argv = [*argv, "--output_dir", "pf-trl-output"]
    parser = _parser()
    try:
        model_args, data_args, config, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except argparse.ArgumentError as exc:
        raise TrainCLIError(f"{exc} (see `pf-trl train --help`)") from exc
    except ValueError as exc:  # PaddingFreeConfig / TrainingArguments validation
        raise TrainCLIError(str(exc)) from exc
    if rest:
        raise TrainCLIError(f"unknown arguments: {' '.join(rest)} (see `pf-trl train --help`)")
    return model_args, data_args, config


# ------------------------------------------------------------------------------------------ cheap checks


def _light_args(argv: list[str]) -> argparse.Namespace:
    """The model and data flags alone, parsed without transformers (for the checks that run first)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for f in (*dataclasses.fields(ModelArguments), *dataclasses.fields(DataArguments)):
        parser.add_argument(f"--{f.name}", default=f.default)
    for name in ("dataset_text_field", "max_tokens_per_batch", "max_eval_tokens_per_batch"):
        parser.add_argument(f"--{name}", default=None)
    args, _ = parser.parse_known_args(normalize_argv(argv))
    return args


def _positive_int(value: Any, flag: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise TrainCLIError(f"{flag} must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise TrainCLIError(f"{flag} must be a positive integer, got {value!r}")
    return number


def precheck(argv: list[str], *, say=print) -> None:
    """Checks that need no model and no transformers import: data paths, formats, lengths, model and tokenizer
    folders, the chat template file, the service. Raises TrainCLIError with a one-line reason and fix."""
    from pf_trl.data.formats import FORMATS
    from pf_trl.data.pretokenize import TRUNCATION_POLICIES
    from pf_trl.data.sources import DataSourceError, check_source_path
    from pf_trl.data.tokenizer import TokenizerLoadError, default_tokenizer_for, resolve_tokenizer_path
    from pf_trl.models import is_embedded_model

    args = _light_args(argv)
    if not args.training_data_path and not args.dataset_service_url:
        raise TrainCLIError("no training data: pass --training_data_path PATH (or --dataset_service_url URL --dataset_id ID)")
    if args.training_data_path and args.dataset_service_url:
        raise TrainCLIError("pass either --training_data_path or --dataset_service_url, not both")
    for flag, path in (("--training_data_path", args.training_data_path),
                       ("--validation_data_path", args.validation_data_path)):
        if path:
            try:
                check_source_path(path, flag=flag)
            except DataSourceError as exc:
                raise TrainCLIError(str(exc)) from exc
    if args.input_format not in ("auto", *FORMATS):
        raise TrainCLIError(f"--input_format {args.input_format!r} is unknown; use auto, {', '.join(FORMATS)}")
    if args.truncation not in TRUNCATION_POLICIES:
        raise TrainCLIError(f"--truncation {args.truncation!r} is unknown; use {', '.join(TRUNCATION_POLICIES)}")
    max_seq_len = _positive_int(args.max_seq_len, "--max_seq_len")
    for flag in ("max_tokens_per_batch", "max_eval_tokens_per_batch"):
        if getattr(args, flag) is not None:
            _positive_int(getattr(args, flag), f"--{flag}")
    name = args.model_name_or_path
    if not is_embedded_model(name) and not Path(name).expanduser().is_dir():
        raise TrainCLIError(
            f"--model_name_or_path {name!r} is neither an embedded model (pf-trl/tiny-llama, pf-trl/tiny-mistral, ...) "
            "nor a local folder; pf-trl never downloads models"
        )
    positions = _max_positions(name)
    if positions is not None and max_seq_len > positions:
        raise TrainCLIError(
            f"--max_seq_len {max_seq_len} exceeds the model's max_position_embeddings ({positions}); lower --max_seq_len"
        )
    try:
        if args.tokenizer_name_or_path:
            resolve_tokenizer_path(args.tokenizer_name_or_path)
        else:
            default_tokenizer_for(name)
    except TokenizerLoadError as exc:
        flag = "--tokenizer_name_or_path" if args.tokenizer_name_or_path else "--model_name_or_path"
        raise TrainCLIError(f"{flag}: {exc}") from exc
    if args.chat_template and not Path(args.chat_template).expanduser().is_file():
        raise TrainCLIError(f"--chat_template {args.chat_template}: no such file; pass a Jinja template file")
    if args.dataset_service_url:
        _probe_service(args, say)


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


def pretokenize_config(data_args: DataArguments, config):
    """The data options of a run (one place: the cache key and the trainer's defaults use the same fields)."""
    from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError

    try:
        return PretokenizeConfig(
            input_format=data_args.input_format,
            text_field=config.dataset_text_field or "text",
            prompt_field=data_args.prompt_field,
            completion_field=data_args.completion_field,
            messages_field=data_args.messages_field,
            conversations_field=data_args.conversations_field,
            instruction_field=data_args.instruction_field,
            input_field=data_args.input_field,
            output_field=data_args.output_field,
            response_template=data_args.response_template,
            max_seq_len=data_args.max_seq_len,
            truncation=data_args.truncation,
            completion_only_loss=config.completion_only_loss is not False,
        )
    except PretokenizeError as exc:
        raise TrainCLIError(str(exc)) from exc


def load_data(data_args: DataArguments, config, tokenizer, *, quiet: bool = False):
    """(train, eval) shards through :mod:`pf_trl.data.sources`."""
    from pf_trl.data import sources

    say = (lambda *_: None) if quiet else (lambda msg: print(f"pf-trl: {msg}", flush=True))
    options = pretokenize_config(data_args, config)
    try:
        if data_args.dataset_service_url:
            train = sources.load_service_dataset(
                data_args.dataset_service_url, data_args.dataset_id, tokenizer, token=data_args.dataset_service_token,
                timeout_s=data_args.dataset_service_timeout_s, progress=not quiet, say=say)
        else:
            train = sources.load_training_data(data_args.training_data_path, tokenizer, options,
                                               num_proc=data_args.pretokenize_num_proc, progress=not quiet, say=say)
        evalset = None
        if data_args.validation_data_path:
            evalset = sources.load_training_data(data_args.validation_data_path, tokenizer, options,
                                                 num_proc=data_args.pretokenize_num_proc, progress=not quiet, say=say,
                                                 what="validation")
    except sources.DataSourceError as exc:
        raise TrainCLIError(_service_message(exc)) from exc
    return train, evalset


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


def resolve_dtype(name: str, *, cuda: bool):
    import torch

    if name == "auto":
        return None
    dtype = getattr(torch, name)
    if dtype == torch.float16 and not cuda:
        print("pf-trl: --torch_dtype float16 on CPU: training in float32 instead (fp16 on CPU is slow and has no "
              "loss scaling)", flush=True)
        return torch.float32
    return dtype


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


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    import torch

    return torch.cuda.is_available()


def build(model_args: ModelArguments, data_args: DataArguments, config, *, quiet: bool = False):
    """Model, tokenizer, datasets and trainer for the parsed arguments (the data before the model loads)."""
    import torch

    from pf_trl.data.tokenizer import TokenizerLoadError, resolve_tokenizer
    from pf_trl.models import build_model, is_embedded_model
    from pf_trl.trainer import PaddingFreeSFTTrainer

    if not data_args.training_data_path and not data_args.dataset_service_url:
        raise TrainCLIError("no training data: pass --training_data_path PATH (or --dataset_service_url URL --dataset_id ID)")
    if data_args.training_data_path and data_args.dataset_service_url:
        raise TrainCLIError("pass either --training_data_path or --dataset_service_url, not both")
    if data_args.dataset_service_url and not data_args.dataset_id:
        raise TrainCLIError("--dataset_service_url needs --dataset_id")
    name = model_args.model_name_or_path
    if not is_embedded_model(name) and not Path(name).is_dir():
        raise TrainCLIError(
            f"--model_name_or_path {name!r} is neither an embedded model (pf-trl/tiny-llama, pf-trl/tiny-mistral, ...) "
            "nor a local folder; pf-trl never downloads models"
        )
    if config.eval_strategy != "no" and not data_args.validation_data_path:
        strategy = getattr(config.eval_strategy, "value", config.eval_strategy)
        raise TrainCLIError(f"--eval_strategy {strategy} needs --validation_data_path")
    overrides = _parse_overrides(model_args.model_overrides)
    if overrides and not is_embedded_model(name):
        raise TrainCLIError("--model_overrides only applies to embedded models")
    cuda = torch.cuda.is_available() and not config.use_cpu
    dtype = resolve_dtype(model_args.torch_dtype, cuda=cuda)
    if config.fp16 and not cuda:
        raise TrainCLIError("--fp16 needs a CUDA device; drop it on CPU")
    from pf_trl.trainer.adapters import lora_config

    if model_args.merge_adapter and model_args.peft_method == "none":
        raise TrainCLIError("--merge_adapter needs --peft_method lora")
    try:
        peft_config = lora_config(model_args.peft_method, r=model_args.r, lora_alpha=model_args.lora_alpha,
                                  lora_dropout=model_args.lora_dropout, target_modules=model_args.target_modules)
    except ValueError as exc:
        raise TrainCLIError(str(exc)) from exc

    attn = None  # transformers picks: sdpa where the architecture supports it, else eager
    if config.use_flash_attn:
        if flash_attn_available():
            attn = "flash_attention_2"
        else:
            if config.padding_free == "huggingface":
                config.padding_free = "internal"
            print("pf-trl: --use_flash_attn True but flash-attn is not installed/usable here: using pf-trl's varlen "
                  f"attention (padding_free=internal, backend={config.attention_backend})", flush=True)
    model_ref = name
    if overrides.get("vocab_size") is not None:
        model_ref = None  # an embedded model resized by --model_overrides: its vocabulary is checked below
    try:
        tokenizer = resolve_tokenizer(model_ref, model_args.tokenizer_name_or_path,
                                      chat_template_file=data_args.chat_template)
    except TokenizerLoadError as exc:
        raise TrainCLIError(str(exc)) from exc
    if not quiet:
        from pf_trl.data.vision import text_tokenizer

        text = text_tokenizer(tokenizer)  # a vision-language model folder gives its processor
        print(f"pf-trl: tokenizer {getattr(tokenizer, 'pf_trl_name', None) or text.name_or_path} "
              f"(vocab {len(text)})", flush=True)
    train, evalset = load_data(data_args, config, tokenizer, quiet=quiet)
    check_budget(train, config.max_tokens_per_batch, "--max_tokens_per_batch")
    check_budget(evalset, config.max_eval_tokens_per_batch, "--max_eval_tokens_per_batch")

    model = build_model(name, torch_dtype=dtype, attn_implementation=attn, seed=config.seed, **overrides)
    if config.max_length is None or config.max_length < data_args.max_seq_len:
        config.max_length = data_args.max_seq_len
    trainer = PaddingFreeSFTTrainer(model, args=config, train_dataset=train, eval_dataset=evalset,
                                    processing_class=tokenizer, peft_config=peft_config)
    return trainer


def format_metrics(metrics: dict[str, Any]) -> str:
    width = max(len(k) for k in metrics) if metrics else 0
    lines = []
    for key in sorted(metrics):
        value = metrics[key]
        if isinstance(value, float):
            value = f"{value:.6g}"
        lines.append(f"  {key:<{width}} = {value}")
    return "\n".join(lines)


def _user_errors() -> tuple[type[BaseException], ...]:
    from pf_trl.data.pretokenize import PretokenizeError
    from pf_trl.data.service_client import DatasetServiceError
    from pf_trl.data.shards import ShardsError
    from pf_trl.data.sources import DataSourceError
    from pf_trl.data.tokenizer import TokenizerLoadError

    errors = (TrainCLIError, DataSourceError, TokenizerLoadError, PretokenizeError, ShardsError, DatasetServiceError)
    # PaddingFreeError: pf-trl refuses the model (with its reason) before training. Importing it imports torch, and
    # it can only have been raised once pf_trl.attention was imported: a cheap error stays cheap.
    attention_errors = sys.modules.get("pf_trl.attention.errors")
    return errors + ((attention_errors.PaddingFreeError,) if attention_errors else ())


def _fail(exc: BaseException) -> int:
    if os.environ.get("PF_TRL_DEBUG"):
        raise exc
    print(f"pf-trl train: error: {one_line(_service_message(exc))}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = normalize_argv(list(sys.argv[1:] if argv is None else argv))
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        precheck(argv)  # before transformers / TRL are imported (seconds) and before the model loads
        model_args, data_args, config = parse_args(argv)
        trainer = build(model_args, data_args, config)
    except _user_errors() as exc:
        return _fail(exc)
    except ValueError as exc:  # the trainer's own checks of the configuration and data
        return _fail(exc)
    try:
        result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    except ValueError as exc:  # resume mismatch, sampler budget: the message says what to change
        return _fail(exc)
    metrics = dict(result.metrics)
    if trainer.is_world_process_zero():
        print("***** train metrics *****")
        print(format_metrics(metrics))
        os.makedirs(config.output_dir, exist_ok=True)
        with open(os.path.join(config.output_dir, "train_results.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    if trainer.eval_dataset is not None and config.eval_strategy != "no":
        ev = trainer.evaluate()
        if trainer.is_world_process_zero():
            print("***** eval metrics *****")
            print(format_metrics(ev))
    if config.save_strategy != "no":
        # every rank: under FSDP / DeepSpeed ZeRO-3 gathering the weights is a collective (a rank-0-only call hangs);
        # Trainer.save_model writes on the main process only (args.should_save) and lets the others join the gather
        trainer.save_model()
        if trainer.is_world_process_zero():
            print(f"pf-trl: model saved to {config.output_dir}", flush=True)
    elif trainer.is_world_process_zero():
        print("pf-trl: --save_strategy no: no model saved (pass --save_strategy steps|epoch to keep one)", flush=True)
    if model_args.merge_adapter and config.save_strategy != "no" and trainer.is_world_process_zero():
        from pf_trl.trainer.adapters import save_merged

        print(f"pf-trl: merged model saved to {save_merged(trainer, os.path.join(config.output_dir, 'merged'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
