"""The node-local cache of remote files: ``$PF_TRL_CACHE/remote/<key>/``, one download per node, bounded.

Every rank of a node asks for the same entry; a file lock (``<key>.lock``, ``fcntl.flock``: released by the kernel
when its holder dies) lets the first download it into a temporary folder, check every file's size (and whatever
``verify`` checks: the shards' checksums), then rename it into place with a ``.complete`` mark; the others wait on
the lock and find it done. A download cut short leaves only a temporary folder, removed by the next holder.

A read-ahead (:mod:`pf_trl.storage.readahead`) fills the same entry file by file instead, holding the lock *shared*
for as long as its process uses the entry: :func:`fetch` then finds a complete entry without waiting for those
holders, waits for an incomplete one to be completed by them rather than downloading it a second time, and eviction
(which needs the lock exclusively) never removes an entry in use.

Bounded by ``PF_TRL_REMOTE_CACHE_SIZE``, a hard limit (:mod:`pf_trl.storage.space`: every file under the cache
counts, partial entries and ``.tmp`` folders included; default 80% of the cache volume): the least recently used
entries that no process holds are evicted to make room; when that is not enough a whole download is refused with one
line (a full disk is refused the same way), and a read-ahead streams (evicting the files it has read).
Checkpoints are staged beside it, under ``$PF_TRL_CACHE/staging/``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pf_trl.storage import space
from pf_trl.storage.errors import StorageError
from pf_trl.storage.filesystem import download
from pf_trl.storage.uri import RemoteURI

COMPLETE = space.COMPLETE
SIZE_ENV = space.SIZE_ENV
_POLL_S = 0.2
parse_size = space.parse_size
cache_limit = space.cache_limit


def pf_trl_cache() -> Path:
    """``$PF_TRL_CACHE`` (a pod's ``emptyDir``) or ``~/.cache/pf-trl``."""
    return Path(os.environ.get("PF_TRL_CACHE", Path.home() / ".cache" / "pf-trl")).expanduser()


def remote_cache_dir() -> Path:
    return pf_trl_cache() / "remote"


def staging_dir() -> Path:
    """Where checkpoints and datasets are written before they are uploaded."""
    return pf_trl_cache() / "staging"


@contextlib.contextmanager
def locked(path: Path, *, blocking: bool = True, shared: bool = False) -> Iterator[bool]:
    """An exclusive (``shared=True``: shared) ``flock`` on ``path`` for the ``with`` block; yields False when
    ``blocking=False`` and another process holds it in a conflicting mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make_room(root: Path, need: int, key: str, what: str) -> space.Reservation:
    """``need`` bytes reserved in the node cache for the entry ``key`` (:func:`pf_trl.storage.space.reserve`: entries
    nobody holds evicted, least recently used first); release it once the files are in place.

    Raises:
        StorageError: ``need`` does not fit the limit, even with every entry nobody holds evicted.
    """
    reservation = space.reserve(root, need, exclude=key)
    if reservation is None:
        limit = cache_limit(root)
        raise StorageError(f"{what}: {need / 2**30:.2f} GiB do not fit the node cache {root} (limit "
                           f"{limit / 2**30:.2f} GiB, {space.held_bytes(root) / 2**30:.2f} GiB of it in use: "
                           f"{SIZE_ENV} or 80% of the cache volume); raise {SIZE_ENV} or give the pod a larger cache "
                           "volume (emptyDir sizeLimit)")
    return reservation


# entry key -> a function completing that entry, registered by a read-ahead of this process: fetch() of the same entry
# (the same dataset as training and evaluation data) asks it rather than waiting for its lock to be released
_FILLERS: dict[str, Callable[[], None]] = {}


def register_filler(key: str, fill: Callable[[], None] | None) -> None:
    """Register (``None``: forget) the function with which this process completes the entry ``key`` it fills."""
    if fill is None:
        _FILLERS.pop(key, None)
    else:
        _FILLERS[key] = fill


def fetch(key: str, source: RemoteURI, files: dict[str, int], *, what: str,
          extra: dict[str, bytes] | None = None, verify: Callable[[Path], None] | None = None) -> Path:
    """The cache entry ``key`` holding ``files`` (``{relative name: bytes}``) downloaded from under ``source``
    (plus the ``extra`` files written as given), downloading it once per node.

    Raises:
        StorageError: a file's size differs from ``files`` (the bucket copy changed), the cache is full, or a
            download failed; ``verify``'s own errors pass through (nothing is kept then).
    """
    root = remote_cache_dir()
    entry = root / key
    while True:
        filler = _FILLERS.get(key)
        if filler is not None:
            filler()  # this process's own read-ahead of the entry: it completes the entry (or raises)
        with locked(root / f"{key}.lock", shared=True):  # waits for a downloader holding it exclusively
            if (entry / COMPLETE).is_file():
                os.utime(entry / COMPLETE)  # recently used
                return entry
        with locked(root / f"{key}.lock", blocking=False) as mine:
            if mine:
                return _download(root, key, source, files, what=what, extra=extra, verify=verify)
        # another process holds it: a downloader (then complete when we get the lock shared), or a read-ahead
        # filling the entry file by file, which marks it complete when its last file is in
        time.sleep(_POLL_S)


def _download(root: Path, key: str, source: RemoteURI, files: dict[str, int], *, what: str,
              extra: dict[str, bytes] | None, verify: Callable[[Path], None] | None) -> Path:
    """:func:`fetch`'s download, under the entry's lock held exclusively."""
    entry = root / key
    if (entry / COMPLETE).is_file():
        os.utime(entry / COMPLETE)
        return entry
    tmp = root / f".{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(entry, ignore_errors=True)  # a read-ahead's partial entry nobody holds now: downloaded whole
    reservation = make_room(root, sum(files.values()), key, what)
    try:
        tmp.mkdir(parents=True)
        for name, size in sorted(files.items()):
            if ".." in Path(name).parts or Path(name).is_absolute():
                raise StorageError(f"{what}: the file list names a path outside the prefix ({name!r})")
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            download(source.join(name), target)
            got = target.stat().st_size
            if got != size:
                raise StorageError(f"{what}: {source.join(name)} has {got} bytes, its manifest says {size} (the "
                                   "bucket copy was changed or cut short); write the dataset again")
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
        if verify is not None:
            verify(tmp)
        (tmp / COMPLETE).write_text(str(source))
        os.replace(tmp, entry)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise StorageError(f"{what}: the node cache's disk is full ({root}); set {SIZE_ENV} below the disk's "
                               "size or give the pod a larger cache volume") from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reservation.release()  # the files count from here (or are gone)
    return entry
