"""How far a p99 ratio could move on another run: a bootstrap interval over the run's own requests.

A p99 over 600 requests is the 6th-slowest of them, so one stall of the shared box more or less on either
side moved a kvindex/Dynamo ratio by tenths: the same code read 0.64x and 1.40x on the 8192-token row an
hour apart (the rows now time 3,000 requests over 3 rounds, and move less). The interval says how much of a ratio is the sample: resample the requests with replacement
(in pairs where the two services were asked in turn, so a stall that met both stays in both), take each
resample's p99 ratio, and report the middle `level` of them. A goal inside the interval is not decided by
that run; one outside it is, at that level.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence

# Resamples per interval: at 1,000 its ends move by ~0.01x from seed to seed (enough to read a goal
# against), and one interval of 3,000 requests a side takes ~0.5 s.
RESAMPLES = 1000


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The benchmark's percentile (compare.Latencies.percentile_ms, unscaled): the sorted sample at
    int(fraction * n), found without sorting the whole sample."""
    rank_from_top = len(samples) - min(len(samples) - 1, int(fraction * len(samples)))
    return heapq.nlargest(rank_from_top, samples)[-1]


def ratio_interval(
    ours: Sequence[float],
    theirs: Sequence[float],
    *,
    fraction: float = 0.99,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """The central `level` interval of percentile(ours) / percentile(theirs) over bootstrap resamples;
    None when either side has no sample or a zero percentile.

    Paired (the same request indices drawn for both) when the two have as many samples, as the idle
    phase's do (request i of each was asked in the same turn); drawn independently otherwise."""
    if not ours or not theirs:
        return None
    rng = random.Random(seed)
    paired = len(ours) == len(theirs)
    ratios: list[float] = []
    for _ in range(resamples):
        ours_drawn = rng.choices(range(len(ours)), k=len(ours))
        theirs_drawn = ours_drawn if paired else rng.choices(range(len(theirs)), k=len(theirs))
        denominator = percentile([theirs[i] for i in theirs_drawn], fraction)
        if denominator <= 0:
            return None
        ratios.append(percentile([ours[i] for i in ours_drawn], fraction) / denominator)
    ratios.sort()
    tail = (1 - level) / 2
    low = ratios[int(tail * (resamples - 1))]
    high = ratios[int(round((1 - tail) * (resamples - 1)))]
    return low, high
