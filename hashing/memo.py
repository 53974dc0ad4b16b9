"""A bounded, thread-safe memo of recent block digests, so a shared or growing prefix is hashed once.

Read path, inside BlockHasher: before hashing a prompt's blocks, the longest already-known prefix of the
chain is looked up here; only the rest is hashed, then recorded. Two levels keep the hot path cheap:
whole *segments* of SEGMENT_BLOCKS aligned blocks (one lookup per 256 tokens at block size 16) and
single blocks for the ragged tail a growing conversation leaves behind. Both are LRU (OrderedDict, C).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

from kvindex.hashing.extra_keys import ExtraKeys

SEGMENT_BLOCKS: Final = 16


class DigestMemo:
    """LRU memo: (parent digest, tokens, extra keys) -> digest(s); the parent pins the whole prefix.

    Tokens come as `token_bytes`: validated ids packed as uint32, `block_width` bytes per block (slicing,
    hashing and comparing bytes is several times cheaper than int tuples, whose ints from a fresh JSON
    decode never share objects). `capacity_blocks` bounds the digests held (a segment counts
    SEGMENT_BLOCKS). Safe to share between threads: every read-modify of the dicts happens under one lock,
    never held while hashing. (functools.lru_cache was measured too: one call per block costs more than
    one lookup per segment, and it cannot walk a chain.)
    """

    def __init__(self, capacity_blocks: int) -> None:
        self._block_capacity = capacity_blocks
        self._segment_capacity = max(1, capacity_blocks // SEGMENT_BLOCKS)
        self._blocks: OrderedDict[tuple[Any, ...], bytes] = OrderedDict()
        self._segments: OrderedDict[tuple[Any, ...], tuple[bytes, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Digests held."""
        with self._lock:
            return len(self._blocks) + SEGMENT_BLOCKS * len(self._segments)

    def resolve(
        self,
        root: bytes,
        token_bytes: bytes,
        block_width: int,
        num_blocks: int,
        extras: Sequence[ExtraKeys] | None,
        digests: list[bytes],
    ) -> list[int]:
        """Append the longest known prefix of the chain to `digests`.

        Returns the first block of every full segment whose lookup missed: the caller `record`s them once
        their blocks are known, so the next prompt through them takes one lookup, not SEGMENT_BLOCKS.
        """
        seg = SEGMENT_BLOCKS
        seg_width = seg * block_width
        full_end = num_blocks - num_blocks % seg
        missed_segments: list[int] = []
        parent = root
        index = 0
        with self._lock:
            segments, blocks = self._segments, self._blocks
            while index < num_blocks:
                start = index * block_width
                if index % seg == 0 and index < full_end:
                    seg_key = (
                        parent,
                        token_bytes[start : start + seg_width],
                        None if extras is None else tuple(extras[index : index + seg]),
                    )
                    found = segments.get(seg_key)
                    if found is not None:
                        segments.move_to_end(seg_key)
                        digests.extend(found)
                        parent = found[-1]
                        index += seg
                        continue
                    missed_segments.append(index)
                block_key = (
                    parent,
                    token_bytes[start : start + block_width],
                    None if extras is None else extras[index],
                )
                hit = blocks.get(block_key)
                if hit is None:
                    break
                blocks.move_to_end(block_key)
                digests.append(hit)
                parent = hit
                index += 1
        return missed_segments

    def record(
        self,
        root: bytes,
        token_bytes: bytes,
        block_width: int,
        extras: Sequence[ExtraKeys] | None,
        digests: Sequence[bytes],
        first_new: int,
        missed_segments: list[int],
    ) -> None:
        """Remember a chain whose blocks from `first_new` on were just hashed.

        Full segments go to the segment level (those that missed, and every one past `first_new`); blocks
        of the ragged tail go to the block level, where the next, longer turn will find them.
        """
        seg = SEGMENT_BLOCKS
        seg_width = seg * block_width
        num_blocks = len(digests)
        full_end = num_blocks - num_blocks % seg
        first_unlooked = -(-first_new // seg) * seg
        starts = dict.fromkeys(missed_segments)
        starts.update(dict.fromkeys(range(first_unlooked, full_end, seg)))
        seg_entries = []
        for index in starts:
            start = index * block_width
            key = (
                root if index == 0 else digests[index - 1],
                token_bytes[start : start + seg_width],
                None if extras is None else tuple(extras[index : index + seg]),
            )
            seg_entries.append((key, tuple(digests[index : index + seg])))
        block_entries = []
        for index in range(max(first_new, full_end), num_blocks):
            start = index * block_width
            key = (
                root if index == 0 else digests[index - 1],
                token_bytes[start : start + block_width],
                None if extras is None else extras[index],
            )
            block_entries.append((key, digests[index]))
        with self._lock:
            segments, blocks = self._segments, self._blocks
            for seg_key, seg_digests in seg_entries:
                segments[seg_key] = seg_digests
                segments.move_to_end(seg_key)
            while len(segments) > self._segment_capacity:
                segments.popitem(last=False)
            for block_key, digest in block_entries:
                blocks[block_key] = digest
            while len(blocks) > self._block_capacity:
                blocks.popitem(last=False)
