"""Data configs and streams given to the trainer, prepared for it (by :func:`pf_trl.data.prepare.prepare_dataset`):

- a **data config** (``train_dataset="mix.yaml"``, a :class:`~pf_trl.data.data_config.DataConfig`, or a list of
  sources with weights): loaded by :func:`pf_trl.data.mixture.load_mixture` (trained with pf-trl's mixture sampler);
- a **stream** (``datasets.IterableDataset``, raw or tokenized, or a data config with ``streaming: true``): tokenized
  on the fly (:mod:`pf_trl.data.streaming`), its token budget fixed now (:func:`stream_budget`); a streamed eval set
  is read into a ``Dataset`` (``eval_max_examples`` rows);
- then, for every input, :func:`finish`: **tokenized datasets** of any origin are checked against the model's
  tokenizer part by part (:func:`pf_trl.data.identity.check_dataset_identity`), and ``eval_max_examples`` keeps a
  fixed subset of each eval set.

Each step is a no-op for the data it does not concern. ``args`` is the trainer config, read by field name.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from pf_trl.data.bookkeeping import BOOKKEEPING_COLUMNS, KEEP
from pf_trl.data.streaming import StreamError

__all__ = ["eval_subset", "finish", "prepare", "rank_and_world", "stream_budget"]

logger = logging.getLogger("pf_trl.trainer")  # the trainer's logger: these lines are part of building a trainer

EVAL_SUBSET_SEED = 0


def rank_and_world(args) -> tuple[int, int]:
    """``(rank, world size)`` of the data-parallel run ``args`` describes (rank 0 in a single process)."""
    world = max(1, int(args.world_size))
    return (int(args.process_index) if world > 1 else 0), world


def prepare(dataset, *, tokenizer, args, config, what: str, model=None) -> tuple[Any, bool]:
    """``(prepared, done)``: a data config or a stream prepared; ``done=False`` leaves ``prepared`` to the default
    path (raw rows, shards, tokenized rows).

    Raises:
        DataConfigError, StreamError, IdentityError (each a ``ValueError``): a bad data config, a stream without
            ``max_steps``, a stream whose first rows do not tokenize.
    """
    from pf_trl.data.data_config import DataConfigError, coerce_data_config
    from pf_trl.data.identity import check_dataset_identity
    from pf_trl.data.mixture import load_mixture
    from pf_trl.data.streaming import is_stream, materialize, prepare_stream, stream_mixture, train_split
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    training = what == "training"
    rank, world = rank_and_world(args)
    data_config = coerce_data_config(dataset)
    if (data_config is not None or is_stream(dataset)) and model is not None:
        from pf_trl.data.tokenizer import check_vocab_fits, model_vocab_size

        check_vocab_fits(tokenizer, model_vocab_size(model))  # these rows are tokenized with it
    if data_config is not None:
        if data_config.is_mixture and training and args.padding_free_mode == "none":
            raise DataConfigError("a weighted mixture is drawn by pf-trl's mixture sampler, which padded training "
                                  "(padding_free=False) does not use (it would train the plain concatenation): "
                                  "train padding-free (padding_free_mode 'huggingface' or 'internal'), or drop "
                                  "the sampling weights")
        if data_config.streaming and training and args.padding_free_mode != "none":
            _require_max_steps(args)
            stream = stream_mixture(data_config, tokenizer, config, rank=rank, world_size=world, what=what)
            stream_budget(stream, args)  # a budget below max_length: refused now, not at the first step
            return stream, True
        if data_config.streaming:  # evaluation, or padded training: read the sources into shards
            data_config = dataclasses.replace(data_config, streaming=False)
        return load_mixture(data_config, tokenizer, config, progress=False, say=_log, what=what), True
    if is_stream(dataset):
        dataset = train_split(dataset, what)
        if hasattr(tokenizer, "backend_tokenizer"):  # shards streamed with to_iterable_dataset() are checked too
            check_dataset_identity(dataset, lambda: tokenizer_fingerprint(tokenizer), what=what)
        if args.padding_free_mode == "none" and training:
            # padded training: the same tokens (pf-trl's formats and masks), batched and padded by TRL
            tokenized = prepare_stream(dataset, tokenizer, config, what=what).dataset
            return tokenized.filter(lambda row: row["_drop"] == KEEP).remove_columns(
                [*BOOKKEEPING_COLUMNS, "length"]), True
        if not training:
            # evaluation reads the whole set every time: a stream is read once, here (eval_max_examples rows)
            rows = materialize(dataset, args.eval_max_examples, what)
            logger.info("pf-trl: %s data: a stream, read into %d rows for evaluation", what, rows.num_rows)
            return rows, False
        _require_max_steps(args)
        stream = prepare_stream(dataset, tokenizer, config, rank=rank, world_size=world, what=what)
        stream_budget(stream, args)  # a budget below max_length: refused now, not at the first step
        return stream, True
    return dataset, False


def _require_max_steps(args) -> None:
    if args.max_steps is None or args.max_steps <= 0:
        raise StreamError(
            "a streamed training set has no length, so epochs cannot be counted: set max_steps (the number of "
            "optimizer steps to train; the stream is read again from its start when it ends)")


def finish(dataset, *, tokenizer, args, what: str):
    """After preparation: the identity check of tokenized datasets, then ``eval_max_examples`` for eval sets."""
    from pf_trl.data.identity import check_dataset_identity
    from pf_trl.data.streaming import TokenizedStream
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    if dataset is None or isinstance(dataset, TokenizedStream) or not hasattr(dataset, "column_names"):
        return dataset
    if "input_ids" in (dataset.column_names or []) and hasattr(tokenizer, "backend_tokenizer"):
        check_dataset_identity(dataset, lambda: tokenizer_fingerprint(tokenizer), what=what)
    if what != "training" and args.eval_max_examples and hasattr(dataset, "select"):
        dataset = eval_subset(dataset, int(args.eval_max_examples))
    return dataset


def eval_subset(dataset, n: int):
    """``n`` examples of ``dataset`` chosen at random with a fixed seed (the same ones every time), in dataset
    order; the whole dataset when it has at most ``n``."""
    total = dataset.num_rows
    if n >= total:
        return dataset
    rng = np.random.default_rng(EVAL_SUBSET_SEED)
    return dataset.select(np.sort(rng.choice(total, size=n, replace=False)).tolist())


def stream_budget(stream, args) -> int:
    """``max_tokens_per_batch``, else ``per_device_train_batch_size x`` the mean length of the stream's first rows,
    at least ``max_seq_len`` (any later example may be that long)."""
    if args.max_tokens_per_batch:
        if args.max_tokens_per_batch < stream.max_seq_len:
            raise StreamError(
                f"max_tokens_per_batch {args.max_tokens_per_batch} is smaller than max_length {stream.max_seq_len}: a "
                "streamed example may be that long and the sampler never splits one; raise max_tokens_per_batch")
        return int(args.max_tokens_per_batch)
    mean = float(np.mean(stream.preflight_lengths)) if stream.preflight_lengths else float(stream.max_seq_len)
    return int(max(stream.max_seq_len, math.ceil(mean * args.per_device_train_batch_size)))


def _log(msg: str) -> None:
    logger.info("pf-trl: %s", msg)
