"""Every private upstream symbol pf-trl touches, in one place.

pf-trl uses a few private attributes of transformers, TRL, torch, datasets, accelerate and argparse, each for lack of
a public hook (docs/training.md, "Private symbols we still use", says why for each). They are listed in
:data:`PRIVATE_SYMBOLS`, and ``tests/test_compat.py`` checks that each one still exists in the installed versions, so
an upgrade that removes one fails a test that names it instead of a training run.

Uses outside the files other work is reshaping go through the accessors below; the others are listed with their file
(``via=None``) and should move here when those files are next edited. This module imports nothing heavy at import
time: each accessor imports what it needs when called.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

__all__ = ["PRIVATE_SYMBOLS", "PrivateSymbol", "attn_implementation", "can_set_attn_implementation",
           "dataset_fingerprint", "dataset_indices", "is_help_action", "is_store_bool_action", "maybe_mark_dynamic",
           "parser_actions", "replace_causal_mask_builder", "saved_data_files", "stream_ex_iterable",
           "stream_shuffling"]


@dataclass(frozen=True)
class PrivateSymbol:
    """``owner`` (an importable dotted path) has ``name``.

    ``kind``: ``"attr"``: ``hasattr(owner, name)``; ``"source"``: an instance attribute, set in the owner's code, so
    ``name`` appears in the owner's source. ``optional``: pf-trl falls back when it is missing (the test reports it,
    it does not fail). ``legacy``: only used with transformers < 4.53 (the legacy suite), absent from the pinned
    versions on purpose."""

    owner: str
    name: str
    used_in: tuple[str, ...]
    via: str | None = None  # the accessor of this module that wraps it, when the use goes through one
    kind: str = "attr"
    optional: bool = False
    legacy: bool = False


PRIVATE_SYMBOLS: tuple[PrivateSymbol, ...] = (
    # TRL's choice of its head's compact path (only labelled positions, on Triton devices): the DPO benchmark's
    # trl-completions mode reads it as true on CPU
    PrivateSymbol("trl.trainer.utils", "_use_triton", ("benchmarks/dpo_throughput.py",)),
    # torch: the parameters and buffers DDP leaves alone (--ignore_bias_buffers, as TRL's scripts set it)
    PrivateSymbol("torch.nn.parallel.distributed", "_ddp_params_and_buffers_to_ignore",
                  ("pf_trl/trainer/trl_script.py",), kind="source"),
    # transformers
    PrivateSymbol("transformers.Trainer", "_track_num_input_tokens", ("pf_trl/trainer/accounting.py",)),
    PrivateSymbol("transformers.Trainer", "_memory_tracker", ("pf_trl/trainer/accounting.py",), kind="source"),
    PrivateSymbol("transformers.Trainer", "_get_num_items_in_batch",
                  ("pf_trl/trainer/trainer.py", "pf_trl/trainer/preference/budget.py")),
    PrivateSymbol("transformers.Trainer", "_remove_unused_columns", ("pf_trl/trainer/preference/budget.py",)),
    PrivateSymbol("transformers.Trainer", "_issue_warnings_after_load", ("pf_trl/trainer/trainer.py",)),
    PrivateSymbol("transformers.PreTrainedModel", "_can_set_attn_implementation",
                  ("pf_trl/attention/enable.py", "pf_trl/attention/hf_sdpa.py"), via="can_set_attn_implementation",
                  optional=True),
    PrivateSymbol("transformers.PretrainedConfig", "_attn_implementation",
                  ("pf_trl/attention/enable.py", "pf_trl/attention/hf_sdpa.py", "pf_trl/attention/support.py"),
                  via="attn_implementation"),
    # the dev tools' tiny vision-language models set it on the config before building the model
    PrivateSymbol("transformers.PretrainedConfig", "_attn_implementation", ("pf_trl_dev/tiny_vlm.py",)),
    # a config's own name (its folder), read to name a model's tokenizer in messages
    PrivateSymbol("transformers.PretrainedConfig", "_name_or_path", ("pf_trl/data/tokenizer.py",), kind="source"),
    PrivateSymbol("transformers.LlamaModel", "_update_causal_mask",
                  ("pf_trl/attention/enable.py", "pf_trl/attention/legacy.py"), via="replace_causal_mask_builder",
                  legacy=True),
    # TRL
    PrivateSymbol("trl.kernels.chunked_logprob", "_use_triton", ("pf_trl/trainer/loss.py",), optional=True),
    PrivateSymbol("trl.trainer.sft_trainer", "BaseTunerLayer", ("pf_trl/trainer/fields.py",)),
    PrivateSymbol("trl.SFTTrainer", "_tag_names", ("pf_trl/trainer/trainer.py",)),
    PrivateSymbol("trl.SFTTrainer", "_metrics", ("pf_trl/trainer/trainer.py",), kind="source"),
    # the packed forward wraps the fused LM head TRL's DPOTrainer installs and calls with `fused_lm_head=True`
    PrivateSymbol("trl.trainer.utils", "add_fused_lm_head", ("pf_trl/trainer/dpo_forward.py",)),
    # GRPO / RLOO: every log-probability forward outside generation goes through this one method (replaced by the
    # packed forward); generation through _generate (run with the model's own attention implementation)
    PrivateSymbol("trl.GRPOTrainer", "_get_per_token_logps_and_entropies", ("pf_trl/trainer/rl/mixin.py",)),
    PrivateSymbol("trl.RLOOTrainer", "_get_per_token_logps_and_entropies", ("pf_trl/trainer/rl/mixin.py",)),
    PrivateSymbol("trl.GRPOTrainer", "_generate", ("pf_trl/trainer/rl/mixin.py",)),
    PrivateSymbol("trl.RLOOTrainer", "_generate", ("pf_trl/trainer/rl/mixin.py",)),
    # torch
    PrivateSymbol("torch", "_assert_async", ("pf_trl/attention/hf.py",)),
    PrivateSymbol("torch._dynamo", "maybe_mark_dynamic", ("pf_trl/batching/collator.py",), via="maybe_mark_dynamic"),
    PrivateSymbol("torch.Tensor", "_version", ("pf_trl/attention/stateful.py",)),  # in-place writes to a reused buffer
    # the fused CPU flash kernel, called for the log-sum-exp it returns
    PrivateSymbol("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu",
                  ("pf_trl/attention/backends/sdpa.py",)),
    # datasets
    PrivateSymbol("datasets.Dataset", "_indices", ("pf_trl/data/mixture.py", "pf_trl/data/pretokenize.py"),
                  via="dataset_indices", kind="source"),
    PrivateSymbol("datasets.Dataset", "_fingerprint", ("pf_trl/data/pretokenize.py",), via="dataset_fingerprint",
                  kind="source"),
    # the data files a save_to_disk folder lists in its state.json (what datasets' own loader reads)
    PrivateSymbol("datasets.Dataset", "_data_files", ("pf_trl/data/source_files.py",), via="saved_data_files",
                  kind="source"),
    PrivateSymbol("datasets.IterableDataset", "_ex_iterable", ("pf_trl/data/identity.py",), via="stream_ex_iterable",
                  kind="source"),
    # _shuffling: datasets < 5 (gone in 5.x, where a shuffled stream wraps its iterable in the class below)
    PrivateSymbol("datasets.IterableDataset", "_shuffling", ("pf_trl/data/streaming.py",), via="stream_shuffling",
                  kind="source", optional=True),
    PrivateSymbol("datasets.iterable_dataset", "BufferShuffledExamplesIterable", ("pf_trl/data/streaming.py",),
                  via="stream_shuffling"),
    PrivateSymbol("datasets.iterable_dataset.BufferShuffledExamplesIterable", "ex_iterable",
                  ("pf_trl/data/streaming.py",), via="stream_shuffling", kind="source"),
    # accelerate: public attribute names on a class accelerate does not document as API
    PrivateSymbol("accelerate.data_loader.BatchSamplerShard", "num_processes", ("pf_trl/trainer/data_inputs.py",),
                  kind="source"),
    PrivateSymbol("accelerate.data_loader.BatchSamplerShard", "process_index", ("pf_trl/trainer/data_inputs.py",),
                  kind="source"),
    # accelerate's package check, memoised for the length of the coverage sweep (it parses metadata on every call)
    PrivateSymbol("accelerate.utils.imports", "_is_package_available", ("pf_trl_dev/coverage.py",)),
    # argparse
    PrivateSymbol("argparse.ArgumentParser", "_actions", ("pf_trl/cli/flag_table.py", "pf_trl/cli/train.py"),
                  via="parser_actions", kind="source"),
    PrivateSymbol("argparse", "_StoreTrueAction", ("pf_trl/cli/flag_table.py",), via="is_store_bool_action"),
    PrivateSymbol("argparse", "_StoreFalseAction", ("pf_trl/cli/flag_table.py",), via="is_store_bool_action"),
    PrivateSymbol("argparse", "_HelpAction", ("pf_trl/cli/flag_table.py",), via="is_help_action"),
)


def resolve(dotted: str) -> Any:
    """The object at an importable dotted path (``"transformers.Trainer"``, ``"trl.kernels.chunked_logprob"``)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def exists(symbol: PrivateSymbol) -> bool:
    """Whether ``symbol`` is still there in the installed version of its package."""
    import inspect

    try:
        owner = resolve(symbol.owner)
    except (ImportError, AttributeError):
        return False
    if symbol.kind == "source":
        classes = [c for c in getattr(owner, "__mro__", (owner,)) if c is not object]
        for cls in classes:
            try:
                if symbol.name in inspect.getsource(cls):
                    return True
            except (OSError, TypeError):
                continue
        return hasattr(owner, symbol.name)
    return hasattr(owner, symbol.name)


