"""TokenBudgetBatchSampler: property tests (hypothesis) and fixed-seed checks. CPU only, a few seconds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pf_trl.batching.sampler import TokenBudgetBatchSampler

# 60 examples a property a run (hypothesis' default is 100): CI draws new ones each run, and the fixed-seed checks
# below cover the ShareGPT-like shapes
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sharegpt_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Deterministic ShareGPT-like lengths: lognormal (median 394) clipped to [8, 1024]: ~13% at 1024, mean ~475."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(394.0), 0.85, n)), 8, 1024).astype(np.int64)


@st.composite
def configs(draw, max_replicas: int = 5):
    max_tokens = draw(st.integers(1, 96))
    num_replicas = draw(st.integers(1, max_replicas))
    n = draw(st.integers(num_replicas, 160))
    lengths = draw(st.lists(st.integers(1, max_tokens), min_size=n, max_size=n))
    return {
        "lengths": lengths,
        "max_tokens": max_tokens,
        "num_replicas": num_replicas,
        "seed": draw(st.integers(0, 2**32)),
        "epoch": draw(st.integers(0, 5)),
        "window": draw(st.sampled_from([None, 1, 7, 32])),
        "drop_last": draw(st.booleans()),
    }


def make(cfg: dict, rank: int = 0, **overrides) -> TokenBudgetBatchSampler:
    kw = {k: cfg[k] for k in ("max_tokens", "num_replicas", "seed", "window", "drop_last")}
    kw.update(overrides)
    sampler = TokenBudgetBatchSampler(cfg["lengths"], rank=rank, **kw)
    sampler.set_epoch(cfg["epoch"])
    return sampler


def all_ranks(cfg: dict, **overrides) -> list[list[list[int]]]:
    """Batches of every rank, or skip the example when equal counts are provably impossible."""
    out = []
    for rank in range(cfg["num_replicas"]):
        sampler = make(cfg, rank, **overrides)
        try:
            out.append(list(sampler))
        except ValueError as exc:
            assert "cannot give all" in str(exc)
            # Legitimate only when there are fewer examples than the next multiple of num_replicas above
            # the run's base bin count: then no duplicate-free equal split exists.
            r = sampler.num_replicas
            assert len(cfg["lengths"]) < math.ceil(sampler._base_bin_count() / r) * r
            assume(False)
    return out


# ----------------------------------------------------------------------------- properties


@PROPS
@given(configs())
def test_coverage_budget_counts(cfg):
    ranks = all_ranks(cfg, drop_last=False)
    lengths = cfg["lengths"]
    seen = [i for batches in ranks for b in batches for i in b]
    assert sorted(seen) == list(range(len(lengths))), "every index exactly once per epoch across ranks"
    assert len({len(batches) for batches in ranks}) == 1, "equal batch counts on every rank"
    for batches in ranks:
        for b in batches:
            assert b, "no empty batch"
            assert all(type(i) is int for i in b)
            assert sum(lengths[i] for i in b) <= cfg["max_tokens"]


@PROPS
@given(configs())
def test_len_matches_iteration_and_plan_is_rank_independent(cfg):
    ranks = all_ranks(cfg)
    samplers = [make(cfg, r) for r in range(cfg["num_replicas"])]
    for sampler, batches in zip(samplers, ranks):
        assert len(sampler) == len(batches)
        assert sampler.batch_token_counts(sampler.rank).tolist() == [sum(cfg["lengths"][i] for i in b) for b in batches]
    ref = samplers[0].batch_token_counts()
    for s in samplers[1:]:
        np.testing.assert_array_equal(s.batch_token_counts(), ref)


@PROPS
@given(configs())
def test_token_balance_across_ranks(cfg):
    """Stated bound: at every step, the spread of cumulative rank tokens <= the largest within-step
    spread of batch tokens so far, hence <= max_tokens."""
    all_ranks(cfg)  # skips impossible configs
    counts = make(cfg).batch_token_counts()  # [steps, ranks]
    if counts.size == 0:
        return
    cumulative = np.cumsum(counts, axis=0)
    spread = cumulative.max(axis=1) - cumulative.min(axis=1)
    step_range = np.maximum.accumulate(counts.max(axis=1) - counts.min(axis=1))
    assert np.all(spread <= step_range)
    assert spread.max() <= cfg["max_tokens"]


@pytest.mark.slow
@PROPS
@given(configs())
def test_deterministic_for_seed_and_epoch(cfg):
    first = all_ranks(cfg)
    assert all_ranks(cfg) == first
    again = make(cfg)
    again.set_epoch(cfg["epoch"] + 1)
    again.set_epoch(cfg["epoch"])
    assert list(again) == first[0]


@pytest.mark.slow
@PROPS
@given(configs(), st.data())
def test_resume_reproduces_remaining_batches(cfg, data):
    all_ranks(cfg)
    rank = data.draw(st.integers(0, cfg["num_replicas"] - 1))
    full = list(make(cfg, rank))
    k = data.draw(st.integers(0, len(full)))
    running = make(cfg, rank)
    it = iter(running)
    head = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(running.state_dict()))  # must survive a JSON checkpoint
    assert state["batches_yielded"] == k and state["epoch"] == cfg["epoch"]

    fresh = make(cfg, rank)
    fresh.set_epoch(0 if cfg["epoch"] else 1)  # wherever it was, the state decides
    fresh.load_state_dict(state)
    assert fresh.num_remaining_batches == len(full) - k
    fresh.set_epoch(cfg["epoch"])  # what a trainer does at the top of the epoch: keeps the resume point
    tail = list(fresh)
    assert head + tail == full
    assert len(fresh) == len(full)
    assert list(fresh) == full, "a second pass over the same epoch starts at batch 0"
    fresh.set_epoch(cfg["epoch"] + 1)
    nxt = make(cfg, rank)
    nxt.set_epoch(cfg["epoch"] + 1)
    assert list(fresh) == list(nxt), "the epoch after a resumed one starts from batch 0"


def test_planned_rows_are_what_the_pass_yields_without_iterating():
    """What a reader fetches ahead (pf_trl/storage/readahead.py): this rank's rows in yield order, from the resume point
    or after ``skip_batches``; planning them leaves the sampler's position alone."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 200, size=600)
    for rank in (0, 1):
        sampler = TokenBudgetBatchSampler(lengths, 512, seed=7, num_replicas=2, rank=rank)
        batches = list(sampler)
        flat = [i for b in batches for i in b]
        assert sampler.planned_rows().tolist() == flat
        assert sampler.planned_rows(skip_batches=3).tolist() == [i for b in batches[3:] for i in b]
        state = dict(sampler.state_dict(), batches_yielded=5)
        fresh = TokenBudgetBatchSampler(lengths, 512, seed=7, num_replicas=2, rank=rank)
        fresh.load_state_dict(state)
        assert fresh.planned_rows().tolist() == [i for b in batches[5:] for i in b]
        assert [i for b in fresh for i in b] == [i for b in batches[5:] for i in b]  # the resume point was kept


