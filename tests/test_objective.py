"""The model's own objective through PaddingFreeSFTTrainer: head transforms, MoE aux loss, TRL loss options.

Each check trains one epoch at lr 0 on equal-length examples, one per batch, so the padded and the packed batches hold
the same tokens: ``train_loss`` of ``padding_free_mode="internal"`` must equal ``"none"`` (TRL's padded loss). Each has a
negative control showing that the test fails on the flaw it guards against.
"""

from __future__ import annotations

import logging

import pytest
import torch

V = 256
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.5)


def _config(name):
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig, MixtralConfig, Qwen2MoeConfig

    return {
        "llama": lambda: LlamaConfig(**TINY),
        "granite": lambda: GraniteConfig(**TINY, logits_scaling=8.0),
        "gemma2": lambda: Gemma2Config(**TINY, head_dim=8, final_logit_softcapping=3.0, sliding_window=64),
        "cohere": lambda: CohereConfig(**TINY, logit_scale=0.25),
        "mixtral": lambda: MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2,
                                         output_router_logits=True, router_aux_loss_coef=0.5),
        "qwen2_moe": lambda: Qwen2MoeConfig(**TINY, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                            num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                            router_aux_loss_coef=0.5),
    }[name]()


def make_model(name, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager" if name == "gemma2" else "sdpa")


def rows(n=2, length=10, seed=1, prompt=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, V, (length,), generator=g).tolist() for _ in range(n)]
    return {"input_ids": ids, "labels": [[-100] * prompt + r[prompt:] for r in ids]}


def train(tmp_path, model, mode, data=None, trainer_kwargs=None, **cfg):
    from datasets import Dataset

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    base = dict(output_dir=str(tmp_path / f"out-{mode}"), report_to=[], save_strategy="no", learning_rate=0.0,
                per_device_train_batch_size=1, num_train_epochs=1, padding_free_mode=mode, max_length=None, use_cpu=True,
                disable_tqdm=True, seed=0, logging_steps=1, dataloader_num_workers=0)
    base.update(cfg)
    trainer = PaddingFreeSFTTrainer(model, args=PaddingFreeConfig(**base), train_dataset=Dataset.from_dict(data or rows()),
                                    **(trainer_kwargs or {}))
    result = trainer.train()
    return result.metrics["train_loss"], trainer


def both(tmp_path, name, **kw):
    pf, trainer = train(tmp_path / "pf", make_model(name), "internal", **kw)
    padded, _ = train(tmp_path / "pad", make_model(name), "none", **kw)
    return pf, padded, trainer


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("transformers").setLevel(logging.ERROR)


# ----------------------------------------------------------------------------------- head transforms


@pytest.mark.slow
@pytest.mark.parametrize("name", ["granite", "gemma2", "cohere"])
def test_head_transform_equals_padded(tmp_path, name, monkeypatch):
    pf, padded, trainer = both(tmp_path, name)
    assert trainer.pf_head_plan.path == "linear"
    assert pf == pytest.approx(padded, rel=1e-5, abs=1e-5)

    # negative control: the transform skipped (the old loss: hidden @ lm_head.weight) is far off the padded loss
    import pf_trl.trainer.loss as loss_mod

    monkeypatch.setattr(loss_mod, "head_transform_from_config", lambda config: (1.0, None))
    monkeypatch.setattr(loss_mod, "probe_head", lambda *a, **k: None)
    skipped, _ = train(tmp_path / "skip", make_model(name), "internal")
    assert abs(skipped - padded) > 0.05


@pytest.mark.slow
def test_unknown_head_transform_falls_back_to_the_models_own_head(tmp_path, monkeypatch):
    import pf_trl.trainer.loss as loss_mod

    padded, _ = train(tmp_path / "pad", make_model("granite"), "none")
    # pf-trl does not know the transform (as for an architecture it has never seen): the probe sees the logits differ
    monkeypatch.setattr(loss_mod, "head_transform_from_config", lambda config: (1.0, None))
    pf, trainer = train(tmp_path / "pf", make_model("granite"), "internal")
    assert trainer.pf_head_plan.path == "model"
    assert pf == pytest.approx(padded, rel=1e-5, abs=1e-5)


def test_unreproducible_head_without_logits_to_keep_is_refused(monkeypatch):
    import pf_trl.trainer.loss as loss_mod

    model = make_model("granite")
    monkeypatch.setattr(loss_mod, "head_transform_from_config", lambda config: (1.0, None))
    monkeypatch.setattr(loss_mod, "_accepts_logits_to_keep", lambda model: False)
    with pytest.raises(ValueError, match="cannot reproduce the logits of GraniteForCausalLM"):
        loss_mod.plan_head(model)


