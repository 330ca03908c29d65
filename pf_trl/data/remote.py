"""Shards directories and data files in a bucket: the shards contract (:mod:`pf_trl.data.shards`) on top of
:mod:`pf_trl.storage`.

- :func:`publish_shards`: a finished local shards directory uploaded under a bucket prefix, its manifest last
  (the manifest's ``checksums`` list every file with its size and xxh3 digest; :mod:`pf_trl.storage.datasets`
  adds the writer folder).
- :func:`local_path`: what the data path opens for a URI: a committed dataset, downloaded once per node into the
  cache and verified against the manifest's checksums (a prefix without a manifest, or a file that differs from
  it, is refused in one line, never trained on); or a data file (``train.jsonl``) downloaded into the cache.
  A local path passes through unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pf_trl.data.shards import MANIFEST_FILE, ShardsError, read_manifest
from pf_trl.storage import StorageError, is_remote, parse_uri


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


def local_path(path: Any) -> Any:
    """``path`` as a local path: a bucket URI is fetched into the node cache (the data file it names, else the
    committed dataset under that prefix); anything else is returned as given.

    Raises:
        StorageError / ShardsError: one line naming the URI (missing manifest, corrupt file, access, endpoint).
    """
    if not is_remote(path):
        return path
    from pf_trl.storage.datasets import fetch_file, is_file

    uri = parse_uri(path)
    return fetch_file(uri) if is_file(uri) else fetch_shards(str(uri))


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
