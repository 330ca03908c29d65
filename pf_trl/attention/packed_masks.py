"""Packed masks for models whose own mask builder is not told the ``position_ids`` (``huggingface`` mode).

transformers keeps packed examples apart under eager / sdpa / flex attention by handing ``position_ids`` to
``masking_utils.create_causal_mask`` and its siblings, which then detect the packed rows. A few models build their
masks from a ``mask_kwargs`` dict that leaves ``position_ids`` out (transformers 5.24-5.25: gpt-oss, AFMoE,
GraniteMoeHybrid), so the packed examples attend to each other there. The same forwards accept a prepared mask
mapping (``attention_mask`` as a dict, what ``generate`` passes): :func:`install` adds a forward pre-hook to such a
module that builds that mapping with the module's own builders and the same arguments, plus ``position_ids``.

Which modules need it is read from their forward's source (``ast``): a ``mask_kwargs = {...}`` literal without a
``"position_ids"`` key, the builders called with ``**mask_kwargs`` in a dict literal, and an
``isinstance(..., dict)`` test on ``attention_mask``. Forwards that call one builder directly without
``position_ids`` (OPT, XGLM, BioGPT, the BART-style decoders) get the mask it builds, a 4-D tensor, which the
builder hands back unchanged (as transformers' packed path would build it for eager / sdpa anyway). A model that
passes ``position_ids`` itself is left alone. The self-check and the coverage sweep then measure each model.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

import torch

_HOOK_ATTR = "_pf_packed_mask_hook"


@functools.cache
def _forward_tree(cls: type) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


@functools.cache
def mask_builders_without_positions(cls: type) -> tuple[tuple[str, str], ...]:
    """``((mask key, masking_utils function), ...)`` when ``cls.forward`` builds its masks without ``position_ids``
    and accepts a prepared mask mapping; ``()`` otherwise."""
    tree = _forward_tree(cls)
    if tree is None:
        return ()
    kwarg_keys: set[str] | None = None
    builders: dict[str, str] = {}
    accepts_mapping = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if "mask_kwargs" in names:
                kwarg_keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
                continue
            for key, value in zip(node.value.keys, node.value.values):
                if (isinstance(key, ast.Constant) and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                        and any(kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == "mask_kwargs"
                                for kw in value.keywords)):
                    builders[key.value] = value.func.id
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
              and len(node.args) == 2 and isinstance(node.args[1], ast.Name) and node.args[1].id == "dict"
              and "attention_mask" in ast.unparse(node.args[0])):
            accepts_mapping = True
    if kwarg_keys is None or "position_ids" in kwarg_keys or not builders or not accepts_mapping:
        return ()
    from transformers import masking_utils

    if not all(callable(getattr(masking_utils, fn, None)) for fn in builders.values()):
        return ()
    return tuple(sorted(builders.items()))


DIRECT_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")


@functools.cache
def direct_builder_without_positions(cls: type) -> str | None:
    """The one ``masking_utils`` builder ``cls.forward`` calls directly (keyword arguments, no ``**``) without
    ``position_ids``, or ``None``."""
    tree = _forward_tree(cls)
    if tree is None:
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id.startswith("create_") and node.func.id.endswith("mask")]
    if len(calls) != 1 or calls[0].func.id not in DIRECT_BUILDERS:
        return None
    keywords = {kw.arg for kw in calls[0].keywords}
    if None in keywords or "position_ids" in keywords or "attention_mask" not in keywords:
        return None
    if "attention_mask" not in inspect.signature(cls.forward).parameters:
        return None
    return calls[0].func.id


def _embeds_like(module: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """What the mask builders read of ``inputs_embeds`` (batch, length, dtype, device), without embedding."""
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):
        return embeds
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return None
    table = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    dtype = table.weight.dtype if table is not None and hasattr(table, "weight") else torch.float32
    return torch.empty(*ids.shape[:2], 0, dtype=dtype, device=ids.device)


def _hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
    position_ids = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    # only the training / scoring call: no cache (generation keeps the model's own path), no prepared mapping
    if args or not isinstance(position_ids, torch.Tensor) or isinstance(mask, dict) or cache is not None:
        return None
    embeds = _embeds_like(module, kwargs)
    if embeds is None:
        return None
    from transformers import masking_utils

    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        return None  # a prepared 4-D mask: the builders hand it back as is
    common = dict(config=module.config, inputs_embeds=embeds, attention_mask=mask, cache=None,
                  position_ids=position_ids)
    builders = mask_builders_without_positions(type(module))
    if builders:
        prepared = {key: getattr(masking_utils, fn)(**common) for key, fn in builders}
    else:
        prepared = getattr(masking_utils, direct_builder_without_positions(type(module)))(**common)
    return args, {**kwargs, "attention_mask": prepared}


def install(model: torch.nn.Module) -> list[str]:
    """Add the pre-hook to every module of ``model`` whose forward builds its masks without ``position_ids``
    (idempotent); returns their class names."""
    fixed = []
    for module in model.modules():
        if getattr(module, _HOOK_ATTR, None) is not None or not hasattr(module, "config"):
            continue
        if mask_builders_without_positions(type(module)) or direct_builder_without_positions(type(module)):
            setattr(module, _HOOK_ATTR, module.register_forward_pre_hook(_hook, with_kwargs=True))
            fixed.append(type(module).__name__)
    return fixed
