"""Mixed precision on every path: the matrix precision x mode x backend through ``PaddingFreeSFTTrainer`` against
TRL's padded ``SFTTrainer`` (:mod:`pf_trl_dev.precision`: one step, loss and gradients, both against TRL's float32
run; pf-trl's error at most twice TRL's in the same precision), the kernels' autocast contract, and heads the loss
path cannot reproduce (Electra).

Before: ``bf16=True`` crashed both padding-free modes on the first attention layer (``RuntimeError: expected scalar
type Float but found BFloat16`` in the packed sdpa op: autocast hands over float32 queries next to bfloat16 values),
and a head whose projection does not read the last hidden state crashed the loss path (``mat1 and mat2 shapes cannot
be multiplied``). Negative controls: a packed row whose examples see each other, shuffled labels and a loss whose
log-softmax runs in bfloat16 all fail the same criterion.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from pf_trl_dev import precision as pm

from tolerances import BF16_LOSS_RTOL, assert_same_math

SLOW = pytest.mark.slow
# the cheapest cell (a 2-layer Llama under autocast, pf-trl's own kernels) runs in the fast lane; the others are slow
FAST = {("llama", "bf16", "internal", "sdpa")}


def _params():
    out = []
    for cell in pm.all_cells():
        marks = [] if cell in FAST else [SLOW]
        out.append(pytest.param(*cell, marks=marks, id="-".join(cell)))
    return out


@pytest.fixture(scope="module")
def matrix():
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return pm.Matrix()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize(("family", "precision", "mode", "backend"), _params())
def test_precision_cell(matrix, family, precision, mode, backend):
    """One step of pf-trl in ``precision``: loss and gradient errors against float32 at most twice TRL's padded run's
    (plus the float32 floor); float32 and float64 cells: within the floor (exact)."""
    reason = pm.cell_skip_reason(family, precision, mode, backend)
    if reason:
        pytest.skip(reason)
    cell = matrix.cell(family, precision, mode, backend)
    print(cell.line())
    assert cell.ok, cell.line()


def _one_segment(batch):
    """The packed row as one sequence: every example attends to the ones before it (the leak pf-trl prevents)."""
    batch = dict(batch)
    total = batch["input_ids"].shape[-1]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        batch[key] = torch.tensor([0, total], dtype=batch[key].dtype)
    batch["max_length_q"] = batch["max_length_k"] = total
    return batch


def _shuffled_labels(batch):
    batch = dict(batch)
    labels = batch["labels"].clone()
    keep = labels != -100
    order = torch.randperm(int(keep.sum()), generator=torch.Generator().manual_seed(0))
    labels[keep] = labels[keep][order]
    batch["labels"] = labels
    return batch


@pytest.mark.parametrize("mode", [pytest.param("huggingface", marks=SLOW), "internal"])
def test_a_leaking_row_fails_the_criterion(matrix, mode):
    """Negative control: the same cell with the examples of the packed row attending to each other fails (loss error
    ~13x TRL's, gradient error ~100x on the tiny Llama)."""
    cell = matrix.cell("llama", "bf16", mode, "auto" if mode == "huggingface" else "sdpa", corrupt=_one_segment)
    print(cell.line())
    assert not cell.ok
    assert cell.grad_err_pf > 10 * cell.grad_bound


@SLOW
def test_shuffled_labels_fail_the_criterion(matrix):
    cell = matrix.cell("mistral", "bf16", "internal", "sdpa", corrupt=_shuffled_labels)
    assert cell.loss_err_pf > 10 * cell.loss_bound and cell.grad_err_pf > 10 * cell.grad_bound


@SLOW
def test_a_bfloat16_log_softmax_fails_the_criterion(matrix, monkeypatch):
    """Negative control for the float32 statistics: the loss path's log-softmax in bfloat16 is caught."""
    from pf_trl.trainer import loss

    monkeypatch.setattr(loss, "loss_dtype", lambda dtype: torch.bfloat16)
    cell = matrix.cell("llama", "bf16", "internal", "sdpa")
    print(cell.line())
    assert not cell.ok


# ------------------------------------------------------------------------------------------- the kernels' contract


def _qkv(dtype_q=torch.float32, dtype_v=torch.bfloat16, t=23, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype_q).requires_grad_()
    k = torch.randn(t, hkv, d, generator=g).to(dtype_q).requires_grad_()
    v = torch.randn(t, hkv, d, generator=g).to(dtype_v).requires_grad_()
    return q, k, v


def _sdpa_reference(q, k, v, cu, *, window=None):
    """transformers' sdpa path under autocast, one segment at a time (4-D, explicit mask for a window)."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        n = b - a
        i = torch.arange(n)
        mask = (i[None, :] <= i[:, None])
        if window is not None:
            mask &= i[None, :] > i[:, None] - window
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_attention_takes_autocast_inputs_as_sdpa_does(window, half):
    """Under CPU autocast (bfloat16, and float16: the dtype fp16=True casts to on CUDA): float32 q/k next to a
    half-precision v (what a rotary model hands over) -> the output in the autocast dtype, as sdpa returns it, and
    within its rounding of sdpa's own result; gradients reach all three in their own dtypes. Outside autocast the
    same mixed inputs are refused by name (sdpa refuses them too)."""
    from pf_trl.attention import varlen_attention
    from pf_trl.errors import AttentionArgumentError

    q, k, v = _qkv(dtype_v=half)
    cu = torch.tensor([0, 9, 10, 23], dtype=torch.int32)
    with torch.autocast("cpu", dtype=half):
        out = varlen_attention(q, k, v, cu, cu, 13, 13, sliding_window=window)
        ref = _sdpa_reference(q, k, v, cu, window=window)
    assert out.dtype == ref.dtype == half
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    assert q.grad.dtype == torch.float32 and v.grad.dtype == half and bool(q.grad.abs().sum() > 0)
    with pytest.raises(AttentionArgumentError, match="different dtypes"):
        varlen_attention(q, k, v, cu, cu, 13, 13)


def test_sinks_and_softcap_keep_float32_statistics_under_autocast():
    """The blockwise kernel (softcap) and the sink rescale under autocast: statistics in float32, so the bfloat16
    result is the exact result on the bfloat16-rounded inputs, rounded once to bfloat16."""
    from pf_trl.attention import varlen_attention

    q, k, v = _qkv(dtype_v=torch.float32, seed=1)
    cu = torch.tensor([0, 14, 23], dtype=torch.int32)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2))
    kw = dict(softcap=5.0, sinks=sinks)
    exact = varlen_attention(*(x.detach().double() for x in (q, k, v)), cu, cu, 14, 14, softcap=5.0,
                             sinks=sinks.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen_attention(q, k, v, cu, cu, 14, 14, **kw).detach()
    assert out.dtype == torch.bfloat16
    rounded = varlen_attention(*(x.detach().bfloat16().double() for x in (q, k, v)), cu, cu, 14, 14, softcap=5.0,
                               sinks=sinks.double())
    # the bf16 inputs, float32 math, one rounding of the output
    assert float((out.double() - rounded).abs().max()) <= 2 ** -8 * float(rounded.abs().max()) * 2
    assert float((out.double() - exact).abs().max()) < 5e-2


def test_linear_head_under_autocast_is_trls_kernel():
    """The CPU loss path under autocast: the head's projection in bfloat16 (as the model's lm_head runs it), the
    log-softmax in float32: the same per-token terms and gradients as TRL's ChunkedLogProbFunction (its torch
    fallback on CPU). Negative control: a float32 projection differs (the backward used to recompute one)."""
    from trl.kernels import ChunkedLogProbFunction

    from pf_trl.trainer.loss import HeadPlan, supervised_loss_terms

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 32, generator=g)
    weight = torch.randn(300, 32, generator=g) * 0.5
    targets = torch.randint(0, 300, (40,), generator=g)
    head = torch.nn.Linear(32, 300, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)

    def run(fn):
        h = hidden.clone().requires_grad_()
        head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nll = fn(h)
        nll.sum().backward()
        return nll.detach(), h.grad, head.weight.grad.clone()

    mine = run(lambda h: supervised_loss_terms(head, h, targets, HeadPlan("linear"), chunk_size=16).nll)
    trl = run(lambda h: -ChunkedLogProbFunction.apply(h, head.weight, None, targets, 1.0, 128, None, 1.0,
                                                      ("log_probs",))[0])
    assert mine[0].dtype == torch.float32
    torch.testing.assert_close(mine[0], trl[0], atol=1e-5, rtol=1e-5)
    # gradients: the same bfloat16 operands; TRL accumulates the hidden-state GEMM in float32, pf-trl's chunk
    # rounds it to bfloat16 as autocast's own linear backward does: one bfloat16 rounding apart
    for a, b in zip(mine[1:], trl[1:]):
        assert float((a - b).norm() / b.norm()) < 2 ** -8
    fp32 = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, reduction="none")
    assert float((mine[0] - fp32).abs().max()) > 1e-3  # the projection did run in bfloat16


# ------------------------------------------------------------------------------------------- heads


def _electra_with_a_wider_head():
    from pf_trl_dev.tiny import causal_lm_class, tiny_config

    config = tiny_config("electra")
    config.embedding_size = 2 * config.hidden_size  # the head reads embedding_size features, after a transform
    torch.manual_seed(0)
    return pm._no_dropout(causal_lm_class("electra")(config).float())


def test_plan_head_sends_a_head_with_a_transform_to_the_model():
    """The head probe, on its own: the wider Electra head (its projection reads 2 x hidden_size features) takes the
    model's own forward; an Electra whose head could read the hidden state (same width) is caught by its logits."""
    from pf_trl.trainer.loss import head_in_features, plan_head

    wide = _electra_with_a_wider_head()
    assert head_in_features(wide.get_output_embeddings()) == 2 * wide.config.hidden_size
    plan = plan_head(wide)
    assert plan.path == "model" and "transform before the vocabulary projection" in plan.reason
    from pf_trl_dev.tiny import tiny_model

    same = tiny_model("electra")
    assert head_in_features(same.get_output_embeddings()) == same.config.hidden_size
    plan = plan_head(same)
    assert plan.path == "model" and "differ from transform(lm_head(hidden))" in plan.reason


