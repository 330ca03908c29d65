"""The ways data reaches :class:`~pf_trl.trainer.PaddingFreeSFTTrainer` besides one source or one shards directory:

- a **data config** (``train_dataset="mix.yaml"``, a :class:`~pf_trl.data.mixture.DataConfig`, or a list of sources
  with weights): loaded by :func:`pf_trl.data.mixture.load_mixture`, trained with
  :class:`~pf_trl.mixture_sampler.MixtureBatchSampler` (exact ratios, a fresh draw per epoch);
- a **stream** (``datasets.IterableDataset``, raw or tokenized, or a data config with ``streaming: true``): tokenized
  on the fly (:mod:`pf_trl.data.streaming`), packed by :class:`~pf_trl.stream_sampler.StreamPacker`, resumed from
  the stream's state; a streamed eval set is read into a ``Dataset`` at construction (``eval_max_examples`` rows);
- **tokenized datasets** of any origin: checked against the model's tokenizer part by part
  (:func:`pf_trl.data.identity.check_dataset_identity`);
- ``eval_max_examples``: a fixed subset of each eval set;
- fractional ``num_train_epochs``: the last epoch's trained steps hold the same share of its examples.

The trainer calls these hooks; each is a no-op for the data it does not concern.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

logger = logging.getLogger("pf_trl.trainer")

STREAM_STATE = "pf_trl_stream_state_rank{rank}.json"
STREAM_BUFFER = "pf_trl_stream_buffer_rank{rank}.npz"
EVAL_SUBSET_SEED = 0


def _rank_world(args) -> tuple[int, int]:
    world = max(1, int(args.world_size))
    return (int(args.process_index) if world > 1 else 0), world


def prepare(dataset, *, tokenizer, args, config, what: str, model=None) -> tuple[Any, bool]:
    """``(prepared, done)``: a data config or a stream prepared; ``done=False`` leaves ``prepared`` to the default
    path (raw rows, shards, tokenized rows).

    Raises:
        ValueError: a bad data config, a stream without ``max_steps``, a stream whose first rows do not tokenize.
    """
    from pf_trl.data.identity import IdentityError, check_dataset_identity
    from pf_trl.data.data_config import DataConfigError, coerce_data_config
    from pf_trl.data.mixture import load_mixture
    from pf_trl.data.tokenizer import tokenizer_fingerprint
    from pf_trl.data.streaming import (StreamError, is_stream, materialize, prepare_stream, stream_mixture,
                                       train_split)

    training = what == "training"
    rank, world = _rank_world(args)
    try:
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
            say = (lambda msg: logger.info("pf-trl: %s", msg))
            return load_mixture(data_config, tokenizer, config, progress=False, say=say, what=what), True
        if is_stream(dataset):
            dataset = train_split(dataset, what)
            if hasattr(tokenizer, "backend_tokenizer"):  # shards streamed with to_iterable_dataset() are checked too
                check_dataset_identity(dataset, tokenizer_fingerprint(tokenizer), what=what)
            if args.padding_free_mode == "none" and training:
                # padded training: the same tokens (pf-trl's formats and masks), batched and padded by TRL
                tokenized = prepare_stream(dataset, tokenizer, config, what=what).dataset
                return tokenized.filter(lambda row: row["_drop"] == 0).remove_columns(
                    ["_drop", "_truncated", "_loss", "length"]), True
            if not training:
                # evaluation reads the whole set every time: a stream is read once, here (eval_max_examples rows)
                rows = materialize(dataset, args.eval_max_examples, what)
                logger.info("pf-trl: %s data: a stream, read into %d rows for evaluation", what, rows.num_rows)
                return rows, False
            _require_max_steps(args)
            stream = prepare_stream(dataset, tokenizer, config, rank=rank, world_size=world, what=what)
            stream_budget(stream, args)  # a budget below max_length: refused now, not at the first step
            return stream, True
    except (DataConfigError, StreamError, IdentityError) as exc:
        raise ValueError(str(exc)) from exc
    return dataset, False


def _require_max_steps(args) -> None:
    if args.max_steps is None or args.max_steps <= 0:
        raise ValueError(
            "a streamed training set has no length, so epochs cannot be counted: set max_steps (the number of "
            "optimizer steps to train; the stream is read again from its start when it ends)")


def finish(dataset, *, tokenizer, args, what: str):
    """After preparation: the identity check of tokenized datasets, then ``eval_max_examples`` for eval sets."""
    from pf_trl.data.identity import IdentityError, check_dataset_identity
    from pf_trl.data.streaming import TokenizedStream
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    if dataset is None or isinstance(dataset, TokenizedStream) or not hasattr(dataset, "column_names"):
        return dataset
    if "input_ids" in (dataset.column_names or []) and hasattr(tokenizer, "backend_tokenizer"):
        try:
            check_dataset_identity(dataset, tokenizer_fingerprint(tokenizer), what=what)
        except IdentityError as exc:
            raise ValueError(str(exc)) from exc
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


# ---------------------------------------------------------------------------------------------- mixtures


def mixture_sampler(dataset, lengths: np.ndarray, budget: int, *, seed: int, args,
                    topology: tuple[int, int] | None = None):
    """A :class:`~pf_trl.mixture_sampler.MixtureBatchSampler` when ``dataset`` is a loaded mixture, else None.

    ``topology``: ``(num_replicas, rank)`` of the sampler (sequence parallelism: groups of ranks share a batch);
    default: the ranks of ``args``."""
    from pf_trl.data.mixture import mixture_of
    from pf_trl.mixture_sampler import MixtureBatchSampler, MixtureSchedule

    rule = mixture_of(dataset)
    if rule is None:
        return None
    schedule = MixtureSchedule(lengths, rule["bounds"], rule["weights"], seed=rule["seed"],
                               sample_by=rule["sample_by"], stopping_strategy=rule["stopping_strategy"])
    rank, world = _rank_world(args)
    if topology is not None:
        world, rank = topology
    common = dict(seed=seed, num_replicas=world, rank=rank)
    if args.max_steps and args.max_steps > 0:
        sampler = MixtureBatchSampler.for_max_steps(schedule, budget, max_steps=args.max_steps,
                                                    grad_accum=args.gradient_accumulation_steps, **common)
    else:
        sampler = MixtureBatchSampler(schedule, budget, num_epochs=math.ceil(args.num_train_epochs), **common)
    shares = ", ".join(f"{name} {s['share_of_examples']:.3f} of examples / {s['share_of_tokens']:.3f} of tokens "
                       f"(weight {s['weight']:.3f})" for name, s in zip(rule["names"], schedule.shares(0)))
    logger.info("pf-trl: mixture by %s, epoch 0: %s", rule["sample_by"], shares)
    return sampler


def apply_partial_epoch(args, sampler) -> None:
    """A fractional ``num_train_epochs``: Trainer trains ``ceil(epochs x steps per epoch)`` steps, so the last epoch
    is cut; tell the sampler, which orders that epoch so the trained steps hold the same share of its examples."""
    if args.max_steps and args.max_steps > 0 or not hasattr(sampler, "set_partial_epoch"):
        return
    epochs = float(args.num_train_epochs)
    whole = math.floor(epochs)
    if epochs == whole:
        return
    ga, n = args.gradient_accumulation_steps, len(sampler)
    per_epoch = max(n // ga + int(n % ga > 0), 1)
    steps_last = math.ceil(epochs * per_epoch) - whole * per_epoch
    sampler.set_partial_epoch(whole, min(steps_last * ga, n))


# ---------------------------------------------------------------------------------------------- streams


def stream_budget(stream, args) -> int:
    """``max_tokens_per_batch``, else ``per_device_train_batch_size x`` the mean length of the stream's first rows,
    at least ``max_seq_len`` (any later example may be that long)."""
    if args.max_tokens_per_batch:
        if args.max_tokens_per_batch < stream.max_seq_len:
            raise ValueError(
                f"max_tokens_per_batch {args.max_tokens_per_batch} is smaller than max_length {stream.max_seq_len}: a "
                "streamed example may be that long and the sampler never splits one; raise max_tokens_per_batch")
        return int(args.max_tokens_per_batch)
    mean = float(np.mean(stream.preflight_lengths)) if stream.preflight_lengths else float(stream.max_seq_len)
    return int(max(stream.max_seq_len, math.ceil(mean * args.per_device_train_batch_size)))


class PackedStream(IterableDataset):
    """The packer as a torch ``IterableDataset`` of example lists (one per batch)."""

    def __init__(self, packer) -> None:
        self.packer = packer

    def __iter__(self):
        for batch in self.packer:
            yield [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in batch]


def stream_dataloader(trainer, collate_fn):
    """The train dataloader of a stream: the packer (restored from the checkpoint's stream state on resume) in the
    main process. Not wrapped by accelerate: each rank already reads its own part of the stream."""
    from pf_trl.stream_sampler import StreamPacker

    args = trainer.args
    stream = trainer._pf_stream
    budget = stream_budget(stream, args)
    state = _load_stream_state(trainer._pf_resume_dir, args, budget) if trainer._pf_resume_dir else None
    packer = StreamPacker(stream.dataset, budget, buffer_size=args.stream_buffer_size, state=state)
    trainer._pf_packer = packer
    trainer.pf_token_budget = budget
    if state is not None:
        trainer._pf_saved_ignore_data_skip = args.ignore_data_skip
        args.ignore_data_skip = True  # the packer starts where the checkpoint stopped: Trainer must not skip again
    elif trainer._pf_resume_dir:
        logger.warning("pf-trl: %s has no stream state for this rank; Trainer skips the consumed batches by reading "
                       "and packing the stream again (exact, slower)", trainer._pf_resume_dir)
    if args.dataloader_num_workers:
        logger.warning("pf-trl: dataloader_num_workers=%d is not used for a stream: it is read and packed in the main "
                       "process (its position is saved for an exact resume)", args.dataloader_num_workers)
    return DataLoader(PackedStream(packer), batch_size=None, collate_fn=collate_fn, num_workers=0,
                      pin_memory=bool(args.dataloader_pin_memory and torch.cuda.is_available()))


def write_stream_state(trainer, folder: str) -> None:
    """This rank's packer position after the batches training consumed (``global_step x`` accumulation steps)."""
    from pf_trl.stream_sampler import save_buffer

    rank, world = _rank_world(trainer.args)
    consumed = trainer.state.global_step * trainer.args.gradient_accumulation_steps
    state = trainer._pf_packer.resume_state(consumed)
    os.makedirs(folder, exist_ok=True)
    save_buffer(os.path.join(folder, STREAM_BUFFER.format(rank=rank)), state.pop("buffer"))
    state.update(world_size=world, global_step=trainer.state.global_step,
                 gradient_accumulation_steps=trainer.args.gradient_accumulation_steps)
    with open(os.path.join(folder, STREAM_STATE.format(rank=rank)), "w") as f:
        json.dump(state, f, default=_json_default)


def _json_default(value):
    if isinstance(value, np.integer):
        return int(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _load_stream_state(folder: str, args, budget: int) -> dict[str, Any] | None:
    from pf_trl.stream_sampler import load_buffer

    rank, world = _rank_world(args)
    path = os.path.join(folder, STREAM_STATE.format(rank=rank))
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        state = json.load(f)
    if state.get("world_size") != world:
        raise ValueError(f"cannot resume from {folder}: its stream was split over {state.get('world_size')} ranks, "
                         f"now {world}; each rank's stream position belongs to its split")
    if state.get("gradient_accumulation_steps") != args.gradient_accumulation_steps:
        raise ValueError(f"cannot resume from {folder}: it was trained with gradient_accumulation_steps="
                         f"{state.get('gradient_accumulation_steps')}, now {args.gradient_accumulation_steps}")
    state["buffer"] = load_buffer(os.path.join(folder, STREAM_BUFFER.format(rank=rank)))
    if state.get("max_tokens") != budget:
        raise ValueError(f"cannot resume from {folder}: its stream was packed to {state.get('max_tokens')} tokens, "
                         f"now {budget}; pass the same max_tokens_per_batch")
    return state
