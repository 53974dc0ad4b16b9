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

    Tokens come as `token_bytes`: ids packed as uint32, `block_width` bytes per block (slicing, hashing
    and comparing bytes is several times cheaper than int tuples, whose ints from a fresh JSON decode
    never share objects). Packing equates True/False with 1/0, so every entry also remembers whether its
    tokens hold an id below 2 (`has_low`): the caller re-checks the types of those tokens on a hit, and
    only those. `capacity_blocks` bounds the digests held (a segment counts SEGMENT_BLOCKS). Safe to share
    between threads: every read-modify of the dicts happens under one lock, never held while hashing.
    (functools.lru_cache was measured too: one call per block costs more than one lookup per segment,
    and it cannot walk a chain.)
    """

    def __init__(self, capacity_blocks: int) -> None:
        self._block_capacity = capacity_blocks
        self._segment_capacity = max(1, capacity_blocks // SEGMENT_BLOCKS)
        self._blocks: OrderedDict[tuple[Any, ...], tuple[bytes, bool]] = OrderedDict()
        self._segments: OrderedDict[tuple[Any, ...], tuple[tuple[bytes, ...], bool]] = OrderedDict()
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
        low_blocks: list[tuple[int, int]],
    ) -> list[int]:
        """Append the longest known prefix of the chain to `digests`.

        Appends to `low_blocks` the block ranges [first, stop) of hits whose tokens hold an id below 2.
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
            get_segment, touch_segment = segments.get, segments.move_to_end
            if extras is None:
                # The common case, kept to a minimum of work per 256 tokens.
                start = 0
                while index < full_end:
                    seg_key: tuple[Any, ...] = (parent, token_bytes[start : start + seg_width], None)
                    found = get_segment(seg_key)
                    if found is None:
                        break
                    touch_segment(seg_key)
                    seg_digests, has_low = found
                    digests.extend(seg_digests)
                    if has_low:
                        low_blocks.append((index, index + seg))
                    parent = seg_digests[-1]
                    index += seg
                    start += seg_width
            while index < num_blocks:
                start = index * block_width
                if index % seg == 0 and index < full_end:
                    seg_key = (
                        parent,
                        token_bytes[start : start + seg_width],
                        None if extras is None else tuple(extras[index : index + seg]),
                    )
                    found = get_segment(seg_key)
                    if found is not None:
                        touch_segment(seg_key)
                        seg_digests, has_low = found
                        digests.extend(seg_digests)
                        if has_low:
                            low_blocks.append((index, index + seg))
                        parent = seg_digests[-1]
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
                parent, has_low = hit
                digests.append(parent)
                if has_low:
                    low_blocks.append((index, index + 1))
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
        low_blocks: Sequence[tuple[int, int]],
        new_has_low: bool,
    ) -> None:
        """Remember a chain whose blocks from `first_new` on were just hashed.

        Full segments go to the segment level (those that missed, and every one past `first_new`); blocks
        of the ragged tail go to the block level, where the next, longer turn will find them. An entry's
        `has_low` comes from `low_blocks` (what `resolve` reported) for known blocks and `new_has_low` for
        the new ones (True is always safe: it only costs a type re-check on a hit).
        """
        seg = SEGMENT_BLOCKS
        seg_width = seg * block_width
        num_blocks = len(digests)
        full_end = num_blocks - num_blocks % seg
        first_unlooked = -(-first_new // seg) * seg

        def has_low(first: int, stop: int) -> bool:
            if new_has_low and stop > first_new:
                return True
            return any(low_first < stop and first < low_stop for low_first, low_stop in low_blocks)

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
            seg_entries.append((key, (tuple(digests[index : index + seg]), has_low(index, index + seg))))
        block_entries = []
        for index in range(max(first_new, full_end), num_blocks):
            start = index * block_width
            key = (
                root if index == 0 else digests[index - 1],
                token_bytes[start : start + block_width],
                None if extras is None else extras[index],
            )
            block_entries.append((key, (digests[index], has_low(index, index + 1))))
        with self._lock:
            segments, blocks = self._segments, self._blocks
            for seg_key, seg_value in seg_entries:
                segments[seg_key] = seg_value
                segments.move_to_end(seg_key)
            while len(segments) > self._segment_capacity:
                segments.popitem(last=False)
            for block_key, block_value in block_entries:
                blocks[block_key] = block_value
            while len(blocks) > self._block_capacity:
                blocks.popitem(last=False)
