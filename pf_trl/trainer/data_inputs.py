"""The training loop's side of the data: samplers, collator and dataloaders of prepared datasets
(:func:`pf_trl.data.prepare.prepare_dataset` prepares them):

- a dataset is batched by :class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` (:func:`token_budget_sampler`) and
  collated by the padding-free collator, wrapped to count the real tokens (:class:`CountingCollator`), in a
  dataloader accelerate does not shard again (:func:`packed_dataloader`);
- a loaded **mixture** is trained with :class:`~pf_trl.batching.mixture_sampler.MixtureBatchSampler` (exact ratios, a fresh
  draw per epoch): :func:`mixture_sampler`;
- a **stream** is packed by :class:`~pf_trl.batching.stream_sampler.StreamPacker` (:func:`stream_dataloader`) and resumed from
  the stream's state, which each checkpoint records per rank (:func:`pf_trl.trainer.resume.write_stream_state`);
- fractional ``num_train_epochs``: the last epoch's trained steps hold the same share of its examples
  (:func:`apply_partial_epoch`).

The trainer calls these hooks; each is a no-op for the data it does not concern.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback

from pf_trl.data.inputs import rank_and_world, stream_budget
from pf_trl.data.prepare import dataset_lengths, derive_token_budget
from pf_trl.data.vision import VISION_COLUMNS, VisionFeatures
from pf_trl.errors import TrainingDataError
from pf_trl.batching.sampler import TokenBudgetBatchSampler
from pf_trl.trainer import sequence_parallel
from pf_trl.trainer.adapters import transformers_model
from pf_trl.trainer.metrics import REAL_TOKENS_KEY
from pf_trl.trainer.resume import load_stream_state

logger = logging.getLogger("pf_trl.trainer")



MODEL_COLUMNS = ("input_ids", "labels", *VISION_COLUMNS)


# ---------------------------------------------------------------------------------------------- datasets


class CountingCollator:
    """Wraps the padding-free collator: records the real token count (without a pad_to_multiple_of segment).
    ``prepare`` turns each row into model features first (a vision-language row's images -> pixel values)."""

    def __init__(self, inner, prepare=None) -> None:
        self.inner = inner
        self.prepare = prepare

    def __call__(self, features):
        if self.prepare is not None:
            features = [self.prepare(f) for f in features]
        batch = self.inner(features)
        batch[REAL_TOKENS_KEY] = sum(len(f["input_ids"]) for f in features)
        return batch


def token_budget_sampler(trainer, dataset, budget: int | None, batch_size: int, *, shuffle: bool,
                         ordered: bool = False):
    """The batch sampler of ``dataset``: a mixture's sampler when it is a shuffled mixture, else a
    :class:`~pf_trl.batching.sampler.TokenBudgetBatchSampler` (``budget`` None: :func:`derive_token_budget` of ``batch_size``),
    rank-aware (a sequence-parallel group shares its batches)."""
    args = trainer.args
    lengths = dataset_lengths(dataset)
    if budget is None:
        budget = derive_token_budget(lengths, batch_size)
    seed = args.data_seed if args.data_seed is not None else args.seed
    world = max(1, args.world_size)
    rank = args.process_index if world > 1 else 0
    world, rank = sequence_parallel.sampler_topology(trainer._pf_sp, world, rank)
    from pf_trl.attention.row_limits import check_packed_rows

    check_packed_rows(transformers_model(trainer.model), int(budget))  # before the first step (Llama 4)
    if shuffle:  # a mixture draws each epoch's rows by its weights
        mixed = mixture_sampler(dataset, lengths, int(budget), seed=int(seed), args=args, topology=(world, rank))
        if mixed is not None:
            return mixed
    grouping = shard_grouping(trainer, dataset) if shuffle else None
    return TokenBudgetBatchSampler(lengths, int(budget), shuffle=shuffle, seed=int(seed), num_replicas=world,
                                   rank=rank, drop_last=False, ordered=ordered, **(grouping or {}))


def shard_grouping(trainer, dataset) -> dict[str, Any] | None:
    """The sampler's shard-grouped shuffle (``shard_bounds``, ``group_shards``) when ``dataset`` is streamed through
    a node cache it does not fit (:func:`pf_trl.data.lazy_shards.shard_window`), else None (the global shuffle).

    Every rank must plan the same epoch, and nodes may have caches of other sizes: the ranks agree on the smallest
    window any of them needs (one streaming node is enough to group them all)."""
    from pf_trl.data.lazy_shards import is_lazy, shard_window

    window = shard_window(dataset) or 0
    if max(1, trainer.args.world_size) > 1:
        seen = trainer.accelerator.gather(torch.tensor([window], device=trainer.accelerator.device))
        windows = [int(w) for w in seen.tolist() if w > 0]
        window = min(windows) if windows else 0
    if not window or not is_lazy(dataset):
        return None
    files = len(dataset.files)
    logger.info("pf-trl: %s does not fit the node cache: shard-grouped shuffle, its %d files in a random order and "
                "the rows shuffled within windows of %d files (seed and epoch decide both; docs/storage.md)",
                dataset.uri, files, window)
    return {"shard_bounds": dataset._offsets, "group_shards": window}


def read_ahead(trainer, dataset, sampler) -> None:
    """Shards read while they download (:class:`~pf_trl.data.lazy_shards.LazyShards`): their files fetched in the
    order of ``sampler``'s planned rows for this rank, from where a resumed run starts; a no-op for other data."""
    from pf_trl.data.lazy_shards import is_lazy

    if not is_lazy(dataset):
        return
    if not hasattr(sampler, "planned_rows"):  # a sampler that plans no order: the files in row order
        dataset.follow(np.arange(len(dataset)))
        return
    resumed = getattr(trainer, "_pf_resumed_state", None) if trainer._pf_resume_dir else None
    skipped = ((resumed or {}).get("sampler") or {}).get("batches_yielded", 0)  # Trainer skips them unread
    dataset.follow(sampler.planned_rows(skip_batches=int(skipped or 0)))
    trainer.pop_callback(FollowEachEpoch)  # a dataloader built again (another train() call) follows its own sampler
    if dataset.streamed:
        trainer.add_callback(FollowEachEpoch(dataset, sampler))


class FollowEachEpoch(TrainerCallback):
    """A dataset streamed through a bounded node cache (its files downloaded as their rows come, evicted once read)
    is fetched ahead in every epoch's planned order, not only the first's: at an epoch's start the sampler plans that
    epoch and the read-ahead follows the plan (:func:`read_ahead` gave it the first epoch's, or a resumed one's)."""

    def __init__(self, dataset, sampler) -> None:
        self.dataset, self.sampler, self.followed = dataset, sampler, sampler.epoch

    def on_epoch_begin(self, args, state, control, **kwargs):
        epoch = math.floor((state.epoch or 0.0) + 1e-6)  # Trainer's epoch loop index (its state counts steps in it)
        if epoch != self.followed:
            self.sampler.set_epoch(epoch)  # what Trainer sets next; setting it again keeps the position
            self.dataset.follow(self.sampler.planned_rows())
            self.followed = epoch


def packed_dataloader(trainer, dataset, sampler, *, training: bool, wrap_collator=None, collate_fn=None):
    """The dataloader of ``dataset`` batched by ``sampler`` and collated padding-free (the model's columns only),
    prepared by accelerate with its sharding turned off: the sampler is already rank-aware. ``wrap_collator``: a
    callable wrapping the collator (evaluation: :class:`pf_trl.trainer.predict.ExampleBounds`). ``collate_fn``: a
    collator of one's own over the dataset's columns as they are (preference pairs), instead of the SFT one."""
    from functools import partial

    from transformers.trainer_utils import seed_worker

    args = trainer.args
    if collate_fn is not None:
        collate = collate_fn
    else:
        names = getattr(dataset, "column_names", None)
        if names:
            keep = [c for c in MODEL_COLUMNS if c in names]
            if "input_ids" not in keep:
                raise TrainingDataError(f"the dataset has no 'input_ids' column (columns: {names}); pretokenize it "
                                        "first")
            dataset = dataset.select_columns(keep)
        collate = CountingCollator(trainer._pf_collator, prepare=VisionFeatures(trainer.processing_class)
                                   if names and "images" in names else None)
    params: dict[str, Any] = dict(
        batch_sampler=sampler,
        collate_fn=wrap_collator(collate) if wrap_collator is not None else collate,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
        in_order=args.dataloader_in_order,
    )
    if args.dataloader_num_workers > 0:
        params["prefetch_factor"] = args.dataloader_prefetch_factor
        params["multiprocessing_context"] = args.dataloader_multiprocessing_context
    if training:
        params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers,
                                           rank=args.process_index)
    loader = trainer.accelerator.prepare(DataLoader(dataset, **params))
    # our sampler is already rank-aware: make accelerate's BatchSamplerShard a passthrough
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
        shard.num_processes = 1
        shard.process_index = 0
    return loader


# ---------------------------------------------------------------------------------------------- mixtures


def mixture_sampler(dataset, lengths: np.ndarray, budget: int, *, seed: int, args,
                    topology: tuple[int, int] | None = None):
    """A :class:`~pf_trl.batching.mixture_sampler.MixtureBatchSampler` when ``dataset`` is a loaded mixture, else None.

    ``topology``: ``(num_replicas, rank)`` of the sampler (sequence parallelism: groups of ranks share a batch);
    default: the ranks of ``args``."""
    from pf_trl.data.mixture import mixture_of
    from pf_trl.batching.mixture_sampler import MixtureBatchSampler, MixtureSchedule

    rule = mixture_of(dataset)
    if rule is None:
        return None
    schedule = MixtureSchedule(lengths, rule["bounds"], rule["weights"], seed=rule["seed"],
                               sample_by=rule["sample_by"], stopping_strategy=rule["stopping_strategy"])
    rank, world = rank_and_world(args)
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
    from pf_trl.batching.stream_sampler import StreamPacker

    args = trainer.args
    stream = trainer._pf_stream
    budget = stream_budget(stream, args)
    state = load_stream_state(trainer._pf_resume_dir, args, budget) if trainer._pf_resume_dir else None
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
