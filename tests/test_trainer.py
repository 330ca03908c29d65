"""PaddingFreeSFTTrainer: exact loss vs padded (GA 1 and 2), weights after a step, eval, resume, metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def tiny_model(seed=0):
    from pf_trl.models import build_model

    return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=seed, **TINY)


@pytest.fixture(scope="module")
def small_ds(sample_shards):
    from pf_trl.data.shards import load_shards

    ds = load_shards(sample_shards)
    lengths = np.asarray(ds["length"])
    keep = np.nonzero(lengths <= 200)[0][:48]
    return ds.select(keep.tolist()).flatten_indices()


def config(tmp_path, **kw):
    from pf_trl.trainer import PaddingFreeConfig

    base = dict(output_dir=str(tmp_path / "out"), report_to=[], save_strategy="no", logging_steps=1,
                disable_tqdm=True, learning_rate=1e-3, seed=0, per_device_train_batch_size=4,
                padding_free_mode="internal", max_length=None, use_cpu=True, dataloader_num_workers=0)
    base.update(kw)
    return PaddingFreeConfig(**base)


class _FixedBatches:
    """A batch sampler replaying given index lists (for the padded side of the equality tests)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self):
        return len(self.batches)


def _padded_trainer(model, args, ds, tokenizer, batches):
    from torch.utils.data import DataLoader
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from pf_trl.trainer import PaddingFreeSFTTrainer

    class Padded(PaddingFreeSFTTrainer):
        def get_train_dataloader(self):
            collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id or 0)
            cols = self.train_dataset.select_columns(["input_ids", "labels"])
            return DataLoader(cols, batch_sampler=_FixedBatches(batches), collate_fn=collator)

    args.padding_free, args.padding_free_mode = False, "none"  # TRL's padded path
    return Padded(model, args=args, train_dataset=ds, processing_class=tokenizer)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
@pytest.mark.parametrize("ga", [1, 2])
def test_loss_and_weights_equal_padded(tmp_path, small_ds, tokenizer, ga):
    from pf_trl.trainer import PaddingFreeSFTTrainer

    ds = small_ds.select(range(24))
    pf = PaddingFreeSFTTrainer(tiny_model(), args=config(tmp_path / "pf", gradient_accumulation_steps=ga, max_steps=2),
                               train_dataset=ds, processing_class=tokenizer)
    assert getattr(pf.model, "_pf_padding_free", None), "enable_padding_free was not applied"
    pf.train()
    batches = list(pf._pf_train_sampler)[: 2 * ga]  # the micro-batches pf-trl trained on, in order
    pad = _padded_trainer(tiny_model(), config(tmp_path / "pad", gradient_accumulation_steps=ga, max_steps=2), ds,
                          tokenizer, batches)
    pad.train()
    np.testing.assert_allclose(_losses(pf), _losses(pad), rtol=2e-5, atol=2e-5)
    pf_params = dict(pf.model.named_parameters())
    for name, p in pad.model.named_parameters():
        torch.testing.assert_close(pf_params[name].detach(), p.detach(), rtol=1e-4, atol=2e-5, msg=name)
    # the padded run paid for padding, pf-trl did not; both saw the same real tokens
    fm, pm = pf.state.log_history[-1], pad.state.log_history[-1]
    assert fm["train_real_tokens"] == pm["train_real_tokens"] == sum(len(ds[i]["input_ids"]) for b in batches for i in b)
    assert fm["train_padding_share"] == 0.0 and pm["train_padding_share"] > 0.0


