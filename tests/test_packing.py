"""pf_trl.batching.packing: the one place that converts between the forms of a packed row's boundaries."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from pf_trl.batching import packing
from pf_trl.batching.collator import PaddingFreeCollator
from pf_trl.errors import PackingError, PfTrlError

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [3, 1, 5, 2]


def test_every_form_of_the_boundaries_converts_to_the_same_cu_seqlens():
    cu = packing.cu_seqlens_from_lengths(LENGTHS)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 9, 11]
    assert packing.lengths_from_cu_seqlens(cu) == LENGTHS
    assert packing.segment_spans(cu) == [(0, 3), (3, 4), (4, 9), (9, 11)]
    assert packing.segment_lengths(cu).tolist() == LENGTHS and packing.max_seqlen(cu) == 5

    positions = packing.position_ids_from_lengths(LENGTHS)
    assert positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1]
    assert torch.equal(packing.cu_seqlens_from_starts(packing.segment_starts(positions[None])), cu)
    assert packing.cu_seqlens_from_positions(positions[None])[1] == 5
    assert torch.equal(packing.cu_seqlens_from_position_ids(positions)[0], cu)

    seq_idx = packing.seq_idx_from_lengths(LENGTHS)
    assert seq_idx.dtype == torch.int32 and seq_idx.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3]
    assert torch.equal(packing.cu_seqlens_from_starts(packing.segment_starts_from_seq_idx(seq_idx[None])), cu)

    seg, pos = packing.token_segments(cu, 11)
    assert torch.equal(seg, seq_idx.long()) and torch.equal(pos, positions)


def test_the_two_position_rules_agree_on_collated_rows_and_differ_only_on_jumps():
    batch = PaddingFreeCollator(pad_to_multiple_of=16)(
        [{"input_ids": list(range(n))} for n in LENGTHS])
    by_step, _ = packing.cu_seqlens_from_positions(batch["position_ids"])
    by_zero, _ = packing.cu_seqlens_from_position_ids(batch["position_ids"])
    assert torch.equal(by_step, batch["cu_seq_lens_q"]) and torch.equal(by_zero, batch["cu_seq_lens_q"])
    jump = torch.tensor([[0, 1, 1, 2]])  # a repeated position: transformers' rule cuts there, flash-attn's does not
    assert packing.cu_seqlens_from_positions(jump)[0].tolist() == [0, 2, 4]
    assert packing.cu_seqlens_from_position_ids(jump)[0].tolist() == [0, 4]
    # several rows: every row starts a segment, even when its positions continue the previous row
    assert packing.cu_seqlens_from_positions(torch.tensor([[0, 1], [2, 3]]))[0].tolist() == [0, 2, 4]


def test_position_ids_that_do_not_start_at_zero_are_a_packing_error():
    for bad in (torch.tensor([[1, 2, 0]]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(PackingError) as info:
            packing.cu_seqlens_from_position_ids(bad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, PfTrlError)


def test_rows_hold_several_segments_reads_only_the_valid_tokens():
    left_padded = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert packing.rows_hold_several_segments(left_padded)  # the padding's positions break the run
    assert not packing.rows_hold_several_segments(left_padded, valid)
    packed = torch.tensor([[0, 1, 0, 1, 2]])
    assert packing.rows_hold_several_segments(packed, torch.ones(1, 5, dtype=torch.bool))
    assert not packing.rows_hold_several_segments(packed, torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool))


def test_shift_labels_aligns_each_position_with_its_target_over_the_whole_row():
    labels = torch.tensor([[packing.IGNORE_INDEX, 11, 12, packing.IGNORE_INDEX, 21]])
    assert packing.shift_labels(labels).tolist() == [[11, 12, packing.IGNORE_INDEX, 21, packing.IGNORE_INDEX]]
    # what every Hugging Face loss skips
    assert packing.IGNORE_INDEX == torch.nn.CrossEntropyLoss().ignore_index


def _assignments(name: str) -> list[str]:
    found = []
    for path in sorted((ROOT / "pf_trl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.append(str(path.relative_to(ROOT)))
    return found


def test_ignore_index_is_defined_once():
    assert _assignments("IGNORE_INDEX") == ["pf_trl/data/labels.py"]


def test_the_data_code_takes_ignore_index_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys, pf_trl.data.formats, pf_trl.data.truncation; "
            "assert pf_trl.data.formats.IGNORE_INDEX == -100; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------- the collator and the upstream ones


def _features():
    return [{"input_ids": list(range(10, 10 + n)), "labels": [100 + t for t in range(n)]} for n in LENGTHS]


def test_collator_matches_transformers_flattening_collator_on_text():
    from transformers import DataCollatorWithFlattening

    ours = PaddingFreeCollator()(_features())
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(_features())
    assert set(theirs) == set(ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == ours[key].dtype and torch.equal(value, ours[key]), key
        else:
            assert type(value) is type(ours[key]) and value == ours[key], key


def test_collator_matches_trl_padding_free_collator_on_text():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    ours = PaddingFreeCollator()(_features())
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(_features())
    assert set(theirs) - set(ours) == {"seq_idx"}  # pf-trl derives it where a kernel wants it (stateful layers)
    for key in ours:
        if isinstance(ours[key], torch.Tensor):
            assert torch.equal(theirs[key], ours[key]), key
        else:
            assert theirs[key] == ours[key], key
    assert torch.equal(theirs["seq_idx"][0], packing.seq_idx_from_lengths(LENGTHS))
