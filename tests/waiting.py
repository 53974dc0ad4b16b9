"""The one way a test waits for another thread, socket or process: poll a condition under a deadline and
fail naming what never happened (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_TIMEOUT_S = 15.0


def wait_for(
    condition: Callable[[], object],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "condition",
    poll_s: float = 0.01,
) -> None:
    """Return as soon as `condition()` is truthy; raise AssertionError once `timeout_s` has passed.

    `condition` is called again after every `poll_s`, so it may also act until what it awaits is seen
    (publish once more while a dialling PUB still lacks our subscription, say).
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)  # ok: polling a condition under a deadline
