"""A shards dataset trained on while it downloads: rows served from each Arrow file once it is local.

:func:`open_lazy_shards` opens a committed dataset in a bucket with only its manifest and ``pf_lengths.npy`` local
(:mod:`pf_trl.data.row_layout`); the trainer builds its token-budget sampler from those lengths, then
:meth:`LazyShards.follow` hands the sampler's planned rows to the read-ahead (:mod:`pf_trl.storage.readahead`), which
downloads the Arrow files in the order of their first planned row. ``dataset[i]`` memory-maps row ``i``'s file once
it is local and waits for it otherwise (bounded: ``PF_TRL_READ_AHEAD_WAIT_S``, default 1800 s, then one line naming
the file's URI). Rows, their order and their Python values are those of ``datasets.load_from_disk`` of the whole
download, so the batches and losses are the same.

Where read-ahead cannot apply, :func:`admit` turns the dataset into the whole download (:meth:`LazyShards.materialize`:
every file waited for, then ``load_from_disk``) and logs why: evaluation data, padded training, ``shuffle_dataset``,
a sequence limit that may cut rows, shards whose vocabulary is not known to fit the model's. A DataLoader worker
(forked or spawned) holds no thread and no fsspec handle: it waits for files to appear in the node cache.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from pf_trl.data.shards import COLUMNS, ShardsError, check_tokenizer

logger = logging.getLogger("pf_trl.trainer")

__all__ = ["LazyShards", "admit", "is_lazy", "open_lazy_shards", "shard_window", "stand_in"]


class LazyShards:
    """Shards rows read from their node-cache files as those arrive (see the module docstring).

    Quacks like the ``datasets.Dataset`` of a shards directory where the trainer reads it: ``column_names``,
    ``num_rows`` / ``len()``, ``features``, ``pf_manifest``, ``select_columns``, ``dataset[i]`` and
    ``dataset.__getitems__(indices)`` (what a DataLoader calls). Anything else needs :meth:`materialize`.
    """

    def __init__(self, uri: str, ahead, manifest: dict[str, Any], files: list[str], offsets: np.ndarray,
                 lengths: np.ndarray, columns: tuple[str, ...] = COLUMNS) -> None:
        self.uri, self._ahead, self.pf_manifest = uri, ahead, manifest
        self._files, self._offsets, self.pf_lengths = files, offsets, lengths
        self._columns = tuple(columns)
        self._tables: dict[int, Any] = {}
        self._pid = os.getpid()

    # ------------------------------------------------------------------------------------ what the trainer reads

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    @property
    def num_rows(self) -> int:
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return self.num_rows

    @property
    def features(self):
        from pf_trl.data.shards import shard_features

        full = shard_features()
        return type(full)({c: full[c] for c in self._columns})

    @property
    def files(self) -> list[str]:
        """The Arrow files, in row order."""
        return list(self._files)

    def select_columns(self, columns: list[str] | str) -> LazyShards:
        """A view with ``columns`` only, sharing this dataset's read-ahead and open files."""
        columns = [columns] if isinstance(columns, str) else list(columns)
        missing = [c for c in columns if c not in self._columns]
        if missing:
            raise ValueError(f"{self.uri}: no columns {missing} (has {self.column_names})")
        view = LazyShards(self.uri, self._ahead, self.pf_manifest, self._files, self._offsets, self.pf_lengths,
                          tuple(columns))
        view._tables = self._tables  # one memory map per file, whichever view opened it
        return view

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return self.__getitems__([int(key)])[0]
        raise TypeError(f"{self.uri} is read while it downloads: index it by row (dataset[i]); call materialize() "
                        f"for {type(key).__name__} keys")

    def __getitems__(self, indices) -> list[dict[str, Any]]:
        """Rows ``indices`` (in that order) as dicts of Python values, as ``datasets.Dataset.__getitems__``."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_rows):
            raise IndexError(f"{self.uri}: row index out of range (it has {self.num_rows} rows)")
        which = np.searchsorted(self._offsets, idx, side="right") - 1
        rows: list[dict[str, Any] | None] = [None] * len(idx)
        for f in dict.fromkeys(which.tolist()):  # files in order of first need
            at = np.flatnonzero(which == f)
            table = self._table(f).select(list(self._columns))
            for pos, row in zip(at.tolist(), table.take(idx[at] - self._offsets[f]).to_pylist()):
                rows[pos] = row
            del table  # no memory map of this file outlives its hold (a streamed file may be evicted next)
        return rows

    def __iter__(self):
        for i in range(self.num_rows):
            yield self[i]

    # ------------------------------------------------------------------------------------ files

    def _table(self, f: int):
        """File ``f``'s Arrow table, memory-mapped once it is local (waited for otherwise)."""
        if os.getpid() != self._pid:  # a forked worker: its own maps (the parent's stay valid, but start clean)
            self._tables, self._pid = {}, os.getpid()
        if self._ahead.streaming:
            return self._streamed_table(f)
        table = self._tables.get(f)
        if table is not None:
            self._ahead.check()  # a failed read-ahead stops the reader at once, not at its next missing file
        else:
            name = self._files[f]
            table = self._open(f, self._ahead.wait(name))
            self._tables[f] = table
        return table

    def _streamed_table(self, f: int):
        """File ``f``'s table when the dataset is streamed through a bounded cache: one file held at a time (the
        read-ahead evicts a file only once no reader holds it)."""
        name = self._files[f]
        table = self._tables.get(f)
        if table is not None:
            self._ahead.check()
            self._ahead.touch(name)
            return table
        for held in list(self._tables):
            del self._tables[held]  # the memory map goes with the last reference, before the file may be evicted
            self._ahead.release(self._files[held])
        path = self._ahead.acquire(name)
        try:
            table = self._open(f, path)
        except BaseException:
            self._ahead.release(name)
            raise
        self._tables[f] = table
        return table

    def _open(self, f: int, path):
        from pf_trl.data.row_layout import open_arrow

        name = self._files[f]
        table = open_arrow(path)
        rows = int(self._offsets[f + 1] - self._offsets[f])
        if table.num_rows != rows or not set(COLUMNS) <= set(table.column_names):
            raise ShardsError(f"{self.uri}: shard file {name} has {table.num_rows} rows and columns "
                              f"{table.column_names}, its manifest's row layout says {rows} rows of "
                              f"{list(COLUMNS)}; write the dataset again with `pf-trl pretokenize`")
        return table

    @property
    def streamed(self) -> bool:
        """Whether the dataset does not fit the node cache: only the planned rows' files are downloaded, each evicted
        once read (:mod:`pf_trl.storage.readahead`)."""
        return bool(self._ahead.streaming)

    def is_local(self) -> bool:
        """Whether every file of the dataset is in the node cache: its Arrow files and the small files
        ``datasets.load_from_disk`` opens them with (``dataset_info.json``, ``state.json``), which arrive on their own
        (a throttled request can hold one back after every Arrow file is in)."""
        return all(self._ahead.is_local(name) for name in self._ahead.files)

    def follow(self, rows) -> None:
        """Download the files of ``rows`` (the sampler's planned rows, in order) first, then the others."""
        rows = np.asarray(rows, dtype=np.int64)
        which = np.searchsorted(self._offsets, rows, side="right") - 1
        if which.size:  # one entry per run of rows of a file: a streamed file is fetched again where it is read again
            which = which[np.concatenate([[True], which[1:] != which[:-1]])]
        read = int(np.count_nonzero(np.bincount(which, minlength=len(self._files))))
        if not self.streamed:  # each file downloaded once: its first read alone orders it (no per-row list)
            which = _first_reads(which, read)
        order = [self._files[f] for f in which.tolist()]
        logger.info("pf-trl: read-ahead of %s: %d of its %d files in the order this rank's epoch reads them",
                    self.uri, read, len(self._files))
        self._ahead.follow(order)

    def materialize(self, reason: str):
        """The whole download (every file waited for) opened as a ``datasets.Dataset``; ``reason`` is logged."""
        logger.info("pf-trl: read-ahead not used for %s (%s): waiting for the whole download", self.uri, reason)
        self._ahead.wait_all()
        return self.local_dataset()

    def local_dataset(self):
        """The ``datasets.Dataset`` of the node-cache copy once every file is local (None before: never waits)."""
        if not self.is_local():
            return None
        from pf_trl.data.shards import load_shards

        dataset = load_shards(self._ahead.entry, verify=False)  # each file was checked on arrival
        return dataset.select_columns(list(self._columns)) if len(self._columns) < len(COLUMNS) else dataset

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tables"] = {}  # memory maps do not pickle: a spawned worker maps the files again
        return state

    def __repr__(self) -> str:
        local = sum(self._ahead.is_local(n) for n in self._files)
        return (f"LazyShards({self.uri!r}, rows={self.num_rows}, columns={self.column_names}, "
                f"files local={local}/{len(self._files)})")


