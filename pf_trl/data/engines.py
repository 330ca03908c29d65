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
            pretokenize SOURCE``): its ``train`` split's file, downloaded alone.
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
        return _pretokenize(_hub_source(source), output_dir, config, engine=engine, ray_workers=ray_workers,
                            rows_per_part=rows_per_part, **options)


def _hub_source(source: Any) -> Any:
    """A Hub dataset id: the one file of its ``train`` split (as ``pf-trl pretokenize SOURCE`` reads it); anything
    else as it is."""
    from pf_trl.hub import looks_like_repo_id

    if not isinstance(source, str) or not looks_like_repo_id(source):
        return source
    from pf_trl.data.local_datasets import LocalDatasetError, resolve_dataset_name

    try:
        train = resolve_dataset_name(source, config=None, train_split="train", test_split="test", evaluate=False,
                                     flag="source").train
    except LocalDatasetError as exc:
        raise PretokenizeError(str(exc)) from None
    if not isinstance(train, str):
        raise PretokenizeError(f"source {source}: its train split has several files; tokenize them together with "
                               f"`pf-trl pretokenize {source} OUTPUT_DIR` or a data config (--data_config)")
    return train


def _pretokenize(source: Any, output_dir: str | Path, config: PretokenizeConfig | None, *, engine: str,
                 ray_workers: int | None, rows_per_part: int | None, **options: Any) -> dict[str, Any]:
    if engine == "local":
        if ray_workers is not None or rows_per_part is not None:
            raise PretokenizeError("ray_workers and rows_per_part apply to engine='ray' only")
        from pf_trl.data.pretokenize import pretokenize as pretokenize_local

        return pretokenize_local(source, output_dir, config, **options)
    from pf_trl.data.ray_engine import pretokenize_ray

    options.pop("progress", None)  # Ray Data reports its own progress
    unknown = sorted(k for k in options if k not in ("tokenizer", "overwrite", "source_fingerprint_value"))
    if unknown:
        raise PretokenizeError(f"engine='ray' does not take {', '.join(unknown)}; use engine='local' for them")
    if "tokenizer" not in options:
        from pf_trl.data.tokenizer import DEFAULT_TOKENIZER

        options["tokenizer"] = DEFAULT_TOKENIZER
    return pretokenize_ray(source, output_dir, config, num_workers=ray_workers, rows_per_part=rows_per_part,
                           **options)
