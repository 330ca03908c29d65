"""The docs site builds strictly (every nav page exists, no broken link or anchor, API reference resolves) and the
README keeps to the first hour: the two fresh-machine commands first, at most 200 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("PaddingFreeSFTTrainer") > 0


def test_readme_first_hour():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README has {len(lines)} lines; move detail into docs/"
    head = "\n".join(lines[:12])
    assert "bash scripts/setup.sh && .venv/bin/pf-trl demo" in head
    assert "bash scripts/test.sh" in head
