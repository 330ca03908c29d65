"""Stateful sequence layers (SSM scans, causal convs, delta rules, RG-LRU, lightning attention) restart per example.

Every hybrid / state-space family transformers ships is trained padding-free through ``PaddingFreeSFTTrainer`` and
compared with the padded run (loss and gradients), in both modes, on its config defaults and on the layer-kind
variants its config can switch on (``tiny.TYPE_VARIANTS``). Each family has a negative control: the same trainer
call with the example boundaries dropped at the stateful layers must move the loss or the gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pf_trl.attention import PaddingFreeError, enable_padding_free, stateful  # noqa: E402
from pf_trl.attention.enable import special_token_ids  # noqa: E402
from pf_trl.attention.stateful import PackedLayout, SegmentPlan, plan_groups  # noqa: E402
from pf_trl.batching.collator import PaddingFreeCollator  # noqa: E402
from pf_trl_dev.tiny import TYPE_VARIANTS, tiny_model  # noqa: E402

from tolerances import assert_bit_equal  # noqa: E402

LENGTHS = (9, 1, 14, 5, 11)  # uneven, one single-token example
LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4

# one model type per family of stateful layer (and its MoE / attention variants); every other type of each family
# goes through the same trainer path in the coverage sweep (tests/test_coverage.py), in both modes
FAMILIES = {
    "qwen3_5_text": "gated_delta_net",  # + variant: linear-attention layers only
    "qwen3_next": "gated_delta_net",  # with a MoE router
    "kimi_linear": "kimi_delta_attention",  # KDA + MLA attention + MoE
    "granitemoehybrid": "mamba2",  # Granite 4.0-H: + attention layers, + dense variant
    "bamba": "mamba2",  # + attention layers
    "jamba": "mamba",  # Mamba + attention + MoE
    "mamba": "mamba",  # pure Mamba: the layout reaches its mixer through the block pre-hook
    "lfm2_moe": "short_conv",  # short convs + attention + MoE
    "minimax": "lightning_attention",  # lightning + softmax attention + MoE
    "recurrent_gemma": "rg_lru",  # conv + RG-LRU + local attention
}
CONFIGS = [(t, None) for t in FAMILIES] + [(t, v) for t in FAMILIES for v in TYPE_VARIANTS.get(t, {})]
# transformers' GraniteMoeHybridModel builds its attention mask without position_ids; pf-trl hands it the mask mapping
# built with them (packed_masks.py), so huggingface mode is exact too (negative control below)


def _examples(model, seed: int = 0, lengths=LENGTHS) -> list[torch.Tensor]:
    avoid = special_token_ids(model.config)
    pool = torch.tensor([i for i in range(3, 200) if i not in avoid])
    g = torch.Generator().manual_seed(seed)
    return [pool[torch.randint(0, len(pool), (n,), generator=g)] for n in lengths]


def _router_kwargs(model) -> dict:
    text = model.config.get_text_config()  # TRL trains a MoE model with its load-balancing loss on
    return {"output_router_logits": True} if getattr(text, "router_aux_loss_coef", 0.0) and hasattr(
        text, "output_router_logits") else {}


def _padded_reference(model, exs):
    """The model's own loss over a right-padded batch (attention mask, no position_ids), and its gradients."""
    model = copy.deepcopy(model)
    n = max(len(e) for e in exs)
    ids = torch.full((len(exs), n), int(exs[0][0]))
    mask = torch.zeros(len(exs), n, dtype=torch.long)
    labels = torch.full((len(exs), n), -100)
    for i, e in enumerate(exs):
        ids[i, : len(e)], mask[i, : len(e)], labels[i, : len(e)] = e, 1, e
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **_router_kwargs(model))
    out.loss.backward()
    return float(out.loss), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _trainer(model, mode, tmp_path, tokenizer, **config):
    import datasets

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=str(tmp_path), padding_free=mode, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, **config)
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[5, 6, 7]]})
    return PaddingFreeSFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=ds)


def _trainer_loss(model, mode, exs, tmp_path, tokenizer, before_loss=None, **config):
    """``PaddingFreeSFTTrainer.compute_loss`` on the collated examples, and the gradients (``before_loss`` runs once
    the trainer has enabled padding-free: the negative controls break the model there, after its self-check)."""
    trainer = _trainer(copy.deepcopy(model), mode, tmp_path, tokenizer, **config)
    trainer.model.train()
    if before_loss is not None:
        before_loss(trainer.model)
    loss = trainer.compute_loss(trainer.model, dict(PaddingFreeCollator()([{"input_ids": e} for e in exs])))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    return float(loss), grads


