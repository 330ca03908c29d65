"""One root exception: every exception class of pf_trl and preprocess_service is a PfTrlError.

The walk reads the sources (ast) instead of importing every module (torch, transformers, fastapi: ~20 s), so it runs
in the fast lane. A class counts as an exception when one of its bases is a builtin exception or, by name, another
exception class of the two packages; warnings are not errors and are left out.
"""

from __future__ import annotations

import ast
import builtins
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pf_trl", "preprocess_service")
BUILTIN_EXCEPTIONS = {name for name, obj in vars(builtins).items()
                      if isinstance(obj, type) and issubclass(obj, BaseException) and not issubclass(obj, Warning)}


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def exception_classes(sources: dict[str, str]) -> dict[str, list[str]]:
    """``{"module.Class": [base names]}`` for every exception class defined at module level in ``sources``
    (``{module: source text}``)."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for module, text in sources.items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (module, [_base_name(b) for b in node.bases])
    exceptions: set[str] = set()
    changed = True
    while changed:  # a class is an exception when a base is one (builtin, or one of ours found so far)
        changed = False
        for name, (_, bases) in classes.items():
            if name not in exceptions and any(b in BUILTIN_EXCEPTIONS or b in exceptions for b in bases):
                exceptions.add(name)
                changed = True
    return {f"{classes[n][0]}.{n}": classes[n][1] for n in sorted(exceptions)}


def outside_root(sources: dict[str, str]) -> list[str]:
    """The exception classes of ``sources`` whose bases never reach ``PfTrlError`` (the root itself excepted)."""
    found = exception_classes(sources)
    by_name = {qual.rsplit(".", 1)[1]: bases for qual, bases in found.items()}

    def under_root(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == "PfTrlError":
            return True
        return name not in seen and any(under_root(b, seen | {name}) for b in by_name.get(name, ()))

    return [qual for qual in found if qual.rsplit(".", 1)[1] != "PfTrlError" and not under_root(qual.rsplit(".", 1)[1])]


@functools.cache
def package_sources() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[module] = path.read_text(encoding="utf-8")
    return out


def test_every_exception_class_is_a_pf_trl_error():
    sources = package_sources()
    found = exception_classes(sources)
    assert len(found) >= 30, sorted(found)  # the walk finds them (30 classes and the root when this was written)
    assert outside_root(sources) == []


@pytest.mark.parametrize("source", [
    "class Stray(ValueError):\n    pass\n",
    "class Base(RuntimeError):\n    pass\n\n\nclass Child(Base):\n    pass\n",
], ids=["stray", "inherited"])
def test_a_class_outside_the_root_is_reported(source):
    sources = {**package_sources(), "pf_trl.fake": source}
    assert outside_root(sources) and all(q.startswith("pf_trl.fake.") for q in outside_root(sources))


def test_the_root_is_exported_and_keeps_builtin_bases():
    import pf_trl
    from pf_trl.batching.sampler import SamplerError, TokenBudgetBatchSampler
    from pf_trl.data.service_client import DatasetServiceError
    from pf_trl.data.shards import ShardsError
    from pf_trl.errors import PfTrlError

    assert pf_trl.PfTrlError is PfTrlError and "PfTrlError" in pf_trl.__all__
    assert issubclass(ShardsError, ValueError) and issubclass(DatasetServiceError, RuntimeError)
    with pytest.raises(ValueError) as info:  # `except ValueError` written before the root keeps working
        TokenBudgetBatchSampler([5, 3], max_tokens=0)
    assert isinstance(info.value, (SamplerError, PfTrlError))


# ------------------------------------------------------------------------------ the trainer's own refusals

# where a builtin raise is the protocol, not a refusal a user meets: json.dump's ``default`` must raise TypeError
BUILTIN_RAISES_ALLOWED = {("pf_trl.trainer.resume", "_json_default")}
BUILTINS_REPLACED = ("ValueError", "TypeError", "RuntimeError")


def bare_builtin_raises(sources: dict[str, str], prefixes: tuple[str, ...]) -> list[str]:
    """``["module.function: raise ValueError", ...]`` for each ``raise ValueError(...)`` / ``TypeError`` /
    ``RuntimeError`` in the modules of ``sources`` under ``prefixes`` (a PfTrlError subclass is not bare)."""
    found = []
    for module, text in sources.items():
        if not module.startswith(prefixes):
            continue
        for func in ast.walk(ast.parse(text)):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or (module, func.name) in \
                    BUILTIN_RAISES_ALLOWED:
                continue
            for node in ast.walk(func):
                exc = node.exc if isinstance(node, ast.Raise) else None
                called = exc.func if isinstance(exc, ast.Call) else exc
                if isinstance(called, ast.Name) and called.id in BUILTINS_REPLACED:
                    found.append(f"{module}.{func.name}: raise {called.id}")
    return sorted(set(found))


def test_the_trainer_and_the_parallelism_checks_raise_pf_trl_errors():
    assert bare_builtin_raises(package_sources(), ("pf_trl.trainer", "pf_trl.parallel")) == []


def test_a_bare_builtin_raise_is_reported():
    fake = "def refuse(x):\n    if x:\n        raise ValueError('no')\n"
    assert bare_builtin_raises({"pf_trl.trainer.fake": fake}, ("pf_trl.trainer",)) == [
        "pf_trl.trainer.fake.refuse: raise ValueError"]


def test_the_trainer_errors_keep_their_builtin_base():
    from pf_trl.errors import ConfigError, ModelSupportError, PfTrlError, ResumeError, TrainingDataError
    from pf_trl.trainer.adapters import lora_config

    for cls in (ConfigError, ModelSupportError, ResumeError, TrainingDataError):
        assert issubclass(cls, PfTrlError) and issubclass(cls, ValueError)
    with pytest.raises(ValueError) as info:  # `except ValueError` keeps working
        lora_config("dora", r=8, lora_alpha=16, lora_dropout=0.0, target_modules=None)
    assert isinstance(info.value, ConfigError)
