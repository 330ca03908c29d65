"""Data identity that explains itself: a manifest records its tokenizer by absolute path, with a digest per file and
one for the chat template; shards made with another tokenizer are refused naming what differs (which files, the
chat template, the vocabulary), and `pf-trl inspect /abs/path` works from any directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_jsonl

CHAT = [{"conversations": [{"from": "human", "value": f"Hi {i}"}, {"from": "gpt", "value": f"Hello {i}."}]}
        for i in range(6)]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
            "{% else %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def plain_tokenizer_dir(tmp_path, tokenizer, monkeypatch):
    """A model's tokenizer folder without a chat template, under a relative path (as a user types it)."""
    import copy

    monkeypatch.chdir(tmp_path)
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "models" / "my-model")
    return Path("models/my-model")


@pytest.mark.slow
def test_manifest_records_an_absolute_tokenizer_path(tmp_path, plain_tokenizer_dir):
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    src = write_jsonl(tmp_path / "c.jsonl", CHAT)
    manifest = pretokenize(src, "shards", PretokenizeConfig(chat_template=TEMPLATE), tokenizer=str(plain_tokenizer_dir),
                           progress=False)
    tok = manifest["tokenizer"]
    assert tok["path"] == str((tmp_path / "models" / "my-model").resolve()) and Path(tok["path"]).is_absolute()
    assert set(tok["files"]) == {"tokenizer.json", "tokenizer_config.json"} and tok["chat_template_sha256"]
    # `pf-trl inspect /abs/path` from another working directory decodes with that tokenizer and template
    proc = subprocess.run([sys.executable, "-m", "pf_trl.cli.main", "inspect", str(tmp_path / "shards"), "--samples", "1",
                           "--max_tokens", "64"], capture_output=True, text=True, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[INST] Hi 0 [/INST]⟦Hello 0.</s>⟧" in proc.stdout and "note:" not in proc.stdout
    assert "{% generation %}" in proc.stdout  # the template the data was rendered with, not the folder's (none)


def test_chat_data_without_a_template_names_the_option(tmp_path, plain_tokenizer_dir):
    from pf_trl.data.pretokenize import PretokenizeError, pretokenize

    src = write_jsonl(tmp_path / "c.jsonl", CHAT)
    with pytest.raises(PretokenizeError, match=r"--chat_template FILE") as info:
        pretokenize(src, "shards", tokenizer=str(plain_tokenizer_dir), progress=False)
    assert info.value.option == "chat_template"


@pytest.mark.slow
def test_a_mismatch_says_what_differs(tmp_path, plain_tokenizer_dir, tokenizer):
    """Through the trainer's data path (pf_trl.data.sources): a template-only difference names the template and the
    flag that fixes it; a different tokenizer file names that file."""
    from pf_trl.data import sources
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.tokenizer import load_tokenizer

    src = write_jsonl(tmp_path / "c.jsonl", CHAT)
    pretokenize(src, "shards", PretokenizeConfig(chat_template=TEMPLATE), tokenizer=str(plain_tokenizer_dir),
                progress=False)
    model_tok = load_tokenizer(str(plain_tokenizer_dir))
    with pytest.raises(sources.DataSourceError) as info:
        sources.load_training_data("shards", model_tok)
    message = str(info.value)
    assert "chat template differs: the data was rendered with chat template sha256" in message
    assert "the model's tokenizer has no chat template" in message and "--chat_template FILE" in message
    assert "tokenizer files differ" not in message
    # the same template given to the model's tokenizer: accepted (negative control of the refusal)
    model_tok.chat_template = TEMPLATE
    assert sources.load_training_data("shards", model_tok).num_rows == len(CHAT)
    # a re-saved copy with another config file (model_max_length) tokenizes the same: accepted, whatever the bytes
    other = tmp_path / "other"
    model_tok.save_pretrained(other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    other_tok = load_tokenizer(str(other))
    other_tok.chat_template = TEMPLATE
    assert sources.load_training_data("shards", other_tok).num_rows == len(CHAT)
    # another vocabulary (two added tokens): named, with the model's own tokenizer as the fix
    other_tok.add_tokens(["<x1>", "<x2>"])
    with pytest.raises(sources.DataSourceError, match=r"added tokens differ: 2 tokens more in the model's tokenizer "
                       r"\(3 vs 5; vocabulary 32000 vs 32002\).*re-run pretokenize with the model's tokenizer"):
        sources.load_training_data("shards", other_tok)


def test_differences_of_old_and_new_records():
    from pf_trl.data.tokenizer import tokenizer_differences

    a = {"sha256": "1", "vocab_size": 10, "files": {"tokenizer.json": "x"}, "chat_template_sha256": None}
    assert tokenizer_differences(a, dict(a)) == []
    b = {**a, "sha256": "2", "vocab_size": 12, "files": {"tokenizer.json": "y", "vocab.json": "z"}}
    diffs = tokenizer_differences(a, b)
    assert diffs[0] == "vocabulary size 10 vs 12"
    assert diffs[1] == "tokenizer files differ: tokenizer.json (different content), vocab.json (only in the model's tokenizer)"
    old = {"sha256": "1", "vocab_size": 10}  # a manifest from before per-file digests
    assert "predates per-file identities" in tokenizer_differences(old, {**old, "sha256": "2"})[0]
