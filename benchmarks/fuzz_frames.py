"""Hostile KV-event frames for benchmarks/fuzz.py: seeded mutations of vLLM 0.33's captured frames, and
the wire rules that say what kvindex must drop for each (a reference written from the spec, not from
kvindex's code). Pure: no sockets, threads or clocks; `Fuzzer(seed, ...)` gives the same frames every run.

Payloads: captured batches, truncated, bit-flipped, spliced, random; decoded to Python and re-encoded with a
value of the wrong type, a field dropped or added, a bad event tag, an older shape; a length header far
beyond the data; nesting past msgspec's recursion limit; genuinely large arrays (100k hashes); valid
events naming the good engines' own keys. Frames: bad seqs (wrong length, 0, 2**64-1, backwards, jumps),
1 to 10 frames, and in bind mode topics that are not `kv@<pod>@<model>`.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from kvindex.hashing import BlockHasher
from kvindex.indexer.decode import DecodeError, decode_batch
from kvindex.replay.frames import END_SEQ_BYTES, encode_seq
from kvindex.replay.publisher import encode_batch
from kvindex.replay.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

VECTORS_DIR = Path(__file__).resolve().parents[1] / "tests" / "vectors"
MODEL = "m"
OTHER_MODEL = "org/model@v2"  # a configured model with '@' in its name (the topic splits on the first two)
MODEL_NAMES = (MODEL, OTHER_MODEL)
BLOCK_SIZE = 16
NUM_GOOD_PODS = 2
# Connect mode: hostile pods kvindex dials; the last one has a replay ROUTER that answers garbage.
CONNECT_HOSTILE_PODS = ("hostile-0", "hostile-1", "hostile-2", "hostile-router")
NUM_BIND_SOCKETS = 4
HUGE = 100_000  # elements of a genuinely large array (bounded in memory: ~1 MB of msgpack)
NUM_VICTIM_BATCHES = 400  # the good engines' first batches, whose keys hostile frames also name

# --- the corpus: what vLLM 0.33 really sent ------------------------------------------------------------


class Corpus(msgspec.Struct, frozen=True):
    """vLLM batch payloads (captured live and replayed, BlockPool runs) and the same decoded to Python."""

    payloads: tuple[bytes, ...]
    values: tuple[Any, ...]
    topics: tuple[bytes, ...]


def load_corpus() -> Corpus:
    with open(VECTORS_DIR / "vllm-0.33.0-wire-frames.json") as f:
        wire_frames: dict[str, Any] = json.load(f)
    with open(VECTORS_DIR / "vllm-0.33.0-raw-vectors.json") as f:
        raw: dict[str, Any] = json.load(f)
    messages = [*wire_frames["live_messages"], *wire_frames["dp_rank_1_default_topic"]["messages"]]
    live = [[bytes.fromhex(h) for h in m["frames_hex"]] for m in messages]
    live += [
        [bytes.fromhex(h) for h in m] for m in wire_frames["ring_overflow_buffer_steps_3"]["live_frames_hex"]
    ]
    payloads = [frames[2] for frames in live]
    for reply in wire_frames["replay_dealer_from_seq2"]["reply_messages"]:
        frames = [bytes.fromhex(h) for h in reply["frames_hex"]]
        if len(frames) == 4 and frames[3]:
            payloads.append(frames[3])
    cases = raw["blockpool_event_cases"] + raw["bytes_event_hashes_run"]["blockpool_event_cases"]
    payloads += [
        bytes.fromhex(s["batch_payload_hex"]) for c in cases for s in c["steps"] if "batch_payload_hex" in s
    ]
    unique = tuple(dict.fromkeys(payloads))
    topics = tuple(dict.fromkeys(frames[0] for frames in live))
    return Corpus(payloads=unique, values=tuple(msgspec.msgpack.decode(p) for p in unique), topics=topics)


# --- the good engines' keys (the hostile side names them too) -------------------------------------------


def good_tokens(engine_no: int, batch_no: int) -> list[int]:
    """The token ids of a good engine's `batch_no`-th stored prompt: two blocks, unique per engine and batch."""
    base = (engine_no + 1) * 10**9 + batch_no * 2 * BLOCK_SIZE
    return list(range(base, base + 2 * BLOCK_SIZE))


