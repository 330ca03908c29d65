"""PaddingFreeDPOTrainer against TRL's DPOTrainer (float32, CPU): loss, every metric and the gradients of a step,
every loss type, training through gradient accumulation and evaluation, LoRA, TRL's reference-model options and token
budgets; each claim beside a negative control that must fail the same check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests import dpo_support as S

pytestmark = pytest.mark.filterwarnings("ignore")

ROWS = S.pairs(6)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    tmp = tmp_path_factory.mktemp("dpo")
    return (S.trainer(DPOTrainer, ROWS, tmp, per_device_train_batch_size=4),
            S.trainer(PaddingFreeDPOTrainer, ROWS, tmp, per_device_train_batch_size=4))


def test_packed_row_has_no_padding(llama_pair):
    _, pf = llama_pair
    batch = pf.data_collator([pf.train_dataset[i] for i in range(4)])
    row = batch["pf_packed_row"]
    assert row.input_ids.shape == (1, int(batch["attention_mask"].sum()))  # real tokens only
    assert pf._pf_batch_pairs(batch) == 4 and row.cu_seq_lens.numel() == 9  # 8 sequences: 4 chosen, 4 rejected
    assert int((row.position_ids == 0).sum()) == 8
    assert pf.pf_head_check is not None and pf.pf_head_check < 1e-5  # pf-trl's head was checked against TRL's


def test_step_equals_trl_and_controls_fail(llama_pair):
    from dataclasses import replace

    trl, pf = llama_pair
    ref = S.one_step(trl, [0, 1, 2, 3])
    assert S.differences(ref, S.one_step(pf, [0, 1, 2, 3])) == []

    def see_each_other(batch):  # one position run over the whole row: the packed sequences attend to each other
        row = batch["pf_packed_row"]
        total = row.num_tokens
        batch["pf_packed_row"] = replace(row, position_ids=torch.arange(total).unsqueeze(0),
                                         cu_seq_lens=torch.tensor([0, total], dtype=torch.int32), lengths=(total,))

    assert S.differences(ref, S.one_step(pf, [0, 1, 2, 3], mutate=see_each_other))

    def split_pair(batch):  # pair 0's rejected scored as pair 1's: the pairs' sequences no longer line up
        row = batch["pf_packed_row"]
        width = batch["input_ids"].shape[1] - 1
        dst = row.shift_dst.clone()
        a, b = (dst // width == 4), (dst // width == 5)
        dst[a] += width
        dst[b] -= width
        batch["pf_packed_row"] = replace(row, shift_dst=dst)

    assert S.differences(ref, S.one_step(pf, [0, 1, 2, 3], mutate=split_pair))


def _head_rows(t, indices) -> int:
    """Positions projected through the ``[vocab, hidden]`` head in one forward step (policy and reference)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        S.one_step(t, indices, backward=False)
    head = [S.TINY["hidden_size"], 32000]
    return sum(e.input_shapes[0][0] for e in prof.events()
               if e.name in ("aten::mm", "aten::addmm") and len(e.input_shapes) > 1 and head in e.input_shapes[:3])


def test_only_completion_tokens_reach_the_head(llama_pair):
    from pf_trl.trainer.adapters import transformers_model
    from pf_trl.trainer.dpo_forward import install_packed_preference_forward

    trl, pf = llama_pair
    batch = pf.data_collator([pf.train_dataset[i] for i in range(4)])
    scored = int(batch["completion_mask"][:, 1:].sum())
    assert 0 < scored < int(batch["attention_mask"].sum()) - 8  # prompts hold tokens the head must not see
    assert _head_rows(pf, range(4)) == 2 * scored  # pf-trl's CPU head, policy and reference
    try:  # TRL's own head on the narrowed hidden states
        install_packed_preference_forward(transformers_model(pf.model), pf._pf_policy_fields(), head="trl")
        install_packed_preference_forward(pf.ref_model, ("log_probs",), head="trl")
        assert _head_rows(pf, range(4)) == 2 * scored
        assert S.differences(S.one_step(trl, [0, 1, 2, 3]), S.one_step(pf, [0, 1, 2, 3])) == []
    finally:
        install_packed_preference_forward(transformers_model(pf.model), pf._pf_policy_fields())
        install_packed_preference_forward(pf.ref_model, ("log_probs",))
    # control: TRL's padded run projects every position of its [2n, L] batch, padding and prompts included
    assert _head_rows(trl, range(4)) == 2 * batch["input_ids"].shape[0] * (batch["input_ids"].shape[1] - 1)


