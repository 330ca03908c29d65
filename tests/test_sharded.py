"""Sharded training you can trust: DeepSpeed ZeRO-3 (and ZeRO-2) and FSDP2, two CPU ranks under torchrun (gloo).

The trainings run in ``tests/sharded_harness.py`` (one ``torchrun --nproc_per_node 2`` launch for every two-rank
run, one plain process for the single-process references, one fresh launch of ``pf-trl train --deepspeed``). Every
run trains a tiny Llama for 2 optimizer steps with gradient accumulation 2 on the same data; the claims:

- ZeRO-3 (model partitioned at load by ``zero.Init``, the usual order, and loaded before the config; a tied,
  soft-capped Gemma 2; LoRA with an adapted head) and FSDP2
  (accelerate's plugin: ``fully_shard`` per decoder layer and the root) train exactly as DDP and as one process
  accumulating both ranks' micro-batches, in both padding-free modes: SGD parameters within 1e-7 (the steps move
  them by more than 1e-3), AdamW within 1e-5, losses equal. The one-process run is the reference of every sharded
  run; DDP is checked against it once (SGD, internal mode) and against the sharded runs there, so each further
  reference (the other mode, AdamW, the tied model, LoRA) is one process, not two ranks;
- each run really is sharded (every parameter a ZeRO-3 partition with an empty local tensor, or an FSDP2 DTensor
  whose local shard is smaller), so a silent fallback to DDP fails;
- a sharded checkpoint (ZeRO-3 ``global_step*`` partitions, FSDP2 sharded state dict) resumes exactly: the second
  AdamW step, trained after a resume from the first step's checkpoint, needs the restored moments and sampler
  position;
- the metrics count parameters by their full size on the sharded model;
- negative controls: the same SGD comparison fails for a gradient-scale bug (the world-size factor dropped), the
  self-check without gathering refuses the ZeRO-3 model, and without handing DeepSpeed the process group the
  model cannot even load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import _env, _failure, _torchrun  # the project's torchrun harness (gloo on loopback)

from tolerances import assert_bit_equal

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).with_name("sharded_harness.py")
ZERO3 = ROOT / "k8s" / "deepspeed" / "zero3.json"
ZERO2 = ROOT / "k8s" / "deepspeed" / "zero2.json"
MODES = ("internal", "huggingface")
SGD_PARAM_TOL = 1e-7
ADAMW_PARAM_TOL = 1e-5
LOSS_TOL = 1e-6
STEPS = 2  # optimizer steps of every job: a resume from the checkpoint of step 1 still has a step to train
RESUME_STEP = 1  # the checkpoint the sharded AdamW runs resume from
CLI_STEPS = 1


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, _failure(proc)


def _job(*args, **kwargs) -> dict:
    from sharded_harness import job

    return job(*args, steps=STEPS, **kwargs)


class Runs:
    def __init__(self, out: Path) -> None:
        self.out = out

    def result(self, name: str, rank: int = 0) -> dict:
        return json.loads((self.out / name / f"result_{rank}.json").read_text())

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / name / "weights.pt")


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama and a tied, soft-capped Gemma 2 (tests/sharded_harness.py)."""
    from sharded_harness import save_models

    return save_models(tmp_path_factory.mktemp("sharded_models"))


@pytest.fixture(scope="module")
def cli_shards(tmp_path_factory, sample_rows) -> Path:
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize

    folder = tmp_path_factory.mktemp("sharded_cli")
    rows = folder / "train.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in sample_rows[:24]), encoding="utf-8")
    pretokenize(rows, folder / "shards", PretokenizeConfig(max_seq_len=128), progress=False)
    return folder / "shards"


