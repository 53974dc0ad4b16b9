"""benchmarks/_process.py's in_fresh_process: the call runs in another interpreter and its value comes back."""

from __future__ import annotations

import os

from benchmarks._process import in_fresh_process

STATE = ["as imported"]


def read_state() -> list[str]:
    return STATE


def test_a_call_runs_in_a_new_interpreter_and_returns_its_value() -> None:
    assert in_fresh_process(os.getpid) != os.getpid()
    assert in_fresh_process(divmod, 17, 5) == (3, 2)
    STATE[0] = "changed here"
    try:
        # spawned, not forked: the module is imported afresh there, not copied from this process
        assert in_fresh_process(read_state) == ["as imported"]
    finally:
        STATE[0] = "as imported"
