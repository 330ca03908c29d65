"""The node cache's hard size limit: what it holds plus what downloads in flight have reserved never exceeds it.

- **What counts**: every file under ``$PF_TRL_CACHE/remote/``, whoever wrote it: complete entries, entries a
  read-ahead fills file by file (complete or not), ``.tmp`` folders of whole downloads, ``.part`` files of
  downloads in flight. A download first *reserves* its size (a zero-byte file ``.reserved/<pid>-<n>-<bytes>``, so
  the processes of a node see each other's), and the sum of the files and the live reservations stays within the
  limit: the bytes on disk are never more than that sum. A reservation is released under the node's space lock, so
  a count never misses a file renamed into place during it (covered by its reservation until the count is done).
- **Making room** (:func:`reserve`, under a node-wide lock ``.space.lock``): leftovers of dead processes are removed
  first (their reservations, ``.tmp`` folders and entries nobody holds, least recently used first), then the
  caller's own eviction runs (a streaming read-ahead evicts files it has read and will not read soon). When that is
  not enough the reservation is refused (``None``): a streaming reader waits for its reader to move on, a whole
  download refuses in one line.
- **The limit**: ``PF_TRL_REMOTE_CACHE_SIZE`` (``40GiB``, ``500MB``, bytes), else 80% of the cache volume's own size
  (``statvfs`` of the cache folder: an ``emptyDir`` or a mounted volume, not the node's whole disk), never more than
  the volume's free space plus what the cache already holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

SIZE_ENV = "PF_TRL_REMOTE_CACHE_SIZE"
SPACE_LOCK = ".space.lock"
RESERVED = ".reserved-"  # + "<pid>-<n>-<bytes>": zero-byte files beside the entries
COMPLETE = ".complete"
DEFAULT_SHARE = 0.8
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30,
          "ti": 2**40}
_COUNTER = itertools.count()
_THREAD_LOCK = threading.Lock()  # flock is per open file: threads of one process take this one too


def parse_size(text: str) -> int:
    """``"40GiB"`` -> bytes (``K``/``M``/``G``/``T`` are powers of 1000, ``Ki``/``KiB``... of 1024).

    Raises:
        StorageError: not a size.
    """
    from pf_trl.storage.errors import StorageError

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise StorageError(f"{SIZE_ENV}={text!r} is not a size; write e.g. 40GiB, 500MB, 64K or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def held_bytes(root: Path) -> int:
    """Bytes of every file under ``root`` (entries, partial entries, ``.tmp`` folders, ``.part`` files)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass  # removed meanwhile
    return total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reserved_bytes(root: Path) -> int:
    """Bytes reserved by live processes' downloads in flight (a dead process's reservations are removed)."""
    total = 0
    for path in root.glob(f"{RESERVED}*-*-*") if root.is_dir() else []:
        pid, _, size = path.name[len(RESERVED):].split("-", 2)
        if pid.isdigit() and size.isdigit() and _alive(int(pid)):
            total += int(size)
        else:
            path.unlink(missing_ok=True)
    return total


def cache_limit(root: Path) -> int:
    """The cache's hard limit in bytes (see the module docstring)."""
    text = os.environ.get(SIZE_ENV)
    if text:
        return parse_size(text)
    root.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(root)
    volume = st.f_blocks * st.f_frsize
    return int(min(DEFAULT_SHARE * volume, shutil.disk_usage(root).free + held_bytes(root)))


class Reservation:
    """Bytes set aside for a download in flight; :meth:`release` once its file is in place (the file counts then)."""

    def __init__(self, path: Path | None, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes

    def shrink(self, nbytes: int) -> None:
        """``nbytes`` of it are in place now (they count as files): reserve that much less."""
        if self.path is None:
            return
        self.nbytes = max(0, self.nbytes - int(nbytes))
        pid, n, _ = self.path.name[len(RESERVED):].split("-", 2)
        smaller = self.path.with_name(f"{RESERVED}{pid}-{n}-{self.nbytes}")
        with space_lock(self.path.parent):  # never while reserve() counts: the file and its reservation, or both
            os.replace(self.path, smaller)
        self.path = smaller

    def release(self) -> None:
        if self.path is not None:
            with space_lock(self.path.parent):  # never while reserve() counts (module docstring)
                self.path.unlink(missing_ok=True)
            self.path = None


@contextlib.contextmanager
def space_lock(root: Path) -> Iterator[None]:
    """The node-wide lock under which reservations are made and files evicted."""
    root.mkdir(parents=True, exist_ok=True)
    with _THREAD_LOCK, open(root / SPACE_LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_lock(path: Path) -> bool:
    """Whether no process holds the flock on ``path`` (taken and released at once)."""
    try:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
            return True
    except BlockingIOError:
        return False


def _unheld_entries(root: Path, exclude: str) -> list[tuple[float, Path, str]]:
    """``(last use, folder, key)`` of the entries and ``.tmp`` folders under ``root`` that no process holds, least
    recently used first: leftovers of dead processes and complete entries nobody reads now."""
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        if not path.is_dir():
            continue
        key = path.name[1:-len(".tmp")] if path.name.startswith(".") and path.name.endswith(".tmp") else path.name
        if key == exclude or path.name.startswith(".") and key == path.name:
            continue
        mark = path / COMPLETE
        used = (mark if mark.is_file() else path).stat().st_mtime
        found.append((used, path, key))
    return sorted(found)


def reserve(root: Path, nbytes: int, *, exclude: str = "",
            evict: Callable[[int], int] | None = None) -> Reservation | None:
    """``nbytes`` reserved under the limit, making room first (module docstring); None when they do not fit.

    Args:
        exclude: the caller's own entry (never removed whole here).
        evict: the caller's own eviction, given the bytes still missing; returns the bytes it freed.
    """
    limit = cache_limit(root)
    if nbytes > limit:
        return None
    with space_lock(root):
        used = held_bytes(root) + reserved_bytes(root)
        if used + nbytes > limit:
            for _, path, key in _unheld_entries(root, exclude):
                if used + nbytes <= limit:
                    break
                lock = root / f"{key}.lock"
                try:
                    with open(lock, "a+") as f:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        size = held_bytes(path)
                        shutil.rmtree(path, ignore_errors=True)
                        used -= size
                except BlockingIOError:
                    continue  # in use (a reader holds it shared, a downloader exclusively)
        if used + nbytes > limit and evict is not None:
            used -= evict(used + nbytes - limit)
        if used + nbytes > limit:
            return None
        if nbytes == 0:
            return Reservation(None, 0)
        path = root / f"{RESERVED}{os.getpid()}-{next(_COUNTER)}-{int(nbytes)}"
        path.touch()
        return Reservation(path, nbytes)


def is_free(path: Path) -> bool:
    """Whether no process holds the flock on ``path`` (a file's in-use lock)."""
    return _free_lock(path)