def _cli_args(shards: Path, out: Path) -> list[str]:
    """`pf-trl train --deepspeed k8s/deepspeed/zero3.json` (the shipped file as it is) on the embedded tiny Llama:
    one step, its ZeRO-3 checkpoint, then the consolidated model."""
    tiny = "num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
    return ["--training_data_path", str(shards), "--output_dir", str(out), "--model_overrides", tiny,
            "--deepspeed", str(ZERO3), "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1",
            "--per_device_train_batch_size", "4", "--report_to", "none", "--padding_free", "internal",
            "--use_cpu", "True", "--max_seq_len", "128", "--disable_tqdm", "True"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models, cli_shards) -> Runs:
    """All trainings: the two-rank launch and the single-process references. The launch's first jobs run where
    DeepSpeed is not set up yet, as in a fresh `pf-trl train`: a negative control, then the CLI itself."""
    out = tmp_path_factory.mktemp("sharded_runs")
    two_rank = [
        _job("zero3_no_adopt", "zero3", fault="no_adopt"),  # fails at load, before DeepSpeed is ever set up
        {"name": "cli", "cli": _cli_args(cli_shards, out / "cli_run")},
        *[_job(f"zero3_sgd_{m}", "zero3", m, eval=True) for m in MODES],
        _job("zero3_no_gather", "zero3", fault="no_gather"),
        _job("ddp_sgd_internal", "ddp", eval=True),
        *[_job(f"fsdp2_sgd_{m}", "fsdp2", m, eval=True) for m in MODES],
        _job("zero3_preloaded_sgd_internal", "zero3_preloaded"),
        _job("zero2_sgd_internal", "zero2"),
        # checkpoints at steps 1 and 2; the resumed runs train step 2 from checkpoint-1
        *[_job(f"{s}_adamw_internal", s, optim="adamw", save_steps=RESUME_STEP) for s in ("zero3", "fsdp2")],
        *[_job(f"{s}_adamw_resumed", s, optim="adamw",
               resume_from=str(out / f"{s}_adamw_internal" / f"checkpoint-{RESUME_STEP}")) for s in ("zero3", "fsdp2")],
        _job("zero3_sgd_no_world_scale", "zero3", fault="no_world_scale"),  # negative control
        _job("zero3_sgd_tied", "zero3", model="gemma2"),
        _job("zero3_sgd_lora", "zero3", lora=True),
    ]
    single = [*[_job(f"single_sgd_{m}", "single", m, eval=True) for m in MODES],
              _job("single_adamw_internal", "single", optim="adamw"),
              _job("single_sgd_tied", "single", model="gemma2"), _job("single_sgd_lora", "single", lora=True)]
    common = {"model": models["llama"], "models": models, "out": str(out), "zero3": str(ZERO3), "zero2": str(ZERO2)}
    for name, jobs in (("two_rank", two_rank), ("single", single)):
        (out / f"{name}.json").write_text(json.dumps({**common, "jobs": jobs}))
    env = {**_env(), "PF_TRL_CACHE": str(out / "cache")}
    proc = subprocess.run(_torchrun(HARNESS, str(out / "two_rank.json")), env=env, capture_output=True, text=True,
                          timeout=900)
    _check(proc)
    proc = subprocess.run([sys.executable, str(HARNESS), str(out / "single.json")], env=env, capture_output=True,
                          text=True, timeout=600)
    _check(proc)
    return Runs(out)


# ------------------------------------------------------------------------------------------ really sharded


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_zero3_partitioned_at_load_trains_sharded(runs, mode):
    for rank in (0, 1):
        r = runs.result(f"zero3_sgd_{mode}", rank)
        assert r["world"] == 2 and r["steps"] == STEPS
        assert r["is_deepspeed_enabled"] and r["zero_stage"] == 3
        assert r["partitioned_at_load"] == r["parameters"] > 0, "zero.Init did not partition the model at load"
        assert r["ds_partitioned"] == r["parameters"], "a parameter is not a ZeRO-3 partition (local numel > 0)"
        assert r["local_numel"] == 0
        # the self-check ran on real weights (gathered module by module): exact on the packed row, and a row with
        # running positions differs (so the check can fail)
        assert r["self_check"]["err"] <= r["self_check"]["tol"] < r["self_check"]["leak"], r["self_check"]
        assert r["head_probe"] is not None and r["head_probe"] < 1e-5  # the head probe ran too (was skipped)


