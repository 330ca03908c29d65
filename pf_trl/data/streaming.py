"""Streamed data (``datasets.IterableDataset``): tokenized on the fly by the same code as ``pretokenize``.

:func:`prepare_stream` turns a stream of raw rows (any format of docs/data.md) or tokenized rows (``input_ids``,
optional ``labels`` / TRL's mask columns) into a stream of ``input_ids`` / ``labels`` / ``length`` rows for one rank:

1. the first rows are read at once (construction time): the format is resolved from them and they are tokenized as
   a preflight, so a wrong format, a missing column or a bad row among them fails before training starts;
2. the stream is split between data-parallel ranks with ``datasets.distributed.split_dataset_by_node`` (disjoint
   streams: whole files per rank when the file count divides by the ranks, else every ``world_size``-th row);
3. each rank tokenizes its rows with ``pretokenize``'s batch function (``IterableDataset.map``): the same ids, the
   same loss masks and the same truncation policy as shards of the same rows.

:func:`stream_mixture` does the same for a data config with ``dataprocessor: {streaming: true}``: every source is
tokenized with its own options, then the sources are interleaved by weight (``datasets.interleave_datasets`` with
the config's seed and stopping strategy).

The stream keeps ``datasets``' ``state_dict()`` / ``load_state_dict()``, which the trainer uses for an exact resume
(:mod:`pf_trl.batching.stream_sampler`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pf_trl._compat import stream_shuffling
from pf_trl.data.bookkeeping import KEEP
from pf_trl.data.pretokenize import PretokenizeConfig, PretokenizeError
from pf_trl.errors import PfTrlError

logger = logging.getLogger(__name__)

PREFLIGHT_ROWS = 64


class StreamError(PfTrlError, ValueError):
    """A stream cannot be trained from; the message names the problem and the fix."""


@dataclass
class TokenizedStream:
    """One rank's stream of tokenized rows (``input_ids``, ``labels``, ``length``, ``_drop``) and what is known of it
    before training: the format and the first rows' lengths (for a default token budget)."""

    dataset: Any
    input_format: str
    preflight_lengths: list[int]
    max_seq_len: int
    sources: list[dict[str, Any]] = field(default_factory=list)


def is_stream(obj: Any) -> bool:
    """True for a ``datasets.IterableDataset`` or an ``IterableDatasetDict`` (its ``train`` split is used)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, (datasets.IterableDataset, datasets.IterableDatasetDict))


def train_split(obj: Any, what: str):
    """An ``IterableDatasetDict``'s ``train`` split (as for a ``DatasetDict``); other streams as they are."""
    import datasets

    if isinstance(obj, datasets.IterableDatasetDict):
        if "train" not in obj:
            raise StreamError(f"{what} data: the IterableDatasetDict has no 'train' split (splits: {list(obj)}); pass "
                              "the split to use, e.g. ds['validation']")
        return obj["train"]
    return obj


def _first_rows(stream, n: int, what: str) -> list[dict[str, Any]]:
    rows = []
    for row in stream.take(n):
        rows.append(dict(row))
    if not rows:
        raise StreamError(f"{what} data: the stream yields no rows")
    return rows


def _columns(stream, first: list[dict[str, Any]]) -> list[str]:
    names = getattr(stream, "column_names", None)
    return list(names) if names else list(first[0].keys())


def _resolve(stream, first: list[dict[str, Any]], config: PretokenizeConfig, tokenizer, what: str) -> str:
    """The input format from the first rows (as pretokenize resolves it), then a preflight tokenization of them."""
    import datasets

    from pf_trl.data.formats import FormatError
    from pf_trl.data.pretokenize import _tokenize_batch, resolve_format

    columns = _columns(stream, first)
    probe = datasets.Dataset.from_list([{c: r.get(c) for c in columns} for r in first])
    try:
        input_format = resolve_format(probe, config)
        batch = {c: [r.get(c) for r in first] for c in columns}
        _tokenize_batch(batch, list(range(len(first))), tokenizer=tokenizer, input_format=input_format, config=config,
                        index_offset=0)
    except (PretokenizeError, FormatError) as exc:
        raise StreamError(f"{what} data (stream, checked on its first {len(first)} rows): {exc}") from exc
    return input_format


def _tokenize_fn(tokenizer, input_format: str, config: PretokenizeConfig):
    from pf_trl.data.pretokenize import _tokenize_batch

    def tokenize(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        return _tokenize_batch(batch, indices, tokenizer=tokenizer, input_format=input_format, config=config,
                               index_offset=0).to_pydict()

    return tokenize


def _tokenized(stream, tokenizer, config: PretokenizeConfig, input_format: str, columns: list[str]):
    from datasets import Features, Sequence, Value

    from pf_trl.data.pretokenize import bookkeeping_features

    features = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
                         "length": Value("int32"), **bookkeeping_features()})
    mapped = stream.map(_tokenize_fn(tokenizer, input_format, config), batched=True, batch_size=64, with_indices=True,
                        remove_columns=columns, features=features)
    return mapped


