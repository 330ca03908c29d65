"""Which checkpoints a restarted job may resume from: ``resume_from_checkpoint="auto"`` and the completion marker.

A pod can die at any moment of a checkpoint save. Trainer writes a checkpoint in pieces: the model, then the
optimizer and scheduler (rank 0), each rank's ``rng_state_<rank>.pth``, ``trainer_state.json`` (rank 0), then the
``on_save`` callbacks (pf-trl's sampler or stream position), and nothing in the folder says the last piece is in. So
pf-trl writes one more file, :data:`COMPLETE_MARKER`, after every rank has finished its part of the save (a barrier),
atomically (written aside, then renamed), listing every file of the checkpoint with its size.

A checkpoint is *complete* when its marker is there, names the folder's step and every file it lists is present with
that size: a save cut short has no marker, and a checkpoint whose deletion by ``save_total_limit`` was cut short is
missing files. ``"auto"`` resumes from the latest complete checkpoint and starts afresh when there is none; a
checkpoint without a marker (cut short, or written by another tool) is never taken by ``auto``.

Light on purpose (no torch): the CLI's checks import :func:`is_auto` before anything heavy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["AUTO", "COMPLETE_MARKER", "checkpoint_problem", "is_auto", "latest_complete_checkpoint", "resolve_auto",
           "write_complete_marker"]

AUTO = "auto"
COMPLETE_MARKER = "pf_trl_checkpoint_complete.json"


def is_auto(resume_from_checkpoint) -> bool:
    """True for ``resume_from_checkpoint="auto"`` (any case): resume if a complete checkpoint is there, else start."""
    return isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.strip().lower() == AUTO


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != COMPLETE_MARKER and not p.name.startswith(f".{COMPLETE_MARKER}")}


def write_complete_marker(folder: str | Path, step: int, world_size: int) -> Path:
    """Write :data:`COMPLETE_MARKER` into checkpoint ``folder`` (call it when every rank's files are in)."""
    folder = Path(folder)
    marker = folder / COMPLETE_MARKER
    tmp = folder / f".{COMPLETE_MARKER}.tmp-{os.getpid()}"
    body = {"global_step": int(step), "world_size": int(world_size), "files": _files(folder)}
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)  # atomic: a reader sees no marker or the whole marker
    return marker


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why checkpoint ``folder`` is not complete (a short phrase), or None when it is."""
    folder = Path(folder)
    try:
        body: dict[str, Any] = json.loads((folder / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {COMPLETE_MARKER} (its save did not finish, or another tool wrote it)"
    except (OSError, ValueError) as exc:
        return f"its {COMPLETE_MARKER} is unreadable ({exc})"
    step = folder.name.rpartition("-")[2]
    if str(body.get("global_step")) != step:
        return f"its {COMPLETE_MARKER} is for step {body.get('global_step')}"
    for name, size in (body.get("files") or {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
    return None


def latest_complete_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the complete checkpoint with the highest step or None, [(a newer incomplete checkpoint, why)])."""
    from pf_trl.trainer.output_dir import checkpoints

    skipped: list[tuple[Path, str]] = []
    for folder in reversed(checkpoints(output_dir)):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder, skipped
        skipped.append((folder, problem))
    return None, skipped


def resolve_auto(output_dir: str | Path, *, say=print, save_total_limit: int | None = None) -> str | None:
    """``"auto"`` made concrete: the latest complete checkpoint's path, or None (a fresh start); says which (and
    warns about ``save_total_limit=1``: the one checkpoint kept is deleted before the next is marked complete)."""
    if save_total_limit == 1:
        say("pf-trl: --resume_from_checkpoint auto with --save_total_limit 1: a pod killed during a save may leave "
            "no complete checkpoint (the older one is deleted before the new one is marked complete); keep 2")
    found, skipped = latest_complete_checkpoint(output_dir)
    for folder, why in skipped:
        say(f"pf-trl: --resume_from_checkpoint auto: {folder} is not complete ({why}); not resumed from")
    if found is None:
        say(f"pf-trl: --resume_from_checkpoint auto: no complete checkpoint in {output_dir}; starting from step 0")
        return None
    say(f"pf-trl: --resume_from_checkpoint auto: resuming from {found}")
    return str(found)
