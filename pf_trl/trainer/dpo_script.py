"""What ``pf-trl dpo`` runs: TRL's ``trl dpo`` script (``trl/scripts/dpo.py``) with PaddingFreeDPOTrainer, on data
and models pf-trl opens locally.

- data: ``--dataset_name`` is a local dataset of preference rows in TRL's formats (``prompt``/``chosen``/``rejected``,
  conversational, or implicit prompt: ``chosen``/``rejected`` only), of any kind
  :func:`pf_trl.data.local_datasets.dataset_splits` reads (a JSON / JSONL / Parquet / CSV file, a folder of them, a
  ``save_to_disk`` folder); ``--datasets`` (a mixture list) is refused. TRL's DPOTrainer tokenizes the rows (its
  ``_prepare_dataset``, cached by ``datasets``), which keeps the run exact against ``trl dpo``.
- model: a local folder or an embedded pf-trl name (``pf-trl/tiny-llama``; its reference model is a second copy);
  ``--use_peft`` and the LoRA flags as TRL reads them (``trl.get_peft_config``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pf_trl.errors import ConfigError

logger = logging.getLogger("pf_trl.trainer")

__all__ = ["load_preference_split", "run_dpo"]


def load_preference_split(name: str, *, config: str | None, split: str, flag: str):
    """``split`` of the local dataset ``name`` as a ``datasets.Dataset`` of preference rows (one line otherwise)."""
    import datasets

    from pf_trl.data.local_datasets import dataset_splits

    splits = dataset_splits(name, config=config)
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
    if not {"chosen", "rejected"} <= columns:
        raise ConfigError(f"--dataset_name {name}: preference rows need 'chosen' and 'rejected' (and optionally "
                          f"'prompt'); its columns are {sorted(columns)}")
    return data


def _model_and_tokenizer(model_args, training_args) -> tuple[Any, Any, Any]:
    """``(model, ref_model, tokenizer)``; the model a path string (TRL loads it) or, for an embedded name, built."""
    from pf_trl.models import build_model, is_embedded_model

    name = model_args.model_name_or_path
    if not name:
        raise ConfigError("--model_name_or_path is required (a local model folder or pf-trl/tiny-llama)")
    if is_embedded_model(name):
        from pf_trl.data.tokenizer import load_tokenizer

        kwargs = {"attn_implementation": model_args.attn_implementation or "sdpa"}
        model = build_model(name, seed=training_args.seed, **kwargs)
        needs_ref = not model_args.use_peft and not training_args.precompute_ref_log_probs
        ref = build_model(name, seed=training_args.seed, **kwargs) if needs_ref else None
        return model, ref, load_tokenizer()
    if not Path(name).expanduser().is_dir():
        raise ConfigError(f"--model_name_or_path {name}: no such model folder (pf-trl never downloads models)")
    from transformers import AutoTokenizer

    return name, None, AutoTokenizer.from_pretrained(name)


def run_dpo(script_args, training_args, model_args, dataset_args=None) -> Any:
    """Train as ``trl dpo`` does (same arguments), padding-free; returns the trainer after saving the model."""
    from trl import get_peft_config

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    if dataset_args is not None and getattr(dataset_args, "datasets", None):
        raise ConfigError("--datasets (a mixture list) is not read by pf-trl dpo; pass one --dataset_name")
    if not script_args.dataset_name:
        raise ConfigError("--dataset_name is required (a local JSONL / Parquet file or dataset folder of pairs)")
    if getattr(script_args, "dataset_streaming", False):
        raise ConfigError("--dataset_streaming is not supported by pf-trl dpo; pass a local file or folder")
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ConfigError("--load_in_4bit / --load_in_8bit (bitsandbytes) are not supported by pf-trl dpo")
    init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                       attn_implementation=model_args.attn_implementation or "sdpa", dtype=model_args.dtype)
    if training_args.model_init_kwargs is not None:
        init_kwargs.update(training_args.model_init_kwargs)
    model, ref_model, tokenizer = _model_and_tokenizer(model_args, training_args)
    training_args.model_init_kwargs = init_kwargs if isinstance(model, str) else None
    train = load_preference_split(script_args.dataset_name, config=script_args.dataset_config,
                                  split=script_args.dataset_train_split, flag="--dataset_train_split")
    evaluate = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    eval_data = load_preference_split(script_args.dataset_name, config=script_args.dataset_config,
                                      split=script_args.dataset_test_split,
                                      flag="--dataset_test_split") if evaluate else None
    trainer = PaddingFreeDPOTrainer(model, ref_model=ref_model, args=training_args, train_dataset=train,
                                    eval_dataset=eval_data, processing_class=tokenizer,
                                    peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        print(f"pf-trl dpo: model saved to {training_args.output_dir}", flush=True)
    return trainer
