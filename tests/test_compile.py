"""torch.compile with pf-trl: no graph break (= no host sync) in the model forward, at most two compilations over
packed batches of varying lengths, and the compiled trainer's loss equals the eager one.

Graph breaks and recompilations are counted with dynamo alone (``torch._dynamo.explain``, the ``eager`` backend):
they are decided while tracing, before any backend runs. Numerics are checked once through inductor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from pf_trl.batching.collator import PaddingFreeCollator, mark_dynamic_lengths

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)
# Mistral with a short sliding window: the window path of the kernel is traced too
ARCHS = {"pf-trl/tiny-llama": {}, "pf-trl/tiny-mistral": {"sliding_window": 4}}
# packed batches (example lengths); one holds a single example (a size-1 segment count must not recompile)
# (the second changes only the token count, the third the segment count, then one example, then the longest)
EPOCH = [(7, 12, 5), (12, 3, 4), (9, 3), (11,), (5, 5, 8)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny(name: str, mode: str):
    from pf_trl.attention import enable_padding_free
    from pf_trl.models import build_model

    model = build_model(name, attn_implementation="sdpa", seed=0, **TINY, **ARCHS[name])
    return enable_padding_free(model, mode=mode).train()


def packed(lengths, seed=0, **collator_kwargs):
    g = torch.Generator().manual_seed(seed)
    feats = [{"input_ids": torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()} for n in lengths]
    return PaddingFreeCollator(**collator_kwargs)(feats)


@pytest.mark.parametrize(
    "name,mode", [("pf-trl/tiny-llama", "internal"), ("pf-trl/tiny-llama", "huggingface"), ("pf-trl/tiny-mistral", "internal")]
)
def test_model_forward_has_no_graph_break(name, mode):
    model = tiny(name, mode)
    batch = packed((7, 12, 5))
    explained = torch._dynamo.explain(model)(**batch)
    reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("mode", ["internal", "huggingface"])
def test_autocast_forward_has_no_graph_break(mode):
    """bf16=True: the kernel entry's cast to the autocast dtype and its autocast-off region trace with the layer (no
    graph break), and the compiled output is the autocast dtype, as eager's."""
    model = tiny("pf-trl/tiny-mistral", mode)
    batch = packed((7, 12, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(**batch)
        eager = model(**batch).logits
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert eager.dtype == torch.bfloat16


def test_explain_sees_a_host_sync():
    # negative control: the position_ids-only path of pf_varlen sizes its segments on the host (documented as
    # eager-only); explain must report that, or the zeros above would prove nothing
    from pf_trl.attention.hf import hf_varlen_attention

    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    batch = packed((4, 5))
    fn = torch._dynamo.explain(hf_varlen_attention)
    assert fn(torch.nn.Module(), q, k, v, None, position_ids=batch["position_ids"]).graph_break_count >= 1
    flash = {name: batch[name] for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    assert torch._dynamo.explain(hf_varlen_attention)(torch.nn.Module(), q, k, v, None, **flash).graph_break_count == 0


def _compilations(model, mark: bool, batches: int = len(EPOCH)) -> tuple[int, list[torch.Tensor]]:
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    grads = []
    for i, lengths in enumerate(EPOCH[:batches]):
        batch = packed(lengths, seed=i)
        if mark:
            mark_dynamic_lengths(batch)
        model.zero_grad()
        compiled(**batch).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    return counter.frame_count, grads


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["internal", "huggingface"])
def test_at_most_two_compilations_over_an_epoch_of_packed_lengths(mode):
    model = tiny("pf-trl/tiny-llama", mode)
    frames, grads = _compilations(model, mark=True)
    assert frames <= 2
    # and the compiled steps are the model's own: same gradients as eager
    for i, lengths in enumerate(EPOCH):
        model.zero_grad()
        model(**packed(lengths, seed=i)).loss.backward()
        torch.testing.assert_close(grads[i], model.model.layers[0].self_attn.q_proj.weight.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_without_marking_lengths_dynamic_it_recompiles_more():
    # negative control for mark_dynamic_lengths: dynamo's automatic dynamic shapes alone recompile whenever a size
    # that has not changed so far changes (here the segment count at the third batch)
    frames, _ = _compilations(tiny("pf-trl/tiny-llama", "internal"), mark=False, batches=3)
    assert frames == 3


def _train_losses(tmp_path, ds, tokenizer, mode, **compile_kwargs):
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0,
                        **{**TINY, "vocab_size": len(tokenizer)})
    args = PaddingFreeConfig(
        output_dir=str(tmp_path / f"out-{mode}-{bool(compile_kwargs)}"), report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, learning_rate=1e-2, seed=0, per_device_train_batch_size=4,
        padding_free_mode=mode, max_length=None, use_cpu=True, dataloader_num_workers=0, gradient_checkpointing=False,
        **compile_kwargs,
    )
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def three_batches(sample_shards):
    from pf_trl.data.shards import load_shards

    ds = load_shards(sample_shards)
    keep = np.nonzero(np.asarray(ds["length"]) <= 120)[0][:12]
    return ds.select(keep.tolist()).flatten_indices()


@pytest.mark.slow
def test_compiled_trainer_loss_equals_eager(tmp_path, three_batches, tokenizer):
    # the user's path: PaddingFreeSFTTrainer(torch_compile=True) compiles the whole model (accelerate); the
    # backbone becomes one graph, the supervised-position loss runs eagerly after it (dynamo alone here: the
    # numerics of compiled code are test_inductor_matches_eager's)
    eager = _train_losses(tmp_path, three_batches, tokenizer, "internal")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _train_losses(tmp_path, three_batches, tokenizer, "internal", torch_compile=True,
                             torch_compile_backend="eager")
    assert len(compiled) == len(eager) >= 3
    np.testing.assert_allclose(compiled, eager, rtol=1e-5, atol=1e-5)
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


@pytest.mark.slow
def test_inductor_matches_eager():
    # numerics of the generated code (CPU C++), forward and backward, over changing packed lengths
    model = tiny("pf-trl/tiny-llama", "internal")
    compiled = torch.compile(model, backend="inductor")
    for i, lengths in enumerate([(7, 12, 5), (11,), (5, 2, 8)]):
        batch = packed(lengths, seed=i)
        mark_dynamic_lengths(batch)
        results = []
        for fn in (compiled, model):
            model.zero_grad()
            loss = fn(**batch).loss
            loss.backward()
            results.append((loss.detach(), model.model.layers[0].self_attn.k_proj.weight.grad.clone()))
        torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-4)