@pytest.mark.slow
def test_metrics_count_every_real_token(tmp_path, small_ds, tokenizer):
    from pf_trl.trainer import PaddingFreeSFTTrainer

    ds = small_ds.select(range(20))
    tr = PaddingFreeSFTTrainer(tiny_model(), args=config(tmp_path, num_train_epochs=1, logging_steps=2),
                               train_dataset=ds, processing_class=tokenizer)
    m = tr.train().metrics
    lengths = np.asarray(ds["length"])
    assert m["train_real_tokens"] == int(lengths.sum()) == m["train_processed_tokens"]
    assert m["train_examples"] == 20
    sup = sum(int((np.asarray(ds[i]["labels"][1:]) != -100).sum()) for i in range(20))
    assert m["train_supervised_tokens"] == sup
    assert tr.pf_token_budget == max(int(lengths.max()), math.ceil(lengths.mean() * 4))
    assert m["train_tokens_per_step_max"] <= tr.pf_token_budget
    assert m["train_real_tokens_per_second"] == pytest.approx(m["train_real_tokens"] / m["train_runtime"], rel=1e-3)
    for key in ("train_mem_cpu_peak", "train_mem_cpu_peak_delta", "train_tflops", "train_supervised_tokens_per_second"):
        assert key in m
    step_logs = [h for h in tr.state.log_history if "loss" in h]
    assert step_logs and all("real_tokens_per_second" in h and h["padding_share"] == 0.0 for h in step_logs)


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [False, True])
def test_eval_loss_equals_padded_token_weighted(tmp_path, small_ds, tokenizer, use_cache):
    from pf_trl.trainer import PaddingFreeSFTTrainer

    ds = small_ds.select(range(24, 40))
    ref_model = tiny_model(seed=3)
    ref_model.config.use_cache = use_cache
    ref_model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in ds:  # one example at a time: the unambiguous reference
            ids = torch.tensor(row["input_ids"])[None]
            labels = torch.tensor(row["labels"])[None]
            logits = ref_model(input_ids=ids, use_cache=use_cache).logits.float()
            t = labels[:, 1:]
            total += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                             t.reshape(-1), ignore_index=-100, reduction="sum"))
            count += int((t != -100).sum())
    model = tiny_model(seed=3)
    model.config.use_cache = use_cache
    tr = PaddingFreeSFTTrainer(model, args=config(tmp_path / "pf", per_device_eval_batch_size=4), train_dataset=ds,
                               eval_dataset=ds, processing_class=tokenizer)
    ev = tr.evaluate()
    assert ev["eval_supervised_tokens"] == count
    assert ev["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    model2 = tiny_model(seed=3)
    model2.config.use_cache = use_cache
    pad = PaddingFreeSFTTrainer(model2, args=config(tmp_path / "pad", padding_free_mode="none", per_device_eval_batch_size=4),
                                train_dataset=ds, eval_dataset=ds, processing_class=tokenizer)
    ev_pad = pad.evaluate()
    assert ev_pad["eval_loss"] == pytest.approx(total / count, rel=1e-5)


class _Recording:
    def __init__(self):
        self.batches = []
        self.at_step = {}  # optimizer step -> micro-batches seen so far


def _recording_trainer(model, args, ds, tokenizer, rec):
    from pf_trl.trainer import PaddingFreeSFTTrainer

    class Rec(PaddingFreeSFTTrainer):
        def compute_loss(self, model, inputs, **kw):
            if self.model.training:
                rec.batches.append(inputs["input_ids"].reshape(-1).tolist())
            return super().compute_loss(model, inputs, **kw)

    from transformers import TrainerCallback

    class StepMark(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            rec.at_step[state.global_step] = len(rec.batches)

    return Rec(model, args=args, train_dataset=ds, processing_class=tokenizer, callbacks=[StepMark()])


@pytest.mark.slow
@pytest.mark.parametrize("ga", [1, 2])
def test_resume_continues_with_exactly_the_same_batches(tmp_path, small_ds, tokenizer, ga):
    ds = small_ds.select(range(16))
    kw = dict(max_steps=6, save_strategy="steps", save_steps=4, gradient_accumulation_steps=ga,
              per_device_train_batch_size=6)
    full = _Recording()
    a = _recording_trainer(tiny_model(), config(tmp_path / "a", **kw), ds, tokenizer, full)
    a.train()
    per_epoch = len(a._pf_train_sampler)
    assert per_epoch * 1 < 6 * ga, "the test must resume in a later epoch"
    resumed = _Recording()
    b = _recording_trainer(tiny_model(), config(tmp_path / "b", **kw), ds, tokenizer, resumed)
    ckpt = tmp_path / "a" / "out" / "checkpoint-4"
    assert (ckpt / "pf_trl_sampler_state.json").is_file()
    b.train(resume_from_checkpoint=str(ckpt))
    assert resumed.batches == full.batches[full.at_step[4] :]  # neither skipped twice nor replayed
    np.testing.assert_allclose(_losses(b)[-2:], _losses(a)[4:], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_resume_refuses_other_data(tmp_path, small_ds, tokenizer):
    ds = small_ds.select(range(16))
    kw = dict(max_steps=3, save_strategy="steps", save_steps=2)
    a = _recording_trainer(tiny_model(), config(tmp_path / "a", **kw), ds, tokenizer, _Recording())
    a.train()
    b = _recording_trainer(tiny_model(), config(tmp_path / "b", **kw), small_ds.select(range(1, 17)), tokenizer, _Recording())
    with pytest.raises(ValueError, match="incompatible"):
        b.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))


def test_config_validation(tmp_path):
    from pf_trl.trainer import PaddingFreeConfig

    with pytest.raises(ValueError, match="packing=True conflicts"):
        PaddingFreeConfig(output_dir=str(tmp_path), packing=True, padding_free_mode="huggingface", use_cpu=True)
    with pytest.raises(ValueError, match="padding_free must be one of"):
        PaddingFreeConfig(output_dir=str(tmp_path), padding_free="sometimes", use_cpu=True)
    with pytest.raises(ValueError, match="padding_free_mode must be one of"):
        PaddingFreeConfig(output_dir=str(tmp_path), padding_free_mode="sometimes", use_cpu=True)
    with pytest.raises(ValueError, match="needs --padding_free_mode internal"):
        PaddingFreeConfig(output_dir=str(tmp_path), padding_free_mode="huggingface", attention_backend="sdpa", use_cpu=True)
    on = PaddingFreeConfig(output_dir=str(tmp_path), padding_free="true", use_cpu=True)  # TRL's CLI passes text
    off = PaddingFreeConfig(output_dir=str(tmp_path), padding_free="false", use_cpu=True)
    assert (on.padding_free, on.padding_free_mode, off.padding_free, off.padding_free_mode) == (
        True, "huggingface", False, "none")
