"""The parity table: every installed SFTConfig / TrainingArguments field is classified, refused values raise at
construction naming the field, fields set to no effect are named in a warning, evidence tests exist, the docs page is
the table rendered for the installed versions."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import datasets
import pytest

from pf_trl.trainer import parity

ROOT = Path(__file__).resolve().parents[1]
REFUSABLE = sorted(name for name, entry in parity.FIELDS.items() if entry.refuse_if is not None)
WARNABLE = sorted(name for name, entry in parity.FIELDS.items() if entry.warn_if is not None)


def test_every_installed_field_is_classified():
    assert parity.unclassified() == [], "classify these fields in pf_trl/trainer/parity.py"
    assert all(entry.status in parity.STATUSES for entry in parity.FIELDS.values())
    assert len(parity.installed_fields()) >= 135  # SFTConfig 1.16 holds 135, TrainingArguments' 114 among them


def test_a_field_added_by_an_upgrade_is_caught():
    """Negative control: a config class with one more field than the table knows."""
    from trl import SFTConfig

    @dataclasses.dataclass
    class NewerSFTConfig(SFTConfig):
        brand_new_option: bool = False

    assert parity.unclassified((NewerSFTConfig,)) == ["brand_new_option"]


def test_docs_page_is_the_table_for_the_installed_versions():
    page = (ROOT / "docs" / "parity.md").read_text(encoding="utf-8")
    assert page == parity.render_markdown(), "regenerate: python -m pf_trl.trainer.parity --write"
    for name in parity.installed_fields():
        assert f"| `{name}` |" in page
    assert "**unclassified**" not in page
    assert "parity.md" in (ROOT / "mkdocs.yml").read_text()


@pytest.mark.parametrize("name", sorted(n for n, e in parity.FIELDS.items() if e.evidence))
def test_evidence_names_an_existing_test(name):
    path, test = parity.FIELDS[name].evidence.split("::")
    assert re.search(rf"^def {test}\(", (ROOT / path).read_text(encoding="utf-8"), re.M), f"{name}: {path}::{test}"


@pytest.mark.parametrize("name", REFUSABLE)
def test_each_refused_value_raises_at_construction_naming_the_field(name, tmp_path):
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    value = parity.FIELDS[name].example
    assert value is not None, f"{name}: give the table entry an example of a refused value"
    with pytest.raises(ValueError, match=rf"\b{name}\b") as caught:
        args = PaddingFreeConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **{name: value})
        PaddingFreeSFTTrainer("pf-trl/tiny-llama", args=args,
                              train_dataset=datasets.Dataset.from_list([{"input_ids": [1, 5, 6, 7]}]))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", REFUSABLE)
def test_refusals_follow_the_value_not_the_name(name):
    """The default value of every refusable field passes (the check reads values, it does not ban names)."""
    from trl import SFTConfig

    default = next(f for f in dataclasses.fields(SFTConfig) if f.name == name)
    value = default.default if default.default is not dataclasses.MISSING else default.default_factory()
    assert not parity.FIELDS[name].refuse_if(value)


@pytest.mark.parametrize("name", WARNABLE)
def test_fields_without_effect_are_named_in_a_warning(name, caplog):
    class Args:
        padding_free, padding_free_mode = True, "huggingface"

    setattr(Args, name, parity.FIELDS[name].example)
    with caplog.at_level(logging.WARNING, logger="pf_trl"):
        parity.check_config(Args())
    assert f"{name}=" in caplog.text and "has no effect" in caplog.text


def test_padded_mode_keeps_trls_behaviour(tmp_path):
    """padding_free_mode='none' is TRL's padded trainer: nothing is refused (dataloader_drop_last drops as TRL does)."""
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], padding_free_mode="none",
                             dataloader_drop_last=True, per_device_train_batch_size=2, max_length=None)
    rows = [{"input_ids": [1] + [5 + i] * (4 + i)} for i in range(5)]
    trainer = PaddingFreeSFTTrainer("pf-trl/tiny-llama", args=args, train_dataset=datasets.Dataset.from_list(rows))
    assert sum(b["input_ids"].shape[0] for b in trainer.get_train_dataloader()) == 4


