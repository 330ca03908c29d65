"""The on-disk contract between pretokenize and the trainer: a shards directory.

A shards directory is what ``datasets.Dataset.save_to_disk`` writes (Arrow shards, ``state.json``,
``dataset_info.json``), so ``datasets.load_from_disk`` opens it memory-mapped, plus ``pf_manifest.json``
(schema below, the one place it is defined). The manifest's ``checksums`` entry holds a checksum of every other
file of the directory (:mod:`pf_trl.data.integrity`); :func:`load_shards` verifies them, so a shard changed after
it was written is refused by name instead of trained on. Columns:

- ``input_ids``: ``list<int32>``
- ``labels``: ``list<int32>``, -100 where no loss
- ``length``: ``int32``, ``len(input_ids)`` (the sampler reads only this column)

The same lengths are also kept as ``pf_lengths.npy``, with the manifest's ``row_layout`` naming the rows of each
Arrow file (:mod:`pf_trl.data.row_layout`): what a trainer reading the directory from a bucket needs before its
Arrow files have arrived.

A dataset of many parts (:mod:`pf_trl.data.parts`) is a directory of such directories with a manifest of its own,
written last; :func:`load_shards` opens it as the concatenation of its parts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pf_trl.errors import PfTrlError

MANIFEST_FILE = "pf_manifest.json"
FORMAT_VERSION = 1
COLUMNS = ("input_ids", "labels", "length")
PARTS_KEY = "parts"  # the manifest of a dataset of many parts lists them here (pf_trl.data.parts writes it)


class ShardsError(PfTrlError, ValueError):
    """A shards directory is missing, corrupt or incompatible. The message says which and what to do."""


def shard_features():
    """The Arrow schema of a shards directory, as ``datasets.Features``."""
    from datasets import Features, Sequence, Value

    return Features(
        {
            "input_ids": Sequence(Value("int32")),
            "labels": Sequence(Value("int32")),
            "length": Value("int32"),
        }
    )


def length_stats(lengths: np.ndarray, max_seq_len: int | None, bins: int = 32) -> dict[str, Any]:
    """min/mean/percentiles/max and a fixed-width histogram of example lengths."""
    if lengths.size == 0:
        return {"min": 0, "mean": 0.0, "p50": 0, "p90": 0, "p99": 0, "max": 0, "histogram": {"edges": [], "counts": []}}
    top = max(int(lengths.max()), int(max_seq_len or 0), 1)
    width = max(1, math.ceil(top / bins))
    edges = [i * width for i in range(bins + 1)]
    # Right-closed last bin so that an example of exactly max_seq_len lands in it.
    counts, _ = np.histogram(lengths, bins=np.array(edges, dtype=np.float64))
    return {
        "min": int(lengths.min()),
        "mean": round(float(lengths.mean()), 3),
        "p50": int(np.percentile(lengths, 50, method="lower")),
        "p90": int(np.percentile(lengths, 90, method="lower")),
        "p99": int(np.percentile(lengths, 99, method="lower")),
        "max": int(lengths.max()),
        "histogram": {"edges": edges, "counts": [int(c) for c in counts]},
    }


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest file, last, after the data (the caller makes the whole directory appear atomically).

    Writes ``pf_lengths.npy`` and sets ``manifest["row_layout"]`` first (:mod:`pf_trl.data.row_layout`: a reader of a
    bucket copy builds its sampler from them before the Arrow files arrive), then ``manifest["checksums"]`` to the
    checksums of every other file in ``directory`` (streamed, see :func:`pf_trl.data.integrity.directory_checksums`),
    the lengths file included, so the returned and stored manifests carry them too.
    """
    from pf_trl.data.integrity import directory_checksums
    from pf_trl.data.row_layout import LAYOUT_KEY, write_row_layout

    layout = write_row_layout(directory)
    if layout is None:
        manifest.pop(LAYOUT_KEY, None)  # a copied manifest must not describe files this directory lacks
    else:
        manifest[LAYOUT_KEY] = layout
    manifest["checksums"] = directory_checksums(directory, exclude=(MANIFEST_FILE,))
    with open(Path(directory) / MANIFEST_FILE, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Read and check ``pf_manifest.json`` of a shards directory."""
    directory = Path(path)
    if not directory.exists():
        raise ShardsError(f"shards directory {directory} does not exist; run `pf-trl pretokenize` to create it")
    if not directory.is_dir():
        raise ShardsError(f"{directory} is a file, not a shards directory; pass the directory pretokenize wrote")
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ShardsError(
            f"{directory} has no {MANIFEST_FILE}: it is not a pf-trl shards directory (or an interrupted "
            "write); re-run `pf-trl pretokenize` into a fresh directory"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardsError(f"{manifest_path} is corrupt ({exc}); re-run `pf-trl pretokenize`") from exc
    if not isinstance(manifest, dict):
        raise ShardsError(f"{manifest_path} is not a JSON object; re-run `pf-trl pretokenize`")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ShardsError(
            f"{directory} has shards format version {version!r}; this pf-trl reads version {FORMAT_VERSION}: "
            "re-run `pf-trl pretokenize` with this version"
        )
    for key in ("tokenizer", "counts", "max_seq_len"):
        if key not in manifest:
            raise ShardsError(f"{manifest_path} lacks the {key!r} field; re-run `pf-trl pretokenize`")
    return manifest


def verify_shards(path: str | Path, manifest: dict[str, Any] | None = None, *, memo=None) -> int:
    """Check every file of a shards directory against the checksums of its manifest; returns the bytes read.

    A manifest without checksums (written before pf-trl recorded them) verifies nothing and returns 0.
    ``memo``: see :func:`pf_trl.data.integrity.verify_checksums` (the service keeps one).

    Raises:
        ShardsError: naming the directory and the first file that differs, and what to do.
    """
    from pf_trl.data.integrity import ChecksumMismatch, verify_checksums

    directory = Path(path)
    manifest = read_manifest(directory) if manifest is None else manifest
    checksums = manifest.get("checksums")
    if checksums is None:
        return 0
    try:
        return verify_checksums(directory, checksums, memo=memo)
    except ChecksumMismatch as exc:
        raise ShardsError(f"{directory}: {exc}; the directory is corrupt: re-run `pf-trl pretokenize` into a new "
                          "directory (a service dataset: POST the same request again, it is rebuilt)") from exc
    except ValueError as exc:
        raise ShardsError(f"{directory}: {exc}; re-run `pf-trl pretokenize`") from exc


def load_shards(path: str | Path, *, expected_tokenizer: dict[str, Any] | None = None, verify: bool = True):
    """Open a shards directory memory-mapped and validate it against its manifest.

    Args:
        path: the directory written by :func:`pf_trl.pretokenize` (one part, or a dataset of many parts).
        expected_tokenizer: a :func:`~pf_trl.data.tokenizer.tokenizer_fingerprint`; when given, shards made
            with another tokenizer are refused (their token ids would mean other tokens).
        verify: check every file against the manifest's checksums first (:func:`verify_shards`: one streaming
            read of the data; the cost per GB is in docs/data.md). False skips it.

    Returns:
        datasets.Dataset: columns ``input_ids``, ``labels``, ``length``; its ``pf_manifest`` attribute holds the
        manifest.

    Raises:
        ShardsError: a missing, incompatible or corrupt directory (the message names the file and the fix).
    """
    import datasets

    manifest = read_manifest(path)
    directory = Path(path)
    if verify:
        verify_shards(directory, manifest)
    try:
        if is_multipart(manifest):  # a dataset of parts: their concatenation, no merge copy (pf_trl.data.parts)
            dataset = _load_parts(directory, manifest)
        else:
            dataset = datasets.load_from_disk(str(directory))
    except ShardsError:
        raise
    except Exception as exc:
        raise ShardsError(f"{directory} has a manifest but its Arrow data cannot be opened ({exc}); re-run pretokenize") from exc
    if isinstance(dataset, datasets.DatasetDict):
        raise ShardsError(f"{directory} holds a DatasetDict; pf-trl shards are a single Dataset")
    missing = [c for c in COLUMNS if c not in dataset.column_names]
    if missing:
        raise ShardsError(f"{directory} lacks columns {missing} (has {dataset.column_names}); re-run pretokenize")
    expected = shard_features()
    for column in COLUMNS:
        if dataset.features[column] != expected[column]:
            raise ShardsError(
                f"{directory}: column {column!r} has type {dataset.features[column]}, expected {expected[column]}"
            )
    rows = manifest["counts"].get("examples")
    if rows != dataset.num_rows:
        raise ShardsError(
            f"{directory}: manifest counts {rows} examples but the Arrow data has {dataset.num_rows}; the "
            "directory was modified after it was written: re-run pretokenize"
        )
    if expected_tokenizer is not None:
        check_tokenizer(str(directory), manifest, expected_tokenizer)
    from pf_trl.data.identity import stamp

    stamp(dataset, manifest, where=str(directory))  # shards written before identities were stamped carry one too
    dataset.pf_manifest = manifest
    return dataset



def is_multipart(manifest: dict[str, Any]) -> bool:
    """True for the manifest of a dataset of many parts (:mod:`pf_trl.data.parts`)."""
    return isinstance(manifest.get(PARTS_KEY), list)


def _load_parts(directory: Path, manifest: dict[str, Any]):
    """The ``datasets.Dataset`` of a dataset of many parts: its parts memory-mapped and concatenated in order.

    Raises:
        ShardsError: a listed part is missing or is not the part the dataset manifest recorded.
    """
    import datasets

    loaded = []
    for record in manifest[PARTS_KEY]:
        name = record.get("name") if isinstance(record, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise ShardsError(f"{directory}: the manifest lists a malformed part {record!r}; re-run pretokenize")
        if not (directory / name / MANIFEST_FILE).is_file():
            raise ShardsError(f"{directory}: part {name} listed by the dataset manifest is missing (or was never "
                              "committed); restore it or re-run pretokenize into a new directory")
        part = load_shards(directory / name, verify=False)  # the dataset's checksums cover every part's files
        if part.num_rows != record.get("examples"):
            raise ShardsError(f"{directory}: part {name} has {part.num_rows} rows, the dataset manifest records "
                              f"{record.get('examples')}; the part was replaced: re-run pretokenize")
        loaded.append(part)
    if not loaded:
        raise ShardsError(f"{directory}: the manifest lists no parts; re-run pretokenize")
    return datasets.concatenate_datasets(loaded) if len(loaded) > 1 else loaded[0]


def check_tokenizer(where: str, manifest: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse shards tokenized with another tokenizer than the model's (``ShardsError`` naming what differs and the
    fix), from the manifest alone: :func:`load_shards` and the bucket's lazy shards both call it."""
    from pf_trl.data.tokenizer import mismatch_fix, tokenizer_differences

    have = manifest["tokenizer"]
    differences = tokenizer_differences(have, expected)
    if differences:
        raise ShardsError(
            f"{where} was tokenized with another tokenizer than the model's: {'; '.join(differences)} "
            f"(data: {have.get('name')!r}, sha256 {str(have.get('sha256'))[:12]}; model: "
            f"{expected.get('name')!r}, sha256 {str(expected.get('sha256'))[:12]}); {mismatch_fix(have, expected)}"
        )

def is_shards_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory with a pf-trl manifest (no validation)."""
    return (Path(path) / MANIFEST_FILE).is_file()
