"""PaddingFreeRewardTrainer against TRL's RewardTrainer (float32, CPU, a tiny LlamaForSequenceClassification, the
shipped tokenizer: no pad token, so TRL pads with EOS and transformers pools the last token that is not EOS): loss,
every metric and the gradients of a step, training and evaluation logs, token budgets; each claim beside a negative
control that fails the same check. Tolerances: tests/dpo_support.py's (float32 rounding of a 2-layer model)."""

from __future__ import annotations

import datasets
import pytest
import torch

from tests import dpo_support as S

pytestmark = pytest.mark.filterwarnings("ignore")

ROWS = [dict(r, margin=0.1 * i) for i, r in enumerate(S.pairs(6, seed=5))]
PF_KEYS = {"max_tokens_per_batch", "padding_free_mode", "attention_backend"}


def reward_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32000, num_labels=1, max_position_embeddings=512, **S.TINY)
    config._attn_implementation = "sdpa"
    return LlamaForSequenceClassification(config).float()


def build(cls, rows, tmp_path, *, eval_rows=None, model=None, peft_config=None, **kw):
    from trl import RewardConfig

    from pf_trl.trainer.preference.reward_config import PaddingFreeRewardConfig

    config_cls = PaddingFreeRewardConfig if PF_KEYS & set(kw) else RewardConfig
    args = config_cls(**S.fields(tmp_path / cls.__name__, **kw))
    return cls(model if model is not None else reward_model(), args=args,
               train_dataset=datasets.Dataset.from_list(rows),
               eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
               processing_class=S.tokenizer(), peft_config=peft_config)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from trl import RewardTrainer

    from pf_trl.trainer.preference import PaddingFreeRewardTrainer

    tmp = tmp_path_factory.mktemp("reward")
    kw = dict(per_device_train_batch_size=4, center_rewards_coefficient=0.05)
    return build(RewardTrainer, ROWS, tmp, **kw), build(PaddingFreeRewardTrainer, ROWS, tmp, **kw)


def test_step_equals_trl_and_controls_fail(pair, monkeypatch):
    from pf_trl.trainer.packed import PackedRow
    from pf_trl.trainer.preference.collate import PACKED_ROW_KEY

    trl, pf = pair
    batch = pf.data_collator([pf.train_dataset[i] for i in range(4)])
    row = batch[PACKED_ROW_KEY]
    assert row.num_tokens == int(batch["attention_mask"].sum()) < batch["input_ids"].numel()  # no padding
    assert pf.processing_class.pad_token_id == pf.processing_class.eos_token_id  # TRL's fallback: pad = EOS
    expected = S.one_step(trl, range(4))
    got = S.one_step(pf, range(4))
    assert {"accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"} <= set(got[1])
    assert S.differences(expected, got) == []
    # control: pooling each sequence's last token (its EOS, transformers' pad here) is not what the padded run scores
    plain = PackedRow.last_index
    monkeypatch.setattr(PackedRow, "last_index", lambda self, ids=None, pad=None: plain(self))
    assert S.differences(expected, S.one_step(pf, range(4)))
    monkeypatch.undo()

    # control: the row without its sequence boundaries (later sequences see earlier ones)
    def unbounded(mutate_batch):
        r = mutate_batch[PACKED_ROW_KEY]
        whole = torch.tensor([0, r.num_tokens], dtype=torch.int32)
        mutate_batch[PACKED_ROW_KEY] = PackedRow(r.input_ids, torch.arange(r.num_tokens)[None], whole, r.lengths,
                                                 r.offsets, r.token_index, r.shift_src, r.shift_dst, r.shape)
        positions = plain(r, mutate_batch["input_ids"], pf.processing_class.pad_token_id)
        monkeypatch.setattr(PackedRow, "last_index", lambda self, ids=None, pad=None: positions)

    assert S.differences(expected, S.one_step(pf, range(4), mutate=unbounded))


