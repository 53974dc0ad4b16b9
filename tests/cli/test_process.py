"""kvindex serve's process setup (cli/process.py) that the serve tests cannot see from outside."""

from __future__ import annotations

import gc
import weakref

from kvindex.cli import process


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_the_startup_heap_leaves_the_collectors_passes_and_new_cycles_are_still_collected() -> None:
    alive_at_startup = _Node()
    try:
        process.freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert not any(obj is alive_at_startup for obj in gc.get_objects())  # no later pass walks it
        later = _Node()
        later.other = later  # a cycle made after start-up is garbage like any other
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
    assert any(obj is alive_at_startup for obj in gc.get_objects())
