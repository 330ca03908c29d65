"""The storage layer's refusals: one line naming the URI, what went wrong and where credentials came from."""

from __future__ import annotations

from pf_trl.errors import PfTrlError


class StorageError(PfTrlError, OSError):
    """A bucket location cannot be used (missing bucket, access denied, unreachable endpoint, an uncommitted or
    corrupt dataset, a full cache disk). A user error: retrying the same command does not help (exit 2)."""


class RemoteNotFound(StorageError, FileNotFoundError):
    """An object (or prefix) the caller asked for is not in the bucket; the bucket itself is there."""
