"""Examples longer than the sequence limit, as TRL's ``SFTTrainer`` treats them, and the count the user sees.

TRL 1.16 (``SFTTrainer._prepare_dataset``) builds ``labels`` from the mask columns first, then cuts every row to
``max_length`` tokens (``input_ids`` and ``labels`` alike): ``truncation_mode="keep_start"`` keeps the first
``max_length`` tokens, ``"keep_end"`` the last. It then drops every example left without a supervised label
(``labels`` all -100), since it contributes no loss. pf-trl does the same, in ``pf-trl pretokenize`` (per row) and in
:class:`~pf_trl.trainer.PaddingFreeSFTTrainer` (tokenized rows it is given), under a *policy*:

- ``truncate`` (the default, TRL's behaviour): cut as above;
- ``drop``: leave the example out instead;
- ``refuse``: stop with an error naming how many examples are too long and the first one.

Whatever the policy, the :class:`TruncationReport` counts what was cut and how many supervised tokens were lost, and
:meth:`TruncationReport.summary` says it in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pf_trl.data.labels import IGNORE_INDEX
from pf_trl.errors import PfTrlError

TRUNCATION_POLICIES = ("truncate", "drop", "refuse")
TRUNCATION_MODES = ("keep_start", "keep_end")
DEFAULT_POLICY = "truncate"
POLICY_HELP = (
    "What to do with an example longer than the sequence limit: 'truncate' (default, as TRL: keep max_length "
    "tokens, which ones set by truncation_mode), 'drop' (leave it out) or 'refuse' (stop with an error). The number "
    "cut and the supervised tokens lost are printed either way."
)
# Accepted spellings of a policy (older pf-trl versions called `refuse` `error`).
_POLICY_ALIASES = {"error": "refuse"}


class TruncationRefused(PfTrlError, ValueError):
    """Examples are longer than the limit and the policy is ``refuse``; the message names them and the fix."""


def normalize_policy(value: str) -> str:
    """``truncate`` | ``drop`` | ``refuse`` (``error`` is accepted for ``refuse``); ValueError otherwise."""
    policy = _POLICY_ALIASES.get(str(value), str(value))
    if policy not in TRUNCATION_POLICIES:
        raise ValueError(f"truncation policy {value!r} is unknown; use one of {', '.join(TRUNCATION_POLICIES)}")
    return policy


def check_mode(mode: str) -> str:
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode {mode!r} is unknown; use {' or '.join(TRUNCATION_MODES)} (as TRL)")
    return mode


def cut(ids: Sequence[int], labels: Sequence[int], max_length: int, mode: str) -> tuple[list[int], list[int]]:
    """``ids`` / ``labels`` cut to ``max_length`` tokens as TRL cuts them (``keep_start``: the first, ``keep_end``: the
    last)."""
    if len(ids) <= max_length:
        return list(ids), list(labels)
    window = slice(None, max_length) if mode == "keep_start" else slice(len(ids) - max_length, None)
    return list(ids[window]), list(labels[window])


@dataclass
class TruncationReport:
    """What the sequence limit did to a dataset.

    Attributes:
        examples: examples looked at.
        too_long: examples longer than the limit.
        truncated: examples cut (policy ``truncate``).
        dropped_too_long: examples left out because they were too long (policy ``drop``).
        loss_tokens_lost: supervised tokens (labels other than -100) removed by cutting or dropping.
        lost_at_least: ``loss_tokens_lost`` is a lower bound (a text far longer than the limit was tokenized only as
            far as the limit needs, so the tokens beyond were never counted).
        dropped_no_loss: examples left without a supervised token, dropped (TRL drops them too).
        max_length, mode, policy: the limit applied.
    """

    examples: int = 0
    too_long: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    loss_tokens_lost: int = 0
    dropped_no_loss: int = 0
    max_length: int | None = None
    mode: str = "keep_start"
    policy: str = DEFAULT_POLICY
    lost_at_least: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def kept(self) -> int:
        return self.examples - self.dropped_too_long - self.dropped_no_loss

    def summary(self, what: str = "training data", limit_name: str = "max_length") -> str | None:
        """One line for the user when anything was cut or dropped, else None."""
        parts = []
        if self.truncated:
            parts.append(f"{self.truncated} of {self.examples} examples were longer than {limit_name} {self.max_length} "
                         f"and were cut ({self.mode})")
        if self.dropped_too_long:
            parts.append(f"{self.dropped_too_long} of {self.examples} examples longer than {limit_name} "
                         f"{self.max_length} were dropped (truncation policy 'drop')")
        if self.truncated or self.dropped_too_long:
            parts.append(f"{'at least ' if self.lost_at_least else ''}{self.loss_tokens_lost} supervised tokens lost")
        if self.dropped_no_loss:
            parts.append(f"{self.dropped_no_loss} examples without a supervised token were dropped (as TRL does)")
        if not parts:
            return None
        hint = ""
        if self.truncated or self.dropped_too_long:
            hint = f"; raise {limit_name} or choose the truncation policy (truncate | drop | refuse)"
        return f"{what}: " + "; ".join(parts) + hint

    def refusal(self, first_index: int, first_length: int, limit_name: str = "max_length", *,
                at_least: bool = False) -> str:
        return (f"{self.too_long} of {self.examples} examples are longer than {limit_name} {self.max_length} (first: "
                f"row {first_index}, {'more than ' if at_least else ''}{first_length} tokens) and the truncation policy is 'refuse'; raise {limit_name}, "
                "or choose truncation 'truncate' (TRL's behaviour) or 'drop'")


def report_from_manifest(manifest: dict[str, Any]) -> TruncationReport:
    """The :class:`TruncationReport` of a shards directory, from the counts its manifest keeps."""
    counts = manifest.get("counts") or {}
    options = manifest.get("options") or {}
    dropped_too_long = int(counts.get("dropped_too_long", 0))
    too_long = int(counts.get("too_long", int(counts.get("truncated", 0)) + dropped_too_long))
    return TruncationReport(
        examples=int(counts.get("source_rows", counts.get("examples", 0))),
        too_long=too_long,
        truncated=too_long - dropped_too_long,  # every row cut, also those then dropped for having no loss left
        dropped_too_long=int(counts.get("dropped_too_long", 0)),
        loss_tokens_lost=int(counts.get("loss_tokens_lost", 0)),
        lost_at_least=bool(counts.get("loss_tokens_lost_at_least", False)),
        dropped_no_loss=int(counts.get("dropped_no_loss", 0)),
        max_length=manifest.get("max_seq_len"),
        mode=options.get("truncation_mode", "keep_start"),
        policy=manifest.get("truncation", "truncate"),
    )


def _row_spans(offsets: np.ndarray, lengths: np.ndarray, max_length: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """[start, stop) of the kept tokens of each row, as positions in the flattened column."""
    keep = np.minimum(lengths, max_length)
    if mode == "keep_start":
        return offsets[:-1], offsets[:-1] + keep
    return offsets[1:] - keep, offsets[1:]


def scan_table(table, *, max_length: int | None, mode: str, row_offset: int = 0) -> dict[str, np.ndarray]:
    """Per-row lengths, supervised tokens, and supervised tokens kept under the limit, for one Arrow table with an
    ``input_ids`` column (and ``labels``: without it every token is supervised, as the collator does)."""
    import pyarrow.compute as pc

    ids = table.column("input_ids").combine_chunks()
    lengths = np.asarray(pc.list_value_length(ids).to_numpy(zero_copy_only=False), dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if "labels" in table.column_names:
        labels = table.column("labels").combine_chunks()
        label_lengths = np.asarray(pc.list_value_length(labels).to_numpy(zero_copy_only=False))
        bad = np.flatnonzero(label_lengths != lengths)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"row {row_offset + i}: labels has {label_lengths[i]} tokens but input_ids has "
                             f"{lengths[i]}; labels must be as long as input_ids (-100 where no loss)")
        flat = np.asarray(pc.list_flatten(labels).to_numpy(zero_copy_only=False))
        supervised_flat = (flat != IGNORE_INDEX).astype(np.int64)
    else:
        supervised_flat = np.ones(int(offsets[-1]), dtype=np.int64)
    cumulative = np.zeros(len(supervised_flat) + 1, dtype=np.int64)
    np.cumsum(supervised_flat, out=cumulative[1:])
    supervised = cumulative[offsets[1:]] - cumulative[offsets[:-1]]
    if max_length is None:
        kept = supervised
    else:
        start, stop = _row_spans(offsets, lengths, max_length, mode)
        kept = cumulative[stop] - cumulative[start]
    return {"lengths": lengths, "supervised": supervised, "kept": kept}


def truncate_dataset(dataset, *, max_length: int | None, mode: str = "keep_start", policy: str = DEFAULT_POLICY,
                     drop_no_loss: bool = True, batch_rows: int = 16384, what: str = "training data",
                     cache_file_name: str | None = None):
    """Apply the sequence limit to a tokenized ``datasets.Dataset`` as TRL does; return ``(dataset, report)``.

    ``input_ids`` and ``labels`` are cut (``length`` is rewritten when present); with ``drop_no_loss`` examples left
    without a supervised label are dropped, as TRL does whenever ``max_length`` is set. ``max_length=None`` applies
    no limit and drops nothing (TRL likewise). The dataset is returned unchanged (the same object) when nothing
    needs doing; the scan reads the columns through Arrow in batches (no Python pass over tokens).
    ``cache_file_name``: where ``datasets`` writes the cut rows of a memory-mapped dataset (by default it writes next
    to the dataset's own files).

    Raises:
        TruncationRefused: an example is too long and ``policy`` is ``refuse``.
    """
    policy = normalize_policy(policy)
    check_mode(mode)
    report = TruncationReport(examples=len(dataset), max_length=max_length, mode=mode, policy=policy)
    if max_length is None or len(dataset) == 0:
        return dataset, report
    columns = [c for c in ("input_ids", "labels") if c in dataset.column_names]
    lengths_parts, drop_parts, cut_parts = [], [], []
    first_long: tuple[int, int] | None = None
    base = 0
    for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=batch_rows):
        scan = scan_table(table, max_length=max_length, mode=mode, row_offset=base)
        long = scan["lengths"] > max_length
        if first_long is None and long.any():
            i = int(np.flatnonzero(long)[0])
            first_long = (base + i, int(scan["lengths"][i]))
        report.too_long += int(long.sum())
        if policy == "truncate":
            report.loss_tokens_lost += int((scan["supervised"] - scan["kept"])[long].sum())
            left = scan["kept"]
            drop = np.zeros(len(long), dtype=bool)
        else:
            report.loss_tokens_lost += int(scan["supervised"][long].sum())
            left = np.where(long, 1, scan["supervised"])  # a dropped long row is counted as too long, not no-loss
            drop = long.copy()
        no_loss = (left == 0) & ~drop if drop_no_loss else np.zeros(len(long), dtype=bool)
        report.dropped_no_loss += int(no_loss.sum())
        drop_parts.append(drop | no_loss)
        cut_parts.append(long & (policy == "truncate"))
        lengths_parts.append(scan["lengths"])
        base += len(long)
    if policy == "refuse" and report.too_long:
        raise TruncationRefused(report.refusal(*first_long))
    if policy == "drop":
        report.dropped_too_long = report.too_long
    cut_rows = np.concatenate(cut_parts)
    drop_rows = np.concatenate(drop_parts)
    report.truncated = int(cut_rows.sum())
    if report.truncated:
        dataset = dataset.map(_cut_batch, batched=True, fn_kwargs={"max_length": max_length, "mode": mode},
                              cache_file_name=cache_file_name, load_from_cache_file=False,
                              desc=f"pf-trl: {what}: truncating to {max_length} ({mode})")
    if drop_rows.any():
        dataset = dataset.select(np.flatnonzero(~drop_rows))
    return dataset, report


def _cut_batch(batch: dict[str, list], *, max_length: int, mode: str) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": []}
    has_labels = "labels" in batch
    if has_labels:
        out["labels"] = []
    for pos, ids in enumerate(batch["input_ids"]):
        labels = batch["labels"][pos] if has_labels else ids
        ids, labels = cut(ids, labels, max_length, mode)
        out["input_ids"].append(ids)
        if has_labels:
            out["labels"].append(labels)
    if "length" in batch:
        out["length"] = [len(ids) for ids in out["input_ids"]]
    return out
