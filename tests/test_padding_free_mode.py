"""`padding_free` keeps TRL's boolean meaning; pf-trl's mode is `padding_free_mode`.

True (or unset) trains padding-free in padding_free_mode, False trains TRL's padded path. The old spelling (a mode in
`padding_free`, in Python and as `--padding_free huggingface` on the CLI) is accepted with exactly one FutureWarning
naming the new field; values that contradict each other are refused; configs pickled or saved as JSON by older pf-trl
still load."""

from __future__ import annotations

import json
import pickle
import shlex
import warnings

import datasets
import pytest
import torch

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1}


def _config(**kw):
    from pf_trl.trainer import PaddingFreeConfig

    base = {"output_dir": "unused", "use_cpu": True, "report_to": []}
    return PaddingFreeConfig(**{**base, **kw})


def _deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "padding_free" in str(w.message)]


@pytest.mark.parametrize(
    "given, expected, warned",
    [
        ({}, (True, "huggingface"), 0),  # PaddingFreeConfig() trains padding-free, as before
        ({"padding_free": True}, (True, "huggingface"), 0),
        ({"padding_free": False}, (False, "none"), 0),  # TRL's meaning: padded
        ({"padding_free_mode": "internal"}, (True, "internal"), 0),
        ({"padding_free_mode": "none"}, (False, "none"), 0),
        ({"padding_free": True, "padding_free_mode": "internal"}, (True, "internal"), 0),
        ({"padding_free": False, "padding_free_mode": "none"}, (False, "none"), 0),
        ({"padding_free": "true"}, (True, "huggingface"), 0),  # text from a command line or a JSON file
        ({"padding_free": "internal"}, (True, "internal"), 1),  # the old spelling: one deprecation warning
        ({"padding_free": "huggingface"}, (True, "huggingface"), 1),
        ({"padding_free": "none"}, (False, "none"), 1),
        ({"padding_free": "Internal", "padding_free_mode": "internal"}, (True, "internal"), 1),  # agreeing: accepted
    ],
)
def test_python_spellings(given, expected, warned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _config(**given)
    assert (config.padding_free, config.padding_free_mode) == expected
    assert config.is_padding_free == expected[0]
    messages = _deprecations(caught)
    assert len(messages) == warned, messages
    if warned:
        assert f"padding_free_mode={expected[1]!r}" in messages[0] and "deprecated" in messages[0]
        assert caught[0].filename == __file__, "the warning points at the caller's line"


@pytest.mark.parametrize(
    "given, needle",
    [
        ({"padding_free": "internal", "padding_free_mode": "huggingface"}, "conflicts with padding_free_mode='huggingface'"),
        ({"padding_free": "none", "padding_free_mode": "internal"}, "conflicts with padding_free_mode='internal'"),
        ({"padding_free": False, "padding_free_mode": "internal"}, "padding_free=False trains padded"),
        ({"padding_free": True, "padding_free_mode": "none"}, "padding_free=True trains padding-free"),
        ({"padding_free": "sometimes"}, "padding_free must be one of True, False"),
        ({"padding_free_mode": "sometimes"}, "padding_free_mode must be one of huggingface, internal, none"),
    ],
)
def test_python_conflicts_are_refused(given, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        _config(**given)


def _tiny_trainer(tmp_path, args, **kw):
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeSFTTrainer

    rows = datasets.Dataset.from_list([{"input_ids": [1] + [5 + i] * (3 + 2 * i)} for i in range(6)])
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    return PaddingFreeSFTTrainer(model, args=args, train_dataset=rows, processing_class=load_tokenizer(), **kw)


def test_padding_free_false_trains_trls_padded_batches(tmp_path):
    """TRL's meaning of the bool, with its negative control: padding_free=True batches one packed row with pf-trl's
    collator (TRL sees False during its init, or it would refuse that collator and max_length); padding_free=False is
    TRL's padded path: its collator, padded [B, T] batches with an attention mask."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from pf_trl.batching.collator import PaddingFreeCollator
    from pf_trl.trainer import PaddingFreeConfig

    common = {"use_cpu": True, "report_to": [], "save_strategy": "no", "per_device_train_batch_size": 3,
              "max_length": 64, "dataloader_num_workers": 0, "bf16": False}
    on = PaddingFreeConfig(output_dir=str(tmp_path / "on"), padding_free=True, **common)
    packed = _tiny_trainer(tmp_path, on)
    assert packed.pf_mode == "huggingface" and isinstance(packed.data_collator, PaddingFreeCollator)
    batch = next(iter(packed.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch and "position_ids" in batch
    assert on.padding_free is True, "restored after TRL's __init__"

    off = PaddingFreeConfig(output_dir=str(tmp_path / "off"), padding_free=False, **common)
    padded = _tiny_trainer(tmp_path, off)
    assert padded.pf_mode == "none" and type(padded.data_collator) is DataCollatorForLanguageModeling
    assert not padded.data_collator.padding_free
    batch = next(iter(padded.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 3 and bool((batch["attention_mask"] == 0).any()), "padded rows"
    padded.train()
    assert padded.state.log_history[-1]["train_padding_share"] > 0


def test_trl_itself_refuses_what_pf_trl_hides_from_it(tmp_path):
    """Why hidden_from_trl still hides padding_free=True: TRL's own __init__ refuses pf-trl's collator with it."""
    from trl import SFTConfig, SFTTrainer

    from pf_trl.batching.collator import PaddingFreeCollator
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model

    rows = datasets.Dataset.from_list([{"input_ids": [1, 5, 6, 7]}, {"input_ids": [1, 8, 9]}])
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], padding_free=True, max_length=None,
                     bf16=False)
    with pytest.raises(ValueError, match="custom data collator is not supported when using padding-free"):
        SFTTrainer(build_model("pf-trl/tiny-llama", seed=0, **TINY), args=args, train_dataset=rows,
                   processing_class=load_tokenizer(), data_collator=PaddingFreeCollator(pad_token_id=0))


# ---------------------------------------------------------------------------------------------- older configs


def _old_shape(mode: str):
    """A PaddingFreeConfig as pf-trl pickled it before padding_free_mode: the mode in padding_free, no new field."""
    from pf_trl.trainer import PaddingFreeConfig

    config = _config(padding_free_mode=mode)
    state = {k: v for k, v in config.__dict__.items() if k != "padding_free_mode"}
    state["padding_free"] = mode
    old = PaddingFreeConfig.__new__(PaddingFreeConfig)
    old.__dict__.update(state)
    return old


@pytest.mark.parametrize("mode", ["huggingface", "internal", "none"])
def test_training_args_bin_of_older_pf_trl_loads(tmp_path, mode):
    path = tmp_path / "training_args.bin"
    torch.save(_old_shape(mode), path)  # what Trainer._save wrote into every checkpoint
    assert b"padding_free_mode" not in path.read_bytes()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*padding_free", category=FutureWarning)  # not the user's spelling
        loaded = torch.load(path, weights_only=False)
    assert (loaded.padding_free, loaded.padding_free_mode) == (mode != "none", mode)
    again = pickle.loads(pickle.dumps(loaded))  # and the new shape round-trips
    assert (again.padding_free, again.padding_free_mode) == (mode != "none", mode)


def test_json_config_of_older_pf_trl_loads(tmp_path):
    from transformers import HfArgumentParser

    from pf_trl.trainer import PaddingFreeConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "padding_free": "internal", "use_cpu": True,
                                "report_to": []}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (config,) = HfArgumentParser(PaddingFreeConfig).parse_json_file(str(path))
    assert (config.padding_free, config.padding_free_mode) == (True, "internal")
    assert len(_deprecations(caught)) == 1


# ---------------------------------------------------------------------------------------------- the CLI


class _Built(Exception):
    """Raised by a stand-in for train.build: the command line was parsed into this config."""


@pytest.fixture
def cli(monkeypatch, tmp_path, sample_path):
    from pf_trl.cli import train

    def fake_build(model_args, data_args, config, **kw):
        raise _Built(config)

    monkeypatch.setattr(train, "build", fake_build)
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))

    def run(flags: str):
        from pf_trl.cli.main import main

        argv = ["train", "--training_data_path", str(sample_path), "--output_dir", str(tmp_path / "o"),
                *shlex.split(flags)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                rc = main(argv)
            except _Built as built:
                return built.args[0], _deprecations(caught)
        return rc, _deprecations(caught)

    return run


@pytest.mark.parametrize(
    "flags, expected, warned",
    [
        ("", (True, "huggingface"), 0),
        ("--padding_free_mode internal", (True, "internal"), 0),
        ("--padding-free-mode none", (False, "none"), 0),
        ("--padding_free False", (False, "none"), 0),  # TRL's switch
        ("--padding_free true", (True, "huggingface"), 0),
        ("--padding_free --padding_free_mode internal", (True, "internal"), 0),  # bare flag: True (TRL's nargs='?')
        ("--padding_free internal", (True, "internal"), 1),  # the seed's / fms-hf-tuning's spelling
        ("--padding_free huggingface", (True, "huggingface"), 1),
        ("--padding-free=none", (False, "none"), 1),
        ("--padding_free internal --padding_free_mode internal", (True, "internal"), 1),
    ],
)
def test_cli_spellings(cli, flags, expected, warned):
    config, messages = cli(flags)
    assert not isinstance(config, int), f"refused with rc {config}"
    assert (config.padding_free, config.padding_free_mode) == expected
    assert len(messages) == warned, messages
    if warned:
        assert f"--padding_free_mode {expected[1]}" in messages[0]


@pytest.mark.parametrize(
    "flags, needle",
    [
        ("--padding_free internal --padding_free_mode huggingface",
         "--padding_free internal and --padding_free_mode huggingface both set --padding_free_mode"),
        ("--padding_free false --padding_free_mode internal", "padding_free=False trains padded"),
        ("--padding_free true --padding_free_mode none", "padding_free=True trains padding-free"),
        ("--padding_free sometimes", "--padding_free must be one of true, false"),
        ("--padding_free_mode sometimes", "invalid choice: 'sometimes'"),
        ("--evaluation_strategy steps --eval_strategy no", "both set --eval_strategy"),
    ],
)
def test_cli_conflicts_are_refused(cli, capsys, flags, needle):
    rc, _ = cli(flags)
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_flag_aliases_are_one_table():
    """Every other spelling is a row of FLAG_ALIASES; normalizing twice changes nothing and warns once."""
    from pf_trl.cli.flags import FLAG_ALIASES, normalize_flags

    flags = [a.flag for a in FLAG_ALIASES]
    assert len(flags) == len(set(flags)) and "--padding_free" in flags
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        once = normalize_flags(["--padding_free", "internal", "--max_seq_length", "8"], command="train")
        assert normalize_flags(once, command="train") == once == ["--padding_free_mode", "internal", "--max_seq_len", "8"]
    assert len(_deprecations(caught)) == 1
    # other commands keep their own --padding_free (pf-trl demo's mode flag) and TRL's bool stays a bool
    assert normalize_flags(["--padding_free", "internal"], command="demo") == ["--padding_free", "internal"]
    assert normalize_flags(["--padding_free", "false"], command="train") == ["--padding_free", "false"]