@pytest.mark.slow
@PROPS
@given(configs())
def test_drop_last_drops_only_smallest_bins(cfg):
    ranks = all_ranks(cfg, drop_last=True)
    sampler = make(cfg, drop_last=True)
    lengths = np.asarray(cfg["lengths"])
    r = cfg["num_replicas"]
    stats = sampler.stats()
    seen = [i for batches in ranks for b in batches for i in b]
    assert len(seen) == len(set(seen)), "never an index twice"
    assert {len(b) for b in ranks} == {len(sampler)}
    assert len(sampler) == sampler._base_bin_count() // r, "drop_last rounds the fixed count down"
    assert len(seen) == len(lengths) - stats["num_dropped_examples"]
    dropped = sampler._plan().dropped_bin_tokens
    assert len(dropped) == stats["num_dropped_bins"]
    assert int(dropped.sum()) == int(lengths.sum()) - int(lengths[seen].sum())
    if len(dropped) and seen:
        kept_tokens = [int(lengths[b].sum()) for batches in ranks for b in batches]
        assert dropped.max() <= min(kept_tokens), "only the bins with the fewest tokens are dropped"


@pytest.mark.slow
@PROPS
@given(configs(), st.lists(st.integers(0, 50), min_size=2, max_size=4, unique=True))
def test_same_batch_count_every_epoch_each_example_once(cfg, epochs):
    """Every epoch of a run: the same per-rank batch count (what Trainer fixes from the first len()), and with
    drop_last=False every example exactly once over all ranks."""
    all_ranks(cfg, drop_last=False)  # skips provably impossible configs
    samplers = [make(cfg, r, drop_last=False) for r in range(cfg["num_replicas"])]
    counts = set()
    for epoch in epochs:
        per_rank = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
            counts.add(len(per_rank[-1]))
            counts.add(len(sampler))
        seen = sorted(i for batches in per_rank for b in batches for i in b)
        assert seen == list(range(len(cfg["lengths"]))), f"epoch {epoch}: every index exactly once"
        assert all(sum(cfg["lengths"][i] for i in b) <= cfg["max_tokens"] for batches in per_rank for b in batches)
    assert len(counts) == 1, f"per-rank batch counts differ between epochs {epochs}: {counts}"


