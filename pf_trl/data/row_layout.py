"""Which file of a shards directory holds which rows, and every row's length, recorded beside the manifest.

A trainer reading a shards directory from a bucket builds its token-budget sampler from the lengths alone and then
fetches the Arrow files in the order its batches need them (:mod:`pf_trl.data.lazy_shards`). For that the directory
carries, written by :func:`pf_trl.data.shards.write_manifest` before the checksums (so the manifest covers them):

- ``pf_lengths.npy``: the ``length`` column, int32, in row order (``numpy.save``; 4 bytes a row);
- the manifest's ``row_layout``: ``{"lengths": "pf_lengths.npy", "files": [{"file": "data-00000-of-00004.arrow",
  "rows": 250000}, ...]}``, the Arrow files in dataset order (``state.json``'s), each with its row count.

A directory whose rows are not plainly the concatenation of its Arrow files (an indices mapping, no ``length``
column) gets no layout; readers then download it whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

LENGTHS_FILE = "pf_lengths.npy"
LAYOUT_KEY = "row_layout"


def open_arrow(path: str | Path):
    """The Arrow table of one file ``datasets`` wrote (IPC stream format), memory-mapped: nothing is read until a
    column's pages are touched."""
    import pyarrow as pa

    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


def data_files(directory: Path) -> list[str] | None:
    """The Arrow files of a ``save_to_disk`` directory in row order, or None when its rows are not their plain
    concatenation."""
    try:
        state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not files or state.get("_indices_data_files"):
        return None
    names = [f.get("filename") for f in files if isinstance(f, dict)]
    if len(names) != len(files) or not all(isinstance(n, str) and "/" not in n for n in names):
        return None
    return names


def write_row_layout(directory: str | Path) -> dict[str, Any] | None:
    """Write ``pf_lengths.npy`` into ``directory`` and return the manifest's ``row_layout`` entry (None, and no
    file, for a directory without a plain layout)."""
    directory = Path(directory)
    (directory / LENGTHS_FILE).unlink(missing_ok=True)  # a stale one (a manifest written again) never stays
    names = data_files(directory)
    if names is None:
        return None
    lengths, files = [], []
    try:
        for name in names:
            table = open_arrow(directory / name)
            if "length" not in table.column_names:
                return None
            lengths.append(table.column("length").to_numpy())
            files.append({"file": name, "rows": int(table.num_rows)})
    except (OSError, ValueError):  # an unreadable Arrow file: the checksums and load_shards report it
        return None
    column = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int32)
    with open(directory / LENGTHS_FILE, "wb") as f:
        np.save(f, np.ascontiguousarray(column, dtype="<i4"), allow_pickle=False)
    return {"lengths": LENGTHS_FILE, "files": files}


def read_row_layout(manifest: dict[str, Any]) -> tuple[list[str], np.ndarray] | None:
    """``(file names in row order, row offsets)`` of a manifest's ``row_layout`` (offsets: ``len(files) + 1``
    cumulative row counts), or None when the manifest has no usable layout (written before layouts, or malformed)."""
    layout = manifest.get(LAYOUT_KEY)
    listed = (manifest.get("checksums") or {}).get("files") or {}
    if not isinstance(layout, dict) or not isinstance(layout.get("files"), list) or layout.get("lengths") not in listed:
        return None
    names, rows = [], []
    for entry in layout["files"]:
        if not isinstance(entry, dict) or entry.get("file") not in listed or not isinstance(entry.get("rows"), int):
            return None
        names.append(entry["file"])
        rows.append(entry["rows"])
    if not names or sum(rows) != (manifest.get("counts") or {}).get("examples"):
        return None
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(rows, out=offsets[1:])
    return names, offsets