def good_hasher() -> BlockHasher:
    return BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed=None)  # ModelConfig's defaults


def victim_keys(num_engines: int = NUM_GOOD_PODS, num_batches: int = NUM_VICTIM_BATCHES) -> list[int]:
    hasher = good_hasher()
    return [
        key
        for engine_no in range(num_engines)
        for batch_no in range(num_batches)
        for key in hasher.event_hashes(good_tokens(engine_no, batch_no))
    ]


# --- the wire rules kvindex must follow (the reference for frame-level drops) ---------------------------


def topic_parts(topic: bytes) -> tuple[str, str] | None:
    """(pod, model) of a bind-mode topic `kv@<pod>@<model>` (README); the model may contain '@'. A topic
    that is not UTF-8 is refused (two different byte strings must never name one pod)."""
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return None
    prefix, at1, rest = text.partition("@")
    pod, at2, model = rest.partition("@")
    if prefix != "kv" or not at1 or not at2 or not pod or not model:
        return None
    return pod, model


def expected_intake_drop(mode: str, frames: Sequence[bytes], model_names: Sequence[str]) -> str | None:
    """Why a live message is dropped before any worker sees it (spec 1.2, README bind mode), or None."""
    if len(frames) != 3:
        return "bad_frame_count"
    if len(frames[1]) != 8:
        return "bad_seq"
    if mode == "connect":
        return None  # the socket names the pod; the topic is not read
    parts = topic_parts(frames[0])
    if parts is None:
        return "bad_topic"
    if parts[1] not in model_names:
        return "unknown_model"
    return None


def expected_replay_drop(frames: Sequence[bytes]) -> str | None:
    """Why a replay reply as the DEALER sees it is not a vLLM replay message (spec 1.3), or None."""
    if len(frames) == 4:
        if frames[0]:
            return "bad_delimiter"
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) in (2, 3):
        seq_frame, payload = frames[-2], frames[-1]
    else:
        return "bad_frame_count"
    if len(seq_frame) != 8:
        return "bad_seq"
    if seq_frame == END_SEQ_BYTES and payload:
        return "bad_end_marker"
    return None


def payload_drops(payload: bytes, tally: Counter[str]) -> bool:
    """Add what the worker counts for one decoded payload to `tally`; True if the batch was readable."""
    try:
        decoded = decode_batch(payload, with_token_ids=False)
    except DecodeError as exc:
        tally[f"decode_{exc.reason}"] += 1
        return False
    tally.update(decoded.dropped)
    return True


def replayable_pod_id(pod: str) -> bool:
    """Whether a hostile pod id keeps kvindex's replay dial under the harness's port template
    (`tcp://127.0.0.1:{pod}`) instant: refused as an address at once.

    NOTE: libzmq reads a port with a leading digit ('1e3' is port 1) and a ':' moves the host part (a DNS
    lookup). Such ids make kvindex dial a real address and wait out its replay timeout on the pod's
    worker, every other pod of that worker waiting too: a denial of service worth knowing about, but
    here it would only measure the timeout, so these ids are not sent. ('-1' is left out for the same
    reason: with the batch's dp rank r added, vLLM's port offset, it dials port r - 1.)"""
    return not (pod[:1].isascii() and pod[:1].isdigit()) and ":" not in pod


# --- mutations (pure, seeded) ----------------------------------------------------------------------------

