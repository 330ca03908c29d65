"""The coverage sweep and the support it decides: every causal LM of transformers is exact or refused with a reason.

``test_committed_matrix_is_fresh`` re-runs the whole sweep (a few minutes on 2 cores, one type at a time) and fails
when ``pf_trl/attention/support.json`` or ``docs/models.md`` differ from it: regenerate them with
``python -m pf_trl_dev.coverage --write``. The other tests are small and check the sweep's negative controls,
the runtime decisions, the self-check and the CLI.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pf_trl.attention import PaddingFreeError, UnsupportedModelError, enable_padding_free, evidence, support  # noqa: E402
from pf_trl_dev import coverage  # noqa: E402
from pf_trl_dev.tiny import tiny_model  # noqa: E402

MIN_EXACT = 60  # the target: architectures exact by default
MIN_BOTH_EXACT = 132  # exact by default in both modes (transformers 5.24: 132 of 199; 5.25: 136 of 203)
SINK_AND_LLAMA4_TYPES = ("gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "llama4_text", "llama4")


@pytest.fixture(scope="module")
def fresh_matrix():
    return coverage.run_sweep(progress=False)


@pytest.mark.slow
def test_committed_matrix_is_fresh(fresh_matrix):
    """The committed matrix holds this transformers' sweep as a fresh one would write it (the other releases' results
    untouched); statuses and reasons are compared, measured numbers masked (float noise differs across CPUs)."""
    committed = coverage.committed_matrix()
    version = transformers.__version__
    assert version in committed["swept"], (
        f"support.json holds no sweep of transformers {version} (swept: {committed['swept']}): run "
        "`python -m pf_trl_dev.coverage --write` with it"
    )
    merged = coverage.merged_matrix(coverage._stable(fresh_matrix), committed)
    fresh, old = coverage.fingerprint(merged), coverage.fingerprint(committed)
    changed = sorted(t for t in set(fresh) | set(old) if fresh.get(t) != old.get(t))
    assert not changed, f"stale support matrix for {changed[:10]}: run `python -m pf_trl_dev.coverage --write`"
    assert committed["valid"] == evidence.declared_range(committed["swept"])
    docs = coverage.comparable(coverage.DOCS_PATH.read_text())
    assert docs == coverage.comparable(coverage.render_markdown(merged)), "docs/models.md is stale"


@pytest.mark.slow
def test_sweep_targets(fresh_matrix):
    models = fresh_matrix["models"]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pf_trl.attention.multimodal import VISION_TYPES

    assert set(models) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(VISION_TYPES)  # + the mRoPE VLMs, on text
    exact = [t for t, e in models.items() if e["huggingface"]["status"] == "exact"]
    assert len(exact) >= MIN_EXACT, len(exact)
    assert coverage.both_exact(models) >= MIN_BOTH_EXACT, coverage.both_exact(models)
    for model_type in SINK_AND_LLAMA4_TYPES:  # attention sinks and Llama 4: exact in both modes
        assert all(models[model_type][m]["status"] == "exact" for m in coverage.MODES), models[model_type]
    assert models["deepseek_v4"]["huggingface"]["status"] == "exact"  # compressed layers per example
    for model_type, entry in models.items():
        for mode in coverage.MODES:
            res = entry[mode]
            if res["status"] == "exact":
                # the negative control saw a leak, and the comparison stayed far below it
                assert entry["leak"] >= coverage.LEAK_MIN, model_type
                assert res["model_err"] <= coverage.LOSS_ATOL and res["loss_err"] <= coverage.LOSS_ATOL
            else:
                assert res.get("reason"), (model_type, mode)  # every non-exact entry names its reason
            # a crash is any error that is not a refusal naming its reason: pf-trl must refuse instead
            assert res["status"] != "crash", (model_type, mode, res.get("reason"))


def test_the_sweep_sees_a_leak_when_pf_trl_does_nothing(monkeypatch):
    """Negative control: with enable_padding_free a no-op, the direct call (use_cache=True default) leaks."""
    import pf_trl.attention as attention

    monkeypatch.setattr(attention, "enable_padding_free", lambda model, **kw: model)
    with coverage._quiet(), support.use_matrix({}):
        entry = coverage.sweep_type(coverage._Sweep(), "llama")
    for mode in coverage.MODES:
        assert entry[mode]["status"] == "mismatch", entry[mode]
        assert entry[mode]["model_err"] > 100 * coverage.LOSS_ATOL
    assert entry["leak"] > 100 * coverage.LOSS_ATOL


@pytest.mark.slow
def test_sweep_entry_exact_for_llama():
    with coverage._quiet(), support.use_matrix({}):
        entry = coverage.sweep_type(coverage._Sweep(), "llama")
    for mode in coverage.MODES:
        assert entry[mode]["status"] == "exact", entry[mode]
        assert entry[mode]["grad_err"] <= coverage.GRAD_RTOL


# ------------------------------------------------------------------------------------------- runtime decisions


def test_exact_types_are_accepted_by_default():
    assert len(support.exact_types("huggingface")) >= MIN_EXACT
    for model_type in ("llama", "gemma3_text", "gpt2"):
        assert support.decide(model_type, "X", "huggingface", allow_unverified=False) == "exact"
    model = tiny_model("gemma3_text")
    enable_padding_free(model, mode="huggingface")  # Gemma 3: refused before the sweep, exact now
    assert model._pf_padding_free["self_check"]["err"] <= model._pf_padding_free["self_check"]["tol"]


def test_known_failures_stay_refused_even_with_allow_unverified():
    model = tiny_model("roberta")
    for flag in (False, True):
        with pytest.raises(UnsupportedModelError, match="padding_idx"):
            enable_padding_free(model, mode="huggingface", allow_unverified=flag)


def test_unknown_type_gets_the_runtime_self_check():
    with support.use_matrix({}):  # no evidence for any type
        model = enable_padding_free(tiny_model("llama"), mode="internal", check=False)
        assert model._pf_padding_free["self_check"]["err"] <= model._pf_padding_free["self_check"]["tol"]  # forced
        # a type pf-trl cannot reproduce is refused by the self-check, before any training
        with pytest.raises(PaddingFreeError, match="padding_idx"):
            enable_padding_free(tiny_model("roberta"), mode="internal")


# ------------------------------------------------------------------------------------------------ self-check


@pytest.mark.parametrize("model_type", ["xglm", "openai-gpt"])
def test_self_check_catches_leaks_below_five_percent(model_type):
    """Real leaks (xglm / openai-gpt under eager) that the old 5%-of-leak criterion let through."""
    model = tiny_model(model_type)
    with support.use_matrix({}), pytest.raises(PaddingFreeError, match="self-check failed") as info:
        enable_padding_free(model, mode="huggingface", allow_unverified=True)
    msg = str(info.value)
    err = float(msg.split("alone by ")[1].split(",")[0])
    leak = float(msg.split("would give ")[1].split(")")[0])
    assert err < 0.05 * leak  # below the old threshold, far above float32 noise


def test_self_check_tolerance_follows_the_dtype():
    model = tiny_model("llama").to(torch.bfloat16)
    enable_padding_free(model, mode="internal")
    state = model._pf_padding_free["self_check"]
    assert state["err"] <= state["tol"] and state["tol"] > 1e-3  # bf16 noise, not float32's


# ----------------------------------------------------------------------------------------- config and CLI


def test_config_allow_unverified_reaches_the_trainer(tmp_path):
    import datasets

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.data.tokenizer import load_tokenizer

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[5, 6, 7]]})
    tok = load_tokenizer()
    inconclusive = {"llama": {"class": "LlamaForCausalLM",
                              **{m: {"status": "inconclusive", "reason": "no leak seen"} for m in coverage.MODES}}}
    with support.use_matrix(inconclusive):
        args = PaddingFreeConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
        with pytest.raises(UnsupportedModelError, match="allow_unverified"):
            PaddingFreeSFTTrainer(tiny_model("llama"), args=args, processing_class=tok, train_dataset=ds)
        args = PaddingFreeConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, allow_unverified=True)
        PaddingFreeSFTTrainer(tiny_model("llama"), args=args, processing_class=tok, train_dataset=ds)


def test_cli_refusal_is_one_line_exit_2(tmp_path, capsys):
    from pf_trl.cli.train import main

    folder = tmp_path / "roberta"
    tiny_model("roberta").save_pretrained(folder)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]}) for _ in range(4)))
    for extra in ([], ["--allow_unverified"]):
        code = main(["--model_name_or_path", str(folder), "--max_seq_len", "256",
                     "--training_data_path", str(data), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                     "--report_to", "none", "--use_cpu", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        refusal = [line for line in err if line.startswith("pf-trl train: error:")]
        assert len(refusal) == 1 and "roberta" in refusal[0] and "Traceback" not in "\n".join(err)