@pytest.mark.slow
def test_training_and_evaluation_logs_equal_trl(tmp_path):
    from trl import RewardTrainer

    from pf_trl.trainer.preference import PaddingFreeRewardTrainer

    evals = S.pairs(3, seed=9)
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, eval_strategy="steps",
              eval_steps=1, per_device_eval_batch_size=2, center_rewards_coefficient=0.05)
    logs = []
    for cls in (RewardTrainer, PaddingFreeRewardTrainer):
        t = build(cls, ROWS, tmp_path, eval_rows=evals, **kw)
        t.train()
        logs.append([{k: v for k, v in h.items() if not k.endswith(("runtime", "per_second"))
                      and not k.startswith(("train_", "eval_real", "eval_processed", "eval_supervised"))}
                     for h in t.state.log_history])
    keys = {k for h in logs[0] for k in h}
    assert {"loss", "grad_norm", "accuracy", "margin", "mean_reward", "eval_loss", "eval_accuracy"} <= keys
    assert S.compare_logs(logs[0], logs[1]) == []


@pytest.mark.slow
def test_token_budget_step_gradient_is_the_mean_over_its_pairs(tmp_path):
    from trl import RewardTrainer

    from pf_trl.trainer.preference import PaddingFreeRewardTrainer
    from tests.test_dpo_trainer import _step_gradient

    rows = S.pairs(7, seed=3)
    common = dict(max_steps=1, max_grad_norm=1e9, learning_rate=0.0, center_rewards_coefficient=0.05)
    whole = _step_gradient(build(RewardTrainer, rows, tmp_path, per_device_train_batch_size=7, **common))

    t = build(PaddingFreeRewardTrainer, rows, tmp_path, max_tokens_per_batch=200, per_device_train_batch_size=1,
              **common)
    longest = int(t._pf_pair_lengths(t.train_dataset).max())
    for tokens in (longest, int(1.3 * longest), int(1.7 * longest), 2 * longest):
        t.pf_token_budget = tokens
        counts = [t._pf_batch_pairs(b) for b in t.get_train_dataloader()]
        if len(set(counts)) > 1:
            break
    assert sum(counts) == 7 and len(set(counts)) > 1  # whole pairs, an uneven number per micro-batch
    t.args.gradient_accumulation_steps = len(counts)

    def worst(g):
        return max(float((whole[n] - g[n]).abs().max()) / float(whole[n].abs().max()) for n in whole)

    assert worst(_step_gradient(t)) < S.GRAD_RTOL
    # control: each micro-batch's plain mean, divided by the accumulation steps (the same trainer trained again:
    # learning rate 0 left its weights as they were)
    t.loss_is_scaled_for_ga = False
    t._get_num_items_in_batch = lambda batch_samples, device: None
    assert worst(_step_gradient(t)) > 1e-3


def test_refusals_name_the_problem(tmp_path):
    from pf_trl.errors import ConfigError
    from pf_trl.trainer.preference import PaddingFreeRewardConfig, PaddingFreeRewardTrainer

    with pytest.raises(ConfigError, match="IterableDataset does not have"):
        PaddingFreeRewardTrainer(reward_model(), args=PaddingFreeRewardConfig(**S.fields(tmp_path),
                                                                               max_tokens_per_batch=64),
                                 train_dataset=datasets.Dataset.from_list(ROWS).to_iterable_dataset())
    with pytest.raises(ConfigError, match=r"pair\(s\) of the train dataset .*set max_length <= 10 "):
        build(PaddingFreeRewardTrainer, ROWS, tmp_path, max_tokens_per_batch=20)
    with pytest.raises(ConfigError, match="data_collator"):
        PaddingFreeRewardTrainer(reward_model(), args=PaddingFreeRewardConfig(**S.fields(tmp_path)),
                                 train_dataset=datasets.Dataset.from_list(ROWS), data_collator=lambda x: x)
    with pytest.raises(ConfigError, match="padding_free_mode"):
        PaddingFreeRewardConfig(**S.fields(tmp_path), padding_free_mode="none")