def _first_reads(which: np.ndarray, files: int) -> np.ndarray:
    """The distinct entries of ``which`` (``files`` of them) in the order of their first occurrence, from the
    shortest prefix that holds them all (a shuffled plan reads every file within its first rows: no sort of the
    whole plan)."""
    k = max(1024, 4 * files)
    while True:
        seen, first = np.unique(which[:k], return_index=True)
        if len(seen) == files or k >= len(which):
            return which[np.sort(first)]
        k *= 4


def shard_window(dataset) -> int | None:
    """How many of ``dataset``'s files a shard-grouped shuffle should read at a time: those that fit in half of the node
    cache's limit (the other half fetches the next window meanwhile), at least one; None when ``dataset`` is not
    streamed (it fits the cache, or it is not read while it downloads): the global shuffle then."""
    if not is_lazy(dataset) or not dataset._ahead.streaming:
        return None
    from pf_trl.storage.space import cache_limit

    biggest = max(dataset._ahead.files[name] for name in dataset._files)
    return int(min(len(dataset._files), max(1, cache_limit(dataset._ahead.root) // (2 * biggest))))


def is_lazy(dataset) -> bool:
    """Whether ``dataset`` is read while it downloads (a :class:`LazyShards`)."""
    return isinstance(dataset, LazyShards)


def open_lazy_shards(uri: str, *, expected_tokenizer: dict[str, Any] | None = None) -> LazyShards | None:
    """The committed dataset ``uri`` opened for reading while it downloads; None (logged) where the dataset cannot be
    read ahead (``PF_TRL_READ_AHEAD=0``, published without a row layout): download it whole then.

    Raises:
        ShardsError / StorageError: one line: no manifest, access or endpoint, another tokenizer than the model's,
            lengths that disagree with the manifest.
    """
    from pf_trl.data.remote import open_read_ahead
    from pf_trl.data.row_layout import LENGTHS_FILE, read_row_layout
    from pf_trl.data.shards import read_manifest

    opened = open_read_ahead(uri)
    if opened is None:
        return None
    ahead, manifest = opened
    files, offsets = read_row_layout(manifest)
    manifest = read_manifest(ahead.entry)  # the format version and required fields, as load_shards checks them
    try:
        lengths = np.load(ahead.path(LENGTHS_FILE), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ShardsError(f"{uri}: {LENGTHS_FILE} cannot be read ({exc}); write the dataset again") from exc
    if lengths.ndim != 1 or len(lengths) != offsets[-1]:
        raise ShardsError(f"{uri}: {LENGTHS_FILE} has {lengths.shape} lengths for {int(offsets[-1])} rows; write the "
                          "dataset again with `pf-trl pretokenize`")
    if expected_tokenizer is not None:
        check_tokenizer(uri, manifest, expected_tokenizer)
    dataset = LazyShards(str(uri), ahead, manifest, files, offsets, lengths.astype(np.int64))
    if dataset.is_local():
        logger.info("pf-trl: %s: every file is in the node cache already", uri)
    return dataset


def why_not(dataset: LazyShards, args, *, what: str, vocab: int | None) -> str | None:
    """Why ``dataset`` cannot be trained on while it downloads with trainer config ``args`` (None: it can)."""
    if what != "training":
        return f"{what} data is read whole"
    if getattr(args, "padding_free_mode", "none") == "none":
        return "padded training reads its rows through TRL's own data path"
    if dataset.pf_manifest.get("mixture"):
        return "a dataset mixture's rows are drawn by weight, not planned by the token-budget sampler"
    if getattr(args, "shuffle_dataset", False):
        return "shuffle_dataset=True shuffles the rows as a datasets.Dataset"
    made_with = (dataset.pf_manifest.get("tokenizer") or {}).get("vocab_size")
    if not (made_with and vocab and made_with <= vocab):
        return "the shards' vocabulary is not known to fit the model's embeddings, so every token id is checked"
    max_length = getattr(args, "max_length", None)
    if max_length is not None:
        from pf_trl.data.sequence_limit import _needs_scan

        if _needs_scan(dataset, int(max_length)):
            return f"max_length {max_length} may cut or drop rows (truncation reads every row)"
    return None


def admit(dataset, *, args, what: str, vocab: int | None):
    """``dataset`` as the trainer may use it: a :class:`LazyShards` stays lazy where read-ahead applies, else it is
    materialized (the whole download; the reason logged). Anything else is returned as it is."""
    if not isinstance(dataset, LazyShards):
        return dataset
    workers = int(getattr(args, "dataloader_num_workers", 0) or 0)
    if dataset._ahead.streaming and what == "training" and workers > 0:
        from pf_trl.storage import StorageError

        raise StorageError(f"{dataset.uri} does not fit the node cache and is streamed through it, which the "
                           f"training process reads itself: pass --dataloader_num_workers 0 (not {workers}), or raise "
                           "PF_TRL_REMOTE_CACHE_SIZE above the dataset's size")
    reason = why_not(dataset, args, what=what, vocab=vocab)
    return dataset if reason is None else dataset.materialize(reason)


def stand_in(dataset):
    """A one-row ``datasets.Dataset`` with ``dataset``'s columns, for TRL's ``SFTTrainer.__init__`` (which takes only a
    ``datasets.Dataset`` and reads its first row: it would wait for the first file). The trainer puts ``dataset``
    back once TRL is initialized; nothing of the stand-in is kept."""
    import datasets

    row = {"input_ids": [[0]], "labels": [[0]], "length": [1]}
    return datasets.Dataset.from_dict({c: row[c] for c in dataset.column_names}, features=dataset.features)

