"""A plain SFTConfig / TrainingArguments handed to PaddingFreeSFTTrainer: converted field by field (the *_token
fields kept, not masked as TrainingArguments.to_dict() masks them), and TRL's padding_free bool (False by default,
so not a choice) read as padding-free training, said in a log line. A TrainingArguments (no padding_free) trains
padding-free too."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
COMMON = dict(report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-3, seed=0,
              max_length=None, use_cpu=True, bf16=False, dataloader_num_workers=0, max_steps=1)


@pytest.fixture(scope="module")
def small_ds(sample_shards):
    from pf_trl.data.shards import load_shards

    ds = load_shards(sample_shards)
    keep = np.nonzero(np.asarray(ds["length"]) <= 200)[0][:12]
    return ds.select(keep.tolist()).flatten_indices()


def _trainer(args, ds):
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeSFTTrainer

    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    return PaddingFreeSFTTrainer(model, args=args, train_dataset=ds, processing_class=load_tokenizer())


def _init_fields(obj):
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


@pytest.mark.slow
def test_sft_config_tokens_survive_and_it_trains(tmp_path, small_ds, caplog):
    from trl import SFTConfig

    from pf_trl.trainer import PaddingFreeConfig, to_padding_free_config

    user = SFTConfig(output_dir=str(tmp_path), eos_token="</s>", pad_token="<unk>", hub_token="hf_not_a_real_token",
                     lr_scheduler_type="cosine", eval_strategy="no", gradient_accumulation_steps=2, padding_free=True,
                     **COMMON)
    before = _init_fields(user)
    # every shared field has the user's value (the trainer then sets dataset_kwargs for pretokenized data); checked
    # before the trainer is built, since building a TrainingArguments resets accelerate's state
    converted = to_padding_free_config(user)
    for name, value in _init_fields(user).items():
        assert getattr(converted, name) == value, name  # padding_free included: TRL's bool, the same meaning
    with caplog.at_level(logging.INFO, logger="pf_trl.trainer"):
        trainer = _trainer(user, small_ds)
    args = trainer.args
    assert isinstance(args, PaddingFreeConfig)
    # the *_token fields as given (to_dict() gives '<EOS_TOKEN>', which TRL refuses: not in the vocabulary)
    assert (args.eos_token, args.pad_token, args.hub_token) == ("</s>", "<unk>", "hf_not_a_real_token")
    assert _init_fields(user) == before, "the user's args object is not modified"
    assert (args.padding_free, args.padding_free_mode, trainer.pf_mode) == (True, "huggingface", "huggingface")
    assert "converted to PaddingFreeConfig (padding_free_mode='huggingface')" in caplog.text
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.state.log_history[-1]["train_padding_share"] == 0.0  # trained padding-free, not padded


def test_training_arguments_hub_token_and_enums(tmp_path, small_ds):
    from transformers import TrainingArguments

    user = TrainingArguments(output_dir=str(tmp_path), hub_token="hf_not_a_real_token", optim="adamw_torch",
                             save_strategy="steps", save_steps=7, accelerator_config={"split_batches": False},
                             **{k: v for k, v in COMMON.items() if k not in ("max_length", "save_strategy")})
    trainer = _trainer(user, small_ds)
    args = trainer.args
    assert args.hub_token == "hf_not_a_real_token"  # push_to_hub would authenticate with it
    assert args.optim == user.optim and args.save_strategy == user.save_strategy and args.save_steps == 7
    assert args.accelerator_config.split_batches is False
    assert trainer.pf_mode == "huggingface"


@pytest.mark.parametrize("flag", [True, False])
def test_sft_config_padding_free_bool_means_padding_free(flag, caplog):
    import warnings

    from trl import SFTConfig

    from pf_trl.trainer import to_padding_free_config

    with caplog.at_level(logging.INFO, logger="pf_trl.trainer"), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*padding_free", category=FutureWarning)  # a bool: TRL's spelling
        args = to_padding_free_config(SFTConfig(output_dir="unused", padding_free=flag, **COMMON))
    assert (args.padding_free, args.padding_free_mode) == (True, "huggingface")
    assert ("TRL's default" in caplog.text and "padding_free_mode='none'" in caplog.text) == (not flag)


def test_sft_config_packing_is_refused_with_the_reason():
    from trl import SFTConfig

    from pf_trl.trainer import to_padding_free_config

    with pytest.raises(ValueError, match="packing=True conflicts"):
        to_padding_free_config(SFTConfig(output_dir="unused", packing=True, padding_free=True, **COMMON))
    with pytest.raises(ValueError, match="packing=True conflicts"):  # padding_free=False (the default) alike
        to_padding_free_config(SFTConfig(output_dir="unused", packing=True, **COMMON))


def test_subclass_fields_that_do_not_convert_are_named(caplog):
    from trl import SFTConfig

    from pf_trl.trainer import to_padding_free_config

    @dataclasses.dataclass
    class MyConfig(SFTConfig):
        my_option: int = 3

    with caplog.at_level(logging.WARNING, logger="pf_trl.trainer"):
        args = to_padding_free_config(MyConfig(output_dir="unused", **COMMON))
    assert not hasattr(args, "my_option")
    assert "my_option" in caplog.text
