"""The data options are declared once (`pf_trl.data.options.PretokenizeConfig`): the pretokenize flags, the train
flags, the service's request schema and the Python config are built from that declaration, so an option (here the
chat template, which the service used to refuse) reaches every door, with the same checks and messages."""

from __future__ import annotations

import dataclasses

import pytest

from pf_trl.data.options import (
    OptionError,
    PretokenizeConfig,
    check_option,
    config_from_values,
    for_service,
    option_specs,
    service_field,
)

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _flags(parser) -> set[str]:
    return {s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_every_door_has_every_option_with_the_same_defaults():
    from pf_trl.cli.pretokenize import build_parser
    from pf_trl.cli.train import DataArguments
    from preprocess_service.schemas import PretokenizeOptions

    names = [f.name for f in dataclasses.fields(PretokenizeConfig)]
    assert "chat_template" in names
    assert list(PretokenizeOptions.model_fields) == names
    assert PretokenizeOptions().model_dump() == dataclasses.asdict(PretokenizeConfig())
    assert set(names) <= _flags(build_parser())
    train = {f.name: f.default for f in dataclasses.fields(DataArguments)}
    trl_named = {name for name, (_, spec) in option_specs().items() if spec.trl_field}
    # TRL's --dataset_text_field / --completion_only_loss / --assistant_only_loss / --truncation_mode, and pf-trl's
    # --truncation policy: fields of the trainer config
    assert trl_named == {"text_field", "completion_only_loss", "assistant_only_loss", "truncation", "truncation_mode"}
    assert train["max_seq_len"] is None  # one limit with TRL's --max_length (default 1024, as below)
    for name in set(names) - trl_named - {"max_seq_len"}:
        assert train[name] == getattr(PretokenizeConfig(), name), name
    from pf_trl.cli.train import pretokenize_config
    from pf_trl.trainer import PaddingFreeConfig

    made = pretokenize_config(DataArguments(), PaddingFreeConfig(output_dir="unused", use_cpu=True))
    assert made.to_dict() == PretokenizeConfig().to_dict()  # `pf-trl train`'s defaults are pretokenize's


def test_the_service_schema_carries_the_declared_bounds():
    from preprocess_service.schemas import PretokenizeOptions

    props = PretokenizeOptions.model_json_schema()["properties"]
    assert props["truncation"]["enum"] == list(option_specs()["truncation"][1].choices)
    assert props["max_seq_len"]["exclusiveMinimum"] == 0 and props["max_seq_len"]["maximum"] == 1 << 20
    (text,) = [b for b in props["chat_template"]["anyOf"] if b.get("type") == "string"]
    assert text["maxLength"] == option_specs()["chat_template"][1].max_length
    assert "--" not in props["response_template"]["description"]  # request fields, not CLI flags
    assert PretokenizeOptions(chat_template=TEMPLATE).chat_template == TEMPLATE
    with pytest.raises(ValueError):
        PretokenizeOptions(no_such_option=1)


@pytest.mark.parametrize("name, value, needle", [
    ("max_seq_len", 0, "max_seq_len must be a positive integer"),
    ("max_seq_len", True, "max_seq_len must be an integer"),
    ("input_format", "yaml", "input_format 'yaml' is unknown; use one of auto,"),
    ("truncation", "chop", "truncation 'chop' is unknown"),
    ("shard_size", "5KB", "shard_size '5KB' is not valid"),
    ("text_field", "", "text_field must not be empty"),
    ("chat_template", "hello", "not a Jinja template"),
    ("add_eos", "yes", "add_eos must be true or false"),
])
def test_one_check_per_option_with_its_name(name, value, needle):
    with pytest.raises(OptionError) as info:
        PretokenizeConfig(**{name: value})
    assert needle in str(info.value) and info.value.option == name
    with pytest.raises(OptionError):
        check_option(name, value)


def test_valid_values_pass():
    config = PretokenizeConfig(input_format="sharegpt", chat_template=TEMPLATE, shard_size="2GiB", max_seq_len=8)
    assert config.fields.conversations == "conversations" and config.to_dict()["chat_template"] == TEMPLATE


def test_cli_reads_the_template_from_a_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert config_from_values({"chat_template": str(path)}).chat_template == TEMPLATE
    with pytest.raises(OptionError, match="--chat_template /nope.jinja: no such file"):
        config_from_values({"chat_template": "/nope.jinja"})
    path.write_text("plain text")
    with pytest.raises(OptionError, match="not a Jinja template"):
        config_from_values({"chat_template": str(path)})


def test_messages_speak_the_door_they_go_through():
    cli = ("chat data needs a chat template and the tokenizer has none; pass one with --chat_template FILE or use "
           "another format; or raise --max_seq_len; see --dataset_text_field and --num_proc")
    service = for_service(cli)
    assert "--chat_template" not in service and "options.chat_template (the template text)" in service
    assert "options.max_seq_len" in service and "options.text_field" in service
    assert "--num_proc" in service  # not a data option: left as it is
    assert service_field(service) == "options.chat_template"
    assert service_field("no field here") is None


def test_options_given_on_the_command_line_and_how_shards_differ():
    from pf_trl.cli.train import given_options
    from pf_trl.data.options import option_differences

    assert given_options(["--max-seq-len", "9", "--dataset_text_field", "t", "--learning_rate", "1", "--truncation=drop"]) \
        == {"max_seq_len", "text_field", "truncation"}
    made = PretokenizeConfig(max_seq_len=512, chat_template=TEMPLATE).to_dict()
    assert option_differences(made, {"max_seq_len": 2048, "truncation": "truncate"}) == ["max_seq_len 512 (not 2048)"]
    assert option_differences(made, {"chat_template": None})[0].startswith("chat_template sha256 ")


def test_pretokenize_applies_the_template_without_touching_the_callers_tokenizer(tmp_path, tokenizer):
    import json

    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.shards import load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    src = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    own = tokenizer.chat_template
    template = ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")
    manifest = pretokenize(src, tmp_path / "o", PretokenizeConfig(chat_template=template), tokenizer=tokenizer,
                           progress=False)
    assert tokenizer.chat_template == own  # the caller's (possibly shared) tokenizer is unchanged
    assert manifest["tokenizer"]["chat_template_sha256"] != tokenizer_fingerprint(tokenizer)["chat_template_sha256"]
    ids = load_shards(tmp_path / "o")[0]["input_ids"]
    assert tokenizer.decode(ids).startswith("user: Hi\nassistant: Hello")


@pytest.mark.slow
def test_python_api_takes_the_template_in_the_data_options(tmp_path, tokenizer, monkeypatch):
    """PaddingFreeSFTTrainer(pretokenize_config=PretokenizeConfig(chat_template=...)) with a tokenizer that has none:
    the chat rows are rendered with it, and the trainer's tokenizer (saved with the model) carries it."""
    import copy

    import datasets

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    template = tokenizer.chat_template
    rows = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": f"Hi {i}"},
                                                     {"role": "assistant", "content": f"Hello {i}."}]} for i in range(4)])
    args = PaddingFreeConfig(output_dir=str(tmp_path / "o"), report_to=[], save_strategy="no", use_cpu=True)
    trainer = PaddingFreeSFTTrainer("pf-trl/tiny-llama", args=args, train_dataset=rows, processing_class=plain,
                                    pretokenize_config=PretokenizeConfig(chat_template=template))
    assert trainer.processing_class.chat_template == template and plain.chat_template is None
    first = trainer.train_dataset[0]
    assert plain.decode(first["input_ids"]).startswith("<s>[INST] Hi 0 [/INST] Hello 0.</s>")


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, dict(text_field="text", completion_only_loss=True, assistant_only_loss=True, drop_no_loss=True)),
    ({"dataset_text_field": "body", "completion_only_loss": False, "assistant_only_loss": False, "max_length": None},
     dict(text_field="body", completion_only_loss=False, assistant_only_loss=False, drop_no_loss=False)),
])
def test_the_trainer_and_the_cli_read_the_configs_data_fields_alike(fields, expected):
    """One derivation of the data options from the trainer config (pf_trl.data.prepare.data_options): the trainer
    calls it with no flags, ``pf-trl train`` with its data flags."""
    from types import SimpleNamespace

    from pf_trl.cli.train import pretokenize_config
    from pf_trl.data.prepare import data_options
    from pf_trl.data.sequence_limit import NO_LIMIT

    config = SimpleNamespace(**{"dataset_text_field": "text", "completion_only_loss": None,
                                "assistant_only_loss": None, "max_length": 64, "truncation": "truncate",
                                "truncation_mode": "keep_end", **fields})
    got = data_options(config)
    limit = NO_LIMIT if config.max_length is None else 64
    assert {k: getattr(got, k) for k in expected} == expected
    assert (got.max_seq_len, got.truncation_mode) == (limit, "keep_end")
    flags = SimpleNamespace(**{name: f.default for name, (f, spec) in option_specs().items() if not spec.trl_field})
    flags.response_template = "### Answer:"
    from_cli = pretokenize_config(flags, config)
    assert dataclasses.replace(from_cli, response_template=None) == got  # the same, flags aside
    assert from_cli.response_template == "### Answer:"
