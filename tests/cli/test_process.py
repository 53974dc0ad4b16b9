"""kvindex serve's process setup (cli/process.py) that the serve tests cannot see from outside."""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import sys
import weakref

import pytest
import uvloop
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


def _loop_class(factory: object) -> type:
    assert callable(factory)
    loop = factory()
    try:
        return type(loop)
    finally:
        loop.close()


def test_auto_and_uvloop_run_on_uvloop_where_it_is_installed() -> None:
    for choice in ("auto", "uvloop"):
        factory, line = process.event_loop_factory(choice)
        assert _loop_class(factory) is uvloop.Loop
        assert line == f"event loop: uvloop {importlib.metadata.version('uvloop')}"


def test_asyncio_is_asyncios_own_loop_set_as_current() -> None:
    factory, line = process.event_loop_factory("asyncio")
    assert factory is None  # asyncio.Runner's default: a new asyncio loop, set as the thread's current one
    assert line == "event loop: asyncio (--event-loop asyncio)"
    with asyncio.Runner(loop_factory=factory) as runner:
        assert not isinstance(runner.get_loop(), uvloop.Loop)


def test_without_uvloop_auto_falls_back_and_uvloop_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` meets where it is not installed
    assert process.event_loop_factory("auto") == (None, "event loop: asyncio (uvloop is not installed)")
    with pytest.raises(process.EventLoopUnavailable, match=r"^--event-loop uvloop: uvloop is not installed"):
        process.event_loop_factory("uvloop")


def test_an_unknown_event_loop_is_refused() -> None:
    with pytest.raises(
        process.EventLoopUnavailable, match="must be one of auto, uvloop, asyncio, got 'trio'"
    ):
        process.event_loop_factory("trio")
