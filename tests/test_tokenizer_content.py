"""Tokenizer identity by content: a re-saved copy of a tokenizer (other file bytes) is the same tokenizer; another chat
template, vocabulary, special token or normalizer is not, and the refusal names the part. Manifests of an older
pf-trl (a file hash only) still match the very folder they were made with, and a mismatch says what to do."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import write_jsonl

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
            "{{ '[INST] ' + m['content'] + ' [/INST]' }}"
            "{% else %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}")
CHAT = [{"messages": [{"role": "user", "content": f"Hi {i}"}, {"role": "assistant", "content": f"Hello {i}."}]}
        for i in range(6)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def resaved(tmp_path, tokenizer):
    """The embedded tokenizer saved again: other files (no tokenizer.model, re-serialized JSON), the same tokenizer."""
    from pf_trl.data.tokenizer import load_tokenizer

    tokenizer.save_pretrained(tmp_path / "copy")
    return load_tokenizer(str(tmp_path / "copy"))


def test_a_resaved_copy_is_the_same_tokenizer(tokenizer, resaved):
    from pf_trl.data.tokenizer import tokenizer_differences, tokenizer_fingerprint

    mine, theirs = tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(resaved)
    assert mine["files"] != theirs["files"] and mine["files_sha256"] != theirs["files_sha256"]  # other bytes
    assert mine["sha256"] == theirs["sha256"] and tokenizer_differences(mine, theirs) == []


def test_each_part_that_differs_is_named(tokenizer, resaved):
    from tokenizers import normalizers

    from pf_trl.data.tokenizer import tokenizer_differences, tokenizer_fingerprint

    mine = tokenizer_fingerprint(tokenizer)

    def differences(change):
        other = copy.deepcopy(resaved)
        change(other)
        return tokenizer_differences(mine, tokenizer_fingerprint(other))

    def template(t):
        t.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    theirs = tokenizer_fingerprint(_with(resaved, template))["chat_template_sha256"][:12]
    assert differences(template) == [
        f"chat template differs: the data was rendered with chat template sha256 {mine['chat_template_sha256'][:12]}, "
        f"the model's tokenizer has chat template sha256 {theirs}"]
    assert differences(lambda t: t.add_tokens([f"<t{i}>" for i in range(12)])) == [
        "added tokens differ: 12 tokens more in the model's tokenizer (3 vs 15; vocabulary 32000 vs 32012)"]
    assert differences(lambda t: t.add_special_tokens({"pad_token": "</s>"})) == []  # TRL sets it; nothing written
    assert differences(lambda t: t.add_special_tokens({"eos_token": "<unk>"})) == [
        "special tokens differ (eos_token_id 2 vs 0)"]

    def lowercase(t):
        t.backend_tokenizer.normalizer = normalizers.Lowercase()

    assert differences(lowercase) == ["normalizer differs"]


def _with(tok, change):
    other = copy.deepcopy(tok)
    change(other)
    return other


def test_an_older_manifest_matches_its_own_folder_only(tokenizer, resaved):
    """A record of an older pf-trl: ``sha256`` was the hash of the files (now ``files_sha256``), no content parts."""
    from pf_trl.data.tokenizer import OLD_MANIFEST_NOTE, tokenizer_differences, tokenizer_fingerprint

    mine = tokenizer_fingerprint(tokenizer)
    old = {k: v for k, v in mine.items() if k not in ("identity", "content", "content_sizes", "files_sha256")}
    old["sha256"] = mine["files_sha256"]
    assert tokenizer_differences(old, mine) == []  # the same folder: still accepted
    differences = tokenizer_differences(old, tokenizer_fingerprint(resaved))
    assert differences[-1] == OLD_MANIFEST_NOTE and "re-run pretokenize" in OLD_MANIFEST_NOTE


@pytest.mark.slow
def test_shards_of_a_resaved_copy_train_with_the_original(tmp_path, tokenizer, resaved):
    """Through PaddingFreeSFTTrainer: shards made with a re-saved copy (template in the manifest's options), a model
    whose tokenizer is the original with the same template set in code: accepted. Negative control: another template
    in code, refused naming the template; an old-style manifest of the copy, refused with what to do."""
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.shards import load_shards
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    src = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    pretokenize(src, tmp_path / "shards", PretokenizeConfig(chat_template=TEMPLATE), tokenizer=resaved, progress=False)

    def trainer(chat_template):
        model_tok = copy.copy(tokenizer)
        model_tok.chat_template = chat_template
        args = PaddingFreeConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=1,
                                 save_strategy="no")
        model = build_model("pf-trl/tiny-llama", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1)
        return PaddingFreeSFTTrainer(model, args=args, train_dataset=load_shards(tmp_path / "shards"),
                                     processing_class=model_tok)

    assert trainer(TEMPLATE).train_dataset.num_rows == len(CHAT)
    with pytest.raises(ValueError, match=r"chat template differs: the data was rendered with chat template sha256 "):
        trainer(TEMPLATE + " ")
    manifest_path = tmp_path / "shards" / "pf_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    tok = manifest["tokenizer"]
    for key in ("identity", "content", "content_sizes"):
        tok.pop(key)
    tok["sha256"] = tok.pop("files_sha256")  # as an older pf-trl wrote it
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"records only the tokenizer's file hash .*re-run pretokenize"):
        trainer(TEMPLATE)
