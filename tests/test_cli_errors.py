"""User errors of every `pf-trl` subcommand: one line on stderr, exit 2, no traceback, hints that name real flags;
cheap checks run before transformers is imported."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

from conftest import write_jsonl

ROWS = [{"prompt": "Name a colour. ", "completion": "Blue."}, {"prompt": "Add 2 and 3. ", "completion": "5."}]
TINY = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", ROWS)


def run(capsys, *args) -> tuple[int, str, str]:
    from pf_trl.cli.main import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    # progress bars (tqdm, carriage returns) are not part of the error
    lines = [line for line in err.splitlines() if line.strip() and "\r" not in line and "%|" not in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def service():
    """A local HTTP server answering GET /v1/datasets/{id} with the status set in `answers`."""
    answers = {"status": 404, "body": {"detail": "unknown dataset"}}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answers["body"]).encode()
            self.send_response(answers["status"])
            self.send_header("Content-Type", "application/problem+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()


def test_file_not_found_is_found_before_transformers_is_imported(tmp_path):
    code = ("import sys; from pf_trl.cli.main import main; rc = main(['train', '--training_data_path', '/nope.jsonl']); "
            "print(rc, 'transformers' in sys.modules, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stderr
    assert_one_line_error(2, proc.stderr, "--training_data_path /nope.jsonl: no such file")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--input_format", "yaml"], ["--input_format 'yaml' is unknown", "alpaca", "sharegpt"]),
        (["--max_seq_len", "0"], ["--max_seq_len must be a positive integer"]),
        (["--max-seq-len", "0"], ["--max_seq_len must be a positive integer"]),  # dash spelling, same flag
        (["--max_seq_len", "999999"], ["exceeds the model's max_position_embeddings (4096)"]),
        (["--truncation", "chop"], ["--truncation 'chop' is unknown"]),
        (["--max_tokens_per_batch", "-3"], ["--max_tokens_per_batch must be a positive integer"]),
        (["--chat_template", "/nope.jinja"], ["--chat_template /nope.jinja: no such file"]),
        (["--tokenizer_name_or_path", "/nope-tok"], ["--tokenizer_name_or_path", "nor a Hub id"]),
        (["--no_such_flag", "3"], ["unknown arguments: --no_such_flag 3"]),
        (["--max_steps", "abc"], ["max_steps", "abc"]),
        (["--eval_strategy", "steps"], ["--eval_strategy steps needs --validation_data_path"]),
        (["--padding_free", "sometimes"], ["padding_free must be one of"]),
    ],
)
def test_train_flag_errors(capsys, tmp_path, data, args, needles):
    rc, _, err = run(capsys, "train", "--training_data_path", data, "--output_dir", tmp_path / "o",
                     "--model_overrides", TINY, *args)
    assert_one_line_error(rc, err, *needles)
    assert "IntervalStrategy" not in err


def test_train_data_errors(capsys, tmp_path):
    txt = tmp_path / "d.txt"
    txt.write_text("hello")
    assert_one_line_error(*run(capsys, "train", "--training_data_path", txt)[::2], "suffix '.txt' is not read")
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert_one_line_error(*run(capsys, "train", "--training_data_path", empty)[::2], "empty")
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "a", "answer": "b"}])
    assert_one_line_error(*run(capsys, "train", "--training_data_path", odd, "--output_dir", tmp_path / "o")[::2],
                          "cannot detect the input format", "--input_format")


def test_model_folder_without_tokenizer(capsys, tmp_path, data):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "vocab_size": 32000}')
    rc, _, err = run(capsys, "train", "--model_name_or_path", folder, "--training_data_path", data)
    assert_one_line_error(rc, err, "holds no tokenizer", "--tokenizer_name_or_path")


def test_budget_smaller_than_the_longest_example(capsys, tmp_path, data):
    rc, _, err = run(capsys, "train", "--training_data_path", data, "--output_dir", tmp_path / "o", "--model_overrides",
                     TINY, "--max_tokens_per_batch", 3, "--report_to", "none")
    assert_one_line_error(rc, err, "--max_tokens_per_batch 3 is smaller than the longest example")


def test_resume_without_checkpoint_is_one_line(capsys, tmp_path, data):
    rc, _, err = run(capsys, "train", "--training_data_path", data, "--output_dir", tmp_path / "o", "--model_overrides",
                     TINY, "--resume_from_checkpoint", "True", "--report_to", "none", "--max_steps", 1)
    assert_one_line_error(rc, err, "no checkpoint found")


def test_service_errors_are_one_line_with_real_flags(capsys, tmp_path, service):
    url, answers = service
    rc, _, err = run(capsys, "train", "--dataset_service_url", url, "--dataset_id", "ds-1")
    assert_one_line_error(rc, err, "knows no dataset 'ds-1'")
    answers.update(status=401, body={"detail": "bad token"})
    rc, _, err = run(capsys, "train", "--dataset_service_url", url, "--dataset_id", "ds-1")
    assert_one_line_error(rc, err, "unauthorized", "--dataset_service_token")
    assert "token=" not in err
    rc, _, err = run(capsys, "train", "--dataset_service_url", "ftp://x", "--dataset_id", "ds-1")
    assert_one_line_error(rc, err, "must start with http://")


def test_unreachable_service_is_waited_on_for_a_bounded_time_and_says_why(capsys, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out, err = run(capsys, "train", "--dataset_service_url", f"http://127.0.0.1:{port}", "--dataset_id", "ds-1",
                       "--dataset_service_timeout_s", 1, "--model_overrides", TINY, "--output_dir", tmp_path / "o")
    assert "not answering yet" in out and "waiting up to 1s (--dataset_service_timeout_s)" in out
    # never reached: the client gives up after min(connect_timeout_s, --dataset_service_timeout_s) and says what to check
    assert_one_line_error(rc, err, "cannot reach the dataset service", "--dataset_service_url")


def test_default_service_wait_is_bounded():
    from pf_trl.cli.train import DataArguments

    assert DataArguments().dataset_service_timeout_s <= 600


def test_pretokenize_errors_and_spellings(capsys, tmp_path, data):
    rc, out, _ = run(capsys, "pretokenize", data, tmp_path / "a", "--max-seq-len", 64, "--no-progress",
                     "--dataset_text_field", "text")
    assert rc == 0 and json.loads(out)["input_format"] == "prompt_completion"
    assert_one_line_error(*run(capsys, "pretokenize", data, tmp_path / "b", "--input-format", "yaml")[::2],
                          "input_format 'yaml' is unknown")
    assert_one_line_error(*run(capsys, "pretokenize", tmp_path / "nope.jsonl", tmp_path / "c")[::2], "no such file")
    assert_one_line_error(*run(capsys, "pretokenize", data, tmp_path / "d", "--bogus", 1)[::2],
                          "unrecognized arguments: --bogus")
    assert_one_line_error(*run(capsys, "pretokenize", data, tmp_path / "e", "--max_seq_len", "x")[::2], "max_seq_len")
    assert_one_line_error(*run(capsys, "pretokenize", data, tmp_path / "a")[::2], "already exists", "--overwrite")
    assert_one_line_error(*run(capsys, "pretokenize", data, tmp_path / "f", "--tokenizer", "/nope")[::2],
                          "nor a Hub id")


@pytest.mark.slow
def test_inspect_samples_show_the_supervised_spans(capsys, tmp_path):
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Name a colour.", "input": "", "output": "Blue."}])
    assert run(capsys, "pretokenize", alpaca, tmp_path / "s", "--no_progress")[0] == 0
    rc, out, _ = run(capsys, "inspect", tmp_path / "s", "--samples", 1)
    assert rc == 0
    assert "format alpaca" in out and "decoded with pf-trl/mistral-7b-v0.1" in out
    assert "--- example 0:" in out and "### Instruction:\nName a colour." in out
    assert "### Response:\n⟦Blue.</s>⟧" in out  # the answer, and only the answer, is marked
    chat = write_jsonl(tmp_path / "c.jsonl", [{"conversations": [{"from": "human", "value": "Hi"},
                                                                 {"from": "gpt", "value": "Hello."}]}])
    assert run(capsys, "pretokenize", chat, tmp_path / "c", "--no_progress")[0] == 0
    rc, out, _ = run(capsys, "inspect", tmp_path / "c", "--samples", 1, "--max-tokens", 64)
    assert rc == 0 and "format sharegpt (chat mask: generation)" in out and "chat template:" in out
    assert "[INST] Hi [/INST]⟦" in out and "Hello.</s>⟧" in out
    assert_one_line_error(*run(capsys, "inspect", tmp_path / "nope")[::2], "does not exist")
    assert_one_line_error(*run(capsys, "inspect", tmp_path / "c", "--samples", -1)[::2], "--samples")
