"""Read-ahead: the files of a committed prefix downloaded into their node-cache entry in the background, in the order
the reader will need them, so that reading can start before the whole prefix is local.

A :class:`ReadAhead` fills the same entry :func:`pf_trl.storage.cache.fetch` would (``$PF_TRL_CACHE/remote/<key>/``,
the same key), but file by file:

- **one download per node**: each file is downloaded under its own lock (``<entry>/.readahead/<file>.lock``) into a
  ``.part`` file, its size and ``verify`` (the shards' checksum) checked, then renamed to its final name: a file
  under its final name is always complete and verified, whoever put it there. Ranks of a node each run a read-ahead
  in their own order; a file another rank is downloading is skipped, then found in place.
- **the cache's lock and eviction**: the process holds the entry's lock *shared* from :meth:`ReadAhead.open` until
  :meth:`ReadAhead.close` (or its exit), so the entry is never evicted while in use, and a whole download of the same
  entry by another process waits until the read-ahead marks it ``.complete`` (see :mod:`pf_trl.storage.cache`).
  Room for the whole prefix is made, by the cache's eviction, before anything is downloaded.
- **the order**: :meth:`ReadAhead.follow` gives it (the files of the sampler's planned rows first), :meth:`wait`
  moves a file the reader needs now to the front; every file is downloaded in the end, by
  ``PF_TRL_READ_AHEAD_STREAMS`` threads (default 4), each taking the first file of the order no one is downloading.
- **fork safety**: the threads and their fsspec filesystem belong to the process that started them. A copy of the object
  in a DataLoader worker (forked or pickled) never downloads: it waits for the file to appear under its final name,
  and reads the owner's failure, if any, from ``<entry>/.readahead/error-<pid>``.

A failure (a checksum that differs, a file missing from the bucket, an unreachable endpoint after the storage layer's
retries) stops the read-ahead; every later :meth:`wait` raises it (even for a file already local: the reader stops
at once), one line naming the file.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from pf_trl.storage import cache
from pf_trl.storage.errors import StorageError
from pf_trl.storage.filesystem import download
from pf_trl.storage.uri import RemoteURI

logger = logging.getLogger("pf_trl.storage")

ENABLE_ENV = "PF_TRL_READ_AHEAD"
WAIT_ENV = "PF_TRL_READ_AHEAD_WAIT_S"
STREAMS_ENV = "PF_TRL_READ_AHEAD_STREAMS"
DEFAULT_WAIT_S = 1800.0
DEFAULT_STREAMS = 4
PARTS = ".readahead"
_POLL_S = 0.05

Verify = Callable[[Path, str], None]  # (a downloaded file, its name in the prefix): raises when it is not the file


def enabled() -> bool:
    """False when ``PF_TRL_READ_AHEAD=0`` (or ``false`` / ``no`` / ``off``): datasets are downloaded whole."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def wait_limit() -> float:
    """Seconds a reader waits for one file: ``PF_TRL_READ_AHEAD_WAIT_S`` (default 1800).

    Raises:
        StorageError: not a positive number.
    """
    text = os.environ.get(WAIT_ENV)
    if not text:
        return DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise StorageError(f"{WAIT_ENV}={text!r} is not a positive number of seconds")
    return value


def streams() -> int:
    """Files downloaded at once by one process: ``PF_TRL_READ_AHEAD_STREAMS`` (default 4; a bucket serves each
    connection at a bounded rate, and small files cost a round trip each).

    Raises:
        StorageError: not a positive integer.
    """
    text = os.environ.get(STREAMS_ENV)
    if not text:
        return DEFAULT_STREAMS
    if not text.strip().isdigit() or int(text) < 1:
        raise StorageError(f"{STREAMS_ENV}={text!r} is not a positive integer")
    return int(text)


def _part_name(name: str) -> str:
    return name.replace("/", "%2F")


