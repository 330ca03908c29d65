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
    from pf_trl.trainer.dpo_script import run_reference_script
    from pf_trl.trainer.preference.kto_trainer import PaddingFreeKTOTrainer

    return run_reference_script(PaddingFreeKTOTrainer, "pf-trl kto", script_args, training_args, model_args,
                                dataset_args, unpaired=True)
