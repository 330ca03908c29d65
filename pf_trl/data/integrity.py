"""Per-file checksums of a shards directory: computed when its manifest is written, verified when it is opened.

The manifest (``pf_manifest.json``, see :mod:`pf_trl.data.shards`) carries ``checksums``::

    {"algorithm": "xxh3_128", "files": {"data-00000-of-00002.arrow": {"bytes": 524288000, "digest": "9f2c..."}, ...}}

covering every file of the directory except the manifest itself (the Arrow shards, ``state.json``,
``dataset_info.json``). Files are hashed as streams of fixed-size blocks, never read whole into memory, so a
memory-mapped dataset of any size verifies in constant memory.

Why xxh3-128: the checksum guards against corruption (a flipped byte, a truncated copy, a file rewritten in
place), not against an attacker who can write the directory (they could rewrite the manifest too). Measured by
``benchmarks/shard_checksum.py`` (docs/data.md): from the page cache xxh3-128 costs about a tenth of sha256's
time per GB and less than crc32c's, on files already cached and cold alike, and ``xxhash`` is already a
dependency of ``datasets``. Manifests naming another algorithm of :data:`HASHERS` still verify.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

DEFAULT_ALGORITHM = "xxh3_128"
BLOCK_BYTES = 4 * 2**20


class ChecksumMismatch(PfTrlError, ValueError):
    """A file of a shards directory differs from its manifest; ``file`` names it, the message says how."""

    def __init__(self, message: str, file: str):
        super().__init__(message)
        self.file = file


def _xxh3_128():
    import xxhash

    return xxhash.xxh3_128()


def _blake3():
    import blake3

    return blake3.blake3()


def _sha256():
    import hashlib

    return hashlib.sha256()


class _Crc32c:
    """google-crc32c behind the hashlib interface (``update`` / ``hexdigest``)."""

    def __init__(self):
        import google_crc32c

        self._c = google_crc32c.Checksum()

    def update(self, data) -> None:
        self._c.update(bytes(data))  # its C extension takes only bytes: one copy per block

    def hexdigest(self) -> str:
        return self._c.digest().hex()


HASHERS: dict[str, Callable[[], Any]] = {
    "xxh3_128": _xxh3_128,
    "sha256": _sha256,
    "blake3": _blake3,
    "crc32c": _Crc32c,
}
"""Algorithm name -> a new hashlib-like object. The optional ones import their package when first used."""


def file_digest(path: str | Path, algorithm: str = DEFAULT_ALGORITHM, *, block_bytes: int = BLOCK_BYTES) -> str:
    """Hex digest of a file's bytes, read as a stream of ``block_bytes`` blocks into one reused buffer."""
    try:
        hasher = HASHERS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(HASHERS)}") from None
    buf = bytearray(block_bytes)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()


_DIGESTS: dict[tuple, str] = {}  # (file status, algorithm) -> digest, for files read again within one process
_DIGESTS_MAX = 1024


def unchanged_file_digest(path: str | Path, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """:func:`file_digest`, remembered per process for as long as the file's status (size, mtime, ctime, inode,
    device: :func:`content_stat`) is unchanged; any write or replacement changes the ctime, so a changed file is
    always hashed again. For small files read several times by one command (a tokenizer's files)."""
    path = Path(path)
    key = (_stat_key(path), algorithm)
    digest = _DIGESTS.get(key)
    if digest is None:
        digest = file_digest(path, algorithm)
        if _stat_key(path) == key[0]:  # not written while it was read
            if len(_DIGESTS) >= _DIGESTS_MAX:
                _DIGESTS.clear()
            _DIGESTS[key] = digest
    return digest


def _data_files(directory: Path, exclude: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in exclude)


def directory_checksums(directory: str | Path, *, exclude: tuple[str, ...] = (),
                        algorithm: str = DEFAULT_ALGORITHM) -> dict[str, Any]:
    """``{"algorithm", "files": {relative path: {"bytes", "digest"}}}`` for every file under ``directory``."""
    directory = Path(directory)
    files = {}
    for path in _data_files(directory, exclude):
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size,
                                                         "digest": file_digest(path, algorithm)}
    return {"algorithm": algorithm, "files": files}


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def content_stat(path: str | Path) -> list[list]:
    """The status (path, size, mtime, ctime, inode, device) of a file, or of every file under a directory, as JSON
    lists: taken before hashing, an unchanged status later means unchanged bytes (any write or replacement changes
    the ctime, which user space cannot set back), so the content need not be hashed again."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [list(_stat_key(f)) for f in files]


def verify_checksums(directory: str | Path, checksums: dict[str, Any], *,
                     memo: MutableMapping[tuple, str] | None = None) -> int:
    """Check every file listed in ``checksums`` against the directory; returns the bytes verified.

    Args:
        directory: the shards directory.
        checksums: the manifest's ``checksums`` entry.
        memo: optional ``{(path, size, mtime, ctime, inode, device): digest}`` of earlier verifications. A file
            whose status is unchanged is not read again (any write, ``touch`` or replacement changes its ctime,
            which user space cannot set back); a long-lived process (the service) passes one.

    Raises:
        ChecksumMismatch: a listed file is missing, has another size, or another digest (the first such file).
        ValueError: ``checksums`` is malformed or names an unknown algorithm.
    """
    directory = Path(directory)
    if not isinstance(checksums, dict) or not isinstance(checksums.get("files"), dict):
        raise ValueError("the manifest's checksums entry is malformed (no 'files' object)")
    algorithm = checksums.get("algorithm")
    if algorithm not in HASHERS:
        raise ValueError(f"the manifest's checksum algorithm {algorithm!r} is unknown; known: {', '.join(HASHERS)}")
    total = 0
    for name, entry in sorted(checksums["files"].items()):
        path = directory / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise ValueError(f"the manifest's checksums name a file outside the directory ({name!r})")
        if not path.is_file():
            raise ChecksumMismatch(f"shard file {name} is missing", name)
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise ChecksumMismatch(f"shard file {name} has {size} bytes, the manifest says {entry.get('bytes')} "
                                   "(truncated or rewritten)", name)
        key = _stat_key(path) + (algorithm,)
        digest = memo.get(key) if memo is not None else None
        if digest is None:
            digest = file_digest(path, algorithm)
        if digest != entry.get("digest"):
            if memo is not None:
                memo.pop(key, None)
            raise ChecksumMismatch(f"shard file {name} does not match its {algorithm} checksum (its bytes changed "
                                   "after it was written)", name)
        if memo is not None:
            if len(memo) > 100_000:
                memo.clear()
            memo[key] = digest
        total += size
    return total