@pytest.mark.slow
@PROPS
@given(configs())
def test_efficiency_matches_manual_computation(cfg):
    ranks = all_ranks(cfg)
    real = sum(cfg["lengths"][i] for batches in ranks for b in batches for i in b)
    num_batches = sum(len(batches) for batches in ranks)
    expected = real / (num_batches * cfg["max_tokens"]) if num_batches else 0.0
    assert make(cfg).efficiency == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- fixed checks


def test_epochs_differ_and_seeds_differ():
    lengths = sharegpt_like_lengths(3000)
    a = TokenBudgetBatchSampler(lengths, 8192, seed=1)
    e0 = list(a)
    a.set_epoch(1)
    e1 = list(a)
    assert e0 != e1
    assert sorted(map(sorted, e0)) != sorted(map(sorted, e1)), "different bin contents, not only another order"
    assert list(TokenBudgetBatchSampler(lengths, 8192, seed=2)) != e0


def test_batch_order_is_shuffled_not_length_sorted():
    # A dataset sorted by length is the worst case: the epoch must still mix short and long batches.
    lengths = np.sort(sharegpt_like_lengths(20000, seed=3))
    sampler = TokenBudgetBatchSampler(lengths, 4096, seed=0)
    batches = list(sampler)
    pos = np.arange(len(batches))
    mean_index = np.array([np.mean(b) for b in batches])
    mean_len = np.array([lengths[b].mean() for b in batches])
    assert abs(np.corrcoef(pos, mean_index)[0, 1]) < 0.1
    assert abs(np.corrcoef(pos, mean_len)[0, 1]) < 0.1
    tenth = len(batches) // 10
    early, late = mean_len[:tenth].mean(), mean_len[-tenth:].mean()
    assert abs(early - late) / mean_len.mean() < 0.15


@pytest.mark.parametrize(("max_tokens", "n"), [(8192, 3000), (8192, 50000), (4096, 20000), (16384, 50000)])
def test_fill_on_sharegpt_like_lengths(max_tokens, n):
    lengths = sharegpt_like_lengths(n)
    assert 455 < lengths.mean() < 495 and 365 < np.median(lengths) < 420 and 0.11 < np.mean(lengths == 1024) < 0.15
    sampler = TokenBudgetBatchSampler(lengths, max_tokens)
    assert sampler.efficiency >= 0.99
    assert len(sampler) <= math.ceil(lengths.sum() / max_tokens) + 1  # within one bin of the lower bound


@pytest.mark.parametrize("num_replicas", [2, 3, 8])
def test_fill_and_balance_with_replicas(num_replicas):
    lengths = sharegpt_like_lengths(20000, seed=5)
    stats = [TokenBudgetBatchSampler(lengths, 8192, num_replicas=num_replicas, rank=r).stats() for r in range(num_replicas)]
    assert stats[0]["efficiency"] >= 0.99
    per_rank = np.array(stats[0]["tokens_per_rank"])
    assert (per_rank.max() - per_rank.min()) / per_rank.mean() < 0.01
    assert all(s == stats[0] for s in stats)


def test_packing_is_fast():
    lengths = sharegpt_like_lengths(2500)
    best = math.inf
    for seed in range(3):
        started = time.perf_counter()
        TokenBudgetBatchSampler(lengths, 8192, seed=seed).efficiency  # noqa: B018  (plans the epoch)
        best = min(best, time.perf_counter() - started)
    assert best < 0.1, f"2.5k examples took {best * 1000:.0f} ms to plan"


def one_at_a_time_bfd(idx: np.ndarray, lens: np.ndarray, capacity: int, *, ties: str = "lowest") -> list[list[int]]:
    """Best-fit-decreasing placing one example at a time (the smallest room that fits, ``ties`` deciding among equal
    rooms by bin id): the reference for the sampler's packing, which places runs of equal lengths at once."""
    rooms: list[int] = []
    bins: list[list[int]] = []
    for i, length in zip(idx.tolist(), lens.tolist()):
        fits = [b for b, room in enumerate(rooms) if room >= length]
        if not fits:
            rooms.append(capacity - length)
            bins.append([i])
            continue
        best = min(rooms[b] for b in fits)
        tied = [b for b in fits if rooms[b] == best]
        b = tied[0] if ties == "lowest" else tied[-1]
        bins[b].append(i)
        rooms[b] -= length
    return bins


