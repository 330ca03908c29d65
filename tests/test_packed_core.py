"""pf_trl.trainer.packed: a padded batch as one packed row, and per-token values scattered back into the padded
layout, checked against the padded forward of a tiny Llama (float32: equal within float32 rounding, 1e-5 relative on
log-probabilities of a 2-layer model), with the controls that fail."""

from __future__ import annotations

import pytest
import torch

from pf_trl.errors import PackingError
from pf_trl.trainer.packed import pack_padded


def _mask(spans: list[tuple[int, int]], width: int) -> torch.Tensor:
    mask = torch.zeros(len(spans), width, dtype=torch.long)
    for i, (a, n) in enumerate(spans):
        mask[i, a:a + n] = 1
    return mask


def test_index_maps_round_trip_any_padding_side():
    mask = _mask([(0, 5), (2, 3), (1, 4)], 6)  # right-, left- and both-side padded rows
    ids = torch.arange(18).reshape(3, 6) + 100
    row = pack_padded(mask, ids)
    assert row.lengths == (5, 3, 4) and row.offsets == (0, 2, 1)
    assert row.input_ids.tolist() == [ids[mask.bool()].tolist()]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    assert row.cu_seq_lens.tolist() == [0, 5, 8, 12]
    assert torch.equal(row.scatter(row.gather(ids)), ids * mask)
    # shifted: the prediction at packed position t (of token t + 1) lands at column (token's column - 1)
    shifted = row.scatter_shifted(row.input_ids[:, 1:].float(), fill=-1)
    expected = torch.where(mask[:, 1:].bool() & mask[:, :-1].bool(), ids[:, 1:].float(), torch.tensor(-1.0))
    assert torch.equal(shifted, expected)
    assert row.last_index().tolist() == [4, 7, 11]


def test_last_index_is_where_transformers_pools_with_pad_as_eos():
    pad = 2
    ids = torch.tensor([[5, 6, 7, 2, 2, 2], [2, 2, 8, 9, 2, 2], [2, 2, 2, 2, 2, 2]])
    mask = _mask([(0, 4), (2, 3), (0, 2)], 6)  # the EOS (= pad) tokens at the end of each sequence are real
    row = pack_padded(mask, ids)
    cols = torch.arange(6)
    pooled = (cols * (ids != pad)).argmax(-1)  # transformers' rule on the padded batch
    assert row.last_index(ids, pad).tolist() == [row.starts[i].item() + pooled[i].item() - row.offsets[i]
                                                 for i in range(3)]
    assert row.last_index(ids, pad).tolist() == [2, 4 + 1, 7]  # row 3: all pad, pooled at its first token


def test_refusals():
    with pytest.raises(PackingError, match="empty row"):
        pack_padded(_mask([(0, 3), (0, 0)], 4))
    with pytest.raises(PackingError, match="contiguous"):
        pack_padded(torch.tensor([[1, 0, 1, 0]]))


def test_packed_forward_log_probs_equal_the_padded_forward():
    from pf_trl.attention import enable_padding_free
    from pf_trl.models import build_model

    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, num_hidden_layers=2, hidden_size=32,
                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1).eval()
    enable_padding_free(model)
    g = torch.Generator().manual_seed(0)
    mask = _mask([(0, 9), (0, 5), (0, 7)], 9)
    ids = torch.randint(3, 32000, (3, 9), generator=g) * mask
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.log_softmax(-1)
        padded_lp = padded[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * (mask[:, 1:] * mask[:, :-1])
        row = pack_padded(mask, ids)
        packed = model(**row.model_kwargs(), use_cache=False).logits.log_softmax(-1)
        lp = packed[0, :-1].gather(-1, row.input_ids[0, 1:, None]).squeeze(-1)
        back = row.scatter_shifted(lp)
        assert torch.allclose(back, padded_lp, rtol=1e-5, atol=1e-5)
        # control: the same row without the sequence boundaries lets later sequences see earlier ones
        mixed = model(input_ids=row.input_ids, use_cache=False).logits.log_softmax(-1)
        lp_mixed = mixed[0, :-1].gather(-1, row.input_ids[0, 1:, None]).squeeze(-1)
        assert not torch.allclose(row.scatter_shifted(lp_mixed), padded_lp, rtol=1e-3, atol=1e-3)
