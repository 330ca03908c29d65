"""Which files a source on disk makes the loader read, checked before anything is opened.

A JSON / JSONL / CSV file is read alone. But a ``datasets.save_to_disk`` folder reads the Arrow files its
``state.json`` names (``_data_files[].filename``, joined to the folder: ``../x.arrow`` or ``/abs/x.arrow`` would
read outside it), and a Parquet file's metadata may place column chunks in other files (``ColumnChunk.file_path``).
:func:`check_source_files` refuses both before any data is opened, so a source reads nothing outside its own
folder (the service's data roots hold the folder), its content hash covers every byte it reads, and no error
message can carry bytes or sizes of a file outside.
"""

from __future__ import annotations

import json
from pathlib import Path

from pf_trl._compat import saved_data_files
from pf_trl.data.formats import FormatError


class SourceFileError(FormatError):
    """A source names a file outside itself, or its metadata cannot be read; the message names it and the fix."""


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _load_json(path: Path, what: str) -> object:
    try:
        if path.stat().st_size > 16 * 2**20:
            raise SourceFileError(f"{path} is {path.stat().st_size} bytes: too large for {what}")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise SourceFileError(f"{path} is not a readable {what} ({type(exc).__name__}); re-save the dataset with "
                              "datasets' save_to_disk") from None


def _named_file(folder: Path, name: object, where: Path) -> Path:
    """``folder / name`` when it is a plain relative name that stays inside ``folder`` (symlinks followed)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise SourceFileError(f"{where} names a data file {name!r:.80} that is not a file name")
    candidate = Path(name)
    root = folder.resolve()
    if candidate.is_absolute() or ".." in candidate.parts or not _inside((folder / candidate).resolve(), root):
        raise SourceFileError(
            f"{where} names the data file {name[:200]!r}, which lies outside the folder {folder}; a save_to_disk "
            "folder keeps its data files inside it: copy them in (or save the dataset again) and retry")
    return folder / candidate


def save_to_disk_files(folder: str | Path) -> list[Path]:
    """Every file ``datasets.load_from_disk(folder)`` reads: each split's ``state.json``, ``dataset_info.json`` and
    the data files its state names, each checked to lie inside ``folder``.

    Raises:
        SourceFileError: a named file (or split folder) outside the folder, or unreadable metadata.
    """
    folder = Path(folder)
    if (folder / "dataset_dict.json").is_file():
        meta = _load_json(folder / "dataset_dict.json", "dataset_dict.json")
        splits = meta.get("splits") if isinstance(meta, dict) else None
        if not isinstance(splits, list):
            raise SourceFileError(f"{folder / 'dataset_dict.json'} has no 'splits' list; re-save the dataset")
        files = [folder / "dataset_dict.json"]
        for split in splits:
            sub = _named_file(folder, split, folder / "dataset_dict.json")
            files += save_to_disk_files(sub)
        return files
    state_path = folder / "state.json"
    if not state_path.is_file():
        raise SourceFileError(f"{folder} has no state.json: it is not a datasets.save_to_disk folder")
    state = _load_json(state_path, "state.json")
    entries = saved_data_files(state)
    if not isinstance(entries, list) or not entries:
        raise SourceFileError(f"{state_path} lists no data files (_data_files); re-save the dataset")
    files = [state_path] + [p for p in (folder / "dataset_info.json",) if p.is_file()]
    for entry in entries:
        files.append(_named_file(folder, entry.get("filename") if isinstance(entry, dict) else entry, state_path))
    return files


def check_parquet_file(path: str | Path) -> None:
    """Refuse a Parquet file whose metadata places column chunks in other files (``file_path``)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(str(path)).metadata
    except Exception as exc:
        raise SourceFileError(f"cannot read {Path(path).name} as Parquet ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        for c in range(group.num_columns):
            if group.column(c).file_path:
                raise SourceFileError(
                    f"{Path(path).name}: row group {g} column {group.column(c).path_in_schema!r} lives in another "
                    "file (Parquet file_path); pass a self-contained Parquet file (pyarrow.parquet.write_table)")


def check_source_files(path: str | Path) -> list[Path]:
    """The files a local source reads, refused (:class:`SourceFileError`) when any lies outside the source."""
    path = Path(path)
    if path.is_dir():
        return save_to_disk_files(path)
    if path.suffix.lower() == ".parquet":
        check_parquet_file(path)
    return [path]