# -- accessors ---------------------------------------------------------------------------------------------------


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's actions (``ArgumentParser._actions``: argparse has no public list)."""
    return parser._actions


def is_store_bool_action(action: argparse.Action) -> bool:
    """``store_true`` / ``store_false`` (argparse's private action classes)."""
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def is_help_action(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction)


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a config is set to (``PretrainedConfig._attn_implementation``: transformers sets
    it publicly through ``model.set_attn_implementation`` but has no public getter), None when it has none."""
    return getattr(config, "_attn_implementation", None)


def can_set_attn_implementation(model: Any) -> bool | None:
    """Whether ``model`` routes its attention through transformers' ``AttentionInterface``
    (``PreTrainedModel._can_set_attn_implementation()``); None when this transformers has no such check."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    return bool(can_set()) if callable(can_set) else None


def replace_causal_mask_builder(module: Any, builder: Any) -> bool:
    """transformers < 4.53: ``module``'s own mask builder (``_update_causal_mask``, a method of its class) replaced on
    the instance by ``builder(self, ...)``; False when its class has none."""
    import types

    if not hasattr(type(module), "_update_causal_mask"):
        return False
    module._update_causal_mask = types.MethodType(builder, module)
    return True


def dataset_indices(dataset: Any) -> Any:
    """A ``datasets.Dataset``'s indices mapping (``_indices``; None when it was never ``select``-ed or shuffled, and
    for objects that have none)."""
    return getattr(dataset, "_indices", None)


