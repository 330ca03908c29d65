"""A directory committed to a bucket by its manifest, written last; and read back through the node cache.

Layout of a committed prefix ``s3://BUCKET/datasets/NAME``::

    pf_manifest.json                   the commit: written last, one PUT; names the writer folder below
    w-<time>-<random>/<every file>     the files of one writer

Each writer uploads into its own fresh folder, then PUTs the manifest (S3, GCS and Azure are read-after-write
consistent and a PUT is atomic): two writers of the same prefix never mix files, the last manifest wins, and a
reader never sees a half-written dataset. A prefix without a manifest is refused. The manifest's own schema
(which files, their sizes and checksums) belongs to the caller (:mod:`pf_trl.data.remote` for shards); this module
adds one key, :data:`FILES_KEY`, naming the writer folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pf_trl.storage import cache
from pf_trl.storage.errors import RemoteNotFound, StorageError
from pf_trl.storage.filesystem import call, check_access, exists, filesystem, read_bytes, upload, write_bytes
from pf_trl.storage.uri import RemoteURI, parse_uri

FILES_KEY = "storage_files_prefix"
WRITER_PREFIX = "w-"


def new_writer() -> str:
    """A folder name no other writer picks: UTC time (sorts by age) and 8 random hex digits."""
    return f"{WRITER_PREFIX}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def check_destination(uri: str | RemoteURI, manifest_name: str, *, overwrite: bool) -> RemoteURI:
    """Fail early (one line) when the bucket cannot be reached, or holds a committed dataset and not ``overwrite``."""
    u = parse_uri(uri)
    check_access(u)
    if not overwrite and exists(u.join(manifest_name)):
        raise StorageError(f"output {u} already holds a committed dataset ({manifest_name}); choose a new prefix or "
                           "pass --overwrite (the new one replaces it when its upload is complete)")
    return u


def publish_directory(local: str | os.PathLike, uri: str | RemoteURI, *, manifest_name: str, files: list[str],
                      manifest: dict[str, Any], overwrite: bool = False,
                      say: Callable[[str], None] | None = None) -> str:
    """Upload ``files`` (relative to ``local``) into a fresh writer folder under ``uri``, then ``manifest`` (with
    :data:`FILES_KEY` set) as ``uri/manifest_name``, last. Returns ``str(uri)``.

    Raises:
        StorageError: unreachable bucket, refused credentials, or a committed dataset there without ``overwrite``.
    """
    u = check_destination(uri, manifest_name, overwrite=overwrite)
    writer = new_writer()
    local = Path(local)
    total = 0
    started = time.monotonic()
    for name in sorted(files):
        upload(local / name, u.join(writer, name))
        total += (local / name).stat().st_size
    body = {**manifest, FILES_KEY: writer}
    write_bytes(u.join(manifest_name), (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())
    if say:
        took = max(time.monotonic() - started, 1e-6)
        say(f"uploaded {len(files)} files ({total / 1e6:.1f} MB, {total / 1e6 / took:.1f} MB/s) to {u}/{writer}; "
            f"committed by {u}/{manifest_name}")
    return str(u)


def read_committed_manifest(uri: str | RemoteURI, manifest_name: str) -> tuple[dict[str, Any], bytes]:
    """The manifest of a committed prefix, parsed, and its bytes.

    Raises:
        StorageError: no manifest (never committed, or an upload cut short), or an unreadable one.
    """
    u = parse_uri(uri)
    try:
        raw = read_bytes(u.join(manifest_name))
    except RemoteNotFound:
        raise StorageError(f"{u} has no {manifest_name}: it is not a committed pf-trl dataset (an upload cut short, or "
                           f"the wrong prefix); never trained on: run `pf-trl pretokenize SOURCE {u}`") from None
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise StorageError(f"{u}/{manifest_name} is corrupt ({exc}); run `pf-trl pretokenize` into it again") from exc
    return manifest, raw


def entry_key(uri: RemoteURI, manifest_bytes: bytes) -> str:
    """The node-cache entry of one commit of ``uri`` (a new commit of the prefix is a new entry)."""
    return hashlib.sha256(str(uri).encode() + b"\0" + manifest_bytes).hexdigest()[:32]


def files_source(uri: RemoteURI, manifest: dict[str, Any]) -> RemoteURI:
    """The prefix a committed manifest's files are under (its writer folder)."""
    writer = manifest.get(FILES_KEY) or ""
    return uri.join(writer) if writer else uri


def read_ahead_directory(uri: str | RemoteURI, manifest: dict[str, Any], manifest_bytes: bytes, *, manifest_name: str,
                         files: dict[str, int], verify=None):
    """This process's :class:`~pf_trl.storage.readahead.ReadAhead` of the committed prefix ``uri`` (its manifest
    already read): the same cache entry as :func:`fetch_directory`, filled file by file, nothing downloaded yet.

    Raises:
        StorageError: the cache cannot hold the prefix.
    """
    from pf_trl.storage.readahead import open_read_ahead

    u = parse_uri(uri)
    return open_read_ahead(entry_key(u, manifest_bytes), files_source(u, manifest), files, what=str(u),
                           extra={manifest_name: manifest_bytes}, verify=verify)


def fetch_directory(uri: str | RemoteURI, *, manifest_name: str, files_of: Callable[[dict[str, Any]], dict[str, int]],
                    verify: Callable[[Path, dict[str, Any]], None] | None = None) -> Path:
    """The local copy (node cache) of the committed prefix ``uri``: its manifest, then every file it lists, sizes
    checked, ``verify(folder, manifest)`` run before the copy is kept. A new commit is a new cache entry.

    Raises:
        StorageError: no manifest, a file missing or of another size, or the cache cannot hold it.
    """
    u = parse_uri(uri)
    manifest, raw = read_committed_manifest(u, manifest_name)
    files = files_of(manifest)
    key, source = entry_key(u, raw), files_source(u, manifest)
    try:
        return cache.fetch(key, source, files, what=str(u), extra={manifest_name: raw},
                           verify=(lambda folder: verify(folder, manifest)) if verify else None)
    except RemoteNotFound as exc:
        raise StorageError(f"{u}: a file its {manifest_name} lists is missing from the bucket ({exc}); the dataset "
                           "is incomplete: write it again") from exc


def is_file(uri: str | RemoteURI) -> bool:
    """True when ``uri`` names an object (a data file), False for a prefix or nothing.

    Raises:
        StorageError: missing bucket, refused credentials, unreachable endpoint.
    """
    u = parse_uri(uri)
    try:
        return call(u, "reading it", lambda: filesystem(u).info(u.path)).get("type") == "file"
    except RemoteNotFound:
        return False


def fetch_file(uri: str | RemoteURI) -> Path:
    """The local copy (node cache) of the object ``uri`` (a data file), downloaded once per version (ETag, size).

    Raises:
        StorageError: missing bucket or object, refused credentials, unreachable endpoint.
    """
    u = parse_uri(uri)
    info = call(u, "reading its size", lambda: filesystem(u).info(u.path))
    if info.get("type") == "directory":
        raise StorageError(f"{u} is a prefix, not a file, and has no manifest; name a data file or a dataset "
                           "`pf-trl pretokenize` wrote")
    version = str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("LastModified") or "")
    size = int(info.get("size") or 0)
    key = hashlib.sha256(f"{u}\0{version}\0{size}".encode()).hexdigest()[:32]
    entry = cache.fetch(key, u.parent(), {u.name: size}, what=str(u))
    return entry / u.name