LOSSES = ["hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero",
          "apo_down", "discopop", "sft", "sigmoid_norm"]


@pytest.mark.slow
def test_every_loss_type_and_option_equals_trl(llama_pair):
    trl, pf = llama_pair
    cases = [dict(loss_types=[t], loss_weights=[1.0]) for t in LOSSES]
    cases += [dict(loss_types=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),  # RPO: DPO + NLL of the chosen
              dict(ld_alpha=0.5), dict(f_divergence_type="js_divergence"),
              dict(beta=0.5, label_smoothing=0.2, loss_types=["robust"], loss_weights=[1.0])]
    failed = []
    for case in cases:
        saved = {k: getattr(trl, k) for k in case}
        for t in (trl, pf):
            for key, value in case.items():
                setattr(t, key, value)
            if "label_smoothing" not in case:
                t.label_smoothing = 0.1  # exo_pair needs it; harmless for the others
        try:  # loss, metrics and every gradient equal TRL's; TRL's own loss code on pf-trl's per-token values
            bad = S.differences(S.one_step(trl, [2, 3, 4, 5]), S.one_step(pf, [2, 3, 4, 5]))
        finally:
            for t in (trl, pf):
                for key, value in saved.items():
                    setattr(t, key, value)
                t.label_smoothing = 0.0
        if bad:
            failed.append((case, bad[:3]))
    assert failed == []


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_step_equals_trl(arch, tmp_path):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    trl = S.trainer(DPOTrainer, ROWS, tmp_path, arch=arch, per_device_train_batch_size=3)
    pf = S.trainer(PaddingFreeDPOTrainer, ROWS, tmp_path, arch=arch, per_device_train_batch_size=3)
    assert S.differences(S.one_step(trl, [0, 1, 2]), S.one_step(pf, [0, 1, 2])) == []


def _logs(t) -> list[dict]:
    t.train()
    return S.logged(t.state.log_history)


_compare_logs = S.compare_logs


@pytest.mark.slow
def test_training_with_accumulation_and_eval_equals_trl(tmp_path):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, eval_strategy="steps",
              eval_steps=2, per_device_eval_batch_size=2, prediction_loss_only=True)
    evals = S.pairs(2, seed=7)
    a = _logs(S.trainer(DPOTrainer, S.pairs(8), tmp_path, eval_rows=evals, **kw))
    b = _logs(S.trainer(PaddingFreeDPOTrainer, S.pairs(8), tmp_path, eval_rows=evals, **kw))
    assert any("eval_loss" in h for h in a) and any("rewards/margins" in h for h in a)
    assert _compare_logs(a, b) == []
    # control: the comparison sees a small change of the run (the loss of test_step_equals_trl_and_controls_fail
    # sees packed sequences attending to each other)
    assert _compare_logs(a, [dict(h, loss=h["loss"] * (1 + 1e-3)) if "loss" in h else h for h in b])


@pytest.mark.slow
def test_lora_adapter_disabled_as_reference_equals_trl(tmp_path):
    from peft import LoraConfig
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trl = S.trainer(DPOTrainer, ROWS, tmp_path, ref=False, peft_config=LoraConfig(**lora),
                    per_device_train_batch_size=3)
    pf = S.trainer(PaddingFreeDPOTrainer, ROWS, tmp_path, ref=False, peft_config=LoraConfig(**lora),
                   per_device_train_batch_size=3)
    assert pf.ref_model is None
    # one update first, so that the adapter is not zero and the reference (adapter disabled) differs from the policy
    for t in (trl, pf):
        with torch.no_grad():
            for name, p in t.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.05)
    a, b = S.one_step(trl, [0, 1, 2]), S.one_step(pf, [0, 1, 2])
    assert a[2] and all("lora_" in n for n in a[2])
    assert abs(a[1]["rewards/margins"]) > 1e-4  # the reference is not the policy
    assert S.differences(a, b) == []


