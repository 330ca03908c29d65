"""Shards directories and data files in a bucket: the shards contract (:mod:`pf_trl.data.shards`) on top of
:mod:`pf_trl.storage`.

- :func:`publish_shards`: a finished local shards directory uploaded under a bucket prefix, its manifest last
  (the manifest's ``checksums`` list every file with its size and xxh3 digest; :mod:`pf_trl.storage.datasets`
  adds the writer folder).
- :func:`local_path`: what the data path opens for a URI: a committed dataset, downloaded once per node into the
  cache and verified against the manifest's checksums (a prefix without a manifest, or a file that differs from
  it, is refused in one line, never trained on); or a data file (``train.jsonl``) downloaded into the cache.
  A local path passes through unchanged. With ``read_ahead=True`` (a training set) a dataset published with its
  row layout is only opened: its manifest and lengths are local, its Arrow files follow in the background
  (:func:`open_read_ahead`, read by :mod:`pf_trl.data.lazy_shards`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pf_trl.data.shards import MANIFEST_FILE, ShardsError, read_manifest
from pf_trl.storage import StorageError, is_remote, parse_uri

logger = logging.getLogger("pf_trl.storage")


def _files_of(manifest: dict[str, Any]) -> dict[str, int]:
    checksums = manifest.get("checksums")
    if not isinstance(checksums, dict) or not isinstance(checksums.get("files"), dict):
        raise StorageError("the dataset's manifest lists no files with checksums (written by a pf-trl before "
                           "checksums); pretokenize it again")
    return {name: int(entry.get("bytes", -1)) for name, entry in checksums["files"].items()}


def publish_shards(local: str | os.PathLike, uri: str, *, overwrite: bool = False, say=None) -> str:
    """Upload the shards directory ``local`` to ``uri`` (files under a fresh writer folder, manifest last)."""
    from pf_trl.storage.datasets import publish_directory

    manifest = read_manifest(local)
    files = sorted(_files_of(manifest))
    return publish_directory(local, uri, manifest_name=MANIFEST_FILE, files=files, manifest=manifest,
                             overwrite=overwrite, say=say)


def check_destination(uri: str, *, overwrite: bool) -> None:
    """Before tokenizing into ``uri``: the bucket is reachable, credentials accepted, no dataset there unless
    ``overwrite``."""
    from pf_trl.storage.datasets import check_destination as check

    check(uri, MANIFEST_FILE, overwrite=overwrite)


def _verify(uri: str):
    from pf_trl.data.integrity import ChecksumMismatch, verify_checksums

    def verify(folder: Path, manifest: dict[str, Any]) -> None:
        try:
            verify_checksums(folder, manifest["checksums"])
        except ChecksumMismatch as exc:
            raise ShardsError(f"{uri}: {exc}: the bucket copy is corrupt, refused (nothing trained on it); write the "
                              "dataset again with `pf-trl pretokenize`") from exc
        except ValueError as exc:
            raise ShardsError(f"{uri}: {exc}") from exc

    return verify


def fetch_shards(uri: str) -> Path:
    """The node-cache copy of the committed shards dataset ``uri`` (downloaded once per node, verified)."""
    from pf_trl.storage.datasets import fetch_directory

    return fetch_directory(uri, manifest_name=MANIFEST_FILE, files_of=_files_of, verify=_verify(uri))


def _verify_file(uri: str, checksums: dict[str, Any]):
    """The check of one downloaded file of ``uri`` against its manifest's checksum (the read-ahead's ``verify``)."""
    from pf_trl.data.integrity import HASHERS, file_digest

    algorithm = checksums.get("algorithm")
    if algorithm not in HASHERS:
        raise ShardsError(f"{uri}: the manifest's checksum algorithm {algorithm!r} is unknown; known: "
                          f"{', '.join(HASHERS)}")

    def verify(path: Path, name: str) -> None:
        if file_digest(path, algorithm) != checksums["files"][name].get("digest"):
            raise ShardsError(f"{uri}: shard file {name} does not match its {algorithm} checksum (its bytes changed "
                              "after it was written): the bucket copy is corrupt, refused (nothing trained on it); "
                              "write the dataset again with `pf-trl pretokenize`")

    return verify


def open_read_ahead(uri: str, *, purpose: str = "training data"):
    """``(read-ahead, manifest)`` of the committed dataset ``uri`` with its lengths file local, its Arrow files not yet
    downloaded; None (said in the log) where read-ahead does not apply: ``PF_TRL_READ_AHEAD=0``, or a dataset
    published without its row layout (by a pf-trl before layouts). The caller then downloads it whole.

    Raises:
        StorageError / ShardsError: one line naming the URI (missing manifest, access, endpoint, a corrupt lengths
            file, a cache too small).
    """
    from pf_trl.data.row_layout import LENGTHS_FILE, read_row_layout
    from pf_trl.storage import readahead
    from pf_trl.storage.datasets import read_ahead_directory, read_committed_manifest

    u = parse_uri(uri)
    if not readahead.enabled():
        logger.info("pf-trl: %s: %s=0: downloaded whole before training", u, readahead.ENABLE_ENV)
        return None
    manifest, raw = read_committed_manifest(u, MANIFEST_FILE)
    if read_row_layout(manifest) is None:
        logger.info("pf-trl: %s was published without its row layout (%s): %s is downloaded whole before training "
                    "starts; publish it again with this pf-trl to train while it downloads", u, LENGTHS_FILE, purpose)
        return None
    files = _files_of(manifest)
    ahead = read_ahead_directory(u, manifest, raw, manifest_name=MANIFEST_FILE, files=files,
                                 verify=_verify_file(str(u), manifest["checksums"]))
    ahead.fetch_now(LENGTHS_FILE)
    return ahead, manifest


def local_path(path: Any, *, read_ahead: bool = False, purpose: str | None = None) -> Any:
    """``path`` as a local path: a bucket URI is fetched into the node cache (the data file it names, else the
    committed dataset under that prefix); anything else is returned as given.

    ``read_ahead``: a committed dataset with a row layout is only opened (:func:`open_read_ahead`): the returned
    folder holds its manifest and lengths, its other files arrive later. ``purpose``: what the data is for, said in
    the log line of a dataset that could have been read ahead but is downloaded whole.

    Raises:
        StorageError / ShardsError: one line naming the URI (missing manifest, corrupt file, access, endpoint).
    """
    if not is_remote(path):
        return path
    from pf_trl.storage.datasets import fetch_file, is_file

    uri = parse_uri(path)
    if is_file(uri):
        return fetch_file(uri)
    if read_ahead:
        opened = open_read_ahead(str(uri))
        if opened is not None:
            return opened[0].entry
    elif purpose:
        _say_whole(str(uri), purpose)
    return fetch_shards(str(uri))


def _say_whole(uri: str, purpose: str) -> None:
    """The log line of a dataset downloaded whole although it could be read ahead (it has a row layout)."""
    from pf_trl.data.row_layout import read_row_layout
    from pf_trl.storage import readahead

    if readahead.enabled() and read_row_layout(read_remote_manifest(uri)) is not None:
        logger.info("pf-trl: %s: downloaded whole before use (%s; read-ahead serves the training set of a "
                    "padding-free run)", uri, purpose)


def publish_through_staging(uri: str, write, *, overwrite: bool = False, say=None) -> dict[str, Any]:
    """``write(local_dir)`` (returns the manifest) into a fresh folder of ``$PF_TRL_CACHE/staging``, then the
    folder published to ``uri`` (:func:`publish_shards`); the staging copy is removed afterwards. The bucket is
    checked first, so a wrong credential or a taken prefix fails before any tokenizing."""
    import shutil
    import tempfile

    from pf_trl.storage.cache import staging_dir

    check_destination(uri, overwrite=overwrite)
    staging_dir().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dataset-", dir=staging_dir()))
    try:
        manifest = write(work / "shards")
        publish_shards(work / "shards", uri, overwrite=True, say=say)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def read_remote_manifest(uri: str) -> dict[str, Any]:
    """The manifest of the committed dataset ``uri`` (nothing downloaded).

    Raises:
        StorageError: no manifest (not committed), unreadable, or the bucket cannot be reached.
    """
    from pf_trl.storage.datasets import read_committed_manifest

    return read_committed_manifest(uri, MANIFEST_FILE)[0]
