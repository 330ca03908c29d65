"""The loss accumulates in the model's dtype when that is wider than float32: a float64 model's packed loss equals
the padded float64 objective (its logits' cross-entropy in float64) to float64 rounding; summing in float32, as
before, is ~1e-7 off (the negative control). TRL 1.16's own fused head reduces in float32 even for a float64
model, so TRL's padded loss is itself float32-accurate there; the reference here is the objective itself."""

from __future__ import annotations

import pytest
import torch

V = 256
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.5)


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY), attn_implementation="sdpa").to(torch.float64)


def _rows():
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, V, (24,), generator=g).tolist() for _ in range(2)]
    return ids, [[-100] * 5 + r[5:] for r in ids]


def _packed_loss(tmp_path) -> torch.Tensor:
    from datasets import Dataset

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    ids, labels = _rows()
    args = PaddingFreeConfig(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True,
                             padding_free="internal", max_length=None, disable_tqdm=True, max_tokens_per_batch=48,
                             dataloader_num_workers=0, seed=0)
    trainer = PaddingFreeSFTTrainer(_model(), args=args, train_dataset=Dataset.from_dict({"input_ids": ids,
                                                                                          "labels": labels}))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape == (1, 48)  # both examples in one packed row
    trainer.model.train()
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch)


def _padded_float64_objective() -> torch.Tensor:
    ids, labels = _rows()
    model = _model().train()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), use_cache=False).logits
    assert logits.dtype == torch.float64
    shifted = torch.tensor(labels)[:, 1:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), shifted.reshape(-1), ignore_index=-100)


def test_float64_model_loss_equals_the_padded_float64_objective(tmp_path, monkeypatch):
    padded = _padded_float64_objective()
    packed = _packed_loss(tmp_path / "f64")
    assert packed.dtype == torch.float64
    assert abs(float(packed - padded)) <= 1e-12 * abs(float(padded))

    # negative control: the loss summed in float32, as before, is visibly off at this tolerance
    import pf_trl.trainer.loss as loss_mod

    monkeypatch.setattr(loss_mod, "loss_dtype", lambda dtype: torch.float32)
    float32_sum = _packed_loss(tmp_path / "f32")
    assert abs(float(float32_sum) - float(padded)) > 1e-10 * abs(float(padded))


@pytest.mark.parametrize("dtype,expected", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_loss_dtype_is_never_narrower_than_float32(dtype, expected):
    from pf_trl.trainer.loss import loss_dtype

    assert loss_dtype(dtype) == expected


@pytest.mark.parametrize("transform", [(1.0, None), (0.5, 3.0)], ids=["plain", "scale-softcap"])
@pytest.mark.parametrize("smooth", [False, True], ids=["nll", "smoothing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_head_chunks_match_autograd_of_the_full_logits(transform, smooth, dtype):
    """The CPU loss path of a plain linear head (token chunks, one weight-gradient buffer) against autograd through
    the full logits: per-token terms and the gradients of hidden, weight and bias."""
    from pf_trl.trainer.loss import HeadPlan, apply_head_transform, loss_dtype, supervised_loss_terms

    scale, softcap = transform
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=dtype)
    head = torch.nn.Linear(16, 50, bias=True).to(dtype)
    targets = torch.randint(0, 50, (37,), generator=g)
    w_nll = torch.rand(37, generator=g, dtype=dtype)
    w_smooth = torch.rand(37, generator=g, dtype=dtype)

    def run(fn):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad()
        nll, sm = fn(h)
        loss = (nll * w_nll.to(nll.dtype)).sum() + ((sm * w_smooth.to(sm.dtype)).sum() if smooth else 0)
        loss.backward()
        return nll.detach(), h.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()

    def chunked(h):
        terms = supervised_loss_terms(head, h, targets, HeadPlan("linear", scale, softcap), chunk_size=8,
                                      with_smooth=smooth)
        return terms.nll, terms.smooth

    def full(h):
        logp = torch.log_softmax(apply_head_transform(head(h), scale, softcap).to(loss_dtype(dtype)), -1)
        return -logp.gather(1, targets[:, None]).squeeze(1), -logp.sum(-1)

    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(run(chunked), run(full)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