@pytest.mark.slow
def test_default_reference_and_precomputed_reference_equal_trl(tmp_path):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    folder = tmp_path / "model"
    S.model().save_pretrained(folder)
    from pf_trl.data.tokenizer import load_tokenizer

    load_tokenizer().save_pretrained(folder)
    kw = dict(per_device_train_batch_size=3, max_steps=1)
    for extra in ({}, {"precompute_ref_log_probs": True}):
        a = _logs(S.trainer(DPOTrainer, ROWS, tmp_path, ref=False, model_obj=str(folder), **kw, **extra))
        pf = S.trainer(PaddingFreeDPOTrainer, ROWS, tmp_path, ref=False, model_obj=str(folder), **kw, **extra)
        assert (pf.ref_model is None) == bool(extra)
        assert _compare_logs(a, _logs(pf)) == []


def _step_gradient(t) -> dict[str, torch.Tensor]:
    from transformers import TrainerCallback

    grads = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not grads:
                grads.update({n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None})

    t.add_callback(Capture())
    t.train()
    return grads


def test_token_budget_step_gradient_is_the_mean_over_its_pairs(tmp_path):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    rows = S.pairs(7, seed=3)
    common = dict(max_steps=1, max_grad_norm=1e9, learning_rate=0.0)
    whole = _step_gradient(S.trainer(DPOTrainer, rows, tmp_path, per_device_train_batch_size=7, **common))
    pf = S.trainer(PaddingFreeDPOTrainer, rows, tmp_path, max_tokens_per_batch=160, per_device_train_batch_size=1,
                   **common)
    longest = int(pf._pf_pair_lengths(pf.train_dataset).max())
    for budget_tokens in (longest, int(1.3 * longest), int(1.7 * longest), 2 * longest, 3 * longest):
        pf.pf_token_budget = budget_tokens
        counts = [pf._pf_batch_pairs(b) for b in pf.get_train_dataloader()]
        if len(set(counts)) > 1:
            break
    assert sum(counts) == 7 and len(set(counts)) > 1  # whole pairs, an uneven number per micro-batch
    pf.args.gradient_accumulation_steps = len(counts)  # one optimizer step over every pair
    budget = _step_gradient(pf)
    worst = max(float((whole[n] - budget[n]).abs().max()) / float(whole[n].abs().max()) for n in whole)
    assert worst < S.GRAD_RTOL
    # control: TRL's normalisation (each micro-batch's mean, divided by the accumulation steps) is not the pair mean
    # (the same trainer trained again: learning rate 0 left its weights as they were)
    pf.loss_is_scaled_for_ga = False
    pf._get_num_items_in_batch = lambda batch_samples, device: None
    unweighted = _step_gradient(pf)
    assert max(float((whole[n] - unweighted[n]).abs().max()) / float(whole[n].abs().max()) for n in whole) > 1e-3


def test_refusals_name_the_problem(tmp_path):
    from peft import PrefixTuningConfig
    from trl import DPOConfig

    from pf_trl.errors import ConfigError
    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    with pytest.raises(ConfigError, match="aot.*token budget"):
        PaddingFreeDPOConfig(**S.fields(tmp_path), max_tokens_per_batch=100, loss_type=["aot"])
    with pytest.raises(ConfigError, match="padding_free_mode"):
        PaddingFreeDPOConfig(**S.fields(tmp_path), padding_free_mode="none")
    args = DPOConfig(**S.fields(tmp_path))
    with pytest.raises(ConfigError, match="prompt learning"):
        PaddingFreeDPOTrainer(S.model(), args=args, train_dataset=_dataset(), peft_config=PrefixTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match="vision"):
        PaddingFreeDPOTrainer(S.model(), args=args, train_dataset=_dataset(image=True))
    with pytest.raises(ConfigError, match="data_collator"):
        PaddingFreeDPOTrainer(S.model(), args=args, train_dataset=_dataset(), data_collator=lambda x: x)
    budgeted = PaddingFreeDPOConfig(**S.fields(tmp_path), max_tokens_per_batch=40)
    with pytest.raises(ConfigError, match="IterableDataset does not have"):
        PaddingFreeDPOTrainer(S.model(), args=budgeted, train_dataset=_dataset().to_iterable_dataset())


