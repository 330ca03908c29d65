"""`pf-trl train`: fine-tune padding-free. Every TrainingArguments / SFTConfig / PaddingFreeConfig flag works
(HfArgumentParser), plus the flags of the fms-acceleration seed command line:

    pf-trl train --model_name_or_path pf-trl/tiny-llama --padding_free huggingface --packing False \
        --max_seq_len 4096 --use_flash_attn True --response_template '### Response:' --dataset_text_field output \
        --include_tokens_per_second True --training_data_path data.json --output_dir out ...

Data (``--training_data_path`` / ``--validation_data_path``): a shards directory (used as is), or a file
(pre-tokenized JSON/JSONL with ``input_ids`` [+ ``labels``], or raw text / prompt-completion / messages), which is
pretokenized once into a content-addressed cache ``cache_root()/datasets/<sha256(source bytes, tokenizer, options)>``;
later runs reuse it without tokenizing. ``--dataset_service_url/--dataset_id`` read a dataset built by the
preprocessing service instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("pf_trl.cli.train")

ALIASES = {"--evaluation_strategy": "--eval_strategy", "--max_seq_length": "--max_seq_len"}
DTYPES = ("auto", "float32", "float16", "bfloat16")


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
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Tokenizer (default: embedded Mistral)."})
    model_overrides: str | None = field(
        default=None,
        metadata={"help": "Config overrides for embedded models, e.g. 'num_hidden_layers=2,hidden_size=64'."},
    )


@dataclass
class DataArguments:
    training_data_path: str | None = field(default=None, metadata={"help": "Shards dir, pre-tokenized JSON/JSONL, or raw data."})
    validation_data_path: str | None = field(default=None, metadata={"help": "Same formats as --training_data_path."})
    max_seq_len: int = field(default=1024, metadata={"help": "Longest example (tokens) when pretokenizing."})
    response_template: str | None = field(default=None, metadata={"help": "Text format: loss starts after it."})
    input_format: str = field(default="auto", metadata={"help": "auto, pretokenized, text, prompt_completion, messages."})
    truncation: str = field(default="truncate", metadata={"help": "truncate, drop or error (longer than max_seq_len)."})
    pretokenize_num_proc: int = field(default=1, metadata={"help": "Tokenizer processes for the cache build."})
    dataset_service_url: str | None = field(default=None, metadata={"help": "Preprocessing service base URL."})
    dataset_id: str | None = field(default=None, metadata={"help": "Dataset id at the service."})
    dataset_service_token: str | None = field(default=None, metadata={"help": "Bearer token (or $PF_SERVICE_TOKEN)."})
    dataset_service_timeout_s: float = field(default=3600.0, metadata={"help": "Wait at most this long for the service."})


def _parser():
    from transformers import HfArgumentParser

    from pf_trl.trainer.config import PaddingFreeConfig

    return HfArgumentParser((ModelArguments, DataArguments, PaddingFreeConfig))


def normalize_argv(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        head, eq, tail = arg.partition("=")
        if head in ALIASES:
            arg = ALIASES[head] + (eq + tail if eq else "")
        out.append(arg)
    return out


def parse_args(argv: list[str]):
    """(ModelArguments, DataArguments, PaddingFreeConfig) from a command line; raises TrainCLIError."""
    argv = normalize_argv(argv)
    if "--output_dir" not in " ".join(argv):
        argv = [*argv, "--output_dir", "pf-trl-output"]
    parser = _parser()
    try:
        model_args, data_args, config, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except ValueError as exc:  # PaddingFreeConfig / TrainingArguments validation
        raise TrainCLIError(str(exc)) from exc
    if rest:
        raise TrainCLIError(f"unknown arguments: {' '.join(rest)} (see `pf-trl train --help`)")
    return model_args, data_args, config


# ----------------------------------------------------------------------------------------------- data


def dataset_cache_key(source: str | Path, tokenizer, options: dict[str, Any]) -> str:
    from pf_trl.data.pretokenize import source_fingerprint
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    digest = hashlib.sha256()
    digest.update(source_fingerprint(source).encode())
    digest.update(tokenizer_fingerprint(tokenizer)["sha256"].encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    return digest.hexdigest()


def resolve_dataset(path: str, data_args: DataArguments, config, tokenizer, *, what: str = "training", quiet: bool = False):
    """A shards directory for ``path`` (building the cache if needed) and the loaded dataset."""
    from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError, pretokenize
    from pf_trl.data.shards import ShardsError, is_shards_dir, load_shards
    from pf_trl.data.tokenizer import cache_root, tokenizer_fingerprint

    say = (lambda *_: None) if quiet else (lambda msg: print(f"pf-trl: {msg}", flush=True))
    source = Path(path)
    if not source.exists():
        raise TrainCLIError(f"--{what}_data_path {path}: no such file or directory")
    expected = tokenizer_fingerprint(tokenizer)
    if source.is_dir() and is_shards_dir(source):
        say(f"{what} data: shards directory {source} (no tokenization)")
        try:
            return source, load_shards(source, expected_tokenizer=expected)
        except ShardsError as exc:
            raise TrainCLIError(f"--{what}_data_path {path}: {exc}") from exc
    try:
        options = PretokenizeConfig(
            input_format=data_args.input_format,
            text_field=config.dataset_text_field or "text",
            response_template=data_args.response_template,
            max_seq_len=data_args.max_seq_len,
            truncation=data_args.truncation,
        )
    except PretokenizeError as exc:
        raise TrainCLIError(str(exc)) from exc
    key = dataset_cache_key(source, tokenizer, options.to_dict())
    target = cache_root() / "datasets" / key
    if is_shards_dir(target):
        say(f"{what} data: cache hit {target} (no tokenization)")
    else:
        say(f"{what} data: tokenizing {source} into the cache {target}")
        try:
            pretokenize(source, target, options, tokenizer=tokenizer, num_proc=data_args.pretokenize_num_proc,
                        progress=not quiet)
        except PretokenizeError as exc:
            raise TrainCLIError(f"--{what}_data_path {path}: {exc}") from exc
        except FileExistsError:
            pass  # another process built it first
    return target, load_shards(target, expected_tokenizer=expected)


def resolve_service_dataset(data_args: DataArguments, tokenizer):
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    if not data_args.dataset_id:
        raise TrainCLIError("--dataset_service_url needs --dataset_id")
    try:
        from pf_trl.data.service_client import wait_for_dataset
    except ImportError as exc:  # pragma: no cover - the client ships with pf-trl
        raise TrainCLIError(f"the dataset service client is not available ({exc})") from exc
    directory = wait_for_dataset(data_args.dataset_service_url, data_args.dataset_id, token=data_args.dataset_service_token,
                                 timeout_s=data_args.dataset_service_timeout_s, progress=True)
    print(f"pf-trl: training data: service dataset {data_args.dataset_id} at {directory} (no tokenization)", flush=True)
    return directory, load_shards(directory, expected_tokenizer=tokenizer_fingerprint(tokenizer))


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
    """Model, tokenizer, datasets and trainer for the parsed arguments."""
    import torch

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model, is_embedded_model
    from pf_trl.trainer import PaddingFreeSFTTrainer

    if not data_args.training_data_path and not data_args.dataset_service_url:
        raise TrainCLIError("no training data: pass --training_data_path PATH (or --dataset_service_url URL --dataset_id ID)")
    if data_args.training_data_path and data_args.dataset_service_url:
        raise TrainCLIError("pass either --training_data_path or --dataset_service_url, not both")
    name = model_args.model_name_or_path
    if not is_embedded_model(name) and not Path(name).is_dir():
        raise TrainCLIError(
            f"--model_name_or_path {name!r} is neither an embedded model (pf-trl/tiny-llama, pf-trl/tiny-mistral, ...) "
            "nor a local folder; pf-trl never downloads models"
        )
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

    attn = "sdpa"
    if config.use_flash_attn:
        if flash_attn_available():
            attn = "flash_attention_2"
        else:
            if config.padding_free == "huggingface":
                config.padding_free = "internal"
            print("pf-trl: --use_flash_attn True but flash-attn is not installed/usable here: using pf-trl's varlen "
                  f"attention (padding_free=internal, backend={config.attention_backend})", flush=True)
    tokenizer = load_tokenizer(model_args.tokenizer_name_or_path) if model_args.tokenizer_name_or_path else load_tokenizer()

    if data_args.dataset_service_url:
        _, train = resolve_service_dataset(data_args, tokenizer)
    else:
        _, train = resolve_dataset(data_args.training_data_path, data_args, config, tokenizer, quiet=quiet)
    evalset = None
    if data_args.validation_data_path:
        _, evalset = resolve_dataset(data_args.validation_data_path, data_args, config, tokenizer, what="validation", quiet=quiet)
    elif config.eval_strategy != "no":
        raise TrainCLIError(f"--eval_strategy {config.eval_strategy} needs --validation_data_path")

    overrides = _parse_overrides(model_args.model_overrides)
    if overrides and not is_embedded_model(name):
        raise TrainCLIError("--model_overrides only applies to embedded models")
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        _parser().print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        model_args, data_args, config = parse_args(argv)
        trainer = build(model_args, data_args, config)
    except TrainCLIError as exc:
        print(f"pf-trl train: error: {exc}", file=sys.stderr)
        return 2
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
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
    if config.save_strategy != "no" and trainer.is_world_process_zero():
        trainer.save_model()
    if model_args.merge_adapter and config.save_strategy != "no" and trainer.is_world_process_zero():
        from pf_trl.trainer.adapters import save_merged

        print(f"pf-trl: merged model saved to {save_merged(trainer, os.path.join(config.output_dir, 'merged'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
