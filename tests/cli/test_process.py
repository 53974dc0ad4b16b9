"""kvindex serve's process setup (cli/process.py) that the serve tests cannot see from outside."""

from __future__ import annotations

import asyncio
import gc
import importlib.metadata
import os
import subprocess
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


# Run in a fresh interpreter: glibc's threshold is process-wide, and this one's was moved by whatever ran
# before. Prints how many blocks glibc has mapped (mallinfo2's hblks) while a 1.5 MiB block is held, after
# a 4 MiB mapped block was freed (which, unpinned, raises the threshold to 4 MiB).
_WHERE_A_LARGE_BLOCK_LANDS = """
import ctypes, sys
from kvindex.cli import process
pinned = process.pin_mmap_threshold() if sys.argv[1] == "pin" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo2().hblks
held = libc.malloc(3 << 19)
print(pinned, libc.mallinfo2().hblks - before)
libc.free(held)
"""


def _where_a_large_block_lands(env: dict[str, str], pin: bool = True) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _WHERE_A_LARGE_BLOCK_LANDS, "pin" if pin else "leave"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    pinned, mapped = done.stdout.split()
    return pinned, int(mapped)


def _env_without_malloc_settings() -> dict[str, str]:
    return {
        key: value
        for key, value in os.environ.items()
        if key != "MALLOC_MMAP_THRESHOLD_" and "mmap_threshold" not in value
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_pinned_a_large_block_gets_its_own_mapping_even_after_a_larger_one_was_freed() -> None:
    env = _env_without_malloc_settings()
    # glibc's own behaviour: the freed block raised the threshold, and the next large one is in the heap
    assert _where_a_large_block_lands(env, pin=False) == ("None", 0)
    assert process.LARGE_BLOCK_BYTES <= 3 << 19
    assert _where_a_large_block_lands(env) == ("True", 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_an_operators_threshold_is_left_alone() -> None:
    env = _env_without_malloc_settings()
    env["MALLOC_MMAP_THRESHOLD_"] = "4194304"
    assert _where_a_large_block_lands(env) == ("False", 0)
    del env["MALLOC_MMAP_THRESHOLD_"]
    env["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=4194304"
    assert _where_a_large_block_lands(env) == ("False", 0)