def test_over_budget_pairs_are_refused_after_tokenization_before_the_reference_precompute(tmp_path, monkeypatch):
    from trl import DPOTrainer

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.errors import ConfigError
    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    def precompute(*args, **kwargs):
        raise AssertionError("the reference log-probs were precomputed before the refusal")

    monkeypatch.setattr(DPOTrainer, "_precompute_ref_logps", precompute)
    args = PaddingFreeDPOConfig(**S.fields(tmp_path), max_tokens_per_batch=30, precompute_ref_log_probs=True)
    with pytest.raises(ConfigError, match=r"pair\(s\) of the train dataset .* set max_length <= 15 "):
        PaddingFreeDPOTrainer(S.model(), args=args, train_dataset=_dataset(), processing_class=load_tokenizer())
    # control: max_length <= budget / 2 (TRL's truncation) makes every pair fit: the refusal is gone
    args = PaddingFreeDPOConfig(**S.fields(tmp_path), max_tokens_per_batch=30, max_length=15,
                                precompute_ref_log_probs=True)
    with pytest.raises(AssertionError, match="precomputed"):
        PaddingFreeDPOTrainer(S.model(), args=args, train_dataset=_dataset(), processing_class=load_tokenizer())


def _dataset(image: bool = False):
    import datasets

    rows = S.pairs(2)
    if image:
        rows = [dict(r, images=[]) for r in rows]
    return datasets.Dataset.from_list(rows)


@pytest.mark.slow
def test_weighted_preference_optimization_equals_trl(tmp_path):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    trl = S.trainer(DPOTrainer, ROWS, tmp_path, per_device_train_batch_size=3, use_weighting=True)
    pf = S.trainer(PaddingFreeDPOTrainer, ROWS, tmp_path, per_device_train_batch_size=3, use_weighting=True)
    ref = S.one_step(trl, [0, 1, 2])
    assert S.differences(ref, S.one_step(pf, [0, 1, 2])) == []
    # control: without the WPO weights (log_sum_sq_probs) the loss differs
    pf.use_weighting = False
    assert S.differences(ref, S.one_step(pf, [0, 1, 2]))


def _budget_trainer(tmp_path, **kw):
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    return S.trainer(PaddingFreeDPOTrainer, S.pairs(9, seed=3), tmp_path, max_tokens_per_batch=200,
                     per_device_train_batch_size=1, **kw)


@pytest.mark.slow
def test_token_budget_resume_equals_the_uninterrupted_run(tmp_path):
    from pf_trl.errors import ResumeError

    kw = dict(max_steps=1, save_strategy="steps", save_steps=1, save_only_model=False)
    whole = _budget_trainer(tmp_path / "whole", **kw)
    per_epoch = len(whole.get_train_dataloader())
    assert per_epoch >= 2
    # a checkpoint one step into the second epoch, two steps after it (the second into the third epoch when an epoch
    # has two micro-batches): the restored epoch, the skipped batches and the next epoch's shuffle all count
    saved, steps = per_epoch + 1, per_epoch + 3
    kw.update(max_steps=steps, save_steps=saved)
    whole.args.max_steps, whole.args.save_steps = steps, saved
    whole.train()
    losses = [h["loss"] for h in whole.state.log_history if "loss" in h]
    assert len(losses) == steps
    checkpoint = str(tmp_path / "whole" / "PaddingFreeDPOTrainer" / f"checkpoint-{saved}")

    def resumed_losses(**extra) -> list[float]:
        t = _budget_trainer(tmp_path / "resumed", **kw, **extra)
        t.train(resume_from_checkpoint=checkpoint)
        return [h["loss"] for h in t.state.log_history if "loss" in h and h["step"] > saved]

    np.testing.assert_allclose(resumed_losses(), losses[saved:], rtol=1e-5, atol=1e-6)
    # control: resumed without skipping the epoch's consumed batches, the next steps train on other pairs
    assert not np.allclose(resumed_losses(ignore_data_skip=True), losses[saved:], rtol=1e-5, atol=1e-6)
    # the checkpoint's sampler state is read on resume (restore_sampler): another accumulation is refused
    with pytest.raises(ResumeError, match="gradient_accumulation_steps=1, now 2"):
        resumed_losses(gradient_accumulation_steps=2)
    # ... and so it is when Trainer finds the checkpoint itself (resume_from_checkpoint=True: the last one)
    with pytest.raises(ResumeError, match=r"cannot resume from .*/checkpoint-\d+: .*now 2"):
        _budget_trainer(tmp_path / "whole", **kw, gradient_accumulation_steps=2).train(resume_from_checkpoint=True)
    # "auto" (a restarted Job): the latest checkpoint its completion marker commits, resumed exactly; the final
    # checkpoint's marker removed (its save cut short), so that is the one of step `saved`
    marker = "pf_trl_checkpoint_complete.json"
    final = tmp_path / "whole" / "PaddingFreeDPOTrainer" / f"checkpoint-{steps}"
    (final / marker).unlink()
    auto = _budget_trainer(tmp_path / "whole", **kw)
    auto.train(resume_from_checkpoint="auto")
    np.testing.assert_allclose([h["loss"] for h in auto.state.log_history if "loss" in h and h["step"] > saved],
                               losses[saved:], rtol=1e-5, atol=1e-6)
    # control: no checkpoint with its marker: "auto" starts from step 0
    for folder in (Path(checkpoint), final):
        (folder / marker).unlink()
    fresh = _budget_trainer(tmp_path / "whole", **{**kw, "max_steps": 1})
    fresh.train(resume_from_checkpoint="auto")
    assert [h["step"] for h in fresh.state.log_history if "loss" in h] == [1]


