"""Two costs every trainer pays at construction, made cheap for a test process without changing a result; used by
tests/conftest.py for the test session and by the test processes that run many pf-trl commands in one interpreter
(tests/test_hub.py's shared Hub process).

- ``datasets`` fingerprints each ``map`` by dill-pickling its arguments, the tokenizer included, whose Python-side
  copies of the vocabulary and merges (``_vocab``, ``_merges``) take 0.4-0.7 s to pickle, three maps a trainer.
  Here the tokenizer is fingerprinted without those copies: its backend (``_tokenizer``, pickled as its JSON,
  the same vocabulary and merges) stays in the fingerprint, so two different tokenizers still differ.
- accelerate answers ``is_peft_available`` / ``is_deepspeed_available`` by parsing package metadata on every call
  (~10 a trainer); no package is installed or removed while tests run, so each answer is kept.
"""

from __future__ import annotations

from collections.abc import Callable


def install() -> Callable[[], None]:
    """Install both shortcuts; returns the function that removes them (a no-op where accelerate or datasets is
    missing: the transformers<4.44 suite's venv has neither)."""
    import functools

    try:
        from accelerate.utils import imports as accelerate_imports
        from datasets.utils import _dill
    except ImportError:
        return lambda: None

    original_save = _dill._save_transformersPreTrainedTokenizerBase

    def save_without_python_copies(pickler, obj):
        if obj.__dict__.get("_tokenizer") is None or not {"_vocab", "_merges"} & obj.__dict__.keys():
            return original_save(pickler, obj)
        light = object.__new__(type(obj))
        light.__dict__.update({k: v for k, v in obj.__dict__.items() if k not in ("_vocab", "_merges")})
        return original_save(pickler, light)

    original_available = accelerate_imports._is_package_available
    _dill._save_transformersPreTrainedTokenizerBase = save_without_python_copies
    accelerate_imports._is_package_available = functools.cache(original_available)
    # types registered before this ran keep the original function: none are (the registration is lazy)
    for obj_type, func in list(_dill.Pickler.dispatch.items()):
        if func is original_save:
            _dill.Pickler.dispatch[obj_type] = save_without_python_copies

    def remove() -> None:
        _dill._save_transformersPreTrainedTokenizerBase = original_save
        accelerate_imports._is_package_available = original_available

    return remove
