"""pretokenize(): the only tokenization code in pf-trl. The CLI and the service both call it.

Source (JSON / JSONL / Parquet / CSV file, a ``load_from_disk`` directory, or a ``datasets.Dataset`` /
``DatasetDict`` in memory) -> format rendering ->
tokenization (batched ``datasets.map``, fast tokenizer, optional worker processes) -> truncation
policy -> a shards directory (see ``shards.py``) written atomically: everything goes to a temporary
sibling directory that is renamed into place at the end, so a failed run leaves nothing behind and an
existing output is never touched unless ``overwrite=True``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pf_trl._compat import dataset_fingerprint, dataset_indices
from pf_trl._version import __version__
from pf_trl.data import formats, identity
from pf_trl.data.bookkeeping import (
    BOOKKEEPING_COLUMNS,
    KEEP,
    NO_LOSS,
    TOO_LONG,
    append_row,
    bookkeeping_features,
    new_batch,
    supervised,
)
from pf_trl.data.formats import FormatError
from pf_trl.data.options import TRUNCATION_POLICIES, PretokenizeConfig, PretokenizeError  # noqa: F401 (re-exported)
from pf_trl.data.processor import is_processor
from pf_trl.data.scan import first_bad_line
from pf_trl.data.shards import FORMAT_VERSION, length_stats, shard_features, write_manifest
from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer, tokenizer_fingerprint, with_chat_template
from pf_trl.data.truncation import TRUNCATION_MODES, TruncationReport, cut  # noqa: F401 (TRUNCATION_MODES re-exported)

if TYPE_CHECKING:
    from pf_trl.data.source_limits import SourceLimits

logger = logging.getLogger(__name__)

# Formats rendered with the chat template (it writes its own BOS / EOS).
CHAT_FORMATS = ("messages", "sharegpt", "conversational_prompt_completion")
SOURCE_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

ProgressCallback = Callable[[int, int, int], None]
"""Called as ``progress(rows_done, rows_total, tokens_done)`` after each chunk."""


# ----------------------------------------------------------------------------------------- source


def source_fingerprint(source: Any) -> str:
    """sha256 of the source bytes (a directory: every file under it, by relative path); for a ``datasets.Dataset``
    in memory, a sha256 of datasets' own content fingerprint (``Dataset._fingerprint``)."""
    fingerprint = _dataset_fingerprint(source)
    if fingerprint is not None:
        return fingerprint
    path = Path(source)
    if path.is_dir():
        _checked_source_files(path)  # every data file it names lies inside it, so hashing the folder covers them
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():  # a single file is its bytes alone: the same data under another name is the same
            digest.update(str(f.relative_to(path)).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _checked_source_files(path: Path) -> list[Path]:
    """:func:`pf_trl.data.source_files.check_source_files`, its refusal as a PretokenizeError."""
    from pf_trl.data.source_files import SourceFileError, check_source_files

    try:
        return check_source_files(path)
    except SourceFileError as exc:
        raise PretokenizeError(f"source {path}: {exc}") from None


def _dataset_fingerprint(source: Any) -> str | None:
    """A content address for an in-memory ``Dataset`` / ``DatasetDict`` (None for paths)."""
    if isinstance(source, (str, os.PathLike)):
        return None
    import datasets

    if isinstance(source, datasets.DatasetDict):
        source = _train_split(source, "the DatasetDict")
    if not isinstance(source, datasets.Dataset):
        raise PretokenizeError(
            f"source must be a path, a datasets.Dataset or a DatasetDict, got {type(source).__name__}"
        )
    # datasets derives _fingerprint from the data (in-memory tables are hashed) and every transform applied to it
    return hashlib.sha256(f"datasets.Dataset:{dataset_fingerprint(source)}".encode()).hexdigest()


def _train_split(ds, where: str):
    if "train" not in ds:
        raise PretokenizeError(f"{where} has no 'train' split (splits: {list(ds)}); pass the split to use, e.g. ds['train']")
    return ds["train"]


def _hub_record(source: Any) -> dict[str, Any] | None:
    from pf_trl.hub import origin_of

    found = origin_of(source) if isinstance(source, (str, os.PathLike)) else None
    return found.record() if found else None


def describe_source(source: Any) -> str:
    """A path, or ``datasets.Dataset(<rows> rows, fingerprint ...)`` for a dataset in memory."""
    if isinstance(source, (str, os.PathLike)):
        return str(Path(source).resolve())
    rows = getattr(source, "num_rows", None)
    return f"datasets.{type(source).__name__}({rows} rows, fingerprint {dataset_fingerprint(source)})"


@contextlib.contextmanager
def _reader_logs_silenced():
    """datasets' packaged readers log a parse failure before raising it; the raised error is reported instead (with
    the line number counted from 1, as editors count)."""
    loggers = [logging.getLogger(f"datasets.packaged_modules.{name}.{name}") for name in ("json", "csv", "parquet")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def load_source(source: Any, work_dir: Path):
    """Open a source as a ``datasets.Dataset``: a local file or ``save_to_disk`` directory (the datasets cache goes
    to ``work_dir``), or a ``Dataset`` / ``DatasetDict`` (its ``train`` split) as is."""
    import datasets

    if isinstance(source, datasets.DatasetDict):
        source = _train_split(source, "the DatasetDict")
    if isinstance(source, datasets.Dataset):
        if source.num_rows == 0:
            raise PretokenizeError("the dataset has no rows")
        return source
    path = Path(source)
    if not path.exists():
        raise PretokenizeError(f"source {path} does not exist")
    _checked_source_files(path)  # nothing outside the source is opened
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise PretokenizeError(
                f"source directory {path} is not a `datasets.save_to_disk` directory ({exc}); pass a JSON, "
                "JSONL, Parquet or CSV file, or such a directory"
            ) from exc
        if isinstance(ds, datasets.DatasetDict):
            ds = _train_split(ds, f"source {path}")
        return ds
    builder = SOURCE_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise PretokenizeError(
            f"source {path} has suffix {path.suffix!r}; supported: {', '.join(sorted(SOURCE_SUFFIXES))} or a directory"
        )
    if path.stat().st_size == 0:
        raise PretokenizeError(f"source {path} is empty (0 bytes)")
    try:
        with _reader_logs_silenced():  # its "... in row 56" log line would precede our numbered one
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(work_dir / "hf-cache"))
    except Exception as exc:
        where = first_bad_line(path) if builder == "json" else None  # the reader does not say which line
        detail = where or (str(exc).splitlines() or [type(exc).__name__])[0]
        raise PretokenizeError(f"cannot read {path} as {builder}: {detail}") from exc
    if ds.num_rows == 0:
        raise PretokenizeError(f"source {path} has no rows")
    return ds


# ------------------------------------------------------------------------------------- tokenizing


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer,
    input_format: str,
    config: PretokenizeConfig,
    index_offset: int,
) -> pa.Table:
    """datasets.map function: one batch of source rows -> token rows plus bookkeeping columns."""
    indices = [i + index_offset for i in indices]  # row numbers of the source, for error messages
    fields = config.fields
    if input_format == "pretokenized":
        mask_columns = formats.MASK_COLUMNS if config.completion_only_loss else ("assistant_masks",)
        ids_list, labels_list = formats.read_pretokenized(batch, indices, fields, len(tokenizer), mask_columns)
        cut_rows = [False] * len(ids_list)
    else:
        chat = input_format in CHAT_FORMATS
        if input_format == "text":
            texts, spans = formats.render_text(batch, indices, fields, config.response_template)
        elif input_format == "prompt_completion":
            texts, spans = formats.render_prompt_completion(batch, indices, fields)
            if not config.completion_only_loss:
                spans = [[(0, len(t))] for t in texts]
        elif input_format == "alpaca":
            texts, spans = formats.render_alpaca(batch, indices, fields)
        elif input_format == "conversational_prompt_completion":
            texts, spans = formats.render_conversational_prompt_completion(
                tokenizer, batch, indices, fields, completion_only_loss=config.completion_only_loss)
        else:
            column = fields.conversations if input_format == "sharegpt" else fields.messages
            # assistant_only_loss=False (TRL's default there): every token of the conversation
            texts, spans = formats.render_messages(tokenizer, batch, indices, fields, column=column,
                                                   supervise_all=not config.assistant_only_loss)
        # Chat templates write their own special tokens; the other formats get the tokenizer's BOS.
        # a text far longer than max_seq_len is tokenized only as far as its first max_seq_len tokens need (bounded
        # time and memory for any row); keep_end needs the end of the text, so it tokenizes the whole text
        cap = config.max_seq_len if config.truncation_mode == "keep_start" else None
        ids_list, labels_list, cut_rows = formats.encode_spans_capped(tokenizer, texts, spans, add_special_tokens=not chat,
                                                               max_tokens=cap)
        if config.add_eos and not chat and tokenizer.eos_token_id is not None:
            eos = tokenizer.eos_token_id
            for ids, labels in zip(ids_list, labels_list):
                ids.append(eos)
                labels.append(eos)

    out = new_batch()
    for ids, labels, was_cut in zip(ids_list, labels_list, cut_rows):
        drop, truncated = KEEP, False
        before = supervised(labels)
        if len(ids) > config.max_seq_len:
            if config.truncation == "truncate":
                ids, labels = cut(ids, labels, config.max_seq_len, config.truncation_mode)
                truncated = True
            else:  # drop, or refuse (refused after the scan, with the count of every row too long)
                drop = TOO_LONG
        append_row(out, ids, labels, drop=drop, truncated=truncated, before=before, drop_no_loss=config.drop_no_loss,
                   cut=was_cut)
    # An Arrow table, not a dict: datasets then writes it as is instead of converting every list element
    # through its own typed-sequence path (a quarter of the non-tokenizer time).
    return pa.Table.from_pydict(out, schema=_processing_schema())


