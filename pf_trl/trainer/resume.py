"""Resume state of a padding-free run: what each checkpoint records about the train sampler and the data, and the
check that a resumed run continues exactly where the checkpoint stopped.

- **Sampler position.** :class:`SamplerStateCallback` writes ``pf_trl_sampler_state.json`` into each checkpoint
  (``on_save``): the sampler's state, its epoch and consumed batches (from ``global_step``, with Trainer's own resume
  arithmetic), the accumulation steps, world size and budget. On resume :func:`restore_sampler` validates it
  against the new sampler (same lengths, budget, seed, world size) and restores the epoch; Trainer's own
  ``skip_first_batches`` then skips the consumed batches of that epoch (index lists only, no data is loaded). The
  sampler itself is *not* fast-forwarded, so nothing is skipped twice and nothing is replayed. A stream saves its
  packer's position instead (:func:`pf_trl.trainer.data_inputs.write_stream_state`).
- **Data identity.** The sampler's own fingerprint covers the example *lengths* and the packing options: enough to
  replay the batches, not to know they hold the same examples (two datasets with the same lengths in the same
  places, or the same data in another order, would resume silently and train some examples twice and others
  never). :func:`data_identity` adds a digest of the content itself: every token id and label, in dataset order,
  read through Arrow in batches (BLAKE2b; about 1 s per 20 M tokens on one CPU core, computed once per run, at the
  first checkpoint or the resume check). :func:`describe_change` names what differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from transformers import TrainerCallback

from pf_trl.data.inputs import rank_and_world
from pf_trl.errors import ResumeError

__all__ = ["SAMPLER_STATE_NAME", "CheckpointCompleteCallback", "ResumableTrainerMixin", "SamplerStateCallback",
           "data_identity", "describe_change", "load_stream_state", "resolve_resume", "resume_dir_for_call",
           "restore_sampler", "sampler_position", "write_sampler_state", "write_stream_state"]

logger = logging.getLogger("pf_trl.trainer")

SAMPLER_STATE_NAME = "pf_trl_sampler_state.json"
STREAM_STATE = "pf_trl_stream_state_rank{rank}.json"
STREAM_BUFFER = "pf_trl_stream_buffer_rank{rank}.npz"
_BATCH_ROWS = 16384


def data_identity(dataset, columns: tuple[str, ...] = ("input_ids", "labels")) -> dict[str, Any]:
    """``{"examples", "tokens", "content"}`` of a ``datasets.Dataset``: the content is a BLAKE2b of the list lengths
    and values of its token columns in row order (its indices mapping honoured); None (and tokens None) for data that
    cannot be read that way, e.g. an IterableDataset."""
    from pf_trl.data.lazy_shards import is_lazy

    if is_lazy(dataset):  # shards read while they download: never waits for them
        whole = dataset.local_dataset()
        if whole is None:  # not all local yet: what the lengths say (describe_change compares those)
            return {"examples": len(dataset), "tokens": int(dataset.pf_lengths.sum()), "content": None}
        dataset = whole
    examples = len(dataset) if hasattr(dataset, "__len__") else None
    present = [c for c in columns if c in (getattr(dataset, "column_names", None) or [])]
    if not present or not hasattr(dataset, "with_format"):
        return {"examples": examples, "tokens": None, "content": None}
    import pyarrow.compute as pc

    digest = hashlib.blake2b(digest_size=20)
    digest.update(",".join(present).encode())
    tokens = 0
    for table in dataset.select_columns(present).with_format("arrow").iter(batch_size=_BATCH_ROWS):
        for name in present:
            column = table.column(name).combine_chunks()
            # int32 whatever the column type (token ids and -100 fit): the same rows give the same digest
            lengths = np.ascontiguousarray(pc.list_value_length(column).to_numpy(zero_copy_only=False), dtype="<i4")
            digest.update(memoryview(lengths))
            values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
            digest.update(memoryview(np.ascontiguousarray(values, dtype="<i4")))
            if name == present[0]:
                tokens += int(lengths.sum())
    return {"examples": examples, "tokens": tokens, "content": digest.hexdigest()}


def describe_change(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """A sentence naming how the data differs from the checkpoint's, or None when it is the same (or unknown)."""
    if not saved:
        return None
    if not saved.get("content") or not now.get("content"):
        # a dataset still downloading has no content digest yet: its counts (from its lengths) are still compared
        if None not in (saved.get("examples"), now.get("examples"), saved.get("tokens"), now.get("tokens")) and (
                saved["examples"], saved["tokens"]) != (now["examples"], now["tokens"]):
            return (f"it has {now['examples']} examples and {now['tokens']} tokens, the checkpoint's data had "
                    f"{saved['examples']} and {saved['tokens']}")
        return None
    if saved["content"] == now["content"]:
        return None
    if saved.get("examples") != now.get("examples"):
        return f"it has {now.get('examples')} examples, the checkpoint's data had {saved.get('examples')}"
    if saved.get("tokens") is not None and now.get("tokens") is not None and saved["tokens"] != now["tokens"]:
        return (f"it has {now['tokens']} tokens in its {now.get('examples')} examples, the checkpoint's data had "
                f"{saved['tokens']}")
    return (f"the same number of examples ({now.get('examples')}) but other token ids or labels, or the same examples "
            "in another order (content digest " f"{str(saved['content'])[:12]} then, {str(now['content'])[:12]} now)")


