"""The one data path: any source -> a shards directory (through the content-addressed cache) -> the loaded shards.

Used by ``pf-trl train``, :class:`~pf_trl.trainer.PaddingFreeSFTTrainer` (raw rows given in Python) and the
preprocessing service alike, so the same rows give the same token ids and the same loss masks whichever door they
come through. Sources:

- a shards directory (``pf_manifest.json``): used as is, refused when made with another tokenizer;
- a JSON / JSONL / Parquet / CSV file, or a ``datasets.save_to_disk`` directory;
- a ``datasets.Dataset`` or ``DatasetDict`` (its ``train`` split) in memory;
- a dataset id at the preprocessing service (:func:`load_service_dataset`).

Files and datasets are tokenized once by :func:`~pf_trl.data.pretokenize.pretokenize` into
``cache_root()/datasets/<sha256(source content, tokenizer fingerprint, options)>``; later runs reuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pf_trl.data.formats import IGNORE_INDEX, MASK_COLUMNS, labels_from_masks
from pf_trl.data.pretokenize import SOURCE_SUFFIXES, PretokenizeConfig, PretokenizeError
from pf_trl.errors import PfTrlError

Say = Callable[[str], None]


class DataSourceError(PfTrlError, ValueError):
    """A data source cannot be used; the message names it and the fix."""


def _quiet(_: str) -> None:
    return None


def check_source_path(path: str | Path, *, flag: str = "source", read_ahead: bool = False) -> Path:
    """Cheap checks of a local source before anything heavy is imported: it exists and is a readable kind. A bucket
    URI is fetched into the node cache first (:func:`pf_trl.data.remote.local_path`) and its local copy returned;
    with ``read_ahead`` (a training set) a dataset published with its row layout is only opened (its folder holds
    the manifest and lengths; the Arrow files follow while training runs)."""
    from pf_trl.storage import is_remote

    if is_remote(path):
        from pf_trl.data.remote import local_path
        from pf_trl.data.shards import ShardsError
        from pf_trl.storage import StorageError

        try:
            path = local_path(path, read_ahead=read_ahead, purpose=None if read_ahead else flag)
        except (StorageError, ShardsError) as exc:
            raise DataSourceError(f"{flag} {exc}") from exc
    source = Path(path).expanduser()
    if not source.exists():
        raise DataSourceError(f"{flag} {path}: no such file or directory")
    if source.is_file():
        if source.suffix.lower() not in SOURCE_SUFFIXES:
            raise DataSourceError(
                f"{flag} {path}: suffix {source.suffix!r} is not read; use {', '.join(sorted(SOURCE_SUFFIXES))}, a "
                "shards directory or a datasets.save_to_disk directory"
            )
        if source.stat().st_size == 0:
            raise DataSourceError(f"{flag} {path}: the file is empty (0 bytes)")
    elif not (source / "pf_manifest.json").is_file() and not (
        (source / "state.json").is_file() or (source / "dataset_dict.json").is_file()
    ):
        raise DataSourceError(
            f"{flag} {path}: the directory is neither a pf-trl shards directory nor a datasets.save_to_disk directory"
        )
    return source


def hub_origin(source: Any) -> dict[str, Any] | None:
    """The Hub repository, revision and commit a source path was downloaded from (None: not a Hub snapshot)."""
    from pf_trl.hub import origin_of

    if not isinstance(source, (str, os.PathLike)):
        return None
    found = origin_of(source)
    return found.record() if found else None


def dataset_cache_key(source: Any, tokenizer, options: dict[str, Any]) -> str:
    """Content address of the shards of ``source`` tokenized by ``tokenizer`` with ``options``: the source's bytes
    and, for Hub snapshots, the dataset's and the tokenizer's resolved commits; the tokenizer's identity by content;
    the options; pf-trl's shards format version (rows cached by another format are never reused)."""
    from pf_trl.data.pretokenize import source_fingerprint
    from pf_trl.data.shards import FORMAT_VERSION
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    digest = hashlib.sha256()
    digest.update(f"pf-trl shards format {FORMAT_VERSION}".encode())
    digest.update(source_fingerprint(source).encode())
    identity = tokenizer_fingerprint(tokenizer)
    digest.update(identity["sha256"].encode())
    origin = hub_origin(source)
    hubs = [(origin or {}).get("repo_id"), (origin or {}).get("commit"),
            (identity.get("hub") or {}).get("repo_id"), (identity.get("hub") or {}).get("commit")]
    if any(hubs):  # a key without Hub commits stays what it was for local data
        digest.update(json.dumps(hubs).encode())
    # special ids set in memory (e.g. SFTConfig.eos_token) change the tokens written but not the tokenizer's files
    digest.update(json.dumps([identity["bos_token_id"], identity["eos_token_id"]]).encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    return digest.hexdigest()


def cached_shards(source: Any, tokenizer, config: PretokenizeConfig, *, num_proc: int = 1, progress: bool = True,
                  say: Say = _quiet, what: str = "training") -> Path:
    """The cache directory holding ``source`` tokenized with ``tokenizer`` and ``config`` (built when missing)."""
    from pf_trl.data.pretokenize import describe_source, pretokenize
    from pf_trl.data.shards import is_shards_dir
    from pf_trl.data.tokenizer import cache_root

    target = cache_root() / "datasets" / dataset_cache_key(source, tokenizer, config.to_dict())
    if is_shards_dir(target):
        say(f"{what} data: cache hit {target} (no tokenization)")
        return target
    say(f"{what} data: tokenizing {describe_source(source)} into the cache {target}")
    try:
        pretokenize(source, target, config, tokenizer=tokenizer, num_proc=num_proc, progress=progress)
    except PretokenizeError as exc:
        if is_shards_dir(target):  # another process built it first
            return target
        raise DataSourceError(str(exc)) from exc
    return target


def load_training_data(source: Any, tokenizer, config: PretokenizeConfig | None = None, *, num_proc: int = 1,
                       progress: bool = True, say: Say = _quiet, what: str = "training", read_ahead: bool = False):
    """Loaded shards (``datasets.Dataset`` with ``input_ids``, ``labels``, ``length``) for any local source.

    ``read_ahead``: a committed dataset in a bucket, published with its row layout, is returned as a
    :class:`~pf_trl.data.lazy_shards.LazyShards` (trained on while it downloads; the trainer decides whether it can
    be: :func:`pf_trl.data.lazy_shards.admit`) instead of being downloaded whole first.

    Args:
        source: a shards directory, a data file, a ``save_to_disk`` directory, or a ``Dataset`` / ``DatasetDict``.
        tokenizer: the loaded tokenizer the model trains with (see :func:`pf_trl.data.tokenizer.resolve_tokenizer`).
        config: formats, lengths, truncation and chat template; shards directories ignore it, except its
            ``chat_template``, which the shards must have been rendered with.
        say: called with one-line progress notes (which source, cache hit or tokenizing).

    Raises:
        DataSourceError: missing or unreadable source, bad rows, or shards made with another tokenizer.
    """
    from pf_trl.data.shards import ShardsError, is_shards_dir, load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint, with_chat_template
    from pf_trl.storage import is_remote

    config = config or PretokenizeConfig()
    tokenizer = with_chat_template(tokenizer, config.chat_template)  # the template the data is (to be) rendered with
    expected = tokenizer_fingerprint(tokenizer)
    if read_ahead and is_remote(source):
        from pf_trl.data.lazy_shards import open_lazy_shards
        from pf_trl.storage import StorageError
        from pf_trl.storage.datasets import is_file

        try:
            lazy = None if is_file(source) else open_lazy_shards(source, expected_tokenizer=expected)
        except (StorageError, ShardsError) as exc:
            raise DataSourceError(f"{what} data {exc}") from exc
        if lazy is not None:
            say(f"{what} data: {source}: {len(lazy)} rows, read while its {len(lazy.files)} files download "
                "(no tokenization)")
            return lazy
    if isinstance(source, (str, os.PathLike)):
        path = check_source_path(source, flag=f"{what} data")
        source = path if is_remote(source) else source  # a bucket URI: its node-cache copy
        if is_shards_dir(path):
            say(f"{what} data: shards directory {path} (no tokenization)")
            try:
                return load_shards(path, expected_tokenizer=expected)
            except ShardsError as exc:
                raise DataSourceError(str(exc)) from exc
    target = cached_shards(source, tokenizer, config, num_proc=num_proc, progress=progress, say=say, what=what)
    try:
        return load_shards(target, expected_tokenizer=expected)
    except ShardsError as exc:
        raise DataSourceError(str(exc)) from exc


def load_service_dataset(url: str, dataset_id: str, tokenizer, *, token: str | None = None,
                         timeout_s: float = 600.0, progress: bool = True, say: Say = _quiet):
    """Shards of a dataset built by the preprocessing service, refused when made with another tokenizer."""
    from pf_trl.data.service_client import DatasetServiceError, wait_for_dataset
    from pf_trl.data.shards import ShardsError, load_shards
    from pf_trl.data.tokenizer import tokenizer_fingerprint

    say(f"training data: waiting up to {timeout_s:.0f}s for dataset {dataset_id} at {url} "
        "(--dataset_service_timeout_s sets the limit)")
    try:
        directory = wait_for_dataset(url, dataset_id, token=token, timeout_s=timeout_s, progress=progress)
        say(f"training data: service dataset {dataset_id} at {directory} (no tokenization)")
        return load_shards(directory, expected_tokenizer=tokenizer_fingerprint(tokenizer))
    except (DatasetServiceError, ShardsError) as exc:
        raise DataSourceError(str(exc)) from exc


def mask_columns_present(dataset) -> list[str]:
    """TRL's mask columns (``completion_mask``, ``assistant_masks``) of a tokenized dataset."""
    names = getattr(dataset, "column_names", None) or []
    return [c for c in MASK_COLUMNS if c in names]


def fold_mask_columns(dataset, *, completion_only_loss: bool | None = True):
    """Turn TRL's mask columns of a tokenized dataset into ``labels`` (-100 where a mask is 0; the intersection
    with existing ``labels``) and drop them, so that cutting the dataset down to ``input_ids`` / ``labels`` keeps
    the loss mask. ``completion_only_loss=False`` ignores ``completion_mask`` as TRL does."""
    masks = mask_columns_present(dataset)
    if completion_only_loss is False and "completion_mask" in masks:
        masks.remove("completion_mask")
    if not masks:
        return dataset
    has_labels = "labels" in dataset.column_names

    def fold(row: dict[str, Any]) -> dict[str, Any]:
        labels = labels_from_masks(row["input_ids"], row["labels"] if has_labels else None, [row[c] for c in masks])
        return {"labels": labels}

    return dataset.map(fold, remove_columns=mask_columns_present(dataset), desc="pf-trl: mask columns -> labels")


def supervised_token_count(dataset) -> int:
    """Labels other than -100 in a tokenized dataset (``labels`` column, else every token)."""
    import pyarrow.compute as pc

    column = "labels" if "labels" in dataset.column_names else "input_ids"
    flat = pc.list_flatten(dataset.select_columns([column]).with_format("arrow")[:][column])
    if column == "input_ids":
        return len(flat)
    return int(pc.sum(pc.not_equal(flat, IGNORE_INDEX)).as_py() or 0)


def check_token_ids(dataset, vocab_size: int | None) -> None:
    """Refuse tokenized rows whose ids reach past the model's embeddings (made with another tokenizer)."""
    if vocab_size is None or "input_ids" not in (dataset.column_names or []):
        return
    import pyarrow.compute as pc

    flat = pc.list_flatten(dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"])
    if len(flat) == 0:
        return
    top = pc.max(flat).as_py()
    if top is not None and top >= vocab_size:
        raise DataSourceError(
            f"token id {top} is outside the model's {vocab_size} embeddings: the data was tokenized with another "
            "tokenizer; tokenize it with the model's own"
        )