def _grad_error(test, ref) -> float:
    assert set(test) == set(ref)
    return max(float((test[k] - g).norm()) / max(float(g.norm()), 1e-8) for k, g in ref.items())


def _base(model_type, variant=None):
    model = tiny_model(model_type, variant=variant)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _whole_row(state, arguments, layout):
    """Negative control for _run_segments: the mixer over the whole packed row, boundaries dropped."""
    call = {k: v for k, v in arguments.items() if k not in stateful.BOUNDARY_KWARGS}
    call["attention_mask"] = None if "attention_mask" in call else None
    call = {k: v for k, v in call.items() if k in state.signature.parameters or any(
        p.kind is p.VAR_KEYWORD for p in state.signature.parameters.values())}
    return state.inner(**call)


# ---------------------------------------------------------------------------------- through the trainer


@pytest.mark.slow
@pytest.mark.parametrize("model_type, variant", CONFIGS, ids=[f"{t}-{v or 'defaults'}" for t, v in CONFIGS])
def test_trainer_loss_and_gradients_equal_padded(model_type, variant, tmp_path, tokenizer):
    base = _base(model_type, variant)
    assert set(stateful.describe(base)) == {FAMILIES[model_type]}
    exs = _examples(base)
    ref_loss, ref_grads = _padded_reference(base, exs)
    for mode in ("internal", "huggingface"):
        loss, grads = _trainer_loss(base, mode, exs, tmp_path, tokenizer)
        assert abs(loss - ref_loss) <= LOSS_ATOL, (mode, loss, ref_loss)
        assert _grad_error(grads, ref_grads) <= GRAD_RTOL, mode


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_negative_control_boundaries_dropped_at_the_stateful_layers_leak(model_type, tmp_path, tokenizer, monkeypatch):
    """The same trainer call, with every stateful layer run over the whole packed row: the loss or the gradients
    move far beyond the exactness tolerance (the attention layers still see the examples apart)."""
    base = _base(model_type)
    exs = _examples(base)
    ref_loss, ref_grads = _padded_reference(base, exs)
    loss, grads = _trainer_loss(base, "internal", exs, tmp_path, tokenizer,
                                before_loss=lambda m: monkeypatch.setattr(stateful, "_run_segments", _whole_row))
    loss_err, grad_err = abs(loss - ref_loss), _grad_error(grads, ref_grads)
    assert loss_err > 20 * LOSS_ATOL or grad_err > 20 * GRAD_RTOL, (loss_err, grad_err)