_MARKER = "\x00fuzz-marker\x00"
_MARKER_BYTES = msgspec.msgpack.encode(_MARKER)
_NESTING_DEPTHS = (50, 300, 5_000, 100_000)  # far from msgspec's ~1,000-level limit on either side
_WRONG_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 7, 2**63, 2**64 - 1, -(2**63), 1.5, float("nan"), float("-inf"), "", "x",
    "BlockStored", "GPU", "CPU", "ü-tier", "t" * 300, b"", b"\x00" * 7, b"\xff" * 32, [], [None], [1, "a"],
    [[1, 2], [3]], {}, {"type": "BlockStored"}, {"a": {"b": {"c": [1]}}}, {1: 2}, [2**64 - 1] * 3,
)  # fmt: skip
# NOTE: tier names come from these and from bit flips only: a bounded set. Every distinct medium string is
# a new (pod, tier) entry that KVIndex never frees, and interning one costs O(entries the pod has), so a
# pod sending ever new media costs quadratic time; unbounded random media would only measure that.
_BAD_TAGS: tuple[Any, ...] = (
    "", "blockstored", "BlockFrobbed", "BlockStored\x00", "AllBlocksCleared", "BlockRemoved", 7, None,
    ["BlockStored"], {"BlockStored": 1},
)  # fmt: skip
_HEADERS = {  # type -> (16-bit, 32-bit) length headers
    "array": (b"\xdc", b"\xdd"),
    "map": (b"\xde", b"\xdf"),
    "str": (b"\xda", b"\xdb"),
    "bin": (b"\xc5", b"\xc6"),
}
PAYLOAD_KINDS: dict[str, float] = {
    "captured": 8,  # a captured payload unchanged: valid, applied to the hostile pod
    "truncated": 10,
    "bit_flips": 14,
    "spliced": 6,  # bytes inserted, deleted or repeated; two payloads glued
    "random_bytes": 4,
    "empty_payload": 1,
    "wrong_type": 16,  # a decoded value replaced by one of another type, re-encoded
    "field_dropped": 4,
    "field_added": 3,
    "bad_tag": 3,
    "old_shape": 3,  # array-like events, a 2-element batch, a map batch (older vLLM): valid
    "declared_huge": 4,  # a length header far beyond the data
    "deep_nesting": 1,
    "huge_array": 0.02,  # 100k hashes (stored or removed), token ids, extra keys; 10k events
    "victim_keys": 4,  # valid events naming the good pods' keys, on the hostile pod
}
SEQ_MUTATION_P = 0.08
FRAMES_MUTATION_P = 0.04
TOPIC_MUTATION_P = 0.15


def _descend(rng: random.Random, value: Any, edit: Callable[[random.Random, Any], Any]) -> Any:
    """`value` with one container somewhere inside it (chosen by a random walk) replaced by edit(it);
    copies only the containers on the way down."""
    if isinstance(value, list) and value and rng.random() < 0.6:
        i = rng.randrange(len(value))
        if isinstance(value[i], (list, dict)):
            copy = list(value)
            copy[i] = _descend(rng, value[i], edit)
            return copy
    elif isinstance(value, dict) and value and rng.random() < 0.6:
        key = rng.choice(list(value))
        if isinstance(value[key], (list, dict)):
            copy_map = dict(value)
            copy_map[key] = _descend(rng, value[key], edit)
            return copy_map
    return edit(rng, value)


def _replace_child(rng: random.Random, container: Any, new: Any) -> tuple[Any, Any]:
    """(container with one child replaced by `new`, the old child); an empty one gets `new` appended."""
    if isinstance(container, list):
        copy = list(container)
        if not copy:
            return [new], None
        i = rng.randrange(len(copy))
        old, copy[i] = copy[i], new
        return copy, old
    if isinstance(container, dict):
        copy_map = dict(container)
        if not copy_map:
            return {"type": new}, None
        key = rng.choice(list(copy_map))
        old, copy_map[key] = copy_map[key], new
        return copy_map, old
    return new, container


