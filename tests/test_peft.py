"""PEFT through PaddingFreeSFTTrainer: peft_config= and a PeftModel; LoRA on the head trains; `pf-trl train` flags.

The reference is the model's own loss on a padded batch (``model(input_ids, attention_mask, labels)``): TRL 1.16's
padded path reads ``lm_head.weight`` directly and so bypasses an adapter on the head itself.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

peft = pytest.importorskip("peft")

V = 128
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def base_model(seed=0):
    from pf_trl.models import build_model

    return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=seed, **TINY)


def lora(targets, dora=False):
    # random B (not zero): the adapters change the loss, so a bypassed adapter shows in the loss and the gradients
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
                           use_dora=dora, task_type="CAUSAL_LM")


def examples():
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (7, 11, 5):
        ids = torch.randint(3, V, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return out


def trainer_for(tmp_path, model, **kw):
    from datasets import Dataset

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    rows = examples()
    ds = Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "labels")})
    args = PaddingFreeConfig(output_dir=str(tmp_path / "out"), report_to=[], save_strategy="no", learning_rate=0.0,
                             per_device_train_batch_size=1, max_steps=1, padding_free_mode="internal", max_length=None,
                             use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    return PaddingFreeSFTTrainer(model, args=args, train_dataset=ds, **kw)


def padded_reference(model):
    """Mean loss over the supervised tokens of the examples as one padded batch, and the adapter gradients."""
    rows = examples()
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    return float(loss), _adapter_grads(model)


def packed_loss(trainer):
    from pf_trl.batching.collator import PaddingFreeCollator

    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, PaddingFreeCollator()(examples()))
    loss.backward()
    return float(loss), _adapter_grads(model)


def _adapter_grads(model):
    return {n: p.grad.detach().clone() if p.grad is not None else None
            for n, p in model.named_parameters() if "lora_" in n}


def assert_same(got, ref):
    assert got.keys() == ref.keys() and ref
    for name, g in ref.items():
        assert got[name] is not None, f"{name} got no gradient"
        assert torch.allclose(got[name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize(("targets", "dora"), [(["q_proj", "v_proj"], False), (["q_proj", "v_proj", "lm_head"], False),
                                              (["v_proj", "lm_head"], True)])
def test_peft_config_loss_and_adapter_grads_equal_padded(tmp_path, targets, dora):
    trainer = trainer_for(tmp_path, base_model(), peft_config=lora(targets, dora))
    assert isinstance(trainer.model, peft.PeftModel)
    expected_path = "module" if "lm_head" in targets else "linear"
    assert trainer.pf_head_plan.path == expected_path
    trainer.model.train()
    got_loss, got = packed_loss(trainer)
    ref_loss, ref = padded_reference(trainer.model)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5)
    assert_same(got, ref)
    if "lm_head" in targets:
        assert any("lm_head" in n for n in got) and all(float(g.abs().sum()) > 0 for n, g in got.items() if "lm_head" in n)


@pytest.mark.slow
def test_adapter_on_head_bypassed_is_caught(tmp_path, monkeypatch):
    """Negative control: reading lm_head.weight (the old path, and TRL's) leaves the head adapter without gradient."""
    import pf_trl.trainer.loss as loss_mod

    monkeypatch.setattr(loss_mod, "_is_plain_linear", lambda module: True)
    trainer = trainer_for(tmp_path, base_model(), peft_config=lora(["q_proj", "lm_head"]))
    assert trainer.pf_head_plan.path == "linear"
    trainer.model.train()
    got_loss, got = packed_loss(trainer)
    ref_loss, _ = padded_reference(trainer.model)
    assert abs(got_loss - ref_loss) > 1e-3
    assert all(g is None or float(g.abs().sum()) == 0 for n, g in got.items() if "lm_head" in n)


def test_peft_model_passed_in_trains(tmp_path):
    model = peft.get_peft_model(base_model(), lora(["q_proj", "v_proj", "lm_head"]))
    trainer = trainer_for(tmp_path, model)
    assert trainer.model is model and trainer.pf_head_plan.path == "module"
    trainer.model.train()
    got_loss, got = packed_loss(trainer)
    ref_loss, ref = padded_reference(model)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5)
    assert_same(got, ref)
    trainer.train()


@pytest.mark.slow
def test_cli_lora_saves_adapter_and_merged_model(tmp_path, sample_path):
    from transformers import AutoModelForCausalLM

    from pf_trl.cli.train import main

    out = tmp_path / "out"
    rc = main(["--model_name_or_path", "pf-trl/tiny-llama", "--model_overrides",
               "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2",
               "--training_data_path", str(sample_path), "--max_seq_len", "64", "--output_dir", str(out),
               "--max_steps", "2", "--per_device_train_batch_size", "2", "--use_cpu", "True", "--report_to", "none",
               "--peft_method", "lora", "--r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0",
               "--target_modules", "q_proj", "v_proj", "--merge_adapter", "True", "--save_strategy", "steps",
               "--save_steps", "100", "--disable_tqdm", "True"])
    assert rc == 0
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", local_files_only=True)
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def test_cli_refuses_bad_peft_flags(tmp_path, sample_path, capsys):
    from pf_trl.cli.train import main

    base = ["--training_data_path", str(sample_path), "--output_dir", str(tmp_path / "o"), "--use_cpu", "True"]
    assert main([*base, "--merge_adapter", "True"]) == 2
    assert "--merge_adapter needs --peft_method lora" in capsys.readouterr().err
    assert main([*base, "--peft_method", "lora", "--r", "0"]) == 2
    assert "--r must be a positive integer" in capsys.readouterr().err
