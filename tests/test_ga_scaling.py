"""Gradient accumulation on every supported transformers: the first optimizer step's gradient of a pf-trl trainer
built as on transformers < 5.19 equals the one on the installed transformers (float32, same batches, same ops:
equal to 1e-6 relative; the bug this guards against halves it at two accumulation steps).

transformers < 5.19 is emulated where it differs: TRL's base trainer reads ``transformers.__version__`` when it
bridges ``loss_is_scaled_for_ga`` to the older Trainer's attributes (patched to 5.18.0 during construction), and the
older Trainer's ``training_step`` never reads ``loss_is_scaled_for_ga`` (set to ``None`` after construction: the
installed Trainer then takes exactly the older rule, ``model_accepts_loss_kwargs`` / ``compute_loss_func``)."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from tests import dpo_support as S

pytestmark = pytest.mark.filterwarnings("ignore")


def _build_as_before_5_19(monkeypatch, build):
    import trl.trainer.base_trainer as base  # its `transformers` (the lazy module replaces itself in sys.modules)

    with monkeypatch.context() as patch:
        patch.setattr(base.transformers, "__version__", "5.18.0")
        trainer = build()
    trainer.loss_is_scaled_for_ga = None  # transformers 5.18's training_step has no such attribute
    return trainer


def _first_step_gradient(trainer) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not grads:
                grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                              if p.grad is not None})

    trainer.add_callback(Capture())
    trainer.train()
    return grads


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[n] - b[n]).abs().max()) / float(a[n].abs().max()) for n in a)


@pytest.mark.slow
def test_dpo_token_budget_accumulation_on_transformers_before_5_19(tmp_path, monkeypatch):
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    rows = S.pairs(6, seed=3)
    kw = dict(max_tokens_per_batch=120, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=1,
              max_grad_norm=1e9, learning_rate=0.0)
    current = _first_step_gradient(S.trainer(PaddingFreeDPOTrainer, rows, tmp_path / "now", **kw))
    old = _build_as_before_5_19(monkeypatch, lambda: S.trainer(PaddingFreeDPOTrainer, rows, tmp_path / "old", **kw))
    assert _worst(current, _first_step_gradient(old)) < 1e-6
    # control: the attribute set after Trainer.__init__ (as before the fix) is not seen by the older Trainer
    late = _build_as_before_5_19(monkeypatch, lambda: S.trainer(PaddingFreeDPOTrainer, rows, tmp_path / "late",
                                                                max_tokens_per_batch=None, **{
                                                                    k: v for k, v in kw.items()
                                                                    if k != "max_tokens_per_batch"}))
    late.pf_token_budget = 120
    late.loss_is_scaled_for_ga = None
    assert _worst(current, _first_step_gradient(late)) > 0.3


@pytest.mark.slow
def test_sft_accumulation_on_transformers_before_5_19(tmp_path, monkeypatch, sample_shards, tokenizer):
    import numpy as np

    from pf_trl.data.shards import load_shards
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    ds = load_shards(sample_shards)
    keep = np.nonzero(np.asarray(ds["length"]) <= 120)[0][:8].tolist()
    ds = ds.select(keep).flatten_indices()

    def build(out, **extra):
        model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **S.TINY)
        model.accepts_loss_kwargs = False  # as Qwen3-VL, GLM-4V, ... declare: the older rule cannot rely on it
        args = PaddingFreeConfig(output_dir=str(out), report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                                 per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                                 learning_rate=0.0, max_grad_norm=1e9, padding_free_mode="internal", max_length=None,
                                 use_cpu=True, dataloader_num_workers=0, **extra)
        return PaddingFreeSFTTrainer(model, args=args, train_dataset=ds, processing_class=tokenizer)

    now = build(tmp_path / "now")
    current = _first_step_gradient(now)
    old = _build_as_before_5_19(monkeypatch, lambda: build(tmp_path / "old"))
    assert old.compute_loss_func is None  # TRL's marker string is not left where pf-trl's compute_loss calls it
    assert _worst(current, _first_step_gradient(old)) < 1e-6
    # control: without the bridge (the attribute unseen, as when it was set after Trainer.__init__) the older rule
    # divides by the accumulation steps once more (the first trainer trained again: learning rate 0 kept its weights)
    now.loss_is_scaled_for_ga = None
    assert _worst(current, _first_step_gradient(now)) > 0.3
