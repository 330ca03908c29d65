"""Model level: padding-free (packed) loss and gradients equal the padded run, on tiny models built from config.

transformers >= 4.48 (AttentionInterface) only; the transformers 4.43 patch is covered by test_attention_legacy.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from pf_trl.attention.hf import has_attention_interface  # noqa: E402

if not has_attention_interface():
    pytest.skip("needs transformers with AttentionInterface (>= 4.48)", allow_module_level=True)

from pf_trl.attention import (  # noqa: E402
    BackendUnavailableError,
    PackedAttentionMaskError,
    PaddingFreeError,
    UnsupportedModelError,
    enable_padding_free,
)
from pf_trl.attention.hf import hf_varlen_attention  # noqa: E402
from pf_trl.batching.collator import PaddingFreeCollator  # noqa: E402
from pf_trl_dev.tiny import LLAMA_SHAPE  # noqa: E402

TINY = LLAMA_SHAPE
VOCAB = TINY["vocab_size"]
LENGTHS = [9, 1, 14, 5, 11]  # uneven, with a 1-token example


def make_model(arch: str, attn: str = "eager", **overrides):
    cfgs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
        "mistral_swa": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 4}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "mixtral": (
            transformers.MixtralConfig,
            transformers.MixtralForCausalLM,
            {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
        ),
        "granite": (
            transformers.GraniteConfig,
            transformers.GraniteForCausalLM,
            {"attention_multiplier": 0.2, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0},
        ),
    }
    config_cls, model_cls, extra = cfgs[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides}))
    model.set_attn_implementation(attn)
    return model


def examples(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def per_token_nll(logits, targets):
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


def padded_run(model, exs):
    """Right padding + attention_mask; returns per-example mean loss and summed token loss."""
    n = max(len(e) for e in exs)
    ids = torch.zeros(len(exs), n, dtype=torch.long)
    mask = torch.zeros(len(exs), n, dtype=torch.long)
    for i, e in enumerate(exs):
        ids[i, : len(e)] = e
        mask[i, : len(e)] = 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    means, total, count = [], 0.0, 0
    for i, e in enumerate(exs):
        if len(e) < 2:
            means.append(None)
            continue
        nll = per_token_nll(logits[i, : len(e) - 1], e[1:])
        means.append(nll.mean())
        total = total + nll.sum()
        count += nll.numel()
    return means, total / count


def packed_run(model, exs, *, drop_position_ids=False, flash_kwargs=True, call_kwargs=None):
    batch = PaddingFreeCollator(return_flash_kwargs=flash_kwargs)([{"input_ids": e} for e in exs])
    labels = batch.pop("labels")
    if drop_position_ids:
        batch.pop("position_ids")
        for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            batch.pop(k, None)
    logits = model(**batch, **(call_kwargs or {})).logits[0]
    ids = batch["input_ids"][0]
    means, total, count, start = [], 0.0, 0, 0
    for e in exs:
        end = start + len(e)
        assert torch.all(labels[0, start + 1 : end] == ids[start + 1 : end])
        if len(e) < 2:
            means.append(None)
        else:
            nll = per_token_nll(logits[start : end - 1], ids[start + 1 : end])
            means.append(nll.mean())
            total = total + nll.sum()
            count += nll.numel()
        start = end
    return means, total / count


def max_mean_diff(a, b):
    return max(float((x - y).detach().abs()) for x, y in zip(a, b) if x is not None)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(g_test, g_ref, rel=1e-4):
    assert g_test.keys() == g_ref.keys()
    for name, ref in g_ref.items():
        denom = ref.norm()
        if denom < 1e-8:
            assert g_test[name].norm() < 1e-6, name
            continue
        assert float((g_test[name] - ref).norm() / denom) <= rel, name


def compare(arch, mode, *, attn="sdpa", checkpointing=False, backend="auto", exs=None):
    exs = exs or examples()
    ref_model = make_model(arch, "eager")
    ref_model.train()
    ref_means, ref_loss = padded_run(ref_model, exs)
    ref_loss.backward()
    ref_grads = grads(ref_model)

    model = make_model(arch, attn)
    enable_padding_free(model, mode=mode, backend=backend)
    model.train()
    if checkpointing:
        enable_ckpt = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable_ckpt()
        assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    means, loss = packed_run(model, exs)
    loss.backward()
    assert max_mean_diff(means, ref_means) <= 1e-5
    assert abs(float((loss - ref_loss).detach())) <= 1e-5
    assert_grads_close(grads(model), ref_grads)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "mixtral", "granite"])
def test_internal_matches_padded(arch):
    model = compare(arch, "internal")
    assert model.config._attn_implementation == "pf_varlen"
    assert model._pf_padding_free["mode"] == "internal"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_huggingface_mode_matches_padded(arch, attn):
    model = compare(arch, "huggingface", attn=attn)
    # sdpa attends packed rows per segment instead of through transformers' dense T x T mask (hf_sdpa)
    assert model.config._attn_implementation == ("pf_packed_sdpa" if attn == "sdpa" else attn)


@pytest.mark.parametrize("mode", ["internal", "huggingface"])
def test_gradient_checkpointing(mode):
    compare("llama", mode, checkpointing=True)


@pytest.mark.parametrize("mode", ["internal", "huggingface"])
def test_mistral_sliding_window(mode):
    # window 4, every multi-token example longer than the window
    compare("mistral_swa", mode, exs=examples([9, 1, 7, 12]))


def test_explicit_sdpa_backend_and_collator_without_flash_kwargs():
    exs = examples()
    ref = make_model("llama", "eager")
    ref_means, _ = padded_run(ref, exs)
    model = enable_padding_free(make_model("llama"), mode="internal", backend="sdpa")
    with torch.no_grad():
        means, _ = packed_run(model, exs, flash_kwargs=False)
    assert max_mean_diff(means, ref_means) <= 1e-5


def test_negative_controls_differ():
    exs = examples()
    ref_means, _ = padded_run(make_model("llama", "eager"), exs)
    plain = make_model("llama", "sdpa")
    with torch.no_grad():
        no_pos, _ = packed_run(plain, exs, drop_position_ids=True)  # one long sequence
        cached, _ = packed_run(plain, exs, flash_kwargs=False)  # use_cache default: native detection skipped
    assert max_mean_diff(no_pos, ref_means) > 1e-3
    assert max_mean_diff(cached, ref_means) > 1e-3  # the pitfall, measured on unpatched transformers


def _isolation_error(model):
    a, b = examples([7, 6], seed=3)
    ids = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(7), torch.arange(6)])[None]
    packed = model(input_ids=ids, position_ids=pos).logits[0, 7:]  # default settings: use_cache from config
    alone = model(input_ids=b[None], position_ids=torch.arange(6)[None]).logits[0]
    return float((packed - alone).abs().max())


@pytest.mark.parametrize("mode", ["internal", "huggingface"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_use_cache_default_is_isolated_in_train_and_eval(mode, attn):
    model = make_model("llama", attn)
    assert model.config.use_cache is True
    with torch.no_grad():
        assert _isolation_error(model) > 1e-2  # unpatched: the packed rows leak into each other
        enable_padding_free(model, mode=mode)
        for train in (True, False):
            model.train(train)
            assert _isolation_error(model) <= 1e-5
            a, b = examples([4, 5], seed=5)
            explicit = model(input_ids=torch.cat([a, b])[None], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]), use_cache=True)
            alone = model(input_ids=b[None], use_cache=True).logits[0]
            assert float((explicit.logits[0, 4:] - alone).abs().max()) <= 1e-5
    assert model.config.use_cache is True  # the user's config is not rewritten


def test_pf_varlen_isolates_even_with_a_cache_in_the_attention_call():
    # bypass the pre-hook: call the attention function as a layer would with an (empty) DynamicCache
    model = make_model("llama")
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 16)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    out, _ = hf_varlen_attention(attn, q, k, v, None, scaling=0.25, position_ids=pos)
    out2, _ = hf_varlen_attention(attn, q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], None, scaling=0.25, position_ids=pos[:, 3:] * 0 + torch.arange(5))
    torch.testing.assert_close(out[:, 3:], out2, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["internal", "huggingface"])
def test_attention_mask_with_packed_position_ids_raises(mode):
    model = enable_padding_free(make_model("llama"), mode=mode)
    ids = torch.randint(0, VOCAB, (1, 8))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with pytest.raises(PackedAttentionMaskError, match="attention_mask"):
        model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids))
    # a left-padded batch with generate-style position_ids is not packed and must still work
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    model(input_ids=ids, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), attention_mask=mask)


def test_attention_mask_with_packed_position_ids_raises_in_attention_function():
    attn = make_model("llama").model.layers[0].self_attn
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    with pytest.raises(PackedAttentionMaskError):
        hf_varlen_attention(attn, q, k, k, torch.ones(1, 6, dtype=torch.bool), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))


def test_packed_batch_with_a_cache_object_raises():
    model = enable_padding_free(make_model("llama"), mode="internal")
    ids = torch.randint(0, VOCAB, (1, 6))
    with pytest.raises(PaddingFreeError, match="cache"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), past_key_values=transformers.DynamicCache())


def test_generation_with_pf_varlen_matches_sdpa():
    prompts = [[5, 9, 2, 7, 1], [3, 8]]
    ids = torch.tensor([[0, 0, 0, 3, 8], prompts[0]][::-1])  # row 0: full, row 1: left padded
    mask = (torch.arange(5)[None] >= torch.tensor([[0], [3]])).long()
    outs = []
    for mode in (None, "internal"):
        model = make_model("llama", "sdpa")
        if mode:
            enable_padding_free(model, mode=mode)
        model.eval()
        outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def test_unavailable_backend_raises_with_install_hint():
    with pytest.raises(BackendUnavailableError, match="pip install flash-attn"):
        enable_padding_free(make_model("llama"), mode="internal", backend="flash_attn")
    with pytest.raises(ValueError, match="internal"):
        enable_padding_free(make_model("llama"), mode="huggingface", backend="sdpa")


def test_multimodal_mrope_model_gets_per_example_positions():
    """Qwen2-VL is made padding-free with its own get_rope_index per example (tests/test_vlm.py: images); a model
    whose config asks for mrope but whose class has no get_rope_index is refused."""
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=1),
    )
    for mode in ("internal", "huggingface"):
        model = transformers.Qwen2VLForConditionalGeneration(cfg)
        enable_padding_free(model, mode=mode)
        assert model._pf_rope_index is not None
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}))
    with pytest.raises(UnsupportedModelError, match="mrope"):
        enable_padding_free(llama, mode="huggingface")


def test_custom_code_is_admitted_on_the_self_check_alone(caplog):
    """A class of custom code (trust_remote_code) has no sweep evidence: admitted like a type the support matrix does
    not list, on the runtime self-check, with a warning that says so. Negative control: custom code that lets packed
    examples see each other (a running sum along the row) is refused by that self-check."""
    class CustomForCausalLM(transformers.LlamaForCausalLM):  # defined outside transformers: "remote code"
        pass

    class LeakyForCausalLM(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            # a state carried along the row (a running sum of the embeddings): a packed example sees the one before
            self.model.embed_tokens.register_forward_hook(lambda module, args, out: out + out.cumsum(1) / 10)

    cfg = transformers.LlamaConfig(**TINY)
    for mode in ("internal", "huggingface"):
        with caplog.at_level(logging.WARNING, logger="pf_trl.attention"):
            enable_padding_free(CustomForCausalLM(cfg), mode=mode)
        assert "CustomForCausalLM comes from custom code" in caplog.text and "self-check decides" in caplog.text
        with pytest.raises(PaddingFreeError, match="self-check failed on LeakyForCausalLM"):
            enable_padding_free(LeakyForCausalLM(cfg), mode=mode)


def test_unknown_models_raise():

    class Plain(torch.nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="not a transformers model"):
        enable_padding_free(Plain())

    # an architecture the coverage sweep found inexact (ALiBi built from the attention mask): refused with its reason
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(UnsupportedModelError, match="bloom"):
        enable_padding_free(bloom, mode="internal")


def test_huggingface_mode_self_check_refuses_an_implementation_that_leaks():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def leaky(module, q, k, v, attention_mask, **kw):  # plain causal attention that ignores segments
        return sdpa_attention_forward(module, q, k, v, None, **kw)

    AttentionInterface.register("pf_test_leaky", leaky)
    AttentionMaskInterface.register("pf_test_leaky", lambda *a, **kw: None)
    model = make_model("llama", "sdpa")
    model.set_attn_implementation("pf_test_leaky")
    with pytest.raises(PaddingFreeError, match="self-check failed"):
        enable_padding_free(model, mode="huggingface")


def test_enable_twice_is_idempotent_and_logs_the_choice(caplog):
    model = make_model("llama")
    with caplog.at_level(logging.INFO, logger="pf_trl.attention"):
        assert enable_padding_free(model, mode="internal") is model
        enable_padding_free(model, mode="internal")
    assert len(model._forward_pre_hooks) == 1
    assert "padding-free enabled" in caplog.text
