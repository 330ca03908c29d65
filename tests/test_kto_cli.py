"""`pf-trl kto` trains what `trl kto` trains (TRL's own script, same flags, same data file and model folder, the
reference log-probabilities precomputed: the saved weights agree to float32 rounding) and refuses bad input in one
line (exit 2)."""

from __future__ import annotations

import json

import pytest

from tests import dpo_support as S

pytestmark = pytest.mark.filterwarnings("ignore")

FLAGS = ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true",
         "--logging_steps", "1", "--per_device_train_batch_size", "3", "--max_steps", "2", "--bf16", "false",
         "--learning_rate", "1e-3", "--seed", "0"]


_run = S.run_cli


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from pf_trl.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("kto_cli")
    model = root / "model"
    S.model().save_pretrained(model)
    load_tokenizer().save_pretrained(model)
    rows = [dict(prompt=r["prompt"], completion=r["chosen"], label=bool(i % 2)) for i, r in
            enumerate(S.pairs(6, seed=4))]
    data = root / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(model), str(data)


@pytest.mark.slow
def test_kto_cli_trains_what_trl_kto_trains(folders, tmp_path, capsys):
    from trl.scripts.kto import main as trl_main
    from trl.scripts.kto import make_parser

    model, data = folders
    common = ["--model_name_or_path", model, "--dataset_name", data, "--precompute_ref_log_probs", "true", *FLAGS]
    # as a restartable Job runs it: checkpoints committed by their marker, "auto" starting from step 0 on a first run
    code, out, err = _run(["kto", *common, "--output_dir", str(tmp_path / "pf"), "--save_strategy", "steps",
                           "--save_steps", "2", "--resume_from_checkpoint", "auto"], capsys)
    assert code == 0, err[-2000:]
    assert "pf-trl kto: model saved to" in out and "no complete checkpoint" in out
    assert (tmp_path / "pf" / "checkpoint-2" / "pf_trl_checkpoint_complete.json").is_file()
    trl_main(*make_parser().parse_args_and_config(args=[*common, "--output_dir", str(tmp_path / "trl")]))
    S.assert_same_trained_weights(tmp_path / "pf", tmp_path / "trl", model)


def test_kto_refuses_in_one_line(tmp_path, capsys, folders):
    model, data = folders
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no rows"}) + "\n")
    code, _, err = _run(["kto", "--model_name_or_path", model, "--dataset_name", str(bad), "--output_dir",
                         str(tmp_path / "o"), *FLAGS], capsys)
    last = err.strip().splitlines()[-1]  # (datasets' progress bars before it)
    assert code == 2 and last.startswith("pf-trl kto: error:") and "unpaired rows 'prompt', 'completion'" in last
    code, _, err = _run(["kto", "--no_such_flag", "1", *FLAGS], capsys)
    assert code == 2 and "no_such_flag" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(["kto", "--model_name_or_path", model, "--dataset_name", data, "--output_dir",
                         str(tmp_path / "o"), "--max_tokens_per_batch", "64", *FLAGS], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "would change KTO's KL term" in err
