"""How closely two runs must agree: the one rule behind every exactness assertion of the tests.

**Bit-equality** only where the two runs execute the same floating-point operations in the same order: the same
rows packed in the same order into the same micro-batches, the same kernels, the same thread count and world size.
Resuming from a checkpoint, the same bytes read from two places (a bucket and a disk, the Hub and a folder), every
rank logging one gathered value, a code path left unchanged: there one different bit is a bug, and
:func:`assert_bit_equal` requires the reason it holds.

**Float rounding** everywhere else: rows packed in another order, a stream against the file read whole, shards
against one file, other batch compositions, another kernel or thread count (BLAS and sdpa split their reductions by
the number of threads). Float addition is not associative: a reordered sum of ``n`` float32 terms rounds
differently, by at most about ``n * 2**-24`` relative (Higham's bound) and in practice by a few units in the last
place (one ulp of float32 is ``2**-23`` ~ 1.2e-7 relative). A mean loss is such a reduction over per-token terms
that are themselves reductions; two such runs were seen one ulp apart (10.309164047 vs 10.309163094). So
:data:`LOSS_RTOL`, relative 1e-6 (~8 ulps), for float32 losses and metrics, a few optimizer steps included;
:func:`sum_rtol` where a value is a longer sum; tensors (gradients, weights, activations) are compared relative to
their largest entry, since entries that cancel to near zero carry the rounding of the large terms they summed.

**bfloat16** keeps 8 significant bits (unit roundoff ``2**-9`` ~ 2e-3): a loss from a bfloat16 forward lies within
:data:`BF16_LOSS_RTOL` (1e-2) of the float32 one. The gap can be tiny (2e-6 to 7e-6 relative on the untrained tiny
models, whose loss is ~log(vocab) whatever the weights' rounding), so that bf16 ran is shown against a float32 rerun
of the same operations in the same order (bit-equal if bf16 were ignored), not by a margin.

Negative controls use :func:`assert_other_math`: the values must differ by far more than the tolerance (100 times by
default), so that a control cannot pass on rounding alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

LOSS_RTOL = 1e-6  # float32 loss or metric, same math in another order: ~8 ulps (seen: 1 ulp)
BF16_LOSS_RTOL = 1e-2  # a bfloat16 forward's loss against float32's (bf16 unit roundoff 2**-9, a few layers)
CONTROL_FACTOR = 100.0  # a negative control differs by at least this many tolerances


def sum_rtol(terms: int) -> float:
    """Relative tolerance of a float32 sum of ``terms`` same-signed values added in another order: Higham's
    worst-case ``terms * 2**-24``, never below :data:`LOSS_RTOL`."""
    return max(LOSS_RTOL, terms * 2.0**-24)


def _pairs(a, b, what: str) -> list[tuple[torch.Tensor, torch.Tensor, bool, str]]:
    """``a`` and ``b`` (numbers, tensors, or sequences / mappings of them) as aligned float64 tensor pairs, each with
    whether it compares elementwise (numbers) or against its largest entry (a tensor)."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        assert isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys(), \
            f"{what}: other keys {sorted(a)} vs {sorted(b)}"
        return [p for key in a for p in _pairs(a[key], b[key], f"{what}[{key!r}]")]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ta, tb = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
        assert ta.shape == tb.shape, f"{what}: shapes {tuple(ta.shape)} vs {tuple(tb.shape)}"
        return [(ta.double().cpu(), tb.double().cpu(), False, what)]
    if isinstance(a, Sequence) and not isinstance(a, str):
        assert isinstance(b, Sequence) and len(a) == len(b), f"{what}: lengths differ: {a!r} vs {b!r}"
        if all(isinstance(x, (int, float)) for x in (*a, *b)):
            return [(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), True, what)]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _pairs(x, y, f"{what}[{i}]")]
    return [(torch.tensor(float(a), dtype=torch.float64), torch.tensor(float(b), dtype=torch.float64), True, what)]


def _gap(x: torch.Tensor, y: torch.Tensor, elementwise: bool) -> float:
    """The relative difference of two aligned values: elementwise for numbers and lists of numbers (each loss to its
    own size), relative to the largest entry for a tensor (a gradient, a weight, an activation)."""
    if x.numel() == 0:
        return 0.0
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        return 0.0 if torch.equal(x, y) else math.inf
    diff = (x - y).abs()
    scale = torch.maximum(x.abs(), y.abs())
    if not elementwise:
        scale = scale.max().expand_as(diff)
    return float(torch.where(scale > 0, diff / scale.clamp(min=1e-300), diff).max())


def relative_gap(a, b) -> float:
    """The largest relative difference between ``a`` and ``b`` (see :func:`assert_same_math` for how it is scaled)."""
    return max((_gap(x, y, e) for x, y, e, _ in _pairs(a, b, "value")), default=0.0)


def assert_same_math(a, b, *, what: str, rtol: float = LOSS_RTOL) -> None:
    """``a`` and ``b`` are the same math up to float rounding: the same computation in another order of operations.

    Numbers and lists of numbers (losses, metrics) agree elementwise within ``rtol`` of each value; a tensor within
    ``rtol`` of its largest entry (gradient and weight entries that cancel to near zero keep
    the rounding of the large terms that formed them). Mappings and nested sequences compare entry by entry; shapes,
    lengths and keys must match exactly. ``what`` names the compared values in the failure."""
    for x, y, elementwise, name in _pairs(a, b, what):
        gap = _gap(x, y, elementwise)
        shown = f": {x.tolist()} vs {y.tolist()}" if x.numel() <= 16 else ""
        assert gap <= rtol, f"{name}: relative gap {gap:.3g} > {rtol:.3g} (float rounding){shown}"


def assert_other_math(a, b, *, what: str, rtol: float = LOSS_RTOL, factor: float = CONTROL_FACTOR) -> None:
    """A negative control: ``a`` and ``b`` differ by more than ``factor`` times the rounding tolerance ``rtol``, so
    the difference cannot come from float rounding alone."""
    gap = relative_gap(a, b)
    assert gap > factor * rtol, f"{what}: relative gap {gap:.3g} is within {factor:g} x {rtol:.3g} (rounding)"


def assert_bit_equal(a, b, *, why: str) -> None:
    """``a`` equals ``b`` to the bit (tensors: same dtype, shape and values; mappings and sequences entry by entry).
    ``why`` must say why the two runs execute the same operations in the same order (same packing, kernels, thread
    count, world size); where they do not, compare with :func:`assert_same_math`."""
    assert why.strip(), "assert_bit_equal needs the reason the runs execute the same operations in the same order"
    _bit_equal(a, b, "value", why)


def _bit_equal(a, b, what: str, why: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{what}: a tensor and a {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
        gap = 0.0 if torch.equal(a, b) else _gap(a.double().cpu(), b.double().cpu(), False)
        assert torch.equal(a, b), f"{what} differs in bits ({why}): relative gap {gap:.3g}"
    elif isinstance(a, Mapping) and isinstance(b, Mapping):
        assert a.keys() == b.keys(), f"{what}: other keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            _bit_equal(a[key], b[key], f"{what}[{key!r}]", why)
    elif isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str):
        assert len(a) == len(b), f"{what}: lengths differ: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _bit_equal(x, y, f"{what}[{i}]", why)
    else:
        assert a == b, f"{what} differs in bits ({why}): {a!r} vs {b!r}"