def resolve_format(ds, config: PretokenizeConfig) -> str:
    """The input format of ``ds``: ``config.input_format``, or detected from its columns when ``auto``
    (``vision`` for TRL's vision-language format: an ``images`` / ``image`` column, see :mod:`pf_trl.data.vision`)."""
    from pf_trl.data.vision import image_column

    fields = config.fields
    input_format = config.input_format
    column = image_column(ds.column_names)
    if column is not None:
        if input_format != "auto":
            raise PretokenizeError(f"the source has an {column!r} column (vision-language rows); input_format "
                                   f"{input_format!r} would drop its images: use input_format 'auto'")
        return "vision"
    if input_format == "auto":
        first = ds[0] if ds.num_rows else None
        input_format = formats.detect_format(ds.column_names, fields, config.response_template, first)
    if config.input_format == "auto":
        _refuse_mixed_formats(ds, input_format, config)
    missing = [c for c in formats.required_columns(input_format, fields) if c not in ds.column_names]
    if missing:
        raise PretokenizeError(
            f"format {input_format!r} needs column(s) {missing}, but the source has {ds.column_names}; "
            "name them with the matching field option (--text_field, --prompt_field, --instruction_field, ...) "
            "or pass another --input_format"
        )
    return input_format


def _refuse_mixed_formats(ds, input_format: str, config: PretokenizeConfig) -> None:
    """Rows of different formats in one table (``concatenate_datasets`` of an Alpaca and a ShareGPT file: the
    columns are the union, each row fills its own) cannot be tokenized with one format: refuse, naming a row of each."""
    import pyarrow.compute as pc

    table = getattr(ds, "data", None)
    needed = [c for c in formats.required_columns(input_format, config.fields) if c in ds.column_names]
    if table is None or not needed or dataset_indices(ds) is not None:
        return
    for column in needed:
        nulls = pc.is_null(table.column(column))
        if not pc.any(nulls).as_py():
            continue
        bad = int(pc.index(nulls, True).as_py())
        good = int(pc.index(nulls, False).as_py())
        row = {k: v for k, v in ds[bad].items() if v is not None}
        try:
            other = formats.detect_format(list(row), config.fields, config.response_template, row)
        except FormatError:
            return  # a broken row, not another format: the row's own error says what is wrong
        if other == input_format:
            return
        raise PretokenizeError(
            f"the rows mix input formats: row {good} is {input_format!r} but row {bad} has no {column!r} and reads as "
            f"{other!r} (e.g. datasets.concatenate_datasets of files in different formats); tokenize each format as "
            "its own source: pass a list of sources or a data config (docs/data.md, Mixtures), which keeps each "
            "source's format"
        )


