"""pf-trl's CPU preference head (pf_trl/trainer/dpo_head.py) against TRL's fused-head kernel
(``trl.kernels.ChunkedLogProbFunction``, the one TRL's DPOTrainer runs): every field and every gradient, with the
logit scale and soft-cap, across chunk borders; each check beside a negative control."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pf_trl.trainer.dpo_head import OUTPUT_FIELDS, cpu_head_refusal, preference_head

VOCAB, HIDDEN = 2000, 16
TOKENS, CHUNK = 300, 128  # three chunks of pf's head, the last one short


def _inputs(seed: int = 0, tokens: int = TOKENS):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.5)
        head.bias.copy_(torch.randn(VOCAB, generator=g) * 0.1)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    targets = torch.randint(0, VOCAB, (tokens,), generator=g)
    return head, hidden, targets, torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)


def _run(impl: str, head, hidden, targets, g_logp, g_entropy, *, scale: float, softcap: float | None):
    """Fields and gradients (hidden, weight, bias) of ``sum(g_logp * log_probs + g_entropy * entropy)``."""
    head.zero_grad()
    hidden = hidden.clone().requires_grad_(True)
    if impl == "pf":
        out = preference_head(head, hidden, targets, scale=scale, softcap=softcap, fields=OUTPUT_FIELDS, chunk=CHUNK)
    else:
        from trl.kernels import ChunkedLogProbFunction

        values = ChunkedLogProbFunction.apply(hidden, head.weight, head.bias, targets, 1.0, 32768, softcap, scale,
                                              OUTPUT_FIELDS)
        out = dict(zip(OUTPUT_FIELDS, values, strict=True))
    (g_logp * out["log_probs"] + g_entropy * out["entropy"]).sum().backward()
    grads = {"hidden": hidden.grad, "weight": head.weight.grad.clone(), "bias": head.bias.grad.clone()}
    return {k: v.detach() for k, v in out.items()}, grads


def _differences(a, b) -> list[str]:
    (fa, ga), (fb, gb) = a, b
    bad = [name for name in OUTPUT_FIELDS if name != "is_top1"
           and not torch.allclose(fa[name], fb[name], rtol=1e-5, atol=1e-5)]
    if not torch.equal(fa["is_top1"], fb["is_top1"]):
        bad.append("is_top1")
    for name in ga:  # relative to each gradient's largest entry
        if float((ga[name] - gb[name]).abs().max()) > 1e-5 * float(ga[name].abs().max()):
            bad.append(f"grad {name}")
    return bad


def _precision(name: str):
    """The inputs' dtype and the context of a precision case: TRL's kernel computes the projection in autocast's
    dtype, else in the hidden states' dtype, and its statistics in float32."""
    if name == "bf16-autocast":
        return torch.float32, torch.autocast("cpu", dtype=torch.bfloat16)
    return getattr(torch, name), contextlib.nullcontext()


@pytest.mark.parametrize("scale, softcap, precision", [(1.0, None, "float32"), (0.25, 3.0, "float32"),
                                                        (0.25, 3.0, "bf16-autocast"), (1.0, None, "float64")])
def test_every_field_and_gradient_equals_trls_kernel(scale, softcap, precision):
    dtype, context = _precision(precision)
    head, hidden, targets, g_logp, g_entropy = _inputs()
    targets[:5] = _inputs()[0](hidden[:5]).argmax(-1)  # a few targets that are the top-1 (is_top1 true)
    head, hidden, g_logp, g_entropy = head.to(dtype), hidden.to(dtype), g_logp.to(dtype), g_entropy.to(dtype)
    with context:
        trl = _run("trl", head, hidden, targets, g_logp, g_entropy, scale=scale, softcap=softcap)
        pf = _run("pf", head, hidden, targets, g_logp, g_entropy, scale=scale, softcap=softcap)
    assert bool(trl[0]["is_top1"].any())
    assert _differences(trl, pf) == []
    # control: the transform is applied (another soft-cap is seen) and the gradient flows per token
    other = _run("pf", head, hidden, targets, g_logp, g_entropy, scale=scale, softcap=(softcap or 30.0) / 2)
    assert _differences(trl, other)
    swapped = _run("pf", head, hidden, targets, g_logp.flip(0), g_entropy, scale=scale, softcap=softcap)
    assert {"grad hidden", "grad weight"} <= set(_differences(trl, swapped))


