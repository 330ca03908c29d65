"""Bucket URIs: which strings name a location in object storage, and their parts.

``s3://BUCKET/KEY`` (AWS S3 and S3-compatible stores), ``gs://`` / ``gcs://`` (Google Cloud Storage), ``az://`` /
``abfs://`` / ``abfss://`` (Azure Blob Storage / ADLS Gen2). Anything else (a local path, ``hf://``...) is not
remote here. The one place pf-trl parses these schemes.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from pf_trl.storage.errors import StorageError

# scheme -> the fsspec protocol that serves it (s3fs, gcsfs, adlfs)
SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "az", "abfs": "abfs", "abfss": "abfs"}
PACKAGES = {"s3": "s3fs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def is_remote(path: Any) -> bool:
    """True when ``path`` is a string naming object storage (``s3://``, ``gs://``, ``az://``, ``abfs://``)."""
    if not isinstance(path, str):
        return False  # a pathlib.Path collapses "s3://" into "s3:/": only strings carry a URI
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


@dataclass(frozen=True)
class RemoteURI:
    """A parsed bucket URI: ``scheme://bucket/key`` (key without leading or trailing slashes, may be empty)."""

    scheme: str
    bucket: str
    key: str

    @property
    def protocol(self) -> str:
        """The fsspec protocol (``s3``, ``gcs``, ``az``, ``abfs``)."""
        return SCHEMES[self.scheme]

    @property
    def path(self) -> str:
        """``bucket/key`` as fsspec's filesystems address objects."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    @property
    def name(self) -> str:
        return posixpath.basename(self.key) if self.key else self.bucket

    def join(self, *parts: str) -> RemoteURI:
        key = posixpath.join(self.key, *(p.strip("/") for p in parts)) if self.key else posixpath.join(
            *(p.strip("/") for p in parts))
        return RemoteURI(self.scheme, self.bucket, key.strip("/"))

    def parent(self) -> RemoteURI:
        return RemoteURI(self.scheme, self.bucket, posixpath.dirname(self.key))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"


def parse_uri(uri: str | RemoteURI) -> RemoteURI:
    """Split ``scheme://bucket/key``.

    Raises:
        StorageError: not a bucket URI, or no bucket named.
    """
    if isinstance(uri, RemoteURI):
        return uri
    if not is_remote(uri):
        raise StorageError(f"{uri!r} is not a bucket URI; use s3://BUCKET/PATH, gs://BUCKET/PATH or az://CONTAINER/PATH")
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.rstrip("/").partition("/")
    if not bucket:
        raise StorageError(f"{uri}: no bucket named; use {scheme}://BUCKET/PATH")
    return RemoteURI(scheme.lower(), bucket, posixpath.normpath(key).strip("/") if key.strip("/") else "")