class ReadAhead:
    """The background download of the files of ``source`` (``{name: bytes}``) into the node-cache entry ``key``.

    Args:
        key: the cache entry (the one :func:`pf_trl.storage.cache.fetch` would fill for this commit).
        source: the prefix the files are under.
        files: ``{relative name: bytes}`` of every file.
        what: how messages name the prefix (its URI).
        extra: small files written into the entry as given (the manifest).
        verify: called on each downloaded file before it takes its final name.
    """

    def __init__(self, key: str, source: RemoteURI, files: dict[str, int], *, what: str,
                 extra: dict[str, bytes] | None = None, verify: Verify | None = None) -> None:
        for name in files:
            if ".." in Path(name).parts or Path(name).is_absolute():
                raise StorageError(f"{what}: the file list names a path outside the prefix ({name!r})")
        self.key, self.source, self.files, self.what = key, source, dict(files), what
        self.extra, self.verify = dict(extra or {}), verify
        self.root = cache.remote_cache_dir()
        self.entry = self.root / key
        self.parts = self.entry / PARTS
        self._pid = os.getpid()
        self._order: list[str] = sorted(self.files)
        self._local: set[str] = set()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._finished = False
        self._stop = False
        self._lock_file = None  # the entry's lock, held shared while this process uses the entry
        # what this process did: the benchmark and the completion line read it
        self.stats = {"files_downloaded": 0, "bytes_downloaded": 0, "download_s": 0.0, "waits": 0, "waited_s": 0.0,
                      "started_at": None, "complete_at": None}

    # ------------------------------------------------------------------------------------------------ set-up

    def open(self) -> Path:
        """Take the entry's lock shared, make room for the prefix, create the entry and write ``extra``; returns the
        entry's folder. Nothing is downloaded yet."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / f"{self.key}.lock", "a+")
        fcntl.flock(f, fcntl.LOCK_SH)  # waits while another process downloads the entry whole (exclusively)
        self._lock_file = f
        if self.complete():
            os.utime(self.entry / cache.COMPLETE)  # recently used
            self._local = set(self.files)
            return self.entry
        try:
            cache.make_room(self.root, sum(self.files.values()), self.key, self.what)
            self.parts.mkdir(parents=True, exist_ok=True)
            for name, data in self.extra.items():
                if not (self.entry / name).is_file():
                    tmp = self.parts / f"{_part_name(name)}.{os.getpid()}.extra"
                    tmp.write_bytes(data)
                    os.replace(tmp, self.entry / name)
        except OSError as exc:
            self.close()
            raise self._disk_error(exc) from exc
        except BaseException:
            self.close()
            raise
        (self.parts / f"error-{self._pid}").unlink(missing_ok=True)  # a failure of an earlier process of this pid
        self._local = {n for n in self.files if (self.entry / n).is_file()}  # a read-ahead cut short left these
        if len(self._local) == len(self.files):
            self._finished = True
            self._finish()
            return self.entry
        cache.register_filler(self.key, self.wait_all)
        return self.entry

    def complete(self) -> bool:
        """Whether every file is in the entry (marked ``.complete``)."""
        return (self.entry / cache.COMPLETE).is_file()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the threads (each after its current file, waited for at most ``timeout`` seconds) and release the
        entry's lock; files stay in the cache (a file cut short is only a ``.part``, downloaded again later)."""
        if os.getpid() != self._pid:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout)
        self._release()

    def _release(self) -> None:
        cache.register_filler(self.key, None)
        if self._lock_file is not None:
            self._lock_file.close()  # closing the only descriptor releases the flock
            self._lock_file = None

    # ------------------------------------------------------------------------------------------------ order

    def follow(self, order: Iterable[str]) -> None:
        """Download ``order``'s files first, in that order, then the others; starts the threads."""
        first = [n for n in dict.fromkeys(order) if n in self.files]
        chosen = set(first)
        rest = [n for n in sorted(self.files) if n not in chosen]
        with self._cond:
            self._order = first + rest
        self.start()

    def start(self) -> None:
        """Start the background threads (once: :func:`streams` of them; the order so far: :meth:`follow`'s, else the
        files sorted). Each takes the first file of the order that no other is downloading."""
        if os.getpid() != self._pid:
            return
        with self._cond:
            if self._threads or self._stop:
                return
            self.stats["started_at"] = time.time()
            self._threads = [threading.Thread(target=self._run, name=f"pf-trl-read-ahead-{self.key[:8]}-{i}",
                                              daemon=True) for i in range(streams())]
            for thread in self._threads:
                thread.start()

    # ------------------------------------------------------------------------------------------------ waiting

    def is_local(self, name: str) -> bool:
        """Whether ``name`` is in the entry (complete and verified)."""
        return name in self._local or (self.entry / name).is_file()

    def check(self) -> None:
        """Raise the read-ahead's failure, if it failed (in its own process; a worker's copy finds out when it
        waits)."""
        if self._error is not None and os.getpid() == self._pid:
            raise self._error

    def path(self, name: str) -> Path:
        return self.entry / name

    def wait(self, name: str, timeout: float | None = None) -> Path:
        """The local path of ``name``, once it is in the entry: moved to the front of the order, waited for at most
        ``timeout`` seconds (default :func:`wait_limit`).

        Raises:
            StorageError / the verification's error: the read-ahead failed (this file or an earlier one), or the file
                did not arrive in time (one line naming its URI).
        """
        limit = wait_limit() if timeout is None else timeout
        if self._error is not None and os.getpid() == self._pid:
            raise self._error
        if name in self._local:
            return self.entry / name
        if os.getpid() != self._pid:
            return self._poll(name, limit)  # a worker's copy: no thread, no filesystem of its own
        started = time.monotonic()
        with self._cond:
            if self._error is not None:
                raise self._error
            if name in self._order:
                self._order.remove(name)
            self._order.insert(0, name)
            self._cond.notify_all()
        self.start()
        counted = False
        with self._cond:
            while name not in self._local:
                if self._error is not None:
                    raise self._error
                if (self.entry / name).is_file():  # put there by another process of the node
                    self._local.add(name)
                    break
                left = limit - (time.monotonic() - started)
                if left <= 0:
                    raise self._timeout(name, limit)
                if not counted:
                    self.stats["waits"] += 1
                    counted = True
                self._cond.wait(min(left, 0.1))  # also notices a file another process put in place
        if counted:
            self.stats["waited_s"] += time.monotonic() - started
        return self.entry / name

    def wait_all(self, timeout: float | None = None) -> Path:
        """The entry, once every file is in it (each waited for at most ``timeout`` seconds, default
        :func:`wait_limit`)."""
        for name in list(self._order):
            self.wait(name, timeout)
        return self.entry

    def fetch_now(self, name: str) -> Path:
        """Download ``name`` in the calling thread unless it is in the entry already (a small file needed before
        anything else: the lengths); waits for another process of the node downloading it."""
        if not self.is_local(name):
            self._fill(name, blocking=True)
        self._local.add(name)
        return self.entry / name

    def _poll(self, name: str, limit: float) -> Path:
        """A worker's wait: the file's final name appears, or the owner's error file does."""
        target, failed = self.entry / name, self.parts / f"error-{self._pid}"
        started = time.monotonic()
        while not target.is_file():
            if failed.is_file():
                raise StorageError(failed.read_text(encoding="utf-8").strip())
            if time.monotonic() - started > limit:
                raise self._timeout(name, limit)
            time.sleep(_POLL_S)
        return target

    def _timeout(self, name: str, limit: float) -> StorageError:
        return StorageError(f"{self.source.join(name)}: not in the node cache after {limit:g} s of waiting "
                            f"(read-ahead of {self.what}); raise {WAIT_ENV}, or check the bucket's bandwidth and the "
                            f"node cache {self.entry}")

    # ------------------------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop or self._error is not None:
                        return
                    pending = [n for n in self._order if n not in self._local]
                    if not pending:
                        if not self._finished:
                            self._finished = True
                            self._finish()
                        return
                progressed = False
                for name in pending:  # the first file no one downloads (this process's other threads, other ranks)
                    if self._fill(name, blocking=False):
                        with self._cond:
                            self._local.add(name)
                            self._cond.notify_all()
                        progressed = True
                        break  # the order may have changed meanwhile: read it again
                if not progressed:
                    time.sleep(_POLL_S)  # every pending file is being downloaded by another thread or process
        except BaseException as exc:  # the reader gets it: the thread must not die silently
            self._fail(exc)

    def _fill(self, name: str, *, blocking: bool) -> bool:
        """Put ``name`` in the entry (downloaded, checked, renamed). False: another process is downloading it."""
        target = self.entry / name
        if target.is_file():
            return True
        with cache.locked(self.parts / f"{_part_name(name)}.lock", blocking=blocking) as mine:
            if not mine:
                return False
            if target.is_file():  # another process finished it while we took the lock
                return True
            part = self.parts / f"{_part_name(name)}.part"
            part.unlink(missing_ok=True)  # a download cut short
            started = time.monotonic()
            try:
                download(self.source.join(name), part)
                got = part.stat().st_size
                if got != self.files[name]:
                    raise StorageError(f"{self.what}: {self.source.join(name)} has {got} bytes, its manifest says "
                                       f"{self.files[name]} (the bucket copy was changed or cut short); write the "
                                       "dataset again")
                if self.verify is not None:
                    self.verify(part, name)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, target)
            except OSError as exc:
                part.unlink(missing_ok=True)
                raise self._disk_error(exc) from exc
            except BaseException:
                part.unlink(missing_ok=True)
                raise
            with self._cond:  # several threads add to it
                self.stats["files_downloaded"] += 1
                self.stats["bytes_downloaded"] += got
                self.stats["download_s"] += time.monotonic() - started
        return True

    def _finish(self) -> None:
        """Every file is in: mark the entry complete (as a whole download would) and say what it took."""
        mark = self.parts / f"complete.{os.getpid()}"
        mark.write_text(str(self.source))
        os.replace(mark, self.entry / cache.COMPLETE)
        self.stats["complete_at"] = time.time()
        took = self.stats["complete_at"] - (self.stats["started_at"] or self.stats["complete_at"])
        mb = self.stats["bytes_downloaded"] / 1e6
        logger.info("pf-trl: read-ahead of %s complete: %d of its %d files downloaded by this process (%.1f MB, "
                    "%.1f MB/s), %.1f s after it started; the reader waited %.1f s in %d waits", self.what,
                    self.stats["files_downloaded"], len(self.files), mb, mb / max(took, 1e-6), took,
                    self.stats["waited_s"], self.stats["waits"])

    def _fail(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, StorageError) or _one_line_error(exc) else StorageError(
            f"{self.what}: read-ahead failed ({type(exc).__name__}: {exc})")
        try:
            (self.parts / f"error-{self._pid}").write_text(str(error) + "\n", encoding="utf-8")
        except OSError:
            pass
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._release()  # a whole download of the entry (another process, or a retry) may take the lock now

    def _disk_error(self, exc: OSError) -> BaseException:
        if exc.errno == errno.ENOSPC:
            return StorageError(f"{self.what}: the node cache's disk is full ({self.root}); set {cache.SIZE_ENV} below "
                                "the disk's size or give the pod a larger cache volume")
        return exc

    # ------------------------------------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict:
        """A copy for another process (a spawned DataLoader worker): what waiting needs, never the thread, its lock
        or its filesystem."""
        keep = ("key", "source", "files", "what", "root", "entry", "parts", "_pid")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.extra, self.verify, self._order, self._local = {}, None, sorted(self.files), set()
        self._error, self._cond, self._threads, self._lock_file = None, threading.Condition(), [], None
        self._finished = False
        self._stop = True  # a copy never starts a thread
        self.stats = {}


