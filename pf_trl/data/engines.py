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

    Args:
        engine: ``"local"`` or ``"ray"`` (needs ``pf-trl[ray]``; see :mod:`pf_trl.data.ray_engine`).
        ray_workers: with ``engine="ray"``, the Ray workers (default: every CPU of the cluster).
        rows_per_part: with ``engine="ray"``, source rows per part (default ~4 parts per worker).
        options: the keyword arguments of :func:`pf_trl.data.pretokenize.pretokenize` (``tokenizer``, ``overwrite``,
            ``num_proc``, ...); with ``engine="ray"`` only ``tokenizer``, ``overwrite``, ``progress`` and
            ``source_fingerprint_value``.

    Raises:
        PretokenizeError: an unknown engine, an option the engine does not take, or what the engine refuses.
    """
    if engine not in ENGINES:
        raise PretokenizeError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
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
