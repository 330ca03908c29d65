"""Checkpoint uploads to a bucket that overlap training, committed by a marker listing every file's checksum.

:class:`CheckpointUploader` (driven by :class:`~pf_trl.trainer.remote_output.RemoteCheckpointCallback`):

- **In the background.** ``on_save`` starts a thread and returns: training goes on while the checkpoint uploads.
  Each rank uploads its share of the files its node wrote in one batched fsspec ``put`` (the files go concurrently).
- **Committed when every rank confirmed.** Each rank hashes the files it uploaded (xxh3-128, as dataset shards are)
  and reports ``{file: bytes, digest}`` or its failure to all ranks (a gloo group of its own, so the thread never
  shares a communicator with training); only when all confirmed does rank 0 write
  :data:`~pf_trl.trainer.checkpoints.COMPLETE_MARKER`, last, naming every file with its size and checksum and the
  attempt (:func:`new_attempt_id`) that wrote them. Then ``save_total_limit`` applies in the bucket and the node's
  staging drops the checkpoints older than this one: the local copy stays until its marker is written.
- **Waited for only when needed.** The next save waits for the previous upload before Trainer writes it (``on_step_end``
  / ``on_epoch_end`` when a save is due: Trainer's local rotation may then delete the previous copy); the end of
  training waits for the last one.
- **Never dropped.** A failed upload is said in one line when it fails; every rank raises it at the next save or at
  the end of training (:class:`~pf_trl.errors.ResumeError`): no marker is written, ``auto`` never takes it.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pf_trl.errors import ResumeError
from pf_trl.storage import RemoteURI
from pf_trl.trainer.checkpoints import COMPLETE_MARKER

__all__ = ["CHECKSUM_ALGORITHM", "CheckpointUploader", "Upload", "new_attempt_id"]

CHECKSUM_ALGORITHM = "xxh3_128"


def new_attempt_id() -> str:
    """A name for this run attempt (UTC start time and a random part), recorded in each marker it writes."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


@dataclass
class Upload:
    """One checkpoint's upload: when it started, finished its files and was committed (``time.monotonic()``)."""

    step: int
    target: RemoteURI
    local: Path
    started: float = field(default_factory=time.monotonic)
    uploaded: float | None = None
    committed: float | None = None
    error: str | None = None
    thread: threading.Thread | None = None


