"""The one data entry point of training: whatever a caller gives as data -> rows the padding-free trainer can batch.

:func:`prepare_dataset` is what :class:`~pf_trl.trainer.PaddingFreeSFTTrainer` calls for its train and eval sets
(and for a dataset passed to ``evaluate()``); ``pf-trl train`` loads its sources first (before the model, with
progress lines) and hands the shards to the trainer, which passes them through here too. The data options of both
come from :func:`data_options`, so the trainer and the CLI read the trainer config's data fields alike.

What it accepts: raw rows or a path (tokenized through :mod:`pf_trl.data.sources`, the CLI's data path: same ids,
same masks; the tokenizer must fit the model's embeddings), tokenized rows or shards (kept as they are: their ids
are checked against the embeddings, TRL's ``completion_mask`` / ``assistant_masks`` folded into ``labels``), a data
config or a stream (:mod:`pf_trl.data.inputs`). TRL's ``max_length`` / ``truncation_mode`` apply to tokenized rows
as TRL applies them (:mod:`pf_trl.data.sequence_limit`).

``args`` is the trainer config (:class:`~pf_trl.trainer.PaddingFreeConfig`), read by field name only: this package
imports nothing of the trainer.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np

from pf_trl.errors import TrainingDataError

__all__ = ["data_options", "dataset_lengths", "derive_token_budget", "has_mask_columns", "is_tokenized",
           "prepare_dataset", "prepare_train_and_eval", "resolve_processing_class", "say_mask_decisions",
           "shuffle_once"]

logger = logging.getLogger("pf_trl.trainer")  # the trainer's logger: these lines are part of building a trainer


def prepare_dataset(dataset, *, tokenizer, model, args, options=None, what: str):
    """``dataset`` prepared for training (``what``: ``"training"``, ``"evaluation"``, ...; ``None`` stays ``None``).

    ``options``: the caller's :class:`~pf_trl.data.pretokenize.PretokenizeConfig`, else :func:`data_options` of
    ``args``. Returns shards / tokenized rows, a loaded mixture, or a :class:`~pf_trl.data.streaming.TokenizedStream`.

    Raises:
        PfTrlError (a ``ValueError``): data that cannot be read or tokenized, ids beyond the model's vocabulary, a
            tokenizer other than the data's, a bad data config, rows a sequence limit would remove from a mixture.
    """
    if dataset is None:
        return dataset
    dataset = _hub_dataset(dataset, what)
    from pf_trl.data import inputs

    options = options if options is not None else data_options(args)
    dataset, done = inputs.prepare(dataset, tokenizer=tokenizer, args=args, config=options, what=what, model=model)
    if not done:
        dataset = _prepare_rows(dataset, tokenizer=tokenizer, model=model, args=args, options=options, what=what)
    return inputs.finish(dataset, tokenizer=tokenizer, args=args, what=what)


def _hub_dataset(dataset, what: str):
    """A Hub dataset id given as the dataset: its ``train`` split (``test`` for evaluation data), as a path or a data
    config of its files; anything else as it is (a local path wins over an id of the same spelling)."""
    from pf_trl.hub import looks_like_repo_id

    if not isinstance(dataset, str) or not looks_like_repo_id(dataset):
        return dataset
    from pf_trl.data.local_datasets import resolve_dataset_name

    split = "train" if what == "training" else "test"
    flag = "train_dataset" if what == "training" else "eval_dataset"
    data = resolve_dataset_name(dataset, config=None, train_split=split, test_split=split, evaluate=False, flag=flag)
    return data.train


def prepare_train_and_eval(train_dataset, eval_dataset, *, tokenizer, model, args, options=None):
    """:func:`prepare_dataset` of a train set and an eval set (or a dict of eval sets), each shuffled once when
    ``shuffle_dataset`` asks it in pf-trl's modes (the padded mode: TRL's own preparation shuffles)."""
    def prepare(dataset, what: str):
        return prepare_dataset(dataset, tokenizer=tokenizer, model=model, args=args, options=options, what=what)

    train_dataset = prepare(train_dataset, "training")
    if isinstance(eval_dataset, dict):
        eval_dataset = {k: prepare(v, f"evaluation {k}") for k, v in eval_dataset.items()}
    else:
        eval_dataset = prepare(eval_dataset, "evaluation")
    if args.padding_free_mode != "none":
        train_dataset = shuffle_once(train_dataset, args)
        eval_dataset = ({k: shuffle_once(v, args) for k, v in eval_dataset.items()}
                        if isinstance(eval_dataset, dict) else shuffle_once(eval_dataset, args))
    return train_dataset, eval_dataset


def shuffle_once(dataset, args):
    """``shuffle_dataset=True``: the prepared dataset shuffled once with ``seed``, as TRL's ``_prepare_dataset``
    ends."""
    if dataset is None or not getattr(args, "shuffle_dataset", False) or not hasattr(dataset, "shuffle"):
        return dataset
    import datasets

    from pf_trl.data.mixture import mixture_of

    if isinstance(dataset, datasets.IterableDataset) or mixture_of(dataset) is not None:
        return dataset  # streamed rows; a mixture's rows are drawn at random by its sampler (its row ranges stay)
    manifest = getattr(dataset, "pf_manifest", None)
    shuffled = dataset.shuffle(seed=args.seed)
    if manifest is not None:
        shuffled.pf_manifest = manifest
    return shuffled


def say_mask_decisions(dataset, args, *, what: str, had_completion_mask: bool = False) -> None:
    """One log line where an unset ``completion_only_loss`` / ``assistant_only_loss`` makes pf-trl's loss mask differ
    from what TRL's default would train, so the divergence is never silent."""
    manifest = getattr(dataset, "pf_manifest", None) or {}
    source = manifest.get("source") or {}
    masks = source.get("mask_columns") or []
    if args.completion_only_loss is None and (had_completion_mask or "completion_mask" in masks):
        logger.warning(  # one line for the run (train and eval data alike): said once
            "pf-trl: the completion_mask column is applied (loss on the completion only) because "
            "completion_only_loss is unset; TRL would train the full sequence of these language-modeling rows. Pass "
            "completion_only_loss=False for TRL's behaviour, True to silence this.")
    if getattr(args, "assistant_only_loss", False) is None and source.get("input_format") in (
            "messages", "sharegpt"):
        logger.warning(  # one line for the run (train and eval data alike): said once
            "pf-trl: chat rows train on assistant turns only because assistant_only_loss is unset (pf-trl's "
            "default); TRL's default (False) trains every token. Pass assistant_only_loss=False for that, True to "
            "silence this.")



