"""TRL's dataset flags on local data: ``--dataset_name`` / ``--dataset_config`` / ``--dataset_train_split`` /
``--dataset_test_split`` and a ``datasets:`` mixture list, resolved to the sources pf-trl's data path reads.

``trl sft`` calls ``datasets.load_dataset(dataset_name, name=dataset_config)`` and trains on
``dataset[dataset_train_split]`` (evaluating on ``dataset[dataset_test_split]`` when evaluation is on). ``dataset_name``
is a Hub dataset id (``ORG/NAME``: its configuration's files of the splits a run reads, resolved by ``datasets`` at
one commit and confined to the repository, :mod:`pf_trl.data.hub_datasets`) or a local path, of any kind pf-trl reads
(a local path wins over a Hub id of the same spelling):

- a data file (JSON / JSONL / Parquet / CSV): one split, ``train``;
- a folder of such files: its splits and configurations exactly as ``datasets`` reads a folder (file names such as
  ``train.jsonl`` / ``test-00000-of-00001.parquet``, ``data/``, a README.md ``configs:`` section), by
  ``datasets.load_dataset_builder``, which only resolves the files;
- a ``save_to_disk`` folder: a ``Dataset`` (split ``train``) or a ``DatasetDict`` (its splits);
- a pf-trl shards directory (split ``train``), or a folder of shards directories, one per split, named by it.

A split of several files becomes a :class:`~pf_trl.data.data_config.DataConfig` concatenating them. A split the data
lacks is refused naming the splits it has, before any tokenizing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pf_trl.data.data_config import DataConfig, DataConfigError, MixtureSource
from pf_trl.data.pretokenize import SOURCE_SUFFIXES
from pf_trl.errors import PfTrlError
from pf_trl.hub import looks_like_repo_id

# Splits a DatasetDict given as evaluation data is read from, in this order (datasets' usual names).
EVAL_SPLITS = ("test", "validation", "valid", "dev")


class LocalDatasetError(PfTrlError, ValueError):
    """A local dataset or split cannot be used; the message names the flag, what was found and the fix."""


@dataclass
class ResolvedData:
    """The sources a run trains and evaluates on (a path, or a DataConfig for several files)."""

    train: Any
    eval: Any = None
    train_split: str = "train"
    eval_split: str | None = None


def _is_shards(path: Path) -> bool:
    return (path / "pf_manifest.json").is_file()


def dataset_splits(name: str, *, config: str | None = None, data_dir: str | None = None,
                   data_files: Any = None, flag: str = "--dataset_name",
                   revision: str | None = None, splits: Any = None) -> dict[str, list[str]]:
    """``{split: [paths]}`` of a local dataset or a Hub dataset (see the module docstring). Of a Hub dataset only
    the files of ``splits`` (None: every split) are downloaded; another split lists its ``hf://`` URLs. Raises
    LocalDatasetError."""
    path = Path(name).expanduser()
    hub_folder = None
    if not path.exists() and looks_like_repo_id(name):
        from pf_trl.data.hub_datasets import HubDatasetError, hub_splits
        from pf_trl.hub import HubError

        try:
            found = hub_splits(name, config=config, data_dir=data_dir, data_files=data_files, revision=revision,
                               splits=splits, flag=flag)
        except (HubError, HubDatasetError) as exc:
            raise LocalDatasetError(str(exc)) from None
        if isinstance(found, dict):
            return _checked_suffixes(found, name, flag)
        hub_folder, cached_only = found  # saved whole, or offline: its snapshot folder, read as a local folder
        path = hub_folder
    elif not path.exists():
        raise LocalDatasetError(f"{flag} {name}: no such file or folder")
    try:
        out = _path_splits(path, name, config=config, data_dir=data_dir, data_files=data_files, flag=flag)
    except LocalDatasetError as exc:
        if hub_folder is None or not cached_only:
            raise
        raise LocalDatasetError(  # a configuration or split no earlier online run read at this commit
            f"{flag} {name}: the Hub is not read (HF_HUB_OFFLINE, or unreachable) and the Hub cache does not hold "
            f"this configuration's files at commit {hub_folder.name[:12]}; run once online with the same "
            f"configuration and split, or unset HF_HUB_OFFLINE ({exc})") from None
    if hub_folder is not None:
        from pf_trl.data.hub_datasets import HubDatasetError, check_inside

        try:
            check_inside(out, hub_folder, name, flag)
        except HubDatasetError as exc:
            raise LocalDatasetError(str(exc)) from None
    return out


def _path_splits(path: Path, name: str, *, config, data_dir, data_files, flag: str) -> dict[str, list[str]]:
    single = path.is_file() or _is_shards(path) or (path / "state.json").is_file() or \
        (path / "dataset_dict.json").is_file()
    if single and (config or data_dir or data_files):
        given = ", ".join(k for k, v in (("--dataset_config" if flag == "--dataset_name" else "name", config),
                                         ("data_dir", data_dir), ("data_files", data_files)) if v)
        raise LocalDatasetError(f"{flag} {name}: {given} only apply to a folder of data files; this is a "
                                f"{'file' if path.is_file() else 'saved dataset'}: drop {given}")
    if path.is_file():
        if path.suffix.lower() not in SOURCE_SUFFIXES:
            raise LocalDatasetError(f"{flag} {name}: suffix {path.suffix!r} is not read; use "
                                    f"{', '.join(sorted(SOURCE_SUFFIXES))}, a folder of them, or a saved dataset")
        return {"train": [str(path)]}
    if _is_shards(path) or (path / "state.json").is_file():
        return {"train": [str(path)]}
    if (path / "dataset_dict.json").is_file():
        return {split: [str(path / split)] for split in _dict_splits(path)}
    subs = sorted(p for p in path.iterdir() if p.is_dir() and _is_shards(p))
    if subs and not config and not data_dir and not data_files:
        return {p.name: [str(p)] for p in subs}
    return _folder_splits(path, config=config, data_dir=data_dir, data_files=data_files, flag=flag)


def _dict_splits(path: Path) -> list[str]:
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        raise LocalDatasetError(f"{path}: dataset_dict.json has no `splits` list; save the dataset again") from None
    return [str(s) for s in splits]


def _folder_splits(path: Path, *, config, data_dir, data_files, flag: str) -> dict[str, list[str]]:
    """A folder of data files, read as ``datasets`` reads it (splits by file name, README configs)."""
    import datasets

    from pf_trl.data.tokenizer import cache_root

    try:
        builder = datasets.load_dataset_builder(str(path), name=config, data_dir=data_dir, data_files=data_files,
                                                cache_dir=str(cache_root() / "hf-datasets"))
    except Exception as exc:  # datasets' own message: unknown config, no data files...
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        what = f" (configuration {config!r})" if config else ""
        raise LocalDatasetError(f"{flag} {path}{what}: datasets cannot read it as a dataset folder: {first}") from None
    files = builder.config.data_files or {}
    return _checked_suffixes({str(split): [str(f) for f in paths] for split, paths in files.items()}, str(path), flag)


def _checked_suffixes(out: dict[str, list[str]], name: str, flag: str) -> dict[str, list[str]]:
    if not out:
        raise LocalDatasetError(f"{flag} {name}: the folder holds no data files ({', '.join(sorted(SOURCE_SUFFIXES))})")
    bad = [f for fs in out.values() for f in fs if Path(f).suffix.lower() not in SOURCE_SUFFIXES]
    if bad:
        raise LocalDatasetError(f"{flag} {name}: {Path(bad[0]).name} is not read by pf-trl; use "
                                f"{', '.join(sorted(SOURCE_SUFFIXES))} files")
    return out


def as_source(paths: list[str], name: str) -> Any:
    """One path as it is; several files concatenated as a data config (in the order datasets lists them)."""
    if len(paths) == 1:
        return paths[0]
    return DataConfig(sources=[MixtureSource(name=name, data_paths=list(paths))])


def _pick(splits: dict[str, list[str]], split: str, flag: str, name: str, what: str) -> list[str]:
    if split not in splits:
        raise LocalDatasetError(f"{flag} {split}: {name} has no {split!r} split (its splits: {', '.join(splits)}); "
                                f"pass the split to {what} with {flag}")
    return splits[split]


def resolve_dataset_name(name: str, *, config: str | None, train_split: str, test_split: str,
                         evaluate: bool, flag: str = "--dataset_name") -> ResolvedData:
    """The train source (and the test split's, when ``evaluate``) of ``--dataset_name``, as ``trl sft`` picks them."""
    splits = dataset_splits(name, config=config, flag=flag,
                            splits=[train_split, test_split] if evaluate else [train_split])
    train = _pick(splits, train_split, "--dataset_train_split", name, "train on")
    evalset = _pick(splits, test_split, "--dataset_test_split", name, "evaluate on") if evaluate else None
    return ResolvedData(train=as_source(train, f"{Path(name).name}-{train_split}"),
                        eval=None if evalset is None else as_source(evalset, f"{Path(name).name}-{test_split}"),
                        train_split=train_split, eval_split=test_split if evaluate else None)


def eval_split_of(path: str, flag: str = "--validation_data_path") -> tuple[str, str | None]:
    """Evaluation data given as a path: a ``DatasetDict`` folder evaluates on its test split (else validation, valid,
    dev), refused when it has none of them; any other path is returned as it is. Returns ``(path, split)``."""
    folder = Path(path).expanduser()
    if not (folder / "dataset_dict.json").is_file():
        return path, None
    splits = _dict_splits(folder)
    for split in EVAL_SPLITS:
        if split in splits:
            return str(folder / split), split
    raise LocalDatasetError(f"{flag} {path} is a DatasetDict with the splits {', '.join(splits)} and none of "
                            f"{', '.join(EVAL_SPLITS)}; pass the split's own folder ({path}/SPLIT) to evaluate on it")


# ------------------------------------------------------------------------------------------ TRL's mixtures

_ENTRY_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")


def mixture_entry(value: Any, i: int) -> dict[str, Any]:
    """One ``datasets:`` entry (TRL's ``DatasetConfig``): a mapping, its JSON, or a bare path."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise LocalDatasetError(f"--datasets entry {i}: not a JSON object: {text[:120]}") from None
        else:
            value = {"path": text}
    if not isinstance(value, dict) or not value.get("path"):
        raise LocalDatasetError(f"datasets[{i}]: each entry needs a `path` (TRL's DatasetConfig)")
    unknown = sorted(set(value) - set(_ENTRY_KEYS))
    if unknown:
        raise LocalDatasetError(f"datasets[{i}]: unknown key(s) {unknown}; TRL's DatasetConfig has "
                                f"{', '.join(_ENTRY_KEYS)}")
    if value.get("fraction") is not None:
        raise LocalDatasetError(
            f"datasets[{i}] ({value['path']}): fraction keeps the first rows of each dataset in trl sft; pf-trl "
            "mixes by weight instead: drop fraction (the datasets are concatenated), or write a data config "
            "(--data_config mix.yaml, `sampling:` weights)")
    columns = value.get("columns")
    if columns is not None and not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
        raise LocalDatasetError(f"datasets[{i}]: columns must be a list of column names")
    return value


def resolve_mixture(entries: list[Any]) -> DataConfig:
    """TRL's ``datasets:`` list as a pf-trl data config: each entry's split of its local dataset, concatenated in
    order (``trl sft``'s ``concatenate_datasets``); ``columns`` keeps those columns."""
    sources = []
    for i, raw in enumerate(entries):
        entry = mixture_entry(raw, i)
        where = f"datasets[{i}] path"
        splits = dataset_splits(entry["path"], config=entry.get("name"), data_dir=entry.get("data_dir"),
                                data_files=entry.get("data_files"), flag=where,
                                splits=[entry.get("split") or "train"])
        split = entry.get("split") or "train"
        if split not in splits:
            raise LocalDatasetError(f"datasets[{i}] ({entry['path']}): no {split!r} split (its splits: "
                                    f"{', '.join(splits)}); set `split:` to one of them")
        name = f"{i}-{Path(entry['path']).name}-{split}"
        sources.append(MixtureSource(name=name, data_paths=splits[split], retain_columns=entry.get("columns")))
    try:
        return DataConfig(sources=sources)
    except DataConfigError as exc:
        raise LocalDatasetError(f"datasets: {exc}") from exc