def test_negative_control_granite_hybrid_masks_without_positions(tmp_path, tokenizer, monkeypatch):
    """Granite 4.0-H's own mask builder is not given position_ids: without pf-trl's mask mapping (packed_masks) its
    sdpa attention lets the packed examples see each other, and huggingface mode is refused by the self-check.

    huggingface mode reroutes sdpa to pf-trl's per-segment attention (hf_sdpa), which reads no mask; the mask mapping
    is what keeps transformers' own dense path exact, so it is checked with the reroute off."""
    from pf_trl.attention import hf_sdpa, packed_masks

    base = _base("granitemoehybrid", "attention")
    monkeypatch.setattr(hf_sdpa, "reroute_refusal", lambda model: "the dense path under test")
    _trainer(copy.deepcopy(base), "huggingface", tmp_path, tokenizer)  # with the mask mapping: admitted
    monkeypatch.setattr(packed_masks, "install", lambda model: [])
    with pytest.raises(PaddingFreeError, match="self-check failed"):
        _trainer(copy.deepcopy(base), "huggingface", tmp_path, tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("model_type", ["mamba", "qwen3_5_text"])  # boundaries via the block pre-hook / kwargs
def test_gradient_checkpointing_recompute_restarts_too(model_type, reentrant, tmp_path, tokenizer, monkeypatch):
    base = _base(model_type)
    exs = _examples(base)
    ref_loss, ref_grads = _padded_reference(base, exs)
    calls = []
    run = stateful._run_segments

    def checkpointed(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        monkeypatch.setattr(stateful, "_run_segments", lambda *a: calls.append(torch.is_grad_enabled()) or run(*a))

    loss, grads = _trainer_loss(base, "internal", exs, tmp_path, tokenizer, before_loss=checkpointed)
    assert abs(loss - ref_loss) <= LOSS_ATOL and _grad_error(grads, ref_grads) <= GRAD_RTOL
    n_mixers = len(stateful.stateful_mixers(base))
    assert len(calls) == 2 * n_mixers  # forward, then the recompute in backward: both restarted per example


# ------------------------------------------------------------------------------------- the model path


def _alone_vs_packed(model, exs, **collator):
    batch = PaddingFreeCollator(**collator)([{"input_ids": e} for e in exs])
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).logits[0]
        alone = torch.cat([model(input_ids=e[None], use_cache=False).logits[0] for e in exs])
    return float((packed - alone).abs().max())


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mamba", "recurrent_gemma"])
def test_packed_by_position_ids_alone_is_exact(model_type):
    """A batch packed by position_ids only (no cu_seq_lens: e.g. DataCollatorWithFlattening's default): pf-trl
    derives the boundaries once and hands them to every layer."""
    model = enable_padding_free(_base(model_type).eval(), mode="huggingface")
    assert _alone_vs_packed(model, _examples(model), return_flash_kwargs=False) < 1e-5


@pytest.mark.parametrize("model_type", ["mamba2", "lfm2"])
def test_many_examples_of_equal_and_unequal_lengths(model_type):
    model = enable_padding_free(_base(model_type).eval(), mode="internal")
    lengths = (7, 7, 7, 1, 30, 2, 15, 7, 64, 3)
    assert _alone_vs_packed(model, _examples(model, seed=3, lengths=lengths)) < 1e-5


@pytest.mark.parametrize("model_type", ["mamba", "qwen3_5_text"])
def test_unpacked_calls_and_generation_are_unchanged(model_type):
    plain = _base(model_type).eval()
    model = enable_padding_free(copy.deepcopy(plain), mode="huggingface")
    exs = _examples(plain, lengths=(6, 9))
    ids = torch.stack([torch.cat([exs[0], exs[0][:3]]), exs[1]])
    mask = torch.tensor([[1] * 6 + [0] * 3, [1] * 9])
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
        b = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert_bit_equal(a, b, why="an unpacked call (a padding mask, no packed positions) runs the model's own "
                     "operations unchanged")
    prompt = exs[1][None]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(plain.generate(prompt, **kwargs), model.generate(prompt, **kwargs))


# ------------------------------------------------------------------------------------------ refusals


def test_a_mixer_reached_without_boundaries_on_a_packed_row_raises():
    model = enable_padding_free(_base("mamba").eval(), mode="internal")
    for block in model.backbone.layers:  # a block that would drop the boundaries on the way to its mixer
        block._forward_pre_hooks.clear()
    batch = PaddingFreeCollator()([{"input_ids": e} for e in _examples(model)])
    batch.pop("labels")
    with pytest.raises(PaddingFreeError, match="MambaMixer.*without its example boundaries"):
        model(**batch)


def test_cache_mask_and_bad_boundaries_at_a_mixer_raise():
    model = enable_padding_free(_base("qwen3_5_text").eval(), mode="internal")
    mixer = next(m for _, m in stateful.stateful_mixers(model))
    h = torch.randn(1, 10, model.config.hidden_size)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(PaddingFreeError, match="cache"):
        mixer(h, cache=transformers.DynamicCache(config=model.config), cu_seq_lens_q=cu)
    with pytest.raises(PaddingFreeError, match="attention_mask"):
        mixer(h, attention_mask=torch.ones(1, 10, dtype=torch.long), cu_seq_lens_q=cu)
    with pytest.raises(PaddingFreeError, match="does not partition"):
        mixer(h, cu_seq_lens_q=torch.tensor([0, 4, 12], dtype=torch.int32))
    with pytest.raises(PaddingFreeError, match="does not partition"):
        mixer(h, cu_seq_lens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32))