def test_a_tie_with_an_earlier_token_is_not_a_top1_as_in_trl():
    head, hidden, _, g_logp, g_entropy = _inputs(tokens=8)
    with torch.no_grad():  # tokens 3 and 7 share their weights and win every row: equal logits, 3 comes first
        head.weight[3] = head.weight[7] = hidden.sum(0) * 10
        head.bias[3] = head.bias[7] = 0.0
    targets = torch.tensor([3, 7] * 4)
    trl = _run("trl", head, hidden, targets, g_logp, g_entropy, scale=1.0, softcap=None)
    pf = _run("pf", head, hidden, targets, g_logp, g_entropy, scale=1.0, softcap=None)
    assert trl[0]["is_top1"].tolist() == [True, False] * 4
    assert _differences(trl, pf) == []
    # control: the other token of the tie as target flips every row
    flipped = _run("pf", head, hidden, targets.flip(0), g_logp, g_entropy, scale=1.0, softcap=None)
    assert flipped[0]["is_top1"].tolist() == [False, True] * 4


def test_only_the_requested_fields_and_an_empty_call():
    head, hidden, targets, _, _ = _inputs(tokens=4)
    out = preference_head(head, hidden, targets)
    assert set(out) == {"log_probs"}
    hidden = hidden[:0].clone().requires_grad_(True)  # no scored token: a zero gradient, not an error
    out = preference_head(head, hidden, targets[:0], fields=("log_probs", "entropy"))
    assert out["log_probs"].shape == (0,)
    out["log_probs"].sum().backward()
    assert hidden.grad.shape == (0, HIDDEN) and float(head.weight.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="unknown fused-head fields"):
        preference_head(head, hidden, targets[:0], fields=("logits",))


def test_refusals_send_other_heads_to_trls_kernel():
    head = torch.nn.Linear(4, 8)
    assert cpu_head_refusal(head, torch.device("cpu")) is None
    assert cpu_head_refusal(head.to(torch.bfloat16), torch.device("cpu")) is None
    assert "device" in cpu_head_refusal(head, torch.device("meta"))
    assert "plain nn.Linear" in cpu_head_refusal(torch.nn.Sequential(head), torch.device("cpu"))


def _granite():
    """A tiny Granite: TRL's head divides its logits by ``logits_scaling`` (scale 4 here, so the logits are far from
    zero and a forgotten scale shows in every log-probability)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.dpo_support import TINY

    torch.manual_seed(0)
    config = AutoConfig.for_model("granite", vocab_size=32000, max_position_embeddings=512, logits_scaling=0.25,
                                  **TINY)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def _granite_trainer(tmp_path, **kw):
    import datasets

    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer
    from tests import dpo_support as S

    args = PaddingFreeDPOConfig(**S.fields(tmp_path, per_device_train_batch_size=2, **kw))
    rows = datasets.Dataset.from_list(S.pairs(2))
    return PaddingFreeDPOTrainer(_granite(), ref_model=_granite(), args=args, train_dataset=rows,
                                 processing_class=S.tokenizer())


def test_head_check_against_trls_head_on_the_model_at_hand(monkeypatch):
    """:func:`check_head_against_trl` compares pf-trl's head with TRL's fused head on a few positions of the model:
    it passes on Granite's scaled head and refuses, naming the model type and the fix, when pf-trl reads the
    transform wrong (the negative control); with TRL's head asked for there is nothing to check."""
    from trl.trainer.utils import add_fused_lm_head

    import pf_trl.trainer.dpo_forward as dpo_forward
    from pf_trl.errors import ModelSupportError

    model = _granite()
    fields = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(model, outputs=fields)  # as TRL's DPOTrainer installs it
    dpo_forward.install_packed_preference_forward(model, fields)
    assert dpo_forward.check_head_against_trl(model) < 1e-5
    # control: pf-trl forgets Granite's logits_scaling
    monkeypatch.setattr(dpo_forward, "head_transform_from_config", lambda config: (1.0, None))
    with pytest.raises(ModelSupportError, match=r"model type 'granite' \(log_probs: .*lm_head_kernel='trl'"):
        dpo_forward.check_head_against_trl(model)
    dpo_forward.install_packed_preference_forward(model, fields, head="trl")
    assert dpo_forward.check_head_against_trl(model) is None


@pytest.mark.slow
def test_the_trainer_checks_its_head_when_built_and_lm_head_kernel_trl_is_the_fix(tmp_path, monkeypatch):
    """PaddingFreeDPOTrainer runs the check when it is built (a head transform pf-trl reads wrong is refused before
    any training); ``lm_head_kernel='trl'``, the fix the refusal names, gives both models TRL's head."""
    import pf_trl.trainer.dpo_forward as dpo_forward
    from pf_trl.errors import ModelSupportError

    monkeypatch.setattr(dpo_forward, "head_transform_from_config", lambda config: (1.0, None))
    with pytest.raises(ModelSupportError, match=r"model type 'granite'"):
        _granite_trainer(tmp_path / "wrong")
    fixed = _granite_trainer(tmp_path / "fixed", lm_head_kernel="trl")
    assert fixed.pf_head_check is None
    assert fixed.model._pf_head == fixed.ref_model._pf_head == "trl"