def _wrong_type(rng: random.Random, container: Any) -> Any:
    return _replace_child(rng, container, rng.choice(_WRONG_VALUES))[0]


def _drop_field(rng: random.Random, container: Any) -> Any:
    if isinstance(container, list) and container:
        copy = list(container)
        del copy[rng.randrange(len(copy))]
        return copy
    if isinstance(container, dict) and container:
        copy_map = dict(container)
        del copy_map[rng.choice(list(copy_map))]
        return copy_map
    return container


def _add_field(rng: random.Random, container: Any) -> Any:
    if isinstance(container, list):
        return [*container, rng.choice(_WRONG_VALUES)]
    if isinstance(container, dict):
        return {
            **container,
            rng.choice(("extra", "block_hashes", "type", "ts", "")): rng.choice(_WRONG_VALUES),
        }
    return container


def _events_of(value: Any) -> list[Any] | None:
    if isinstance(value, list) and len(value) >= 2 and isinstance(value[1], list):
        return value[1]
    return None


def _bad_tag(rng: random.Random, value: Any) -> Any:
    events = _events_of(value)
    if not events:
        return _wrong_type(rng, value)
    i = rng.randrange(len(events))
    event = events[i]
    if not isinstance(event, dict):
        return value
    new_events = list(events)
    new_events[i] = {**event, "type": rng.choice(_BAD_TAGS)}
    return [value[0], new_events, *value[2:]]


def _old_shape(rng: random.Random, value: Any) -> Any:
    events = _events_of(value)
    if events is None:
        return value
    shape = rng.randrange(4)
    if shape == 0:  # vLLM before 0.33: array-like events [tag, field values in order]
        arrays = [
            [e["type"], *(v for k, v in e.items() if k != "type")] if isinstance(e, dict) else e
            for e in events
        ]
        return [value[0], arrays, *value[2:]]
    if shape == 1:  # array-like events cut after block_hashes (the earliest shape), batch without a rank
        arrays = [[e["type"], *list(e.values())[1:3]] if isinstance(e, dict) else e for e in events]
        return [value[0], arrays]
    if shape == 2:  # a map batch (EventBatch was not array_like in some releases)
        return {"ts": value[0], "events": events, "data_parallel_rank": value[2] if len(value) > 2 else None}
    return [*value, "trailing", {"field": 1}]  # newer releases appending batch fields


def _encode_with(value_with_marker: Any, replacement: bytes) -> bytes:
    return msgspec.msgpack.encode(value_with_marker).replace(_MARKER_BYTES, replacement, 1)


def _declared_huge(rng: random.Random, value: Any) -> bytes:
    """A container or string somewhere in `value` re-encoded with a length header far beyond its data."""
    holder: list[Any] = []

    def mark(rng: random.Random, container: Any) -> Any:
        new, old = _replace_child(rng, container, _MARKER)
        holder.append(old)
        return new

    marked = _descend(rng, value, mark)
    old = holder[0] if holder else None
    if isinstance(old, list):
        kind, count, body = "array", len(old), b"".join(msgspec.msgpack.encode(v) for v in old)
    elif isinstance(old, dict):
        kind, count = "map", len(old)
        body = b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in old.items())
    elif isinstance(old, str):
        kind, body = "str", old.encode()
        count = len(body)
    else:
        kind, body = "bin", old if isinstance(old, bytes) else b"\x00" * 8
        count = len(body)
    declared = rng.choice((count + 1, count + 1_000, 2**16 - 1, 2**31, 2**32 - 1))
    short, long = _HEADERS[kind]
    header = short + declared.to_bytes(2, "big") if declared < 2**16 else long + declared.to_bytes(4, "big")
    return _encode_with(marked, header + body)


def _deep(rng: random.Random, value: Any) -> bytes:
    depth = rng.choice(_NESTING_DEPTHS)
    marked = _descend(rng, value, lambda rng, c: _replace_child(rng, c, _MARKER)[0])
    return _encode_with(marked, b"\x91" * depth + b"\x01")


