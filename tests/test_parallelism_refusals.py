"""Parallelism settings pf-trl cannot keep exact are refused when the trainer is built, by name, in every mode."""

from __future__ import annotations

import dataclasses

import pytest

from pf_trl.parallel import ParallelismError
from pf_trl.parallel.checks import parallelism_config_refusal

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)


def _trainer(tmp_path, mode="internal", model=None, trainer_kwargs=None, **cfg):
    from datasets import Dataset

    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    model = model or build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    args = PaddingFreeConfig(output_dir=str(tmp_path / "out"), report_to=[], save_strategy="no", use_cpu=True,
                             padding_free=mode, max_length=None, disable_tqdm=True, **cfg)
    data = Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10, 11]]})
    return PaddingFreeSFTTrainer(model, args=args, train_dataset=data, **(trainer_kwargs or {}))


@pytest.mark.parametrize("mode", ["huggingface", "internal", "none"])
@pytest.mark.parametrize("field,name", [("cp_size", "context parallelism"), ("tp_size", "tensor parallelism"),
                                        ("sp_size", "sequence_parallel_size")])
def test_parallelism_config_is_refused_in_every_mode(tmp_path, mode, field, name):
    from accelerate import ParallelismConfig

    with pytest.raises(ParallelismError, match=rf"parallelism_config\.{field}=2.*{name}"):
        _trainer(tmp_path, mode, parallelism_config=ParallelismConfig(**{field: 2}))


def test_unknown_parallelism_setting_is_refused_and_data_parallel_is_not():
    from accelerate import ParallelismConfig

    @dataclasses.dataclass
    class Future(ParallelismConfig):
        ep_size: int | None = None

    assert "ep_size=4" in parallelism_config_refusal(Future(ep_size=4))
    assert parallelism_config_refusal(Future()) is None
    assert parallelism_config_refusal(ParallelismConfig(dp_replicate_size=1, dp_shard_size=1)) is None
    assert parallelism_config_refusal(None) is None


def test_tensor_parallel_model_is_refused(tmp_path):
    from pf_trl.models import build_model

    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    model._tp_size = 2  # what transformers sets on a model loaded with tp_plan
    with pytest.raises(ParallelismError, match="tensor parallelism"):
        _trainer(tmp_path, "none", model=model)


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(padding_free="none"), "packed rows"),
        (dict(sequence_parallel_size=3), "must divide the number of attention heads"),
        (dict(torch_compile=True), "torch_compile"),
        (dict(average_tokens_across_devices=False), "average_tokens_across_devices"),
        (dict(fsdp="full_shard"), "FSDP"),
    ],
    ids=["padded", "heads", "compile", "per-rank-average", "fsdp"],
)
def test_sequence_parallel_settings_that_break_exactness_are_refused(tmp_path, cfg, match):
    cfg = {"sequence_parallel_size": 2, **cfg}
    mode = cfg.pop("padding_free", "internal")
    with pytest.raises(ParallelismError, match=match):
        _trainer(tmp_path, mode, **cfg)


def test_sequence_parallel_kv_heads_must_split_or_divide(tmp_path):
    from pf_trl.models import build_model

    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0,
                        **{**TINY, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48})
    with pytest.raises(ParallelismError, match="3 key/value heads"):
        _trainer(tmp_path, model=model, sequence_parallel_size=2)


def test_sequence_parallel_refuses_moe_aux_loss_and_custom_loss(tmp_path):
    from pf_trl.models import build_model

    with pytest.raises(ParallelismError, match="compute_loss_func"):
        _trainer(tmp_path, sequence_parallel_size=2, trainer_kwargs={"compute_loss_func": lambda *a, **k: None})
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    model.config.output_router_logits = True
    with pytest.raises(ParallelismError, match="load-balancing"):
        _trainer(tmp_path, model=model, sequence_parallel_size=2)


@pytest.mark.parametrize("model_type,match", [("mamba", "recurrent / convolutional layers \\(MambaMixer\\)"),
                                              ("qwen2_vl", "vision-language model")])
def test_sequence_parallel_refuses_stateful_layers_and_vision_language_models(tmp_path, model_type, match):
    """Stateful layers (restarted per example, pf_trl.attention.stateful) and vision-language models would see only
    this rank's slice of the row: refused before any process group is needed."""
    from pf_trl_dev.tiny import tiny_model

    with pytest.raises(ParallelismError, match=match):
        _trainer(tmp_path, model=tiny_model(model_type), sequence_parallel_size=2)


def test_sequence_parallel_needs_several_processes(tmp_path):
    with pytest.raises(ParallelismError, match="torchrun --nproc_per_node 2"):
        _trainer(tmp_path, sequence_parallel_size=2)


def test_cli_refuses_sequence_parallel_in_one_process(tmp_path, capsys, sample_shards):
    from pf_trl.cli.main import main

    rc = main(["train", "--training_data_path", str(sample_shards), "--output_dir", str(tmp_path / "o"),
               "--model_overrides", "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=4,"
               "num_key_value_heads=2", "--max_steps", "1", "--use_cpu", "True", "--report_to", "none",
               "--sequence_parallel_size", "2", "--max_seq_len", "128"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "sequence_parallel_size=2 needs 2 processes" in err[0], err


def test_sequence_parallel_size_must_be_positive(tmp_path):
    from pf_trl.trainer import PaddingFreeConfig

    with pytest.raises(ValueError, match="sequence_parallel_size"):
        PaddingFreeConfig(output_dir=str(tmp_path), sequence_parallel_size=0)