def dataset_fingerprint(dataset: Any) -> str | None:
    """datasets' content fingerprint of a ``Dataset`` (``_fingerprint``), None for objects that have none."""
    return getattr(dataset, "_fingerprint", None)


def saved_data_files(state: Any) -> Any:
    """The data files a ``datasets.save_to_disk`` folder's ``state.json`` lists (its ``_data_files`` entries), None
    when ``state`` is not such a mapping."""
    return state.get("_data_files") if isinstance(state, dict) else None


def stream_ex_iterable(stream: Any) -> Any:
    """The examples iterable behind an ``IterableDataset`` (``_ex_iterable``), None when there is none."""
    return getattr(stream, "_ex_iterable", None)


def stream_shuffling(stream: Any) -> Any:
    """What makes an ``IterableDataset`` shuffled with a buffer, or None when it is not: datasets < 5 kept it in
    ``_shuffling``; datasets 5 wraps the examples iterable in a ``BufferShuffledExamplesIterable`` instead."""
    shuffling = getattr(stream, "_shuffling", None)
    if shuffling is not None:
        return shuffling
    ex = stream_ex_iterable(stream)
    for _ in range(64):  # a chain of wrapped iterables (map, filter, shuffle...), never a cycle in practice
        if ex is None or type(ex).__name__ == "BufferShuffledExamplesIterable":
            return ex
        ex = getattr(ex, "ex_iterable", None)
    return None


def maybe_mark_dynamic(tensor: Any, dim: int) -> None:
    """``torch._dynamo.maybe_mark_dynamic``: a hint to ``torch.compile`` that ``dim`` varies."""
    from torch._dynamo import maybe_mark_dynamic as mark

    mark(tensor, dim)
