"""What ``pf-trl reward`` runs: TRL's ``trl reward`` script (``trl/scripts/reward.py``) with
PaddingFreeRewardTrainer, on data and models pf-trl opens locally (as ``pf-trl dpo``: see
:mod:`pf_trl.trainer.dpo_script`).

- data: ``--dataset_name``: a Hub dataset id or a local file / folder / saved dataset of preference rows
  (``chosen``/``rejected``, optionally ``prompt`` and ``margin``); ``--datasets`` mixtures and streaming refused.
- model: a Hub model id (at ``--model_revision``) or a local folder, loaded by TRL's RewardTrainer as
  ``AutoModelForSequenceClassification`` (``num_labels=1``, a new score head on a causal checkpoint) with
  ``--attn_implementation``, ``--dtype``, ``--trust_remote_code`` as ``trl reward`` passes them; or an embedded
  pf-trl name (``pf-trl/tiny-llama``: a sequence-classification model of that config, seeded).
"""

from __future__ import annotations

from typing import Any

from pf_trl.errors import ConfigError

__all__ = ["run_reward"]


def _embedded_reward_model(name: str, model_args, seed: int):
    import torch
    from transformers import AutoModelForSequenceClassification

    from pf_trl.models import embedded_config

    config = embedded_config(name, num_labels=1)
    kwargs = {"attn_implementation": model_args.attn_implementation} if model_args.attn_implementation else {}
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, **kwargs)


def _model_and_tokenizer(model_args, training_args, trust: bool) -> tuple[Any, Any]:
    from pf_trl.models import is_embedded_model
    from pf_trl.trainer.dpo_script import model_folder

    name = model_args.model_name_or_path
    if not name:
        raise ConfigError("--model_name_or_path is required (a Hub id ORG/NAME, a local model folder or "
                          "pf-trl/tiny-llama)")
    if is_embedded_model(name):
        from pf_trl.data.tokenizer import load_tokenizer

        return _embedded_reward_model(name, model_args, training_args.seed), load_tokenizer()
    folder = model_folder(name, model_args.model_revision, trust)
    from transformers import AutoTokenizer

    from pf_trl.remote_code import tokenizer_code_error

    try:
        return folder, AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
    except ValueError as exc:  # a tokenizer of its own code without the flag: one line naming it
        refusal = tokenizer_code_error(exc, name, "--model_name_or_path")
        if refusal is None:
            raise
        raise refusal from None


def run_reward(script_args, training_args, model_args, dataset_args=None) -> Any:
    """Train as ``trl reward`` does (same arguments), padding-free; returns the trainer after saving the model."""
    from trl import get_peft_config

    from pf_trl.trainer.dpo_script import check_pair_script_args, preference_splits
    from pf_trl.trainer.preference.reward_trainer import PaddingFreeRewardTrainer
    from pf_trl.trainer.trl_script import train_save_push

    check_pair_script_args(script_args, dataset_args, model_args, "pf-trl reward")
    init_kwargs = dict(trust_remote_code=training_args.trust_remote_code,
                       attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    if training_args.model_init_kwargs is not None:
        init_kwargs.update(training_args.model_init_kwargs)
    model, tokenizer = _model_and_tokenizer(model_args, training_args, bool(init_kwargs["trust_remote_code"]))
    training_args.model_init_kwargs = init_kwargs if isinstance(model, str) else None
    train, eval_data = preference_splits(script_args, training_args)
    trainer = PaddingFreeRewardTrainer(model, args=training_args, train_dataset=train, eval_dataset=eval_data,
                                       processing_class=tokenizer, peft_config=get_peft_config(model_args))
    return train_save_push(trainer, script_args, training_args, "pf-trl reward")
