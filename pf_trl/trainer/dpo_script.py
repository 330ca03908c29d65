"""What ``pf-trl dpo`` runs: TRL's ``trl dpo`` script (``trl/scripts/dpo.py``) with PaddingFreeDPOTrainer, on data
and models pf-trl opens locally.

- data: ``--dataset_name`` is a Hub dataset id (``ORG/NAME``, with ``--dataset_config`` and the split flags, through
  :mod:`pf_trl.hub` as ``pf-trl train`` reads it) or a local dataset of preference rows in TRL's formats
  (``prompt``/``chosen``/``rejected``, conversational, or implicit prompt: ``chosen``/``rejected`` only), of any kind
  :func:`pf_trl.data.local_datasets.dataset_splits` reads (a JSON / JSONL / Parquet / CSV file, a folder of them, a
  ``save_to_disk`` folder); ``--datasets`` (a mixture list) and ``--dataset_streaming`` are refused. TRL's
  DPOTrainer tokenizes the rows (its ``_prepare_dataset``, cached by ``datasets``), which keeps the run exact against
  ``trl dpo``.
- model: a Hub model id (``ORG/NAME`` at ``--model_revision``, its snapshot downloaded by huggingface_hub), a local
  folder or an embedded pf-trl name (``pf-trl/tiny-llama``; its reference model is a second copy);
  ``--trust_remote_code`` as TRL passes it (custom code refused without it, before any weights are downloaded);
  ``--use_peft`` and the LoRA flags as TRL reads them (``trl.get_peft_config``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pf_trl.errors import ConfigError

logger = logging.getLogger("pf_trl.trainer")

__all__ = ["load_preference_split", "run_dpo", "run_reference_script"]


def load_preference_split(name: str, *, config: str | None, split: str, flag: str, unpaired: bool = False):
    """``split`` of the local dataset ``name`` as a ``datasets.Dataset`` of preference rows (one line otherwise);
    ``unpaired``: unpaired rows (``prompt``/``completion``/``label``, KTO's format) are accepted too."""
    import datasets

    from pf_trl.data.local_datasets import dataset_splits

    splits = dataset_splits(name, config=config, splits=[split])
    if split not in splits:
        raise ConfigError(f"{flag} {split}: {name} has no {split!r} split (its splits: {', '.join(splits)})")
    paths = splits[split]
    first = Path(paths[0])
    if (first / "pf_manifest.json").is_file():
        raise ConfigError(f"--dataset_name {name}: a pf-trl shards directory holds SFT tokens, not preference pairs; "
                          "pass the rows (prompt/chosen/rejected) as a JSONL / Parquet file or a saved dataset")
    if first.is_dir():
        data = datasets.load_from_disk(str(first))
    else:
        suffix = first.suffix.lower().lstrip(".")
        builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}.get(suffix, suffix)
        data = datasets.load_dataset(builder, data_files=paths, split="train")
    columns = set(data.column_names)
    if unpaired and {"prompt", "completion", "label"} <= columns:
        return data
    if not {"chosen", "rejected"} <= columns:
        also = " or unpaired rows 'prompt', 'completion' and 'label'" if unpaired else ""
        raise ConfigError(f"--dataset_name {name}: preference rows need 'chosen' and 'rejected' (and optionally "
                          f"'prompt'){also}; its columns are {sorted(columns)}")
    return data


def _model_and_tokenizer(model_args, training_args, trust: bool) -> tuple[Any, Any, Any]:
    """``(model, ref_model, tokenizer)``; the model a folder (TRL loads it: a local one, or a Hub id's snapshot) or,
    for an embedded name, built."""
    from pf_trl.models import build_model, is_embedded_model

    name = model_args.model_name_or_path
    if not name:
        raise ConfigError("--model_name_or_path is required (a Hub id ORG/NAME, a local model folder or "
                          "pf-trl/tiny-llama)")
    folder = model_folder(name, model_args.model_revision, trust)  # an embedded name as it is
    if is_embedded_model(name):
        from pf_trl.data.tokenizer import load_tokenizer

        kwargs = {"attn_implementation": model_args.attn_implementation}  # None: transformers' default, as trl dpo
        model = build_model(name, seed=training_args.seed, **kwargs)
        needs_ref = not model_args.use_peft and not training_args.precompute_ref_log_probs
        ref = build_model(name, seed=training_args.seed, **kwargs) if needs_ref else None
        return model, ref, load_tokenizer()
    from transformers import AutoTokenizer

    from pf_trl.remote_code import tokenizer_code_error

    try:
        return folder, None, AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    except ValueError as exc:  # a tokenizer of its own code without the flag: one line naming it
        refusal = tokenizer_code_error(exc, name, "--model_name_or_path")
        if refusal is None:
            raise
        raise refusal from None


