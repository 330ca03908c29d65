"""Exact maths: padding-free loss and gradients equal the padded run (tiny Llama, fp32).

Padded: right padding + attention_mask, one row per example. Padding-free: the collator's single row
with restarting position_ids and no mask (transformers' native packed path). Same examples, same loss
definition (mean over all supervised tokens), so per-example losses and parameter gradients must match.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from pf_trl.batching.collator import IGNORE_INDEX, PaddingFreeCollator


def tiny_llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation=attn, use_cache=False,
    )
    return LlamaForCausalLM(config).float()


def examples(seed: int = 0, lengths=(7, 1, 19, 33, 2, 12)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        labels = list(ids)
        labels[: n // 3] = [IGNORE_INDEX] * (n // 3)  # a prompt part without loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token CE of next-token prediction (0 where ignored)."""
    shift_logits, shift_labels = logits[..., :-1, :], labels[..., 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    ).view(shift_labels.shape)


def padded_run(model, feats):
    n = max(len(f["input_ids"]) for f in feats)
    ids = torch.zeros(len(feats), n, dtype=torch.long)
    labels = torch.full((len(feats), n), IGNORE_INDEX)
    mask = torch.zeros(len(feats), n, dtype=torch.long)
    for i, f in enumerate(feats):
        k = len(f["input_ids"])
        ids[i, :k] = torch.tensor(f["input_ids"])
        labels[i, :k] = torch.tensor(f["labels"])
        mask[i, :k] = 1
    labels[:, 0] = IGNORE_INDEX  # the collator's rule, so both runs supervise the same tokens
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    tl = token_losses(logits, labels)
    sup = (labels[:, 1:] != IGNORE_INDEX)
    (tl.sum() / sup.sum()).backward()
    per_example = [(tl[i].sum() / sup[i].sum()).item() if sup[i].any() else 0.0 for i in range(len(feats))]
    return per_example, {k: p.grad.clone() for k, p in model.named_parameters()}


def packed_run(model, feats, *, with_positions: bool = True):
    batch = PaddingFreeCollator()(feats)
    model.zero_grad()
    kwargs = {"position_ids": batch["position_ids"]} if with_positions else {}
    logits = model(input_ids=batch["input_ids"], use_cache=False, **kwargs).logits
    tl = token_losses(logits, batch["labels"])[0]
    sup = batch["labels"][0, 1:] != IGNORE_INDEX
    (tl.sum() / sup.sum()).backward()
    cu = batch["cu_seq_lens_q"].tolist()
    per_example = []
    for a, b in zip(cu[:-1], cu[1:]):
        # token t predicts t+1: an example's shifted losses are positions a .. b-2
        seg_l, seg_s = tl[a : b - 1], sup[a : b - 1]
        per_example.append((seg_l.sum() / seg_s.sum()).item() if seg_s.any() else 0.0)
    return per_example, {k: p.grad.clone() for k, p in model.named_parameters()}


def max_rel_grad_diff(g1, g2) -> float:
    return max(((g1[k] - g2[k]).norm() / g2[k].norm().clamp_min(1e-12)).item() for k in g2)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_free_matches_padded(attn):
    model = tiny_llama(attn)
    feats = examples()
    loss_pad, grad_pad = padded_run(model, feats)
    loss_pf, grad_pf = packed_run(model, feats)
    assert max(abs(a - b) for a, b in zip(loss_pad, loss_pf)) <= 1e-5
    assert max_rel_grad_diff(grad_pf, grad_pad) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_negative_control_without_position_ids_differs(attn):
    """Concatenated without position_ids, examples attend to each other: the test above can fail."""
    model = tiny_llama(attn)
    feats = examples()
    loss_pad, grad_pad = padded_run(model, feats)
    loss_cat, grad_cat = packed_run(model, feats, with_positions=False)
    assert max(abs(a - b) for a, b in zip(loss_pad, loss_cat)) > 1e-2
    assert max_rel_grad_diff(grad_cat, grad_pad) > 1e-2
