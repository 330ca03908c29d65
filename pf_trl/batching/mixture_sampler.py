"""Mixtures with exact ratios: which rows each epoch trains (:class:`MixtureSchedule`), packed into token-budget
batches (:class:`MixtureBatchSampler`). Plain Python/numpy, lengths only, like :mod:`pf_trl.batching.sampler`.

The rows are the concatenation of the sources (source ``s`` is rows ``bounds[s]``). An epoch is

- ``sample_by="examples"``: ``N`` examples, of which source ``s`` gives ``c_s = w_s * N`` (rounded by largest
  remainder, so the counts sum to ``N`` and every share is within ``1/N`` of its weight). ``N`` follows the stopping
  strategy of ``datasets.interleave_datasets``: ``all_exhausted`` (default) takes the smallest ``N`` at which every
  source is seen whole (``max_s n_s / w_s``: light sources are repeated), ``first_exhausted`` the largest at which
  none is repeated (``min_s n_s / w_s``);
- ``sample_by="tokens"``: the same with tokens: source ``s`` gives the examples whose tokens come closest to
  ``w_s * T`` (``T`` from the token counts and the stopping strategy), so token shares are within half an example.

Draws are fresh every epoch and deterministic: each source walks an endless sequence of permutations of its rows
(pass ``p`` of source ``s`` is a permutation seeded by ``(seed, s, p)``) and epoch ``e`` takes the next ``c_s`` rows
of that walk. So a source sampled below its size sees every row before any repeats, and one sampled above it is
repeated whole before any row is seen a third time.

The batch count of an epoch is fixed for the whole run (the HF Trainer takes the step count from the first
``len()``): the largest count any epoch of the run packs into (planned for ``num_epochs`` epochs), reached in every
epoch by the machinery of :class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` (merge or split bins).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pf_trl.batching.sampler import SamplerError, TokenBudgetBatchSampler, _bfd_bin_count

__all__ = ["MixtureBatchSampler", "MixtureSchedule"]

_STATE_VERSION = 1


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    raw = weights * total
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        order = np.argsort(-(raw - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


class MixtureSchedule:
    """The rows of each epoch of a mixture (see the module docstring).

    Args:
        lengths: tokens of every row of the concatenated sources.
        bounds: ``(start, stop)`` rows of each source, in order, covering ``lengths``.
        weights: one weight per source (normalised here; 0 leaves a source out).
        seed: the mixture seed (the draws depend on it alone, not on the trainer's seed).
        sample_by: ``examples`` or ``tokens``.
        stopping_strategy: ``all_exhausted`` or ``first_exhausted``.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, bounds: Sequence[tuple[int, int]], weights: Sequence[float],
                 *, seed: int = 42, sample_by: str = "examples", stopping_strategy: str = "all_exhausted") -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.bounds = [(int(a), int(b)) for a, b in bounds]
        if len(self.bounds) != len(weights):
            raise SamplerError(f"{len(self.bounds)} sources but {len(weights)} weights")
        if self.bounds[0][0] != 0 or self.bounds[-1][1] != len(self.lengths) or any(
                a >= b for a, b in self.bounds) or any(self.bounds[i][1] != self.bounds[i + 1][0]
                                                       for i in range(len(self.bounds) - 1)):
            raise SamplerError(f"source bounds {self.bounds} do not tile the {len(self.lengths)} rows "
                               "(an empty source?)")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise SamplerError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
        self.weights = w / w.sum()
        if sample_by not in ("examples", "tokens"):
            raise SamplerError(f"sample_by must be examples or tokens, got {sample_by!r}")
        if stopping_strategy not in ("all_exhausted", "first_exhausted"):
            raise SamplerError(f"stopping_strategy must be all_exhausted or first_exhausted, got {stopping_strategy!r}")
        self.seed, self.sample_by, self.stopping_strategy = int(seed), sample_by, stopping_strategy
        self.sizes = np.asarray([b - a for a, b in self.bounds], dtype=np.int64)
        self.source_tokens = np.asarray([int(self.lengths[a:b].sum()) for a, b in self.bounds], dtype=np.int64)
        active = self.weights > 0
        pick = np.max if stopping_strategy == "all_exhausted" else np.min
        if sample_by == "examples":
            self.epoch_examples = max(1, int(math.ceil(pick(self.sizes[active] / self.weights[active]) - 1e-9)))
            self.counts = _largest_remainder(self.weights, self.epoch_examples)
            self.epoch_tokens = None
        else:
            self.epoch_tokens = float(pick(self.source_tokens[active] / self.weights[active]))
            self.targets = self.weights * self.epoch_tokens
            self.counts = None
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._starts: list[np.ndarray] = [np.zeros(len(self.bounds), dtype=np.int64)]  # walk position per epoch

    # ------------------------------------------------------------------ the walk

    def _perm(self, s: int, p: int) -> np.ndarray:
        key = (s, p)
        perm = self._perms.get(key)
        if perm is None:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, s, p]))
            perm = rng.permutation(int(self.sizes[s]))
            self._perms[key] = perm
            if len(self._perms) > 2 * len(self.bounds) + 4:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(key)
        return perm

    def _walk(self, s: int, start: int, count: int) -> np.ndarray:
        """Rows (global) at positions ``[start, start + count)`` of source ``s``'s walk."""
        n = int(self.sizes[s])
        out, pos = [], start
        while pos < start + count:
            p, off = divmod(pos, n)
            take = min(n - off, start + count - pos)
            out.append(self._perm(s, p)[off:off + take])
            pos += take
        rows = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
        return rows + self.bounds[s][0]

    def _token_count(self, s: int, start: int) -> int:
        """Examples of source ``s`` from walk position ``start`` whose tokens come closest to its target."""
        target = float(self.targets[s])
        if target <= 0:
            return 0
        taken, total, chunk = 0, 0, max(64, int(self.sizes[s]))
        while True:
            lens = self.lengths[self._walk(s, start + taken, chunk)]
            cum = total + np.cumsum(lens)
            k = int(np.searchsorted(cum, target))  # first index with cum >= target
            if k < len(cum):
                before = total if k == 0 else int(cum[k - 1])
                after = int(cum[k])
                return taken + (k + 1 if after - target < target - before else k)
            taken, total = taken + chunk, int(cum[-1])

    def starts(self, epoch: int) -> np.ndarray:
        """Walk position of each source at the start of ``epoch``."""
        if self.counts is not None:
            return epoch * self.counts
        while len(self._starts) <= epoch:
            prev = self._starts[-1]
            counts = [self._token_count(s, int(prev[s])) for s in range(len(self.bounds))]
            self._starts.append(prev + np.asarray(counts))
        return self._starts[epoch]

    def epoch_counts(self, epoch: int) -> np.ndarray:
        """Examples each source gives in ``epoch``."""
        if self.counts is not None:
            return self.counts.copy()
        return self.starts(epoch + 1) - self.starts(epoch)

    def rows(self, epoch: int) -> np.ndarray:
        """The rows of ``epoch`` (source after source, in walk order; the batch sampler shuffles them)."""
        starts, counts = self.starts(epoch), self.epoch_counts(epoch)
        return np.concatenate([self._walk(s, int(starts[s]), int(counts[s])) for s in range(len(self.bounds))])

    def shares(self, epoch: int) -> list[dict[str, float]]:
        """Per source: examples, tokens and their shares in ``epoch``."""
        counts = self.epoch_counts(epoch)
        starts = self.starts(epoch)
        tokens = [int(self.lengths[self._walk(s, int(starts[s]), int(counts[s]))].sum()) for s in range(len(counts))]
        n, t = max(int(counts.sum()), 1), max(sum(tokens), 1)
        return [{"weight": float(self.weights[s]), "examples": int(counts[s]), "tokens": tokens[s],
                 "share_of_examples": int(counts[s]) / n, "share_of_tokens": tokens[s] / t} for s in range(len(counts))]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.lengths, dtype="<i8").tobytes())
        h.update(json.dumps({"bounds": self.bounds, "weights": [round(float(w), 12) for w in self.weights],
                             "seed": self.seed, "sample_by": self.sample_by,
                             "stopping": self.stopping_strategy}).encode())
        return h.hexdigest()


