"""`pf-trl reward` trains what `trl reward` trains (TRL's own script, same flags, same data folder and model folder:
the saved weights agree to float32 rounding) and refuses bad input in one line (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from tests import dpo_support as S

pytestmark = pytest.mark.filterwarnings("ignore")

FLAGS = ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true",
         "--logging_steps", "1", "--per_device_train_batch_size", "2", "--max_steps", "2", "--bf16", "false",
         "--learning_rate", "1e-3", "--seed", "0", "--center_rewards_coefficient", "0.05"]


_run = S.run_cli


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from pf_trl.data.tokenizer import load_tokenizer
    from tests.test_reward_trainer import reward_model

    root = tmp_path_factory.mktemp("reward_cli")
    model = root / "model"
    reward_model().save_pretrained(model)
    load_tokenizer().save_pretrained(model)
    data = root / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in S.pairs(6, seed=4)))
    return str(model), str(data)


@pytest.mark.slow
def test_reward_cli_trains_what_trl_reward_trains(folders, tmp_path, capsys):
    from trl.scripts.reward import main as trl_main
    from trl.scripts.reward import make_parser

    model, data = folders
    common = ["--model_name_or_path", model, "--dataset_name", data, *FLAGS]
    code, out, err = _run(["reward", *common, "--output_dir", str(tmp_path / "pf")], capsys)
    assert code == 0, err[-2000:]
    assert "pf-trl reward: model saved to" in out
    trl_main(*make_parser().parse_args_and_config(args=[*common, "--output_dir", str(tmp_path / "trl")]))
    S.assert_same_trained_weights(tmp_path / "pf", tmp_path / "trl", model)


@pytest.mark.slow
def test_reward_cli_lora_trains_the_adapter_trl_reward_trains(folders, tmp_path, capsys):
    """`--use_peft --lora_task_type SEQ_CLS` (the score head trained beside the adapters, as PEFT does for SEQ_CLS):
    the adapter pf-trl saves equals TRL's to float32 rounding, and training moved it from its start (LoRA's B at 0)."""
    from safetensors.torch import load_file
    from trl.scripts.reward import main as trl_main
    from trl.scripts.reward import make_parser

    model, data = folders
    common = ["--model_name_or_path", model, "--dataset_name", data, *FLAGS, "--use_peft", "--lora_r", "4",
              "--lora_alpha", "8", "--lora_task_type", "SEQ_CLS"]
    code, out, err = _run(["reward", *common, "--output_dir", str(tmp_path / "pf")], capsys)
    assert code == 0, err[-2000:]
    trl_main(*make_parser().parse_args_and_config(args=[*common, "--output_dir", str(tmp_path / "trl")]))
    pf, trl = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("pf", "trl"))
    assert pf.keys() == trl.keys() and any("lora_B" in k for k in trl) and any("score" in k for k in trl)
    for name in trl:
        torch.testing.assert_close(pf[name], trl[name], rtol=1e-4, atol=2e-6, msg=name)
    assert all(float(trl[k].abs().max()) > 0 for k in trl if "lora_B" in k)  # moved from LoRA's zero start


def test_reward_refuses_in_one_line(tmp_path, capsys, folders):
    model, _ = folders
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no pairs"}) + "\n")
    code, _, err = _run(["reward", "--model_name_or_path", model, "--dataset_name", str(bad), "--output_dir",
                         str(tmp_path / "o"), *FLAGS], capsys)
    last = err.strip().splitlines()[-1]  # (datasets' progress bars before it)
    assert code == 2 and last.startswith("pf-trl reward: error:") and "need 'chosen' and 'rejected'" in last
    code, _, err = _run(["reward", "--no_such_flag", "1", *FLAGS], capsys)
    assert code == 2 and "no_such_flag" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(["reward", "--model_name_or_path", model, "--dataset_name", str(bad), "--output_dir",
                         str(tmp_path / "o"), "--dataset_streaming", "True", *FLAGS], capsys)
    assert code == 2 and "--dataset_streaming True is not supported by pf-trl reward" in err.strip().splitlines()[-1]
    # LoRA with trl's default task type (a language model's): TRL fails inside PEFT; pf-trl names the fix
    good = tmp_path / "good"
    good.mkdir()
    (good / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in S.pairs(2)))
    code, _, err = _run(["reward", "--model_name_or_path", model, "--dataset_name", str(good), "--output_dir",
                         str(tmp_path / "o"), "--use_peft", *FLAGS], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("pf-trl reward: error:") and "--lora_task_type SEQ_CLS" in last