def test_prompt_learning_peft_refused_as_config_or_model(tmp_path):
    """Prompt tuning prepends virtual tokens to each sequence of the padded batch: refused as TRL's ``peft_config``
    and as a ``PeftModel`` passed in (which reached the packed forward and failed there, a raw KeyError)."""
    peft = pytest.importorskip("peft")
    from pf_trl.errors import ConfigError
    from pf_trl.trainer.adapters import refuse_prompt_learning
    from pf_trl.trainer.preference import PaddingFreeRewardTrainer

    def prompt_tuning():
        return peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=2)

    with pytest.raises(ConfigError, match=r"^PromptTuningConfig \(prompt learning\) .* use LoRA"):
        build(PaddingFreeRewardTrainer, ROWS, tmp_path, peft_config=prompt_tuning())
    with pytest.raises(ConfigError, match=r"^PromptTuningConfig \(prompt learning\) .* use LoRA"):
        build(PaddingFreeRewardTrainer, ROWS, tmp_path, model=peft.get_peft_model(reward_model(), prompt_tuning()))
    # control: the same check takes a LoRA PeftModel (test_lora_reward_model_trains_as_trl trains one)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS")
    assert refuse_prompt_learning(peft.get_peft_model(reward_model(), lora), None) is None


@pytest.mark.slow
def test_lora_reward_model_trains_as_trl(tmp_path):
    """TRL's ``peft_config`` (LoRA on the attention, the score head a trained copy: PEFT's ``SEQ_CLS`` task): two steps
    of TRL's RewardTrainer and of PaddingFreeRewardTrainer log the same loss and metrics and end with the same adapter
    weights; control: the packed step with the adapters disabled is not TRL's step."""
    peft = pytest.importorskip("peft")
    from trl import RewardTrainer

    from pf_trl.trainer.preference import PaddingFreeRewardTrainer

    def lora():  # random B (not zero): the adapters change the rewards from the first step
        return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                               init_lora_weights=False, task_type="SEQ_CLS")

    kw = dict(per_device_train_batch_size=3, max_steps=2, learning_rate=1e-2, center_rewards_coefficient=0.05)
    runs = []
    for cls in (RewardTrainer, PaddingFreeRewardTrainer):
        t = build(cls, ROWS, tmp_path, peft_config=lora(), **kw)
        assert isinstance(t.model, peft.PeftModel)
        start = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
        t.train()
        trained = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
        runs.append((t, start, trained, [{k: v for k, v in h.items() if not k.endswith(("runtime", "per_second"))
                                          and not k.startswith("train_")} for h in t.state.log_history]))
    (trl, trl_start, trl_w, trl_logs), (pf, pf_start, pf_w, pf_logs) = runs
    assert any("lora_A" in n for n in trl_w) and any("score" in n for n in trl_w)  # adapters and the head's copy
    torch.testing.assert_close(pf_start, trl_start, rtol=0, atol=0)  # the same adapters to start from
    keys = {k for h in trl_logs for k in h}
    assert {"loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward", "max_reward"} <= keys
    assert S.compare_logs(trl_logs, [{k: v for k, v in h.items() if k in keys} for h in pf_logs]) == []
    for name, value in trl_w.items():
        torch.testing.assert_close(pf_w[name], value, rtol=1e-4, atol=2e-6, msg=name)
    assert any(not torch.allclose(trl_start[n], trl_w[n]) for n in trl_w)  # training moved the adapters
    # control: the same packed step without the adapters (the base model alone) is not TRL's step
    expected = S.one_step(trl, range(3))
    shapes = []  # the backbone runs the packed row under PEFT's wrapper: [1, real tokens]
    backbone = pf.model.get_base_model().model
    hook = backbone.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)),
                                              with_kwargs=True)
    assert S.differences(expected, S.one_step(pf, range(3))) == []
    hook.remove()
    batch = pf.data_collator([pf.train_dataset[i] for i in range(3)])
    assert shapes == [(1, int(batch["attention_mask"].sum()))] and batch["input_ids"].numel() > shapes[0][1]
    with pf.model.disable_adapter():
        assert S.differences(expected, S.one_step(pf, range(3)))
