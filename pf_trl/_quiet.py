"""Quiet by default: each pf-trl warning once per run and on rank 0 only, and no DeepSpeed banner unless DeepSpeed
is used.

- pf-trl's loggers (:data:`LOGGERS`, every name ``pf_trl`` logs under) carry :class:`OncePerRun`: a record at
  WARNING or below is dropped on ranks other than 0, and a warning already said in this run (same logger, same text)
  is not said again. :func:`start_run` (each ``PaddingFreeSFTTrainer``) begins a new run.
- accelerate imports ``deepspeed`` whenever it is installed (``extract_model_from_parallel`` checks for its engine),
  and that import logs "Setting accelerator to CPU" on machines without a GPU. :class:`DeepSpeedBanner` on
  DeepSpeed's logger drops that line unless DeepSpeed is in use (``ACCELERATE_USE_DEEPSPEED``, which
  ``TrainingArguments(deepspeed=...)`` and ``accelerate launch`` set).
- huggingface_hub warns "Repo card metadata block was not found" for every README without a YAML block; for a Hub
  dataset that only means no `configs:` section (``datasets`` then finds its files by name), so
  :class:`CardWithoutMetadata` on its ``huggingface_hub.repocard`` logger drops that line: it would come before
  whatever the run says next (a refusal of one line, or nothing).

Imports nothing heavy: installing the filters costs nothing, and torch is only asked for the rank when it is already
imported.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGERS = ("pf_trl.trainer", "pf_trl.attention", "pf_trl.cli.train", "pf_trl.data.streaming", "pf_trl.data.pretokenize",
           "pf_trl.data.ray_engine", "pf_trl.storage")
DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_BANNER = "Setting accelerator to CPU"
CARD_LOGGER = "huggingface_hub.repocard"
CARD_WITHOUT_METADATA = "Repo card metadata block was not found"


def rank() -> int:
    """This process's global rank: torch.distributed's when a group is up, else ``$RANK`` (torchrun / accelerate
    set it before the group exists), else 0."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except (RuntimeError, ValueError):
        pass
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


class OncePerRun(logging.Filter):
    """Warnings and below on rank 0 only; each warning (logger, level, text) once per run."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True  # errors are said by every rank that has one
        if rank() != 0:
            return False
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class DeepSpeedBanner(logging.Filter):
    """DeepSpeed's "Setting accelerator to CPU" line, dropped unless DeepSpeed is in use."""

    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            return True
        return not str(record.msg).startswith(DEEPSPEED_BANNER)


class CardWithoutMetadata(logging.Filter):
    """huggingface_hub's "Repo card metadata block was not found" line, dropped (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CARD_WITHOUT_METADATA)


_ONCE = OncePerRun()
_BANNER = DeepSpeedBanner()
_CARD = CardWithoutMetadata()


def install() -> None:
    """Attach the filters (idempotent). DeepSpeed's logger is made here if DeepSpeed has not made it yet: it sets its
    level and handler on import and keeps the filters."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _ONCE not in logger.filters:
            logger.addFilter(_ONCE)
    deepspeed = logging.getLogger(DEEPSPEED_LOGGER)
    if _BANNER not in deepspeed.filters:
        deepspeed.addFilter(_BANNER)
    card = logging.getLogger(CARD_LOGGER)
    if _CARD not in card.filters:
        card.addFilter(_CARD)


_held = False  # a run begun by a command (pf-trl train): the trainer it builds is part of it


def start_run(*, command: bool = False) -> None:
    """A new run: the filters installed, the warnings said so far forgotten. ``command``: a command line begins it
    (its trainer does not begin another, so a warning said while loading its data is not said again by the trainer);
    :func:`end_command` ends it."""
    global _held
    install()
    if command or not _held:
        _ONCE.seen.clear()
    _held = _held or command


def end_command() -> None:
    """The command that began the run is done: the next trainer begins a run of its own."""
    global _held
    _held = False
