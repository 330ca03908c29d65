"""What every benchmark script sets first: offline hub access (nothing is downloaded at run time) and the import
path of a checkout (the repository root for ``pf_trl`` and ``pf_trl_dev``, ``tests/`` for the shared test harness).

Imported before anything that reads these variables (``transformers``, ``datasets``, ``tokenizers``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ["TOKENIZERS_PARALLELISM"] = "false"
for _path in (REPO / "tests", REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
