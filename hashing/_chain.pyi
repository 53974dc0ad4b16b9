from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

def chain(
    parent: bytes,
    tokens: Sequence[int],
    block_size: int,
    num_blocks: int,
    cbor: bool,
    digest: Callable[[bytes], bytes] | None = None,
    /,
) -> list[bytes] | None: ...
def chain_packed(
    parent: bytes,
    token_bytes: bytes,
    first: int,
    block_size: int,
    num_blocks: int,
    cbor: bool,
    digest: Callable[[bytes], bytes] | None = None,
    /,
) -> list[bytes] | None: ...
def pack_ids(tokens: Sequence[int], /) -> bytes | None: ...
def event_keys(digests: list[bytes], /) -> bytes: ...
def pack_ids_tagged(tokens: Sequence[int], seg_ids: int, /) -> tuple[bytes, list[int]] | None: ...
def segment_tags(data: bytes, start: int, width: int, count: int, /) -> list[int]: ...
def preimage(parent: bytes, tokens: Sequence[int], cbor: bool, /) -> bytes | None: ...
def untrack_atomic(objects: list[object], /) -> None: ...
def walk_segments(
    segments: OrderedDict[Any, Any],
    parent: bytes,
    tags: list[int],
    token_bytes: bytes,
    seg_width: int,
    seg_blocks: int,
    digests: list[bytes],
    low_checks: list[Any] | None,
    /,
) -> tuple[int, bytes]: ...
