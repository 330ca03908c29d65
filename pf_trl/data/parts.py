"""Datasets of many parts: one shards directory made of committed part directories, read without a merge copy.

A multi-part dataset is a directory holding part directories (each an ordinary shards directory with its own
``pf_manifest.json``: rows, lengths, checksums) and, written last, the dataset's ``pf_manifest.json``. That manifest
has every field a single-part manifest has (``counts`` summed over the parts, ``lengths`` over all rows,
``tokenizer``, ``source``, ``options``), plus:

- ``parts``: the part directories in row order, each ``{"name", "examples", "tokens", "source_rows"}``;
- ``checksums``: every file of every part (``part-.../data-....arrow``, the parts' own manifests included), taken
  from the part manifests rather than read again, so verifying the dataset verifies every part and a part's
  manifest that changed or went missing is refused by name;
- ``row_layout`` and ``pf_lengths.npy``: the Arrow files of all parts in row order and every row's length, so a
  trainer reading the dataset from a bucket builds its sampler before the parts arrive.

:func:`pf_trl.data.shards.load_shards` opens such a directory as the concatenation of its parts (memory-mapped, in
the listed order; this module writes them): the trainer, the token-budget sampler, ``pf-trl inspect`` and
``pf-trl verify`` read it directly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pf_trl.data.shards import PARTS_KEY, ShardsError

__all__ = ["PARTS_KEY", "check_compatible", "combined_source", "merge_counts", "write_parts_manifest"]


def merge_counts(manifests: list[dict]) -> dict:
    """The ``counts`` of a dataset of parts: every key any part has (a part without it counts 0 / false), integers
    summed, booleans (lower-bound flags: "at least this many were lost") true when any part's is; a key of another
    type must be equal in every part."""
    keys = list(dict.fromkeys(k for m in manifests for k in m.get("counts", {})))
    out: dict = {}
    for key in keys:
        values = [m.get("counts", {}).get(key) for m in manifests]
        present = [v for v in values if v is not None]
        if all(isinstance(v, bool) for v in present):
            out[key] = any(present)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            out[key] = sum(present)
        elif all(v == present[0] for v in values):
            out[key] = present[0]
        else:
            raise ShardsError(f"counts.{key} differs between the parts ({values}) and cannot be summed")
    return out


def combined_source(path: str, manifests: list[dict]) -> dict[str, Any]:
    """The ``source`` of a dataset whose parts were tokenized from different sources (the Indexed Job's slices):
    a checksum over the parts' source checksums, their rows summed, their formats, each part's source."""
    import hashlib

    formats = sorted({m["source"].get("input_format") for m in manifests})
    return {
        "path": path,
        "sha256": hashlib.sha256("".join(m["source"]["sha256"] for m in manifests).encode()).hexdigest(),
        "rows": sum(m["source"].get("rows", 0) for m in manifests),
        "input_format": formats[0] if len(formats) == 1 else "mixed",
        "chat_mask": manifests[0]["source"].get("chat_mask"),
        "mask_columns": sorted({c for m in manifests for c in m["source"].get("mask_columns") or []}),
        "parts": [{"path": m["source"].get("path"), "sha256": m["source"]["sha256"],
                   "input_format": m["source"].get("input_format")} for m in manifests],
    }


def check_compatible(names: list[str], manifests: list[dict]) -> None:
    """Refuse parts that cannot form one dataset: another format version, tokenizer, options or truncation."""
    first = manifests[0]
    for name, m in zip(names[1:], manifests[1:]):
        for key in ("format_version", "options", "max_seq_len", "truncation"):
            if m.get(key) != first.get(key):
                raise ShardsError(f"part {name}: {key} {m.get(key)!r} differs from part {names[0]}'s "
                                  f"{first.get(key)!r}; tokenize every part with the same flags")
        for key in ("sha256", "vocab_size"):
            if m["tokenizer"].get(key) != first["tokenizer"].get(key):
                raise ShardsError(f"part {name} was tokenized with another tokenizer than part {names[0]} ({key} "
                                  "differs); tokenize every part with the same tokenizer")
    if any("vision" in m for m in manifests):
        raise ShardsError("the parts hold images (a vision manifest): a dataset of parts is text only; pretokenize "
                          "the source in one run")


def write_parts_manifest(directory: str | Path, names: list[str], manifest: dict[str, Any]) -> dict[str, Any]:
    """Commit ``directory`` as a dataset of the parts ``names`` (in row order), its manifest written last.

    ``manifest`` carries the dataset's own fields (``source``, ``created_unix``, ...); the fields every part
    shares (tokenizer, options, ...) are taken from the first part where ``manifest`` lacks them, and ``counts``,
    ``lengths``, ``parts``, ``row_layout`` and ``checksums`` are derived from the parts. Returns the manifest.

    Raises:
        ShardsError: a part that is not a committed shards directory, or parts that cannot form one dataset.
    """
    from pf_trl.data.integrity import file_digest
    from pf_trl.data.row_layout import LAYOUT_KEY, LENGTHS_FILE, read_row_layout
    from pf_trl.data.shards import MANIFEST_FILE, length_stats, read_manifest

    directory = Path(directory)
    if not names:
        raise ShardsError(f"{directory}: a dataset of parts needs at least one part")
    manifests = [read_manifest(directory / name) for name in names]
    check_compatible(names, manifests)
    first = manifests[0]
    algorithm = (first.get("checksums") or {}).get("algorithm")
    files: dict[str, Any] = {}
    layout_files: list[dict[str, Any]] = []
    lengths: list[np.ndarray] = []
    records = []
    for name, m in zip(names, manifests):
        checksums = m.get("checksums") or {}
        if checksums.get("algorithm") != algorithm or not isinstance(checksums.get("files"), dict):
            raise ShardsError(f"part {name}: its manifest has no checksums of algorithm {algorithm!r}; pretokenize "
                              "it again with this pf-trl")
        for file, entry in checksums["files"].items():
            files[f"{name}/{file}"] = entry
        part_manifest = directory / name / MANIFEST_FILE
        files[f"{name}/{MANIFEST_FILE}"] = {"bytes": part_manifest.stat().st_size,
                                            "digest": file_digest(part_manifest, algorithm)}
        layout = read_row_layout(m)
        if layout is None:
            raise ShardsError(f"part {name} has no row layout (written by an older pf-trl); pretokenize it again")
        layout_names, offsets = layout
        layout_files += [{"file": f"{name}/{f}", "rows": int(b - a)}
                         for f, a, b in zip(layout_names, offsets[:-1], offsets[1:])]
        lengths.append(np.load(directory / name / LENGTHS_FILE, allow_pickle=False))
        records.append({"name": name, "examples": int(m["counts"]["examples"]), "tokens": int(m["counts"]["tokens"]),
                        "source_rows": (m.get("part") or {}).get("source_rows")})
    column = np.concatenate(lengths).astype("<i4")
    with open(directory / LENGTHS_FILE, "wb") as f:
        np.save(f, np.ascontiguousarray(column), allow_pickle=False)
    files[LENGTHS_FILE] = {"bytes": (directory / LENGTHS_FILE).stat().st_size,
                           "digest": file_digest(directory / LENGTHS_FILE, algorithm)}
    out = {key: first[key] for key in ("format_version", "tokenizer", "options", "max_seq_len", "truncation",
                                       "columns") if key in first}
    out.update(manifest)
    out["counts"] = merge_counts(manifests)
    out["lengths"] = length_stats(column, out["max_seq_len"])
    out[PARTS_KEY] = records
    out[LAYOUT_KEY] = {"lengths": LENGTHS_FILE, "files": layout_files}
    out["checksums"] = {"algorithm": algorithm, "files": dict(sorted(files.items()))}
    if int(column.size) != out["counts"]["examples"]:
        raise ShardsError(f"{directory}: the parts' lengths hold {column.size} rows, their manifests count "
                          f"{out['counts']['examples']}; a part changed while the dataset was written")
    tmp = directory / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)  # last: the directory is a dataset from here on
    return out
