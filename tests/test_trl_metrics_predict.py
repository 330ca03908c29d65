"""TRL's step metrics and predict() in padding-free mode, against TRL's padded run on the same rows and weights:
`entropy`, `num_tokens` and `mean_token_accuracy` in the logs (train and eval), and predict() returning one row of
logits and labels per example (not one packed row per batch).

The rows are random token ids, so the model's head is ``SMALL_VOCAB`` rows (trl_parity_support), not the tokenizer's
32,000: the same comparisons at a thirtieth of the logits."""

from __future__ import annotations

import math

import pytest
from trl_parity_support import SMALL_VOCAB, pf_trainer, rows, trl_trainer

LENGTHS = [64, 90, 70, 66, 81, 70, 60]
EVAL = rows([40, 75, 52, 61, 33, 70, 48, 57], [5, 10, 8, 12, 4, 9, 6, 7], seed=1, vocab_size=SMALL_VOCAB)
TRAIN = rows(vocab_size=SMALL_VOCAB)
STEPS = dict(per_device_train_batch_size=len(LENGTHS), max_steps=2, per_device_eval_batch_size=len(EVAL))


def _logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """TRL's padded run, trained and evaluated once: the reference of both fused_loss settings below."""
    trl = trl_trainer(TRAIN, tmp_path_factory.mktemp("trl"), EVAL, vocab_size=SMALL_VOCAB, **STEPS)
    trl.train()
    return trl, trl.evaluate()


@pytest.mark.slow
@pytest.mark.parametrize("fused_loss", ["chunked", "none"])
def test_entropy_and_num_tokens_match_trls_padded_run(tmp_path, fused_loss, trl_run):
    """One batch per step holds all seven rows in both runs (TRL: batch size 7; pf-trl: a token budget of their sum),
    so each step's mean entropy and token count are the same quantities. Negative control: without pf-trl's metrics
    the keys are missing (KeyError / empty lists)."""
    trl, trl_eval = trl_run
    pf = pf_trainer(TRAIN, tmp_path, EVAL, max_tokens_per_batch=sum(LENGTHS), max_eval_tokens_per_batch=4096,
                    fused_loss=fused_loss, vocab_size=SMALL_VOCAB, **STEPS)
    pf.train()
    pf_eval = pf.evaluate()
    for key in ("entropy", "mean_token_accuracy"):
        want, got = _logged(trl, key), _logged(pf, key)
        assert len(want) == len(got) == 2, (key, want, got)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5), key
    assert _logged(pf, "num_tokens") == _logged(trl, "num_tokens") == [sum(LENGTHS), 2 * sum(LENGTHS)]
    # nats, below log(vocabulary): a real entropy, not a loss or a count
    assert 0 < _logged(pf, "entropy")[0] <= math.log(SMALL_VOCAB) + 1e-4
    assert pf_eval["eval_entropy"] == pytest.approx(trl_eval["eval_entropy"], rel=1e-4)
    assert pf_eval["eval_num_tokens"] == trl_eval["eval_num_tokens"] == 2 * sum(LENGTHS)
    assert pf_eval["eval_mean_token_accuracy"] == pytest.approx(trl_eval["eval_mean_token_accuracy"], abs=1e-6)
    assert "train_real_tokens" in pf.state.log_history[-2]  # pf-trl's own metrics stay beside TRL's


@pytest.mark.slow
def test_predict_returns_one_row_per_example(tmp_path):
    """predict() of eight rows, four a batch: shapes, labels and the logits at every real position equal TRL's padded
    run with the same weights. Negative control: the packed output had one row per batch ([2, 228, V])."""
    trl = trl_trainer(TRAIN, tmp_path, per_device_eval_batch_size=4, vocab_size=SMALL_VOCAB)
    pf = pf_trainer(TRAIN, tmp_path, per_device_eval_batch_size=4, vocab_size=SMALL_VOCAB)
    import datasets

    test = datasets.Dataset.from_list(EVAL)
    want, got = trl.predict(test), pf.predict(test)
    assert got.predictions.shape == want.predictions.shape == (len(EVAL), max(len(r["input_ids"]) for r in EVAL),
                                                              want.predictions.shape[-1])
    assert (got.label_ids == want.label_ids).all()
    for i, row in enumerate(EVAL):
        n = len(row["input_ids"])
        assert got.predictions[i, :n] == pytest.approx(want.predictions[i, :n], abs=2e-4), i
        assert (got.predictions[i, n:] == -100).all()  # padding, as evaluation_loop pads across batches
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-4)

    # evaluate() with compute_metrics: one row per example too (in the order the eval batches were packed)
    seen = []
    pf.compute_metrics = lambda p: seen.append(p) or {}
    pf.evaluate(test)
    rows_of = {tuple(int(x) for x in r if x != -100) for r in want.label_ids}
    assert seen[0].predictions.shape[0] == len(EVAL)
    assert {tuple(int(x) for x in r if x != -100) for r in seen[0].label_ids} == rows_of
