"""The tests' exactness rule (tests/tolerances.py) on float32 sums built here: a reordered sum is not bit-equal but is
within rounding; a changed term is beyond it; bit-equality needs its reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tolerances import (
    assert_bit_equal,
    assert_other_math,
    assert_same_math,
    relative_gap,
    sum_rtol,
)


def _sequential_sums(n: int = 4096, orders: int = 8) -> list[float]:
    """Float32 sums of the same ``n`` positive terms, added one by one in ``orders`` different orders."""
    rng = np.random.default_rng(0)
    terms = rng.random(n, dtype=np.float32)
    return [float(np.cumsum(terms[rng.permutation(n)], dtype=np.float32)[-1]) for _ in range(orders)]


def test_a_reordered_float32_sum_is_within_rounding_and_not_bit_equal():
    sums = _sequential_sums()
    first, rest = [sums[0]] * (len(sums) - 1), sums[1:]
    assert len(set(sums)) > 1, "every order gave the same bits: the example shows nothing"
    with pytest.raises(AssertionError, match="differs in bits"):
        assert_bit_equal(first, rest, why="a wrong claim: the order of the additions differs")
    # one by one, 4096 terms drift by ~1e-6 relative here: more than LOSS_RTOL, within the sum's bound
    assert relative_gap(first, rest) <= sum_rtol(4096)
    assert_same_math(first, rest, what="reordered sums", rtol=sum_rtol(4096))
    with pytest.raises(AssertionError, match="within 100 x"):  # a control cannot pass on rounding alone
        assert_other_math(first, rest, what="reordered sums")


def test_a_changed_term_is_beyond_rounding():
    losses = [10.309164047241211, 10.232975006103516]
    other = [losses[0], losses[1] * (1 + 1e-5)]
    with pytest.raises(AssertionError, match=r"what\[1\]|relative gap"):
        assert_same_math(losses, other, what="what")
    assert_same_math(losses, [10.309163093566895, losses[1]], what="one ulp apart")  # seen on another machine
    assert_other_math(losses, [x * 1.001 for x in losses], what="changed")  # 1e-3: 1000 x LOSS_RTOL


def test_a_tensor_compares_to_its_largest_entry_and_bit_equality_needs_a_reason():
    grad = torch.tensor([[1.0, -2.0], [3e-9, 0.5]])
    rounded = grad.clone()
    rounded[1, 0] = 1e-9  # an entry that cancelled to near zero: its rounding is the large terms' (2e-9 / 2.0)
    assert_same_math(grad, rounded, what="gradient")
    with pytest.raises(AssertionError, match="relative gap"):
        assert_same_math(grad, grad * (1 + 1e-4), what="gradient")
    with pytest.raises(AssertionError, match="needs the reason"):
        assert_bit_equal(grad, grad.clone(), why=" ")
    with pytest.raises(AssertionError, match="float32"):
        assert_bit_equal(grad, grad.double(), why="the same operations")  # a dtype is part of the bits
    assert_bit_equal({"loss": [1.5, 2.0], "grad": grad}, {"loss": [1.5, 2.0], "grad": grad.clone()}, why="copies")
