"""The reference precompute of TRL's DPO and KTO trainers on several processes: TRL writes the precomputed column into
the dataset's cache folder on the main process and every process reads it from there, which an in-memory dataset
cannot give (its cache folder is a temporary folder of each process): refused in one line before any work, instead
of a ``FileNotFoundError`` on every other rank after the main process's precompute."""

from __future__ import annotations

from typing import Any

from pf_trl.errors import ConfigError

__all__ = ["refuse_in_memory_precompute"]


def _in_memory(dataset: Any) -> bool:
    import datasets

    return isinstance(dataset, datasets.Dataset) and not dataset.cache_files


def refuse_in_memory_precompute(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """One line when ``precompute_ref_log_probs`` runs on several processes with a dataset held in memory."""
    world = int(getattr(args, "world_size", 1) or 1)
    if not getattr(args, "precompute_ref_log_probs", False) or world <= 1:
        return
    named = [("training", train_dataset)]
    if isinstance(eval_dataset, dict):
        named += [(f"evaluation ({key})", value) for key, value in eval_dataset.items()]
    else:
        named.append(("evaluation", eval_dataset))
    for name, dataset in named:
        if _in_memory(dataset):
            raise ConfigError(
                f"precompute_ref_log_probs=True on {world} processes: TRL writes the reference log-probabilities "
                f"into the {name} dataset's cache folder on the main process and every process reads them from "
                "there, but this dataset is held in memory (Dataset.from_list / from_dict: its cache folder is a "
                "temporary folder of each process); load it with datasets.load_dataset or load_from_disk from a "
                "folder every process sees, or set precompute_ref_log_probs=False")
