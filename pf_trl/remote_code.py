"""Custom code in a model folder or Hub repository (its ``config.json`` ``auto_map``), as TRL treats it.

TRL forwards ``trust_remote_code`` (``SFTConfig`` / ``DPOConfig``, ``--trust_remote_code True``) to transformers'
``from_pretrained``, and transformers decides: a config whose ``auto_map`` names a class of the repository's own code
needs ``trust_remote_code=True`` unless transformers ships its ``model_type`` (then, without the flag, the shipped
class loads; with it, the repository's code does). :func:`check_remote_code` answers the same question from the
``config.json`` alone, so pf-trl refuses in one line before any weights are downloaded (a Hub id's ``config.json``
is fetched first, :func:`pf_trl.models.resolve_model_path`).

With the flag the custom class loads. pf-trl's exactness rests on its support matrix, which covers transformers' own
classes; a custom class is treated as a model type the matrix does not list: the runtime self-check decides whether
it trains padding-free (:func:`pf_trl.attention.enable.admit`).

Imports nothing heavy: transformers only when a config has an ``auto_map`` (to ask whether it ships the type).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

__all__ = ["FLAG", "RemoteCodeError", "check_remote_code", "custom_code", "is_custom_class", "tokenizer_code_error"]

FLAG = "--trust_remote_code True"
# the auto_map entries of the classes pf-trl loads a model with (a causal LM, a vision-language model, its config),
# the model class first: the one a refusal names
MODEL_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel", "AutoConfig")
# what the runtime does with custom code once trusted (the refusal says it, so the choice is an informed one)
UNVERIFIED = ("pf-trl's support matrix covers transformers' own classes only, so, as for a model type it does not "
              "list, the runtime self-check decides whether it trains padding-free")


class RemoteCodeError(PfTrlError, ValueError):
    """A model or tokenizer that needs its repository's own code, without ``trust_remote_code``; one line naming
    the flag and what the code would be."""


def _config(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _shipped(model_type: Any) -> bool:
    """transformers ships ``model_type`` (its config class is in ``CONFIG_MAPPING``)."""
    if not isinstance(model_type, str) or not model_type:
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def custom_code(folder: str | Path) -> str | None:
    """The class reference (``modeling_x.XForCausalLM``) of the code a model folder needs transformers to run: its
    ``config.json`` ``auto_map`` names a model or config class and transformers does not ship its ``model_type``.
    None otherwise (no ``auto_map``, or a shipped type, which loads without the flag as in transformers)."""
    config = _config(Path(folder).expanduser())
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict):
        return None
    named = [auto_map[k] for k in MODEL_CLASSES if auto_map.get(k)]
    if not named or _shipped(config.get("model_type")):
        return None
    ref = named[0] if isinstance(named[0], str) else next((r for r in named[0] if r), "")
    return str(ref).split("--", 1)[-1]  # "org/repo--modeling_x.X": the class, wherever its code lives


def check_remote_code(folder: str | Path, *, trust_remote_code: bool, name: str,
                      flag: str = "--model_name_or_path") -> str | None:
    """The custom class ``folder`` needs (:func:`custom_code`), or None; refused without ``trust_remote_code``.

    Raises:
        RemoteCodeError: in one line naming ``flag``, ``name``, the class and ``--trust_remote_code True``.
    """
    ref = custom_code(folder)
    if ref is not None and not trust_remote_code:
        model_type = _config(Path(folder).expanduser()).get("model_type")
        raise RemoteCodeError(
            f"{flag} {name}: its config.json maps the model (model_type {model_type!r}, which transformers does not "
            f"ship) to the repository's own code ({ref}), which runs only with {_switch(flag)}; pass it to run that "
            f"code ({UNVERIFIED}), or use a model of an architecture transformers ships")
    return ref


def _switch(flag: str) -> str:
    """How the caller turns it on: the config field for the Python API's arguments (``model``,
    ``processing_class``), else the command-line flag."""
    return "trust_remote_code=True" if flag in ("model", "processing_class") else FLAG


def tokenizer_code_error(exc: BaseException, name: str, flag: str) -> RemoteCodeError | None:
    """transformers' refusal of a tokenizer or processor that needs its own code, as one line naming the flag (None
    for any other error)."""
    text = str(exc)
    if "trust_remote_code" not in text and "custom code" not in text:
        return None
    return RemoteCodeError(f"{flag} {name}: the tokenizer or processor needs its repository's own code "
                           f"(tokenizer_config.json / processor_config.json auto_map), which runs only with "
                           f"{_switch(flag)}; pass it to run that code, or use a tokenizer transformers ships")


def is_custom_class(model: Any) -> bool:
    """``model``'s class comes from custom code (a repository's ``auto_map``), not from transformers."""
    return not type(model).__module__.startswith("transformers.")