@SLOW
@pytest.mark.parametrize("mode", ["huggingface", "internal"])
def test_a_head_with_a_transform_takes_the_models_own_head(mode):
    """ElectraForCausalLM (dense + gelu + LayerNorm to embedding_size, then the vocabulary projection): the loss
    path runs the model's own head at the supervised positions. The reference is the model's own padded loss (TRL's
    fused LM head cannot run this head): float32 equal, bf16 within the matrix criterion. Negative control: the
    plain linear path on it is the crash it used to be."""
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.trainer.loss import HeadPlan, supervised_loss_terms

    model = _electra_with_a_wider_head()
    family = pm.Family("electra", model, pm.text_rows(model.config.vocab_size), load_tokenizer())
    backend = "auto" if mode == "huggingface" else "sdpa"
    trainer = pm.pf_trainer(family, "float32", mode, backend)
    assert trainer.pf_head_plan.path == "model" and "transform" in trainer.pf_head_plan.reason
    reference = {p: pm.run_model_padded(family, p) for p in ("float32", "bf16")}
    for precision in ("float32", "bf16"):
        cell = pm.judge("electra", precision, mode, backend, pm.run_pf(family, precision, mode, backend),
                        reference[precision], reference["float32"])
        print(cell.line())
        assert cell.ok, cell.line()
    head = model.get_output_embeddings()
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        supervised_loss_terms(head, torch.randn(4, model.config.hidden_size), torch.zeros(4, dtype=torch.long),
                              HeadPlan("linear"))


