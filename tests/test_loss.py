"""Chunked cross-entropy == plain cross-entropy (loss, top-1 count, gradients), without the full logits.

``chunked_cross_entropy`` is TRL's chunked log-prob kernel (``chunk_size``: vocabulary columns per tile);
``supervised_loss_terms`` is the trainer's loss (on CPU: token chunks under activation checkpointing).
"""

from __future__ import annotations

import pytest
import torch
from loss_reference import chunked_cross_entropy, linear_cross_entropy, plain_cross_entropy

from pf_trl.trainer.loss import resolve_fused_loss


def _case(n=37, h=16, v=101, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


def _grads(fn, hidden, weight, bias, targets):
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    loss, correct = fn(hidden, weight, targets, bias)
    (loss / targets.numel()).backward()
    return loss.detach(), int(correct), [t.grad.clone() for t in (hidden, weight, bias) if t is not None]


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_plain(chunk, bias):
    hidden, weight, b, targets = _case(bias=bias)
    ref_loss, ref_correct, ref_grads = _grads(plain_cross_entropy, hidden, weight, b, targets)
    loss, correct, grads = _grads(
        lambda h, w, t, bb: chunked_cross_entropy(h, w, t, bb, chunk_size=chunk), hidden, weight, b, targets
    )
    assert correct == ref_correct
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_mean_loss_matches_at_1e_6_fp32():
    hidden, weight, b, targets = _case(n=300, h=32, v=2000)
    ref, _ = plain_cross_entropy(hidden, weight, targets, b)
    got, _ = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=64)
    assert abs(float(got) / 300 - float(ref) / 300) < 1e-6


def test_no_grad_and_empty():
    hidden, weight, b, targets = _case()
    with torch.no_grad():
        loss, _ = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=5)
        ref, _ = plain_cross_entropy(hidden, weight, targets, b)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5)
    empty, correct = chunked_cross_entropy(hidden[:0], weight, targets[:0])
    assert float(empty) == 0.0 and int(correct) == 0
    empty.backward()  # stays connected to the graph: an all-masked micro-batch does not break backward
    assert weight.grad is not None


def test_input_validation_and_dispatch():
    hidden, weight, b, targets = _case()
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, targets[:-1])
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, targets, chunk_size=0)
    assert resolve_fused_loss("auto", torch.device("cpu")) == "chunked"
    with pytest.raises(ValueError, match="liger"):
        resolve_fused_loss("liger", torch.device("cpu"))
    a, _ = linear_cross_entropy(hidden, weight, targets, b, impl="none")
    c, _ = linear_cross_entropy(hidden, weight, targets, b, impl="chunked", chunk_size=3)
    torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-5)


def _linear_head(weight, bias):
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    head.weight = torch.nn.Parameter(weight.detach().clone())
    if bias is not None:
        head.bias = torch.nn.Parameter(bias.detach().clone())
    return head


@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (0.125, None), (1.0, 2.0), (0.5, 3.0)])
@pytest.mark.parametrize("path", ["linear", "module"])
def test_trainer_loss_paths_apply_the_head_transform(scale, softcap, path):
    from pf_trl.trainer.loss import HeadPlan, supervised_loss_terms

    hidden, weight, b, targets = _case(n=40, v=300)
    weight = (weight * 10).detach().requires_grad_()  # logits large enough for softcap to matter
    ref_loss, _, ref_grads = _grads(
        lambda h, w, t, bb: plain_cross_entropy(h, w, t, bb, logit_scale=scale, softcap=softcap), hidden, weight, b, targets)
    fused_loss, _ = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=64, logit_scale=scale, softcap=softcap)
    torch.testing.assert_close(fused_loss, ref_loss, rtol=1e-5, atol=1e-4)
    head = _linear_head(weight, b)
    h = hidden.detach().clone().requires_grad_()
    terms = supervised_loss_terms(head, h, targets, HeadPlan(path, scale, softcap), chunk_size=16)
    (terms.nll.sum() / targets.numel()).backward()
    torch.testing.assert_close(terms.nll.sum(), ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.grad, ref_grads[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, ref_grads[1], rtol=1e-4, atol=1e-6)
    if scale != 1.0 or softcap is not None:  # negative control: the transform matters at this size
        plain, _ = plain_cross_entropy(hidden, weight, targets, b)
        assert abs(float(plain) - float(ref_loss)) > 1.0


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bf16_autocast_numerics_and_grad_dtype(weight_dtype):
    """bf16 autocast (fp32 or bf16 weights): loss and grads near the fp64 reference, grads in the weight's dtype."""
    from pf_trl.trainer.loss import HeadPlan, supervised_loss_terms

    hidden64, weight64, _, targets = _case(n=64, h=32, v=512, bias=False)
    ref_h = hidden64.detach().double().requires_grad_()
    ref_w = weight64.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_h @ ref_w.t(), targets, reduction="sum")
    ref.backward()
    head = _linear_head(weight64.to(weight_dtype), None)
    h = hidden64.detach().to(weight_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = supervised_loss_terms(head, h, targets, HeadPlan("linear"), chunk_size=16).nll.sum()
    loss.backward()
    assert head.weight.grad.dtype == weight_dtype and h.grad.dtype == weight_dtype
    assert abs(float(loss) - float(ref)) / float(ref) < 2e-2
    rel = float((head.weight.grad.double() - ref_w.grad).norm() / ref_w.grad.norm())
    assert rel < 3e-2


def test_no_vocab_by_hidden_tensor_is_kept_for_backward():
    """Between forward and backward the loss keeps O(tokens x hidden), never a [vocab, hidden] gradient buffer."""
    from pf_trl.trainer.loss import HeadPlan, supervised_loss_terms

    hidden, weight, _, targets = _case(n=64, h=16, v=1024, bias=False)
    head = _linear_head(weight, None)
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() != head.weight.untyped_storage().data_ptr():
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        supervised_loss_terms(head, hidden, targets, HeadPlan("linear"), chunk_size=16).nll.sum()
    assert saved and max(saved) < weight.numel()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # negative control: the full logits are kept
        plain_cross_entropy(hidden, head.weight, targets)
    assert max(saved) >= 64 * 1024