@PROPS
@given(st.integers(1, 64), st.lists(st.integers(1, 64), min_size=1, max_size=200), st.integers(1, 6))
def test_packing_runs_of_equal_lengths_places_them_as_one_at_a_time(capacity, raw, distinct):
    """Bin for bin and in the same order as placing one example at a time, ties included (few distinct lengths
    make long runs); the count on length counts alone agrees."""
    from pf_trl.batching.sampler import _bfd_bin_count, _packed_bins

    lens = np.minimum(np.asarray(raw) % (distinct * 7) + 1, capacity)
    by_len = np.argsort(-lens, kind="stable")
    idx = np.random.default_rng(len(raw)).permutation(len(lens))[by_len]
    bins, loads = _packed_bins(idx, lens[by_len], capacity)
    assert bins == one_at_a_time_bfd(idx, lens[by_len], capacity)
    length_of = dict(zip(idx.tolist(), lens[by_len].tolist()))
    assert loads == [sum(length_of[i] for i in b) for b in bins]
    assert _bfd_bin_count(lens, capacity) == len(bins)


def test_packing_runs_matches_one_at_a_time_on_long_tailed_and_short_rows():
    from pf_trl.batching.sampler import _packed_bins

    cases = [(sharegpt_like_lengths(1500, seed=3), 2048), (np.random.default_rng(1).integers(4, 17, 3000), 256)]
    for lengths, capacity in cases:
        by_len = np.argsort(-lengths, kind="stable")
        idx = by_len.astype(np.int64)
        bins, _ = _packed_bins(idx, lengths[by_len], capacity)
        assert bins == one_at_a_time_bfd(idx, lengths[by_len], capacity)
        # negative control: the tie rule is exercised (the other rule gives other bins on the same rows)
        assert bins != one_at_a_time_bfd(idx, lengths[by_len], capacity, ties="highest")


def test_fixed_count_on_long_tailed_data_whose_packings_differ():
    """The case Trainer got wrong: 3,000 long-tailed examples whose packing yields a different bin count in
    different epochs; the sampler now gives every epoch the same count, splitting or re-packing as needed."""
    lengths = sharegpt_like_lengths(3000, seed=2)
    sampler = TokenBudgetBatchSampler(lengths, 1024, seed=0)
    raw, lens, windows = [], [], []
    for epoch in range(6):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        stats = sampler.stats()
        raw.append(stats["num_packed_bins"])
        windows.append(stats["packing_window"])
        lens.append(len(batches))
        assert sorted(i for b in batches for i in b) == list(range(3000))
        assert stats["efficiency"] >= 0.99
    assert len(set(raw)) > 1, "negative control: the windowed packing alone differs between epochs"
    assert set(lens) == {len(sampler)} == {raw[0]}
    assert max(windows) > sampler.window, "an epoch with one bin too many is packed again with a larger window"


def test_len_is_fixed_without_planning_the_epoch():
    lengths = sharegpt_like_lengths(2000, seed=1)
    sampler = TokenBudgetBatchSampler(lengths, 2048, num_replicas=3, seed=5)
    sampler.set_epoch(7)
    n = len(sampler)
    assert sampler._plan_cache is None, "len() comes from the lengths, not from the current epoch's plan"
    assert n == len(list(sampler))


def test_split_fixup_keeps_exactly_once_coverage():
    # 10 bins of 2 x 5 tokens, 4 ranks: two bins must be split, nothing duplicated or dropped.
    lengths = [5] * 20
    ranks = [list(TokenBudgetBatchSampler(lengths, 10, num_replicas=4, rank=r)) for r in range(4)]
    assert [len(b) for b in ranks] == [3, 3, 3, 3]
    seen = sorted(i for batches in ranks for b in batches for i in b)
    assert seen == list(range(20))
    assert TokenBudgetBatchSampler(lengths, 10, num_replicas=4).stats()["num_split_bins"] == 2


def test_impossible_equal_split_raises_and_drop_last_works():
    lengths = [600] * 5  # five examples that each need their own bin, four ranks: 8 bins would be needed
    with pytest.raises(ValueError, match="drop_last=True"):
        len(TokenBudgetBatchSampler(lengths, 1000, num_replicas=4))
    ranks = [list(TokenBudgetBatchSampler(lengths, 1000, num_replicas=4, rank=r, drop_last=True)) for r in range(4)]
    assert [len(b) for b in ranks] == [1, 1, 1, 1]
    assert len({i for batches in ranks for b in batches for i in b}) == 4


