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

__all__ = ["PfTrlError"]


class PfTrlError(Exception):
    """Base class of every exception pf-trl and ``preprocess_service`` raise on purpose."""
