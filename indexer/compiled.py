"""Which core runs the index's shards and reads batches on the hot path: compiled or pure Python.

The compiled cores are built by `pip install` when a C compiler is present:
- kvindex.indexer._shard (indexer/_shard.c) keeps the same two LRU levels, copy counts and reverse logs
  as indexer/shard.py in ~40 bytes per pair instead of ~100; shard.py's `Shard` is the reference;
- kvindex.indexer._payload (indexer/_payload.c) reads a batch of vLLM's default shape straight into
  kvindex's events (`read_events`), or copies it without its token ids (`without_token_ids`), mostly off
  the GIL, for decode's hot path, and reads one event's token ids packed for the hash check
  (`stored_token_ids`); without it msgspec decodes the original (the same events and ids).
Both give way to pure Python when their extension is absent or KVINDEX_PURE_PYTHON=1 was set at import
(the switch the hash core reads too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvindex.hashing.compiled import describe_choice, pure_python_forced
from kvindex.indexer.shard import Shard, ShardCore

# (capacity, max_pods_per_key) -> an empty shard.
ShardFactory = Callable[[int, int], ShardCore]


def load_extension() -> ShardFactory | None:
    """The compiled shard type if it was built and imports, whatever KVINDEX_PURE_PYTHON says; else None."""
    try:
        from kvindex.indexer import _shard
    except ImportError:  # not built: no compiler at install time
        return None
    return _shard.Shard


# NOTE: read when a KVIndex is made (never per call), so a test can run both cores in one process by
# setting this; everything else treats it as a constant.
shard_type: ShardFactory = Shard if pure_python_forced() else (load_extension() or Shard)


def _payload_function(name: str) -> Any:
    """kvindex.indexer._payload's function `name` if the extension was built, whatever KVINDEX_PURE_PYTHON
    says; else None."""
    try:
        from kvindex.indexer import _payload
    except ImportError:
        return None
    return getattr(_payload, name)


def load_payload_extension() -> Callable[[bytes], bytes | None] | None:
    """kvindex.indexer._payload's without_token_ids (None: not built)."""
    loaded: Callable[[bytes], bytes | None] | None = _payload_function("without_token_ids")
    return loaded


# A batch without its token ids, or None (decode the original); read per call by decode.py.
without_token_ids: Callable[[bytes], bytes | None] | None = (
    None if pure_python_forced() else load_payload_extension()
)

# (payload, BlocksStored, BlocksRemoved, the AllBlocksCleared, the GPU tier) -> (ts, events, rank), or None
# (not the default shape: decode it with msgspec).
EventReader = Callable[[bytes, Any, Any, Any, str], "tuple[float, tuple[Any, ...], int | None] | None"]


def load_event_reader() -> EventReader | None:
    """kvindex.indexer._payload's read_events (None: not built)."""
    loaded: EventReader | None = _payload_function("read_events")
    return loaded


# Read per call by decode.py.
read_events: EventReader | None = None if pure_python_forced() else load_event_reader()

# (payloads, BlocksStored, BlocksRemoved, the AllBlocksCleared, the GPU tier) -> EventReader's answer for
# each payload, their bytes walked in one stretch without the GIL.
ManyEventReader = Callable[
    [list[bytes], Any, Any, Any, str], "list[tuple[float, tuple[Any, ...], int | None] | None]"
]


def load_many_event_reader() -> ManyEventReader | None:
    """kvindex.indexer._payload's read_events_many (None: not built)."""
    loaded: ManyEventReader | None = _payload_function("read_events_many")
    return loaded


# Read per call by decode.py.
read_events_many: ManyEventReader | None = None if pure_python_forced() else load_many_event_reader()

# (payload, pos) -> the byte span of that event, or None.
EventSpan = Callable[[bytes, int], "tuple[int, int] | None"]


def load_event_span() -> EventSpan | None:
    """kvindex.indexer._payload's event_span (None: not built)."""
    loaded: EventSpan | None = _payload_function("event_span")
    return loaded


# Read per call by decode.py.
event_span: EventSpan | None = None if pure_python_forced() else load_event_span()

# (payload, pos) -> (that BlockStored's token ids as array('I') bytes, its block keys as array('Q') bytes), or
# None (another event or shape, an id outside 32 bits: decode it with msgspec).
StoredTokenIds = Callable[[bytes, int], "tuple[bytes, bytes] | None"]


def load_stored_token_ids() -> StoredTokenIds | None:
    """kvindex.indexer._payload's stored_token_ids (None: not built)."""
    loaded: StoredTokenIds | None = _payload_function("stored_token_ids")
    return loaded


# Read per call by decode.py.
stored_token_ids: StoredTokenIds | None = None if pure_python_forced() else load_stored_token_ids()


def describe() -> str:
    """One line for the logs: which core runs."""
    compiled = "compiled core" if shard_type is not Shard else None
    return describe_choice("block index", compiled, "pure Python", "the compiled core")
