"""PaddingFreeKTOTrainer against TRL's KTOTrainer under the same KTOConfig (float32, CPU, the tiny Llama of
pf_trl.models, the shipped tokenizer: no pad token, so TRL pads with EOS): two training steps logged metric for metric
(the KL term positive, so it is exercised), every backbone forward one packed row without padding, one micro-batch's
loss, metrics and gradients (the kto and the apo_zero_unpaired loss), the reference precompute's per-batch
log-probs; each beside a control that fails the same check. Tolerance: tests/tolerances.py's ``sum_rtol`` over the
run's tokens (the metrics are sums of per-token log-probabilities, and the rewards and the KL differences of such
sums; measured gaps: at most 3e-6 relative)."""

from __future__ import annotations

import dataclasses

import datasets
import pytest
import torch

from tests import dpo_support as S
from tests.tolerances import assert_other_math, assert_same_math, sum_rtol

pytestmark = pytest.mark.filterwarnings("ignore")

# unpaired rows, desirable and undesirable mixed; two batches of four
ROWS = [dict(prompt=r["prompt"], completion=r["chosen"], label=bool(i % 3)) for i, r in enumerate(S.pairs(8, seed=5))]
BATCH = 4
RTOL = sum_rtol(302)  # the two steps' tokens
_TIMES = ("runtime", "per_second", "tflops")


def assert_same_metrics(expected: dict, got: dict, what: str) -> None:
    """TRL's metrics against pf-trl's: each within ``RTOL`` of itself, except ``logits/*``: a mean logit over the
    vocabulary sits near 0 by construction (logits of both signs), so its rounding is relative to the logits' own
    scale (order 1 on these models), not to the mean: within ``RTOL`` absolute."""
    assert expected.keys() == got.keys(), f"{what}: keys {sorted(expected)} vs {sorted(got)}"
    for key, value in expected.items():
        if key.startswith("logits/"):
            assert abs(value - got[key]) <= RTOL, f"{what} {key}: {value} vs {got[key]}"
        else:
            assert_same_math(value, got[key], what=f"{what} {key}", rtol=RTOL)