# ------------------------------------------------------------------------------------------- the Python API


@SLOW
def test_python_api_bf16_trains_in_both_modes(tmp_path, monkeypatch):
    """The README's Python API with bf16=True on CPU (a chat JSONL, the default tiny model), both modes: evaluation
    (autocast, and bf16_full_eval's bfloat16 weights) and one training step run, and bf16 was on (each loss differs
    from the float32 run's, by bfloat16 rounding only)."""
    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

    path = chat_jsonl(tmp_path)
    losses = {}
    for mode in pm.MODES:
        for name, precision in (("fp32", {}), ("bf16", {"bf16": True}),
                                ("bf16_full_eval", {"bf16": True, "bf16_full_eval": True})):
            args = PaddingFreeConfig(output_dir=str(tmp_path / f"out-{mode}-{name}"), padding_free_mode=mode,
                                     use_cpu=True, max_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                                     seed=0, **precision)
            trainer = PaddingFreeSFTTrainer("pf-trl/tiny-llama", args=args, train_dataset=str(path),
                                            eval_dataset=str(path))
            losses[mode, name, "eval"] = trainer.evaluate()["eval_loss"]
            if name != "bf16_full_eval":
                losses[mode, name, "train"] = trainer.train().training_loss
    for mode in pm.MODES:
        for name, what in (("bf16", "train"), ("bf16", "eval"), ("bf16_full_eval", "eval")):
            fp32, half = losses[mode, "fp32", what], losses[mode, name, what]
            # bf16 was on: with bf16 ignored both runs are the same float32 operations in the same order, so equal
            # to the bit (the gap is small, 2e-6 relative seen: an untrained model's loss is ~log(vocab))
            assert half != fp32, losses
            assert_same_math(half, fp32, what=f"{mode} {name} {what} loss", rtol=BF16_LOSS_RTOL)


def chat_jsonl(tmp_path, n: int = 24):
    """A new user's first file: ``n`` chat rows."""
    import json

    path = tmp_path / "m.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. " * (1 + i % 4)}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
