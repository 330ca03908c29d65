"""``max_length`` / ``truncation_mode`` on the rows the trainer is given, as TRL's ``SFTTrainer`` applies them.

TRL cuts every tokenized row to ``max_length`` (train and eval) and drops the rows left without a supervised label,
unless ``dataset_kwargs={"skip_prepare_dataset": True}``. pf-trl tokenizes raw rows itself (the limit is applied
while tokenizing, :mod:`pf_trl.data.pretokenize`) and is given tokenized rows or shards as they are: both go through
:func:`apply_sequence_limit`, so a padding-free run trains exactly the tokens a padded TRL run trains. The
``truncation`` policy of :class:`~pf_trl.trainer.PaddingFreeConfig` (``truncate`` | ``drop`` | ``refuse``) decides
what happens to a longer row, and one log line says how many were cut and how many supervised tokens were lost.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from typing import Any

from pf_trl.data.truncation import TruncationRefused, TruncationReport, report_from_manifest, truncate_dataset

logger = logging.getLogger("pf_trl.trainer")

NO_LIMIT = 1 << 20  # pretokenize's max_seq_len when max_length is None (TRL: no truncation): the largest it takes


def pretokenize_limits(args) -> dict[str, Any]:
    """The :class:`~pf_trl.data.pretokenize.PretokenizeConfig` options that carry the trainer's sequence limit."""
    return {
        "max_seq_len": int(args.max_length) if args.max_length is not None else NO_LIMIT,
        "truncation": args.truncation,
        "truncation_mode": args.truncation_mode,
        # TRL drops rows without a supervised label only when it truncates (max_length set)
        "drop_no_loss": args.max_length is not None,
    }


def log_manifest_truncation(dataset, *, what: str) -> None:
    """One warning line when the shards of ``dataset`` were cut or thinned while tokenizing (their manifest says)."""
    manifest = getattr(dataset, "pf_manifest", None)
    if manifest:
        line = report_from_manifest(manifest).summary(what, limit_name="max_length")
        if line:
            logger.warning("pf-trl: %s", line)


def _needs_scan(dataset, max_length: int) -> bool:
    """False when a shards manifest already proves every row fits and has a supervised label."""
    manifest = getattr(dataset, "pf_manifest", None) or {}
    longest = (manifest.get("lengths") or {}).get("max")
    drops_no_loss = (manifest.get("options") or {}).get("drop_no_loss", False)
    rows = (manifest.get("counts") or {}).get("examples")
    return not (longest is not None and longest <= max_length and drops_no_loss and rows == len(dataset))


_SCRATCH: list[str] = []


def _scratch_dir() -> str:
    """A private directory for the cut copy of memory-mapped shards (never written into the user's shards)."""
    from pf_trl.data.tokenizer import cache_root

    root = cache_root() / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="truncated-", dir=root)
    _SCRATCH.append(path)
    if len(_SCRATCH) == 1:
        atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _SCRATCH])
    return path


def apply_sequence_limit(dataset, args, *, what: str) -> tuple[Any, TruncationReport | None]:
    """Cut (or drop, or refuse) the tokenized rows of ``dataset`` longer than ``args.max_length``, TRL's way.

    Returns the dataset to train on and the report (None when nothing was looked at). Raises ``ValueError`` (a
    :class:`~pf_trl.data.truncation.TruncationRefused`) under the ``refuse`` policy.
    """
    import datasets

    max_length = args.max_length
    if max_length is None or not isinstance(dataset, datasets.Dataset) or "input_ids" not in dataset.column_names:
        return dataset, None  # no limit, or streamed rows (read lazily: not pf-trl's to cut here)
    if not _needs_scan(dataset, int(max_length)):
        return dataset, None
    cache = None
    if getattr(dataset, "cache_files", None):
        import os

        cache = os.path.join(_scratch_dir(), "data.arrow")
    try:
        limited, report = truncate_dataset(dataset, max_length=int(max_length), mode=args.truncation_mode,
                                           policy=args.truncation, drop_no_loss=True, what=what,
                                           cache_file_name=cache)
    except TruncationRefused as exc:
        raise TruncationRefused(f"{what}: {exc}") from None
    line = report.summary(what)
    if line:
        logger.warning("pf-trl: %s", line)
    return limited, report
