"""``pf-trl train``'s TRL data flags (``--dataset_name`` and its splits, ``--datasets``) and evaluation data given as
a ``DatasetDict`` folder, turned into the sources ``load_data`` reads (:mod:`pf_trl.data.local_datasets` resolves
them). Runs twice: in the cheap checks (refusals before any tokenizing) and when the data is loaded."""

from __future__ import annotations

from typing import Any

from pf_trl.cli.train_args import TrainCLIError


def _eval_on(strategy: Any) -> bool:
    return str(getattr(strategy, "value", strategy) or "no") != "no"


def trl_data_flags(args) -> list[str]:
    """The TRL data flags given (for the one-data-choice check)."""
    return [flag for flag, name in (("--dataset_name", "dataset_name"), ("--datasets", "datasets"))
            if getattr(args, name, None)]


def resolve(args, eval_strategy: Any) -> tuple[Any, Any, str | None]:
    """``(train source, eval source or None, a note)`` for ``--dataset_name`` / ``--datasets``, or
    ``(None, None, None)`` when neither is given; raises TrainCLIError in one line."""
    from pf_trl.data.local_datasets import LocalDatasetError, resolve_dataset_name, resolve_mixture

    evaluate = _eval_on(eval_strategy)
    name, mixture = getattr(args, "dataset_name", None), getattr(args, "datasets", None)
    if not name and not mixture:
        return None, None, None
    if name and mixture:  # trl sft warns and drops dataset_name; nothing is dropped here
        raise TrainCLIError("--dataset_name and --datasets (a `datasets:` list) both name the training data; pass one")
    validation = getattr(args, "validation_data_path", None)
    try:
        if mixture:
            if evaluate and not validation:
                raise TrainCLIError("evaluation is on but a `datasets:` mixture has no test split here (trl sft makes "
                                    "one with test_split_size, which pf-trl does not); pass --validation_data_path")
            config = resolve_mixture(list(mixture))
            return config, None, f"training data: {len(config.sources)} datasets of `datasets:`, concatenated"
        if evaluate and validation:
            raise TrainCLIError(f"--dataset_name evaluates on its {args.dataset_test_split!r} split and "
                                "--validation_data_path names other evaluation data; pass one")
        data = resolve_dataset_name(name, config=getattr(args, "dataset_config", None),
                                    train_split=args.dataset_train_split or "train",
                                    test_split=args.dataset_test_split or "test", evaluate=evaluate)
    except LocalDatasetError as exc:
        raise TrainCLIError(str(exc)) from exc
    note = f"--dataset_name {name}: training on its {data.train_split!r} split"
    if data.eval_split:
        note += f", evaluating on its {data.eval_split!r} split"
    return data.train, data.eval, note


def _true(value: Any) -> bool:
    from pf_trl.trainer.modes import as_bool

    return bool(as_bool(value))


def streaming_flag(args) -> str | None:
    """The TRL flag that streams the training data (``--dataset_streaming`` for ``--dataset_name``, ``--streaming``
    for a ``datasets:`` mixture), or None; a streaming flag for data it does not apply to is refused (trl sft would
    ignore it without a word)."""
    flag = None
    if _true(getattr(args, "dataset_streaming", None)):
        if not getattr(args, "dataset_name", None):
            raise TrainCLIError("--dataset_streaming True streams --dataset_name, which is not given; pass "
                                "--dataset_name, or --streaming True with --datasets, or for --data_config set "
                                "dataprocessor.streaming: true")
        flag = "--dataset_streaming"
    if _true(getattr(args, "streaming", None)):
        if not getattr(args, "datasets", None):
            raise TrainCLIError("--streaming True streams a `datasets:` mixture (--datasets), which is not given; for "
                                "--dataset_name pass --dataset_streaming True")
        flag = "--streaming"
    return flag


def check_streaming(args, max_steps: Any) -> None:
    """A streamed training set has no length: refused in one line without ``--max_steps`` (before any data is
    read)."""
    flag = streaming_flag(args)
    try:
        steps = int(max_steps) if max_steps is not None else -1
    except (TypeError, ValueError):
        return  # refused with its own message by the flag checks
    if flag is not None and steps <= 0:
        raise TrainCLIError(f"{flag} True: a stream has no length, so epochs cannot be counted; set --max_steps N "
                            "(optimizer steps; the stream is read again from its start when it ends), or drop "
                            f"{flag} to tokenize the data once into the cache")


def streamed(train: Any, name: str) -> Any:
    """The training source as a streamed data config (pf-trl's streaming path: tokenized while training, packed
    to the token budget from a look-ahead buffer; :mod:`pf_trl.data.streaming`)."""
    import dataclasses

    from pf_trl.data.data_config import DataConfig, MixtureSource

    if isinstance(train, DataConfig):
        return dataclasses.replace(train, streaming=True)
    return DataConfig(sources=[MixtureSource(name=name, data_paths=[str(train)])], streaming=True)


def validation_split(path: str | None) -> tuple[str | None, str | None]:
    """``--validation_data_path``: a DatasetDict folder's test split (else validation...), refused without one."""
    from pf_trl.data.local_datasets import LocalDatasetError, eval_split_of

    if not path or not isinstance(path, str):
        return path, None
    try:
        return eval_split_of(path)
    except LocalDatasetError as exc:
        raise TrainCLIError(str(exc)) from exc


def chat_template_path(path: str, chat_template: str | None) -> str:
    """TRL's ``--chat_template_path FILE``: the same setting as pf-trl's ``--chat_template FILE`` (returned); a
    tokenizer folder, or a second, different file, is refused."""
    from pathlib import Path

    if Path(path).expanduser().is_dir():
        raise TrainCLIError(f"--chat_template_path {path} is a folder: pf-trl takes the template as a Jinja file "
                            "(cloning a tokenizer folder's template adds tokens and resizes the model); pass the file")
    if chat_template and Path(chat_template).expanduser().resolve() != Path(path).expanduser().resolve():
        raise TrainCLIError(f"--chat_template_path {path} and --chat_template {chat_template} both set the chat "
                            "template, to different files; pass one")
    return path


def apply(data_args, config, say) -> None:
    """Point ``data_args`` at the resolved sources (before ``load_data``), saying which splits are used, and
    ``--chat_template_path`` at ``--chat_template`` (the trainer then has nothing left to apply)."""
    from pf_trl.data.data_config import DataConfig

    if getattr(config, "chat_template_path", None):
        data_args.chat_template = chat_template_path(config.chat_template_path, data_args.chat_template)
        config.chat_template_path = None

    train, evalset, note = resolve(data_args, config.eval_strategy)
    flag = streaming_flag(data_args)
    if train is not None and flag is not None:
        check_streaming(data_args, config.max_steps)
        from pathlib import Path

        train = streamed(train, f"{Path(str(data_args.dataset_name)).name}-{data_args.dataset_train_split or 'train'}")
        note += (f"; {flag}: streamed, tokenized while training" +
                 (" (padded training reads it whole)" if config.padding_free_mode == "none" else "") +
                 (", the evaluation split read whole" if evalset is not None else ""))
    if train is not None:
        if isinstance(train, DataConfig):
            data_args.data_config, data_args.training_data_path = train, None
        else:
            data_args.training_data_path = train
        if evalset is not None:
            data_args.validation_data_path = evalset
        say(note)
    path, split = validation_split(data_args.validation_data_path)
    if split is not None:
        say(f"--validation_data_path {data_args.validation_data_path}: a DatasetDict, evaluating on its {split!r} "
            "split")
        data_args.validation_data_path = path
