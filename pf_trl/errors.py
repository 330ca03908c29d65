"""The root of pf-trl's exceptions.

Every error that pf-trl or its preprocessing service raises on purpose (a refused option, unreadable data, a model
pf-trl cannot make padding-free, a checkpoint that does not fit the run, a service job that failed) is a
:class:`PfTrlError`, so ``except PfTrlError`` catches exactly pf-trl's own refusals and lets upstream errors and bugs
through. Each class also keeps the builtin base it had before the root existed (``ValueError`` for bad input,
``RuntimeError`` for a missing backend, ...), so code that catches those keeps working.

This module imports nothing: the sampler, the CLI's argument checks and the service import it without pulling in
torch or transformers. ``tests/test_errors.py`` walks both packages and fails on an exception class outside the root.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ModelSupportError", "PfTrlError", "ResumeError", "TrainingDataError"]


class PfTrlError(Exception):
    """Base class of every exception pf-trl and ``preprocess_service`` raise on purpose."""


class PackingError(PfTrlError, ValueError):
    """A packed batch, or the input to one, that does not describe its examples consistently: an empty batch or
    example, labels or token types of the wrong length, ``cu_seq_lens`` / ``position_ids`` that do not partition the
    row (:mod:`pf_trl.batching.packing`, :mod:`pf_trl.batching.collator`)."""


class AttentionArgumentError(PfTrlError, ValueError):
    """An argument ``varlen_attention`` cannot take: an unknown backend name, q/k/v or ``cu_seqlens`` shapes that do
    not fit, a sliding window below 1, a negative softcap, sinks of the wrong size
    (:mod:`pf_trl.attention.dispatch`)."""
# The trainer's and the parallelism checks' own refusals (pf_trl.trainer, pf_trl.parallel). Other packages keep
# their classes next to the code that raises them (pf_trl.data.*, pf_trl.attention.errors, the CLIs).


class ConfigError(PfTrlError, ValueError):
    """A training option, or a combination of options, that pf-trl refuses: out of range, or not reproducible
    exactly on packed rows (named in the message)."""


class ModelSupportError(PfTrlError, ValueError):
    """A model whose loss pf-trl cannot compute at the supervised positions only (no backbone, no output embeddings,
    logits it cannot reproduce): train it padded (``padding_free=False``)."""


class TrainingDataError(PfTrlError, ValueError):
    """Data the trainer cannot train on as given (no ``input_ids`` column, no dataset, rows a limit would remove
    from a mixture)."""


class ResumeError(PfTrlError, ValueError):
    """A checkpoint that does not fit the run resumed from it (other data, accumulation steps, ranks or budget)."""
