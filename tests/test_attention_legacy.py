"""The ``internal`` path on any transformers: patched attention (< 4.48) or pf_varlen (>= 4.48), exact sdpa kernel.

Run in the transformers 4.43.4 environment by ``scripts/test_legacy.sh`` (``pytest -m legacy``); the main run
collects it too and then exercises the registry path with the same assertions. Tests that only make sense on old
transformers skip on new ones.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pf_trl.attention import PackedAttentionMaskError, UnsupportedModelError, enable_padding_free  # noqa: E402
from pf_trl.attention.enable import native_packing_supported  # noqa: E402
from pf_trl.attention.hf import has_attention_interface  # noqa: E402
from pf_trl.batching.collator import PaddingFreeCollator  # noqa: E402
from pf_trl_dev.tiny import LLAMA_SHAPE  # noqa: E402

pytestmark = pytest.mark.legacy
LEGACY = not has_attention_interface()

TINY = LLAMA_SHAPE
VOCAB = TINY["vocab_size"]
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
}


def make_model(arch, attn="eager"):
    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**TINY, **extra})
    config._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def examples(lengths=(9, 1, 14, 5, 11), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def token_losses(logits, spans, ids):
    out = []
    for (row, start, end) in spans:
        if end - start < 2:
            out.append(None)
            continue
        out.append(torch.nn.functional.cross_entropy(logits[row, start : end - 1].float(), ids[row, start + 1 : end], reduction="none"))
    return out


def padded(model, exs):
    n = max(len(e) for e in exs)
    ids = torch.zeros(len(exs), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(exs):
        ids[i, : len(e)], mask[i, : len(e)] = e, 1
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    return token_losses(logits, [(i, 0, len(e)) for i, e in enumerate(exs)], ids)


def packed(model, exs, flash_kwargs=True, **call):
    batch = PaddingFreeCollator(return_flash_kwargs=flash_kwargs)([{"input_ids": e} for e in exs])
    batch.pop("labels")
    logits = model(**batch, **call).logits
    spans, start = [], 0
    for e in exs:
        spans.append((0, start, start + len(e)))
        start += len(e)
    return token_losses(logits, spans, batch["input_ids"])


def loss_of(parts):
    parts = [p for p in parts if p is not None]
    return torch.cat(parts).mean()


def check_equal(ref_parts, parts):
    diffs = [float((a.mean() - b.mean()).detach().abs()) for a, b in zip(ref_parts, parts) if a is not None]
    assert max(diffs) <= 1e-5, diffs


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_internal_matches_padded(arch, checkpointing):
    exs = examples((9, 1, 7, 12)) if arch == "mistral_swa" else examples()
    ref = make_model(arch, "eager")
    ref.train()
    ref_parts = padded(ref, exs)
    loss_of(ref_parts).backward()
    ref_grads = grads(ref)

    model = enable_padding_free(make_model(arch, "sdpa"), mode="internal", backend="sdpa")
    model.train()
    if checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    parts = packed(model, exs)
    check_equal(ref_parts, parts)
    loss_of(parts).backward()
    got = grads(model)
    assert got.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        if g.norm() > 1e-8:
            assert float((got[name] - g).norm() / g.norm()) <= 1e-4, name


def test_negative_control_without_patch_leaks():
    exs = examples()
    ref_parts = padded(make_model("llama", "eager"), exs)
    with torch.no_grad():
        parts = packed(make_model("llama", "sdpa"), exs, flash_kwargs=False, use_cache=False)
    diffs = [float((a.mean() - b.mean()).detach().abs()) for a, b in zip(ref_parts, parts) if a is not None]
    if LEGACY:
        assert max(diffs) > 1e-3  # transformers 4.43 sdpa ignores packed position_ids
    # (on new transformers use_cache=False lets the native path isolate; the pitfall case is tested below)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_default_use_cache_is_isolated_in_train_and_eval(attn):
    model = enable_padding_free(make_model("llama", attn), mode="internal", backend="sdpa")
    a, b = examples((7, 6), seed=3)
    ids = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(7), torch.arange(6)])[None]
    with torch.no_grad():
        for train in (True, False):
            model.train(train)
            out = model(input_ids=ids, position_ids=pos).logits[0, 7:]  # use_cache left to the config (True)
            alone = model(input_ids=b[None], position_ids=torch.arange(6)[None]).logits[0]
            assert float((out - alone).abs().max()) <= 1e-5


def test_attention_mask_with_packed_position_ids_raises():
    model = enable_padding_free(make_model("llama"), mode="internal", backend="sdpa")
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(PackedAttentionMaskError):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), attention_mask=torch.ones_like(ids))


def test_generation_still_works_after_patch():
    model = enable_padding_free(make_model("llama", "sdpa"), mode="internal", backend="sdpa")
    model.eval()
    ids = torch.tensor([[0, 0, 3, 8], [5, 9, 2, 7]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    ref = make_model("llama", "eager")
    ref.eval()
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.skipif(not LEGACY, reason="transformers has AttentionInterface: no module patch needed")
def test_legacy_patch_is_used():
    model = enable_padding_free(make_model("qwen2"), mode="internal", backend="sdpa")
    attn = [m for m in model.modules() if getattr(m, "_pf_legacy_patched", False)]
    assert len(attn) == TINY["num_hidden_layers"]


@pytest.mark.skipif(native_packing_supported(), reason="transformers >= 4.44 has a native packed path")
def test_huggingface_mode_switches_to_internal_on_old_transformers(caplog):
    model = enable_padding_free(make_model("llama"), mode="huggingface")
    assert model._pf_padding_free["mode"] == "internal"
    assert "using mode='internal'" in caplog.text


@pytest.mark.skipif(not LEGACY, reason="legacy allow-list only")
def test_unknown_architecture_raises_on_legacy():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        enable_padding_free(gpt2, mode="internal")
