"""Attention sinks in pf-trl's varlen kernels vs transformers' eager definition (an extra softmax column per head).

Forward on every CPU backend, gradients (q, k, v and the sinks) on the backends that train on CPU, the exact
gradient of the log-sum-exp rescale for kernels whose lse has none (flash-attn, PyTorch's varlen op: checked here
with the sdpa kernel's lse detached), and negative controls (sinks dropped; lse gradient dropped).
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kernels import naive_reference

from pf_trl.attention import varlen_attention
from pf_trl.attention.backends import _sinks
from pf_trl.attention.backends import sdpa as sdpa_backend
from pf_trl.attention.dispatch import backend_status, flash_window

from tolerances import assert_bit_equal

CPU_BACKENDS = [name for name, reason in backend_status("cpu", torch.float32).items() if reason is None]


def eager_reference(q, k, v, cu_q, cu_k, sinks, *, causal=True, scale=None, sliding_window=None):
    """transformers' gpt-oss eager attention, densely in float64: the sink as one more score column per query."""
    return naive_reference(q, k, v, cu_q, cu_k, causal=causal, scale=scale, sliding_window=sliding_window, sinks=sinks)


def make_inputs(lengths, hq=4, hkv=2, d=16, seed=0, kv_lengths=None):
    g = torch.Generator().manual_seed(seed)
    kv_lengths = kv_lengths or lengths
    q = torch.randn(sum(lengths), hq, d, generator=g)
    k = torch.randn(sum(kv_lengths), hkv, d, generator=g)
    v = torch.randn(sum(kv_lengths), hkv, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 2  # some heads dominated by the sink, some not
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = cu_q if kv_lengths == lengths else torch.tensor([0, *torch.tensor(kv_lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, sinks, cu_q, cu_k, max(lengths), max(kv_lengths)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "features",
    [{}, {"hkv": 4}, {"hkv": 1}, {"sliding_window": 3}, {"causal": False}, {"softmax_scale": 0.3}],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain",
)
def test_forward_with_sinks_matches_eager(backend, features):
    features = dict(features)
    hkv = features.pop("hkv", 2)
    q, k, v, sinks, cu_q, cu_k, mq, mk = make_inputs([5, 1, 9, 3], hkv=hkv)
    out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=backend, sinks=sinks, **features)
    ref = eager_reference(q, k, v, cu_q, cu_k, sinks, causal=features.get("causal", True),
                          scale=features.get("softmax_scale"), sliding_window=features.get("sliding_window"))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # negative control: the same call without its sinks is far from eager's
    plain = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=backend, **features)
    assert (plain.double() - ref).abs().max() > 1e-2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sinks_with_fewer_queries_than_keys(backend):
    q, k, v, sinks, cu_q, cu_k, mq, mk = make_inputs([1, 2, 1], kv_lengths=[4, 6, 1], seed=2)
    out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=backend, sinks=sinks, sliding_window=2)
    ref = eager_reference(q, k, v, cu_q, cu_k, sinks, sliding_window=2)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _grads(fn, q, k, v, sinks):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out = fn(*leaves).double()
    w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    (out * w).sum().backward()
    return [t.grad.double() for t in leaves]


@pytest.mark.parametrize("features", [{}, {"sliding_window": 3}], ids=["full", "sliding"])
def test_backward_with_sinks_matches_eager(features):
    q, k, v, sinks, cu_q, cu_k, mq, mk = make_inputs([6, 1, 10, 3], seed=1)
    got = _grads(lambda q, k, v, s: varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend="sdpa", sinks=s, **features),
                 q, k, v, sinks)
    want = _grads(lambda q, k, v, s: eager_reference(q, k, v, cu_q, cu_k, s, **features), q, k, v, sinks)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(got[3], want[3], atol=1e-5, rtol=1e-5, msg="sinks")
    assert want[3].abs().max() > 1e-3  # the sinks do get a gradient


def _kernel_without_lse_gradient(cu, mq, window):
    """The sdpa kernel as flash-attn / PyTorch's varlen op present themselves: an lse that carries no gradient."""
    opts = dict(causal=True, scale=16**-0.5, window=window, softcap=0.0, dropout_p=0.0)

    def attend_lse(q, k, v):
        out, lse = sdpa_backend.forward(q, k, v, cu, cu, mq, mq, with_lse=True, **opts)
        return out, lse.detach()

    def attend(q, k, v):
        return sdpa_backend.forward(q, k, v, cu, cu, mq, mq, **opts)

    return attend_lse, attend


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding"])
def test_lse_gradient_for_kernels_whose_lse_has_none(window):
    q, k, v, sinks, cu, _, mq, _ = make_inputs([6, 1, 10, 3], seed=3)
    attend_lse, attend = _kernel_without_lse_gradient(cu, mq, flash_window(True, window))
    want = _grads(lambda q, k, v, s: eager_reference(q, k, v, cu, cu, s, sliding_window=window), q, k, v, sinks)
    got = _grads(lambda q, k, v, s: _sinks.attend_with_sinks(attend_lse, attend, q, k, v, s, scale=16**-0.5),
                 q, k, v, sinks)
    for name, a, b in zip(["q", "k", "v", "sinks"], got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    # negative control: the same rescale without the lse gradient gets q and k wrong (v and the sinks stay right)
    dropped = _grads(lambda q, k, v, s: _sinks.attend_with_sinks(attend_lse, None, q, k, v, s, scale=16**-0.5),
                     q, k, v, sinks)
    assert (dropped[0] - want[0]).abs().max() > 1e-3 and (dropped[1] - want[1]).abs().max() > 1e-3
    torch.testing.assert_close(dropped[2], want[2], atol=1e-5, rtol=1e-5)


def test_lse_gradient_value_is_the_kernels_lse():
    q, k, v, sinks, cu, _, mq, _ = make_inputs([4, 7], seed=4)
    attend_lse, attend = _kernel_without_lse_gradient(cu, mq, (-1, -1))
    _, lse = attend_lse(q, k, v)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    assert_bit_equal(_sinks.lse_with_gradient(lse, qq, kk, attend, 16**-0.5), lse,
                     why="the value is the kernel's lse plus terms x - x.detach(), each exactly 0")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_query_that_sees_no_key_outputs_zeros_with_sinks(backend):
    # three queries over one key, bottom-right aligned: the first two see no key (eager: all mass on the sink)
    q, k, v, sinks, cu_q, cu_k, mq, mk = make_inputs([3, 2], kv_lengths=[1, 2])
    out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=backend, sinks=sinks)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and out[2].abs().max() > 0
    torch.testing.assert_close(out.double(), eager_reference(q, k, v, cu_q, cu_k, sinks), atol=1e-5, rtol=1e-5)


def test_sinks_shape_is_checked():
    q, k, v, sinks, cu_q, cu_k, mq, mk = make_inputs([3, 2])
    with pytest.raises(ValueError, match="one value per query head"):
        varlen_attention(q, k, v, cu_q, cu_k, mq, mk, sinks=sinks[:2])


@pytest.mark.slow
def test_gpu_sinks_check_dry_run(tmp_path):
    """The GPU run book's sinks stage stays runnable between GPU sessions (CPU, tiny sizes)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "sinks_check.py"
    done = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "sinks_check.json").read_text())
    assert [r for r in result["kernels"] if r["backend"] == "sdpa" and r["status"] == "ok"]
    assert result["gpt_oss"][0]["loss_err"] < 1e-5