def test_fewer_examples_than_replicas_raises():
    with pytest.raises(ValueError, match=r"3 example\(s\) but num_replicas=4"):
        TokenBudgetBatchSampler([1, 2, 3], 10, num_replicas=4, drop_last=True)
    # as many examples as ranks: one single-example batch each
    ranks = [list(TokenBudgetBatchSampler([1, 2, 3], 10, num_replicas=3, rank=r)) for r in range(3)]
    assert sorted(b[0] for batches in ranks for b in batches) == [0, 1, 2]


def test_long_example_error_names_index_and_length():
    lengths = [10] * 7 + [2049] + [10, 5000]
    with pytest.raises(ValueError) as info:
        TokenBudgetBatchSampler(lengths, 2048)
    msg = str(info.value)
    assert "example 7" in msg and "2049" in msg and "max_seq_len <= 2048" in msg and "2 example(s)" in msg


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": [3, 0, 2]}, "example 1 has length 0"),
        ({"lengths": [3, -4]}, "example 1 has length -4"),
        ({"lengths": []}, "empty"),
        ({"lengths": [1.5, 2]}, "integers"),
        ({"lengths": [[1, 2]]}, "one-dimensional"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"rank": 2, "num_replicas": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"window": 0}, "window"),
        ({"carry_below": 1.5}, "carry_below"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = {"lengths": [3, 4, 5], "max_tokens": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        TokenBudgetBatchSampler(args.pop("lengths"), args.pop("max_tokens"), **args)


def test_incompatible_state_raises():
    lengths = sharegpt_like_lengths(500)
    base = TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, seed=3)
    it = iter(base)
    next(it)
    state = base.state_dict()
    others = {
        "max_tokens": TokenBudgetBatchSampler(lengths, 8192, num_replicas=2, seed=3),
        "num_replicas": TokenBudgetBatchSampler(lengths, 4096, num_replicas=4, seed=3),
        "num_examples": TokenBudgetBatchSampler(lengths[:-1], 4096, num_replicas=2, seed=3),
        "lengths": TokenBudgetBatchSampler(np.roll(lengths, 1), 4096, num_replicas=2, seed=3),
        "seed": TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, seed=4),
        "window": TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, seed=3, window=64),
    }
    for name, other in others.items():
        with pytest.raises(ValueError, match=name if name != "window" else "packing options"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        base.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="batches_yielded"):
        base.load_state_dict({**state, "batches_yielded": len(base) + 1})
    with pytest.raises(ValueError, match="version 1"):  # version 1 planned epochs differently
        base.load_state_dict({**state, "version": 1})
    # a compatible sampler on another rank accepts it (the state is rank-independent)
    TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, rank=1, seed=3).load_state_dict(state)


def test_state_dict_override_for_prefetching_loaders():
    lengths = sharegpt_like_lengths(800)
    sampler = TokenBudgetBatchSampler(lengths, 4096)
    full = list(sampler)
    state = sampler.state_dict(batches_yielded=5)  # the sampler ran ahead; the model saw 5 batches
    fresh = TokenBudgetBatchSampler(lengths, 4096)
    fresh.load_state_dict(state)
    assert list(fresh) == full[5:]


def test_shuffle_false_packs_in_dataset_order():
    lengths = [4, 4, 4, 4, 8, 2, 2]
    sampler = TokenBudgetBatchSampler(lengths, 8, shuffle=False)
    assert list(sampler) == list(TokenBudgetBatchSampler(lengths, 8, shuffle=False, seed=9))
    assert sorted(map(sorted, sampler)) == [[0, 1], [2, 3], [4], [5, 6]]


def test_from_dataset_reads_length_column_with_indices_mapping():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"length": [5, 6, 7, 8], "input_ids": [[0] * 5, [0] * 6, [0] * 7, [0] * 8]})
    sub = ds.select([3, 0, 2])
    sampler = TokenBudgetBatchSampler.from_dataset(sub, 16, seed=0)
    assert sampler.lengths.tolist() == [8, 5, 7]
    assert sorted(i for b in sampler for i in b) == [0, 1, 2]


def test_works_as_torch_batch_sampler():
    torch = pytest.importorskip("torch")
    lengths = sharegpt_like_lengths(300)
    data = [{"idx": i, "len": int(n)} for i, n in enumerate(lengths)]
    sampler = TokenBudgetBatchSampler(lengths, 4096, num_replicas=2, rank=1)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=lambda feats: feats)
    assert len(loader) == len(sampler)
    got = [[f["idx"] for f in batch] for batch in loader]
    assert got == list(sampler)


def test_import_does_not_pull_torch_or_transformers():
    code = (
        "import sys, pf_trl.batching.sampler; "
        "bad = [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
