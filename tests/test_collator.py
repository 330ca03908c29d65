import pytest
import torch

from pf_trl.batching.collator import IGNORE_INDEX, PaddingFreeCollator, cu_seqlens_from_position_ids


def features(*lengths, start=10):
    out, tok = [], start
    for n in lengths:
        ids = list(range(tok, tok + n))
        tok += n
        out.append({"input_ids": ids, "labels": [t + 1000 for t in ids]})
    return out


def test_concatenates_with_restarting_positions_and_cu_seqlens():
    batch = PaddingFreeCollator()(features(3, 1, 4))
    assert batch["input_ids"].shape == (1, 8)
    assert batch["input_ids"].dtype == torch.long
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 8]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(batch["cu_seq_lens_q"], batch["cu_seq_lens_k"])
    assert batch["max_length_q"] == batch["max_length_k"] == 4
    assert "attention_mask" not in batch


def test_first_label_of_each_example_is_ignored():
    batch = PaddingFreeCollator()(features(3, 1, 4))
    labels = batch["labels"][0].tolist()
    assert [labels[i] for i in (0, 3, 4)] == [IGNORE_INDEX] * 3
    assert labels[1:3] == [1011, 1012]
    assert labels[5:] == [1015, 1016, 1017]


def test_missing_labels_default_to_input_ids():
    batch = PaddingFreeCollator()([{"input_ids": [5, 6, 7]}])
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7]]


def test_pad_to_multiple_of_adds_one_dummy_segment_without_loss():
    batch = PaddingFreeCollator(pad_to_multiple_of=8, pad_token_id=0)(features(3, 2))
    assert batch["input_ids"].shape == (1, 8)
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]
    assert batch["labels"][0, 5:].tolist() == [IGNORE_INDEX] * 3
    assert batch["position_ids"][0, 5:].tolist() == [0, 1, 2]
    exact = PaddingFreeCollator(pad_to_multiple_of=5)(features(3, 2))
    assert exact["input_ids"].shape == (1, 5)  # already a multiple: nothing appended


def test_errors_name_the_problem():
    collate = PaddingFreeCollator()
    with pytest.raises(ValueError, match="empty batch"):
        collate([])
    with pytest.raises(KeyError, match="input_ids"):
        collate([{"labels": [1]}])
    with pytest.raises(ValueError, match="labels has 2 tokens but input_ids has 3"):
        collate([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(ValueError, match="empty input_ids"):
        collate([{"input_ids": []}])
    with pytest.raises(ValueError, match="positive"):
        PaddingFreeCollator(pad_to_multiple_of=0)


def test_cu_seqlens_from_position_ids_round_trip():
    batch = PaddingFreeCollator()(features(2, 5, 1))
    cu, max_len = cu_seqlens_from_position_ids(batch["position_ids"])
    assert torch.equal(cu, batch["cu_seq_lens_q"])
    assert max_len == 5
    with pytest.raises(ValueError, match="start at 0"):
        cu_seqlens_from_position_ids(torch.tensor([[1, 2, 0]]))


def test_check_packed_batch_accepts_the_collators_output_and_refuses_inconsistent_layouts():
    from pf_trl.batching.collator import check_packed_batch

    batch = PaddingFreeCollator(pad_to_multiple_of=8)(features(3, 1, 4, 2))
    check_packed_batch(batch)  # the collator's own output (dummy segment included)

    def broken(**changes):
        b = dict(batch)
        b.update(changes)
        return b

    cu = batch["cu_seq_lens_q"]
    cases = {
        "end at the token count": broken(cu_seq_lens_q=cu[:-1], cu_seq_lens_k=cu[:-1]),
        "increase strictly": broken(cu_seq_lens_q=torch.tensor([0, 3, 3, 4, 8, 10, 16], dtype=torch.int32),
                                    cu_seq_lens_k=torch.tensor([0, 3, 3, 4, 8, 10, 16], dtype=torch.int32)),
        "int32": broken(cu_seq_lens_q=cu.long(), cu_seq_lens_k=cu.long()),
        "differ": broken(cu_seq_lens_k=torch.tensor([0, 2, 4, 8, 10, 16], dtype=torch.int32)),
        "max_length_q must be the Python int 6": broken(max_length_q=torch.tensor(6)),
        "max_length_k must be the Python int 6": broken(max_length_k=5),
        "position_ids do not restart": broken(position_ids=torch.arange(16).unsqueeze(0)),
        "one row": broken(input_ids=batch["input_ids"].reshape(2, 8)),
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            check_packed_batch(bad)


def test_mark_dynamic_lengths_marks_the_varying_dims():
    from pf_trl.batching.collator import mark_dynamic_lengths

    batch = PaddingFreeCollator()(features(3, 5))
    mark_dynamic_lengths(batch)
    for name in ("input_ids", "labels", "position_ids"):
        assert 1 in getattr(batch[name], "_dynamo_weak_dynamic_indices", set())
    assert 0 in getattr(batch["cu_seq_lens_q"], "_dynamo_weak_dynamic_indices", set())
