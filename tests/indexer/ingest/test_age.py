"""age_ms: the event ages score answers and /v1/pods report, to the millisecond."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from kvindex.indexer.ingest.service import age_ms

times = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)


@given(times, times)
def test_an_age_is_the_nearest_millisecond_and_never_negative(now: float, at: float) -> None:
    age = age_ms(now, at)
    assert age >= 0.0  # `at` may be stamped by a worker just after `now` was read
    assert abs(age - max(0.0, now - at)) <= 0.0005 + 1e-9 * max(1.0, now)
    millis = age * 1000.0
    assert abs(millis - round(millis)) < 1e-6  # a whole number of milliseconds
    assert msgspec.json.encode(age) == msgspec.json.encode(round(age, 3))  # as short as round() makes it