@pytest.mark.slow
def test_eval_under_a_token_budget_gives_trls_eval_metrics(tmp_path):
    from trl import DPOTrainer

    evals = S.pairs(5, seed=11)
    kw = dict(per_device_eval_batch_size=2, prediction_loss_only=True, max_steps=1)
    pf = _budget_trainer(tmp_path, eval_rows=evals, **kw)
    pf.train()  # one budget step first: its loss weighting and packed batches must not reach evaluation
    trl = S.trainer(DPOTrainer, ROWS, tmp_path, eval_rows=evals, **kw)
    before = trl.evaluate()
    trl.model.load_state_dict(pf.model.state_dict())
    expected, got = trl.evaluate(), pf.evaluate()
    assert {"eval_loss", "eval_rewards/margins", "eval_logps/chosen"} <= set(expected)
    assert _compare_logs(S.logged([expected]), [got]) == []
    # control: TRL's metrics of the weights before that step differ
    assert _compare_logs(S.logged([before]), [got])


@pytest.mark.slow
def test_truncation_through_the_trainer_equals_trl(tmp_path):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    rows = S.pairs(4, seed=2, long=30)
    kw = dict(per_device_train_batch_size=4, max_length=14, truncation_mode="keep_end")  # keep_start: the control
    trl, pf = S.trainer(DPOTrainer, rows, tmp_path, **kw), S.trainer(PaddingFreeDPOTrainer, rows, tmp_path, **kw)
    batch = pf.data_collator([pf.train_dataset[i] for i in range(4)])
    assert batch["pf_packed_row"].max_length == 14  # some sequence was cut to max_length
    expected = S.one_step(trl, range(4))
    assert S.differences(expected, S.one_step(pf, range(4))) == []
    # control: the other truncation mode (TRL's default, in the collator the config built) scores other tokens
    pf.data_collator.inner.truncation_mode = "keep_start"
    assert S.differences(expected, S.one_step(pf, range(4)))


@pytest.mark.slow
def test_sync_ref_model_training_equals_trl(tmp_path):
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    kw = dict(per_device_train_batch_size=2, max_steps=2, sync_ref_model=True, ref_model_sync_steps=1,
              ref_model_mixup_alpha=0.5)
    a = _logs(S.trainer(DPOTrainer, S.pairs(6), tmp_path, **kw))
    b = _logs(S.trainer(PaddingFreeDPOTrainer, S.pairs(6), tmp_path, **kw))
    assert _compare_logs(a, b) == []
    # control: without the reference updates the later steps' rewards differ
    c = _logs(S.trainer(DPOTrainer, S.pairs(6), tmp_path / "nosync", **dict(kw, sync_ref_model=False)))
    assert _compare_logs(a, c)
