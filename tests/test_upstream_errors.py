"""What TRL / transformers would fail on after tokenizing and building the model is refused first, in one line, exit
2, without importing torch or transformers: a reporter or liger-kernel without its package, `--push_to_hub` offline /
without a token / without a network, a Hub id given as a data path (a Hub dataset is --dataset_name)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import write_jsonl

SCRIPT = r"""
import contextlib, io, json, sys
from pf_trl.cli.main import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = main(json.loads(sys.argv[1]))
print(json.dumps({"rc": rc, "err": err.getvalue(),
                  "heavy": sorted(m for m in ("torch", "transformers", "trl") if m in sys.modules)}))
"""


def refused(argv: list, tmp_path, **env) -> str:
    """The one line `pf-trl train ARGV` fails with (exit 2, no heavy import, a few seconds)."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "input": "", "output": "b"}])
    full = ["train", "--training_data_path", str(data), "--output_dir", str(tmp_path / "out"), *map(str, argv)]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(full)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PF_TRL_CACHE": str(tmp_path / "cache"), **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = json.loads(proc.stdout.splitlines()[-1])
    lines = [line for line in body["err"].splitlines() if line.strip()]
    assert body["rc"] == 2 and len(lines) == 1 and "Traceback" not in body["err"], body
    assert body["heavy"] == [], body["heavy"]
    assert time.monotonic() - start < 30  # seconds, not a model build (generous: a loaded 2-core machine)
    return lines[0]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_missing_packages_and_hub_access_fail_in_one_line(tmp_path):
    assert "--report_to wandb: the 'wandb' package is not installed; pip install wandb" in refused(
        ["--report_to", "wandb"], tmp_path)
    assert "--report_to trackio: the 'trackio' package" in refused(["--report_to", "trackio"], tmp_path)
    assert "--report_to 'wandbb' is not a reporter transformers knows" in refused(["--report_to", "wandbb"], tmp_path)
    assert "--use_liger_kernel True needs the liger-kernel package" in refused(["--use_liger_kernel", "True"], tmp_path)
    assert "but HF_HUB_OFFLINE=1 (offline)" in refused(["--push_to_hub", "True"], tmp_path, HF_HUB_OFFLINE="1")
    online = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "",
              "HUGGING_FACE_HUB_TOKEN": ""}
    assert "needs a Hugging Face token and none is set" in refused(["--push_to_hub", "True"], tmp_path, **online)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    assert f"but {endpoint} cannot be reached" in refused(["--push_to_hub", "True", "--hub_token", "hf_x"], tmp_path,
                                                          **online, HF_ENDPOINT=endpoint)
    line = refused(["--validation_data_path", "HuggingFaceH4/ultrachat_200k"], tmp_path)
    assert "--dataset_name HuggingFaceH4/ultrachat_200k" in line and "local file or folder" in line


def test_the_checks_pass_what_upstream_accepts(tmp_path, monkeypatch):
    """Negative controls: an installed reporter package (found, not imported), none/all, a reachable endpoint with a
    token, a local folder that reads like `org/name`."""
    from pf_trl.cli import upstream

    with pytest.raises(upstream.UpstreamError):
        upstream.check_report_to("wandb")
    (tmp_path / "site" / "wandb").mkdir(parents=True)
    (tmp_path / "site" / "wandb" / "__init__.py").write_text("raise ImportError('never imported by the check')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for value in ("wandb", ["wandb"], "none", "all", None):
        upstream.check_report_to(value)
    with pytest.raises(upstream.UpstreamError, match="tensorboard"):
        upstream.check_report_to("wandb,tensorboard")
    upstream.check_liger(False)

    with socket.socket() as server:  # a listening endpoint and a token: the Hub is reachable
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            monkeypatch.setenv(var, "0")
        upstream.check_push_to_hub(True, "hf_x")
        upstream.check_push_to_hub(False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(upstream.UpstreamError, match="offline"):
            upstream.check_push_to_hub(True, "hf_x")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not upstream.looks_like_hub_id("org/model") and upstream.looks_like_hub_id("org/other")
    assert not upstream.looks_like_hub_id("pf-trl/tiny-llama") and not upstream.looks_like_hub_id("/abs/path")


@pytest.mark.slow
def test_every_reporter_transformers_knows_is_classified():
    """A reporter added by a newer transformers gets its package named here (else it would be refused as unknown)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from pf_trl.cli.upstream import REPORTERS

    assert set(REPORTERS) == set(INTEGRATION_TO_CALLBACK)