def reference_model():
    """A reference whose distribution is sharper than the policy's (its head scaled), so the KL estimate is positive
    (with two random tiny models it is clamped to 0, and the KL term would go unchecked)."""
    model = S.model(seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def build(cls, tmp_path, **kw):
    from trl import KTOConfig

    from pf_trl.data.tokenizer import load_tokenizer

    args = KTOConfig(**S.fields(tmp_path / cls.__name__, per_device_train_batch_size=BATCH, **kw))
    return cls(S.model(), ref_model=reference_model(), args=args, train_dataset=datasets.Dataset.from_list(ROWS),
               processing_class=load_tokenizer())


def _record_backbone(trainer, calls: list) -> None:
    for model in (trainer.model, trainer.ref_model):
        model.model.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append((tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask"),
                                                       kwargs.get("position_ids"))), with_kwargs=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """TRL's KTOTrainer and PaddingFreeKTOTrainer, each trained two steps; the packed run's backbone calls."""
    from trl import KTOTrainer

    from pf_trl.trainer.preference import PaddingFreeKTOTrainer

    tmp = tmp_path_factory.mktemp("kto")
    trl, pf = build(KTOTrainer, tmp, max_steps=2), build(PaddingFreeKTOTrainer, tmp, max_steps=2)
    calls: list = []
    _record_backbone(pf, calls)
    logs = [_trained_logs(t) for t in (trl, pf)]
    return trl, pf, logs, calls


def _trained_logs(trainer) -> list[dict]:
    """``trainer`` trained; its logged values but timings and the end-of-training summary."""
    trainer.train()
    return [{k: v for k, v in h.items() if not k.endswith(_TIMES) and not k.startswith("train_")}
            for h in trainer.state.log_history]


@pytest.mark.slow
def test_training_logs_equal_trl_on_packed_rows(runs):
    trl, pf, (expected, got), calls = runs
    keys = {k for h in expected for k in h}
    assert {"loss", "grad_norm", "kl", "entropy", "num_tokens", "logits/chosen", "logits/rejected", "rewards/chosen",
            "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"} <= keys
    assert all(h["kl"] > 0.5 for h in expected if "kl" in h)  # the KL term is in the loss, not clamped away
    for step, (mine, theirs) in enumerate(zip(expected, got, strict=True)):
        assert_same_metrics(mine, {k: v for k, v in theirs.items() if k in keys}, f"log {step}")
    assert got[0]["padding_share"] == 0 and got[0]["tokens_per_step_mean"] == expected[0]["num_tokens"]
    assert pf.pf_head_check is not None and pf.pf_head_check < 1e-4  # pf-trl's CPU head checked against TRL's at start
    # every forward was one packed row holding exactly the batch's real tokens: per step the KL completions and the
    # completions, on the policy then on the reference
    data = pf.train_dataset
    expected_rows = []
    for start in range(0, len(ROWS), BATCH):
        rows = data.select(range(start, start + BATCH))
        main = sum(len(p) + len(c) for p, c in zip(rows["prompt_ids"], rows["completion_ids"]))
        kl = sum(len(p) + len(c) for p, c in zip(rows["prompt_ids"], rows["KL_completion_ids"]))
        expected_rows += [(1, kl), (1, main), (1, kl), (1, main)]
    assert [shape for shape, _, _ in calls] == expected_rows
    assert all(mask is None and int((pos == 0).sum()) == BATCH for _, mask, pos in calls)
    # TRL's padded batches do carry padding (the packed rows are shorter)
    padded = trl.data_collator([trl.train_dataset[i] for i in range(BATCH)])
    assert padded["input_ids"].numel() > expected_rows[1][1]


def _unbounded(monkeypatch):
    """Control: every packed row as one sequence (later sequences attend to earlier ones)."""
    from pf_trl.trainer.packed import pack_padded
    from pf_trl.trainer.preference import self_packed_forward

    def one_sequence(mask, ids=None):
        row = pack_padded(mask, ids)
        n = row.num_tokens
        return dataclasses.replace(row, cu_seq_lens=torch.tensor([0, n], dtype=torch.int32),
                                   position_ids=torch.arange(n)[None], lengths=(n,))

    monkeypatch.setattr(self_packed_forward, "pack_padded", one_sequence)


@pytest.mark.slow
def test_step_and_precompute_equal_trl_and_control_fails(runs, monkeypatch):
    trl, pf, _, _ = runs
    pf.model.load_state_dict(trl.model.state_dict())  # the same weights (the runs agree only to rounding)
    expected, got = S.one_step(trl, range(BATCH)), S.one_step(pf, range(BATCH))
    assert expected[1]["kl"] > 0.5
    assert_same_math(expected[0], got[0], what="loss", rtol=RTOL)
    assert_same_metrics(expected[1], got[1], "metrics")
    assert_same_math(expected[2], got[2], what="gradients", rtol=S.GRAD_RTOL)
    # TRL's reference precompute of one batch (its precompute_ref_log_probs loop), packed
    batch = trl.data_collator([trl.train_dataset[i] for i in range(BATCH)])
    calls: list = []
    _record_backbone(pf, calls)
    ref_trl = trl.compute_ref_log_probs(trl.ref_model, batch)
    ref_pf = pf.compute_ref_log_probs(pf.ref_model, batch)
    assert [shape[0] for shape, _, _ in calls] == [1, 1] and all(mask is None for _, mask, _ in calls)
    assert_same_math(ref_trl, ref_pf, what="reference log-probs", rtol=RTOL)

    # apo_zero_unpaired (no KL pass): TRL reads the loss type at every step, so both trainers switch
    for t in (trl, pf):
        monkeypatch.setattr(t, "loss_type", "apo_zero_unpaired")
        monkeypatch.setattr(t, "calculate_KL", False)
    apo = S.one_step(trl, range(BATCH))
    apo_pf = S.one_step(pf, range(BATCH))
    assert_same_math(apo[0], apo_pf[0], what="apo_zero_unpaired loss", rtol=RTOL)
    assert_same_metrics(apo[1], apo_pf[1], "apo_zero_unpaired metrics")
    assert_other_math(expected[0], apo[0], what="the loss types differ", rtol=RTOL)
    monkeypatch.undo()

    _unbounded(monkeypatch)
    wrong = S.one_step(pf, range(BATCH))
    assert_other_math(expected[0], wrong[0], what="loss without sequence boundaries", rtol=RTOL)
    assert_other_math(expected[1]["logps/chosen"], wrong[1]["logps/chosen"], what="logps without boundaries",
                      rtol=RTOL)
    assert_other_math(ref_trl, pf.compute_ref_log_probs(pf.ref_model, batch), what="reference without boundaries",
                      rtol=RTOL)


@pytest.mark.slow
def test_sync_ref_model_training_equals_trl(runs, tmp_path):
    """``sync_ref_model``: TRL's callback mixes the policy into the reference model after each step (here alpha 0.5,
    every step); the packed reference forwards read the mixed weights, so the second step's KL and rewards are TRL's.
    Control: the same step without the update (the ``runs`` fixture) logs another KL."""
    from trl import KTOTrainer

    from pf_trl.trainer.preference import PaddingFreeKTOTrainer

    kw = dict(max_steps=2, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    expected, got = (_trained_logs(build(cls, tmp_path, **kw)) for cls in (KTOTrainer, PaddingFreeKTOTrainer))
    keys = {k for h in expected for k in h}
    for step, (mine, theirs) in enumerate(zip(expected, got, strict=True)):
        assert_same_metrics(mine, {k: v for k, v in theirs.items() if k in keys}, f"log {step}")
    unsynced = runs[2][0]
    assert_same_metrics(unsynced[0], expected[0], "first step (the reference is updated after it)")
    assert_other_math(unsynced[1]["kl"], expected[1]["kl"], what="second step's kl without the update", rtol=RTOL)


def test_budgets_and_unsupported_inputs_refused(tmp_path):
    from pf_trl.errors import ConfigError
    from pf_trl.trainer.preference import PaddingFreeKTOConfig, PaddingFreeKTOTrainer

    with pytest.raises(ConfigError, match="max_tokens_per_batch=256 would change KTO's KL term: loss_type='kto'"):
        PaddingFreeKTOConfig(**S.fields(tmp_path), max_tokens_per_batch=256)
    with pytest.raises(ConfigError, match="loss_type='apo_zero_unpaired' has no KL term, but its loss"):
        PaddingFreeKTOConfig(**S.fields(tmp_path), max_tokens_per_batch=256, loss_type="apo_zero_unpaired")
    with pytest.raises(ConfigError, match="padding_free_mode"):
        PaddingFreeKTOConfig(**S.fields(tmp_path), padding_free_mode="none")
    args = PaddingFreeKTOConfig(**S.fields(tmp_path))
    with pytest.raises(ConfigError, match="pass no data_collator"):
        PaddingFreeKTOTrainer(S.model(), args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                              data_collator=lambda x: x)
    rows = [dict(r, images=[]) for r in ROWS]
    with pytest.raises(ConfigError, match="vision datasets are refused"):
        PaddingFreeKTOTrainer(S.model(), args=args, train_dataset=datasets.Dataset.from_list(rows))
    from peft import PrefixTuningConfig

    with pytest.raises(ConfigError, match=r"^PrefixTuningConfig \(prompt learning\) .* use LoRA"):
        PaddingFreeKTOTrainer(S.model(), args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                              peft_config=PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