class CheckpointUploader:
    """Uploads checkpoints in a background thread, one at a time (see the module docstring)."""

    def __init__(self, uri: RemoteURI, attempt: str, group=None) -> None:
        self.uri, self.attempt, self.group = uri, attempt, group
        self.history: list[Upload] = []

    @property
    def current(self) -> Upload | None:
        return self.history[-1] if self.history else None

    def wait(self) -> None:
        """Wait for the upload in flight (if any).

        Raises:
            ResumeError: it failed (every rank raises: the run stops, the checkpoint has no marker).
        """
        upload = self.current
        if upload is None:
            return
        if upload.thread is not None:
            upload.thread.join()
        if upload.error:
            raise ResumeError(upload.error)

    def start(self, *, step: int, local: Path, files: list[str], rank: int, local_rank: int, world_size: int,
              rotate, trim) -> Upload:
        """Upload ``files`` (this rank's share of checkpoint folder ``local``) in the background, then commit.

        ``rotate()`` (rank 0) applies ``save_total_limit`` in the bucket and ``trim()`` (each node's first rank) the
        node's staging, both after the marker is written."""
        self.wait()
        upload = Upload(step=step, target=self.uri.join(local.name), local=local)
        upload.thread = threading.Thread(
            target=self._run, args=(upload, files, rank, local_rank, world_size, rotate, trim),
            name=f"pf-trl-upload-{local.name}", daemon=True)
        self.history.append(upload)
        upload.thread.start()
        return upload

    # ------------------------------------------------------------------------------------------- the thread

    def _gather(self, value, world_size: int) -> list:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list = [None] * world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _run(self, upload: Upload, files: list[str], rank: int, local_rank: int, world_size: int, rotate, trim):
        from pf_trl.trainer.remote_checkpoints import remove_remote_checkpoints

        error = None
        listed: dict[str, dict] = {}
        try:
            if rank == 0:  # what an earlier save of this step left (a pod killed mid-upload): never mixed in
                remove_remote_checkpoints([upload.target])
        except Exception as exc:
            error = str(exc)
        if any(self._gather(error, world_size)):  # nobody uploads before the leftovers are gone
            error = error or "rank 0 could not clear the checkpoint's earlier objects"
        else:
            try:
                listed = _upload_files(upload.local, upload.target, files, rank, self.attempt)
            except Exception as exc:  # reported to every rank: no rank waits for a marker that will not come
                error = " ".join(str(exc).split()) or type(exc).__name__
        upload.uploaded = time.monotonic()
        outcomes = self._gather((error, listed), world_size)
        failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(outcomes) if e]
        if failed:
            upload.error = (f"checkpoint {upload.target} was not uploaded (no marker written, `auto` will not take "
                            f"it): {'; '.join(failed)}")
            if rank == 0:
                print(f"pf-trl: {upload.error}; the run stops at the next save or at its end", flush=True)
            return
        try:
            if rank == 0:
                merged = {name: entry for _, part in outcomes for name, entry in part.items()}
                _write_marker(upload.target, upload.step, world_size, self.attempt, merged)
                upload.committed = time.monotonic()
                rotate(upload.step)
        except Exception as exc:
            error = " ".join(str(exc).split())
        committed = self._gather(error, world_size)  # the marker is in (or not) before any node trims
        failed = [f"rank {r}: {e}" for r, e in enumerate(committed) if e]
        if failed:
            upload.error = f"checkpoint {upload.target} was not committed: {'; '.join(failed)}"
            if rank == 0:
                print(f"pf-trl: {upload.error}; the run stops at the next save or at its end", flush=True)
            return
        if upload.committed is None:
            upload.committed = time.monotonic()
        if local_rank == 0:
            trim(upload.local)


def _upload_files(local: Path, target: RemoteURI, files: list[str], rank: int, attempt: str) -> dict[str, dict]:
    """``files`` of ``local`` uploaded in one batched ``put`` (concurrent); ``{name: {bytes, digest, rank}}``."""
    from pf_trl.data.integrity import file_digest
    from pf_trl.storage.filesystem import call, filesystem

    listed = {name: {"bytes": (local / name).stat().st_size, "digest": file_digest(local / name, CHECKSUM_ALGORITHM),
                     "rank": rank, "attempt": attempt} for name in files}
    if files:
        fs = filesystem(target)
        lpaths = [str(local / name) for name in files]
        rpaths = [target.join(name).path for name in files]
        call(target, f"uploading {len(files)} checkpoint file(s) from {local}", lambda: fs.put(lpaths, rpaths))
    return listed


def _write_marker(target: RemoteURI, step: int, world_size: int, attempt: str, files: dict[str, dict]) -> None:
    from pf_trl.storage.filesystem import write_bytes

    body = {"global_step": int(step), "world_size": int(world_size), "attempt": attempt,
            "files": {name: entry["bytes"] for name, entry in sorted(files.items())},
            "checksums": {"algorithm": CHECKSUM_ALGORITHM, "files": dict(sorted(files.items()))}}
    write_bytes(target.join(COMPLETE_MARKER), json.dumps(body, indent=1).encode())  # the commit, last


def trim_staging(current: Path, best: str | None) -> None:
    """Drop the node's staged checkpoints older than ``current`` (the best kept): the bucket holds them now."""
    from pf_trl.trainer.remote_checkpoints import CHECKPOINT

    step = int(CHECKPOINT.match(current.name).group(1))
    for folder in current.parent.iterdir():
        m = CHECKPOINT.match(folder.name)
        if m and int(m.group(1)) < step and (not best or folder.name != Path(best).name):
            shutil.rmtree(folder, ignore_errors=True)