def block_stored(
    keys: Sequence[int], parent: int | None, medium: str = "GPU", tokens: Sequence[int] | None = None
) -> BlockStored:
    """A BlockStored as vLLM's BlockPool writes it; token ids 0, 1, ... unless given."""
    return BlockStored(
        block_hashes=list(keys),
        parent_block_hash=parent,
        token_ids=list(range(len(keys) * BLOCK_SIZE) if tokens is None else tokens),
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[None] * len(keys),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def block_removed(keys: Sequence[int], medium: str | None = "GPU") -> BlockRemoved:
    hashes: list[int | bytes] = list(keys)
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)


def huge_payloads(seed: int) -> tuple[bytes, ...]:
    """Genuinely large payloads (built once: ~1 MB each). The 100k keys are one fixed set, so storing them
    again and again on a hostile pod never grows the index past 100k keys."""
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(HUGE)]
    one = [rng.getrandbits(64)]

    def batch(events: list[Any]) -> bytes:
        return encode_batch(KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))

    stored_keys = block_stored(keys, None, tokens=range(BLOCK_SIZE))  # 16 tokens: never hash-checked
    long_tokens = block_stored(one, None, tokens=range(HUGE))
    long_extra_keys = msgspec.structs.replace(block_stored(one, None), extra_keys=[None] * HUGE)
    return (
        batch([stored_keys]),
        batch([block_removed(keys)]),
        batch([long_tokens]),
        batch([long_extra_keys]),
        batch([block_removed(one)] * 10_000),
        msgspec.msgpack.encode([1.0] * HUGE),  # a 100k-element "batch"
    )


class Message(msgspec.Struct, frozen=True):
    kind: str  # the payload mutation (PAYLOAD_KINDS)
    extra: tuple[str, ...]  # frame-level mutations on top: seq_*, frames_*, topic_*
    target: int  # which hostile socket sends it
    frames: list[bytes]