def _split(stream, rank: int, world_size: int):
    if world_size <= 1:
        return stream
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(stream, rank=rank, world_size=world_size)


def prepare_stream(stream, tokenizer, config: PretokenizeConfig | None = None, *, rank: int = 0, world_size: int = 1,
                   what: str = "training") -> TokenizedStream:
    """One rank's tokenized stream of ``stream`` (raw or tokenized rows), checked on its first rows now.

    Raises:
        StreamError: an empty stream, an undetectable format, a missing column or a bad row among the first rows.
    """
    config = config or PretokenizeConfig()
    first = _first_rows(stream, PREFLIGHT_ROWS, what)
    input_format = _resolve(stream, first, config, tokenizer, what)
    if stream_shuffling(stream) is not None:
        logger.warning("pf-trl: the %s stream is shuffled with a buffer (IterableDataset.shuffle): datasets does not "
                       "keep a shuffle buffer across a resume, so a resumed run reads other rows than an uninterrupted "
                       "one (pf-trl's own look-ahead buffer is saved)", what)
    columns = _columns(stream, first)
    tokenized = _tokenized(_split(stream, rank, world_size), tokenizer, config, input_format, columns)
    lengths = _preflight_lengths(first, tokenizer, config, input_format, columns)
    return TokenizedStream(dataset=tokenized, input_format=input_format, preflight_lengths=lengths,
                           max_seq_len=config.max_seq_len, sources=[{"name": what, "input_format": input_format}])


def _preflight_lengths(first, tokenizer, config, input_format, columns) -> list[int]:
    from pf_trl.data.pretokenize import _tokenize_batch

    table = _tokenize_batch({c: [r.get(c) for r in first] for c in columns}, list(range(len(first))),
                            tokenizer=tokenizer, input_format=input_format, config=config, index_offset=0)
    drop = table.column("_drop").to_pylist()
    return [n for n, d in zip(table.column("length").to_pylist(), drop) if d == KEEP]


def _open_stream(path: Path):
    """One concrete data path as a stream: a data file or a folder of them, a shards or ``save_to_disk`` directory."""
    import datasets

    from pf_trl.data.pretokenize import SOURCE_SUFFIXES
    from pf_trl.data.shards import is_shards_dir

    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"]
        if is_shards_dir(path):
            from pf_trl.data.shards import load_shards

            ds = load_shards(path)
        return ds.to_iterable_dataset(num_shards=max(1, len(ds.cache_files)))
    builder = SOURCE_SUFFIXES[path.suffix.lower()]
    return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)


def stream_mixture(data_config, tokenizer, base: PretokenizeConfig | None = None, *, rank: int = 0,
                   world_size: int = 1, what: str = "training") -> TokenizedStream:
    """A streamed data config: each source tokenized with its own options, interleaved by weight (or concatenated).

    ``sample_by: tokens`` is refused (a stream's token counts are not known ahead); shares are by examples, as
    ``datasets.interleave_datasets`` draws them.
    """
    import datasets

    from pf_trl.data.data_config import DataConfigError, expand_data_path, source_config

    base = base or PretokenizeConfig()
    if data_config.sample_by != "examples":
        raise DataConfigError("dataprocessor.sample_by: tokens needs the token counts of every source before training; "
                              "a streamed mixture mixes by examples (datasets.interleave_datasets): drop sample_by or "
                              "set streaming: false")
    parts, infos, lengths = [], [], []
    for source in data_config.sources:
        options = source_config(base, source)
        streams = []
        for path in source.data_paths:
            for concrete in expand_data_path(path):
                stream = _open_stream(concrete)
                if source.rename_columns:
                    stream = stream.rename_columns(source.rename_columns)
                if source.retain_columns:
                    stream = stream.select_columns(source.retain_columns)
                streams.append(stream)
        stream = datasets.concatenate_datasets(streams) if len(streams) > 1 else streams[0]
        prepared = prepare_stream(stream, tokenizer, options, rank=rank, world_size=world_size,
                                  what=f"{what} ({source.name})")
        parts.append(prepared.dataset)
        infos.append({"name": source.name, "input_format": prepared.input_format, "weight": source.sampling})
        lengths.extend(prepared.preflight_lengths)
    if data_config.is_mixture:
        mixed = datasets.interleave_datasets(parts, probabilities=data_config.weights(), seed=data_config.seed,
                                             stopping_strategy=data_config.stopping_strategy)
    else:
        mixed = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    formats = sorted({i["input_format"] for i in infos})
    return TokenizedStream(dataset=mixed, input_format=formats[0] if len(formats) == 1 else "mixture",
                           preflight_lengths=lengths, max_seq_len=max(source_config(base, s).max_seq_len
                                                                      for s in data_config.sources), sources=infos)


def materialize(stream, limit: int | None, what: str):
    """A finite stream as a ``datasets.Dataset`` (its first ``limit`` rows), for evaluation."""
    import datasets

    rows = []
    for row in (stream.take(limit) if limit else stream):
        rows.append(dict(row))
    if not rows:
        raise StreamError(f"{what} data: the stream yields no rows")
    return datasets.Dataset.from_list(rows)