def data_options(args, values: dict[str, Any] | None = None):
    """The :class:`~pf_trl.data.pretokenize.PretokenizeConfig` of a run: ``values`` (the CLI's data flags; a file
    option's value is a path, read here), the options the trainer config carries under TRL's names
    (``dataset_text_field``, ``completion_only_loss``, ``assistant_only_loss``, ``truncation_mode``: unset -> the
    option's default) and its sequence limit (:func:`~pf_trl.data.sequence_limit.pretokenize_limits`)."""
    from pf_trl.data.options import config_from_values, option_specs
    from pf_trl.data.sequence_limit import pretokenize_limits

    values = dict(values or {})
    for name, (f, spec) in option_specs().items():
        if spec.trl_field:
            value = getattr(args, spec.trl_field, None)
            unset = value is None or value == ""
            values[name] = f.default if unset else (value is not False if f.type == "bool" else value)
    limits = pretokenize_limits(args)  # max_length, truncation, truncation_mode: as TRL, see sequence_limit
    limits["drop_no_loss"] = limits["drop_no_loss"] and values.get("drop_no_loss", True)
    values.update(limits)
    return config_from_values(values)


def resolve_processing_class(model, processing_class, *, trust_remote_code: bool = False):
    """``processing_class`` or the model's own tokenizer (folder), the embedded one for embedded/in-memory models
    (same rules as ``pf-trl train``; ``trust_remote_code``: a tokenizer of its own code may run). Its vocabulary is
    checked against the model where data is tokenized with it (:func:`prepare_dataset`); tokenized rows have their
    ids checked instead."""
    from pf_trl.data.tokenizer import resolve_tokenizer

    if processing_class is not None and not hasattr(processing_class, "backend_tokenizer") and not isinstance(
        processing_class, str
    ):
        return processing_class  # a processor (multimodal): not pf-trl's to check
    return resolve_tokenizer(model, processing_class, check_vocab=False, trust_remote_code=trust_remote_code)