def test_truncation_policy_field():
    from pf_trl.trainer import PaddingFreeConfig

    assert PaddingFreeConfig(output_dir="x", use_cpu=True, truncation="error").truncation == "refuse"
    with pytest.raises(ValueError, match="truncation policy 'chop' is unknown"):
        PaddingFreeConfig(output_dir="x", use_cpu=True, truncation="chop")
    with pytest.raises(ValueError, match="truncation_mode 'keep_middle' is unknown"):
        PaddingFreeConfig(output_dir="x", use_cpu=True, truncation_mode="keep_middle")


@pytest.mark.slow
def test_one_config_object_builds_two_trainers_alike(tmp_path):
    """What pf-trl hides from TRL during its init (padding_free, assistant_only_loss, skip_prepare_dataset) is restored:
    a second trainer from the same config still applies max_length."""
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_length=8)
    rows = datasets.Dataset.from_list([{"input_ids": list(range(1, 21))}, {"input_ids": list(range(1, 6))}])
    for _ in range(2):
        trainer = PaddingFreeSFTTrainer("pf-trl/tiny-llama", args=args, train_dataset=rows)
        assert sorted(len(r) for r in trainer.train_dataset["input_ids"]) == [5, 8]
    assert (args.dataset_kwargs, args.padding_free, args.padding_free_mode, args.assistant_only_loss) == (
        None, True, "huggingface", None)


# ----------------------------------------------------------------- trl sft's other flags (ScriptArguments, ...)


def test_every_flag_of_trl_sft_is_classified_and_declared():
    """Every field of TRL's ScriptArguments / ModelConfig / DatasetMixtureConfig has a status, and `pf-trl train`
    declares it as a flag (built from TRL's own dataclasses)."""
    from pf_trl.cli.train_args import full_parser
    from pf_trl.trainer import script_parity

    assert script_parity.unclassified() == [], "classify these in pf_trl/trainer/script_parity.py"
    assert all(e.status in (script_parity.HONOURED, script_parity.MAPPED, script_parity.REFUSED)
               for e in script_parity.FIELDS.values())
    fields = script_parity.trl_script_fields()
    assert sum(map(len, fields.values())) >= 28  # TRL 1.16: 6 + 19 + 3
    flags = {s for action in full_parser()._actions for s in action.option_strings}
    missing = [n for names in fields.values() for n in names if f"--{n}" not in flags]
    assert missing == [], f"not flags of pf-trl train: {missing}"
    assert "--config" not in flags  # read before the parser, as TrlParser reads it


def test_a_trl_script_field_added_by_an_upgrade_is_caught(monkeypatch):
    """Negative control: a newer ModelConfig with one more field is unclassified, and the flag it gets is declared."""
    from trl.trainer import model_config

    from pf_trl.trainer import script_parity

    @dataclasses.dataclass
    class NewerModelConfig(model_config.ModelConfig):
        brand_new_model_flag: int = 3

    monkeypatch.setattr(model_config, "ModelConfig", NewerModelConfig)
    assert script_parity.unclassified() == ["brand_new_model_flag"]
    from pf_trl.cli.train_args import DataArguments, ModelArguments
    from pf_trl.cli.trl_fields import extended_arguments

    model_cls, _ = extended_arguments(ModelArguments, DataArguments)
    assert "brand_new_model_flag" in {f.name for f in dataclasses.fields(model_cls)}


def test_docs_page_lists_trl_sfts_other_flags():
    from pf_trl.trainer import script_parity

    page = (ROOT / "docs" / "parity.md").read_text(encoding="utf-8")
    for names in script_parity.trl_script_fields().values():
        for name in names:
            assert f"| `--{name}` |" in page


@pytest.mark.parametrize("name", sorted(n for n, e in __import__("pf_trl.trainer.script_parity", fromlist=["x"])
                                        .FIELDS.items() if e.refuse_if is not None))
def test_each_refused_trl_flag_value_names_the_flag_and_the_way_out(name):
    from pf_trl.trainer import script_parity

    entry = script_parity.FIELDS[name]
    message = script_parity.refusal(name, entry.example)
    assert message and message.startswith(f"--{name} ") and "Way out:" in message
    default = {"model_revision": "main", "lora_task_type": "CAUSAL_LM", "test_split_size": None}.get(name, False)
    assert script_parity.refusal(name, default) is None  # negative control: the default is accepted
