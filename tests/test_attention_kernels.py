"""varlen_attention backends vs a naive masked-softmax reference (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from pf_trl.attention import varlen_attention
from pf_trl.attention.dispatch import backend_status, flash_window, resolve_backend
from pf_trl.attention.errors import BackendUnavailableError, UnsupportedFeatureError

from tolerances import assert_bit_equal

CPU_BACKENDS = [name for name, reason in backend_status("cpu", torch.float32).items() if reason is None]
# every backend, so that one which cannot run on CPU (flash_attn, torch_varlen: CUDA only) shows as skipped, with why
BACKEND_PARAMS = [pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=f"{name}: {reason}"))
                  for name, reason in backend_status("cpu", torch.float32).items()]


def naive_reference(q, k, v, cu_q, cu_k, *, causal=True, scale=None, sliding_window=None, softcap=None, sinks=None):
    """Dense (T_q, T_k) masked softmax written from the definition, float64. ``sinks`` (one logit per head): one more
    score column per query, dropped after the softmax (transformers' gpt-oss eager attention)."""
    q, k, v = q.double(), k.double(), v.double()
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    scale = d**-0.5 if scale is None else scale
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    allowed = torch.zeros(tq, tk, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        sq, eq, sk, ek = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        lq, lk = eq - sq, ek - sk
        for i in range(lq):
            a = i + lk - lq
            for j in range(lk):
                ok = True
                if causal and j > a:
                    ok = False
                if sliding_window is not None:
                    if causal and j <= a - sliding_window:
                        ok = False
                    if not causal and abs(j - a) > sliding_window - 1:
                        ok = False
                allowed[sq + i, sk + j] = ok
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().view(hq, 1, 1).expand(hq, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_inputs(lengths, hq=4, hkv=2, d=16, seed=0, kv_lengths=None, shared_cu=False):
    g = torch.Generator().manual_seed(seed)
    kv_lengths = kv_lengths or lengths
    tq, tk = sum(lengths), sum(kv_lengths)
    q = torch.randn(tq, hq, d, generator=g)
    k = torch.randn(tk, hkv, d, generator=g)
    v = torch.randn(tk, hkv, d, generator=g)
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(kv_lengths).cumsum(0).tolist()], dtype=torch.int32)
    if shared_cu:  # one tensor for both layouts, as pf_varlen passes it for self-attention (sdpa's fast path)
        assert kv_lengths == lengths
        cu_k = cu_q
    return q, k, v, cu_q, cu_k, max(lengths), max(kv_lengths)


LAYOUTS = {
    "uneven": [5, 1, 9, 3],
    "one_token_segments": [1, 1, 1, 4, 1],
    "single_full_row": [17],
}


def test_cpu_has_sdpa_and_flex():
    assert "sdpa" in CPU_BACKENDS
    assert resolve_backend("auto", device=torch.device("cpu"), dtype=torch.float32) == "sdpa"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("shared_cu", [False, True], ids=["cu_q_k", "one_cu"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "features",
    [
        {},
        {"hkv": 4},  # MHA
        {"hkv": 1},  # MQA
        {"sliding_window": 3},
        {"softcap": 2.0},
        {"sliding_window": 2, "softcap": 5.0},
        {"causal": False},
        {"causal": False, "sliding_window": 3},
        {"softmax_scale": 0.3},
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain",
)
def test_forward_matches_reference(backend, shared_cu, layout, features):
    features = dict(features)
    hkv = features.pop("hkv", 2)
    q, k, v, cu_q, cu_k, mq, mk = make_inputs(LAYOUTS[layout], hkv=hkv, shared_cu=shared_cu)
    out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=backend, **features)
    ref = naive_reference(
        q,
        k,
        v,
        cu_q,
        cu_k,
        causal=features.get("causal", True),
        scale=features.get("softmax_scale"),
        sliding_window=features.get("sliding_window"),
        softcap=features.get("softcap"),
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("shared_cu", [False, True], ids=["cu_q_k", "one_cu"])
@pytest.mark.parametrize("features", [{}, {"sliding_window": 3, "softcap": 3.0}], ids=["plain", "window_softcap"])
def test_backward_matches_reference(backend, shared_cu, features):
    if backend == "flex":
        q, k, v, cu_q, cu_k, mq, mk = make_inputs([3, 2])
        with pytest.raises(UnsupportedFeatureError, match="backward"):
            varlen_attention(q.requires_grad_(), k, v, cu_q, cu_k, mq, mk, backend="flex")
        return
    q, k, v, cu_q, cu_k, mq, mk = make_inputs([6, 1, 10, 3], hkv=2, seed=1, shared_cu=shared_cu)
    grads = []
    for fn in ("backend", "ref"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if fn == "backend":
            out = varlen_attention(qq, kk, vv, cu_q, cu_k, mq, mk, backend=backend, **features).double()
        else:
            out = naive_reference(qq, kk, vv, cu_q, cu_k, **features)
        w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        (out * w).sum().backward()
        grads.append([t.grad.double() for t in (qq, kk, vv)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_fewer_queries_than_keys_is_bottom_right_aligned(backend):
    # decode-like call: each segment has its last 1-2 tokens as queries over all its keys
    q, k, v, cu_q, cu_k, mq, mk = make_inputs([1, 2, 1], kv_lengths=[4, 6, 1], seed=2)
    for window in (None, 2):
        out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend=backend, sliding_window=window)
        ref = naive_reference(q, k, v, cu_q, cu_k, sliding_window=window)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_segments_are_isolated():
    q, k, v, cu_q, cu_k, mq, mk = make_inputs([4, 6], seed=3)
    out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk)
    k2, v2 = k.clone(), v.clone()
    k2[:4] += 10.0
    v2[:4] -= 3.0
    out2 = varlen_attention(q, k2, v2, cu_q, cu_k, mq, mk)
    # segment 2 never sees segment 1
    assert_bit_equal(out[4:], out2[4:], why="segment 2's rows come from its own unchanged q, k, v by the same "
                     "operations: a bit changed by segment 1's keys is a leak")


def test_dropout_runs_and_is_deterministic_in_eval():
    q, k, v, cu_q, cu_k, mq, mk = make_inputs([5, 7], seed=4)
    out = varlen_attention(q, k, v, cu_q, cu_k, mq, mk, dropout_p=0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_flash_window_convention():
    assert flash_window(True, None) == (-1, -1)
    assert flash_window(True, 4) == (3, 0)
    assert flash_window(False, 4) == (3, 3)
    with pytest.raises(ValueError):
        flash_window(True, 0)


def test_explicit_unavailable_backend_raises_with_install_hint():
    q, k, v, cu_q, cu_k, mq, mk = make_inputs([3, 2])
    with pytest.raises(BackendUnavailableError, match="pip install flash-attn"):
        varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend="flash_attn")
    with pytest.raises(BackendUnavailableError, match="torch_varlen"):
        varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend="torch_varlen")
    with pytest.raises(ValueError, match="unknown varlen attention backend"):
        varlen_attention(q, k, v, cu_q, cu_k, mq, mk, backend="nope")


def test_shape_validation():
    q, k, v, cu_q, cu_k, mq, mk = make_inputs([3, 2], hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q, k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="total_tokens"):
        varlen_attention(q[None], k, v, cu_q, cu_k, mq, mk)


def test_auto_on_cuda_skips_flex_for_a_softcap(monkeypatch):
    """The compiled flex kernel fails with the softcap score_mod on CUDA (seen on an H200, torch 2.11): `auto` passes
    to sdpa there, and an explicit flex says why. Negative control: without a softcap, flex is chosen."""
    from pf_trl.attention import dispatch

    here = {"flex", "sdpa"}  # as on a CUDA machine without flash-attn, where torch_varlen has no softcap anyway
    monkeypatch.setattr(dispatch, "_unavailable", lambda name, device, dtype: None if name in here else "absent")
    cuda = torch.device("cuda")
    bf16 = torch.bfloat16
    assert dispatch.resolve_backend("auto", device=cuda, dtype=bf16, requires_grad=True) == "flex"
    assert dispatch.resolve_backend("auto", device=cuda, dtype=bf16, softcap=30.0, requires_grad=True) == "sdpa"
    with pytest.raises(UnsupportedFeatureError, match="softcap"):
        dispatch.resolve_backend("flex", device=cuda, dtype=torch.bfloat16, softcap=30.0)
    assert dispatch.resolve_backend("flex", device=torch.device("cpu"), dtype=torch.float32, softcap=30.0) == "flex"
