"""Read-ahead: the files of a committed prefix downloaded into their node-cache entry in the background, in the order
the reader will need them, so that reading can start before the whole prefix is local.

A :class:`ReadAhead` fills the same entry :func:`pf_trl.storage.cache.fetch` would (``$PF_TRL_CACHE/remote/<key>/``,
the same key), but file by file:

- **one download per node**: each file is downloaded under its own lock (``<entry>/.readahead/<file>.lock``) into a
  ``.part`` file, its size and ``verify`` (the shards' checksum) checked, then renamed to its final name: a file
  under its final name is always complete and verified, whoever put it there. Ranks of a node each run a read-ahead
  in their own order; a file another rank is downloading is skipped, then found in place.
- **the cache's lock and eviction**: the process holds the entry's lock *shared* from :meth:`ReadAhead.open` until
  :meth:`ReadAhead.close` (or its exit), so the entry is never evicted whole while in use, and a whole download of
  the same entry by another process waits until the read-ahead marks it ``.complete`` (see
  :mod:`pf_trl.storage.cache`).
- **the cache's hard limit** (:mod:`pf_trl.storage.space`): when what is still missing fits the limit (entries
  nobody holds evicted first), it is reserved at :meth:`ReadAhead.open` and every file is downloaded in the end, as
  a whole download would. Otherwise the read-ahead **streams**: it downloads only the files of the reader's plan
  (:meth:`follow`: for a resumed run, what is still to be read), each reserved before it is downloaded, and makes
  room by evicting the entry's files that the plan does not need before the one it fetches (those it will never
  read again first, then the least recently used), never a file a reader holds (:meth:`acquire` takes a shared
  ``flock`` on ``<entry>/.readahead/<file>.use`` until :meth:`release`; the evictor needs it exclusively). When
  nothing can be evicted it waits for the reader to move on. The entry is then never complete, a whole download of
  it is refused in one line, and the limit must hold three of its largest files.
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
import bisect
import errno
import fcntl
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from pf_trl.storage import cache, space
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
        self._reservation: space.Reservation | None = None  # what is still missing, when it fits the limit
        self.streaming = False  # True: the prefix does not fit the cache's limit (module docstring)
        self._seq: list[str] = []  # streaming: the files in the order the reader reads them, repeats included
        self._occurs: dict[str, list[int]] = {}  # name -> its positions in _seq
        self._pos = 0  # streaming: where the reader is in _seq
        self._urgent: list[str] = []  # files a reader waits for now
        self._no_room_at: float | None = None  # streaming: the plan position of a file waiting for room
        self._tickets = self._serving = 0  # streaming: files picked / reservations tried, in the order picked
        self._downloading: set[str] = set()
        self._in_use: Counter = Counter()
        self._use_locks: dict[str, list] = {}
        self._last_used: dict[str, float] = {}
        self._keep: set[str] = set(self.extra)  # small files read at open (manifest, lengths): never evicted
        # what this process did: the benchmark and the completion line read it
        self.stats = {"files_downloaded": 0, "bytes_downloaded": 0, "download_s": 0.0, "waits": 0, "waited_s": 0.0,
                      "started_at": None, "complete_at": None, "files_evicted": 0}

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
            self._finished = True  # downloaded whole before (inspect, evaluation data): nothing to mark complete
            return self.entry
        try:
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
        missing = sum(size for name, size in self.files.items() if name not in self._local)
        self._reservation = space.reserve(self.root, missing, exclude=self.key)
        if self._reservation is None:
            self._start_streaming()
        cache.register_filler(self.key, self.wait_all)
        return self.entry

    def _start_streaming(self) -> None:
        """The prefix does not fit the cache's limit: stream it (module docstring), or refuse a limit below three of
        its largest files."""
        limit = space.cache_limit(self.root)
        floor = 3 * max(self.files.values()) + sum(len(b) for b in self.extra.values())
        if limit < floor:
            self.close()
            raise StorageError(f"{self.what}: the node cache's limit ({limit / 1e6:.1f} MB, {cache.SIZE_ENV} or 80% of "
                               f"the cache volume) holds fewer than three of its largest files ({floor / 1e6:.1f} MB "
                               f"needed to stream it); raise {cache.SIZE_ENV} or give the pod a larger cache volume")
        self.streaming = True
        logger.info("pf-trl: %s (%.1f MB) does not fit the node cache (limit %.1f MB): streaming it, each file "
                    "downloaded before the reader needs it and evicted once read", self.what,
                    sum(self.files.values()) / 1e6, limit / 1e6)

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
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None
        for locks in self._use_locks.values():
            for f in locks:
                f.close()
        self._use_locks.clear()
        if self._lock_file is not None:
            self._lock_file.close()  # closing the only descriptor releases the flock
            self._lock_file = None

    # ------------------------------------------------------------------------------------------------ order

    def follow(self, order: Iterable[str]) -> None:
        """Download ``order``'s files first, in that order, then the others; starts the threads."""
        order = [n for n in order if n in self.files]
        if self.streaming:  # only the plan's files, each again where the plan reads it again
            seq = [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n]
            occurs: dict[str, list[int]] = {}
            for i, n in enumerate(seq):
                occurs.setdefault(n, []).append(i)
            with self._cond:
                self._seq, self._occurs, self._pos = seq, occurs, 0
                self._cond.notify_all()
            self.start()
            return
        first = list(dict.fromkeys(order))
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
            if self.streaming:
                if name not in self._urgent:
                    self._urgent.append(name)
            else:
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
            if name in self._urgent:
                self._urgent.remove(name)
        if counted:
            self.stats["waited_s"] += time.monotonic() - started
        return self.entry / name

    def acquire(self, name: str) -> Path:
        """:meth:`wait` for ``name``, then hold it (a shared ``flock`` on its ``.use`` file: never evicted until
        :meth:`release`); where the reader is in the plan moves to it."""
        while True:
            path = self.wait(name)
            use = open(self.parts / f"{_part_name(name)}.use", "a+")
            fcntl.flock(use, fcntl.LOCK_SH)  # an evictor holds it exclusively for a moment only
            if path.is_file():
                break
            use.close()  # evicted (by another process) between the wait and the lock: fetch it again
            with self._cond:
                self._local.discard(name)
        with self._cond:
            self._in_use[name] += 1
            self._use_locks.setdefault(name, []).append(use)
            self._advance(name)
        return path

    def release(self, name: str) -> None:
        """Let go of ``name`` (taken by :meth:`acquire`): it may be evicted from now on."""
        with self._cond:
            locks = self._use_locks.get(name)
            if locks:
                locks.pop().close()
                self._in_use[name] -= 1
            self._last_used[name] = time.monotonic()
            self._cond.notify_all()

    def touch(self, name: str) -> None:
        """The reader reads ``name`` again (held already): where it is in the plan moves to it."""
        with self._cond:
            self._advance(name)

    def _advance(self, name: str) -> None:
        occurs = self._occurs.get(name)
        if occurs:
            k = bisect.bisect_left(occurs, self._pos)
            if k < len(occurs):
                self._pos = occurs[k]
                self._cond.notify_all()

    def _next_use(self, name: str) -> float:
        occurs = self._occurs.get(name) or []
        k = bisect.bisect_left(occurs, self._pos)
        return occurs[k] if k < len(occurs) else float("inf")

    def wait_all(self, timeout: float | None = None) -> Path:
        """The entry, once every file is in it (each waited for at most ``timeout`` seconds, default
:func:`wait_limit`).

        Raises:
            StorageError: the prefix is streamed (it does not fit the node cache's limit).
        """
        if self.streaming:
            raise StorageError(f"{self.what}: {sum(self.files.values()) / 1e6:.1f} MB do not fit the node cache's "
                               f"limit ({space.cache_limit(self.root) / 1e6:.1f} MB), so it is streamed and cannot be "
                               f"read whole; raise {cache.SIZE_ENV} or give the pod a larger cache volume")
        for name in list(self._order):
            self.wait(name, timeout)
        return self.entry

    def fetch_now(self, name: str) -> Path:
        """Download ``name`` in the calling thread unless it is in the entry already (a small file needed before
        anything else: the lengths); waits for another process of the node downloading it."""
        self._keep.add(name)
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
        if self.streaming:
            return self._run_streaming()
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
                            if self._reservation is not None:  # the file counts itself now
                                self._reservation.shrink(self.files[name])
                            self._cond.notify_all()
                        progressed = True
                        break  # the order may have changed meanwhile: read it again
                if not progressed:
                    time.sleep(_POLL_S)  # every pending file is being downloaded by another thread or process
        except BaseException as exc:  # the reader gets it: the thread must not die silently
            self._fail(exc)

    def _run_streaming(self) -> None:
        """A streaming thread: the next file of the plan (a file a reader waits for first), reserved, making room by
        evicting files the plan reads later than it (or never again); waits while there is no room."""
        try:
            while True:
                with self._cond:
                    if self._stop or self._error is not None:
                        return
                    pick = self._next_target()
                    if pick is None:
                        self._cond.wait(0.1)
                        continue
                    name, at = pick
                    self._downloading.add(name)
                    ticket = self._tickets
                    self._tickets += 1
                try:
                    # room is reserved in the order the files were picked (the plan's): a later, smaller file must
                    # not take the room an earlier one waits for, to be evicted again for it
                    with self._cond:
                        while self._serving != ticket and not self._stop:
                            self._cond.wait(0.1)
                        if self._stop:
                            return
                    reservation, blocked = None, self._no_room_at is not None and at > self._no_room_at
                    try:
                        reservation = None if blocked else space.reserve(
                            self.root, self.files[name], exclude=self.key,
                            evict=lambda want, at=at: self._evict(want, at))
                    finally:
                        with self._cond:
                            self._serving += 1
                            if reservation is None and not blocked:  # nothing fetched past it until it fits
                                self._no_room_at = at
                            elif reservation is not None and self._no_room_at is not None and self._no_room_at >= at:
                                self._no_room_at = None
                            self._cond.notify_all()
                    if reservation is None:  # every file in the cache is read before this one: the reader moves on
                        with self._cond:
                            self._cond.wait(0.05)
                        continue
                    try:
                        done = self._fill(name, blocking=False)
                    finally:
                        reservation.release()
                    if done:
                        with self._cond:
                            self._local.add(name)
                            self._cond.notify_all()
                    else:
                        time.sleep(_POLL_S)  # another process of the node is downloading it
                finally:
                    with self._cond:
                        self._downloading.discard(name)
        except BaseException as exc:  # the reader gets it: the thread must not die silently
            self._fail(exc)

    def _next_target(self) -> tuple[str, float] | None:
        """(file, its position in the plan) to download next, or None; called under ``_cond``."""
        if self._no_room_at is not None and self._no_room_at < self._pos and not self._urgent:
            self._no_room_at = None  # the reader moved past the file that waited for room (or got it urgently)
        for name in self._urgent:
            if name not in self._local and name not in self._downloading:
                return name, -1
        for i in range(self._pos, len(self._seq)):
            if self._no_room_at is not None and i > self._no_room_at:
                return None
            name = self._seq[i]
            if name not in self._local and name not in self._downloading:
                return name, i
        return None

    def _evict(self, want: int, before: float) -> int:
        """Remove this entry's files that no reader holds and that the plan reads after position ``before`` (or never
        again: those first, then the least recently used), until ``want`` bytes are freed; returns the bytes freed
        (none when those files together do not free ``want``).
        Called by :func:`pf_trl.storage.space.reserve` under the node's space lock."""
        with self._cond:
            candidates = []
            for name in self._local | {n for n in self.files if n not in self._local and (self.entry / n).is_file()}:
                if name in self._keep or self._in_use[name] or name in self._downloading:
                    continue
                after = self._next_use(name)
                if after > before:
                    candidates.append((-after, self._last_used.get(name, 0.0), name))
            sizes = {}
            for _, _, name in candidates:
                try:
                    sizes[name] = (self.entry / name).stat().st_size
                except OSError:
                    sizes[name] = 0
            if sum(sizes.values()) < want:
                # not enough room even so: evicting would only undo another thread's download (which then fetches
                # it again, and so on); wait for the reader to move on instead
                return 0
            freed = 0
            for _, _, name in sorted(candidates):
                if freed >= want:
                    break
                use = self.parts / f"{_part_name(name)}.use"
                try:
                    with open(use, "a+") as f:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no reader of the node holds it
                        target = self.entry / name
                        size = target.stat().st_size if target.is_file() else 0
                        target.unlink(missing_ok=True)
                except BlockingIOError:
                    continue
                self._local.discard(name)
                freed += size
                self.stats["files_evicted"] += 1
            return freed

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
        if self._reservation is not None:
            self._reservation.release()
            self._reservation = None
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
        keep = ("key", "source", "files", "what", "root", "entry", "parts", "_pid", "streaming")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.extra, self.verify, self._order, self._local = {}, None, sorted(self.files), set()
        self._error, self._cond, self._threads, self._lock_file = None, threading.Condition(), [], None
        self._finished = False
        self._reservation, self._seq, self._occurs, self._pos, self._urgent = None, [], {}, 0, []
        self._no_room_at, self._tickets, self._serving = None, 0, 0
        self._downloading, self._in_use, self._use_locks, self._last_used = set(), Counter(), {}, {}
        self._keep = set()
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
