"""`pf-trl grpo` / `pf-trl rloo` train a step from a folder with train.jsonl of prompts, with `trl grpo`'s flags and a
reward function named as a dotted path in the working directory; bad input is refused in one line (exit 2)."""

from __future__ import annotations

import json

import pytest

from tests import rl_support as S

pytestmark = pytest.mark.filterwarnings("ignore")

FLAGS = ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true",
         "--logging_steps", "1", "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "2",
         "--max_completion_length", "6", "--beta", "0.1"]


def _run(argv, capsys):
    from pf_trl.cli.main import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    data = tmp_path / "prompts"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in S.prompts(4)))
    (tmp_path / "my_rewards.py").write_text(
        "def short_answers(completions, **kwargs):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.slow
def test_grpo_trains_a_step_from_jsonl(workdir, capsys, tmp_path_factory):
    kind = "grpo"  # pf-trl rloo runs the same script code with RLOOTrainer (its trainer: tests/test_rl_grpo.py)
    folder = S.model_folder(tmp_path_factory.mktemp("cli-model"))
    out = workdir / "out"
    with S.gc_frozen():
        code, stdout, err = _run([kind, "--model_name_or_path", folder, "--dataset_name", "prompts", "--reward_funcs",
                                  "my_rewards.short_answers", "--output_dir", str(out), *FLAGS,
                                  "--max_tokens_per_forward", "24"], capsys)
    assert code == 0, err
    assert f"pf-trl {kind}: model saved to" in stdout
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_grpo_resumes_auto_from_its_committed_checkpoint(workdir, capsys, tmp_path_factory):
    """`--resume_from_checkpoint auto` as a restarted Job passes it: the first run starts from step 0, the second
    resumes from the checkpoint the first committed (its completion marker) and trains the step after it."""
    folder = S.model_folder(tmp_path_factory.mktemp("cli-model"))
    out = workdir / "out"
    pairs = dict(zip(FLAGS[::2], FLAGS[1::2]))
    pairs.update({"--save_strategy": "steps", "--save_steps": "1", "--resume_from_checkpoint": "auto"})
    del pairs["--max_steps"]
    flags = [x for pair in pairs.items() for x in pair]
    argv = ["grpo", "--model_name_or_path", folder, "--dataset_name", "prompts", "--reward_funcs",
            "my_rewards.short_answers", "--output_dir", str(out), *flags]
    with S.gc_frozen():
        code, stdout, err = _run([*argv, "--max_steps", "1"], capsys)
        assert code == 0, err
        assert "no complete checkpoint" in stdout
        assert (out / "checkpoint-1" / "pf_trl_checkpoint_complete.json").is_file()
        code, stdout, err = _run([*argv, "--max_steps", "2"], capsys)
    assert code == 0, err
    assert f"resuming from {out / 'checkpoint-1'}" in stdout
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2]
    assert (out / "checkpoint-2" / "pf_trl_checkpoint_complete.json").is_file()


def test_refusals_are_one_line(workdir, capsys):
    code, _, err = _run(["grpo", "--model_name_or_path", "pf-trl/tiny-llama", "--dataset_name", "prompts",
                         "--reward_funcs", "no_such_reward", "--output_dir", "o", *FLAGS], capsys)
    assert code == 2 and "not a built-in reward" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(["grpo", "--dataset_name", "prompts", "--no_such_flag", "1", *FLAGS], capsys)
    assert code == 2 and "unrecognized arguments" in err
    code, _, err = _run(["rloo", "--model_name_or_path", "pf-trl/tiny-llama", "--dataset_name", "prompts",
                         "--reward_funcs", "my_rewards.missing", "--output_dir", "o", *FLAGS], capsys)
    assert code == 2 and "cannot import" in err


def test_push_to_hub_offline_is_refused_before_any_work(workdir, capsys, monkeypatch):
    """`pf-trl grpo` ends as `trl grpo` does (the final save, then --push_to_hub): an impossible push is said first."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = _run(["grpo", "--model_name_or_path", "pf-trl/tiny-llama", "--dataset_name", "prompts",
                         "--reward_funcs", "my_rewards.short_answers", "--output_dir", "pushed", *FLAGS,
                         "--push_to_hub", "True"], capsys)
    assert code == 2 and "--push_to_hub True needs the Hugging Face Hub" in err and len(err.strip().splitlines()) == 1
    assert not (workdir / "pushed").exists()  # refused before the model or the data were touched
