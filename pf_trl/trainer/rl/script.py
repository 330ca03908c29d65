"""What ``pf-trl grpo`` and ``pf-trl rloo`` run: TRL's ``trl grpo`` / ``trl rloo`` scripts (``trl/scripts/grpo.py``,
``rloo.py``) with pf-trl's trainers, on data and models pf-trl opens locally.

- reward functions: ``--reward_funcs`` names TRL's built-in ones (``accuracy_reward``, ``reasoning_accuracy_reward``,
  ``think_format_reward``, ``get_soft_overlong_punishment``) or a dotted path ``module.func`` imported with the working
  directory on ``sys.path``, as TRL's scripts do; ``--reward_model_name_or_path`` as TRL passes it;
- data: ``--dataset_name`` a local dataset of prompt rows (``prompt``, plain or conversational) of any kind
  :func:`pf_trl.data.local_datasets.dataset_splits` reads (a JSONL / JSON / Parquet / CSV file, a folder of them, a
  ``save_to_disk`` folder) or a Hub dataset id; ``--datasets`` mixtures and streaming are refused;
- model: a local folder, a Hub id (its snapshot) or an embedded pf-trl name (built, saved under the output folder,
  since TRL builds the reference model from the policy's folder).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pf_trl.errors import ConfigError

__all__ = ["load_prompt_split", "reward_functions", "run_rl"]


def reward_functions(names: list[str] | None, reward_model: str | None) -> list[Any]:
    """TRL's scripts' reward functions for ``--reward_funcs`` / ``--reward_model_name_or_path``."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    registry: dict[str, Callable] = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }
    funcs: list[Any] = [reward_model] if reward_model else []
    for name in names or ():
        if name in registry:
            funcs.append(registry[name])
            continue
        if "." not in name:
            raise ConfigError(f"--reward_funcs {name}: not a built-in reward ({', '.join(registry)}) nor a dotted "
                              "path module.func")
        module_path, func_name = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # TRL's scripts import from the working directory
        try:
            func = getattr(importlib.import_module(module_path), func_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"--reward_funcs {name}: cannot import it ({exc})") from None
        if not callable(func):
            raise ConfigError(f"--reward_funcs {name}: {func_name} is not a function")
        funcs.append(func)
    if not funcs:
        raise ConfigError("no reward: pass --reward_funcs (a built-in name or module.func) or "
                          "--reward_model_name_or_path")
    return funcs


def load_prompt_split(name: str, *, config: str | None, split: str, flag: str):
    """``split`` of ``name`` as a ``datasets.Dataset`` of prompt rows (one line otherwise)."""
    import datasets

    from pf_trl.data.local_datasets import LocalDatasetError, dataset_splits

    try:
        splits = dataset_splits(name, config=config)
    except LocalDatasetError as exc:
        raise ConfigError(str(exc)) from None
    if split not in splits:
        raise ConfigError(f"{flag} {split}: {name} has no {split!r} split (its splits: {', '.join(splits)})")
    paths = splits[split]
    first = Path(paths[0])
    if first.is_dir():
        data = datasets.load_from_disk(str(first))
    else:
        suffix = first.suffix.lower().lstrip(".")
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(suffix, suffix)
        data = datasets.load_dataset(builder, data_files=paths, split="train")
    if "prompt" not in data.column_names:
        raise ConfigError(f"--dataset_name {name}: GRPO/RLOO rows need a 'prompt' column; its columns are "
                          f"{sorted(data.column_names)}")
    return data


def _model(model_args, training_args) -> tuple[str, Any]:
    """The policy's folder and its tokenizer (an embedded name is built and saved under the output folder)."""
    from pf_trl.models import build_model, is_embedded_model
    from pf_trl.trainer.dpo_script import model_folder

    name = model_args.model_name_or_path
    if not name:
        raise ConfigError("--model_name_or_path is required (a Hub id ORG/NAME, a local model folder or "
                          "pf-trl/tiny-llama)")
    trust = bool(training_args.trust_remote_code)
    if is_embedded_model(name):
        from pf_trl.data.tokenizer import load_tokenizer

        folder = Path(training_args.output_dir) / "pf-trl-initial-model"
        if not (folder / "config.json").is_file():
            build_model(name, seed=training_args.seed,
                        attn_implementation=model_args.attn_implementation or "sdpa").save_pretrained(folder)
            load_tokenizer().save_pretrained(folder)
        return str(folder), load_tokenizer(str(folder))
    from transformers import AutoTokenizer

    folder = model_folder(name, model_args.model_revision, trust)
    return folder, AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)


def run_rl(kind: str, script_args, training_args, model_args, dataset_args=None) -> Any:
    """Train as ``trl grpo`` / ``trl rloo`` (``kind``) does, with the same arguments, padding-free; returns the trainer
    after the final save (and ``--push_to_hub``), as TRL's script ends."""
    from trl import get_peft_config

    from pf_trl.trainer.trl_script import train_save_push

    if dataset_args is not None and getattr(dataset_args, "datasets", None):
        raise ConfigError(f"--datasets (a mixture list) is not read by pf-trl {kind}; pass one --dataset_name")
    if not script_args.dataset_name:
        raise ConfigError("--dataset_name is required (a local JSONL / Parquet file or dataset folder of prompts, or "
                          "a Hub dataset id)")
    if getattr(script_args, "dataset_streaming", False):
        raise ConfigError(f"--dataset_streaming True is not supported by pf-trl {kind}; drop it")
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ConfigError(f"--load_in_4bit / --load_in_8bit (bitsandbytes) are not supported by pf-trl {kind}")
    rewards = reward_functions(script_args.reward_funcs, script_args.reward_model_name_or_path)
    folder, tokenizer = _model(model_args, training_args)
    init_kwargs = dict(trust_remote_code=training_args.trust_remote_code,
                       attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    if training_args.model_init_kwargs is not None:
        init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = init_kwargs
    train = load_prompt_split(script_args.dataset_name, config=script_args.dataset_config,
                              split=script_args.dataset_train_split, flag="--dataset_train_split")
    evaluate = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    eval_data = load_prompt_split(script_args.dataset_name, config=script_args.dataset_config,
                                  split=script_args.dataset_test_split,
                                  flag="--dataset_test_split") if evaluate else None
    if kind == "grpo":
        from pf_trl.trainer.rl.grpo import PaddingFreeGRPOTrainer as trainer_cls
    else:
        from pf_trl.trainer.rl.rloo import PaddingFreeRLOOTrainer as trainer_cls
    trainer = trainer_cls(model=folder, reward_funcs=rewards, args=training_args, train_dataset=train,
                          eval_dataset=eval_data, processing_class=tokenizer, peft_config=get_peft_config(model_args))
    return train_save_push(trainer, script_args, training_args, f"pf-trl {kind}")
