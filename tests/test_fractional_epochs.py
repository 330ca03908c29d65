"""Fractional epochs count examples; an eval subset picks the same examples every time."""

from __future__ import annotations

import math

import numpy as np
import pytest

TINY = dict(vocab_size=256, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1)
BUDGET = 512


def _bimodal(n=400, seed=0) -> np.ndarray:
    """Many short examples and some long ones: a batch holds ~25 short ones or a single long one."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.25
    return np.where(long, rng.integers(300, 500, n), rng.integers(10, 30, n)).astype(int)


def _first_share(lengths, seed, k, partial: bool) -> float:
    from pf_trl.batching.sampler import TokenBudgetBatchSampler

    sampler = TokenBudgetBatchSampler(lengths, BUDGET, seed=seed)
    if partial:
        sampler.set_partial_epoch(0, k)
    batches = list(sampler)
    return sum(len(b) for b in batches[:k]) / len(lengths)


def test_partial_epoch_holds_its_share_of_examples():
    from pf_trl.batching.sampler import TokenBudgetBatchSampler

    lengths = _bimodal()
    n = len(TokenBudgetBatchSampler(lengths, BUDGET, seed=0))
    k = math.ceil(0.5 * n)
    stratified = [_first_share(lengths, seed, k, True) for seed in range(10)]
    plain = [_first_share(lengths, seed, k, False) for seed in range(10)]
    assert max(abs(s - k / n) for s in stratified) <= 0.02, stratified
    assert max(abs(s - k / n) for s in plain) > 0.02, plain  # the negative control: any first half of the batches
    # the epoch still holds every example exactly once
    sampler = TokenBudgetBatchSampler(lengths, BUDGET, seed=3)
    sampler.set_partial_epoch(0, k)
    assert sorted(i for b in sampler for i in b) == list(range(len(lengths)))


@pytest.fixture(scope="module")
def dataset():
    import datasets

    rng = np.random.default_rng(1)
    rows = [rng.integers(3, 256, int(n)).tolist() for n in _bimodal(160, seed=1)]
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})


def _args(tmp_path, **kw):
    from pf_trl.trainer import PaddingFreeConfig

    base = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_length=None, disable_tqdm=True,
                max_tokens_per_batch=BUDGET, save_strategy="no", logging_steps=1000, seed=0)
    base.update(kw)
    return PaddingFreeConfig(**base)


@pytest.mark.slow
def test_half_an_epoch_trains_half_the_examples(tmp_path, dataset, tokenizer):
    import torch

    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeSFTTrainer

    torch.set_num_threads(1)
    seen = []

    class Counting(PaddingFreeSFTTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if self.model.training:
                seen.append(int((inputs["position_ids"] == 0).sum()))
            return super().compute_loss(model, inputs, *a, **kw)

    trainer = Counting(build_model("pf-trl/tiny-llama", seed=0, **TINY), args=_args(tmp_path, num_train_epochs=0.5),
                       train_dataset=dataset, processing_class=tokenizer)
    metrics = trainer.train().metrics
    assert abs(sum(seen) / dataset.num_rows - 0.5) <= 0.03, sum(seen)
    assert metrics["train_examples"] == sum(seen)


def test_eval_subset_is_the_same_every_time(tmp_path, dataset, tokenizer):
    from pf_trl.data.inputs import eval_subset
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeSFTTrainer

    picks = []
    for seed in (0, 1):
        trainer = PaddingFreeSFTTrainer(build_model("pf-trl/tiny-llama", seed=seed, **TINY),
                                        args=_args(tmp_path, seed=seed, eval_max_examples=20, max_steps=1),
                                        train_dataset=dataset, eval_dataset=dataset, processing_class=tokenizer)
        picks.append(trainer.eval_dataset["input_ids"])
    assert len(picks[0]) == 20 and picks[0] == picks[1], "the same examples whatever the training seed"
    assert picks[0] != dataset.select(range(20))["input_ids"], "a random subset, not the first rows"
    assert eval_subset(dataset, 1000).num_rows == dataset.num_rows
