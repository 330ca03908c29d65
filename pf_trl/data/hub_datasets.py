"""A Hub dataset's splits as ``datasets`` resolves them, confined to the repository, with only the asked-for files
downloaded.

``load_dataset(ORG/NAME, name, split=...)`` resolves a configuration's data files against the repository at one
commit and downloads those; pf-trl does the same: the revision is resolved to a commit once
(:func:`pf_trl.hub.resolve`), ``datasets.load_dataset_builder`` resolves the configuration's files at that commit
(it reads the README alone), and huggingface_hub downloads the files of the splits a run reads, nothing else.

Confinement: a dataset card is written by whoever may push to (or open a pull request on) the repository. Every data
file it names must be a path inside that repository: an absolute path, a ``..`` step, ``~``, or a URL (another host,
an fsspec chain) is refused in one line naming the file, before ``datasets`` resolves anything. The files resolved
are checked again (each one ``hf://datasets/ORG/NAME@COMMIT/...``), and offline, where the cached snapshot folder is
read as a local folder, every file must lie inside that folder (symlinks resolved into the repository's own cache).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

# what a dataset saved whole looks like at a repository's root: it is downloaded whole and read as a local folder
WHOLE_DATASET_FILES = ("pf_manifest.json", "state.json", "dataset_dict.json")
_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


class HubDatasetError(PfTrlError, ValueError):
    """A Hub dataset cannot be read as asked (outside its repository, unknown config, no such split)."""


def outside_reason(pattern: str) -> str | None:
    """Why the data-file pattern ``pattern`` of a dataset card does not name a path inside its repository (None:
    it does)."""
    text = str(pattern)
    if "://" in text or "::" in text:
        return "a URL (another host)"
    if text.startswith(("/", "\\", "~")) or _DRIVE.match(text):
        return "an absolute path"
    if ".." in re.split(r"[\\/]", text):
        return "a path that climbs out with `..`"
    return None


def _patterns(value: Any) -> Iterable[str]:
    """Every path string in a ``data_files`` / ``data_dir`` value (a string, a list, ``{split, path}`` entries)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            if key != "split":
                yield from _patterns(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _patterns(item)


def check_card(readme: Path | None, repo_id: str, flag: str, *, config: str | None = None, data_dir: Any = None,
               data_files: Any = None) -> None:
    """Refuse (HubDatasetError) a data file of the dataset card ``readme`` (the ``data_files`` and ``data_dir`` of
    configuration ``config``; None: of the one ``datasets`` takes by default, every one when it cannot tell), or of
    the caller's own ``data_dir`` / ``data_files``, that is not a path inside ``repo_id``."""
    entries: list[tuple[str, Any]] = [("data_dir", data_dir), ("data_files", data_files)]
    if readme is not None and readme.is_file():
        from datasets.utils.metadata import MetadataConfigs
        from huggingface_hub import DatasetCard

        try:
            configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data)
        except Exception as exc:  # datasets' own refusal of a malformed `configs:` section
            first = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise HubDatasetError(f"{flag} {repo_id}: its README `configs:` cannot be read: {first}") from None
        chosen = [config] if config is not None else (
            [n for n, params in configs.items() if params.get("default")] or
            [n for n in configs if n == "default"] or list(configs))  # one config, or datasets asks for a name
        for name, params in configs.items():
            if name not in chosen:
                continue
            entries += [(f"configuration {name!r}", params.get("data_files")),
                        (f"configuration {name!r}", params.get("data_dir"))]
    for where, value in entries:
        for pattern in _patterns(value):
            reason = outside_reason(pattern)
            if reason:
                raise HubDatasetError(
                    f"{flag} {repo_id}: data file {pattern!r} ({where}) is {reason}, outside the repository; a Hub "
                    "dataset reads only its own files: name paths relative to the repository root")


def _confined(url: str, prefix: str, repo_id: str, flag: str) -> str:
    """The repository path of a resolved data file ``hf://datasets/ORG/NAME@COMMIT/PATH``; refused otherwise."""
    rest = url[len(prefix):] if url.startswith(prefix) else None
    if rest is None or outside_reason(rest) or posixpath.normpath(rest) != rest:
        raise HubDatasetError(f"{flag} {repo_id}: data file {url} lies outside the repository at this commit; a Hub "
                              "dataset reads only its own files: fix its README `configs:`")
    return rest


def check_inside(files: dict[str, list[str]], folder: Path, repo_id: str, flag: str) -> None:
    """Every file of ``files`` lies inside the snapshot folder ``folder`` as written, and, symlinks followed, inside
    the repository's own part of the Hub cache (its blobs); else HubDatasetError naming the file."""
    root = os.path.normpath(os.path.abspath(folder))
    repo_cache = os.path.realpath(Path(folder).parent.parent)  # .../datasets--ORG--NAME
    for paths in files.values():
        for path in paths:
            written = os.path.normpath(os.path.abspath(path))
            real = os.path.realpath(path)
            if os.path.commonpath([root, written]) != root or os.path.commonpath([repo_cache, real]) != repo_cache:
                raise HubDatasetError(f"{flag} {repo_id}: data file {path} lies outside the repository's snapshot "
                                      f"{folder}; a Hub dataset reads only its own files: fix its README `configs:`")