class Fuzzer:
    """Seeded hostile multipart messages for one mode.

    Most messages are `[topic, seq, payload]` with the payload mutated (PAYLOAD_KINDS) and the seq next for
    its sender, so they reach the decoder; some also get a bad seq, a bad frame count or (bind mode) a bad
    topic. Connect mode: the target is one of CONNECT_HOSTILE_PODS (the topic is not read). Bind mode: the
    target is one of the hostile sockets and the topic names a hostile pod, never a good one.
    """

    def __init__(
        self,
        seed: int,
        corpus: Corpus,
        mode: str,
        *,
        victims: Sequence[int] = (),
        good_pod_ids: Sequence[str] = (),
    ) -> None:
        if mode not in ("connect", "bind"):
            raise ValueError(f"mode must be connect or bind, got {mode!r}")
        self.rng = random.Random(seed)
        self.corpus = corpus
        self.mode = mode
        self.victims = list(victims) or [1, 2, 3, 4]
        self.good_pod_ids = frozenset(good_pod_ids)
        self.num_targets = len(CONNECT_HOSTILE_PODS) if mode == "connect" else NUM_BIND_SOCKETS
        self._kinds = list(PAYLOAD_KINDS)
        self._weights = list(PAYLOAD_KINDS.values())
        self._huge = huge_payloads(seed)
        self._next_seq: dict[object, int] = {}
        self._last_seq: dict[object, int] = {}
        pods = [f"h{i}" for i in range(24)]
        pods += ["hostile pod", "pod/with/slashes", "ü-pod", "{pod}", "%s%n", "p" * 256, "h\x00nul"]
        self.pod_pool = pods
        self.base_topics = [f"kv@{pod}@{MODEL}".encode() for pod in pods]
        self.base_topics += [f"kv@{pod}@{OTHER_MODEL}".encode() for pod in pods[:4]]

    # -- payloads ---------------------------------------------------------------------------------------

    def payload(self) -> tuple[str, bytes]:
        rng = self.rng
        kind = rng.choices(self._kinds, self._weights)[0]
        i = rng.randrange(len(self.corpus.payloads))
        raw, value = self.corpus.payloads[i], self.corpus.values[i]
        if kind == "captured":
            return kind, raw
        if kind == "truncated":
            return kind, raw[: rng.randrange(len(raw))]
        if kind == "bit_flips":
            data = bytearray(raw)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            return kind, bytes(data)
        if kind == "spliced":
            return kind, self._splice(raw)
        if kind == "random_bytes":
            return kind, rng.randbytes(rng.randrange(300))
        if kind == "empty_payload":
            return kind, b""
        if kind == "wrong_type":
            return kind, msgspec.msgpack.encode(_descend(rng, value, _wrong_type))
        if kind == "field_dropped":
            return kind, msgspec.msgpack.encode(_descend(rng, value, _drop_field))
        if kind == "field_added":
            return kind, msgspec.msgpack.encode(_descend(rng, value, _add_field))
        if kind == "bad_tag":
            return kind, msgspec.msgpack.encode(_bad_tag(rng, value))
        if kind == "old_shape":
            return kind, msgspec.msgpack.encode(_old_shape(rng, value))
        if kind == "declared_huge":
            return kind, _declared_huge(rng, value)
        if kind == "deep_nesting":
            return kind, _deep(rng, value)
        if kind == "huge_array":
            return kind, rng.choice(self._huge)
        return "victim_keys", self.victim_payload()

    def _splice(self, raw: bytes) -> bytes:
        rng = self.rng
        a, b = sorted(rng.randrange(len(raw) + 1) for _ in range(2))
        how = rng.randrange(4)
        if how == 0:
            return raw[:a] + rng.randbytes(rng.randint(1, 16)) + raw[a:]
        if how == 1:
            return raw[:a] + raw[b:]
        if how == 2:
            return raw[:b] + raw[a:b] * rng.randint(1, 4) + raw[b:]
        other = rng.choice(self.corpus.payloads)
        return raw + other if rng.random() < 0.5 else raw[:a] + other[a:]

    def victim_payload(self) -> bytes:
        """A valid batch naming keys the good engines hold (or held): the hostile pod's own events."""
        rng = self.rng
        keys = rng.sample(self.victims, rng.randint(1, 4))
        roll = rng.random()
        if roll < 0.6:
            event: Any = block_stored(
                keys, rng.choice((None, self.victims[0])), medium=rng.choice(("GPU", "CPU"))
            )
        elif roll < 0.9:
            event = block_removed(keys, rng.choice(("GPU", "CPU", None)))
        else:
            event = AllBlocksCleared()
        rank = rng.choice((0, None))
        return encode_batch(
            KVEventBatch(ts=rng.uniform(1.7e9, 1.8e9), events=[event], data_parallel_rank=rank)
        )

    # -- frames -----------------------------------------------------------------------------------------

    def message(self) -> Message:
        rng = self.rng
        kind, payload = self.payload()
        extra: list[str] = []
        target = rng.randrange(self.num_targets)
        if self.mode == "connect":
            topic = rng.choice(self.corpus.topics) if rng.random() < 0.9 else rng.randbytes(rng.randrange(20))
            sender: object = target
        else:
            topic = rng.choice(self.base_topics)
            if kind != "victim_keys" and rng.random() < TOPIC_MUTATION_P:
                topic_kind, topic = self.bad_topic(topic)
                extra.append(topic_kind)
            sender = topic
        seq_frame = self._seq_frame(sender, kind != "victim_keys", extra)
        frames = [topic, seq_frame, payload]
        if kind != "victim_keys" and rng.random() < FRAMES_MUTATION_P:
            frames, frames_kind = self._bad_frames(frames)
            extra.append(frames_kind)
        return Message(kind=kind, extra=tuple(extra), target=target, frames=frames)

    def restart(self, target: int) -> None:
        """Connect mode: the hostile engine behind `target` restarted; its seqs start again at 0."""
        self._next_seq.pop(target, None)
        self._last_seq.pop(target, None)

    def _seq_frame(self, sender: object, may_mutate: bool, extra: list[str]) -> bytes:
        rng = self.rng
        seq = self._next_seq.get(sender, 0)
        last = self._last_seq.get(sender, 0)
        self._next_seq[sender] = seq + 1
        if may_mutate and rng.random() < SEQ_MUTATION_P:
            how = rng.choice(("len", "dup", "back", "jump", "zero", "max", "random"))
            extra.append(f"seq_{how}")
            if how == "len":
                return rng.randbytes(rng.choice((0, 1, 4, 7, 9, 16)))
            if how == "dup":
                seq = last
            elif how == "back":
                seq = max(0, last - rng.randint(1, 100))
            elif how == "jump":
                seq = last + rng.randint(2, 10_000)
                self._next_seq[sender] = seq + 1  # the sender goes on from there: a gap
            elif how == "zero":
                seq = 0
                self._next_seq[sender] = 1  # a restarted engine
            elif how == "max":
                seq = 2**64 - 1
            else:
                seq = rng.getrandbits(64)
        else:
            self._last_seq[sender] = seq
        return encode_seq(seq)

    def bad_topic(self, topic: bytes) -> tuple[str, bytes]:
        """A wrong or odd bind-mode topic, never one naming a good pod or a pod id kvindex would dial."""
        rng = self.rng
        pod = rng.choice(self.pod_pool).encode()
        choices: dict[str, bytes] = {
            "topic_empty": b"",
            "topic_no_prefix": pod + b"@m",
            "topic_bad_prefix": rng.choice((b"KV@" + pod + b"@m", b"kv-events", b"kv@", b"kv")),
            "topic_empty_pod": b"kv@@m",
            "topic_empty_model": b"kv@" + pod + b"@",
            "topic_unknown_model": b"kv@" + pod + b"@" + rng.choice((b"nope", b"M", b"m ", b"org/model")),
            "topic_two_parts": b"kv@" + pod,
            "topic_non_utf8": rng.choice((b"kv@\xff\xfe@m", b"kv@h\xc3@m", b"kv@h1@m\xff")),
            "topic_random": rng.randbytes(rng.randrange(40)),
            "topic_long": b"kv@" + rng.choice((b"p", b"q")) * 65_536 + b"@m",
        }
        name = rng.choice(list(choices) + ["topic_bit_flip"])
        if name == "topic_bit_flip":
            data = bytearray(topic)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            new = bytes(data)
        else:
            new = choices[name]
        parts = topic_parts(new)
        if parts is not None and (parts[0] in self.good_pod_ids or not replayable_pod_id(parts[0])):
            # NOTE: a hostile topic naming a good pod is indistinguishable from that pod on the wire (bind
            # mode has no authentication), so the good pods' exactness is only checked without it.
            return name, b"kv@" + pod + b"@nope"
        return name, new

    def _bad_frames(self, frames: list[bytes]) -> tuple[list[bytes], str]:
        rng = self.rng
        topic, seq, payload = frames
        how = rng.randrange(7)
        if how == 0:
            return [payload], "frames_1"
        if how == 1:
            return [topic, payload] if rng.random() < 0.5 else [seq, payload], "frames_2"
        if how == 2:
            return [b"", topic, seq, payload], "frames_4"  # a replay reply's shape, sent live
        if how == 3:
            return [topic, seq, payload, *(rng.randbytes(rng.randrange(8)) for _ in range(7))], "frames_10"
        if how == 4:
            return [b"", b"", b""], "frames_empty"
        if how == 5:
            return [b""], "frames_1_empty"
        return [topic, END_SEQ_BYTES, b""], "frames_end_marker"  # the replay end marker, sent live
