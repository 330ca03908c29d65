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