def model_folder(name: str, revision: str | None, trust: bool) -> str:
    """The local folder of ``--model_name_or_path``: itself, or a Hub id's snapshot at ``--model_revision``
    (:func:`pf_trl.models.resolve_model_path`, the code ``pf-trl train`` uses); one line on any failure."""
    from pf_trl.hub import HubError
    from pf_trl.models import pinned_revision, resolve_model_path
    from pf_trl.remote_code import RemoteCodeError

    try:
        return resolve_model_path(name, revision=pinned_revision(name, revision), trust_remote_code=trust)
    except (HubError, RemoteCodeError) as exc:
        raise ConfigError(str(exc)) from None


def _refuse_streaming(script_args, dataset_args, command: str = "pf-trl dpo") -> None:
    """A stream has no lengths ahead of time; pf-trl dpo's batches (and TRL's tokenizing of the pairs) need them."""
    if getattr(script_args, "dataset_streaming", False):
        raise ConfigError(f"--dataset_streaming True is not supported by {command}: its batches are planned from the "
                          "lengths of every pair, which a stream does not have; drop it (the dataset is "
                          "memory-mapped, not held in memory)")
    if dataset_args is not None and getattr(dataset_args, "streaming", False):
        raise ConfigError(f"--streaming True streams a `datasets:` mixture, which {command} does not read; drop it "
                          "and pass one --dataset_name")


def preference_splits(script_args, training_args, unpaired: bool = False) -> tuple[Any, Any]:
    """The training split of ``--dataset_name`` and, when evaluation is on, its test split (else ``None``);
    ``unpaired``: as :func:`load_preference_split`."""
    train = load_preference_split(script_args.dataset_name, config=script_args.dataset_config,
                                  split=script_args.dataset_train_split, flag="--dataset_train_split",
                                  unpaired=unpaired)
    evaluate = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    eval_data = load_preference_split(script_args.dataset_name, config=script_args.dataset_config,
                                      split=script_args.dataset_test_split,
                                      flag="--dataset_test_split", unpaired=unpaired) if evaluate else None
    return train, eval_data


def check_pair_script_args(script_args, dataset_args, model_args, command: str) -> None:
    """The script arguments a pair trainer's command (``pf-trl dpo``, ``pf-trl reward``) refuses, in one line each:
    a mixture list, no ``--dataset_name``, streaming, bitsandbytes quantization."""
    if dataset_args is not None and getattr(dataset_args, "datasets", None):
        raise ConfigError(f"--datasets (a mixture list) is not read by {command}; pass one --dataset_name")
    if not script_args.dataset_name:
        raise ConfigError("--dataset_name is required (a Hub dataset id ORG/NAME, or a local JSONL / Parquet file or "
                          "dataset folder of pairs)")
    _refuse_streaming(script_args, dataset_args, command)
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ConfigError(f"--load_in_4bit / --load_in_8bit (bitsandbytes) are not supported by {command}")


def run_dpo(script_args, training_args, model_args, dataset_args=None) -> Any:
    """Train as ``trl dpo`` does (same arguments), padding-free; returns the trainer after saving the model."""
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    return run_reference_script(PaddingFreeDPOTrainer, "pf-trl dpo", script_args, training_args, model_args,
                                dataset_args)


def run_reference_script(trainer_cls, command: str, script_args, training_args, model_args, dataset_args=None, *,
                         unpaired: bool = False) -> Any:
    """What ``trl dpo`` / ``trl kto`` do with their arguments (the script checks, the model, its reference and
    tokenizer, the train / test splits, then train, save and push), with ``trainer_cls`` (a pf-trl trainer taking
    ``ref_model``); ``unpaired``: the splits hold KTO's unpaired rows. Returns the trainer."""
    from trl import get_peft_config

    from pf_trl.trainer.trl_script import train_save_push

    check_pair_script_args(script_args, dataset_args, model_args, command)
    init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                       attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    if training_args.model_init_kwargs is not None:
        init_kwargs.update(training_args.model_init_kwargs)
    trust = bool(init_kwargs["trust_remote_code"])  # TRL's scripts: model_init_kwargs win over the flag
    model, ref_model, tokenizer = _model_and_tokenizer(model_args, training_args, trust)
    if isinstance(model, str):
        init_kwargs.pop("revision")  # the folder is the snapshot of that revision already
    training_args.model_init_kwargs = init_kwargs if isinstance(model, str) else None
    train, eval_data = preference_splits(script_args, training_args, unpaired=unpaired)
    trainer = trainer_cls(model, ref_model=ref_model, args=training_args, train_dataset=train, eval_dataset=eval_data,
                          processing_class=tokenizer, peft_config=get_peft_config(model_args))
    return train_save_push(trainer, script_args, training_args, command)
