"""``output_dir`` in a bucket (``s3://BUCKET/runs/NAME``): checkpoints and the final model uploaded from node-local
staging, committed by the completion marker, found again by ``resume_from_checkpoint="auto"`` on any node.

- **Staging.** Trainer writes into ``$PF_TRL_CACHE/staging/output-<hash of the URI>`` (the same folder for every
  rank of a node; another node has its own disk). The trainer's ``args.output_dir`` is that folder; the URI is kept
  on the trainer (:class:`RemoteOutput`).
- **A checkpoint** (:class:`RemoteCheckpointCallback`, ``on_save``, after the local marker): rank 0 clears what a
  save of the same step cut short left in the bucket; the ranks of each node share the upload of the files their
  node wrote (the model, optimizer and trainer state on rank 0's node; every rank's ``rng_state_<rank>.pth``,
  stream positions, ZeRO / FSDP shards on theirs); every rank reports its result to all; only when all confirmed does
  rank 0 write :data:`~pf_trl.trainer.checkpoints.COMPLETE_MARKER` into the bucket, listing every object of the
  checkpoint with its size and xxh3-128 checksum and the attempt that wrote it, last. A pod killed during an
  upload leaves no marker: ``auto`` never takes it.
  ``save_total_limit`` is then applied in the bucket (oldest first, each marker deleted before its files), and the
  node's staging keeps only the newest checkpoint (and the best). Uploads run in the background while training goes
  on (:mod:`pf_trl.trainer.checkpoint_uploads`): the next save waits for the previous upload, the end of training
  for the last; a failed upload stops the run at the next save or at its end.
- **The final model** (``save_model()`` into ``output_dir``): the staged root (every file but the checkpoints)
  uploaded by rank 0 and committed by its own marker, written last (:mod:`pf_trl.storage.committed`); what an
  earlier final model left in the prefix is removed, so ``--model_name_or_path s3://...`` reads one whole model.
- **Resume** (``auto`` / ``True`` / a checkpoint URI): rank 0 picks the latest complete checkpoint in the bucket
  (marker there, names its step, every listed object present with that size) and tells every rank; the first rank
  of each node downloads what its node's ranks read (:mod:`pf_trl.trainer.checkpoint_fetch`: the shared files and
  its own ranks' shards, concurrently, each checked against the marker's checksum) into the (emptied) staging
  folder; Trainer resumes from the local copy, exactly.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

from pf_trl.errors import ResumeError
from pf_trl.storage import RemoteURI, is_remote, parse_uri
from pf_trl.trainer.checkpoints import COMPLETE_MARKER, is_auto
from pf_trl.trainer.remote_checkpoints import (
    CHECKPOINT,
    checkpoint_problem,
    latest_complete,
    remote_checkpoints,
    remove_remote_checkpoints,
)

__all__ = ["RemoteCheckpointCallback", "RemoteOutput", "prepare_resume", "stage_output_dir", "upload_final"]


@dataclass
class RemoteOutput:
    """The bucket prefix a run's output goes to, and the local folder it is staged in."""

    uri: RemoteURI
    staging: Path


def stage_output_dir(args) -> RemoteOutput | None:
    """When ``args.output_dir`` is a bucket URI: point it at the node's staging folder and return both (else None)."""
    if not is_remote(args.output_dir):
        return None
    from pf_trl.storage.cache import staging_dir

    uri = parse_uri(args.output_dir)
    staging = staging_dir() / f"output-{hashlib.sha256(str(uri).encode()).hexdigest()[:16]}"
    args.output_dir = str(staging)
    if getattr(args, "logging_dir", None) and is_remote(args.logging_dir):
        args.logging_dir = str(staging / "runs")
    return RemoteOutput(uri, staging)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _broadcast(value, rank: int):
    dist = _dist()
    if dist is None:
        return value
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(outcome: str | None) -> list[str]:
    """Every rank's failure (None: confirmed), gathered on every rank."""
    dist = _dist()
    if dist is None:
        return [outcome] if outcome else []
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    return [f"rank {r}: {o}" for r, o in enumerate(outcomes) if o]


def _ranks_of_this_node(rank: int) -> set[int]:
    """The global ranks on this node (torchrun's GROUP_RANK names the node; else the host name)."""
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    dist = _dist()
    if dist is None:
        return {rank}
    placed: list = [None] * dist.get_world_size()
    dist.all_gather_object(placed, (node, rank))
    return {r for n, r in placed if n == node}


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def prepare_resume(trainer, remote: RemoteOutput, resume_from_checkpoint):
    """``resume_from_checkpoint`` for a bucket ``output_dir``, made local: the staging folder emptied on each node,
    the checkpoint rank 0 chose downloaded into it, its local path returned (None: a fresh start).

    Raises:
        ResumeError: ``True`` (or a checkpoint URI) and no complete checkpoint there.
        StorageError: the bucket cannot be read (one line).
    """
    from pf_trl.storage.filesystem import list_files

    args = trainer.args
    rank = args.process_index
    say = print if rank == 0 else (lambda *_: None)
    if args.local_process_index == 0:
        shutil.rmtree(remote.staging, ignore_errors=True)  # a disk that held another attempt: only the bucket counts
        remote.staging.mkdir(parents=True, exist_ok=True)
    auto = is_auto(resume_from_checkpoint)
    wanted = resume_from_checkpoint is True or (isinstance(resume_from_checkpoint, str)
                                                and resume_from_checkpoint.strip().lower() == "true")
    choice = None
    if rank == 0:
        if auto or wanted:
            found = latest_complete(remote.uri, say=say)
            if found is None and wanted:
                choice = ("error", f"resume_from_checkpoint=True but no complete checkpoint in {remote.uri}")
            elif found is None:
                say(f"pf-trl: --resume_from_checkpoint auto: no complete checkpoint in {remote.uri}; starting from "
                    "step 0")
            else:
                choice = ("resume", str(found))
        elif isinstance(resume_from_checkpoint, str) and is_remote(resume_from_checkpoint):
            folder = parse_uri(resume_from_checkpoint)
            problem = checkpoint_problem(folder, list_files(folder))
            choice = ("error", f"cannot resume from {folder}: {problem}") if problem else ("resume", str(folder))
        elif resume_from_checkpoint:
            choice = ("error", f"resume_from_checkpoint={resume_from_checkpoint!r} with output_dir {remote.uri}: pass "
                               "auto, True or a checkpoint's bucket URI")
    choice = _broadcast(choice, rank)
    if choice is None:
        _barrier()
        return None
    if choice[0] == "error":
        raise ResumeError(choice[1])
    folder = parse_uri(choice[1])
    local = remote.staging / folder.name
    outcome = None
    ranks = _ranks_of_this_node(rank)
    if args.local_process_index == 0:
        from pf_trl.trainer.checkpoint_fetch import fetch_checkpoint

        try:  # this node's ranks' files and the shared ones, concurrently, checked against the marker
            fetch_checkpoint(folder, local, ranks, max(1, int(args.world_size)))
        except Exception as exc:  # every rank hears of it, none waits forever
            outcome = " ".join(str(exc).split())
    failed = _all_ok(outcome)
    if failed:
        raise ResumeError(f"cannot download {folder}: {'; '.join(failed)}")
    say(f"pf-trl: --resume_from_checkpoint: resuming from {folder} (downloaded to {local})")
    return str(local)


