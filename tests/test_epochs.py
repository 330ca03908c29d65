"""Epochs through PaddingFreeSFTTrainer: every example exactly once per epoch over 3 epochs whose packings differ,
and a resume in the middle of epoch 2 that trains exactly the rest of it, then a full epoch 3.

The trainer's sampler gets a packing window of 16 examples (the automatic window is at least 512 examples, so
packings that differ between epochs need many more examples: that case is covered in tests/test_sampler.py), so
that 100 examples give different packings in different epochs and the test stays fast.

Each example carries its index in its first two tokens, so the test reads what was trained from the packed rows
that reach ``compute_loss`` (split at ``position_ids == 0``), independently of the sampler's own bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

N, BUDGET, VOCAB, BASE, WINDOW = 100, 256, 256, 250, 16
TINY = dict(vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1)


def _lengths() -> np.ndarray:
    # long-tailed; with this seed the windowed packing gives 27, 28, 28 bins in epochs 0, 1, 2 (asserted below)
    rng = np.random.default_rng(4)
    return np.clip(np.round(rng.lognormal(np.log(50), 0.9, N)), 4, BUDGET).astype(int)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """A tiny model gains nothing from intra-op threads, and on a loaded 2-core machine two threads spin-wait on
    each other (0.7 ms vs 135 ms for the MLP here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset():
    import datasets

    rng = np.random.default_rng(0)
    rows = {"input_ids": [], "labels": []}
    for i, n in enumerate(_lengths()):
        ids = [3 + i // BASE, 3 + i % BASE] + rng.integers(3, VOCAB, int(n) - 2).tolist()
        rows["input_ids"].append(ids)
        rows["labels"].append(ids)
    return datasets.Dataset.from_dict(rows)


def _trainer_cls():
    from transformers import TrainerCallback

    from pf_trl.batching.sampler import TokenBudgetBatchSampler
    from pf_trl.trainer import PaddingFreeSFTTrainer

    class EpochOf(TrainerCallback):
        def __init__(self):
            self.epoch = None

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.epoch = math.floor(state.epoch + 1e-9)  # a resumed run begins inside its epoch

    class Recording(PaddingFreeSFTTrainer):
        """Records (epoch, global step, example index) of every example that reaches compute_loss in training."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.epoch_of = EpochOf()
            self.add_callback(self.epoch_of)
            self.trained: list[tuple[int, int, int]] = []

        def _pf_sampler(self, dataset, budget, batch_size, *, shuffle):
            s = super()._pf_sampler(dataset, budget, batch_size, shuffle=shuffle)
            return TokenBudgetBatchSampler(s.lengths, s.max_tokens, shuffle=s.shuffle, seed=s.seed,
                                           num_replicas=s.num_replicas, rank=s.rank, window=WINDOW)

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.model.training:
                ids = inputs["input_ids"].reshape(-1).tolist()
                pos = inputs["position_ids"].reshape(-1).tolist()
                for start in (j for j, p in enumerate(pos) if p == 0):
                    index = (ids[start] - 3) * BASE + ids[start + 1] - 3
                    self.trained.append((self.epoch_of.epoch, self.state.global_step, index))
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def _args(out, **kw):
    from pf_trl.trainer import PaddingFreeConfig

    base = dict(output_dir=str(out), report_to=[], logging_steps=50, disable_tqdm=True, learning_rate=1e-4, seed=0,
                padding_free_mode="huggingface", max_length=None, use_cpu=True, dataloader_num_workers=0,
                max_tokens_per_batch=BUDGET, num_train_epochs=3, save_strategy="no",
                lr_scheduler_type="constant")
    base.update(kw)
    return PaddingFreeConfig(**base)


def _model():
    from pf_trl.models import build_model

    return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)


def _per_epoch(trained, epoch):
    return sorted(i for e, _, i in trained if e == epoch)


def test_packings_differ_between_epochs():
    """Negative control: the raw packing of this data has a different bin count in epochs 0 and 1, so a per-epoch
    count taken from the plan would differ (Trainer would cut epoch 2 short by one batch)."""
    from pf_trl.batching.sampler import TokenBudgetBatchSampler

    sampler = TokenBudgetBatchSampler(_lengths(), BUDGET, seed=0, window=WINDOW)
    raw = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        raw.append(sampler.stats()["num_packed_bins"])
    assert raw == [27, 28, 28]
    assert len(sampler) == 27


@pytest.mark.slow
@pytest.mark.parametrize("ga", [1, 2])
def test_three_epochs_each_example_once_and_resume_mid_epoch_two(tmp_path, dataset, tokenizer, ga):
    Recording = _trainer_cls()
    full = Recording(_model(), args=_args(tmp_path / "full", gradient_accumulation_steps=ga), train_dataset=dataset,
                     processing_class=tokenizer)
    full.train()
    batches = len(full._pf_train_sampler)
    steps_per_epoch = math.ceil(batches / ga)
    assert full.state.global_step == 3 * steps_per_epoch
    for epoch in range(3):
        assert _per_epoch(full.trained, epoch) == list(range(N)), f"epoch {epoch + 1}: every example exactly once"

    # the same run, saving in the middle of epoch 2, then resumed from that checkpoint by a new trainer
    save_at = steps_per_epoch + steps_per_epoch // 2
    first = Recording(_model(), args=_args(tmp_path / "run", gradient_accumulation_steps=ga, save_strategy="steps",
                                           save_steps=save_at, max_steps=save_at), train_dataset=dataset,
                      processing_class=tokenizer)
    first.train()
    # max_steps changes the scheduler; the resumed trainer gets the full run's arguments
    resumed = Recording(_model(), args=_args(tmp_path / "run", gradient_accumulation_steps=ga), train_dataset=dataset,
                        processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{save_at}"))
    assert resumed.state.global_step == 3 * steps_per_epoch
    assert {e for e, _, _ in resumed.trained} == {1, 2}
    before = [i for e, step, i in full.trained if e == 1 and step < save_at]
    after = [i for e, _, i in resumed.trained if e == 1]
    assert before and after
    assert sorted(before + after) == list(range(N)), "epoch 2 across the resume: every example exactly once"
    assert after == [i for e, step, i in full.trained if e == 1 and step >= save_at], "the same batches, same order"
    assert _per_epoch(resumed.trained, 2) == list(range(N)), "epoch 3 after the resume: every example exactly once"
    assert [i for e, _, i in resumed.trained if e == 2] == [i for e, _, i in full.trained if e == 2]
    final_full = {k: v for k, v in full.model.state_dict().items()}
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, final_full[name], rtol=1e-4, atol=1e-6, msg=name)
