"""How many shard workers an aggregator runs and which fragments each owns (aggregator.shard_plan)."""

import itertools
import random

import pytest

from aggregator.config import AggregatorConfig, parse_fragments
from aggregator.shard_plan import AUTO, SHARD_VALUES, fragments_text, shard_count, shard_id, split
from bus.config import ConfigError, from_env


def test_auto_runs_one_shard_per_shard_values_parameters_capped_by_cores_and_fragments():
    m = 1_000_000
    assert shard_count([5 * m] * 8, AUTO, cores=16) == 1  # a small run: the aggregator in its own process
    assert shard_count([SHARD_VALUES // 8] * 8, AUTO, cores=16) == 1
    assert shard_count([SHARD_VALUES // 8 + 1] * 8, AUTO, cores=16) == 2
    assert shard_count([12_500_000] * 8, AUTO, cores=16) == 2  # 100M
    assert shard_count([125 * m] * 8, AUTO, cores=16) == 8  # 1B: 20 wanted, 8 fragments
    assert shard_count([125 * m] * 8, AUTO, cores=4) == 3  # ... one core left to the broker
    assert shard_count([125 * m] * 8, AUTO, cores=2) == 1
    assert shard_count([125 * m] * 8, AUTO, cores=0) == 1
    assert shard_count([], AUTO, cores=4) == 1


def test_an_explicit_count_is_kept_up_to_the_fragments():
    assert shard_count([10] * 8, 3, cores=1) == 3  # the user's number, whatever the size and cores
    assert shard_count([10] * 2, 5, cores=16) == 2


def brute(sizes, n):
    """The smallest largest-shard sum over every contiguous split into n parts."""
    k = len(sizes)
    best = None
    for cuts in itertools.combinations(range(1, k), n - 1):
        bounds = (0, *cuts, k)
        worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_split_is_contiguous_covers_every_fragment_once_and_balances_the_largest_shard():
    rng = random.Random(3)
    for _ in range(300):
        k = rng.randint(1, 9)
        sizes = [rng.randint(1, 100) for _ in range(k)]
        n = rng.randint(1, k)
        parts = split(sizes, n)
        assert len(parts) == n and all(len(r) > 0 for r in parts)
        assert [i for r in parts for i in r] == list(range(k))
        assert max(sum(sizes[i] for i in r) for r in parts) == brute(sizes, n)


def test_split_of_equal_fragments_gives_equal_ranges():
    assert split([7] * 8, 2) == [range(0, 4), range(4, 8)]
    assert split([7] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError):
        split([1, 2], 3)


def test_each_range_reads_back_as_the_fragments_it_names():
    for r in split([3, 1, 4, 1, 5, 9, 2, 6], 3):
        assert parse_fragments(fragments_text(r), 8) == r
    assert fragments_text(range(5, 6)) == "5"
    assert shard_id("agg-0", 2) == "agg-0-s2"


def test_diloco_agg_shards_reads_auto_or_a_count_and_names_itself_when_wrong(monkeypatch):
    monkeypatch.setenv("DILOCO_AGG_SHARDS", "auto")
    assert from_env(AggregatorConfig).agg_shards == AUTO
    monkeypatch.setenv("DILOCO_AGG_SHARDS", "3")
    assert from_env(AggregatorConfig).agg_shards == 3
    for bad in ("0", "many", "-1"):
        monkeypatch.setenv("DILOCO_AGG_SHARDS", bad)
        with pytest.raises(ConfigError, match="DILOCO_AGG_SHARDS"):
            from_env(AggregatorConfig)