@dataclass(frozen=True)
class HubSplitFiles:
    """A configuration's data files as ``datasets`` resolves them at one commit, confined to the repository, before
    any data file is downloaded: ``files`` their repository paths per split, ``urls`` their ``hf://`` URLs."""

    repo_id: str
    revision: str | None
    commit: str
    files: dict[str, list[str]]
    urls: dict[str, list[str]]


def hub_split_files(repo_id: str, *, config: str | None, data_dir: str | None, data_files: Any,
                    revision: str | None, flag: str) -> HubSplitFiles | tuple[Path, bool]:
    """The cheap half of :func:`hub_splits`: the commit ``revision`` names now, the dataset card checked
    (:func:`check_card`, the README the only file downloaded) and the configuration's files resolved by ``datasets``
    and confined to the repository; no data file is downloaded. A dataset saved whole, or offline: see
    :func:`hub_splits`.

    Raises:
        pf_trl.hub.HubError: the Hub refused or could not be reached (one line).
        HubDatasetError: a file outside the repository, or a configuration ``datasets`` cannot resolve (one line).
    """
    from pf_trl import hub

    found = hub.resolve(repo_id, repo_type="dataset", revision=revision, flag=flag)
    if not found.online or any(name in found.files for name in WHOLE_DATASET_FILES):
        folder = Path(hub.snapshot(repo_id, repo_type="dataset", revision=revision, flag=flag).folder)
        check_card(folder / "README.md", repo_id, flag, config=config, data_dir=data_dir, data_files=data_files)
        return folder, not found.online
    readme = None
    if "README.md" in found.files:
        readme = Path(hub.snapshot(repo_id, repo_type="dataset", revision=revision, flag=flag,
                                   what="files", files=["README.md"]).folder) / "README.md"
    check_card(readme, repo_id, flag, config=config, data_dir=data_dir, data_files=data_files)
    remote = _builder_files(repo_id, found.commit, config=config, data_dir=data_dir, data_files=data_files, flag=flag)
    prefix = f"hf://datasets/{repo_id}@{found.commit}/"
    files = {split: [_confined(url, prefix, repo_id, flag) for url in urls] for split, urls in remote.items()}
    return HubSplitFiles(repo_id=repo_id, revision=revision, commit=found.commit, files=files, urls=remote)


def hub_splits(repo_id: str, *, config: str | None, data_dir: str | None, data_files: Any, revision: str | None,
               splits: Iterable[str] | None, flag: str) -> dict[str, list[str]] | tuple[Path, bool]:
    """``{split: [local files]}`` of the Hub dataset ``repo_id`` (configuration ``config``) at the commit
    ``revision`` names now, the files of ``splits`` (None: every split) downloaded and the others listed by their
    ``hf://`` URL; or, for a dataset saved whole (a pf-trl shards folder, a ``save_to_disk`` folder) or offline (the
    Hub not read), ``(snapshot folder, offline)``: to be read as a local folder, its files checked with
    :func:`check_inside`.

    Raises:
        pf_trl.hub.HubError: the Hub refused or could not be reached (one line).
        HubDatasetError: a file outside the repository, or a configuration ``datasets`` cannot resolve (one line).
    """
    from pf_trl import hub

    found = hub_split_files(repo_id, config=config, data_dir=data_dir, data_files=data_files, revision=revision,
                            flag=flag)
    if not isinstance(found, HubSplitFiles):
        return found
    wanted = set(found.files) if splits is None else set(splits) & set(found.files)
    names = sorted({name for split in wanted for name in found.files[split]})
    folder = Path(hub.snapshot(repo_id, repo_type="dataset", revision=revision, flag=flag, what="files",
                               files=names).folder) if names else None
    return {split: [str(folder / name) for name in found.files[split]] if split in wanted and folder else
            found.urls[split] for split in found.files}


def _builder_files(repo_id: str, commit: str, *, config, data_dir, data_files, flag: str) -> dict[str, list[str]]:
    """The configuration's data files per split as ``datasets`` resolves them at ``commit`` (``hf://`` URLs)."""
    import datasets

    from pf_trl.data.tokenizer import cache_root

    try:
        builder = datasets.load_dataset_builder(repo_id, name=config, revision=commit, data_dir=data_dir,
                                                data_files=data_files, cache_dir=str(cache_root() / "hf-datasets"))
    except Exception as exc:  # datasets' own message: unknown config, no data files...
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        what = f" (configuration {config!r})" if config else ""
        raise HubDatasetError(f"{flag} {repo_id}{what}: datasets cannot resolve its data files: {first}") from None
    return {str(split): [str(f) for f in paths] for split, paths in (builder.config.data_files or {}).items()}
