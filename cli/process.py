"""Process setup for `kvindex serve`: what belongs to the process, not to the indexer — the event loop, the
open-files limit, the GIL switch interval, the start-up heap kept out of the cyclic collector's passes, where
the C heap puts large blocks, and handing freed heap pages back to the OS."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import importlib.metadata
import os
import sys
from collections.abc import Callable

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


class EventLoopUnavailable(RuntimeError):
    """The event loop asked for cannot run here; the message says why and what to choose instead."""


def event_loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The factory of the loop the HTTP side runs on (None: asyncio's own, set as the current loop as
    asyncio.run does) and a line for the log saying which loop and why.

    auto takes uvloop when it is installed: aiohttp's per-request work costs less on it. Two `kvindex
    serve`s on one feed (100 pods x 10k blocks), requests alternating between them, 2,000 each: 512-hash
    scores mean 3-5% and p99 7-15% lower, 8192-token scores mean 3-5% lower. asyncio is the fallback.
    """
    if choice not in EVENT_LOOPS:
        raise EventLoopUnavailable(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return None, "event loop: asyncio (--event-loop asyncio)"
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise EventLoopUnavailable(
                "--event-loop uvloop: uvloop is not installed here (pip install uvloop); choose auto or asyncio"
            ) from None
        return None, "event loop: asyncio (uvloop is not installed)"
    return uvloop.new_event_loop, f"event loop: uvloop {importlib.metadata.version('uvloop')}"


def raise_open_files_limit() -> None:
    """Each pod costs a few descriptors (SUB, monitor, replay DEALER); containers often start with a soft
    limit of 1,024, which a few hundred pods exhaust. Raise the soft limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: keep the limit we have
        pass


def set_switch_interval(interval_ms: float) -> None:
    """The GIL switch interval: ingest threads share the GIL with the event loop answering scores, and a
    shorter slice hands it back sooner. Set before any ingest thread starts."""
    sys.setswitchinterval(interval_ms / 1000)


# glibc's mallopt parameter number for the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3
# Blocks at least this large get their own mapping: the index's growing tables, never a payload or a body.
LARGE_BLOCK_BYTES = 1 << 20


def pin_mmap_threshold(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Give every block of LARGE_BLOCK_BYTES or more its own mapping, for the life of the process; False
    where there is no glibc or the operator set the threshold (MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES).

    glibc raises its threshold to the size of any mapped block freed (up to 32 MiB), so once the index has
    resized a large table, the next ones come from the threads' heaps, amid the payloads a burst queues,
    and after the burst the live tables keep its freed pages resident: `kvindex serve`'s RSS after one
    100 pods x 10k blocks burst read 103-162 B per pair from run to run in pure Python (44-46 compiled).
    Pinned, every resize hands the old table back to the OS at once: 103.0-103.4 B (44.3-44.6 compiled)
    over five runs, ingest unchanged. Call it before the index allocates."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "MALLOC_MMAP_THRESHOLD_" in environ or "glibc.malloc.mmap_threshold" in tunables:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES))


def heap_releaser() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), which returns whole free pages from anywhere in the heap; None where there
    is no glibc (musl, macOS): releasing free heap pages is then left to the allocator."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def release() -> object:
        return trim(0)

    return release


def freeze_startup_heap() -> None:
    """Move everything alive now (modules, the app, every stream and its tracker) out of the cyclic
    collector's sight: it is never garbage, and a full collection walked all of it, ~40 ms at 1,000 pods
    under the GIL, stalling ingest and every score request meanwhile."""
    gc.collect()
    gc.freeze()
