"""``pf_trl.pretokenize``: one front door to the two tokenizing engines, which share every line of tokenization.

- ``engine="local"``: :func:`pf_trl.data.pretokenize.pretokenize` (this process and ``num_proc`` forked workers),
  one shards directory written atomically;
- ``engine="ray"``: :func:`pf_trl.data.ray_engine.pretokenize_ray` (Ray Data tasks on ``RAY_ADDRESS``'s cluster,
  else a local one), a dataset of many parts with the same rows in the same order and the same identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pf_trl.data.options import PretokenizeConfig, PretokenizeError

ENGINES = ("local", "ray")


def pretokenize(source: Any, output_dir: str | Path, config: PretokenizeConfig | None = None, *,
                engine: str = "local", ray_workers: int | None = None, rows_per_part: int | None = None,
                **options: Any) -> dict[str, Any]:
    """Tokenize ``source`` into ``output_dir`` with ``engine``; returns the manifest.

    Every Hub repository of one call (a tokenizer by id, a source by Hub dataset id) is read at the one commit its
    revision named when the call first resolved it (:func:`pf_trl.hub.one_commit_per_repository`), as ``pf-trl
    pretokenize`` does: a branch that moves meanwhile changes nothing of this call.

    Args:
        source: what :func:`pf_trl.data.pretokenize.pretokenize` takes, or a Hub dataset id (``ORG/NAME``, as ``pf-trl
            pretokenize SOURCE``): its ``train`` split's files, downloaded alone; a split of several files is
            tokenized as ``pf-trl pretokenize`` does (:func:`pretokenize_data_config`, ``engine="local"`` only).
        engine: ``"local"`` or ``"ray"`` (needs ``pf-trl[ray]``; see :mod:`pf_trl.data.ray_engine`).
        ray_workers: with ``engine="ray"``, the Ray workers (default: every CPU of the cluster).
        rows_per_part: with ``engine="ray"``, source rows per part (default ~4 parts per worker).
        options: the keyword arguments of :func:`pf_trl.data.pretokenize.pretokenize` (``tokenizer``, ``overwrite``,
            ``num_proc``, ...); with ``engine="ray"`` only ``tokenizer``, ``overwrite``, ``progress`` and
            ``source_fingerprint_value``.

    Raises:
        PretokenizeError: an unknown engine, an option the engine does not take, or what the engine refuses.
    """
    from pf_trl.hub import one_commit_per_repository

    if engine not in ENGINES:
        raise PretokenizeError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    with one_commit_per_repository():
        source = _hub_source(source)
        from pf_trl.data.data_config import DataConfig

        if isinstance(source, DataConfig):
            return _pretokenize_files(source, output_dir, config, engine=engine, ray_workers=ray_workers,
                                      rows_per_part=rows_per_part, **options)
        return _pretokenize(source, output_dir, config, engine=engine, ray_workers=ray_workers,
                            rows_per_part=rows_per_part, **options)


def _hub_source(source: Any) -> Any:
    """A Hub dataset id: its ``train`` split as ``pf-trl pretokenize SOURCE`` reads it (one file: its path; several:
    a data config concatenating them in the order ``datasets`` lists them); anything else as it is."""
    from pf_trl.hub import looks_like_repo_id

    if not isinstance(source, str) or not looks_like_repo_id(source):
        return source
    from pf_trl.data.local_datasets import LocalDatasetError, resolve_dataset_name

    try:
        train = resolve_dataset_name(source, config=None, train_split="train", test_split="test", evaluate=False,
                                     flag="source").train
    except LocalDatasetError as exc:
        raise PretokenizeError(str(exc)) from None
    return train


def _pretokenize_files(data_config: Any, output_dir: str | Path, config: PretokenizeConfig | None, *, engine: str,
                       ray_workers: int | None, rows_per_part: int | None, **options: Any) -> dict[str, Any]:
    """A Hub split of several files: the CLI's data-config path (local engine; its options that apply)."""
    if engine != "local":
        raise PretokenizeError(f"engine={engine!r} tokenizes one file; this Hub split has "
                               f"{len(data_config.sources[0].data_paths)} files: use engine='local', which "
                               "concatenates them as `pf-trl pretokenize` does")
    unknown = sorted(k for k in options if k not in ("tokenizer", "overwrite", "progress", "num_proc"))
    if ray_workers is not None or rows_per_part is not None or unknown:
        given = ", ".join([*(["ray_workers"] if ray_workers is not None else []),
                           *(["rows_per_part"] if rows_per_part is not None else []), *unknown])
        raise PretokenizeError(f"a Hub split of several files does not take {given}; it takes tokenizer, "
                               "num_proc, progress and overwrite")
    from pf_trl.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    tokenizer = options.get("tokenizer", DEFAULT_TOKENIZER)
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(str(tokenizer))
    return pretokenize_data_config(data_config, output_dir, config or PretokenizeConfig(), tokenizer,
                                   num_proc=options.get("num_proc", 1), progress=options.get("progress", True),
                                   overwrite=options.get("overwrite", False))


def pretokenize_data_config(data_config: Any, output_dir: str | Path, config: PretokenizeConfig, tokenizer, *,
                            num_proc: int = 1, progress: bool = True, overwrite: bool = False,
                            say: Any = None) -> dict[str, Any]:
    """Each dataset of ``data_config`` into its own content-addressed shards (the pf-trl cache), then all of them
    as one shards directory at ``output_dir`` (a bucket URI: written into staging, then uploaded); returns its
    manifest. What ``pf-trl pretokenize --data_config`` (and ``pf-trl pretokenize ORG/NAME`` of a split of several
    files) runs.

    Raises:
        PretokenizeError: ``output_dir`` exists and not ``overwrite``; DataConfigError: a source cannot be read.
    """
    from pf_trl.data.mixture import load_mixture, write_mixture_shards
    from pf_trl.storage import is_remote

    def load():
        return load_mixture(data_config, tokenizer, config, num_proc=num_proc, progress=progress,
                            **({"say": say} if say else {}))

    if is_remote(output_dir):  # written into staging, then uploaded (manifest last)
        from pf_trl.data.remote import publish_through_staging

        return publish_through_staging(str(output_dir), lambda local: write_mixture_shards(
            load(), local, shard_size=config.shard_size), overwrite=overwrite)
    if Path(output_dir).exists() and not overwrite:  # before any tokenizing
        raise PretokenizeError(f"output {output_dir} already exists; choose a new directory or pass --overwrite")
    return write_mixture_shards(load(), output_dir, overwrite=overwrite, shard_size=config.shard_size)


def _pretokenize(source: Any, output_dir: str | Path, config: PretokenizeConfig | None, *, engine: str,
                 ray_workers: int | None, rows_per_part: int | None, **options: Any) -> dict[str, Any]:
    if engine == "local":
        if ray_workers is not None or rows_per_part is not None:
            raise PretokenizeError("ray_workers and rows_per_part apply to engine='ray' only")
        from pf_trl.data.pretokenize import pretokenize as pretokenize_local

        return pretokenize_local(source, output_dir, config, **options)
    from pf_trl.data.ray_engine import pretokenize_ray

    unknown = sorted(k for k in options if k not in ("tokenizer", "overwrite", "progress", "source_fingerprint_value"))
    if unknown:
        raise PretokenizeError(f"engine='ray' does not take {', '.join(unknown)}; use engine='local' for them")
    if "tokenizer" not in options:
        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER

        options["tokenizer"] = DEFAULT_TOKENIZER
    return pretokenize_ray(source, output_dir, config, num_workers=ray_workers, rows_per_part=rows_per_part,
                           **options)
