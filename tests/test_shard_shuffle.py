"""The token-budget sampler's shard-grouped shuffle (pf_trl/batching/sampler.py: ``shard_bounds``, ``group_shards``),
which the trainer picks for a dataset streamed through a node cache it does not fit: every row once per epoch, a
stretch of the epoch reading a few shards only (the global shuffle, the negative control, reads most of them),
deterministic by seed and epoch, resumable, ranks balanced. Pure numpy, CPU, about a second; the trainer's side
against a real S3 server is in tests/test_read_ahead.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pf_trl.batching.sampler import SamplerError, TokenBudgetBatchSampler

MAX_TOKENS = 512


def _data(seed: int = 0, shards: int = 40):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(30, 90, shards)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return rng.integers(5, 160, int(bounds[-1])), bounds


def _plans(lengths, bounds, *, window, replicas=1, epoch=0, seed=3):
    samplers = [TokenBudgetBatchSampler(lengths, MAX_TOKENS, seed=seed, num_replicas=replicas, rank=r,
                                        shard_bounds=bounds, group_shards=window) for r in range(replicas)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


def _shards_per_stretch(plans, bounds, steps: int = 8) -> list[int]:
    """Distinct shards read by all ranks in each stretch of ``steps`` steps."""
    shard_of = np.searchsorted(bounds, np.arange(bounds[-1]), side="right") - 1
    per_step = [{int(shard_of[i]) for plan in plans for i in plan[s]} for s in range(len(plans[0]))]
    return [len(set().union(*per_step[k:k + steps])) for k in range(0, len(per_step) - steps + 1, steps)]


@pytest.mark.parametrize("replicas", [1, 3])
def test_every_row_once_a_few_shards_at_a_time_and_the_ranks_balanced(replicas):
    lengths, bounds = _data()
    window = 4
    samplers, plans = _plans(lengths, bounds, window=window, replicas=replicas)
    rows = sorted(i for plan in plans for batch in plan for i in batch)
    assert rows == list(range(len(lengths)))  # every row once
    assert {len(plan) for plan in plans} == {len(samplers[0])}  # the same number of batches on every rank
    assert all(sum(lengths[batch]) <= MAX_TOKENS for plan in plans for batch in plan)
    grouped = _shards_per_stretch(plans, bounds)
    # a stretch reads its window's shards, and the next window's where the stretch crosses into it
    assert max(grouped) <= 2 * window + 1, grouped
    _, global_plans = _plans(lengths, bounds, window=None, replicas=replicas)
    spread = _shards_per_stretch(global_plans, bounds)  # negative control: the global shuffle reads most shards
    assert min(spread) > max(grouped) and np.median(spread) > 4 * np.median(grouped), (spread, grouped)
    if replicas > 1:  # the rank gap stays within the budget at every step, as with the global shuffle
        tokens = np.stack([[int(sum(lengths[b])) for b in plan] for plan in plans]).cumsum(axis=1)
        assert int((tokens.max(axis=0) - tokens.min(axis=0)).max()) <= MAX_TOKENS
    # the cost of packing each window on its own: a little less full
    assert samplers[0].efficiency > 0.95


def test_the_plan_is_decided_by_seed_and_epoch():
    lengths, bounds = _data()
    _, a = _plans(lengths, bounds, window=4)
    _, again = _plans(lengths, bounds, window=4)
    _, other_epoch = _plans(lengths, bounds, window=4, epoch=1)
    _, other_seed = _plans(lengths, bounds, window=4, seed=4)
    assert a == again and a != other_epoch and a != other_seed
    first_shards = [np.searchsorted(bounds, p[0][0][0], side="right") - 1 for p in (a, other_epoch, other_seed)]
    assert len(set(first_shards)) > 1  # the shards' order is shuffled too, not only the rows within windows


def test_without_grouping_the_plan_is_the_global_shuffle_it_was():
    lengths, bounds = _data()
    plain = TokenBudgetBatchSampler(lengths, MAX_TOKENS, seed=3)
    bounded = TokenBudgetBatchSampler(lengths, MAX_TOKENS, seed=3, shard_bounds=bounds)  # bounds alone change nothing
    assert list(plain) == list(bounded) and plain.fingerprint() == bounded.fingerprint()
    assert plain.state_dict()["group_shards"] is None


def test_a_grouped_epoch_resumes_with_the_remaining_batches_even_on_a_node_with_another_cache():
    lengths, bounds = _data()
    saved_by, plans = _plans(lengths, bounds, window=4, replicas=2, epoch=1)
    skip = len(plans[0]) // 3
    state = saved_by[1].state_dict(batches_yielded=skip)
    assert state["group_shards"] == 4
    # the resumed node's cache would pick windows of 9 shards: the checkpoint's plan wins (it decides the rows)
    resumed = TokenBudgetBatchSampler(lengths, MAX_TOKENS, seed=3, num_replicas=2, rank=1, shard_bounds=bounds,
                                      group_shards=9)
    resumed.load_state_dict(state)
    assert resumed.group_shards == 4 and resumed.epoch == 1
    assert list(resumed) == plans[1][skip:]
    assert resumed.planned_rows(skip_batches=skip).tolist() == [i for b in plans[1][skip:] for i in b]
    # a sampler that cannot group (no shard bounds) refuses the grouped state in one line
    with pytest.raises(SamplerError, match="resume from the same bucket dataset"):
        TokenBudgetBatchSampler(lengths, MAX_TOKENS, seed=3, num_replicas=2, rank=1).load_state_dict(state)
    with pytest.raises(SamplerError, match="shard_bounds must rise"):
        TokenBudgetBatchSampler(lengths, MAX_TOKENS, shard_bounds=[0, 5, 5, len(lengths)], group_shards=2)
    with pytest.raises(SamplerError, match="needs shard_bounds"):
        TokenBudgetBatchSampler(lengths, MAX_TOKENS, group_shards=2)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=12), max_tokens=st.integers(16, 64),
       window=st.integers(1, 5), replicas=st.integers(1, 3), epoch=st.integers(0, 3), data=st.data())
def test_any_grouping_keeps_the_fixed_count_and_every_row_once(sizes, max_tokens, window, replicas, epoch, data):
    n = sum(sizes)
    if n < 2 * replicas:
        return
    lengths = data.draw(st.lists(st.integers(1, max_tokens), min_size=n, max_size=n))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    samplers = [TokenBudgetBatchSampler(lengths, max_tokens, seed=epoch, num_replicas=replicas, rank=r,
                                        shard_bounds=bounds, group_shards=window) for r in range(replicas)]
    try:
        count = len(samplers[0])
    except SamplerError:  # too few rows for equal batch counts: refused as for the global shuffle
        return
    for s in samplers:
        s.set_epoch(epoch)
    plans = [list(s) for s in samplers]
    assert all(len(p) == count for p in plans)
    assert sorted(i for p in plans for b in p for i in b) == list(range(n))
    assert all(0 < sum(lengths[i] for i in b) <= max_tokens for p in plans for b in p)
