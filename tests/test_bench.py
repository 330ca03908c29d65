"""`pf-trl bench` on the tiny scenario writes the table, JSON and PNG.

The scenario is benchmarks/scenarios/tiny_test.yaml on the first 32 rows of the shipped sample (a JSONL file it names
as its dataset): each run is a fresh subprocess that pretokenizes its dataset, and the whole sample (2,500 rows) cost
~11 s of CPU a test for the 8 examples trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

TINY_TEST = Path(__file__).resolve().parents[1] / "benchmarks" / "scenarios" / "tiny_test.yaml"


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, sample_path) -> Path:
    folder = tmp_path_factory.mktemp("scenario")
    with open(sample_path, encoding="utf-8") as f:
        (folder / "sample32.jsonl").write_text("".join(next(f) for _ in range(32)), encoding="utf-8")
    data = yaml.safe_load(TINY_TEST.read_text())
    data["dataset"] = str(folder / "sample32.jsonl")
    path = folder / "tiny_test.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_bench_tiny_scenario(tmp_path, monkeypatch, capsys, scenario):
    from pf_trl.cli.bench import main

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    assert main([str(scenario), "--modes", "padded,pf-trl", "--examples", "8", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| implementation |" in out and "pf-trl" in out
    report = json.loads((tmp_path / "bench_tiny-test.json").read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"padded", "pf-trl"}
    assert rows["padded"]["real_tokens"] == rows["pf-trl"]["real_tokens"]  # same examples, same real tokens
    assert rows["pf-trl"]["padding_share"] == 0.0 and rows["padded"]["padding_share"] > 0
    assert rows["padded"]["speedup_vs_padded"] == 1.0 and rows["pf-trl"]["speedup_vs_padded"] > 0
    # two interleaved repeats by default: spread per mode, examples named
    for r in rows.values():
        assert r["repeats"] == 2 and len(r["real_tokens_per_second_runs"]) == 2 and r["examples"] == 8
        assert r["real_tokens_per_second_min"] <= r["real_tokens_per_second"] <= r["real_tokens_per_second_max"]
    assert [run["mode"] for run in report["runs"]] == ["padded", "pf-trl", "pf-trl", "padded"]
    assert "min / median / max" in out
    assert report["environment"]["machine"]
    png = tmp_path / "bench_tiny-test.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_rejects_bad_scenarios(tmp_path, capsys):
    from pf_trl.cli.bench import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("modes: [padded, warp-drive]\n")
    assert main([str(bad)]) == 2
    assert "unknown modes" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.slow
def test_bench_default_output_is_fresh_and_untracked(tmp_path, monkeypatch, scenario):
    """Without --output-dir a run writes under ./pf-trl-bench/<name>-<time>, never into benchmarks/results."""
    from pf_trl.cli.bench import main

    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main([str(scenario), "--modes", "pf-trl", "--examples", "4", "--repeats", "1"]) == 0
    written = sorted((tmp_path / "pf-trl-bench").glob("tiny-test-*/bench_tiny-test.json"))
    assert len(written) == 1
    assert not (tmp_path / "benchmarks").exists()