def _node_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != COMPLETE_MARKER and not p.name.startswith(f".{COMPLETE_MARKER}"))


class RemoteCheckpointCallback(TrainerCallback):
    """Uploads each checkpoint from staging to the bucket in the background and commits it
    (:class:`~pf_trl.trainer.checkpoint_uploads.CheckpointUploader`). Added after
    :class:`~pf_trl.trainer.resume.CheckpointCompleteCallback`: every rank's files are in when it runs."""

    def __init__(self, trainer, remote: RemoteOutput) -> None:
        self.trainer, self.remote = trainer, remote
        self.uploader = None

    def on_train_begin(self, args, state, control, **kwargs):
        from pf_trl.trainer.checkpoint_uploads import CheckpointUploader, new_attempt_id

        dist = _dist()
        # the upload thread's collectives run on a gloo group of their own, never on training's communicator
        group = dist.new_group(backend="gloo") if dist is not None else None
        attempt = _broadcast(new_attempt_id() if args.process_index == 0 else None, args.process_index)
        self.uploader = CheckpointUploader(self.remote.uri, attempt, group)

    def _wait_if_saving(self, control) -> None:
        if control.should_save and self.uploader is not None:
            self.uploader.wait()  # before Trainer writes (and rotates) the next checkpoint

    def on_step_end(self, args, state, control, **kwargs):
        self._wait_if_saving(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._wait_if_saving(control)

    def on_evaluate(self, args, state, control, **kwargs):
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best" and self.uploader is not None:
            self.uploader.wait()  # a save may follow this evaluation

    def on_train_end(self, args, state, control, **kwargs):
        if self.uploader is not None:
            self.uploader.wait()  # the last checkpoint is committed before the run ends

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        if state.is_hyper_param_search:
            return
        if self.uploader is None:
            self.on_train_begin(args, state, control)
        from pf_trl.trainer.checkpoint_uploads import trim_staging

        local = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        mine = _node_files(local)[args.local_process_index::max(1, _local_world(args))]
        self.uploader.start(step=int(state.global_step), local=local, files=mine, rank=args.process_index,
                            local_rank=args.local_process_index, world_size=max(1, int(args.world_size)),
                            rotate=lambda step: self._rotate(args, step),
                            trim=lambda current: trim_staging(current, self.trainer.state.best_model_checkpoint))

    def _rotate(self, args, step: int) -> None:
        """``save_total_limit`` in the bucket, over the checkpoints up to this step: a newer leftover of a killed
        attempt (no marker) is not counted, so it can never push the checkpoint just committed out."""
        limit = args.save_total_limit
        if not limit or limit < 1:
            return
        found = [u for s, u, _ in remote_checkpoints(self.remote.uri) if s <= step]
        best = self.trainer.state.best_model_checkpoint
        keep = set(found[-limit:])
        if best:
            keep.add(self.remote.uri.join(Path(best).name))
        remove_remote_checkpoints([u for u in found if u not in keep])


def _local_world(args) -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 when unknown: each rank then uploads all its node's files,
    the same bytes twice at worst)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        return 1


def upload_final(trainer, remote: RemoteOutput) -> None:
    """The staged root (final model, tokenizer, results; not the checkpoints) uploaded by rank 0 and committed by
    :data:`~pf_trl.storage.committed.MODEL_MARKER`, written last (:func:`~pf_trl.storage.committed.commit_prefix`):
    files of an earlier final model in the prefix that this one does not hold are removed; the checkpoints and the
    logs (``runs/``) of earlier attempts stay."""
    from pf_trl.storage.committed import commit_prefix

    if not trainer.args.should_save:
        return
    root = remote.staging
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not CHECKPOINT.match(rel.parts[0]) and not rel.parts[0].startswith("."):
            files.append(rel.as_posix())
    commit_prefix(root, remote.uri, files, keep=_not_the_model)


def _not_the_model(name: str) -> bool:
    """Objects of a bucket ``output_dir`` that a new final model leaves in place: checkpoints (``save_total_limit``
    and resume manage them) and training logs."""
    top = name.partition("/")[0]
    return bool(CHECKPOINT.match(top)) or top == "runs"
