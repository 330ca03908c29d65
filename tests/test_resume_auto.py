"""``resume_from_checkpoint="auto"``: the latest complete checkpoint (its marker written last), a fresh start when
there is none; a save cut short, or a checkpoint whose deletion was cut short, is never taken."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def small_ds(sample_shards):
    from pf_trl.data.shards import load_shards

    ds = load_shards(sample_shards)
    keep = np.nonzero(np.asarray(ds["length"]) <= 200)[0][:16]
    return ds.select(keep.tolist()).flatten_indices()


def _trainer(out, ds, tokenizer, **kw):
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=str(out), report_to=[], logging_steps=1, disable_tqdm=True, learning_rate=1e-3,
                             seed=0, per_device_train_batch_size=4, padding_free_mode="internal", max_length=None,
                             use_cpu=True, dataloader_num_workers=0, max_steps=4, save_strategy="steps", save_steps=2,
                             **kw)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    return PaddingFreeSFTTrainer(model, args=args, train_dataset=ds, processing_class=tokenizer)


def test_marker_lists_the_files_and_names_what_is_wrong(tmp_path):
    from pf_trl.trainer.checkpoints import (
        checkpoint_problem,
        is_auto,
        latest_complete_checkpoint,
        resolve_auto,
        write_complete_marker,
    )

    assert is_auto("auto") and is_auto(" AUTO ") and not is_auto("True") and not is_auto(True)
    for step in (2, 4, 6):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * step)
        (folder / "rng_state_1.pth").write_bytes(b"r")
    write_complete_marker(tmp_path / "checkpoint-2", 2, 2)
    write_complete_marker(tmp_path / "checkpoint-4", 4, 2)
    assert checkpoint_problem(tmp_path / "checkpoint-2") is None
    assert "no pf_trl_checkpoint_complete.json" in checkpoint_problem(tmp_path / "checkpoint-6")  # save cut short
    found, skipped = latest_complete_checkpoint(tmp_path)
    assert found == tmp_path / "checkpoint-4" and [p.name for p, _ in skipped] == ["checkpoint-6"]
    (tmp_path / "checkpoint-4" / "rng_state_1.pth").unlink()  # a rotation (rmtree) cut short
    assert checkpoint_problem(tmp_path / "checkpoint-4") == "rng_state_1.pth is missing"
    (tmp_path / "checkpoint-2" / "model.safetensors").write_bytes(b"x")  # rewritten after the marker
    assert "has 1 bytes, 2 were written" in checkpoint_problem(tmp_path / "checkpoint-2")
    assert latest_complete_checkpoint(tmp_path)[0] is None
    shutil.copytree(tmp_path / "checkpoint-6", tmp_path / "checkpoint-8")
    write_complete_marker(tmp_path / "checkpoint-6", 6, 1)
    (tmp_path / "checkpoint-8" / "pf_trl_checkpoint_complete.json").write_text(
        (tmp_path / "checkpoint-6" / "pf_trl_checkpoint_complete.json").read_text())
    assert "is for step 6" in checkpoint_problem(tmp_path / "checkpoint-8")  # a copied folder is not step 8
    said = []
    assert resolve_auto(tmp_path, say=said.append, save_total_limit=1) == str(tmp_path / "checkpoint-6")
    assert "keep 2" in said[0] and "checkpoint-8 is not complete" in said[1] and "resuming from" in said[-1]
    said.clear()
    resolve_auto(tmp_path, say=said.append, save_total_limit=2)
    assert not any("save_total_limit" in line for line in said)


@pytest.mark.slow
def test_auto_resumes_from_the_latest_complete_checkpoint(tmp_path, small_ds, tokenizer, capsys):
    from pf_trl.trainer.output_dir import OutputDirError

    out = tmp_path / "out"
    fresh = _trainer(out, small_ds, tokenizer)
    fresh.train(resume_from_checkpoint="auto")  # nothing there: a fresh start, no refusal
    assert "no complete checkpoint" in capsys.readouterr().out
    for step in (2, 4):
        marker = json.loads((out / f"checkpoint-{step}" / "pf_trl_checkpoint_complete.json").read_text())
        assert marker["global_step"] == step
        # written last: it lists the sampler state and the trainer state, which are written after the weights
        expected = {"trainer_state.json", "pf_trl_sampler_state.json", "optimizer.pt", "rng_state.pth"}
        assert expected <= set(marker["files"])
    losses = [h["loss"] for h in fresh.state.log_history if "loss" in h]
    # The pod died while it saved step 4: no marker there, so auto resumes from step 2 and trains steps 3-4 again.
    (out / "checkpoint-4" / "pf_trl_checkpoint_complete.json").unlink()
    with pytest.raises(OutputDirError):  # without auto (or True) the folder is still not trained over
        _trainer(out, small_ds, tokenizer).train()
    again = _trainer(out, small_ds, tokenizer)
    again.train(resume_from_checkpoint="auto")
    said = capsys.readouterr().out
    assert "checkpoint-4 is not complete" in said and f"resuming from {out / 'checkpoint-2'}" in said
    assert again.state.global_step == 4
    np.testing.assert_allclose([h["loss"] for h in again.state.log_history if "loss" in h][-2:], losses[2:],
                               rtol=1e-5, atol=1e-5)
    assert (out / "checkpoint-4" / "pf_trl_checkpoint_complete.json").is_file()  # the redone save is complete
