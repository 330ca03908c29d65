"""What ``pf-trl kto`` runs: TRL's ``trl kto`` script (``trl/scripts/kto.py``) with PaddingFreeKTOTrainer, on data
and models pf-trl opens locally (as ``pf-trl dpo``: see :mod:`pf_trl.trainer.dpo_script`).

- data: ``--dataset_name``: a Hub dataset id or a local file / folder / saved dataset of KTO rows: unpaired
  (``prompt``, ``completion``, ``label``) or preference pairs (``chosen``/``rejected``, optionally ``prompt``), which
  TRL's KTOTrainer unpairs; ``--datasets`` mixtures and streaming refused.
- model: a Hub model id (at ``--model_revision``) or a local folder, loaded by TRL's KTOTrainer with
  ``--attn_implementation``, ``--dtype``, ``--trust_remote_code`` as ``trl kto`` passes them (its reference model a
  second load of the same folder); or an embedded pf-trl name (``pf-trl/tiny-llama``; its reference model a second
  copy). ``--use_peft`` and the LoRA flags as TRL reads them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_kto"]


def run_kto(script_args, training_args, model_args, dataset_args=None) -> Any:
    """Train as ``trl kto`` does (same arguments), padding-free; returns the trainer after saving the model."""
    from trl import get_peft_config

    from pf_trl.trainer.dpo_script import _model_and_tokenizer, check_pair_script_args, preference_splits
    from pf_trl.trainer.preference.kto_trainer import PaddingFreeKTOTrainer
    from pf_trl.trainer.trl_script import train_save_push

    check_pair_script_args(script_args, dataset_args, model_args, "pf-trl kto")
    init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                       attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    if training_args.model_init_kwargs is not None:
        init_kwargs.update(training_args.model_init_kwargs)
    trust = bool(init_kwargs["trust_remote_code"])  # trl kto's: model_init_kwargs win over the flag
    model, ref_model, tokenizer = _model_and_tokenizer(model_args, training_args, trust)
    if isinstance(model, str):
        init_kwargs.pop("revision")  # the folder is the snapshot of that revision already
    training_args.model_init_kwargs = init_kwargs if isinstance(model, str) else None
    train, eval_data = preference_splits(script_args, training_args, unpaired=True)
    trainer = PaddingFreeKTOTrainer(model, ref_model=ref_model, args=training_args, train_dataset=train,
                                    eval_dataset=eval_data, processing_class=tokenizer,
                                    peft_config=get_peft_config(model_args))
    return train_save_push(trainer, script_args, training_args, "pf-trl kto")
