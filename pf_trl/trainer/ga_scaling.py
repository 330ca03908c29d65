"""Telling transformers' Trainer that ``compute_loss`` already scaled the loss for gradient accumulation, on every
supported transformers (``>=5.0``).

transformers 5.19 and later read ``Trainer.loss_is_scaled_for_ga`` in ``training_step``. Earlier 5.x versions read
only ``model_accepts_loss_kwargs`` and ``compute_loss_func`` (the loss counts as scaled when the model took
``num_items_in_batch`` or a ``compute_loss_func`` is set); TRL's base trainer bridges the two right after
``Trainer.__init__``: when ``loss_is_scaled_for_ga`` is ``True`` there, it sets ``model_accepts_loss_kwargs=False``
and puts a marker string in ``compute_loss_func``. So the attribute must be set *before* ``super().__init__()``
(:func:`declare_loss_scaled_for_ga`); set afterwards, only 5.19+ sees it and older versions divide the loss and the
gradient by the accumulation steps once more.
"""

from __future__ import annotations

from typing import Any

__all__ = ["declare_loss_scaled_for_ga", "restore_compute_loss_func"]


def declare_loss_scaled_for_ga(trainer: Any, scaled: bool = True) -> None:
    """Set ``loss_is_scaled_for_ga`` on ``trainer``; call it before ``super().__init__()`` (see the module
    docstring)."""
    trainer.loss_is_scaled_for_ga = bool(scaled)


def restore_compute_loss_func(trainer: Any, compute_loss_func: Any) -> None:
    """After ``super().__init__()``, for a trainer whose ``compute_loss`` calls ``compute_loss_func`` itself: on
    transformers < 5.19 TRL's bridge left a marker string there (not callable). Put the caller's function back and
    keep the older Trainer's rule true through ``model_accepts_loss_kwargs`` (the loss is divided by
    ``num_items_in_batch``, which the trainer counts for every micro-batch)."""
    if isinstance(getattr(trainer, "compute_loss_func", None), str):
        trainer.compute_loss_func = compute_loss_func
        trainer.model_accepts_loss_kwargs = True