def test_kernels_path_is_refused_where_no_kernel_runs():
    model = enable_padding_free(_base("mamba2").eval(), mode="internal")
    stateful.set_stateful_path(model, "kernels")
    batch = PaddingFreeCollator()([{"input_ids": e} for e in _examples(model)])
    batch.pop("labels")
    with pytest.raises(PaddingFreeError, match="'kernels'.*cannot run here"):
        model(**batch)
    assert stateful.choose_path("mamba2", "auto", torch.device("cpu"), 1) == "segments"
    assert stateful.choose_path("mamba", "auto", torch.device("cuda"), 1) == "segments"  # no boundaries in its kernel
    with pytest.raises(ValueError, match="stateful path"):
        stateful.set_stateful_path(model, "fast")


# ------------------------------------------------------------------------------------------ the layout


def test_layout_agrees_with_transformers_seq_idx_and_every_source():
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": list(range(3, 3 + n))} for n in (4, 1, 6)]
    hf = DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True)(features)
    ours = PaddingFreeCollator()(features)
    from_cu = PackedLayout.from_cu_seqlens(ours["cu_seq_lens_q"], 1, 11)
    assert from_cu.lengths == (4, 1, 6) and from_cu.packed
    assert PackedLayout.from_positions(ours["position_ids"]).lengths == from_cu.lengths
    assert PackedLayout.from_seq_idx(hf["seq_idx"]).lengths == from_cu.lengths
    assert torch.equal(from_cu.seq_idx(torch.device("cpu")), hf["seq_idx"].to(torch.int32))
    assert torch.equal(from_cu.cu_seqlens(torch.device("cpu")), hf["cu_seq_lens_q"].to(torch.int32))
    with pytest.raises(PaddingFreeError, match="crosses a row"):
        PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 8]), 2, 4)


@pytest.mark.parametrize("seed", range(5))
def test_segment_plan_is_a_permutation_with_bounded_padding(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = tuple(int(x) for x in torch.randint(1, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g))
    groups = plan_groups(lengths)
    assert sorted(i for grp in groups for i in grp) == list(range(len(lengths)))
    for grp in groups:
        width = lengths[grp[0]]
        assert all(lengths[i] <= width for i in grp)
        assert len(grp) == 1 or len(grp) * width <= (1 + stateful.GROUP_SLACK) * sum(lengths[i] for i in grp)
    plan = SegmentPlan.build(lengths, torch.device("cpu"))
    row = torch.arange(sum(lengths))
    batches = torch.cat([row.index_select(0, grp.gather) for grp in plan.groups])
    assert torch.equal(batches.index_select(0, plan.inverse), row)  # out and back: every token in place
    # each padded batch row holds one example, from its first token, padded by repeating its last token
    starts = torch.tensor((0, *lengths)).cumsum(0)
    for grp, members in zip(plan.groups, groups):
        for slot, i in enumerate(members):
            got = grp.gather[slot * grp.width : (slot + 1) * grp.width]
            want = torch.clamp(torch.arange(grp.width), max=lengths[i] - 1) + starts[i]
            assert torch.equal(got, want)


# --------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_pf_trl_train_end_to_end_on_a_tiny_hybrid(tmp_path, sample_rows, monkeypatch):
    """`pf-trl train` on a tiny Granite 4.0-H (Mamba2 + attention + MoE), one step over 8 examples: the
    padding-free loss equals the padded run's (padding_free none: TRL's padded batch of the same 8 examples)."""
    import json

    from pf_trl.cli.main import main

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sample_rows[:8]))
    overrides = "hidden_size=64,intermediate_size=64,shared_intermediate_size=128,mamba_n_heads=8,mamba_d_head=16"
    losses = {}
    for mode in ("internal", "huggingface", "none"):
        out = tmp_path / mode
        argv = (f"--model_name_or_path pf-trl/tiny-granite-4.0-h --model_overrides {overrides} "
                f"--training_data_path {data} --max_seq_len 128 --max_steps 1 --per_device_train_batch_size 8 "
                f"--max_tokens_per_batch 100000 --report_to none --save_strategy no --padding_free {mode} "
                f"--output_dir {out}")
        assert main(["train", *argv.split()]) == 0
        metrics = json.loads((out / "train_results.json").read_text())
        assert metrics["train_real_tokens"] > 0
        losses[mode] = metrics["train_loss"]
    for mode in ("internal", "huggingface"):
        assert abs(losses[mode] - losses["none"]) <= 1e-5 * max(1.0, abs(losses["none"])), losses