class _FixedCountSampler(TokenBudgetBatchSampler):
    """One epoch of a mixture: the base sampler over that epoch's rows, brought to the run's fixed batch count."""

    def __init__(self, lengths: np.ndarray, max_tokens: int, *, fixed_bins: int | None, **kwargs: Any) -> None:
        super().__init__(lengths, max_tokens, **kwargs)
        self._fixed_bins = fixed_bins

    def natural_bins(self, epoch: int) -> int:
        """Bins this epoch packs into before the count is fixed (at least the global best-fit-decreasing count)."""
        first = len(self._pack_windows(*self._order(self._rng(epoch)), self.window))
        return max(first, _bfd_bin_count(self.lengths, self.max_tokens))

    def _base_bin_count(self) -> int:
        return self._fixed_bins if self._fixed_bins is not None else super()._base_bin_count()


class MixtureBatchSampler:
    """Token-budget batches over the rows that :class:`MixtureSchedule` draws for each epoch, for one rank.

    The same protocol as :class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` (``__iter__`` / ``__len__`` /
    ``set_epoch`` / ``state_dict`` / ``load_state_dict`` / ``max_tokens``), so the trainer's resume works unchanged.

    Args:
        schedule: the mixture's :class:`MixtureSchedule`.
        max_tokens: the token budget of one batch.
        seed: the packing seed (the trainer's data seed); the draws use the schedule's own seed.
        num_replicas, rank: data-parallel ranks.
        num_epochs: epochs the run will train (the batch count is fixed over them); see :meth:`for_max_steps`.
        window, carry_below: packing options of :class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler`.
    """

    def __init__(self, schedule: MixtureSchedule, max_tokens: int, *, seed: int = 0, num_replicas: int = 1,
                 rank: int = 0, num_epochs: int = 1, window: int | None = None, carry_below: float = 0.99) -> None:
        self.schedule = schedule
        self.max_tokens = int(max_tokens)
        self.seed, self.num_replicas, self.rank = int(seed), int(num_replicas), int(rank)
        self.num_epochs = max(1, int(num_epochs))
        longest = int(schedule.lengths.max())
        if longest > self.max_tokens:
            raise SamplerError(f"an example has {longest} tokens > max_tokens={self.max_tokens}; raise the token "
                               "budget or pretokenize with a lower max_seq_len")
        if window is None:
            per_bin = self.max_tokens / float(schedule.lengths.mean())
            window = int(min(16384, max(512, math.ceil(128 * per_bin))))
        self.window, self.carry_below = int(window), float(carry_below)
        self.epoch = 0
        self._partial: tuple[int, int] | None = None
        self._fixed: int | None = None
        self._current: _FixedCountSampler | None = None
        self._pending: dict[str, Any] | None = None

    @classmethod
    def for_max_steps(cls, schedule: MixtureSchedule, max_tokens: int, *, max_steps: int, grad_accum: int = 1,
                      **kwargs: Any) -> MixtureBatchSampler:
        """A sampler whose fixed count covers every epoch that ``max_steps`` optimizer steps reach."""
        epochs = 1
        while True:
            sampler = cls(schedule, max_tokens, num_epochs=epochs, **kwargs)
            per_epoch = max(1, math.ceil(len(sampler) / grad_accum))
            needed = max(1, math.ceil(max_steps / per_epoch))
            if needed <= epochs:
                return sampler
            epochs = needed

    # ------------------------------------------------------------------ the fixed count

    def _epoch_sampler(self, epoch: int, fixed: int | None) -> _FixedCountSampler:
        rows = self.schedule.rows(epoch)
        return _FixedCountSampler(self.schedule.lengths[rows], self.max_tokens, fixed_bins=fixed, shuffle=True,
                                  seed=self.seed, num_replicas=self.num_replicas, rank=self.rank, window=self.window,
                                  carry_below=self.carry_below)

    def fixed_bins(self) -> int:
        """Batches of every epoch, all ranks: the most any of the run's epochs packs into, rounded up to the ranks."""
        if self._fixed is None:
            most = 0
            for e in range(self.num_epochs):
                most = max(most, self._epoch_sampler(e, None).natural_bins(e))
            r = self.num_replicas
            self._fixed = -(-most // r) * r
        return self._fixed

    def _sampler(self) -> _FixedCountSampler:
        if self._current is None or self._current.epoch != self.epoch:
            sampler = self._epoch_sampler(self.epoch, self.fixed_bins())
            sampler.set_epoch(self.epoch)
            if self._partial and self._partial[0] == self.epoch:
                sampler.set_partial_epoch(*self._partial)
            self._current = sampler
            self._rows = self.schedule.rows(self.epoch)
        return self._current

    # ------------------------------------------------------------------ sampler protocol

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._pending = None
        self._sampler()

    def set_partial_epoch(self, epoch: int, num_batches: int) -> None:
        """See :meth:`pf_trl.batching.sampler.TokenBudgetBatchSampler.set_partial_epoch`."""
        self._partial = (int(epoch), int(num_batches))
        self._current = None

    def __len__(self) -> int:
        return self.fixed_bins() // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        sampler = self._sampler()
        if self._pending is not None:
            sampler.load_state_dict(self._pending)
            self._pending = None
        rows = self._rows
        for batch in sampler:
            yield rows[batch].tolist()

    @property
    def num_remaining_batches(self) -> int:
        return self._sampler().num_remaining_batches

    @property
    def efficiency(self) -> float:
        return self._sampler().efficiency

    def stats(self) -> dict[str, Any]:
        """The current epoch's packing stats plus each source's examples, tokens and shares."""
        out = self._sampler().stats()
        out["sources"] = self.schedule.shares(self.epoch)
        return out

    # ------------------------------------------------------------------ resume

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.schedule.fingerprint().encode())
        h.update(json.dumps({"max_tokens": self.max_tokens, "num_replicas": self.num_replicas, "window": self.window,
                             "carry_below": self.carry_below, "fixed_bins": self.fixed_bins(),
                             "version": _STATE_VERSION}).encode())
        return h.hexdigest()

    def state_dict(self, *, batches_yielded: int | None = None) -> dict[str, Any]:
        inner = self._sampler().state_dict(batches_yielded=batches_yielded)
        return {"version": _STATE_VERSION, "kind": "mixture", "epoch": self.epoch, "seed": self.seed,
                "batches_yielded": inner["batches_yielded"], "fingerprint": self.fingerprint(),
                "num_examples": int(len(self.schedule.lengths)), "max_tokens": self.max_tokens,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the next iteration yields the rest of that epoch.

        Raises:
            SamplerError (a ValueError): a state of another mixture, budget, rank count, seed or batch count.
        """
        missing = [k for k in ("epoch", "seed", "batches_yielded", "fingerprint") if k not in state]
        if missing:
            raise SamplerError(f"sampler state is missing {missing}; expected a MixtureBatchSampler state_dict()")
        if state.get("kind") != "mixture":
            raise SamplerError("the checkpoint's sampler state is not a mixture's: the run was trained on other data")
        if state["fingerprint"] != self.fingerprint():
            raise SamplerError("the checkpoint's mixture differs from this one (sources, weights, seed, sample_by, "
                               "token budget, ranks or planned epochs): cannot resume it exactly")
        if int(state["seed"]) != self.seed:
            raise SamplerError(f"sampler state was saved with seed={state['seed']}, this sampler has seed={self.seed}")
        self.epoch = int(state["epoch"])
        sampler = self._sampler()
        inner = sampler.state_dict()
        self._pending = {**inner, "epoch": self.epoch, "batches_yielded": int(state["batches_yielded"])}
        if not 0 <= int(state["batches_yielded"]) <= len(self):
            raise SamplerError(f"sampler state has batches_yielded={state['batches_yielded']}, but an epoch has "
                               f"{len(self)} batches per rank")