# ---------------------------------------------------------------------------------------------- the sampler


class SamplerStateCallback(TrainerCallback):
    """Keeps pf-trl's train sampler in step with the Trainer: selects its epoch at each epoch's start, and writes its
    position into each checkpoint (read back on resume by :func:`restore_sampler`).

    ``on_epoch_begin`` reaches the sampler itself: once ``skip_first_batches`` has wrapped the dataloader on resume,
    ``set_epoch`` is not forwarded to a batch sampler. The epoch is ``floor(state.epoch)``, which is also right for a
    run resumed inside an epoch (``state.epoch`` is then fractional).
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        sampler = self.trainer._pf_train_sampler
        if sampler is not None:
            sampler.set_epoch(int(math.floor(state.epoch or 0)))

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if state.is_hyper_param_search:  # checkpoints then live in a per-trial folder that callbacks are not told
            logger.warning("pf-trl: hyperparameter search: the sampler position is not saved with the checkpoint; "
                           "a resume from it restarts the epoch's batches from Trainer's step count only")
            return
        write_sampler_state(self.trainer, os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))


class CheckpointCompleteCallback(TrainerCallback):
    """Writes the completion marker of :mod:`pf_trl.trainer.checkpoints` at the end of each save: every rank waits
    until all have written their part (rng states, a stream's position), then the main process writes the marker.
    Added after :class:`SamplerStateCallback`, so the sampler state is in before the marker."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from pf_trl.trainer.checkpoints import write_complete_marker

        if state.is_hyper_param_search:  # per-trial folders that callbacks are not told
            return
        if args.world_size > 1:
            self.trainer.accelerator.wait_for_everyone()
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if args.should_save and os.path.isdir(folder):
            write_complete_marker(folder, state.global_step, args.world_size)


def sampler_position(trainer) -> dict[str, int]:
    """Epoch and consumed batches of the train sampler implied by ``global_step``, with Trainer's own resume
    arithmetic."""
    ga = trainer.args.gradient_accumulation_steps
    n = len(trainer._pf_train_sampler)
    per_epoch = max(n // ga + int(n % ga > 0), 1)
    step = trainer.state.global_step
    return {"epoch": step // per_epoch, "batches_yielded": min((step % per_epoch) * ga, n)}


def write_sampler_state(trainer, folder: str) -> None:
    """Write the train sampler's position (or a stream's packer position) into checkpoint ``folder``."""
    if trainer._pf_packer is not None:
        return write_stream_state(trainer, folder)  # every rank: each reads its own part of the stream
    if trainer._pf_train_sampler is None or not trainer.args.should_save or not os.path.isdir(folder):
        return
    sampler = trainer._pf_train_sampler
    state = {
        "sampler": {**sampler.state_dict(), **sampler_position(trainer)},
        "data": _train_data_identity(trainer),
        "global_step": trainer.state.global_step,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "world_size": max(1, trainer.args.world_size),
        "max_tokens": sampler.max_tokens,
    }
    with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as f:
        json.dump(state, f, indent=2)


def _train_data_identity(trainer) -> dict[str, Any]:
    """:func:`data_identity` of the trainer's train dataset, computed once per dataset object."""
    cached = getattr(trainer, "_pf_identity_cache", None)
    if cached is None or cached[0] is not trainer.train_dataset:
        cached = (trainer.train_dataset, data_identity(trainer.train_dataset))
        trainer._pf_identity_cache = cached
    return cached[1]


@contextmanager
def resume_dir_for_call(trainer, resume_from_checkpoint: Any) -> Iterator[None]:
    """For one ``train()`` call: ``trainer._pf_resume_dir`` is the checkpoint folder a resumed run's sampler or
    stream state is read from (:func:`restore_sampler`, :func:`load_stream_state`): ``resume_from_checkpoint`` when
    it is a path, the output folder's last checkpoint when it is ``True`` (the one Trainer resumes from), else None;
    cleared on the way out, so a later call does not resume from it."""
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        resume_from_checkpoint = get_last_checkpoint(trainer.args.output_dir)  # None: Trainer refuses it itself
    trainer._pf_resume_dir = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
    try:
        yield
    finally:
        trainer._pf_resume_dir = None


def resolve_resume(trainer, resume_from_checkpoint: Any) -> Any:
    """``resume_from_checkpoint`` as Trainer takes it, for a local ``output_dir``: ``"auto"`` made the latest checkpoint
    its completion marker commits (None: a fresh start), the same for every rank (rank 0's reading, after checking
    that every rank sees the folder); ``True`` / ``"true"`` the last checkpoint.

    Raises:
        ResumeError: ``True`` and no checkpoint in ``output_dir``.
        SharedOutputError: a rank does not see rank 0's ``output_dir``.
    """
    from pf_trl.trainer.shared_output import agree_on_output_dir

    args = trainer.args
    resume_from_checkpoint = agree_on_output_dir(args.output_dir, resume_from_checkpoint,
                                                 save_on_each_node=args.save_on_each_node,
                                                 save_total_limit=args.save_total_limit)
    if resume_from_checkpoint is True or (isinstance(resume_from_checkpoint, str)
                                          and resume_from_checkpoint.lower() == "true"):
        from transformers.trainer_utils import get_last_checkpoint

        resume_from_checkpoint = get_last_checkpoint(args.output_dir)
        if resume_from_checkpoint is None:
            raise ResumeError(f"resume_from_checkpoint=True but no checkpoint found in {args.output_dir}")
    return resume_from_checkpoint


class ResumableTrainerMixin:
    """Mixed into pf-trl's TRL trainers (before the TRL class; each adds :class:`CheckpointCompleteCallback` last):
    ``train(resume_from_checkpoint=...)`` takes what ``pf-trl train`` takes (``"auto"``, ``True``, a path;
    :func:`resolve_resume`), and the checkpoint resumed from is recorded for :func:`restore_sampler` for that call. A
    URI as ``output_dir`` is refused at construction (these trainers save into a local folder)."""

    _pf_resume_dir: str | None = None

    def __init__(self, *args, **kwargs):
        from transformers import TrainingArguments

        from pf_trl.trainer.output_dir import refuse_uri_output_dir

        config = next((v for v in (*args, *kwargs.values()) if isinstance(v, TrainingArguments)), None)
        if config is not None:  # before Trainer creates it as a local folder
            refuse_uri_output_dir(config.output_dir, type(self).__name__)
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if trial is None:  # a hyperparameter search trains each trial in its own folder
            resume_from_checkpoint = resolve_resume(self, resume_from_checkpoint)
        with resume_dir_for_call(self, resume_from_checkpoint):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)


def restore_sampler(trainer, sampler) -> None:
    """On resume (``trainer._pf_resume_dir`` set): check the checkpoint's sampler state against this run and restore
    the sampler's epoch.

    Raises:
        ResumeError: other gradient accumulation steps, or other training data than the checkpoint's.
        SamplerError: other lengths, budget, seed or world size (from the sampler's own check).
    """
    folder = trainer._pf_resume_dir
    if not folder:
        return
    path = os.path.join(folder, SAMPLER_STATE_NAME)
    if not os.path.isfile(path):
        logger.warning("pf-trl: %s has no %s; resuming with Trainer's skip only (epoch from global_step)", folder,
                       SAMPLER_STATE_NAME)
        return
    with open(path) as f:
        saved = json.load(f)
    ga = trainer.args.gradient_accumulation_steps
    if saved.get("gradient_accumulation_steps") != ga:
        raise ResumeError(
            f"cannot resume from {folder}: it was trained with gradient_accumulation_steps="
            f"{saved.get('gradient_accumulation_steps')}, now {ga}; the same batches cannot be reproduced"
        )
    change = describe_change(saved.get("data") or {}, _train_data_identity(trainer))
    if change:
        raise ResumeError(f"cannot resume from {folder}: the training data is incompatible with the checkpoint's: "
                          f"{change}; resume with the data it was trained on, or start a new run")
    # validates lengths / budget / world size / seed (clear error otherwise) and restores the epoch. The position
    # stays at 0: Trainer's skip_first_batches skips the consumed batches itself.
    sampler.load_state_dict({**saved["sampler"], "batches_yielded": 0})
    trainer._pf_resumed_state = saved
    if trainer.is_world_process_zero():
        pos = saved["sampler"]
        print(f"pf-trl: resuming from {folder}: step {saved.get('global_step')}, epoch "
              f"{pos.get('epoch', 0) + 1}, after batch {pos.get('batches_yielded', 0)} of {len(sampler)} "
              "(those batches are skipped, not replayed)", flush=True)


# ---------------------------------------------------------------------------------------------- a stream


def write_stream_state(trainer, folder: str) -> None:
    """This rank's packer position after the batches training consumed (``global_step x`` accumulation steps)."""
    from pf_trl.batching.stream_sampler import save_buffer

    rank, world = rank_and_world(trainer.args)
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


def load_stream_state(folder: str, args, budget: int) -> dict[str, Any] | None:
    """This rank's stream state saved in checkpoint ``folder`` (None when there is none), checked against this run.

    Raises:
        ResumeError: other ranks, accumulation steps or token budget than the checkpoint's stream.
    """
    from pf_trl.batching.stream_sampler import load_buffer

    rank, world = rank_and_world(args)
    path = os.path.join(folder, STREAM_STATE.format(rank=rank))
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        state = json.load(f)
    if state.get("world_size") != world:
        raise ResumeError(f"cannot resume from {folder}: its stream was split over {state.get('world_size')} ranks, "
                         f"now {world}; each rank's stream position belongs to its split")
    if state.get("gradient_accumulation_steps") != args.gradient_accumulation_steps:
        raise ResumeError(f"cannot resume from {folder}: it was trained with gradient_accumulation_steps="
                         f"{state.get('gradient_accumulation_steps')}, now {args.gradient_accumulation_steps}")
    state["buffer"] = load_buffer(os.path.join(folder, STREAM_BUFFER.format(rank=rank)))
    if state.get("max_tokens") != budget:
        raise ResumeError(f"cannot resume from {folder}: its stream was packed to {state.get('max_tokens')} tokens, "
                         f"now {budget}; pass the same max_tokens_per_batch")
    return state
