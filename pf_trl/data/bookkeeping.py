"""The bookkeeping columns of a tokenizing pass: why a row is dropped, whether it was cut, its supervised tokens.

Every tokenizing path (text rows in :mod:`pf_trl.data.pretokenize` and :mod:`pf_trl.data.streaming`, vision rows in
:mod:`pf_trl.data.vision`) writes the same columns next to ``input_ids`` / ``labels`` / ``length``; pretokenize reads
them to report and apply the truncation policy, then removes them. They are declared here, below those modules, so
that each writes them without importing the others.
"""

from __future__ import annotations

from typing import Any

from pf_trl.data.formats import IGNORE_INDEX

# Why a row is not kept (the `_drop` column).
KEEP, TOO_LONG, NO_LOSS = 0, 1, 2


# column -> its Arrow type: why a row is dropped, whether it was cut, its supervised tokens and those lost, whether
# it was tokenized from a prefix
_COLUMNS = {"_drop": "int8", "_truncated": "bool", "_loss": "int32", "_lost": "int32", "_cut": "bool"}
BOOKKEEPING_COLUMNS = tuple(_COLUMNS)  # removed before rows reach a trainer or a shard


def bookkeeping_features() -> dict:
    """The ``datasets`` features of the columns that exist only while processing; every tokenizing path writes them."""
    from datasets import Value

    return {name: Value(dtype) for name, dtype in _COLUMNS.items()}


def new_batch(*extra: str) -> dict[str, list]:
    """Empty output columns of one tokenized batch: the shard columns, ``extra`` ones, then the bookkeeping."""
    return {name: [] for name in ("input_ids", "labels", "length", *extra, *_COLUMNS)}


def supervised(labels: list[int]) -> int:
    """How many tokens of ``labels`` carry a loss."""
    return len(labels) - labels.count(IGNORE_INDEX)


def append_row(out: dict[str, list], ids: list[int], labels: list[int], *, drop: int, truncated: bool, before: int,
               drop_no_loss: bool, cut: bool, **extra: Any) -> None:
    """Append one tokenized row to ``out``: ``before`` is its supervised tokens before the truncation policy; a kept
    row left without any is dropped when ``drop_no_loss`` (as TRL); ``cut``: tokenized from a prefix only (its length
    and lost tokens are lower bounds); ``extra``: values of the batch's extra columns."""
    loss = supervised(labels)
    if drop == KEEP and loss == 0 and drop_no_loss:
        drop = NO_LOSS
    out["input_ids"].append(ids)
    out["labels"].append(labels)
    out["length"].append(len(ids))
    for name, value in extra.items():
        out[name].append(value)
    out["_drop"].append(drop)
    out["_truncated"].append(truncated)
    out["_loss"].append(loss)
    out["_lost"].append(before if drop == TOO_LONG else before - loss)
    out["_cut"].append(cut)
