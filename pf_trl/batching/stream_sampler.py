"""Token-budget batches from a stream: a bounded look-ahead buffer packed to the budget (:class:`StreamPacker`).

A stream has no lengths ahead of time, so the batches cannot be planned for an epoch as
:class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` plans them. Instead the packer keeps up to ``buffer_size``
examples read ahead; for each batch it packs the buffer with best-fit-decreasing and hands out the fullest bin, then
reads examples until the buffer is full again. Memory is bounded by the buffer (plus, for resume, references to the
buffers of the last few batches); batches stay near the budget because a bin is chosen from many candidates, and
short examples left over wait in the buffer for the gaps of later bins.

When the stream ends, the packer starts its next pass (``set_epoch(pass)`` on the stream, so a shuffled stream
reshuffles) without emptying the buffer: there are no short tail batches, and a run is bounded by ``max_steps``.

Exact resume: after each batch the packer records the stream's ``state_dict()`` and the buffer (references, no
copy). :meth:`StreamPacker.resume_state` returns them for the number of batches training has consumed; with that
state a new packer yields exactly the batches the interrupted one would have yielded next.

Plain Python/numpy: examples are dicts with ``input_ids`` / ``labels`` lists (and ``length``); no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from pf_trl.batching.sampler import SamplerError, _packed_bins

__all__ = ["StreamPacker"]

STATE_VERSION = 1


class StreamPacker:
    """Batches (lists of examples) of at most ``max_tokens`` tokens from an endless pass over ``stream``.

    Args:
        stream: an iterable of tokenized examples with ``state_dict()`` / ``load_state_dict()`` / ``set_epoch()``
            (a ``datasets.IterableDataset``); rows with a non-zero ``_drop`` are skipped.
        max_tokens: the token budget of a batch; an example longer than it is an error (truncate when tokenizing).
        buffer_size: examples read ahead.
        history: batches whose state is kept for :meth:`resume_state` (training lags the packer by at most the
            batches of one optimizer step).
        state: a :meth:`resume_state` result to continue from.
    """

    def __init__(self, stream, max_tokens: int, *, buffer_size: int = 1024, history: int = 256,
                 state: dict[str, Any] | None = None) -> None:
        if max_tokens <= 0 or buffer_size <= 0:
            raise SamplerError(f"max_tokens and buffer_size must be positive, got {max_tokens}, {buffer_size}")
        self.stream = stream
        self.max_tokens = int(max_tokens)
        self.buffer_size = int(buffer_size)
        self.batches = 0  # batches handed out
        self.passes = 0  # completed passes over the stream
        self.real_tokens = 0
        self._buffer: list[dict[str, Any]] = []
        self._history: deque[tuple[int, int, Any, list]] = deque(maxlen=max(1, int(history)))
        self._restore = state
        self._iterating = False

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        if self._iterating:
            raise RuntimeError("a StreamPacker is iterated once (it carries the stream position)")
        self._iterating = True
        if self._restore is not None:
            self._load(self._restore)
            self._restore = None
        else:
            self.stream.set_epoch(self.passes)
        self._remember()
        it = iter(self.stream)
        read_this_pass = 0
        while True:
            while len(self._buffer) < self.buffer_size:
                try:
                    example = next(it)
                except StopIteration:
                    if read_this_pass == 0 and not self._buffer:
                        raise SamplerError("the stream yields no usable example (every row dropped, or no rows); check "
                                           "the data and the truncation / loss options") from None
                    if read_this_pass == 0:
                        break  # an empty pass: pack what is left rather than loop forever
                    self.passes += 1
                    read_this_pass = 0
                    self.stream.set_epoch(self.passes)
                    it = iter(self.stream)
                    continue
                read_this_pass += 1
                if example.get("_drop", 0):
                    continue
                length = int(example["length"])
                if length > self.max_tokens:
                    raise SamplerError(f"a streamed example has {length} tokens > the token budget {self.max_tokens}; "
                                       "set max_tokens_per_batch >= max_length (examples are truncated to max_length)")
                self._buffer.append({"input_ids": example["input_ids"], "labels": example["labels"],
                                     "length": length})
            if not self._buffer:
                raise SamplerError("the stream yields no usable example (every row dropped, or no rows)")
            batch = self._take_fullest()
            self.batches += 1
            self.real_tokens += sum(e["length"] for e in batch)
            self._remember()
            yield batch

    def _take_fullest(self) -> list[dict[str, Any]]:
        lens = np.fromiter((e["length"] for e in self._buffer), dtype=np.int64, count=len(self._buffer))
        order = np.argsort(-lens, kind="stable")  # ties keep the stream order
        bins, loads = _packed_bins(order, lens[order], self.max_tokens)
        chosen = sorted(bins[int(np.argmax(loads))])  # the first fullest bin; examples in stream order
        taken = set(chosen)
        batch = [self._buffer[i] for i in chosen]
        self._buffer = [e for i, e in enumerate(self._buffer) if i not in taken]
        return batch

    # ------------------------------------------------------------------ resume

    def _remember(self) -> None:
        self._history.append((self.batches, self.passes, self.stream.state_dict(), list(self._buffer)))

    def resume_state(self, batches_consumed: int) -> dict[str, Any]:
        """The state after ``batches_consumed`` batches: the stream position and the buffer at that point.

        Raises:
            SamplerError (a ValueError): when that batch is older than the kept history (training lagged more than
                ``history``).
        """
        for batches, passes, stream_state, buffer in reversed(self._history):
            if batches == batches_consumed:
                return {"version": STATE_VERSION, "batches": batches, "passes": passes, "stream": stream_state,
                        "max_tokens": self.max_tokens, "buffer_size": self.buffer_size, "buffer": buffer}
        kept = [h[0] for h in self._history]
        raise SamplerError(f"the stream state after batch {batches_consumed} is no longer kept (kept: {kept[0]}.."
                           f"{kept[-1]}); raise `history`")

    def _load(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise SamplerError(f"stream state version {state.get('version')} is not supported")
        if state["max_tokens"] != self.max_tokens or state["buffer_size"] != self.buffer_size:
            raise SamplerError(
                f"the checkpoint's stream was packed with max_tokens={state['max_tokens']}, buffer "
                f"{state['buffer_size']}; now {self.max_tokens}, {self.buffer_size}: the same batches cannot be "
                "reproduced (use the same max_tokens_per_batch and stream_buffer_size)")
        self.batches, self.passes = int(state["batches"]), int(state["passes"])
        self.stream.set_epoch(self.passes)
        if state["stream"] is not None:  # None: saved before the stream was first read
            self.stream.load_state_dict(state["stream"])
        self._buffer = list(state["buffer"])


def save_buffer(path, buffer: list[dict[str, Any]]) -> None:
    """The buffer's examples as one ``.npz`` (token ids and labels concatenated, with lengths)."""
    lengths = np.asarray([e["length"] for e in buffer], dtype=np.int64)
    ids = np.asarray([t for e in buffer for t in e["input_ids"]], dtype=np.int64)
    labels = np.asarray([t for e in buffer for t in e["labels"]], dtype=np.int64)
    with open(path, "wb") as f:
        np.savez(f, lengths=lengths, input_ids=ids, labels=labels)


def load_buffer(path) -> list[dict[str, Any]]:
    data = np.load(path)
    offsets = np.concatenate([[0], np.cumsum(data["lengths"])])
    ids, labels = data["input_ids"], data["labels"]
    return [{"input_ids": ids[a:b].tolist(), "labels": labels[a:b].tolist(), "length": int(b - a)}
            for a, b in zip(offsets[:-1], offsets[1:])]
