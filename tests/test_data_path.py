"""The data a user brings: their tokenizer (a model folder whose tokenizer is not the embedded one), their formats
(Alpaca, ShareGPT, chat, TRL conversational prompt-completion), and one data path for the CLI and the Python API."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import datasets
import pytest

from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
from pf_trl.data.shards import load_shards

from conftest import write_jsonl

CHATML_GENERATION = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction: ### Input: ### Response: system user assistant human gpt",
    "Name a colour. Blue is a colour. Add 2 and 3. 2 plus 3 is 5. Say hi in French. Bonjour! Hello there.",
    "You are a helpful assistant. What is the capital of France? Paris is the capital of France.",
]
ALPACA = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue is a colour."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "2 plus 3 is 5."},
    {"instruction": "Say hi in French.", "output": "Bonjour!"},
]
SHAREGPT = [
    {"conversations": [{"from": "system", "value": "You are a helpful assistant."},
                       {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue is a colour."},
                       {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Green."}]},
    {"conversations": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "2 plus 3 is 5."}]},
]
TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


def make_tokenizer():
    """A byte-level BPE built with `tokenizers` (ids unrelated to Mistral's), ChatML template with generation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML_GENERATION
    return tok


def save_model(folder: Path, vocab_size: int, *, with_tokenizer=None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    if with_tokenizer is not None:
        with_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model folder saved with its own (non-embedded) tokenizer."""
    tok = make_tokenizer()
    return save_model(tmp_path_factory.mktemp("model") / "my-model", len(tok), with_tokenizer=tok)


@pytest.fixture(scope="module")
def my_tok(model_dir):
    from pf_trl.data.tokenizer import load_tokenizer

    return load_tokenizer(str(model_dir))


def supervised_runs(tok, example) -> list[str]:
    """Decoded runs of consecutive supervised tokens."""
    runs, current = [], []
    for t, label in zip(example["input_ids"], example["labels"]):
        if label != -100:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


def content_hash(ds) -> str:
    digest = hashlib.sha256()
    for row in ds.select_columns(["input_ids", "labels"]):
        digest.update(json.dumps([row["input_ids"], row["labels"]]).encode())
    return digest.hexdigest()


def run_main(args: list[str]) -> int:
    from pf_trl.cli.main import main

    return main([str(a) for a in args])


# ------------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_defaults_to_the_model_folder(model_dir, my_tok, tmp_path):
    from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, default_tokenizer_for, resolve_tokenizer

    assert default_tokenizer_for(str(model_dir)) == str(model_dir)
    assert default_tokenizer_for("pf-trl/tiny-llama") == DEFAULT_TOKENIZER
    tok = resolve_tokenizer(str(model_dir))
    assert len(tok) == len(my_tok) < 1000 and tok.pf_trl_path == str(model_dir)
    src = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    out = tmp_path / "shards"
    assert run_main(["pretokenize", src, out, "--model-name-or-path", model_dir, "--no_progress"]) == 0
    manifest = load_shards(out).pf_manifest
    assert manifest["tokenizer"]["path"] == str(model_dir) and manifest["tokenizer"]["vocab_size"] == len(my_tok)
    ex = load_shards(out)[0]
    assert my_tok.decode(ex["input_ids"]).startswith("<s>Below is an instruction")


@pytest.mark.slow
def test_tokenizer_files_are_hashed_once_per_version(model_dir, tmp_path, monkeypatch):
    """A command fingerprints its tokenizer several times (cache key, manifest, trainer check): each file is read
    once while unchanged. Negative control: a file rewritten (same bytes, or new ones) is read again, and new bytes
    give a new fingerprint."""
    import pf_trl.data.integrity as integrity
    from pf_trl.data.tokenizer import load_tokenizer, tokenizer_fingerprint

    reads: list[str] = []
    real = integrity.file_digest
    monkeypatch.setattr(integrity, "file_digest", lambda path, *a, **k: reads.append(Path(path).name) or real(path, *a, **k))
    folder = Path(shutil.copytree(model_dir, tmp_path / "model"))  # its own files: fresh and free to change
    tok = load_tokenizer(str(folder))
    first = tokenizer_fingerprint(tok)
    hashed = len(reads)
    assert sorted(reads) == sorted(f for f in first["files"] if f != "tokenizer_config.json") and hashed > 0
    assert tokenizer_fingerprint(tok) == first and len(reads) == hashed, "unchanged files: no second read"
    tok_json = folder / "tokenizer.json"
    tok_json.write_bytes(tok_json.read_bytes())  # same bytes, new ctime: read again, same digest
    assert tokenizer_fingerprint(tok) == first and reads[hashed:] == ["tokenizer.json"]
    template = folder / "chat_template.jinja"
    if template.is_file():
        template.write_text(template.read_text() + " ")
        assert tokenizer_fingerprint(tok)["files_sha256"] != first["files_sha256"]  # the identity of older manifests


def test_train_cli_tokenizes_with_the_model_folder_tokenizer(model_dir, my_tok, tmp_path, capsys):
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    src = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    rc = run_main(["train", "--model_name_or_path", model_dir, "--training_data_path", src, "--max_steps", 1,
                   "--output_dir", tmp_path / "o", "--report_to", "none", "--save_strategy", "no", "--max_seq_len", 256])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"tokenizer {model_dir} (vocab {len(my_tok)})" in out
    (shards,) = (tmp_path / "cache" / "datasets").iterdir()
    assert load_shards(shards).pf_manifest["tokenizer"]["sha256"] == tokenizer_fingerprint(my_tok)["sha256"]


def test_train_cli_model_folder_under_home(model_dir, tmp_path, monkeypatch, capsys):
    """`--model_name_or_path ~/my-model` is the folder in the home directory, in the early checks and when the model
    loads. Negative control: a missing folder there is refused in one line, exit status 2."""
    home = tmp_path / "home"
    shutil.copytree(model_dir, home / "my-model")
    monkeypatch.setenv("HOME", str(home))
    src = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    args = ["--training_data_path", src, "--max_steps", 1, "--output_dir", tmp_path / "o", "--report_to", "none",
            "--save_strategy", "no", "--max_seq_len", 256]
    assert run_main(["train", "--model_name_or_path", "~/my-model", *args]) == 0, capsys.readouterr().err
    assert f"tokenizer {home / 'my-model'}" in capsys.readouterr().out
    assert run_main(["train", "--model_name_or_path", "~/no-such-model", *args]) == 2
    assert "'~/no-such-model' is neither an embedded model" in capsys.readouterr().err


def test_data_made_with_another_tokenizer_is_refused(model_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    mistral = tmp_path / "mistral-shards"
    pretokenize(src, mistral, progress=False)  # the embedded tokenizer
    rc = run_main(["train", "--model_name_or_path", model_dir, "--training_data_path", mistral, "--max_steps", 1,
                   "--output_dir", tmp_path / "o", "--max_seq_len", 256])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "pf-trl/mistral-7b-v0.1" in err and str(model_dir) in err  # both fingerprints named
    # the same shards with the embedded model are accepted (positive control)
    from pf_trl.data.sources import load_training_data
    from pf_trl.data.tokenizer import load_tokenizer

    assert load_training_data(mistral, load_tokenizer()).num_rows == len(ALPACA)


@pytest.mark.slow
def test_tokenizer_larger_than_the_embeddings_is_refused(model_dir, tmp_path, capsys):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pf_trl.data.tokenizer import TokenizerLoadError
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    small = save_model(tmp_path / "small", 64)
    capsys.readouterr()
    rc = run_main(["train", "--model_name_or_path", small, "--tokenizer_name_or_path", model_dir, "--max_seq_len", 256,
                   "--training_data_path", write_jsonl(tmp_path / "a.jsonl", ALPACA), "--output_dir", tmp_path / "o"])
    err = capsys.readouterr().err
    assert rc == 2 and "64 embeddings" in err and "tokens" in err and len(err.strip().splitlines()) == 1
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    args = PaddingFreeConfig(output_dir=str(tmp_path / "p"), report_to="none")
    with pytest.raises(TokenizerLoadError, match="has 32000 tokens but the model has 64 embeddings"):
        PaddingFreeSFTTrainer(model, args=args, train_dataset=datasets.Dataset.from_list(ALPACA))  # raw rows
    with pytest.raises(ValueError, match="token id 64 is outside the model's 64 embeddings"):
        PaddingFreeSFTTrainer(model, args=args, train_dataset=datasets.Dataset.from_list([{"input_ids": [1, 5, 64]}]))
    # tokenized rows inside the embeddings train with any tokenizer (it only supplies the pad id): positive control
    ok = PaddingFreeSFTTrainer(model, args=args, train_dataset=datasets.Dataset.from_list([{"input_ids": [1, 5, 63]}]))
    assert ok.train_dataset.num_rows == 1


def test_python_api_defaults_to_the_model_folder_tokenizer(model_dir, my_tok, tmp_path):
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    trainer = PaddingFreeSFTTrainer(str(model_dir), args=PaddingFreeConfig(output_dir=str(tmp_path / "p"),
                                                                           report_to="none", max_length=256),
                                    train_dataset=datasets.Dataset.from_list(ALPACA))
    assert trainer.processing_class.pf_trl_path == str(model_dir)
    assert trainer.train_dataset.pf_manifest["tokenizer"]["vocab_size"] == len(my_tok)


# ------------------------------------------------------------------------------------------------ formats


def test_alpaca_supervises_exactly_the_output(my_tok, tmp_path):
    from pf_trl.data.formats import ALPACA_PROMPT_NO_INPUT, ALPACA_PROMPT_WITH_INPUT

    manifest = pretokenize(write_jsonl(tmp_path / "a.jsonl", ALPACA), tmp_path / "o", tokenizer=my_tok, progress=False)
    assert manifest["source"]["input_format"] == "alpaca"
    for row, ex in zip(ALPACA, load_shards(tmp_path / "o")):
        assert supervised_runs(my_tok, ex) == [row["output"] + "</s>"]
        prompt = (ALPACA_PROMPT_WITH_INPUT.format(**row) if row.get("input") else
                  ALPACA_PROMPT_NO_INPUT.format(instruction=row["instruction"]))
        assert my_tok.decode(ex["input_ids"]) == "<s>" + prompt + row["output"] + "</s>"
        assert ("### Input:" in prompt) == bool(row.get("input"))


def test_sharegpt_supervises_exactly_the_replies(my_tok, tmp_path):
    manifest = pretokenize(write_jsonl(tmp_path / "s.jsonl", SHAREGPT), tmp_path / "o", tokenizer=my_tok, progress=False)
    assert manifest["source"]["input_format"] == "sharegpt" and manifest["source"]["chat_mask"] == "generation"
    ds = load_shards(tmp_path / "o")
    assert supervised_runs(my_tok, ds[0]) == ["Blue is a colour.<|im_end|>", "Green.<|im_end|>"]
    assert supervised_runs(my_tok, ds[1]) == ["2 plus 3 is 5.<|im_end|>"]
    assert my_tok.decode(ds[0]["input_ids"]).startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_generation_blocks_decide_the_mask_and_prefix_rendering_is_the_fallback(my_tok, tmp_path):
    """Negative control: the same template without {% generation %} supervises what each turn's rendering adds
    (here also the newline after <|im_end|>), so the generation blocks are what the mask follows."""
    rows = [{"messages": [{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                          {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}]}]
    src = write_jsonl(tmp_path / "m.jsonl", rows)
    pretokenize(src, tmp_path / "gen", tokenizer=my_tok, progress=False)
    assert supervised_runs(my_tok, load_shards(tmp_path / "gen")[0]) == ["Blue.<|im_end|>", "Green.<|im_end|>"]
    plain = make_tokenizer()
    plain.chat_template = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    manifest = pretokenize(src, tmp_path / "prefix", tokenizer=plain, progress=False)
    assert manifest["source"]["chat_mask"] == "prefix"
    assert supervised_runs(plain, load_shards(tmp_path / "prefix")[0]) == ["Blue.<|im_end|>\n", "Green.<|im_end|>\n"]


def test_embedded_template_generation_blocks_match_prefix_rendering(tokenizer, tmp_path):
    """The embedded template's {% generation %} blocks give the masks prefix rendering gave before them."""
    from pf_trl.data.formats import FieldNames, render_messages

    rows = {"messages": [SHAREGPT[0]["conversations"]]}
    norm = [{"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]), "content": m["value"]}
            for m in rows["messages"][0]]
    gen = render_messages(tokenizer, {"messages": [norm]}, [0], FieldNames())
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = saved.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        prefix = render_messages(tokenizer, {"messages": [norm]}, [0], FieldNames())
    finally:
        tokenizer.chat_template = saved
    assert gen == prefix and len(gen[1][0]) == 2


def test_conversational_prompt_completion_supervises_the_completion(my_tok, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                        {"role": "user", "content": "Another?"}],
             "completion": [{"role": "assistant", "content": "Green."}]}]
    manifest = pretokenize(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "o", tokenizer=my_tok, progress=False)
    assert manifest["source"]["input_format"] == "conversational_prompt_completion"
    assert supervised_runs(my_tok, load_shards(tmp_path / "o")[0]) == ["Green.<|im_end|>"]  # not the prompt's reply
    pretokenize(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "all", PretokenizeConfig(completion_only_loss=False),
                tokenizer=my_tok, progress=False)
    assert supervised_runs(my_tok, load_shards(tmp_path / "all")[0]) == ["Blue.<|im_end|>", "Green.<|im_end|>"]


def test_input_format_override_and_field_names(my_tok, tmp_path):
    rows = [{"q": r["instruction"], "a": r["output"]} for r in ALPACA]
    src = write_jsonl(tmp_path / "x.jsonl", rows)
    assert run_main(["pretokenize", src, tmp_path / "o", "--input-format", "alpaca", "--instruction-field", "q",
                     "--output_field", "a", "--no_progress"]) == 0
    assert load_shards(tmp_path / "o").pf_manifest["source"]["input_format"] == "alpaca"


@pytest.mark.slow
def test_chat_template_file(tmp_path, capsys):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
                        "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}"
                        "{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]}]
    src = write_jsonl(tmp_path / "m.jsonl", rows)
    assert run_main(["pretokenize", src, tmp_path / "o", "--chat_template", template, "--no_progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["input_format"] == "messages" and summary["chat_mask"] == "generation"
    from pf_trl.data.tokenizer import load_tokenizer

    ex = load_shards(tmp_path / "o")[0]
    assert load_tokenizer().decode(ex["input_ids"]).startswith("user: Hi\nassistant: Hello there")


# --------------------------------------------------------------------- one data path: CLI == Python API


FORMAT_ROWS = {
    "alpaca": ALPACA,
    "sharegpt": SHAREGPT,
    "messages": [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                               {"role": "assistant", "content": "Goodbye."}]}],
    "prompt_completion": [{"prompt": "Name a colour. ", "completion": "Blue."}],
    "conversational_prompt_completion": [{"prompt": [{"role": "user", "content": "Hi"}],
                                          "completion": [{"role": "assistant", "content": "Hello."}]}],
    "text": [{"text": "Name a colour.\n### Response:\nBlue."}],
}


@pytest.mark.parametrize("fmt", sorted(FORMAT_ROWS))
def test_cli_and_python_api_give_the_same_shards(fmt, model_dir, tmp_path):
    """`pf-trl train` and PaddingFreeSFTTrainer(raw rows): the same token ids and labels (hash), per format."""
    from pf_trl.cli.train import build, parse_args
    from pf_trl.data.sources import supervised_token_count
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    rows = FORMAT_ROWS[fmt]
    src = write_jsonl(tmp_path / f"{fmt}.jsonl", rows)
    argv = ["--model_name_or_path", str(model_dir), "--training_data_path", str(src), "--output_dir",
            str(tmp_path / "cli"), "--report_to", "none", "--max_seq_len", "256"]
    options = PretokenizeConfig(max_seq_len=256)
    if fmt == "text":
        argv += ["--response_template", "### Response:"]
        options = PretokenizeConfig(max_seq_len=256, response_template="### Response:")
    cli = build(*parse_args(argv), quiet=True).train_dataset
    api = PaddingFreeSFTTrainer(str(model_dir), args=PaddingFreeConfig(output_dir=str(tmp_path / "api"),
                                                                       report_to="none", max_length=256),
                                train_dataset=datasets.Dataset.from_list(rows), pretokenize_config=options).train_dataset
    assert cli.pf_manifest["source"]["input_format"] == api.pf_manifest["source"]["input_format"] == fmt
    assert content_hash(cli) == content_hash(api)
    assert supervised_token_count(cli) == supervised_token_count(api) > 0


@pytest.mark.slow
def test_every_source_kind_reaches_the_same_shards(tokenizer, tmp_path):
    from pf_trl.data.sources import load_training_data

    ds = datasets.Dataset.from_list(ALPACA)
    file = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    ds.save_to_disk(str(tmp_path / "saved"))
    hashes = {
        "file": content_hash(load_training_data(file, tokenizer)),
        "dataset": content_hash(load_training_data(ds, tokenizer)),
        "dataset_dict": content_hash(load_training_data(datasets.DatasetDict({"train": ds}), tokenizer)),
        "save_to_disk": content_hash(load_training_data(tmp_path / "saved", tokenizer)),
    }
    pretokenize(ds, tmp_path / "shards", progress=False)  # pretokenize() takes a Dataset too
    hashes["shards"] = content_hash(load_training_data(tmp_path / "shards", tokenizer))
    assert len(set(hashes.values())) == 1, hashes