@pytest.mark.slow
def test_zero3_loaded_before_the_config_and_zero2_are_sharded(runs):
    r = runs.result("zero3_preloaded_sgd_internal")
    assert r["partitioned_at_load"] == 0 and r["ds_partitioned"] == r["parameters"] > 0 and r["zero_stage"] == 3
    r = runs.result("zero2_sgd_internal")
    assert r["is_deepspeed_enabled"] and r["zero_stage"] == 2
    assert r["zero2_partitioned_optimizer"], "ZeRO-2 did not partition the optimizer state"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_trains_sharded(runs, mode):
    for rank in (0, 1):
        r = runs.result(f"fsdp2_sgd_{mode}", rank)
        assert r["is_fsdp_enabled"] and not r["is_deepspeed_enabled"]
        assert r["dtensor"] == r["dtensor_local_smaller"] == r["parameters"] > 0, "not every parameter is sharded"


@pytest.mark.slow
def test_ddp_runs_are_not_sharded(runs):
    r = runs.result("ddp_sgd_internal")
    assert not r["is_deepspeed_enabled"] and not r["is_fsdp_enabled"]
    assert r["ds_partitioned"] == r["dtensor"] == 0 and r["local_numel"] == r["full_parameters"]


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ["zero3", "fsdp2"])
def test_sgd_equals_ddp_and_one_process(runs, strategy, mode):
    """Against the one-process run in both modes, and against DDP in internal mode (DDP equals the one-process run
    there: test_ddp_equals_one_process)."""
    run = runs.result(f"{strategy}_sgd_{mode}")
    refs = [f"single_sgd_{mode}"] + (["ddp_sgd_internal"] if mode == "internal" else [])
    for ref in refs:
        r = runs.result(ref)
        assert len(run["losses"]) == len(r["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(run["losses"], r["losses"])) <= LOSS_TOL, (run["losses"], r["losses"])
        assert max_param_diff(runs.weights(f"{strategy}_sgd_{mode}"), runs.weights(ref)) <= SGD_PARAM_TOL, ref
        # evaluation after training, through the sharded model: the token-weighted loss of the same weights
        assert run["eval_loss"] == pytest.approx(r["eval_loss"], abs=LOSS_TOL)


@pytest.mark.slow
def test_ddp_equals_one_process(runs):
    """Two DDP ranks and one process accumulating both ranks' micro-batches: the same losses and weights (so a
    sharded run that equals the one-process run equals DDP)."""
    ddp, single = runs.result("ddp_sgd_internal"), runs.result("single_sgd_internal")
    assert ddp["world"] == 2 and single["world"] == 1
    assert ddp["losses"] == pytest.approx(single["losses"], abs=LOSS_TOL)
    assert max_param_diff(runs.weights("ddp_sgd_internal"), runs.weights("single_sgd_internal")) <= SGD_PARAM_TOL
    assert ddp["eval_loss"] == pytest.approx(single["eval_loss"], abs=LOSS_TOL)


@pytest.mark.slow
def test_zero3_loaded_before_and_zero2_equal_ddp(runs):
    ddp = runs.weights("ddp_sgd_internal")
    for name in ("zero3_preloaded_sgd_internal", "zero2_sgd_internal"):
        assert runs.result(name)["losses"] == pytest.approx(runs.result("ddp_sgd_internal")["losses"], abs=LOSS_TOL)
        assert max_param_diff(runs.weights(name), ddp) <= SGD_PARAM_TOL, name


@pytest.mark.slow
def test_tied_soft_capped_model_under_zero3_equals_one_process(runs):
    r = runs.result("zero3_sgd_tied")
    assert r["partitioned_at_load"] == r["ds_partitioned"] == r["parameters"] > 0
    assert r["self_check"]["err"] <= r["self_check"]["tol"] < r["self_check"]["leak"]
    assert r["head_probe"] is not None and r["head_probe"] < 1e-5  # the soft-capped head reproduced, probed sharded
    assert r["losses"] == pytest.approx(runs.result("single_sgd_tied")["losses"], abs=LOSS_TOL)
    assert max_param_diff(runs.weights("zero3_sgd_tied"), runs.weights("single_sgd_tied")) <= SGD_PARAM_TOL


@pytest.mark.slow
def test_lora_with_an_adapted_head_under_zero3_equals_one_process(runs):
    """LoRA on q/v and on lm_head (the loss calls the adapted, partitioned head as a module) over a model partitioned
    at load: the adapters are trained exactly as in one process."""
    r = runs.result("zero3_sgd_lora")
    assert r["partitioned_at_load"] > 0 and r["ds_partitioned"] == r["parameters"]
    assert r["parameters"] > runs.result("ddp_sgd_internal")["parameters"]  # the adapters are there
    assert r["losses"] == pytest.approx(runs.result("single_sgd_lora")["losses"], abs=LOSS_TOL)
    assert max_param_diff(runs.weights("zero3_sgd_lora"), runs.weights("single_sgd_lora")) <= SGD_PARAM_TOL


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp2"])
def test_adamw_equals_one_process(runs, strategy):
    w = runs.weights(f"{strategy}_adamw_internal")
    losses = runs.result(f"{strategy}_adamw_internal")["losses"]
    assert losses == pytest.approx(runs.result("single_adamw_internal")["losses"], abs=LOSS_TOL)
    assert max_param_diff(w, runs.weights("single_adamw_internal")) <= ADAMW_PARAM_TOL


@pytest.mark.slow
def test_negative_control_a_gradient_scale_bug_fails_the_sgd_comparison(runs, models):
    """The tolerance is meaningful: the steps move the weights by more than 1e-3, and a sharded run that forgets the
    world-size factor (half the gradient) lands more than 1e-4 away from DDP (1e3 times the tolerance)."""
    from transformers import AutoModelForCausalLM

    ddp = runs.weights("ddp_sgd_internal")
    initial = {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(models["llama"]).state_dict().items()}
    assert max_param_diff(ddp, initial) > 1e-3
    assert max_param_diff(runs.weights("zero3_sgd_no_world_scale"), ddp) > 1e-4


@pytest.mark.slow
def test_negative_controls_zero3_at_load_needs_the_gathered_self_check_and_the_process_group(runs):
    for rank in (0, 1):
        error = runs.result("zero3_no_gather", rank)["error"]
        assert error and error.startswith("UnsupportedModelError") and "self-check" in error, error
        error = runs.result("zero3_no_adopt", rank)["error"]
        assert error and "world_size" in error, error  # DeepSpeed sized its batch for one process


# ------------------------------------------------------------------------------------------ resume, metrics


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "fsdp2"])
def test_resume_from_a_sharded_checkpoint_is_exact(runs, strategy):
    folder = runs.out / f"{strategy}_adamw_internal" / f"checkpoint-{RESUME_STEP}"
    assert (folder / "pf_trl_sampler_state.json").is_file()
    if strategy == "zero3":
        shards = sorted(p.name for p in (folder / f"global_step{RESUME_STEP}").iterdir())
        assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(shards), shards
    else:
        assert (folder / "pytorch_model_fsdp_0").is_dir() and (folder / "optimizer_0").is_dir(), \
            sorted(p.name for p in folder.iterdir())
    full = runs.result(f"{strategy}_adamw_internal")
    resumed = runs.result(f"{strategy}_adamw_resumed")
    # the resumed log: step 1 from the checkpoint's trainer state, step 2 trained after the resume
    assert resumed["steps"] == STEPS == RESUME_STEP + 1
    assert_bit_equal(resumed["losses"], full["losses"], why="resume: the same two ranks train the same batches, "
                     "packed the same, from the checkpoint's exact weights, optimizer and sampler state")
    assert max_param_diff(runs.weights(f"{strategy}_adamw_resumed"), runs.weights(f"{strategy}_adamw_internal")) \
        <= SGD_PARAM_TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_sgd_internal", "fsdp2_sgd_internal"])