_resolve_format = resolve_format


@dataclass
class _ChunkJob:
    """Everything a worker needs to tokenize one chunk (inherited by forked workers, never pickled)."""

    dataset: Any
    tokenizer: Any
    input_format: str
    config: PretokenizeConfig
    work: Path
    vision: Any = None  # a pf_trl.data.vision.VisionTokenizer for a source with images

    def __call__(self, bounds: tuple[int, int]) -> tuple[int, int, str, int]:
        start, stop = bounds
        chunk = self.dataset.select(range(start, stop))
        path = str(self.work / f"chunk-{start:012d}.arrow")
        if self.vision is not None:
            from pf_trl.data import vision

            function, features = vision.tokenize_batch, vision.processing_features(self.vision.token_type_key)
            fn_kwargs = {"vision": self.vision, "config": self.config, "index_offset": start}
        else:
            function, features = _tokenize_batch, _processing_features()
            fn_kwargs = {"tokenizer": _text_tokenizer(self.tokenizer), "input_format": self.input_format,
                         "config": self.config, "index_offset": start}
        mapped = chunk.map(
            function,
            with_indices=True,
            batched=True,
            batch_size=256,
            remove_columns=chunk.column_names,
            fn_kwargs=fn_kwargs,
            features=features,
            load_from_cache_file=False,
            cache_file_name=path,
            new_fingerprint=f"pf-{start}",
        )
        return start, stop, path, int(np.asarray(mapped.data.column("length")).sum())


