"""Support evidence over transformers releases: records per swept release, the declared range, and what pf-trl
decides on a release or a type the sweep has not seen (the runtime self-check, not a blanket refusal)."""

from __future__ import annotations

import logging

import pytest

transformers = pytest.importorskip("transformers")

from pf_trl.attention import UnsupportedModelError, enable_padding_free, evidence, support  # noqa: E402
from pf_trl_dev import coverage  # noqa: E402
from pf_trl_dev.tiny import tiny_model  # noqa: E402

EXACT = {m: {"status": "exact"} for m in evidence.MODES}
REFUSED = {m: {"status": "refused", "reason": "it leaks (measured 0.5)"} for m in evidence.MODES}


def entry(verdict, cls="LlamaForCausalLM", leak=0.05):
    return {"class": cls, "leak": leak, **verdict}


def two_releases():
    matrix = evidence.merge(None, "5.24.0", {"llama": entry(EXACT), "electra": entry(REFUSED, "ElectraForCausalLM")},
                            coverage.HEADER)
    return evidence.merge(matrix, "5.25.0", {"llama": entry(EXACT, leak=0.04),
                                             "electra": entry(EXACT, "ElectraForCausalLM"),
                                             "ergo": entry(EXACT, "ErgoForCausalLM")}, coverage.HEADER)


def test_merge_keeps_one_record_per_verdict():
    matrix = two_releases()
    assert matrix["swept"] == ["5.24.0", "5.25.0"] and matrix["valid"] == ">=5.24.0,<5.26"
    assert [r["transformers"] for r in matrix["models"]["llama"]] == [["5.24.0", "5.25.0"]]  # the same verdict
    assert [r["transformers"] for r in matrix["models"]["electra"]] == [["5.24.0"], ["5.25.0"]]
    assert [r["transformers"] for r in matrix["models"]["ergo"]] == [["5.25.0"]]  # new in 5.25
    # re-sweeping a release replaces its results and leaves the others alone
    again = evidence.merge(matrix, "5.25.0", {"llama": entry(REFUSED)}, coverage.HEADER)
    assert [r["transformers"] for r in again["models"]["llama"]] == [["5.24.0"], ["5.25.0"]]
    assert [r["transformers"] for r in again["models"]["electra"]] == [["5.24.0"]] and "ergo" not in again["models"]


def test_a_record_holds_for_the_patch_releases_of_its_release():
    matrix = two_releases()
    assert evidence.basis(matrix, "5.25.0") == "5.25.0" and evidence.basis(matrix, "5.25.3") == "5.25.0"
    assert evidence.basis(matrix, "5.24.1") == "5.24.0"
    assert evidence.basis(matrix, "5.26.0") is None and evidence.basis(matrix, "5.23.0") is None
    assert evidence.nearest(matrix, "5.26.0") == "5.25.0" and evidence.nearest(matrix, "5.23.0") == "5.24.0"


@pytest.fixture
def release(monkeypatch):
    matrix = two_releases()
    monkeypatch.setattr(support, "matrix", lambda: matrix)

    def set_release(version):
        monkeypatch.setattr(support, "transformers_version", lambda: version)

    return set_release


def test_each_release_reads_its_own_evidence(release):
    release("5.24.1")
    with pytest.raises(UnsupportedModelError, match=r"transformers 5\.24\.0: refused"):
        support.decide("electra", "ElectraForCausalLM", "internal", allow_unverified=True)
    release("5.25.0")
    assert support.decide("electra", "ElectraForCausalLM", "internal", allow_unverified=False) == "exact"
    assert support.exact_types("huggingface") == ["electra", "ergo", "llama"]


def test_unknown_type_or_release_gets_the_self_check_not_a_blanket_refusal(release, caplog):
    release("5.25.0")
    with caplog.at_level(logging.WARNING, logger="pf_trl.attention"):
        assert support.decide("brand_new", "BrandNewForCausalLM", "huggingface", allow_unverified=False) == "unverified"
    assert "self-check decides" in caplog.text
    release("5.27.0")  # outside >=5.24.0,<5.26: no evidence, the nearest swept release advises
    assert support.decide("llama", "LlamaForCausalLM", "huggingface", allow_unverified=False) == "unverified"
    assert support.decide("electra", "ElectraForCausalLM", "huggingface", allow_unverified=False) == "unverified"
    assert support.decide("brand_new", "X", "internal", allow_unverified=False) == "unverified"


def test_a_failure_the_nearest_release_measured_needs_allow_unverified(release, monkeypatch):
    matrix = evidence.merge(two_releases(), "5.25.0", {"llama": entry(REFUSED)}, coverage.HEADER)
    monkeypatch.setattr(support, "matrix", lambda: matrix)
    release("5.26.0")
    with pytest.raises(UnsupportedModelError, match=r"outside the swept range \(>=5\.24\.0,<5\.26\).*allow_unverified"):
        support.decide("llama", "LlamaForCausalLM", "internal", allow_unverified=False)
    assert support.decide("llama", "LlamaForCausalLM", "internal", allow_unverified=True) == "unverified"


def test_unswept_release_forces_the_self_check(release):
    release("9.0.0")
    model = enable_padding_free(tiny_model("llama"), mode="internal", check=False)
    state = model._pf_padding_free["self_check"]
    assert state and state["err"] <= state["tol"] and state["leak"] > state["tol"]


def test_the_shipped_matrix_covers_the_pinned_and_the_newest_release():
    shipped = support._shipped()
    assert {"5.24.0", "5.25.0"} <= set(shipped["swept"])
    assert support.evidence_basis() == transformers.__version__  # the installed release was swept
    for version, floor in {"5.24.0": 132, "5.25.0": 136}.items():  # exact in both modes
        models = evidence.entries(shipped, version)
        assert all(e[m]["status"] != "crash" for e in models.values() for m in evidence.MODES), version
        assert coverage.both_exact(models) >= floor, (version, coverage.both_exact(models))
