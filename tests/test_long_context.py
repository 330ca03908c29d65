"""Long packed rows: attention memory linear in the row on every CPU path, exact.

- the blockwise kernel (windows, softcap, dropout, bottom-right alignment, a gradient on the log-sum-exp) against a
  float64 reference, with blocks small enough that every block boundary case occurs;
- no tensor of size ``T x T`` is created by a forward + backward of a packed row in either mode (a dispatch mode
  records every tensor an op creates); negative control: transformers' own sdpa on the same packed row does;
- ``huggingface`` mode reroutes sdpa models to the per-segment path, and keeps transformers' path where it cannot.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_kernels import make_inputs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pf_trl.attention.backends import blockwise
from pf_trl.batching.collator import PaddingFreeCollator


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK", 4)


def _reference_with_lse(q, k, v, cu_q, cu_k, *, causal=True, sliding_window=None, softcap=None, scale=None):
    """Output and log-sum-exp ``(H, Tq)`` written from the definition (float64, differentiable)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kk = k64.repeat_interleave(hq // hkv, 1)
    vv = v64.repeat_interleave(hq // hkv, 1)
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        sq, eq, sk, ek = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        lq, lk = eq - sq, ek - sk
        a = torch.arange(lq)[:, None] + lk - lq
        j = torch.arange(lk)[None, :]
        vis = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            vis &= j <= a
        if sliding_window is not None:
            vis &= (j > a - sliding_window) if causal else ((j - a).abs() <= sliding_window - 1)
        sc = torch.einsum("qhd,khd->hqk", q64[sq:eq], kk[sk:ek]) * scale
        if softcap:
            sc = softcap * torch.tanh(sc / softcap)
        sc = sc.masked_fill(~vis, float("-inf"))
        lse = torch.logsumexp(sc, -1)
        probs = torch.exp(sc - lse[..., None].clamp(min=-1e30)).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vv[sk:ek]))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