@dataclass
class TokenizedRows:
    """Tokenized rows with their bookkeeping resolved: the rows kept (bookkeeping columns removed, an index mapping
    over ``full``), their keep mask and lengths, the manifest's ``counts`` and the truncation report."""

    kept: Any
    keep: np.ndarray
    lengths: np.ndarray
    counts: dict[str, Any]
    report: TruncationReport


def summarize_tokenized(full, config: PretokenizeConfig, rows_total: int, index_offset: int = 0) -> TokenizedRows:
    """Resolve the bookkeeping columns of tokenized rows (``full``: what :class:`_ChunkJob` wrote, in source order):
    which rows stay, the counts, and the ``refuse`` policy's refusal (naming source row ``index_offset + i``).
    Both engines call it (the single-process one on all rows, the Ray engine on each part's)."""
    drop = np.asarray(full.data.column("_drop"))
    truncated = np.asarray(full.data.column("_truncated"))
    loss = np.asarray(full.data.column("_loss"))
    lost = np.asarray(full.data.column("_lost"), dtype=np.int64)
    prefix_only = np.asarray(full.data.column("_cut"), dtype=bool)
    keep = drop == KEEP
    too_long = drop == TOO_LONG
    report = TruncationReport(
        examples=rows_total, too_long=int(too_long.sum()) + int(truncated.sum()), truncated=int(truncated.sum()),
        dropped_too_long=int(too_long.sum()), loss_tokens_lost=int(lost.sum()),
        dropped_no_loss=int((drop == NO_LOSS).sum()), max_length=config.max_seq_len,
        mode=config.truncation_mode, policy=config.truncation, lost_at_least=bool(prefix_only.any()))
    if config.truncation == "refuse" and too_long.any():
        first = int(np.flatnonzero(too_long)[0])
        raise PretokenizeError(report.refusal(index_offset + first, int(np.asarray(full.data.column("length"))[first]),
                                              limit_name="max_seq_len", at_least=bool(prefix_only[first])))
    # An index mapping, not a rewrite: save_to_disk writes the kept rows once.
    kept = full.select(np.flatnonzero(keep)) if not keep.all() else full
    kept = kept.remove_columns(list(BOOKKEEPING_COLUMNS))
    # `.data` is the table before the filter's index mapping: select the kept rows ourselves.
    lengths = np.asarray(full.data.column("length"))[keep]
    counts = {
        "source_rows": rows_total,
        "examples": int(kept.num_rows),
        "tokens": int(lengths.sum()),
        "loss_tokens": int(loss[keep].sum()),
        "truncated": int(truncated[keep].sum()),
        "too_long": report.too_long,  # cut (kept or then dropped without loss) or dropped for their length
        "loss_tokens_lost": report.loss_tokens_lost,
        "loss_tokens_lost_at_least": report.lost_at_least,
        "dropped": int((~keep).sum()),
        "dropped_too_long": int((drop == TOO_LONG).sum()),
        "dropped_no_loss": int((drop == NO_LOSS).sum()),
    }
    return TokenizedRows(kept=kept, keep=keep, lengths=lengths, counts=counts, report=report)


