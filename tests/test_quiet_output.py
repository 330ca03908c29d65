"""Quiet, true output of `pf-trl train`: a resume of a model with tied embeddings does not warn about the head
"missing" from the checkpoint, the model card names what the model was trained from (an embedded config, a local
folder), and the evaluation of the last step is not run a second time; PaddingFreeSFTTrainer never trains over
the checkpoints of an earlier run silently."""

from __future__ import annotations

import logging

import pytest

from conftest import LogRecords, write_jsonl

TIED = ("num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1,"
        "tie_word_embeddings=true")
ROWS = [{"instruction": f"Say {i}", "input": "", "output": f"Number {i}."} for i in range(24)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


def train(*args) -> int:
    from pf_trl.cli.main import main

    return main(["train", *[str(a) for a in args], "--report_to", "none", "--disable_tqdm", "True"])


@pytest.mark.slow
def test_resume_card_and_final_eval(tmp_path, monkeypatch):
    from pf_trl.trainer import PaddingFreeSFTTrainer

    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    calls = []
    evaluate = PaddingFreeSFTTrainer.evaluate
    monkeypatch.setattr(PaddingFreeSFTTrainer, "evaluate",
                        lambda self, *a, **k: calls.append(self.state.global_step) or evaluate(self, *a, **k))
    out = tmp_path / "out"
    common = ["--training_data_path", data, "--output_dir", out, "--model_overrides", TIED, "--save_strategy", "steps",
              "--save_steps", 2, "--max_tokens_per_batch", 256]
    assert train(*common, "--validation_data_path", data, "--eval_strategy", "steps", "--eval_steps", 2,
                 "--max_steps", 2) == 0
    assert calls == [2]  # the step-2 evaluation only: the CLI prints its metrics instead of evaluating again
    card = (out / "README.md").read_text()
    assert "embedded `pf-trl/tiny-llama` config" in card and "None" not in card
    assert f"source: `{data}`" in card and "base_model" not in card  # no Hub link for something not on the Hub

    records = LogRecords()
    logging.getLogger("transformers").addHandler(records)
    try:
        assert train(*common, "--max_steps", 4, "--resume_from_checkpoint", "True") == 0
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not [m for m in records.messages if "missing keys" in m], records.messages
    assert (out / "checkpoint-4").is_dir()

    # a model folder as the base: the card names the folder
    again = tmp_path / "again"
    assert train("--model_name_or_path", out, "--training_data_path", data, "--output_dir", again, "--max_steps", 1,
                 "--save_strategy", "steps", "--save_steps", 1, "--max_tokens_per_batch", 256) == 0
    assert f"local model folder `{out.resolve()}`" in (again / "README.md").read_text()


def test_only_tied_keys_leave_the_warning():
    """A key whose parameter is shared with a loaded one is dropped; a key that is really missing stays."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pf_trl.trainer.trainer import _untied_missing_keys

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=True)
    tied = LlamaForCausalLM(config)
    assert _untied_missing_keys(tied, ["lm_head.weight", "model.norm.weight"]) == ["model.norm.weight"]
    untied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False}))
    assert _untied_missing_keys(untied, ["lm_head.weight"]) == ["lm_head.weight"]
    # both names missing: nothing of that tensor was loaded
    assert _untied_missing_keys(tied, ["lm_head.weight", "model.embed_tokens.weight"]) == [
        "lm_head.weight", "model.embed_tokens.weight"]


@pytest.mark.slow
def test_python_api_never_trains_over_checkpoints_silently(tmp_path, capsys):
    """trainer.train() into a folder with checkpoints: refused naming the latest; resume passes; overwrite_output_dir
    deletes the old checkpoints (a later resume must not pick one up) and trains from step 0."""
    import datasets

    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.trainer.output_dir import OutputDirError

    rows = datasets.Dataset.from_list(ROWS)
    overrides = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=1)

    def trainer(**kw):
        args = PaddingFreeConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, save_strategy="steps",
                                 disable_tqdm=True, max_tokens_per_batch=256, **kw)
        return PaddingFreeSFTTrainer(build_model("pf-trl/tiny-llama", **overrides), args=args, train_dataset=rows)

    trainer(max_steps=3, save_steps=3).train()
    (tmp_path / "out" / "checkpoint-7").mkdir()  # as if an earlier, longer run had been there
    with pytest.raises(OutputDirError, match=r"holds 2 checkpoint\(s\), the latest .*checkpoint-7 \(step 7\).*"
                       r"trainer.train\(resume_from_checkpoint=True\).*overwrite_output_dir=True"):
        trainer(max_steps=4, save_steps=4).train()
    trainer(max_steps=4, save_steps=4).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    capsys.readouterr()
    trainer(max_steps=2, save_steps=2, overwrite_output_dir=True).train()
    assert "removed 3 checkpoint(s) of an earlier run" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2"]