FEATURES = [
    {},
    {"sliding_window": 3},
    {"sliding_window": 6, "softcap": 2.0},
    {"softcap": 3.0},
    {"causal": False, "sliding_window": 3},
    {"causal": False},
]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("kv", ["self", "decode"])
def test_blockwise_matches_reference_across_block_boundaries(small_blocks, features, kv):
    from pf_trl.attention.backends import sdpa

    lengths = [13, 1, 9, 4]
    kv_lengths = lengths if kv == "self" else [17, 3, 9, 11]
    q, k, v, cu_q, cu_k, *_ = make_inputs(lengths, kv_lengths=kv_lengths, hq=4, hkv=2, d=8, seed=5)
    features = {"causal": True, **features}
    window = features.get("sliding_window")
    left = -1 if window is None else window - 1
    right = -1 if (window is None or features["causal"]) else window - 1
    grads = []
    for impl in ("blockwise", "reference"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        if impl == "blockwise":
            # the general path for every segment (a softcap of 0 would take the fused kernel where it can)
            out, lse = sdpa.varlen_sdpa(qq, kk, vv, cu_q, cu_k, features["causal"], q.shape[-1] ** -0.5, left, right,
                                        float(features.get("softcap", 0.0)), 0.0, None) if features.get("softcap") \
                else _blockwise_only(qq, kk, vv, cu_q, cu_k, features["causal"], left, right)
        else:
            out, lse = _reference_with_lse(qq, kk, vv, cu_q, cu_k, causal=features["causal"], sliding_window=window,
                                           softcap=features.get("softcap"))
        w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        wl = torch.linspace(0.5, -0.5, lse.numel(), dtype=torch.float64).reshape(lse.shape)
        seen = torch.isfinite(lse)
        loss = (out.double() * w).sum() + (torch.where(seen, lse.double(), 0.0) * wl).sum()  # a gradient on lse too
        loss.backward()
        grads.append((out.detach().double(), torch.where(seen, lse.detach().double(), 0.0),
                      [t.grad.double() for t in (qq, kk, vv)]))
    (o1, l1, g1), (o2, l2, g2) = grads
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _blockwise_only(q, k, v, cu_q, cu_k, causal, left, right):
    """The blockwise kernel on every segment, through autograd of its own forward/backward pair."""

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            outs, lses = [], []
            for s in range(len(cu_q) - 1):
                sq, eq, sk, ek = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
                o, l = blockwise.forward(q[sq:eq], k[sk:ek], v[sk:ek], causal=causal, scale=q.shape[-1] ** -0.5,
                                         left=left, right=right, softcap=0.0)
                outs.append(o)
                lses.append(l)
            out, lse = torch.cat(outs), torch.cat(lses, 1)
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for s in range(len(cu_q) - 1):
                sq, eq, sk, ek = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
                g = blockwise.backward(dout[sq:eq], q[sq:eq], k[sk:ek], v[sk:ek], out[sq:eq], lse[:, sq:eq],
                                       causal=causal, scale=q.shape[-1] ** -0.5, left=left, right=right, softcap=0.0,
                                       dlse=dlse[:, sq:eq])
                dq[sq:eq], dk[sk:ek], dv[sk:ek] = g
            return dq, dk, dv

    return F.apply(q, k, v)


def test_blockwise_dropout_uses_the_same_mask_in_backward(small_blocks):
    """Dropout inside the kernel: forward and backward agree with autograd through the same keep masks."""
    q, k, v, *_ = make_inputs([11], hq=2, hkv=1, d=8, seed=7)
    p, seed, scale = 0.3, 1234, 8 ** -0.5
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = blockwise.forward(qq.detach(), kk.detach(), vv.detach(), causal=True, scale=scale, left=-1, right=-1,
                                 softcap=0.0, dropout_p=p, seed=seed)
    dout = torch.randn_like(out)
    dq, dk, dv = blockwise.backward(dout, q, k, v, out, lse, causal=True, scale=scale, left=-1, right=-1, softcap=0.0,
                                    dropout_p=p, seed=seed)
    # reference: the same keep mask, block by block, written densely
    keep = torch.ones(1, 2, 11, 11)
    for i0 in range(0, 11, 4):
        for j0 in range(0, min(11, i0 + 4), 4):
            m = blockwise._keep_mask((1, 2, min(4, 11 - i0), min(4, 11 - j0)), p, seed, 0, i0, j0, q.device)
            keep[..., i0:i0 + 4, j0:j0 + 4] = m.float()
    scores = torch.einsum("qhd,khd->hqk", qq, kk.expand(-1, 2, -1)) * scale
    scores = scores.masked_fill(torch.ones(11, 11, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, -1) * keep[0] / (1 - p)
    ref = torch.einsum("hqk,khd->qhd", probs, vv.expand(-1, 2, -1))
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    for got, want in zip((dq, dk, dv), (qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert 0.1 < 1 - keep.mean() < 0.5  # dropout did drop


# ---------------------------------------------------------------------------------------- no T x T tensor


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (numel) any op creates, with the op's name."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=4096)
ROW = (1536, 512)  # T = 2048: T x T = 4.2M elements; the largest legitimate tensor is T x 64


def _packed_row(lengths=ROW):
    g = torch.Generator().manual_seed(0)
    feats = [{"input_ids": torch.randint(3, 128, (n,), generator=g).tolist()} for n in lengths]
    return PaddingFreeCollator()(feats)


def _largest(model, batch) -> LargestTensor:
    rec = LargestTensor()
    with rec:
        model(**batch).loss.backward()
    return rec


@pytest.mark.parametrize("mode", ["huggingface", "internal"])
@pytest.mark.parametrize("name,extra", [("pf-trl/tiny-llama", {}), ("pf-trl/tiny-mistral", {"sliding_window": 256})])
def test_no_tensor_of_size_t_squared_in_a_packed_step(mode, name, extra):
    from pf_trl.attention import enable_padding_free
    from pf_trl.models import build_model

    model = build_model(name, attn_implementation="sdpa", seed=0, **TINY, **extra)
    enable_padding_free(model, mode=mode)
    total = sum(ROW)
    rec = _largest(model, _packed_row())
    assert rec.numel < total * total // 8, (rec.numel, rec.op)  # the largest here: the logits, T x vocab


def test_transformers_sdpa_on_a_packed_row_builds_a_t_squared_mask():
    # negative control: the same row through transformers' own sdpa path (what huggingface mode did before)
    from pf_trl.models import build_model

    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    batch = _packed_row()
    rec = _largest(model, {**batch, "use_cache": False})
    total = sum(ROW)
    assert rec.numel >= total * total, (rec.numel, rec.op)


def test_blockwise_kernel_temporaries_are_bounded_by_the_block(monkeypatch):
    # the general path (a window shorter than the segment): its largest temporary is heads x BLOCK x BLOCK
    monkeypatch.setattr(blockwise, "BLOCK", 64)
    q, k, v, *_ = make_inputs([1024], hq=4, hkv=2, d=8, seed=3)
    rec = LargestTensor()
    with rec:
        out, lse = blockwise.forward(q, k, v, causal=True, scale=0.3, left=99, right=-1, softcap=1.5)
        blockwise.backward(torch.ones_like(out), q, k, v, out, lse, causal=True, scale=0.3, left=99, right=-1,
                           softcap=1.5)
    assert rec.numel <= max(4 * 64 * 64, q.numel()), (rec.numel, rec.op)


# ---------------------------------------------------------------------------------------- huggingface mode routing


def test_huggingface_mode_reroutes_sdpa_and_keeps_eager():
    from pf_trl.attention import enable_padding_free
    from pf_trl.attention.hf_sdpa import PACKED_SDPA
    from pf_trl.models import build_model

    sdpa = enable_padding_free(build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY))
    assert sdpa.config._attn_implementation == PACKED_SDPA
    eager = enable_padding_free(build_model("pf-trl/tiny-llama", attn_implementation="eager", seed=0, **TINY))
    assert eager.config._attn_implementation == "eager"


def test_reroute_refuses_what_lives_in_the_mask_only():
    from transformers import AutoConfig, AutoModelForCausalLM

    from pf_trl.attention.hf_sdpa import reroute_refusal

    config = AutoConfig.for_model("llama", **TINY)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert reroute_refusal(model) is None
    model.config.is_causal = False
    assert "bidirectional" in reroute_refusal(model)
    model.config.is_causal = True
    model.config.layer_types = ["chunked_attention", "full_attention"]
    assert "chunked_attention" in reroute_refusal(model)


def test_rerouted_model_generates_like_transformers():
    # calls with a KV cache and a padding mask go to transformers' own sdpa: generation is unchanged
    from pf_trl.attention import enable_padding_free
    from pf_trl.models import build_model

    ref = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY).eval()
    model = enable_padding_free(build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)).eval()
    ids = torch.tensor([[5, 9, 17, 3, 44, 8], [0, 0, 7, 12, 19, 4]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