_FORKED_JOB: _ChunkJob | None = None


def _run_forked_chunk(bounds: tuple[int, int]) -> tuple[int, int, str, int]:
    assert _FORKED_JOB is not None
    return _FORKED_JOB(bounds)


def _run_chunks(job: _ChunkJob, bounds: list[tuple[int, int]], num_proc: int):
    """Yield finished chunks; with num_proc > 1 one process pool serves the whole call.

    One pool for all chunks, not ``datasets.map(num_proc=...)`` per chunk: that starts a new pool each
    time, which made 2 processes slower than 1. Workers are forked so they share the memory-mapped source
    and the loaded tokenizer without pickling either.
    """
    import multiprocessing

    if num_proc == 1 or len(bounds) == 1 or "fork" not in multiprocessing.get_all_start_methods():
        for b in bounds:
            yield job(b)
        return
    global _FORKED_JOB
    _FORKED_JOB = job
    try:
        with multiprocessing.get_context("fork").Pool(min(num_proc, len(bounds))) as pool:
            yield from pool.imap_unordered(_run_forked_chunk, bounds)
    finally:
        _FORKED_JOB = None


def pretokenize(
    source: Any,
    output_dir: str | Path,
    config: PretokenizeConfig | None = None,
    *,
    tokenizer: Any = DEFAULT_TOKENIZER,
    num_proc: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    progress_callback: ProgressCallback | None = None,
    source_fingerprint_value: str | None = None,
    limits: SourceLimits | None = None,
    image_roots: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Tokenize ``source`` into a shards directory at ``output_dir`` and return its manifest (in this process and
    ``num_proc`` forked workers; :func:`pf_trl.pretokenize` also takes ``engine="ray"``, :mod:`pf_trl.data.engines`).

    Args:
        source: JSON / JSONL / Parquet / CSV file, a ``datasets.save_to_disk`` directory, or a ``datasets.Dataset``
            / ``DatasetDict`` (its ``train`` split).
        output_dir: the shards directory to create (must not exist unless ``overwrite``), or a bucket URI
            (``s3://BUCKET/datasets/NAME``: written into ``$PF_TRL_CACHE/staging`` then uploaded, manifest last).
        config: formats, lengths, truncation and chat template (:class:`PretokenizeConfig`).
        tokenizer: an embedded name, a local folder, or a loaded fast tokenizer (``config.chat_template``, when set,
            replaces its template for this call; the tokenizer object itself is not changed).
        num_proc: tokenizer worker processes for ``datasets.map``.
        overwrite: replace an existing output (still atomically: the old one stays until the new is complete).
        progress: show a tqdm progress bar.
        progress_callback: ``f(rows_done, rows_total, tokens_done)`` after each chunk (the service uses it).
        source_fingerprint_value: precomputed sha256 of the source (avoids hashing it twice).
        limits: a :class:`pf_trl.data.source_limits.SourceLimits`: a source file is scanned against it before it
            is parsed, the loaded rows after (the service passes its limits; None: no limits).
        image_roots: directories image paths of a vision-language source may be read from (default: the source
            file's directory); relative paths are resolved against the first.

    Raises:
        PretokenizeError: bad source, format, options or rows; the message names the row and the fix.
    """
    from pf_trl.data.remote import local_path, publish_through_staging
    from pf_trl.storage import is_remote

    source = local_path(source)  # a bucket URI: the node cache's copy
    if is_remote(output_dir):  # tokenized into staging, then uploaded (manifest last)
        return publish_through_staging(str(output_dir), lambda local: pretokenize(
            source, local, config, tokenizer=tokenizer, num_proc=num_proc, progress=progress,
            progress_callback=progress_callback, source_fingerprint_value=source_fingerprint_value, limits=limits,
            image_roots=image_roots), overwrite=overwrite)
    import datasets
    from tqdm.auto import tqdm

    config = config or PretokenizeConfig()
    out = Path(output_dir)
    if out.exists() and not overwrite:
        raise PretokenizeError(f"output {out} already exists; choose a new directory or pass overwrite=True (--overwrite)")
    if num_proc < 1:
        raise PretokenizeError(f"num_proc must be >= 1, got {num_proc}")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))
    tokenizer = with_chat_template(tokenizer, config.chat_template)
    started = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar of our own instead of datasets' per-step bars
    try:
        if limits is not None and isinstance(source, (str, os.PathLike)) and Path(source).is_file():
            from pf_trl.data.source_limits import check_source_limits

            check_source_limits(source, limits)  # before any reader parses it
        ds = load_source(source, work)
        if limits is not None:
            from pf_trl.data.source_limits import check_table_limits

            check_table_limits(ds, limits)
        input_format = _resolve_format(ds, config)
        vision_tokenizer = None
        if input_format == "vision":
            vision_tokenizer = _vision_tokenizer(ds, source, tokenizer, config, image_roots)
        if vision_tokenizer is not None:
            from pf_trl.data.vision import undecoded

            ds = undecoded(ds, vision_tokenizer.image_column)
        rows_total = ds.num_rows
        # Contiguous chunks: progress reports after each, and the unit of work of the process pool.
        chunk_rows = max(500, min(20000, -(-rows_total // (8 * num_proc))))
        bounds = [(a, min(a + chunk_rows, rows_total)) for a in range(0, rows_total, chunk_rows)]
        job = _ChunkJob(ds, tokenizer, input_format, config, work, vision_tokenizer)
        arrow_files: dict[int, str] = {}
        tokens_done = rows_done = 0
        bar = tqdm(total=rows_total, desc="pretokenize", unit="rows", disable=not progress)
        try:
            for start, stop, path, tokens in _run_chunks(job, bounds, num_proc):
                arrow_files[start] = path
                rows_done += stop - start
                tokens_done += tokens
                bar.update(stop - start)
                if progress_callback is not None:
                    progress_callback(rows_done, rows_total, tokens_done)
        finally:
            bar.close()
        parts = [datasets.Dataset.from_file(arrow_files[start]) for start, _ in bounds]
        full = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

        tokenized = summarize_tokenized(full, config, rows_total)
        report, keep, lengths = tokenized.report, tokenized.keep, tokenized.lengths
        kept = tokenized.kept
        if kept.num_rows == 0:
            raise PretokenizeError(
                f"no example left after tokenization ({report.dropped_too_long} too long, "
                f"{report.dropped_no_loss} without supervised tokens); check max_seq_len and the loss masking options"
            )
        shards_tmp = work / "shards"
        source_sha = source_fingerprint_value or source_fingerprint(source)
        # the identity travels with the Arrow data (Dataset.info), so shards passed as a Dataset are checked too
        identity.stamp(kept, {"tokenizer": tokenizer_fingerprint(tokenizer),
                              "source": {"input_format": input_format, "sha256": source_sha}}, where=str(out))
        kept.save_to_disk(str(shards_tmp), max_shard_size=config.shard_size)
        manifest = {
            "format_version": FORMAT_VERSION,
            "pf_trl_version": __version__,
            "created_unix": round(started, 3),
            "tokenize_seconds": round(time.time() - started, 3),
            "source": {
                "path": describe_source(source),
                "hub": _hub_record(source),  # repo id, revision and commit of a Hub dataset's file (else None)
                "sha256": source_sha,
                "rows": rows_total,
                "input_format": input_format,
                "chat_mask": formats.chat_mask_method(tokenizer) if input_format in CHAT_FORMATS else None,
                "mask_columns": [c for c in formats.MASK_COLUMNS if c in ds.column_names]
                if input_format == "pretokenized" else [],
            },
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "options": config.to_dict(),
            "max_seq_len": config.max_seq_len,
            "truncation": config.truncation,
            "counts": tokenized.counts,
            "lengths": length_stats(lengths, config.max_seq_len),
            "columns": {"input_ids": "list<int32>", "labels": "list<int32>", "length": "int32"},
        }
        if vision_tokenizer is not None:
            manifest["vision"] = _vision_manifest(full.data.column("images"), keep, vision_tokenizer)
            manifest["columns"].update({c: t for c, t in (("images", "list<large_binary>"),
                                                          (vision_tokenizer.token_type_key, "list<int8>")) if c})
        write_manifest(shards_tmp, manifest)
        _publish(shards_tmp, out, overwrite=overwrite)
        logger.info("pretokenize: %d examples, %d tokens -> %s", kept.num_rows, int(lengths.sum()), out)
        return manifest
    except FormatError as exc:
        raise PretokenizeError(str(exc), getattr(exc, "option", None)) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if bars_were_on:
            datasets.enable_progress_bars()


def _text_tokenizer(processing_class):
    """The tokenizer that renders text rows: a processor's own (with the processor's chat template if it has none)."""
    if not is_processor(processing_class):
        return processing_class
    tokenizer = processing_class.tokenizer
    template = getattr(processing_class, "chat_template", None)
    if template and not getattr(tokenizer, "chat_template", None):
        import copy

        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = template
    return tokenizer


def _vision_tokenizer(ds, source, tokenizer, config: PretokenizeConfig, image_roots):
    """The row function of a vision-language source, or a PretokenizeError naming what is missing."""
    from pf_trl.data import vision

    column = vision.image_column(ds.column_names)
    if not is_processor(tokenizer):
        raise PretokenizeError(
            f"the source has an {column!r} column (vision-language rows), but {type(tokenizer).__name__} is a "
            "tokenizer: tokenize it with the model's processor (a model folder holding preprocessor_config.json / "
            "processor_config.json, or processing_class=AutoProcessor...)")
    if image_roots is None and isinstance(source, (str, os.PathLike)):
        path = Path(source).resolve()
        image_roots = (str(path if path.is_dir() else path.parent),)
    marks_turns = "messages" in ds.column_names and config.assistant_only_loss  # False: every token, TRL's default
    try:  # once, before any row: a template that cannot mark the assistant turns fails here
        template = vision.training_chat_template(tokenizer) if marks_turns else None
    except vision.VisionDataError as exc:
        raise PretokenizeError(str(exc)) from exc
    return vision.VisionTokenizer(processor=tokenizer, image_column=column,
                                  token_type_key=vision.token_type_key(tokenizer),
                                  policy=vision.ImagePolicy(roots=tuple(image_roots or ())), chat_template=template,
                                  completion_only_loss=config.completion_only_loss, text_field=config.text_field,
                                  assistant_only_loss=config.assistant_only_loss)


def _vision_manifest(images: pa.ChunkedArray, keep: np.ndarray, vision_tokenizer) -> dict[str, Any]:
    """Image counts of the kept rows and what made their tokens (the manifest's ``vision`` section). Read from the
    memory-mapped column with the keep mask, never by materialising the kept rows' image bytes."""
    import pyarrow.compute as pc

    per_row = np.asarray(pc.list_value_length(images).fill_null(0))
    flat = pc.list_flatten(images)
    owner = np.asarray(pc.list_parent_indices(images))
    sizes = np.bincount(owner, weights=np.asarray(pc.binary_length(flat)), minlength=len(per_row))
    return {
        "images": int(per_row[keep].sum()),
        "image_bytes": int(sizes[keep].sum()),
        "rows_with_images": int((per_row[keep] > 0).sum()),
        "processor": type(vision_tokenizer.processor).__name__,
        "image_processor": type(vision_tokenizer.processor.image_processor).__name__,
        "token_type_key": vision_tokenizer.token_type_key,
    }


@functools.lru_cache(maxsize=1)
def _processing_schema() -> pa.Schema:
    return _processing_features().arrow_schema


def _processing_features():
    """Shard columns plus the bookkeeping columns that exist only while processing."""
    features = shard_features()
    features.update(bookkeeping_features())
    return features


def _publish(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Move a complete shards directory into place; an old output is replaced only after the new is whole."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if not overwrite:
        raise PretokenizeError(f"output {out} appeared while pretokenizing; it was left untouched")
    backup = out.with_name(f".{out.name}.old-{os.getpid()}-{int(time.time())}")
    os.rename(out, backup)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(backup, out)
        raise
    shutil.rmtree(backup, ignore_errors=True)