def _prepare_rows(dataset, *, tokenizer, model, args, options, what: str):
    """One source: raw rows or a path through pf-trl's data path, tokenized rows as they are (then the limit)."""
    from pf_trl.data import sources
    from pf_trl.data.lazy_shards import admit
    from pf_trl.data.tokenizer import check_vocab_fits, model_vocab_size
    from pf_trl.data.vision import image_column

    vocab = model_vocab_size(model)
    dataset = admit(dataset, args=args, what=what, vocab=vocab)  # read while it downloads, or the whole download
    made_with = (getattr(dataset, "pf_manifest", None) or {}).get("tokenizer", {}).get("vocab_size")
    if is_tokenized(dataset) and hasattr(dataset, "data") and not (made_with and vocab and made_with <= vocab):
        sources.check_token_ids(dataset, vocab)  # shards made with a tokenizer that fits need no scan
    if (args.dataset_kwargs or {}).get("skip_prepare_dataset") and not has_mask_columns(dataset):
        return dataset
    from pf_trl.data.sequence_limit import apply_sequence_limit, log_manifest_truncation

    if isinstance(dataset, (str, os.PathLike)) or (hasattr(dataset, "column_names") and not is_tokenized(dataset)):
        import datasets

        if isinstance(dataset, datasets.IterableDataset):
            return dataset  # streamed rows: left to TRL
        if args.padding_free_mode == "none" and image_column(getattr(dataset, "column_names", None) or []):
            if args.assistant_only_loss is None:
                logger.warning(
                    "pf-trl: %s data: padded vision-language rows are processed by TRL's own collator, where an unset "
                    "assistant_only_loss trains every token (TRL's default) while pf-trl's padding-free modes train "
                    "the assistant turns. Pass assistant_only_loss=True (or False) so both train the same tokens.",
                    what)
            return dataset  # padded vision-language rows: TRL's own collator processes them on the fly
        check_vocab_fits(tokenizer, vocab)
        dataset = sources.load_training_data(dataset, tokenizer, options, num_proc=args.dataset_num_proc or 1,
                                             progress=False, say=lambda msg: logger.info("pf-trl: %s", msg),
                                             what=what, read_ahead=what == "training"
                                             and args.padding_free_mode != "none")
        dataset = admit(dataset, args=args, what=what, vocab=vocab)
        log_manifest_truncation(dataset, what=f"{what} data")  # cut while tokenizing: say so
        say_mask_decisions(dataset, args, what=f"{what} data")
    else:
        say_mask_decisions(dataset, args, what=f"{what} data",
                           had_completion_mask="completion_mask" in sources.mask_columns_present(dataset))
        if has_mask_columns(dataset):
            dataset = sources.fold_mask_columns(dataset, completion_only_loss=args.completion_only_loss)
    # TRL's max_length / truncation_mode on tokenized rows and shards (labels are final by now, as in TRL)
    from pf_trl.data.mixture import mixture_of

    mixed = mixture_of(dataset) is not None
    limited = apply_sequence_limit(dataset, args, what=f"{what} data")[0]
    if mixed and mixture_of(limited) is None:  # rows dropped: the mixture's per-source row ranges no longer hold
        raise TrainingDataError(
            f"{what} data: max_length {args.max_length} with truncation={args.truncation!r} removes rows of a "
            "dataset mixture, whose sources are recorded as row ranges; tokenize the data config with the same "
            "limit (--max_seq_len) or use truncation='truncate'")
    return limited


def has_mask_columns(dataset) -> bool:
    """Whether ``dataset`` holds TRL's ``completion_mask`` / ``assistant_masks`` columns (folded into ``labels``)."""
    from pf_trl.data.sources import mask_columns_present

    return bool(mask_columns_present(dataset))


def is_tokenized(dataset) -> bool:
    """Whether ``dataset`` has an ``input_ids`` column (tokenized rows or shards)."""
    names = getattr(dataset, "column_names", None)
    return bool(names) and "input_ids" in names


def dataset_lengths(dataset) -> np.ndarray:
    """The token length of every example: the ``length`` column of shards, else the ``input_ids`` list lengths
    (read through Arrow, no rows decoded); shards read while they download: their lengths file."""
    lengths = getattr(dataset, "pf_lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    names = getattr(dataset, "column_names", None) or []
    if "length" in names:
        column = dataset.select_columns(["length"]).with_format("arrow")[:]["length"]
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.int64)
    if names:
        column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
        import pyarrow.compute as pc

        return np.asarray(pc.list_value_length(column).to_numpy(zero_copy_only=False), dtype=np.int64)
    return np.asarray([len(dataset[i]["input_ids"]) for i in range(len(dataset))], dtype=np.int64)


def derive_token_budget(lengths: np.ndarray, batch_size: int) -> int:
    """``batch_size x mean length`` (rounded up), at least the longest example."""
    return int(max(int(lengths.max()), math.ceil(float(lengths.mean()) * batch_size)))
