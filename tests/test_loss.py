"""Chunked cross-entropy == plain cross-entropy (loss, top-1 count, gradients), without the full logits."""

from __future__ import annotations

import pytest
import torch

from pf_trl.trainer.loss import chunked_cross_entropy, linear_cross_entropy, plain_cross_entropy, resolve_fused_loss


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
