"""Checkpoints in a bucket ``output_dir``: which are there, which are complete, the overwrite check, deletion.

Light on purpose (no torch, no transformers): ``pf-trl train`` checks a bucket ``output_dir`` before anything heavy
is imported. A bucket checkpoint is complete on the same terms as a local one (:mod:`pf_trl.trainer.checkpoints`):
its :data:`~pf_trl.trainer.checkpoints.COMPLETE_MARKER` is there, names its step, and every object it lists is
present with that size.
"""

from __future__ import annotations

import json
import re

from pf_trl.storage import RemoteURI, parse_uri
from pf_trl.trainer.checkpoints import COMPLETE_MARKER

__all__ = ["check_any_output_dir", "check_remote_output", "checkpoint_problem", "latest_complete", "remote_checkpoints",
           "remove_remote_checkpoints"]

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def remote_checkpoints(uri: str | RemoteURI) -> list[tuple[int, RemoteURI, dict[str, int]]]:
    """``[(step, checkpoint URI, {file: size})]`` of ``uri``'s ``checkpoint-<step>`` prefixes, oldest first."""
    from pf_trl.storage.filesystem import list_files

    root = parse_uri(uri)
    found: dict[int, dict[str, int]] = {}
    for name, size in list_files(root).items():
        top, _, rest = name.partition("/")
        m = CHECKPOINT.match(top)
        if m and rest:
            found.setdefault(int(m.group(1)), {})[rest] = size
    return [(step, root.join(f"checkpoint-{step}"), files) for step, files in sorted(found.items())]


def checkpoint_problem(uri: RemoteURI, files: dict[str, int]) -> str | None:
    """Why the bucket checkpoint ``uri`` (its objects ``files``) is not complete, or None when it is."""
    from pf_trl.storage.filesystem import read_bytes

    if COMPLETE_MARKER not in files:
        return f"no {COMPLETE_MARKER} (its save or upload did not finish)"
    try:
        body = json.loads(read_bytes(uri.join(COMPLETE_MARKER)))
    except ValueError as exc:
        return f"its {COMPLETE_MARKER} is unreadable ({exc})"
    if str(body.get("global_step")) != uri.name.rpartition("-")[2]:
        return f"its {COMPLETE_MARKER} is for step {body.get('global_step')}"
    for name, size in (body.get("files") or {}).items():
        if name not in files:
            return f"{name} is missing"
        if files[name] != size:
            return f"{name} has {files[name]} bytes, {size} were written"
    return None


def latest_complete(uri: RemoteURI, say=print) -> RemoteURI | None:
    """The complete checkpoint with the highest step in the bucket (newer incomplete ones named through ``say``)."""
    for _, folder, files in reversed(remote_checkpoints(uri)):
        problem = checkpoint_problem(folder, files)
        if problem is None:
            return folder
        say(f"pf-trl: --resume_from_checkpoint: {folder} is not complete ({problem}); not resumed from")
    return None


def check_remote_output(uri: str, *, resume_from_checkpoint, overwrite_output_dir: bool, cli: bool) -> list:
    """:func:`pf_trl.trainer.output_dir.check_output_dir` for a bucket: the checkpoints a new run would overwrite."""
    from pf_trl.trainer.output_dir import OutputDirError, wants_resume

    found = remote_checkpoints(uri)
    if not found or wants_resume(resume_from_checkpoint):
        return []
    if overwrite_output_dir:
        return [u for _, u, _ in found]
    resume = "--resume_from_checkpoint auto" if cli else "trainer.train(resume_from_checkpoint=\"auto\")"
    overwrite = "--overwrite_output_dir True" if cli else "PaddingFreeConfig(overwrite_output_dir=True)"
    step, latest, _ = found[-1]
    raise OutputDirError(f"output_dir {uri} already holds {len(found)} checkpoint(s), the latest {latest} (step "
                         f"{step}); a new run would overwrite them. Continue it with {resume}, start over with "
                         f"{overwrite} (its checkpoints are deleted), or choose another output_dir")


def remove_remote_checkpoints(found: list[RemoteURI]) -> None:
    """Delete bucket checkpoints, each marker first (a deletion cut short leaves a checkpoint ``auto`` never takes)."""
    from pf_trl.storage.filesystem import remove

    for folder in found:
        remove(folder.join(COMPLETE_MARKER))
        remove(folder, recursive=True)


def check_any_output_dir(output_dir: str, *, resume_from_checkpoint, overwrite_output_dir: bool, cli: bool) -> list:
    """:func:`~pf_trl.trainer.output_dir.check_output_dir` for a local folder, :func:`check_remote_output` for a
    bucket URI (the CLI's check, before anything heavy is imported)."""
    from pf_trl.storage import is_remote
    from pf_trl.trainer.output_dir import check_output_dir

    check = check_remote_output if is_remote(output_dir) else check_output_dir
    return check(output_dir, resume_from_checkpoint=resume_from_checkpoint, overwrite_output_dir=overwrite_output_dir,
                 cli=cli)