def test_metrics_count_full_parameters_of_a_sharded_model(runs, name):
    r = runs.result(name)
    expected = runs.result("ddp_sgd_internal")["flop_params"]
    assert r["flop_params"] == r["flop_params_sharded_model"] == expected > 0
    assert r["local_numel"] < r["full_parameters"]  # what counting local tensors would have reported
    assert r["train_tflops"] > 0


# ------------------------------------------------------------------------------------------ the CLI


@pytest.mark.slow
def test_cli_train_deepspeed_zero3_under_torchrun(runs):
    """`pf-trl train --deepspeed k8s/deepspeed/zero3.json` on 2 ranks, in processes where DeepSpeed was not set up:
    the embedded model is partitioned at load, trains, writes ZeRO-3 checkpoints and the consolidated model."""
    assert runs.result("cli", 0)["rc"] == runs.result("cli", 1)["rc"] == 0
    out = runs.out / "cli_run"
    shards = {p.name for p in (out / f"checkpoint-{CLI_STEPS}" / f"global_step{CLI_STEPS}").iterdir()}
    assert {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} <= shards, shards
    metrics = json.loads((out / "train_results.json").read_text())
    assert metrics["train_real_tokens"] > 0 and metrics["train_tflops"] > 0
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in final.parameters()) > 0
    last = AutoModelForCausalLM.from_pretrained(out / f"checkpoint-{CLI_STEPS}")
    for (name, a), (_, b) in zip(final.state_dict().items(), last.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


# ------------------------------------------------------------------------------------------ launch checks


def test_torchrun_on_cpu_without_use_cpu_is_refused(monkeypatch):
    """WORLD_SIZE=2 but no GPU and no use_cpu: accelerate runs one process; each would train alone. Refused."""
    from pf_trl.trainer import PaddingFreeConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: accelerate would start the process group")
    with pytest.raises(ValueError, match=r"2 processes were launched .* --use_cpu True"):
        PaddingFreeConfig(output_dir="unused", report_to=[])


def test_sequence_parallelism_with_zero_or_fsdp_is_refused_by_name():
    from types import SimpleNamespace

    from pf_trl.parallel.checks import check_launch

    for setting in ({"deepspeed": "zero3.json", "fsdp": ""}, {"deepspeed": None, "fsdp": "full_shard"}):
        args = SimpleNamespace(world_size=1, sequence_parallel_size=2, **setting)
        with pytest.raises(ValueError, match="sequence_parallel_size=2 with (deepspeed|fsdp)"):
            check_launch(args)
    check_launch(SimpleNamespace(world_size=1, sequence_parallel_size=2, deepspeed=None, fsdp=""))  # plain DP: ok


def test_shipped_deepspeed_configs_are_valid():
    """k8s/deepspeed/zero{2,3}.json: what transformers fills in from the training arguments is a valid DeepSpeed
    config, and ZeRO-3 consolidates the weights on save (so `save_model` writes model.safetensors)."""
    from types import SimpleNamespace

    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    from pf_trl.trainer import PaddingFreeConfig

    args = PaddingFreeConfig(output_dir="unused", report_to=[], use_cpu=True)
    try:
        for path, stage in ((ZERO2, 2), (ZERO3, 3)):
            config = json.loads(path.read_text())
            assert config["zero_optimization"]["stage"] == stage
            hf = HfTrainerDeepSpeedConfig(str(path))
            hf.trainer_config_process(args)
            hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)),
                                       num_training_steps=10)
            DeepSpeedConfig(hf.config)
        assert json.loads(ZERO3.read_text())["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    finally:
        unset_hf_deepspeed_config()


def test_gathered_forward_is_a_no_op_without_zero3_and_leaves_no_hooks():
    from pf_trl.sharding import full_numel, full_shape, gathered_forward

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    with torch.no_grad(), gathered_forward(model):
        y = model(x)
    torch.testing.assert_close(y, model(x).detach())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert [full_numel(p) for p in model.parameters()] == [12, 3, 6, 2]
    assert full_shape(model[0].weight) == torch.Size([3, 4])
