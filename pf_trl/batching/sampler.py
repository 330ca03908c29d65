"""TokenBudgetBatchSampler: shuffled, bin-packed batches under a token budget, sharded across ranks.

Each batch is a list of dataset indices whose lengths sum to at most ``max_tokens``; the
:class:`~pf_trl.batching.collator.PaddingFreeCollator` turns it into one padding-free row. The sampler only
reads per-example lengths (the shards' ``length`` column), never the tokens, and is plain
Python/numpy: it imports neither torch nor transformers and works as a torch ``batch_sampler`` by duck
typing (``__iter__`` / ``__len__``).

How an epoch is planned (identically on every rank, from a numpy Generator seeded by
``(seed, epoch)``; no global RNG is touched):

1. shuffle all indices;
2. cut the shuffled order into windows of ``window`` examples and pack each window with
   best-fit-decreasing (BFD). Bins of a window left filled below ``carry_below`` are opened again and
   their examples are carried into the next window, where more small examples can fill them;
3. bring the number of bins to the run's fixed count (below), so that every epoch has the same number of
   batches per rank. Shuffling changes how well a window packs, so the raw count drifts by a bin or two
   between epochs, while the HF Trainer fixes its step count from the first ``len()`` (an epoch with more
   batches would lose its tail, one with fewer would start the next epoch early). Above the count: merge the
   two least-filled bins while they fit together, then pack the same shuffled order again with a window
   twice as large, until the count is reached (a window of the whole dataset packs into the global
   best-fit-decreasing count, which the fixed count is never below, so this ends). Below it: with
   ``drop_last=False`` split the bins holding the most tokens in two (every index still appears exactly
   once, no batch is empty); with ``drop_last=True`` the count is rounded down instead of up and the bins
   holding the fewest tokens are dropped;
4. sort the bins by tokens and group ``num_replicas`` consecutive ones into a *step* (so the ranks of
   a step carry near-equal work and DDP waits little), then shuffle the steps (so the batch order over
   the epoch is random: early steps are not all short examples);
5. inside each step give the largest bin to the rank with the fewest tokens so far. This keeps the
   gap between any two ranks' token totals, at every point of the epoch, at most the largest
   within-step spread of bin tokens, hence at most ``max_tokens``.

The fixed count is derived once, from the lengths and the options alone: the bin count of epoch 0's
packing (or the global best-fit-decreasing count, if that is larger), rounded up to a multiple of
``num_replicas`` (down with ``drop_last=True``). So ``len()`` is the same for every epoch and on every
rank, and a resumed run (whatever its epoch) computes the same count.

Shard-grouped shuffle (``shard_bounds`` and ``group_shards`` given, as for a dataset streamed through a bounded node
cache, whose reads must stay within a few files at a time): step 1 shuffles the order of the shards and cuts it into
windows of ``group_shards`` shards, then shuffles the rows within each window; step 2 packs each window on its own
(no carry across windows); step 4 groups and shuffles the steps within each window, a window's steps before the
next's. So a stretch of the epoch reads the rows of ``group_shards`` shards only, every row still once per epoch, the
ranks balanced as above (a step may take bins of two neighbouring windows). When the fixed count is not reached by
merging bins, windows are merged pairwise (a window of the whole dataset is the global packing again).

Resume: :meth:`TokenBudgetBatchSampler.state_dict` records the epoch, seed, how many batches this
rank has yielded and a fingerprint of everything the plan depends on; :meth:`load_state_dict` makes
the next iteration yield exactly the remaining batches of that epoch. ``len()`` stays the full
per-rank batch count of the epoch (what the HF Trainer expects for its schedule); see
:attr:`TokenBudgetBatchSampler.num_remaining_batches` for what is left.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from pf_trl.errors import PfTrlError

__all__ = ["SamplerError", "TokenBudgetBatchSampler"]

_STATE_VERSION = 2  # 2: a fixed batch count for every epoch (plans differ from version 1)
# BFD keys are ``remaining_capacity << _SHIFT | bin_id`` so one sorted list of ints replaces a
# balanced tree of (capacity, bin) pairs: bisect on plain ints is fast in CPython.
_SHIFT = 32
_MASK = (1 << _SHIFT) - 1
# How many bins a window should produce when ``window`` is left to the sampler: enough that BFD
# has small examples left to fill the gaps of the big ones, small enough to pack quickly.
_AUTO_WINDOW_BINS = 128
_AUTO_WINDOW_MIN = 512
_AUTO_WINDOW_MAX = 16384


class SamplerError(PfTrlError, ValueError):
    """Bad sampler options or lengths, an example over the token budget, or a saved state this sampler cannot resume
    (the samplers of ``mixture_sampler`` and ``stream_sampler`` raise it too)."""


@dataclass(frozen=True)
class _EpochPlan:
    """Everything one epoch yields, for all ranks (each rank keeps the whole plan: it is small)."""

    epoch: int
    flat: np.ndarray  # dataset indices of all kept bins, bin after bin
    offsets: np.ndarray  # bin b is flat[offsets[b]:offsets[b + 1]]
    tokens: np.ndarray  # tokens per bin
    steps: np.ndarray  # [num_steps, num_replicas] bin ids: steps[s, r] is rank r's batch s
    num_packed: int  # bins of the first packing (window ``window``), before the count was fixed
    window: int  # the window of the packing kept (larger than ``window`` when the first one had too many bins)
    num_merged: int  # pairs of least-filled bins merged to reach the fixed count
    num_split: int  # bins split to reach the fixed count
    num_dropped_bins: int  # bins dropped by drop_last
    num_dropped_examples: int
    dropped_bin_tokens: np.ndarray  # tokens of each dropped bin


def _packed_bins(idx: np.ndarray, lens: np.ndarray, capacity: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit-decreasing: the bins (lists of ``idx`` entries) and the tokens each holds.

    ``idx`` / ``lens`` must already be sorted by decreasing length. Each example goes into the open
    bin whose remaining capacity is the smallest that still fits it (the lowest bin id among equal rooms),
    else into a new bin.

    Examples of one length are placed in runs: the bin that is the best fit for an example stays the best
    fit for the next one of the same length while it still has room for it (its room only shrinks, and no
    other bin had room between), so it takes ``room // length`` of them at once, and a new bin
    ``capacity // length``. The bins are those of placing one example at a time, bin for bin and in the same
    order; the Python work is per (length, bin) touched instead of per example (a million rows: ~0.5 s).
    """
    n = len(idx)
    if n == 0:
        return [], []
    keys: list[int] = []  # sorted remaining-capacity keys of bins that can still take an example
    bins: list[list[int]] = []
    rooms: list[int] = []  # room left in each bin
    ids = idx.tolist()
    lens = np.asarray(lens)
    min_len = int(lens[-1])  # examples come in decreasing order: nothing shorter than this will come
    cuts = (np.flatnonzero(lens[1:] != lens[:-1]) + 1).tolist()
    for start, end in zip([0, *cuts], [*cuts, n]):
        length = int(lens[start])
        probe = length << _SHIFT
        i = start
        while i < end:
            pos = bisect.bisect_left(keys, probe)
            if pos == len(keys):  # no open bin fits: new bins, each filled with as many as fit
                per_bin = capacity // length
                full, rest = divmod(end - i, per_bin)
                room = capacity - per_bin * length
                for _ in range(full):
                    if room >= min_len:  # bins that cannot take the shortest example are closed
                        bisect.insort(keys, (room << _SHIFT) | len(bins))
                    bins.append(ids[i : i + per_bin])
                    i += per_bin
                rooms.extend([room] * full)
                if rest:
                    room = capacity - rest * length
                    if room >= min_len:
                        bisect.insort(keys, (room << _SHIFT) | len(bins))
                    bins.append(ids[i : i + rest])
                    rooms.append(room)
                    i += rest
                break
            key = keys.pop(pos)
            b, room = key & _MASK, key >> _SHIFT
            take = min(end - i, room // length)
            bins[b].extend(ids[i : i + take])
            i += take
            room -= take * length
            rooms[b] = room
            if room >= min_len:
                bisect.insort(keys, (room << _SHIFT) | b)
    return bins, [capacity - room for room in rooms]


def _bfd_bin_count(lengths: np.ndarray, capacity: int) -> int:
    """How many bins :func:`_packed_bins` packs ``lengths`` into (all of them, sorted by decreasing length),
    computed on counts: bins left with the same room are interchangeable for what comes after, so only how many
    bins have each remaining room matters, and the examples of one length are placed in bulk (a bin with room ``r``,
    the smallest that fits length ``l``, takes ``r // l`` of them in a row). Linear in the dataset for the counting,
    then in the number of distinct lengths and rooms: fast where the per-example loop takes seconds per million."""
    per_length = np.bincount(np.asarray(lengths, dtype=np.int64), minlength=capacity + 1)
    present = np.flatnonzero(per_length)
    shortest = int(present[0]) if present.size else 1
    rooms = [0] * (capacity + 1)  # rooms[r]: open bins with r tokens of room left
    usable: list[int] = []  # sorted rooms that some bin has and that the shortest example still fits
    bins = 0

    def add(room: int, count: int) -> None:
        if room >= shortest and count:
            if not rooms[room]:
                bisect.insort(usable, room)
            rooms[room] += count

    for length in present[::-1].tolist():
        k = int(per_length[length])
        while k:
            at = bisect.bisect_left(usable, length)
            room = usable[at] if at < len(usable) else capacity
            have = rooms[room] if at < len(usable) else k  # new bins: as many as needed
            full = room // length  # examples one such bin takes before another bin is the best fit
            whole, rest = divmod(k, full) if k < have * full else (have, 0)
            if at < len(usable):
                rooms[room] -= whole + (1 if rest else 0)
                if not rooms[room]:
                    usable.pop(at)
            else:
                bins += whole + (1 if rest else 0)
            add(room - full * length, whole)
            if rest:
                add(room - rest * length, 1)
            k -= whole * full + rest
    return bins


def _next_fit(order: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Pack examples in ``order`` without reordering: a new bin whenever the next example does not fit."""
    bins: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, length in zip(order.tolist(), lengths[order].tolist()):
        if current and used + length > capacity:
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    if current:
        bins.append(current)
    return bins


def _split_in_two(items: list[int], lengths: np.ndarray) -> tuple[list[int], list[int]]:
    """Split a bin's examples into two non-empty halves with near-equal tokens (greedy LPT)."""
    order = sorted(items, key=lambda i: -int(lengths[i]))
    a, b = [order[0]], [order[1]]
    ta, tb = int(lengths[order[0]]), int(lengths[order[1]])
    for i in order[2:]:
        if ta <= tb:
            a.append(i)
            ta += int(lengths[i])
        else:
            b.append(i)
            tb += int(lengths[i])
    return a, b


class TokenBudgetBatchSampler:
    """Yield lists of dataset indices whose lengths sum to at most ``max_tokens``, for one rank.

    Args:
        lengths: per-example token counts (e.g. the shards' ``length`` column), a sequence or a 1-D
            numpy array of positive integers. Example ``i`` of the dataset has ``lengths[i]`` tokens.
        max_tokens: token budget of one batch (one packed row). Every example must fit:
            pretokenize with ``max_seq_len <= max_tokens``.
        shuffle: shuffle the examples before packing and the batches after it. With ``False`` the
            examples are packed in dataset order and the steps are kept in packing order (still
            deterministic; useful for evaluation).
        seed: base seed; the plan of an epoch depends only on ``(seed, epoch)`` and the arguments.
        num_replicas: number of data-parallel ranks (world size).
        rank: this process's rank, in ``[0, num_replicas)``.
        drop_last: round the fixed bin count down to a multiple of ``num_replicas`` and drop the bins
            with the fewest tokens to reach it, instead of rounding up and splitting the largest ones.
        window: examples per packing window; ``None`` picks about 128 bins' worth (clamped to
            [512, 16384] examples). Bigger windows fill slightly better and pack slightly slower.
        carry_below: after a window is packed, bins filled below this fraction of ``max_tokens``
            are reopened and their examples carried into the next window (at most half a window
            is carried). ``0`` disables carrying.
        ordered: with ``shuffle=False``, keep the dataset order exactly (transformers'
            ``train_sampling_strategy="sequential"``): examples fill each batch in order until the next
            one does not fit (next-fit), and batches come in that order.
        shard_bounds: the first row of each shard (file) and the row count at the end (``[0, ..., n]``): where
            the dataset's files begin. Used with ``group_shards``.
        group_shards: shuffle shard-grouped (module docstring): the shards in a random order, rows shuffled within
            windows of this many shards. ``None`` (default): one shuffle over the whole dataset. Ignored without
            ``shuffle``.

    Raises:
        SamplerError (a ValueError): on an empty or non-integer ``lengths``, a length ``<= 0``, an example longer than
            ``max_tokens`` (the message names its index and length), ``max_tokens <= 0``, a rank
            out of range, or fewer examples than ``num_replicas``.

    With ``drop_last=False``, ``len()`` and iteration raise ``SamplerError`` in the degenerate case where
    equal batch counts per rank are impossible without duplicating an index (almost every example needs
    its own bin and there are fewer examples than the next multiple of ``num_replicas``); use
    ``drop_last=True`` or a larger ``max_tokens`` then.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        window: int | None = None,
        carry_below: float = 0.99,
        ordered: bool = False,
        shard_bounds: Sequence[int] | np.ndarray | None = None,
        group_shards: int | None = None,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)):
            raise SamplerError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if max_tokens <= 0:
            raise SamplerError(f"max_tokens must be a positive integer, got {max_tokens}")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
            raise SamplerError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
            raise SamplerError(f"rank must be an integer in [0, {num_replicas}), got {rank!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
            raise SamplerError(f"window must be a positive integer or None, got {window!r}")
        if not 0.0 <= float(carry_below) <= 1.0:
            raise SamplerError(f"carry_below must be in [0, 1], got {carry_below!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise SamplerError(f"seed must be a non-negative integer, got {seed!r}")

        self.lengths = self._validate_lengths(lengths, int(max_tokens))
        self.max_tokens = int(max_tokens)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.drop_last = bool(drop_last)
        self.carry_below = float(carry_below)
        if ordered and shuffle:
            raise SamplerError("ordered=True keeps the dataset order and needs shuffle=False")
        self.ordered = bool(ordered)
        n = len(self.lengths)
        if n < self.num_replicas:
            raise SamplerError(
                f"the dataset has {n} example(s) but num_replicas={self.num_replicas}: every rank needs at least "
                "one example; use fewer processes or more data"
            )
        if window is None:
            per_bin = self.max_tokens / float(self.lengths.mean())
            window = int(min(_AUTO_WINDOW_MAX, max(_AUTO_WINDOW_MIN, math.ceil(_AUTO_WINDOW_BINS * per_bin))))
        self.window = int(window)
        self.total_tokens = int(self.lengths.sum())
        self.shard_bounds = None if shard_bounds is None else self._validate_bounds(shard_bounds, n)
        self.group_shards: int | None = None
        if group_shards is not None:
            self.set_grouping(group_shards)

        self.epoch = 0
        self._resume_at = 0  # batches to skip at the next __iter__ (set by load_state_dict)
        self._yielded = 0  # batches yielded in the current epoch on this rank
        self._plan_cache: _EpochPlan | None = None
        self._fingerprint: str | None = None
        self._base_count: int | None = None  # bins of epoch 0's packing (or the global BFD count if larger)
        # that packing with the order and generator it was made from, until epoch 0 is planned from them
        self._epoch0_bins: tuple[list[list[int]], np.ndarray, np.ndarray, np.random.Generator] | None = None
        self._partial: tuple[int, int] | None = None  # (epoch, batches) of a fractional last epoch

    # ------------------------------------------------------------------ construction helpers

    @classmethod
    def from_dataset(cls, dataset: Any, max_tokens: int, *, length_column: str = "length",
                     **kwargs: Any) -> TokenBudgetBatchSampler:
        """Build a sampler from a ``datasets.Dataset`` (or anything indexable by column name).

        Reads only ``length_column`` (through Arrow when available: fast, and it honours a
        ``select`` / ``shuffle`` indices mapping), never the token ids.
        """
        try:
            column = dataset.select_columns([length_column]).with_format("arrow")[:][length_column]
            lengths = np.asarray(column.to_numpy(zero_copy_only=False))
        except (AttributeError, TypeError):
            lengths = np.asarray(dataset[length_column])
        return cls(lengths, max_tokens, **kwargs)

    @staticmethod
    def _validate_bounds(bounds: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
        arr = np.asarray(bounds, dtype=np.int64)
        if arr.ndim != 1 or arr.size < 2 or arr[0] != 0 or arr[-1] != n or np.any(np.diff(arr) <= 0):
            raise SamplerError(f"shard_bounds must rise from 0 to the {n} examples, one entry per shard start and the "
                               f"end; got {arr.size} entries from {arr[:1].tolist()} to {arr[-1:].tolist()}")
        arr.setflags(write=False)
        return arr

    def set_grouping(self, group_shards: int | None, shard_bounds: Sequence[int] | np.ndarray | None = None) -> None:
        """Shuffle shard-grouped in windows of ``group_shards`` shards (``None``: one global shuffle); the plan, the
        fixed count and the fingerprint follow. Needs ``shard_bounds`` (given here or at construction); ignored
        without ``shuffle``."""
        if shard_bounds is not None:
            self.shard_bounds = self._validate_bounds(shard_bounds, len(self.lengths))
            self._plan_cache, self._fingerprint, self._base_count, self._epoch0_bins = None, None, None, None
        if group_shards is not None:
            if isinstance(group_shards, bool) or not isinstance(group_shards, (int, np.integer)) or group_shards < 1:
                raise SamplerError(f"group_shards must be a positive integer or None, got {group_shards!r}")
            if self.shard_bounds is None:
                raise SamplerError("group_shards needs shard_bounds (where each shard's rows begin)")
            group_shards = int(group_shards) if self.shuffle else None
        if group_shards != self.group_shards:
            self.group_shards = group_shards
            self._plan_cache, self._fingerprint, self._base_count, self._epoch0_bins = None, None, None, None

    @property
    def grouped(self) -> bool:
        """Whether epochs are shuffled shard-grouped (module docstring)."""
        return self.group_shards is not None

    @staticmethod
    def _validate_lengths(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> np.ndarray:
        arr = np.asarray(lengths)
        if arr.dtype == object:  # e.g. a lazy column that numpy could not read as numbers
            arr = np.asarray(list(lengths))
        if arr.ndim != 1:
            raise SamplerError(f"lengths must be one-dimensional, got shape {arr.shape}")
        if arr.size == 0:
            raise SamplerError("lengths is empty: the dataset has no examples")
        if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise SamplerError(f"lengths must be integers, got dtype {arr.dtype}")
        if np.issubdtype(arr.dtype, np.floating):
            if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                bad = int(np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))[0])
                raise SamplerError(f"lengths must be integers, example {bad} has length {arr[bad]!r}")
        arr = arr.astype(np.int64)
        nonpos = np.flatnonzero(arr <= 0)
        if nonpos.size:
            i = int(nonpos[0])
            raise SamplerError(
                f"example {i} has length {int(arr[i])}: lengths must be positive "
                f"({nonpos.size} example(s) with length <= 0); drop empty examples when pretokenizing"
            )
        too_long = np.flatnonzero(arr > max_tokens)
        if too_long.size:
            i = int(too_long[0])
            raise SamplerError(
                f"example {i} has length {int(arr[i])} > max_tokens={max_tokens} "
                f"({too_long.size} example(s) too long); pretokenize with max_seq_len <= {max_tokens} "
                "(the truncation policy lives in pretokenization) or raise max_tokens"
            )
        arr.setflags(write=False)
        return arr

    # ------------------------------------------------------------------ planning

    def _rng(self, epoch: int) -> np.random.Generator:
        # SeedSequence of (seed, epoch): independent streams per epoch, same on every process.
        return np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))

    def _order(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's example order and the cuts of its windows (``[0, n]``: one window, the global shuffle)."""
        n = len(self.lengths)
        if not self.grouped:
            return (rng.permutation(n) if self.shuffle else np.arange(n)), np.asarray([0, n], dtype=np.int64)
        bounds, w = self.shard_bounds, self.group_shards
        shards = rng.permutation(len(bounds) - 1)
        sizes = np.diff(bounds)[shards]
        starts = np.repeat(bounds[shards] - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        rows = np.arange(n, dtype=np.int64) + starts  # the shards' rows, shard after shard in the shuffled order
        cuts = np.concatenate([np.cumsum(sizes)[w - 1::w], [n]]) if len(shards) > w else np.asarray([n])
        cuts = np.unique(np.concatenate([[0], cuts])).astype(np.int64)
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            rows[a:b] = rows[a:b][rng.permutation(b - a)]
        return rows, cuts

    def _pack_windows(self, order: np.ndarray, cuts: np.ndarray, window: int) -> list[list[int]]:
        """:meth:`_pack` of each shard window on its own (no carry across them)."""
        if len(cuts) == 2:
            return self._pack(order, window)
        bins: list[list[int]] = []
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            bins.extend(self._pack(order[a:b], window))
        return bins

    def _pack(self, order: np.ndarray, window: int) -> list[list[int]]:
        """Windowed best-fit-decreasing over ``order`` (see the module docstring, step 2); next-fit when ordered."""
        lengths = self.lengths
        if self.ordered:
            return _next_fit(order, lengths, self.max_tokens)
        n = len(order)
        carry_tokens = self.carry_below * self.max_tokens
        max_carry = max(1, window // 2)
        bins: list[list[int]] = []
        carried = np.empty(0, dtype=np.int64)
        budget = self.max_tokens
        room_key = (lambda lens: (budget - lens).astype(np.uint16)) if budget < 1 << 16 else None
        for start in range(0, n, window):
            idx = order[start : start + window]
            if carried.size:
                idx = np.concatenate([carried, idx])
            lens = lengths[idx]
            # Stable sort keeps the shuffled order among equal lengths (so ties are random too); on 16-bit keys
            # numpy's stable sort is a radix sort (several times faster than on int64, the same order).
            by_len = np.argsort(room_key(lens) if room_key else -lens, kind="stable")
            win_bins, win_loads = _packed_bins(idx[by_len], lens[by_len], self.max_tokens)
            last = start + window >= n
            carried = np.empty(0, dtype=np.int64)
            if not last and carry_tokens > 0:
                loads = np.asarray(win_loads, dtype=np.int64)
                under = np.flatnonzero(loads < carry_tokens)
                if under.size:
                    # Least-filled first, and never more than half a window: what is carried is packed
                    # again next window, so the carry cannot grow without bound.
                    under = under[np.argsort(loads[under], kind="stable")]
                    take: list[int] = []
                    count = 0
                    for b in under.tolist():
                        if count + len(win_bins[b]) > max_carry:
                            break
                        take.append(b)
                        count += len(win_bins[b])
                    if take:
                        taken = set(take)
                        carried = np.fromiter(chain.from_iterable(win_bins[b] for b in take), dtype=np.int64,
                                              count=count)
                        win_bins = [b for j, b in enumerate(win_bins) if j not in taken]
            bins.extend(win_bins)
        return bins

    # ------------------------------------------------------------------ the fixed batch count

    def _base_bin_count(self) -> int:
        """Bins of epoch 0's packing, or the global best-fit-decreasing count if that is larger (cached).

        The global count is what a window spanning the whole dataset packs into, whatever the shuffle (BFD
        decides on lengths only), so every epoch can be brought down to at most this count.
        """
        if self._base_count is None:
            rng = self._rng(0)
            order, cuts = self._order(rng)
            first = self._pack_windows(order, cuts, self.window)
            self._epoch0_bins = (first, order, cuts, rng)  # epoch 0's plan goes on from here: kept until it is planned
            self._base_count = max(len(first), _bfd_bin_count(self.lengths, self.max_tokens))
        return self._base_count

    def _target_bins(self) -> int:
        """The number of bins of every epoch (all ranks): the base count rounded to a multiple of ``num_replicas``."""
        r, base = self.num_replicas, self._base_bin_count()
        if self.drop_last:
            return (base // r) * r
        target = -(-base // r) * r
        if target > len(self.lengths):
            raise SamplerError(
                f"cannot give all {r} ranks the same number of batches without duplicating an example: the data packs "
                f"into {base} bin(s), {target} are needed and there are only {len(self.lengths)} examples (max_tokens="
                f"{self.max_tokens}); use drop_last=True, a larger max_tokens or fewer ranks"
            )
        return target

    def _merge_least_filled(self, bins: list[list[int]], target: int) -> tuple[list[list[int]], int]:
        """Merge the two least-filled bins while they fit together and there are more than ``target`` bins.

        If the two least-filled bins do not fit together, no two bins do.
        """
        if len(bins) <= target:
            return bins, 0
        heap = list(zip(self._bin_loads(bins).tolist(), range(len(bins))))
        heapq.heapify(heap)
        alive = list(bins)
        merged = 0
        while len(bins) - merged > target and len(heap) >= 2:
            (ta, a), (tb, b) = heapq.heappop(heap), heapq.heappop(heap)
            if ta + tb > self.max_tokens:
                break
            alive[a] = alive[a] + alive[b]
            alive[b] = []
            heapq.heappush(heap, (ta + tb, a))
            merged += 1
        return [b for b in alive if b], merged

    def _bin_loads(self, bins: list[list[int]]) -> np.ndarray:
        """Tokens of each bin (int64)."""
        sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
        if not len(bins):
            return sizes
        flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum()))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return np.add.reduceat(self.lengths[flat], starts)

    def _fit_count(self, bins: list[list[int]], target: int) -> tuple[list[list[int]], int, np.ndarray]:
        """Bring ``len(bins)`` (at least ``target`` when drop_last is off) to ``target``.

        Returns (bins, num_split, tokens of the dropped bins).
        """
        lengths = self.lengths
        none = np.zeros(0, dtype=np.int64)
        if len(bins) > target:
            if not self.drop_last:  # cannot happen: the global BFD count is <= target (see _base_bin_count)
                raise AssertionError(f"packing left {len(bins)} bins above the fixed count {target}")
            # Drop the bins with the fewest tokens: loses the least data. Ties: packing order (random).
            loads = self._bin_loads(bins)
            order = np.argsort(loads, kind="stable")
            drop = len(bins) - target
            keep = np.sort(order[drop:]).tolist()
            return [bins[j] for j in keep], 0, loads[order[:drop]]
        extra = target - len(bins)
        if extra == 0:
            return bins, 0, none
        # Split the bins holding the most tokens (among those with >= 2 examples) in two, one at a time:
        # each split adds one bin, keeps coverage exactly-once and never creates an empty batch. Possible
        # while target <= number of examples (checked by _target_bins, or implied by drop_last's rounding down).
        # Only the ``extra`` largest splittable bins can ever be popped from the start: the heap starts with them
        # alone, in heap order (tokens descending, then bin order), which a sorted list is.
        loads = self._bin_loads(bins)
        splittable = np.flatnonzero(np.fromiter(map(len, bins), dtype=np.int64, count=len(bins)) >= 2)
        first = splittable[np.lexsort((splittable, -loads[splittable]))[:extra]]
        heap = list(zip((-loads[first]).tolist(), first.tolist()))
        bins = list(bins)
        for _ in range(extra):
            _, j = heapq.heappop(heap)
            a, b = _split_in_two(bins[j], lengths)
            bins[j] = a
            bins.append(b)
            for k in (j, len(bins) - 1):
                if len(bins[k]) >= 2:
                    heapq.heappush(heap, (-int(lengths[bins[k]].sum()), k))
        return bins, extra, none

    def _build_plan(self, epoch: int) -> _EpochPlan:
        target = self._target_bins()
        n = len(self.lengths)
        window = self.window
        if epoch == 0 and self._epoch0_bins is not None:  # the packing the fixed count was taken from
            bins, order, cuts, rng = self._epoch0_bins
        else:
            rng = self._rng(epoch)
            order, cuts = self._order(rng)
            bins = self._pack_windows(order, cuts, window)
        self._epoch0_bins = None
        num_packed = len(bins)
        bins, num_merged = self._merge_least_filled(bins, target)
        while len(bins) > target and not self.drop_last and (window < n or len(cuts) > 2):
            # Too many bins for the fixed count: pack the same order with a larger window (fills better); shard
            # windows merged pairwise once the packing window spans the largest (one window: the global packing).
            if len(cuts) > 2 and window >= int(np.diff(cuts).max()):
                cuts = np.append(cuts[:-1:2], n)
            else:
                window = min(2 * window, n)
            bins, num_merged = self._merge_least_filled(self._pack_windows(order, cuts, window), target)
        bins, num_split, dropped_tokens = self._fit_count(bins, target)
        if self.ordered:
            bins.sort(key=min)  # a bin split to reach the count goes back to its place in the order
        r = self.num_replicas
        sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
        offsets = np.zeros(len(bins) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=int(offsets[-1]))
        tokens = np.add.reduceat(self.lengths[flat], offsets[:-1]) if len(bins) else np.zeros(0, dtype=np.int64)
        num_steps = len(bins) // r
        if num_steps == 0:
            steps = np.zeros((0, r), dtype=np.int64)
        else:
            # Group bins of similar tokens into a step (per-step balance), then randomise the step order.
            pre = rng.permutation(len(bins)) if self.shuffle else np.arange(len(bins))
            if len(cuts) > 2:  # shard windows: bins by (window, tokens), steps shuffled within their window
                position = np.empty(n, dtype=np.int64)
                position[order] = np.arange(n, dtype=np.int64)
                in_window = np.searchsorted(cuts, position[flat], side="right") - 1
                bin_window = np.minimum.reduceat(in_window, offsets[:-1])
                by_tokens = pre[np.lexsort((tokens[pre], bin_window[pre]))]
                groups = by_tokens.reshape(num_steps, r)
                shuffled = rng.permutation(num_steps)
                groups = groups[shuffled[np.argsort(bin_window[groups[shuffled, 0]], kind="stable")]]
            else:
                by_tokens = pre if self.ordered else pre[np.argsort(tokens[pre], kind="stable")]
                groups = by_tokens.reshape(num_steps, r)
                if self.shuffle:
                    groups = groups[rng.permutation(num_steps)]
            groups = self._front_load(groups, offsets, epoch)
            steps = self._assign_ranks(groups, tokens)
        dropped_examples = n - int(offsets[-1])
        return _EpochPlan(epoch, flat, offsets, tokens, steps, num_packed, window, num_merged, num_split,
                          len(dropped_tokens), dropped_examples, dropped_tokens)

    def _front_load(self, groups: np.ndarray, offsets: np.ndarray, epoch: int) -> np.ndarray:
        """In a fractional last epoch (:meth:`set_partial_epoch`), move forward the steps that will be trained: the
        ``k`` steps at evenly spaced ranks of examples per step, so that they hold ``k / num_steps`` of the epoch's
        examples (and, batches being near the budget, of its tokens) rather than whatever ``k`` steps come first."""
        if self._partial is None or self._partial[0] != epoch:
            return groups
        num_steps, k = len(groups), min(self._partial[1], len(groups))
        if k <= 0 or k >= num_steps:
            return groups
        per_step = np.diff(offsets)[groups].sum(axis=1)
        by_examples = np.argsort(per_step, kind="stable")  # ties keep the shuffled order
        chosen = np.zeros(num_steps, dtype=bool)
        chosen[by_examples[((np.arange(k) + 0.5) * num_steps / k).astype(np.int64)]] = True
        return np.concatenate([groups[chosen], groups[~chosen]])

    @staticmethod
    def _assign_ranks(groups: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Within each step give the largest bin to the rank with the fewest tokens so far."""
        num_steps, r = groups.shape
        if r == 1:
            return groups.copy()
        steps = np.empty_like(groups)
        totals = np.zeros(r, dtype=np.int64)
        group_tokens = tokens[groups]
        for s in range(num_steps):
            bins_desc = np.argsort(-group_tokens[s], kind="stable")
            ranks_asc = np.argsort(totals, kind="stable")
            steps[s, ranks_asc] = groups[s, bins_desc]
            totals[ranks_asc] += group_tokens[s, bins_desc]
        return steps

    def _plan(self) -> _EpochPlan:
        if self._plan_cache is None or self._plan_cache.epoch != self.epoch:
            self._plan_cache = self._build_plan(self.epoch)  # only the current epoch is kept
        return self._plan_cache

    # ------------------------------------------------------------------ sampler protocol

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to plan (call before each epoch, as with ``DistributedSampler``).

        Setting a different epoch restarts from its batch 0 (and forgets a pending resume); setting the
        epoch that was just restored by :meth:`load_state_dict` keeps the resume position.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise SamplerError(f"epoch must be a non-negative integer, got {epoch!r}")
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._resume_at = 0
            self._yielded = 0

    def set_partial_epoch(self, epoch: int, num_batches: int) -> None:
        """Declare that only the first ``num_batches`` batches (per rank) of ``epoch`` will be trained (a fractional
        ``num_train_epochs``): that epoch's steps are ordered so those batches hold the same share of its examples as
        of its batches. Every example of the epoch is still planned (and yielded if iterated to the end)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise SamplerError(f"epoch must be a non-negative integer, got {epoch!r}")
        self._partial = (int(epoch), int(num_batches))
        if self._plan_cache is not None and self._plan_cache.epoch == int(epoch):
            self._plan_cache = None

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._plan()
        start = self._resume_at
        self._resume_at = 0  # a resume applies to one pass only; the next pass starts at batch 0
        self._yielded = start
        column = plan.steps[:, self.rank]
        flat, offsets = plan.flat, plan.offsets
        for b in column[start:].tolist():
            # Count before yielding: a state_dict() taken while the consumer holds this batch counts it.
            self._yielded += 1
            yield flat[offsets[b] : offsets[b + 1]].tolist()

    def planned_rows(self, skip_batches: int | None = None) -> np.ndarray:
        """The dataset indices the next pass over the current epoch yields on this rank, in yield order, without
        iterating (the sampler's state is left as it is): what a reader can fetch ahead of the training loop.

        Args:
            skip_batches: batches of the epoch to leave out first (e.g. those a resumed run skips); default the
                pass's own start (a position restored by :meth:`load_state_dict`, else batch 0).
        """
        plan = self._plan()
        start = self._resume_at if skip_batches is None else int(skip_batches)
        column = plan.steps[max(start, 0):, self.rank]
        begins, sizes = plan.offsets[column], np.diff(plan.offsets)[column]
        # each bin's slice of ``flat``, bin after bin: positions counted from each bin's first entry
        shift = begins - np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return plan.flat[np.repeat(shift, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)]

    def __len__(self) -> int:
        """Batches this rank yields in one epoch: the same for every epoch and on every rank.

        Fixed from the lengths and options (see the module docstring), without planning the current epoch.
        Stays the full count after :meth:`load_state_dict`; see :attr:`num_remaining_batches`.
        """
        return self._target_bins() // self.num_replicas

    @property
    def num_remaining_batches(self) -> int:
        """Batches the next (or current) pass will still yield on this rank in this epoch."""
        pending = self._resume_at if self._resume_at else self._yielded
        return len(self) - pending

    # ------------------------------------------------------------------ stats

    @property
    def efficiency(self) -> float:
        """Real tokens / (number of batches x ``max_tokens``) over the current epoch, all ranks."""
        plan = self._plan()
        if plan.steps.size == 0:
            return 0.0
        return float(plan.tokens.sum()) / (plan.steps.size * self.max_tokens)

    def batch_token_counts(self, rank: int | None = None) -> np.ndarray:
        """Tokens of each batch of the current epoch, in yield order.

        ``rank=None`` (default): a ``[num_steps, num_replicas]`` array, column ``r`` being rank ``r``'s
        batches; an int: that rank's 1-D array.
        """
        plan = self._plan()
        counts = plan.tokens[plan.steps]
        if rank is None:
            return counts
        if not 0 <= rank < self.num_replicas:
            raise SamplerError(f"rank must be in [0, {self.num_replicas}), got {rank}")
        return counts[:, rank].copy()

    def batch_example_counts(self, rank: int | None = None) -> np.ndarray:
        """Examples in each batch of the current epoch; same shape rules as :meth:`batch_token_counts`."""
        plan = self._plan()
        counts = np.diff(plan.offsets)[plan.steps]
        return counts if rank is None else counts[:, rank].copy()

    def stats(self) -> dict[str, Any]:
        """Summary of the current epoch's plan (all ranks), JSON-serialisable."""
        plan = self._plan()
        tokens = plan.tokens[plan.steps]
        per_rank = tokens.sum(axis=0) if tokens.size else np.zeros(self.num_replicas, dtype=np.int64)
        examples = np.diff(plan.offsets)
        return {
            "epoch": self.epoch,
            "num_examples": len(self.lengths),
            "num_replicas": self.num_replicas,
            "max_tokens": self.max_tokens,
            "window": self.window,
            "num_batches": int(plan.steps.size),
            "batches_per_rank": int(plan.steps.shape[0]),
            "real_tokens": int(plan.tokens.sum()),
            "efficiency": self.efficiency,
            "padding_share": 1.0 - self.efficiency if plan.steps.size else 0.0,
            "mean_examples_per_batch": float(examples.mean()) if examples.size else 0.0,
            "mean_tokens_per_batch": float(plan.tokens.mean()) if plan.tokens.size else 0.0,
            "tokens_per_rank": [int(t) for t in per_rank],
            "rank_token_spread": int(per_rank.max() - per_rank.min()) if per_rank.size else 0,
            "num_packed_bins": plan.num_packed,
            "packing_window": plan.window,
            "num_merged_bins": plan.num_merged,
            "num_split_bins": plan.num_split,
            "num_dropped_bins": plan.num_dropped_bins,
            "num_dropped_examples": plan.num_dropped_examples,
        }

    # ------------------------------------------------------------------ resume

    def fingerprint(self) -> str:
        """Hash of everything the plan depends on besides (seed, epoch)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(np.ascontiguousarray(self.lengths, dtype="<i8").tobytes())
            params = {
                "max_tokens": self.max_tokens,
                "num_replicas": self.num_replicas,
                "shuffle": self.shuffle,
                "drop_last": self.drop_last,
                "window": self.window,
                "carry_below": self.carry_below,
                "version": _STATE_VERSION,
            }
            if self.ordered:
                params["ordered"] = True
            if self.grouped:
                params["group_shards"] = self.group_shards
                params["shards"] = hashlib.sha256(np.ascontiguousarray(self.shard_bounds, dtype="<i8")).hexdigest()
            h.update(json.dumps(params, sort_keys=True).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self, *, batches_yielded: int | None = None) -> dict[str, Any]:
        """State for exact mid-epoch resume (rank-independent: every rank yields as many batches).

        Args:
            batches_yielded: override the count of batches already consumed in this epoch. Pass it when
                a DataLoader with workers prefetches ahead of training, so the sampler has yielded more
                batches than the model has seen.
        """
        done = self._resume_at if self._resume_at else self._yielded
        if batches_yielded is not None:
            done = int(batches_yielded)
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "batches_yielded": done,
            "fingerprint": self.fingerprint(),
            "num_examples": len(self.lengths),
            "max_tokens": self.max_tokens,
            "num_replicas": self.num_replicas,
            "group_shards": self.group_shards,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: the next iteration yields exactly the remaining batches.

        Raises:
            SamplerError (a ValueError): if the state is malformed or was saved by an incompatible sampler (other
                lengths, ``max_tokens``, ``num_replicas``, packing options or seed).
        """
        missing = [k for k in ("epoch", "seed", "batches_yielded", "fingerprint") if k not in state]
        if missing:
            raise SamplerError(f"sampler state is missing {missing}; expected the output of state_dict()")
        if state.get("version", _STATE_VERSION) != _STATE_VERSION:
            raise SamplerError(f"sampler state version {state.get('version')} is not supported "
                               f"(expected {_STATE_VERSION})")
        saved_groups = state.get("group_shards")
        if saved_groups != self.group_shards:
            if saved_groups is not None and self.shard_bounds is None:
                raise SamplerError(f"sampler state was saved shuffling shard-grouped (windows of {saved_groups} "
                                   "shards: a dataset streamed through a bounded node cache), this sampler has no "
                                   "shard bounds: resume from the same bucket dataset")
            # the grouping follows the node cache's size, not the data: the checkpoint's plan is the one to resume
            self.set_grouping(saved_groups)
        if state["fingerprint"] != self.fingerprint():
            diffs = [
                f"{k}: saved {state[k]!r}, now {v!r}"
                for k, v in (("num_examples", len(self.lengths)), ("max_tokens", self.max_tokens),
                             ("num_replicas", self.num_replicas))
                if k in state and state[k] != v
            ]
            detail = ("; ".join(diffs) if diffs
                      else "lengths or packing options (shuffle, drop_last, window, carry_below) differ")
            raise SamplerError(f"sampler state is incompatible with this sampler ({detail}): cannot resume mid-epoch")
        if int(state["seed"]) != self.seed:
            raise SamplerError(f"sampler state was saved with seed={state['seed']}, this sampler has seed={self.seed}")
        epoch, done = int(state["epoch"]), int(state["batches_yielded"])
        if epoch < 0:
            raise SamplerError(f"sampler state has a negative epoch {epoch}")
        self.epoch = epoch
        self._yielded = 0
        total = len(self)
        if not 0 <= done <= total:
            raise SamplerError(f"sampler state has batches_yielded={done}, but epoch {epoch} has {total} batches "
                               "per rank")
        self._resume_at = done

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_examples={len(self.lengths)}, max_tokens={self.max_tokens}, "
            f"num_replicas={self.num_replicas}, rank={self.rank}, epoch={self.epoch}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last}, window={self.window}, group_shards={self.group_shards})"
        )
