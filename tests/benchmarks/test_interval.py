"""benchmarks/interval.py: the bootstrap interval of a p99 ratio, against what arithmetic says it must be."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.compare import Latencies
from benchmarks.interval import percentile, ratio_interval

samples = st.lists(st.floats(1e-5, 1e-1, allow_nan=False), min_size=1, max_size=300)


@given(samples, st.sampled_from([0.5, 0.9, 0.99]))
@settings(max_examples=200, deadline=None)
def test_percentile_is_the_benchmarks_own(values: list[float], fraction: float) -> None:
    latencies = Latencies(samples_s=values)
    percentile_ms = latencies.percentile_ms(fraction)
    assert percentile_ms is not None
    assert percentile(values, fraction) * 1e3 == percentile_ms


@given(samples, st.floats(0.25, 4.0))
@settings(max_examples=50, deadline=None)
def test_paired_samples_in_a_fixed_ratio_give_exactly_that_ratio(values: list[float], factor: float) -> None:
    # Every resample draws the same requests from both, so every resample's p99 ratio is `factor`.
    interval = ratio_interval([v * factor for v in values], values, resamples=50)
    assert interval is not None
    low, high = interval
    assert math.isclose(low, factor, rel_tol=1e-12)
    assert math.isclose(high, factor, rel_tol=1e-12)


def test_the_interval_holds_the_point_ratio_and_narrows_with_more_requests() -> None:
    rng = random.Random(7)

    def widths(n: int) -> tuple[float, float, float]:
        ours = [rng.lognormvariate(-8.0, 0.6) for _ in range(n)]
        theirs = [rng.lognormvariate(-7.8, 0.6) for _ in range(n)]
        interval = ratio_interval(ours, theirs, resamples=400)
        assert interval is not None
        return interval[0], percentile(ours, 0.99) / percentile(theirs, 0.99), interval[1]

    small = widths(300)
    large = widths(30_000)
    for low, point, high in (small, large):
        assert low <= point <= high
    assert large[2] - large[0] < (small[2] - small[0]) / 3
    # Both are lognormal with one sigma, so every quantile of ours is exp(-0.2) times theirs.
    assert large[0] <= math.exp(-0.2) <= large[2]


def test_unpaired_phases_and_empty_sides() -> None:
    assert ratio_interval([], [1.0]) is None
    assert ratio_interval([1.0], []) is None
    assert ratio_interval([1.0, 2.0], [0.0, 0.0]) is None
    # 1,440 requests against 40 (the during-ingest phase) are drawn independently, and still bracket the ratio
    ours = [0.001] * 1440
    theirs = [0.004] * 40
    assert ratio_interval(ours, theirs, resamples=20) == (0.25, 0.25)


def test_a_seed_gives_the_same_interval() -> None:
    rng = random.Random(3)
    ours = [rng.random() for _ in range(200)]
    theirs = [rng.random() for _ in range(200)]
    assert ratio_interval(ours, theirs, seed=11) == ratio_interval(ours, theirs, seed=11)
