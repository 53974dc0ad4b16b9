"""A bounded, thread-safe memo of recent block digests, so a shared or growing prefix is hashed once.

Read path, inside BlockHasher: before hashing a prompt's blocks, the longest already-known prefix of the
chain is looked up here; only the rest is hashed, then recorded. Two levels keep the hot path cheap:
whole *segments* of SEGMENT_BLOCKS aligned blocks (one lookup per 256 tokens at block size 16) and
single blocks for the ragged tail a growing conversation leaves behind. Both are LRU (OrderedDict, C).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

import xxhash
from kvindex.hashing.extra_keys import ExtraKeys

SEGMENT_BLOCKS: Final = 16

# An entry's `has_low`: do its tokens hold an id below 2? None until its first hit settles it.
LowIds = bool | None
# A hit the caller must re-check: (first block, stop block, key to settle, or None if already settled).
LowCheck = tuple[int, int, "tuple[Any, ...] | None"]
# (data, start, width, count) -> the tags of `count` consecutive `width`-byte runs of data from `start`.
SegmentTagger = Callable[[bytes, int, int, int], list[int]]
# (segments, parent, tags, token_bytes, seg_width, seg_blocks, digests, low_checks) -> (blocks, parent):
# resolve's walk over the leading memoised segments (hashing/_chain.c's walk_segments).
SegmentWalker = Callable[
    [
        "OrderedDict[tuple[Any, ...], tuple[bytes, tuple[bytes, ...], LowIds]]",
        bytes,
        list[int],
        bytes,
        int,
        int,
        list[bytes],
        "list[LowCheck] | None",
    ],
    tuple[int, bytes],
]


class DigestMemo:
    """LRU memo: (parent digest, tokens, extra keys) -> digest(s); the parent pins the whole prefix.

    Tokens come as `token_bytes`: ids packed as uint32, `block_width` bytes per block (slicing, hashing
    and comparing bytes is several times cheaper than int tuples, whose ints from a fresh JSON decode
    never share objects). Segment keys carry an xxh3-128 tag of the 1 KiB token run instead of the run
    (copying and siphashing 1 KiB into every key was most of a cold prompt's recording cost); the run is
    kept in the value and compared on every hit, so a tag collision only costs a miss.

    Packing equates True/False with 1/0, so a hit proves values, not types: `resolve` reports every hit
    whose tokens hold, or may hold, an id below 2, and the caller re-checks those tokens' types. Whether
    an entry holds such ids is learnt on its first hit (`settle`), so recording costs nothing extra.

    `capacity_blocks` bounds the digests held (a segment counts SEGMENT_BLOCKS). Safe to share between
    threads: every read-modify of the dicts happens under one lock, never held while hashing.
    (functools.lru_cache was measured too: one call per block costs more than one lookup per segment,
    and it cannot walk a chain.)
    """

    def __init__(
        self,
        capacity_blocks: int,
        segment_tags: SegmentTagger | None = None,
        untrack: Callable[[list[object]], None] | None = None,
        walk_segments: SegmentWalker | None = None,
        defer_records: bool = False,
    ) -> None:
        # The tagger: None for xxh3-128 computed inline (the pure path, unchanged), or the compiled
        # core's (XXH64, every segment in one call). A memo keeps one for life: it only ever compares its
        # keys with keys it made itself, and a tag is never part of a result.
        self._segment_tags = segment_tags
        # The compiled core's untrack_atomic, or None: the entries `record` makes hold only bytes, ints and
        # None, and live on, so the cyclic GC need never scan them (see hashing/_chain.c).
        self._untrack = untrack
        # The compiled core's walk over a prompt's memoised segments (resolve's loop, the same steps), or
        # None for the loop below: the loop's per-segment work was a third of a warm prompt's hashing.
        self._walk_segments = walk_segments
        self._block_capacity = capacity_blocks
        self._segment_capacity = max(1, capacity_blocks // SEGMENT_BLOCKS)
        self._blocks: OrderedDict[tuple[Any, ...], tuple[bytes, LowIds]] = OrderedDict()
        self._segments: OrderedDict[tuple[Any, ...], tuple[bytes, tuple[bytes, ...], LowIds]] = OrderedDict()
        self._lock = threading.Lock()
        # With defer_records, what `record` queued, oldest first: run by flush, or by the next resolve
        # before it reads, so that a caller can answer before it pays for remembering (a fresh
        # 8192-token prompt's record: 26 us at p50, 200 us at p99 when the dicts grow).
        self._defer_records = defer_records
        self._pending: list[Callable[[], None]] = []

    def __len__(self) -> int:
        """Digests held (not those a deferred `record` still queues)."""
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
        low_checks: list[LowCheck] | None,
        seg_tags: list[int] | None = None,
        tags_known: bool = False,
    ) -> list[int]:
        """Append the longest known prefix of the chain to `digests`.

        Appends to `low_checks` (None: the caller proved every id's type) each hit whose tokens hold or
        may hold an id below 2, and (without extra keys) to `seg_tags` the tag of every full segment, for
        `record` to reuse; with `tags_known`, `seg_tags` already holds them (the compiled packer's, made
        by this memo's tagger). Returns the first block of every full segment whose lookup missed: the
        caller `record`s them once their blocks are known, so the next prompt through them takes one
        lookup, not SEGMENT_BLOCKS.
        """
        if self._pending:
            self.flush()
        seg = SEGMENT_BLOCKS
        seg_width = seg * block_width
        full_end = num_blocks - num_blocks % seg
        missed_segments: list[int] = []
        parent = root
        index = 0
        view = memoryview(token_bytes)
        tag = xxhash.xxh3_128_intdigest
        segment_tags = self._segment_tags
        with self._lock:
            segments, blocks = self._segments, self._blocks
            get_segment, touch_segment = segments.get, segments.move_to_end
            if extras is None:
                # The common case, at a minimum of work per segment: tags in one comprehension, and the
                # stored run compared in place (startswith) rather than through a 1 KiB slice.
                at_offset = token_bytes.startswith
                if tags_known and seg_tags is not None:
                    tags = seg_tags
                else:
                    if segment_tags is None:
                        tags = [
                            tag(view[start : start + seg_width])
                            for start in range(0, full_end * block_width, seg_width)
                        ]
                    else:
                        tags = segment_tags(token_bytes, 0, seg_width, full_end // seg)
                    if seg_tags is not None:
                        seg_tags.extend(tags)
                walk = self._walk_segments
                if walk is not None:
                    index, parent = walk(
                        segments, parent, tags, token_bytes, seg_width, seg, digests, low_checks
                    )
                else:
                    for seg_tag in tags:
                        seg_key: tuple[Any, ...] = (parent, seg_tag, None)
                        found = get_segment(seg_key)
                        if found is None or not at_offset(found[0], index * block_width):
                            break
                        touch_segment(seg_key)
                        _, seg_digests, has_low = found
                        digests.extend(seg_digests)
                        if has_low is not False and low_checks is not None:
                            low_checks.append((index, index + seg, seg_key if has_low is None else None))
                        parent = seg_digests[-1]
                        index += seg
            while index < num_blocks:
                start = index * block_width
                if index % seg == 0 and index < full_end:
                    seg_key = (
                        parent,
                        tag(view[start : start + seg_width])
                        if segment_tags is None
                        else segment_tags(token_bytes, start, seg_width, 1)[0],
                        None if extras is None else tuple(extras[index : index + seg]),
                    )
                    found = get_segment(seg_key)
                    if found is not None and token_bytes.startswith(found[0], start):
                        touch_segment(seg_key)
                        _, seg_digests, has_low = found
                        digests.extend(seg_digests)
                        if has_low is not False and low_checks is not None:
                            low_checks.append((index, index + seg, seg_key if has_low is None else None))
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
                if has_low is not False and low_checks is not None:
                    low_checks.append((index, index + 1, block_key if has_low is None else None))
                index += 1
        return missed_segments

    def settle(self, key: tuple[Any, ...], is_segment: bool, has_low: bool) -> None:
        """Record what a re-check learnt about an entry's ids (no-op if it was evicted meanwhile)."""
        with self._lock:
            if is_segment:
                found = self._segments.get(key)
                if found is not None:
                    self._segments[key] = (found[0], found[1], has_low)
            else:
                hit = self._blocks.get(key)
                if hit is not None:
                    self._blocks[key] = (hit[0], has_low)

    def flush(self) -> None:
        """Run the records `defer_records` queued, in order."""
        with self._lock:
            pending, self._pending = self._pending, []
        for record in pending:
            record()

    def record(
        self,
        root: bytes,
        token_bytes: bytes,
        block_width: int,
        extras: Sequence[ExtraKeys] | None,
        digests: Sequence[bytes],
        first_new: int,
        missed_segments: list[int],
        seg_tags: Sequence[int] = (),
        *,
        now: bool = False,
    ) -> None:
        """Remember a chain whose blocks from `first_new` on were just hashed.

        Full segments go to the segment level (those that missed, and every one past `first_new`); blocks
        of the ragged tail go to the block level, where the next, longer turn will find them. `seg_tags`:
        the tags `resolve` computed for this prompt's full segments, if any.

        With `defer_records` (and not `now`), only queued until `flush` or the next `resolve`; `digests` is
        copied, the other arguments must not change meanwhile.
        """
        if self._defer_records and not now:
            kept = tuple(digests)

            def record() -> None:
                self.record(
                    root,
                    token_bytes,
                    block_width,
                    extras,
                    kept,
                    first_new,
                    missed_segments,
                    seg_tags,
                    now=True,
                )

            with self._lock:
                self._pending.append(record)
            return
        seg = SEGMENT_BLOCKS
        seg_width = seg * block_width
        num_blocks = len(digests)
        full_end = num_blocks - num_blocks % seg
        first_unlooked = -(-first_new // seg) * seg
        view = memoryview(token_bytes)
        tag = xxhash.xxh3_128_intdigest
        # A chain hashed only part of the way (BlockHasher's `held`) may end before a missed segment does.
        starts = dict.fromkeys(index for index in missed_segments if index + seg <= num_blocks)
        starts.update(dict.fromkeys(range(first_unlooked, full_end, seg)))
        seg_entries: list[tuple[tuple[Any, ...], tuple[bytes, tuple[bytes, ...], LowIds]]] = []
        for index in starts:
            start = index * block_width
            seg_key = (
                root if index == 0 else digests[index - 1],
                seg_tags[index // seg]
                if seg_tags
                else tag(view[start : start + seg_width])
                if self._segment_tags is None
                else self._segment_tags(token_bytes, start, seg_width, 1)[0],
                None if extras is None else tuple(extras[index : index + seg]),
            )
            run = token_bytes[start : start + seg_width]
            seg_entries.append((seg_key, (run, tuple(digests[index : index + seg]), None)))
        block_entries: list[tuple[tuple[Any, ...], tuple[bytes, LowIds]]] = []
        for index in range(max(first_new, full_end), num_blocks):
            start = index * block_width
            block_key = (
                root if index == 0 else digests[index - 1],
                token_bytes[start : start + block_width],
                None if extras is None else extras[index],
            )
            block_entries.append((block_key, (digests[index], None)))
        if self._untrack is not None:
            created: list[object] = []
            for seg_key, seg_value in seg_entries:
                created += (seg_value[1], seg_value, seg_key)  # the digests tuple before its holder
            for block_key, block_value in block_entries:
                created += (block_key, block_value)
            self._untrack(created)
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
