"""Which flash-attention package pf-trl finds, and what it asks for: FA2 / FA3 / FA4 absent or present.

These tests put tiny stand-in packages (``flash_attn/cute``, ``flash_attn``) in a temporary folder on ``sys.path``
and let the real import machinery find them. They prove the SELECTION logic (which package counts as installed,
which ``attn_implementation`` transformers is asked for, which kernel the ``flash_attn`` backend picks on which
GPU generation) and the keyword plumbing of the FA4 call (the stand-in has FA4 4.0.0b36's signature, where ``qv``
is the fourth positional parameter). They are NOT evidence that any flash kernel computes attention correctly:
that is ``benchmarks/gpu/attention_check.py`` on a GPU, against the float32 reference.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from pf_trl.attention.backends import flash_attn as fa_backend
from pf_trl.attention.flash_packages import installed_flash_kernels, transformers_flash_implementation

# FA4 4.0.0b36's flash_attn/cute/interface.py signature (keyword names and positions), computing attention with
# pf-trl's exact per-segment sdpa backend so that the plumbing test compares numbers, not only names
FA4_STANDIN = '''
import torch
from pf_trl.attention.backends import sdpa

CALLS = []

def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                           gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    assert qv is None, "a positional call bound cu_seqlens_q to qv"
    assert cu_seqlens_q is not None and cu_seqlens_q.dtype == torch.int32
    CALLS.append(dict(causal=causal, window_size=window_size, softcap=softcap, return_lse=return_lse))
    window = tuple(-1 if w is None else w for w in window_size)
    out = sdpa.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                       scale=softmax_scale, window=window, softcap=softcap, dropout_p=0.0)
    return out, torch.zeros(q.shape[1], q.shape[0])
'''

FA2_STANDIN = "def flash_attn_varlen_func(*args, **kwargs):\n    raise RuntimeError('stand-in: not called here')\n"


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Install stand-in packages by name ("fa4": namespace ``flash_attn`` + ``flash_attn/cute``; "fa2":
    ``flash_attn/__init__.py`` with ``flash_attn_varlen_func``) and forget every cached import."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "flash_attn_interface")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(fa_backend, "_IMPORTS", {})
    monkeypatch.setattr(fa_backend, "_MAJOR", {})

    def install(*names: str) -> None:
        pkg = tmp_path / "flash_attn"
        if "fa4" in names:
            (pkg / "cute").mkdir(parents=True)
            (pkg / "cute" / "__init__.py").write_text(textwrap.dedent(FA4_STANDIN))
        if "fa2" in names:
            pkg.mkdir(exist_ok=True)
            (pkg / "__init__.py").write_text(FA2_STANDIN)
        import importlib

        importlib.invalidate_caches()

    return install


def test_nothing_installed_asks_for_no_flash_implementation(packages):
    packages()
    assert installed_flash_kernels() == {"fa3": False, "fa4": False, "fa2": False}
    impl, why = transformers_flash_implementation(9)
    assert impl is None and "no flash-attention package" in why
    assert transformers_flash_implementation(None)[0] is None


def test_fa4_alone_is_a_namespace_flash_attn_without_fa2(packages):
    """The flash-attn-4 wheel makes ``import flash_attn`` succeed; that must not count as FA2."""
    packages("fa4")
    import flash_attn  # noqa: F401  (succeeds: a namespace package)

    assert installed_flash_kernels() == {"fa3": False, "fa4": True, "fa2": False}
    assert transformers_flash_implementation(9)[0] == "flash_attention_4"
    assert transformers_flash_implementation(10)[0] == "flash_attention_4"
    impl, why = transformers_flash_implementation(8)  # an A100: FA4 has no SM80 path
    assert impl is None and "sm90" in why and "sm8x" in why


def test_fa2_and_fa4_prefers_fa4_on_hopper_and_fa2_before(packages):
    packages("fa2", "fa4")
    assert transformers_flash_implementation(9)[0] == "flash_attention_4"
    assert transformers_flash_implementation(8)[0] == "flash_attention_2"


def test_backend_kernel_choice_by_gpu_generation(packages, monkeypatch):
    packages("fa4")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fa_backend, "_MAJOR", {0: 9})
    assert fa_backend.kernel_for(cuda)[0] == "fa4"
    name, reason, _ = fa_backend.kernel_for(cuda, dropout_p=0.1)
    assert name is None and "dropout" in reason
    monkeypatch.setattr(fa_backend, "_MAJOR", {0: 8})
    name, reason, _ = fa_backend.kernel_for(cuda)
    assert name is None and "SM90" in reason
    assert fa_backend.unavailable(torch.device("cpu"), torch.bfloat16).startswith("flash-attn runs on CUDA only")
    monkeypatch.setattr(fa_backend, "_MAJOR", {0: 9})
    features = dict(causal=True, window=(-1, -1), softcap=0.0, dropout_p=0.0, head_dim=128, gqa=True, device=cuda)
    assert fa_backend.unsupported(**features, sinks=True) is None  # FA4 returns its log-sum-exp (return_lse)
    assert "divisible by 8" in fa_backend.unsupported(**{**features, "head_dim": 36})


def test_backend_without_any_package_says_not_installed(packages):
    packages()
    assert "not installed" in fa_backend.unavailable(torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("window", [(-1, -1), (15, 0)])
def test_fa4_call_plumbing_by_keyword(packages, monkeypatch, window):
    """pf-trl's FA4 call binds cu_seqlens by keyword, maps -1 windows to None, and unpacks (out, lse)."""
    packages("fa4")
    from pf_trl.attention.backends import sdpa

    g = torch.Generator().manual_seed(0)
    lens = [5, 23, 9]
    q = torch.randn(sum(lens), 4, 16, generator=g)
    k = torch.randn(sum(lens), 2, 16, generator=g)
    v = torch.randn(sum(lens), 2, 16, generator=g)
    cu = torch.tensor([0, 5, 28, 37], dtype=torch.int64)
    monkeypatch.setattr(fa_backend, "kernel_for", lambda device, dropout_p=0.0: ("fa4", *fa_backend._fa4()))
    out = fa_backend.forward(q, k, v, cu, cu, 23, 23, causal=True, scale=0.25, window=window, softcap=0.0,
                             dropout_p=0.0)
    ref = sdpa.forward(q, k, v, cu, cu, 23, 23, causal=True, scale=0.25, window=window, softcap=0.0, dropout_p=0.0)
    torch.testing.assert_close(out, ref)
    import flash_attn.cute as standin

    expected = (None, None) if window == (-1, -1) else (15, 0)
    assert standin.CALLS[-1]["window_size"] == expected and standin.CALLS[-1]["return_lse"] is False
    # negative control: the flash-attn 2 calling convention (positional cu_seqlens) is refused by FA4's signature
    with pytest.raises(AssertionError, match="qv"):
        standin.flash_attn_varlen_func(q, k, v, cu.int(), cu.int(), 23, 23)

