"""Attention-sink models (gpt-oss, Granite SWA, DeepSeek-V4) and Llama 4 through pf-trl's paths, padded vs packed.

Each case runs the coverage sweep's comparison on one tiny model (:func:`pf_trl_dev.coverage.sweep_model`):
the model path (a direct call with the collator's batch) and the trainer path (``PaddingFreeSFTTrainer.compute_loss``,
loss and gradients against the model's own padded loss), in both modes, with the sweep's own negative control
(the row without per-example positions must move the loss). Every fix has a control that removes it and sees the
mismatch come back.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pf_trl.attention import (  # noqa: E402
    PaddingFreeError,
    UnsupportedModelError,
    enable_padding_free,
    hf,
    packed_masks,
    support,
)
from pf_trl_dev import coverage  # noqa: E402
from pf_trl_dev.tiny import causal_lm_class, tiny_config  # noqa: E402


def build(model_type: str, **overrides):
    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return causal_lm_class(model_type)(config).float()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls, as the sweep runs them
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def state():
    with coverage._quiet():
        return coverage._Sweep()


@pytest.fixture
def sweep(state):
    def run(model, lengths=coverage.LENGTHS):
        with coverage._quiet(), support.use_matrix({}):
            return coverage.sweep_model(state, model, lengths=lengths)

    return run


def assert_exact(entry, modes=coverage.MODES):
    assert entry["leak"] >= coverage.LEAK_MIN  # a leak would show
    for mode in modes:
        res = entry[mode]
        assert res["status"] == "exact", (mode, res)
        assert res["model_err"] <= coverage.LOSS_ATOL and res["loss_err"] <= coverage.LOSS_ATOL
        assert res["grad_err"] <= coverage.GRAD_RTOL


GPT_OSS_VARIANTS = {
    "defaults": {},
    # four layers alternating sliding (window 3, shorter than most examples) and full attention, MoE router loss on
    "alternating_moe_router": {"num_hidden_layers": 4, "sliding_window": 3, "output_router_logits": True,
                               "layer_types": ["sliding_attention", "full_attention"] * 2, "router_aux_loss_coef": 0.5},
}


@pytest.mark.parametrize("variant", sorted(GPT_OSS_VARIANTS))
def test_gpt_oss_is_exact_in_both_modes(variant, sweep):
    model = build("gpt_oss", **GPT_OSS_VARIANTS[variant])
    assert {m.self_attn.sliding_window for m in model.model.layers} >= {None}  # full layers present
    with torch.no_grad():  # sinks that matter: some heads put real mass on them
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    assert_exact(sweep(model))


@pytest.mark.parametrize("model_type", ["granite_swa", "flint", "mimo_v2_flash"])
def test_other_sink_models_are_exact_in_internal_mode(model_type, sweep):
    assert_exact(sweep(build(model_type)), modes=("internal",))


def test_negative_control_sinks_dropped_in_pf_varlen(monkeypatch, sweep):
    """Without the sinks, pf_varlen is self-consistent (the self-check passes) but not gpt-oss: the sweep sees it."""
    original = hf.varlen_attention
    monkeypatch.setattr(hf, "varlen_attention", lambda *a, sinks=None, **kw: original(*a, **kw))
    entry = sweep(build("gpt_oss"))
    assert entry["internal"]["status"] == "mismatch" and entry["internal"]["model_err"] > 100 * coverage.LOSS_ATOL


def test_negative_control_gpt_oss_masks_without_positions(monkeypatch, sweep):
    """gpt-oss's own mask builder is not given position_ids: without pf-trl's mask mapping its eager attention
    lets the packed examples see each other, and huggingface mode is refused by the self-check."""
    monkeypatch.setattr(packed_masks, "install", lambda model: [])
    entry = sweep(build("gpt_oss"))
    assert entry["huggingface"]["status"] == "refused" and "self-check failed" in entry["huggingface"]["reason"]
    assert entry["internal"]["status"] == "exact"  # pf_varlen does not depend on the mask


def test_mask_builders_without_positions_are_found_by_source():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssModel
    from transformers.models.llama.modeling_llama import LlamaModel

    assert dict(packed_masks.mask_builders_without_positions(GptOssModel)) == {
        "full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}
    assert packed_masks.mask_builders_without_positions(LlamaModel) == ()  # passes position_ids itself


DEEPSEEK_V4_VARIANTS = {
    "defaults": {},  # CSA windows of 4, HCA windows of 128 (none complete in 14 tokens)
    "hca_windows_complete": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}},
    "sliding_only": {"layer_types": ["sliding_attention"] * 3},
}


@pytest.mark.parametrize("variant", sorted(DEEPSEEK_V4_VARIANTS))
def test_deepseek_v4_compressed_layers_per_example(sweep, variant):
    """Sinks and compressed attention exact in huggingface mode; internal mode refuses compressed layers by name."""
    overrides = DEEPSEEK_V4_VARIANTS[variant]
    entry = sweep(build("deepseek_v4", **overrides))
    if variant == "sliding_only":
        assert_exact(entry)
        return
    assert_exact(entry, modes=("huggingface",))
    assert entry["internal"]["status"] == "refused" and "compressed attention layers" in entry["internal"]["reason"]


def test_deepseek_v4_negative_control_compressors_over_the_row(sweep, monkeypatch):
    """Without the per-example compressors the windows straddle examples: the self-check sees the leak."""
    from pf_trl.attention import compressed_kv

    monkeypatch.setattr(compressed_kv, "install", lambda model: [])
    entry = sweep(build("deepseek_v4", **DEEPSEEK_V4_VARIANTS["hca_windows_complete"]))
    assert entry["huggingface"]["status"] == "refused" and "self-check failed" in entry["huggingface"]["reason"]


# --------------------------------------------------------------------------------------------------- Llama 4


def test_llama4_text_defaults_are_exact(sweep):
    model = build("llama4_text")
    assert model.config.layer_types.count("chunked_attention") and 0 in model.config.no_rope_layers  # NoPE + chunked
    assert_exact(sweep(model))


def test_llama4_negative_control_load_balancing_term_it_does_not_have(monkeypatch, sweep):
    """The trainer-path mismatch of Llama 4 was a load-balancing term (Mixtral's) that the model's own loss lacks."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    import pf_trl.trainer.loss as loss

    monkeypatch.setattr(loss.sys.modules[causal_lm_class("llama4_text").__module__], "load_balancing_loss_func",
                        load_balancing_loss_func, raising=False)
    entry = sweep(build("llama4_text"))
    for mode in coverage.MODES:
        assert entry[mode]["status"] == "mismatch" and entry[mode]["model_err"] <= coverage.LOSS_ATOL
        assert entry[mode]["loss_err"] > coverage.LOSS_ATOL


def test_llama4_chunked_attention_is_exact_and_its_negative_control(monkeypatch, sweep):
    model = build("llama4_text", attention_chunk_size=4, attn_temperature_tuning=False)  # examples of 9-14 tokens
    assert_exact(sweep(model))
    monkeypatch.setattr(hf, "attention_chunk", lambda module: None)  # pf_varlen ignoring the chunks
    entry = sweep(model)
    assert entry["internal"]["status"] == "mismatch" and entry["huggingface"]["status"] == "exact"


def test_llama4_temperature_tuning_limits_the_packed_row(sweep):
    model = build("llama4_text", floor_scale=64)  # the scale changes at row position 63: rows of 40 tokens are exact
    assert_exact(sweep(model))
    short = build("llama4_text", floor_scale=8)  # rows of 11 (self-check) and 40 tokens exceed 7
    entry = sweep(short)
    for mode in coverage.MODES:
        assert entry[mode]["status"] == "refused" and "floor_scale - 1 = 7" in entry[mode]["reason"]
    # negative control: without the limit, the row position changes the NoPE queries and the self-check sees it
    alone = build("llama4_text", floor_scale=8)
    alone._pf_row_limit = None  # what the forward pre-hook would have found: no limit
    with support.use_matrix({}), pytest.raises(PaddingFreeError, match="self-check failed"):
        enable_padding_free(alone, mode="internal", allow_unverified=True)


def test_llama4_budget_over_the_limit_is_refused_before_training(tmp_path):
    import datasets

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.data.tokenizer import load_tokenizer

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10]] * 4, "labels": [[5, 6, 7, 8, 9, 10]] * 4})
    args = PaddingFreeConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_tokens_per_batch=24,
                             max_steps=1, allow_unverified=True, disable_tqdm=True, save_strategy="no")
    with support.use_matrix({}):
        trainer = PaddingFreeSFTTrainer(build("llama4_text", floor_scale=16), args=args,
                                        processing_class=load_tokenizer(), train_dataset=ds)
    with pytest.raises(UnsupportedModelError, match="max_tokens_per_batch <= 15"):
        trainer.train()


