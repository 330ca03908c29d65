"""The flags of ``trl sft`` beyond ``SFTConfig``, declared on ``pf-trl train`` from TRL's own dataclasses.

:func:`extended_arguments` adds every field of TRL's ``ScriptArguments`` / ``DatasetMixtureConfig`` to
``DataArguments`` and every field of ``ModelConfig`` to ``ModelArguments`` (those pf-trl already declares under the same
name, ``model_name_or_path``, ``lora_alpha``, ``lora_dropout``, keep pf-trl's declaration, which means the same), with
TRL's types, defaults and help, except where :data:`ADAPTED` says otherwise. Built when the full parser is (it imports
transformers anyway), so a field a new TRL adds becomes a flag, and
:mod:`pf_trl.trainer.script_parity` must classify it.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import field

from pf_trl.trainer.script_parity import FIELDS, TRL_SCRIPT_CLASSES

# Flags taking several values (nargs "+"): the cheap pre-import parse needs to know (no TRL import there).
LIST_FLAGS = ("lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "datasets")
# Boolean flags (alone they mean true, as HfArgumentParser reads them)
BOOL_FLAGS = ("use_peft", "use_rslora", "use_dora", "load_in_8bit", "load_in_4bit", "use_bnb_nested_quant",
              "dataset_streaming", "ignore_bias_buffers", "streaming")
# The names of the flags this module declares (checked against TRL by tests/test_parity.py).
FLAG_NAMES = tuple(name for name in FIELDS if name not in ("model_name_or_path", "lora_alpha", "lora_dropout"))

# Where pf-trl declares a TRL field differently (same name and meaning, another type or default):
ADAPTED = {
    # unset: --torch_dtype decides (one setting, two names); TRL's default float32 would override it silently
    "dtype": (str | None, field(default=None, metadata={
        "help": "TRL's name of --torch_dtype: the dtype the model is loaded in. Unset: --torch_dtype (default auto).",
        "choices": ["auto", "bfloat16", "float16", "float32"]})),
    # each value: a local path, or (from a config file's `datasets:` list) one DatasetConfig entry as JSON
    "datasets": (list[str] | None, field(default=None, metadata={
        "help": "TRL's dataset mixture: local dataset paths (as --dataset_name), or in a --config file a `datasets:` "
                "list of {path, name, data_dir, data_files, split, columns}; concatenated in order."})),
}


def _trl_fields(class_names: tuple[str, ...], skip: set[str]) -> list[tuple]:
    out = []
    for module, name in TRL_SCRIPT_CLASSES:
        if name not in class_names:
            continue
        cls = getattr(importlib.import_module(module), name)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or f.name in skip:
                continue
            if f.name in ADAPTED:
                out.append((f.name, *ADAPTED[f.name]))
                continue
            spec = field(default=f.default, metadata=dict(f.metadata)) if f.default is not dataclasses.MISSING else \
                field(default_factory=f.default_factory, metadata=dict(f.metadata))
            out.append((f.name, hints[f.name], spec))
    return out


def extended_arguments(model_cls: type, data_cls: type) -> tuple[type, type]:
    """``(ModelArguments + ModelConfig's fields, DataArguments + ScriptArguments' and DatasetMixtureConfig's)``:
    subclasses, so the parsed objects are still instances of pf-trl's classes."""
    model_own = {f.name for f in dataclasses.fields(model_cls)}
    data_own = {f.name for f in dataclasses.fields(data_cls)}
    model = dataclasses.make_dataclass(
        "ModelArguments", _trl_fields(("ModelConfig",), model_own), bases=(model_cls,),
        namespace={"__module__": model_cls.__module__, "__doc__": model_cls.__doc__})
    data = dataclasses.make_dataclass(
        "DataArguments", _trl_fields(("ScriptArguments", "DatasetMixtureConfig"), data_own), bases=(data_cls,),
        namespace={"__module__": data_cls.__module__, "__doc__": data_cls.__doc__})
    return model, data
