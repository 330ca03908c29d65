"""No silent overwrite of earlier work: an output directory that holds checkpoints is only trained into again when
the run resumes from them or is told to start over.

Light on purpose (no torch, no transformers): ``pf-trl train`` runs this check before it imports anything heavy, and
:class:`~pf_trl.trainer.PaddingFreeSFTTrainer` runs the same check in ``train()``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pf_trl.errors import PfTrlError

# transformers.trainer_utils: PREFIX_CHECKPOINT_DIR and the pattern get_last_checkpoint() reads
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class OutputDirError(PfTrlError, ValueError):
    """The output directory holds checkpoints and the run neither resumes nor overwrites; the message says how."""


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders of ``output_dir``, oldest step first (none when it does not exist)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def refuse_uri_output_dir(output_dir, what: str) -> None:
    """One line when ``output_dir`` is a URI (``s3://``, ``gs://``, ...) and ``what`` (a trainer or a command) saves
    into a local folder only: Trainer would create a local folder named after it (``s3:/bucket/...``) and write
    there."""
    if isinstance(output_dir, str) and "://" in output_dir:
        raise OutputDirError(f"output_dir {output_dir}: {what} saves its checkpoints and model into a local folder; a "
                             "bucket output_dir is taken by `pf-trl train` (PaddingFreeSFTTrainer) only: give a local "
                             "or mounted folder (one volume every rank sees) and copy it to the bucket after training")


def wants_resume(resume_from_checkpoint) -> bool:
    """True when ``resume_from_checkpoint`` asks for a resume (``True``, ``"true"``, ``"auto"`` or a checkpoint path):
    ``"auto"`` is a job that restarts itself, whose output directory holds its own checkpoints
    (:mod:`pf_trl.trainer.checkpoints`)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return False
    if isinstance(resume_from_checkpoint, str):
        return resume_from_checkpoint.strip().lower() not in ("", "false", "no", "0", "none")
    return bool(resume_from_checkpoint)


def check_output_dir(output_dir: str | Path, *, resume_from_checkpoint=None, overwrite_output_dir: bool = False,
                     cli: bool = False) -> list[Path]:
    """Refuse to train into ``output_dir`` over its checkpoints unless the run resumes or overwrites.

    Returns the checkpoints a run with ``overwrite_output_dir`` replaces (empty otherwise).

    Raises:
        OutputDirError: checkpoints are there, no resume and no overwrite; the message names the latest one and the
            two ways on (spelled as flags when ``cli``, else as Python arguments).
    """
    found = checkpoints(output_dir)
    if not found or wants_resume(resume_from_checkpoint):
        return []
    if overwrite_output_dir:
        return found
    latest = found[-1]
    if cli:
        resume, overwrite = "--resume_from_checkpoint True (or auto)", "--overwrite_output_dir True"
    else:
        resume = "trainer.train(resume_from_checkpoint=True) (or \"auto\")"
        overwrite = "PaddingFreeConfig(overwrite_output_dir=True)"
    raise OutputDirError(
        f"output_dir {output_dir} already holds {len(found)} checkpoint(s), the latest {latest} (step "
        f"{_CHECKPOINT.match(latest.name).group(1)}); a new run would overwrite them. Continue it with {resume}, "
        f"start over with {overwrite} (its checkpoints are deleted), or choose another output_dir"
    )


def remove_checkpoints(found: list[Path]) -> None:
    """Delete the checkpoints of an earlier run (``overwrite_output_dir``): a later resume must not pick one of them
    up as if the new run had written it."""
    for folder in found:
        shutil.rmtree(folder, ignore_errors=True)
