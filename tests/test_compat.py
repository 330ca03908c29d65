"""Every private upstream symbol pf-trl touches (pf_trl._compat.PRIVATE_SYMBOLS) still exists in the installed
transformers, TRL, torch, datasets, accelerate and argparse."""

from __future__ import annotations

import pytest

from pf_trl._compat import PRIVATE_SYMBOLS, PrivateSymbol, exists

REPO_FILES = {path for s in PRIVATE_SYMBOLS for path in s.used_in}


@pytest.mark.parametrize("symbol", [
    pytest.param(s, marks=pytest.mark.skipif(s.legacy, reason="used only with transformers < 4.53 (legacy suite)"))
    for s in PRIVATE_SYMBOLS
], ids=[f"{s.owner}.{s.name}" for s in PRIVATE_SYMBOLS])
def test_private_symbol_still_exists(symbol):
    if symbol.optional and not exists(symbol):
        pytest.skip(f"{symbol.owner}.{symbol.name} is gone; pf-trl falls back without it (optional)")
    assert exists(symbol), f"{symbol.owner}.{symbol.name} (used in {', '.join(symbol.used_in)}) is gone upstream"


@pytest.mark.parametrize("made_up", [
    PrivateSymbol("transformers.Trainer", "_pf_no_such_method", ("nowhere.py",)),
    PrivateSymbol("transformers.Trainer", "_pf_no_such_attribute", ("nowhere.py",), kind="source"),
    PrivateSymbol("trl.no_such_module", "_x", ("nowhere.py",)),
], ids=["attr", "source", "module"])
def test_a_made_up_symbol_is_reported_missing(made_up):
    assert not exists(made_up)


def test_the_registry_names_real_files_and_accessors():
    from pathlib import Path

    import pf_trl._compat as compat

    root = Path(__file__).resolve().parents[1]
    missing = sorted(p for p in REPO_FILES if not (root / p).exists())
    assert not missing, f"_compat lists files that are gone: {missing}"
    for s in PRIVATE_SYMBOLS:
        if s.via:
            assert callable(getattr(compat, s.via)), s.via
        for path in s.used_in:  # the file still touches the symbol (directly, or through the accessor)
            text = (root / path).read_text(encoding="utf-8")
            assert s.name in text or (s.via and s.via in text), f"{path} no longer uses {s.name}: update _compat"


def test_a_shuffled_stream_is_recognised():
    import datasets

    from pf_trl._compat import stream_shuffling

    stream = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset()
    assert stream_shuffling(stream) is None
    assert stream_shuffling(stream.shuffle(seed=0, buffer_size=4)) is not None
    assert stream_shuffling(stream.shuffle(seed=0, buffer_size=4).map(lambda row: row)) is not None


def test_the_attention_accessors():
    import torch
    import transformers

    from pf_trl._compat import attn_implementation, can_set_attn_implementation, replace_causal_mask_builder

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("eager")
    assert attn_implementation(model.config) == "eager"
    assert attn_implementation(object()) is None
    assert can_set_attn_implementation(model) is True
    assert can_set_attn_implementation(object()) is None  # no such check: the caller decides
    assert replace_causal_mask_builder(torch.nn.Linear(1, 1), lambda self, *a: None) is False  # no builder to replace

    class OwnMask(torch.nn.Module):
        def _update_causal_mask(self, *args):
            return "own"

    module = OwnMask()
    assert replace_causal_mask_builder(module, lambda self, *args: "replaced") is True
    assert module._update_causal_mask() == "replaced"