# ------------------------------------------------------------------- mask builders not given the position_ids


def test_opt_direct_mask_builder_and_its_negative_control(sweep, monkeypatch):
    """OPT calls create_causal_mask without position_ids: pf-trl hands its decoder the mask built with them.

    huggingface mode reroutes sdpa models to pf-trl's per-segment attention (hf_sdpa), which reads no mask; the mask
    fix is what keeps transformers' own dense path exact, so it is checked with the reroute off."""
    from transformers.models.opt.modeling_opt import OPTDecoder

    from pf_trl.attention import hf_sdpa

    assert packed_masks.direct_builder_without_positions(OPTDecoder) == "create_causal_mask"
    assert_exact(sweep(build("opt")))
    monkeypatch.setattr(hf_sdpa, "reroute_refusal", lambda model: "the dense path under test")
    assert_exact(sweep(build("opt")))  # transformers' dense sdpa mask, built with the packed positions
    monkeypatch.setattr(packed_masks, "install", lambda model: [])
    entry = sweep(build("opt"))
    assert entry["huggingface"]["status"] == "refused" and "self-check failed" in entry["huggingface"]["reason"]


def test_sparse_attention_indexer_is_refused_in_internal_mode_only(sweep):
    entry = sweep(build("deepseek_v32"))
    assert entry["huggingface"]["status"] == "exact"
    assert entry["internal"]["status"] == "refused" and "sparse attention indexer" in entry["internal"]["reason"]