# ----------------------------------------------------------------------------------- MoE aux loss


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_aux_loss_equals_padded(tmp_path, name):
    pf, padded, trainer = both(tmp_path, name)
    assert pf == pytest.approx(padded, rel=1e-5, abs=1e-5)
    logged = [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]
    assert logged and all(v > 0 for v in logged)
    # negative control: without the aux loss (what the old loss did) the packed loss is far off the padded one
    dropped, _ = train(tmp_path / "noaux", make_model(name), "internal", router_aux_loss_coef=0.0)
    assert abs(dropped - padded) > 0.05


def test_moe_aux_loss_masks_the_pad_segment_like_a_padded_batch(tmp_path):
    """Several examples of different lengths and a pad_to_multiple_of tail: aux == the model's own on the padded batch."""
    from pf_trl.batching.collator import PaddingFreeCollator
    from pf_trl.trainer.loss import router_aux_loss

    model = make_model("mixtral").eval()
    data = rows(3, 9)
    feats = [{"input_ids": ids[: 5 + 2 * i]} for i, ids in enumerate(data["input_ids"])]
    packed = PaddingFreeCollator(pad_to_multiple_of=32)(feats)
    real = sum(len(f["input_ids"]) for f in feats)
    assert packed["input_ids"].shape[1] == 32 > real
    longest = max(len(f["input_ids"]) for f in feats)
    ids = torch.zeros(len(feats), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(feats):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss
        routed = model.model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                             output_router_logits=True, use_cache=False).router_logits
        got = router_aux_loss(model, routed, real, packed["input_ids"].shape[1])
        unmasked = router_aux_loss(model, routed, None, packed["input_ids"].shape[1])
    assert float(got) == pytest.approx(float(ref), rel=1e-5)
    assert abs(float(unmasked) - float(ref)) > 1e-4  # negative control: the pad tail counted


# ----------------------------------------------------------------------------------- TRL loss options


@pytest.mark.slow
def test_label_smoothing_equals_padded(tmp_path):
    pf, padded, trainer = both(tmp_path, "llama", label_smoothing_factor=0.5)
    assert trainer.pf_head_plan.path == "module"
    assert pf == pytest.approx(padded, rel=1e-5, abs=1e-5)
    plain, _ = train(tmp_path / "plain", make_model("llama"), "internal")
    assert abs(plain - padded) > 0.01  # negative control: smoothing ignored


@pytest.mark.slow
def test_dft_equals_padded(tmp_path):
    pf, padded, _ = both(tmp_path, "granite", loss_type="dft")
    assert pf == pytest.approx(padded, rel=1e-5, abs=1e-6)
    nll, _ = train(tmp_path / "nll", make_model("granite"), "internal")
    assert abs(nll - padded) > 0.05  # negative control: dft ignored


def _z_loss(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits[:, :-1].float()
    target = labels[:, 1:]
    keep = target != -100
    ce = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    z = torch.logsumexp(logits[keep], -1).pow(2).sum()
    n = keep.sum() if num_items_in_batch is None else num_items_in_batch
    return (ce + 0.5 * z) / n


@pytest.mark.slow
def test_compute_loss_func_equals_padded(tmp_path):
    kw = {"trainer_kwargs": {"compute_loss_func": _z_loss}}
    pf, padded, _ = both(tmp_path, "llama", **kw)
    assert pf == pytest.approx(padded, rel=1e-5, abs=1e-5)
    plain, _ = train(tmp_path / "plain", make_model("llama"), "internal")
    assert abs(plain - padded) > 0.05  # negative control: compute_loss_func ignored


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha"),
        ({"loss_type": "dft", "label_smoothing_factor": 0.1}, "label_smoothing_factor with loss_type='dft'"),
        ({"use_liger_kernel": True, "fused_loss": "chunked"}, "use_liger_kernel"),
    ],
)
def test_unsupported_loss_options_are_refused(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        train(tmp_path, make_model("llama"), "internal", **options)


@pytest.mark.slow
def test_all_masked_micro_batch_is_a_differentiable_zero(tmp_path):
    from pf_trl.batching.collator import PaddingFreeCollator

    _, trainer = train(tmp_path, make_model("granite"), "internal", max_steps=1)
    model = trainer.model.train()
    batch = PaddingFreeCollator()([{"input_ids": [5, 6, 7], "labels": [-100] * 3}, {"input_ids": [8, 9], "labels": [-100] * 2}])
    model.zero_grad()
    loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(7))
    loss.backward()
    assert float(loss) == 0.0
    assert model.lm_head.weight.grad is not None and float(model.lm_head.weight.grad.abs().sum()) == 0.0