def _one_line_error(exc: BaseException) -> bool:
    """pf-trl's own refusals (a checksum that differs: a ShardsError) pass through as they are."""
    from pf_trl.errors import PfTrlError

    return isinstance(exc, PfTrlError) and "\n" not in str(exc)


_OPEN: dict[tuple[int, str], ReadAhead] = {}


def open_read_ahead(key: str, source: RemoteURI, files: dict[str, int], *, what: str,
                    extra: dict[str, bytes] | None = None, verify: Verify | None = None) -> ReadAhead:
    """This process's read-ahead of the entry ``key``, opened once (the CLI's checks and the trainer share it)."""
    found = _OPEN.get((os.getpid(), key))
    if found is not None and found._lock_file is not None and found._error is None:
        return found
    ahead = ReadAhead(key, source, files, what=what, extra=extra, verify=verify)
    ahead.open()
    _OPEN[(os.getpid(), key)] = ahead
    return ahead


def close_all(timeout: float = 60.0) -> None:
    """Close every read-ahead this process opened (their threads stopped after their current file, their locks
    released); what they downloaded stays in the cache."""
    for key in [k for k in _OPEN if k[0] == os.getpid()]:
        _OPEN.pop(key).close(timeout)


# a run that ends before its dataset is all local: its threads stop at exit instead of being cut off mid-call by the
# interpreter's shutdown (a file in flight stays a .part)
atexit.register(close_all, 2.0)
