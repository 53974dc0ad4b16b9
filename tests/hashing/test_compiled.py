"""The compiled hash core (hashing/_chain.c) against the pure-Python reference and the serialisers
vLLM uses: byte-identical preimages, identical chains, and the switches that choose a core."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import subprocess
import sys
from array import array
from collections.abc import Callable

import cbor2
import pytest
import xxhash
from hash_cores import EDGE_IDS, require_extension
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvindex.hashing import HASH_ALGOS, BlockHasher, compiled
from kvindex.hashing import memo as memo_module

# ids the C encoder covers: every exact int in [0, 2**64)
token_ids = st.one_of(st.sampled_from(EDGE_IDS), st.integers(0, 2**18), st.integers(0, 2**64 - 1))
parents = st.binary(min_size=0, max_size=255)
block_sizes = st.sampled_from([1, 2, 3, 4, 5, 16, 17, 64])
examples = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# The core's `digest` argument: None (its own SHA-256), or the function the xxhash algorithms pass.
core_digests = st.sampled_from([None, xxhash.xxh3_128_digest])


def reference_chain(
    parent: bytes,
    tokens: list[int],
    block_size: int,
    cbor: bool,
    digest: Callable[[bytes], bytes] | None = None,
) -> list[bytes]:
    """vLLM's formula: sha256 (or `digest`: xxhash's xxh3_128_digest, as vLLM's xxhash algorithms call it)
    over pickle protocol 5 or canonical CBOR, block by block."""
    digests = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        obj = (parent, tuple(tokens[start : start + block_size]), None)
        data = cbor2.dumps(obj, canonical=True) if cbor else pickle.dumps(obj, protocol=5)
        parent = hashlib.sha256(data).digest() if digest is None else digest(data)
        digests.append(parent)
    return digests


def test_the_extension_is_built() -> None:
    """Skips locally without a compiler; under CI=true a missing extension fails (.ci/run builds it)."""
    core = require_extension()
    assert compiled.load_extension() is core


@given(parent=parents, tokens=st.lists(token_ids, min_size=1, max_size=70), cbor=st.booleans())
@examples
def test_preimage_is_what_pickle_and_cbor2_write(parent: bytes, tokens: list[int], cbor: bool) -> None:
    core = require_extension()
    obj = (parent, tuple(tokens), None)
    expected = cbor2.dumps(obj, canonical=True) if cbor else pickle.dumps(obj, protocol=5)
    assert core.preimage(parent, tokens, cbor) == expected


@pytest.mark.parametrize("cbor", [False, True])
@pytest.mark.parametrize("token", EDGE_IDS)
def test_every_width_boundary_serialises_exactly(token: int, cbor: bool) -> None:
    core = require_extension()
    for tokens in ([token], [token] * 3, [token, 0, token, 2**64 - 1]):
        obj = (bytes(32), tuple(tokens), None)
        expected = cbor2.dumps(obj, canonical=True) if cbor else pickle.dumps(obj, protocol=5)
        assert core.preimage(bytes(32), tokens, cbor) == expected


@given(
    parent=parents,
    tokens=st.lists(token_ids, max_size=200),
    block_size=block_sizes,
    cbor=st.booleans(),
    as_tuple=st.booleans(),
    digest=core_digests,
)
@examples
def test_chain_equals_the_reference(
    parent: bytes,
    tokens: list[int],
    block_size: int,
    cbor: bool,
    as_tuple: bool,
    digest: Callable[[bytes], bytes] | None,
) -> None:
    core = require_extension()
    num_blocks = len(tokens) // block_size
    sequence = tuple(tokens) if as_tuple else tokens
    assert core.chain(parent, sequence, block_size, num_blocks, cbor, digest) == reference_chain(
        parent, tokens, block_size, cbor, digest
    )


@given(
    parent=parents,
    tokens=st.lists(
        st.one_of(st.sampled_from([0, 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1)), max_size=200
    ),
    block_size=block_sizes,
    first_block=st.integers(0, 5),
    cbor=st.booleans(),
    digest=core_digests,
)
@examples
def test_chain_packed_equals_the_reference_from_any_block(
    parent: bytes,
    tokens: list[int],
    block_size: int,
    first_block: int,
    cbor: bool,
    digest: Callable[[bytes], bytes] | None,
) -> None:
    core = require_extension()
    first = min(first_block * block_size, len(tokens))
    num_blocks = (len(tokens) - first) // block_size
    packed = array("I", tokens).tobytes()
    assert core.chain_packed(parent, packed, first, block_size, num_blocks, cbor, digest) == reference_chain(
        parent, tokens[first : first + num_blocks * block_size], block_size, cbor, digest
    )


def test_a_digest_function_that_fails_or_returns_no_usable_parent_raises() -> None:
    """The digest function is the algorithm's own (never the client's); should one misbehave, the chain
    raises rather than hash on from a wrong parent."""
    core = require_extension()
    packed = array("I", [1, 2, 3, 4]).tobytes()

    def broken(data: bytes) -> bytes:
        raise RuntimeError("digest failed")

    with pytest.raises(RuntimeError, match="digest failed"):
        core.chain(bytes(16), [1, 2, 3, 4], 2, 2, False, broken)
    with pytest.raises(RuntimeError, match="digest failed"):
        core.chain_packed(bytes(16), packed, 0, 2, 2, True, broken)
    for wrong in (lambda data: "text", lambda data: bytearray(16), lambda data: bytes(256)):
        with pytest.raises(TypeError, match="the digest function must return bytes"):
            core.chain(bytes(16), [1, 2, 3, 4], 2, 2, False, wrong)
        with pytest.raises(TypeError, match="the digest function must return bytes"):
            core.chain_packed(bytes(16), packed, 0, 2, 2, False, wrong)
    with pytest.raises(TypeError):
        core.chain(bytes(16), [1, 2], 2, 1, False, b"not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        core.chain_packed(bytes(16), packed, 0, 2, 2, False, 7)  # type: ignore[arg-type]

    # A digest of 255 bytes is still a parent pickle writes as SHORT_BINBYTES.
    def longest(data: bytes) -> bytes:
        return (hashlib.sha256(data).digest() * 8)[:255]

    assert core.chain(bytes(16), [1, 2, 3, 4], 2, 2, False, longest) == reference_chain(
        bytes(16), [1, 2, 3, 4], 2, False, longest
    )


def test_the_xxhash_algorithms_run_on_the_core_with_their_own_digest() -> None:
    """Every algorithm's hasher takes the compiled core; the xxhash ones hand it xxh3_128_digest."""
    core = require_extension()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "chain_core", core)
        for algo in HASH_ALGOS:
            hasher = BlockHasher(algo, 16, "0")
            assert hasher._compiled is core
            expected_digest = None if algo.startswith("sha256") else xxhash.xxh3_128_digest
            assert hasher._core_digest is expected_digest
            tokens = list(range(64))
            assert hasher.block_hashes(tokens) == reference_chain(
                hasher.root, tokens, 16, algo.endswith("_cbor"), expected_digest
            )


@given(
    tokens=st.lists(st.one_of(st.sampled_from(EDGE_IDS), st.integers(0, 2**20)), max_size=300),
    block_size=block_sizes,
    algo=st.sampled_from(HASH_ALGOS),
    memo_size=st.sampled_from([0, 64]),
    seed=st.sampled_from(["0", "42"]),
)
@examples
def test_block_hasher_compiled_equals_pure(
    tokens: list[int], block_size: int, algo: str, memo_size: int, seed: str
) -> None:
    """Differential: two BlockHashers, one per core, over the same prompts (twice: memo hits too)."""
    core = require_extension()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "chain_core", core)
        fast = BlockHasher(algo, block_size, seed, memo_size=memo_size)
        patch.setattr(compiled, "chain_core", None)
        pure = BlockHasher(algo, block_size, seed, memo_size=memo_size)
    for prompt in (tokens, tokens + tokens[: len(tokens) // 2], tokens):
        assert fast.block_hashes(prompt) == pure.block_hashes(prompt)
        assert fast.block_hashes_after(pure.root[::-1], prompt) == pure.block_hashes_after(
            pure.root[::-1], prompt
        )


@pytest.mark.parametrize("token", [2**64, 2**70, -1, True, 1.0])
def test_what_the_encoder_does_not_cover_is_left_to_python(token: object) -> None:
    core = require_extension()
    assert core.chain(bytes(32), [1, token, 2], 3, 1, False) is None
    assert core.preimage(bytes(32), [1, token, 2], True) is None
    assert core.chain(bytes(256), [1, 2, 3], 3, 1, False) is None  # a parent pickle writes as BINBYTES
    assert core.chain(bytes(32), [1] * 4097, 4097, 1, False) is None  # pickle would split the frame


def test_ids_beyond_64_bits_still_hash_right_with_the_core() -> None:
    """BlockHasher falls back to the reference for a prompt the C encoder refuses."""
    require_extension()
    tokens = [5, 2**64, 2**70, 7] * 8
    for algo in ("sha256", "sha256_cbor"):
        expected = reference_chain(BlockHasher(algo, 4, "0").root, tokens, 4, algo.endswith("_cbor"))
        assert BlockHasher(algo, 4, "0").block_hashes(tokens) == expected


@given(tokens=st.lists(st.one_of(st.sampled_from(EDGE_IDS), st.booleans(), st.integers(-3, 3)), max_size=40))
@examples
def test_pack_ids_is_array_packing_of_exact_uint32s(tokens: list[int]) -> None:
    core = require_extension()
    exact = all(type(t) is int and 0 <= t < 2**32 for t in tokens)
    assert core.pack_ids(tokens) == (array("I", tokens).tobytes() if exact else None)
    assert core.pack_ids(tuple(tokens)) == core.pack_ids(tokens)


@given(digests=st.lists(st.binary(min_size=8, max_size=40), max_size=30))
@examples
def test_event_keys_are_event_hash_packed_as_uint64(digests: list[bytes]) -> None:
    core = require_extension()
    assert core.event_keys(digests) == array("Q", [int.from_bytes(d[-8:], "big") for d in digests]).tobytes()


@given(
    tokens=st.lists(st.one_of(st.sampled_from(EDGE_IDS), st.booleans(), st.integers(-3, 3)), max_size=90),
    seg_ids=st.sampled_from([8, 16, 24, 64]),
)
@examples
def test_pack_ids_tagged_is_pack_ids_and_segment_tags(tokens: list[int], seg_ids: int) -> None:
    """One pass, the same as pack_ids then segment_tags over every full run of seg_ids ids."""
    core = require_extension()
    packed = core.pack_ids(tokens)
    if packed is None:
        assert core.pack_ids_tagged(tokens, seg_ids) is None
        return
    runs = len(tokens) // seg_ids
    expected_tags = [
        xxhash.xxh64_intdigest(packed[4 * seg_ids * r : 4 * seg_ids * (r + 1)]) for r in range(runs)
    ]
    assert core.pack_ids_tagged(tokens, seg_ids) == (packed, expected_tags)
    assert core.pack_ids_tagged(tuple(tokens), seg_ids) == (packed, expected_tags)


@given(data=st.binary(max_size=3000), width=st.integers(1, 1100), start=st.integers(0, 40))
@examples
def test_segment_tags_are_xxh64(data: bytes, width: int, start: int) -> None:
    core = require_extension()
    start = min(start, len(data))
    count = (len(data) - start) // width
    expected = [
        xxhash.xxh64_intdigest(data[o : o + width]) for o in range(start, start + count * width, width)
    ]
    assert core.segment_tags(data, start, width, count) == expected


def test_untrack_atomic_untracks_only_tuples_of_untracked_items() -> None:
    core = require_extension()
    flat = tuple([b"digest", 7, None, True])
    holds_a_list = tuple([b"run", [1, 2]])
    inner = tuple([b"a", b"b"])
    outer = tuple([inner, 3])
    late_inner = tuple([b"c"])
    early_outer = tuple([late_inner, None])
    objects: list[object] = [flat, holds_a_list, inner, outer, early_outer, late_inner, [1], "text"]
    assert all(gc.is_tracked(t) for t in (flat, holds_a_list, inner, outer, early_outer, late_inner))
    core.untrack_atomic(objects)
    assert not gc.is_tracked(flat)
    assert gc.is_tracked(holds_a_list)  # a list can be part of a cycle
    assert not gc.is_tracked(inner) and not gc.is_tracked(outer)  # inner came first
    assert gc.is_tracked(early_outer) and not gc.is_tracked(late_inner)  # its item was still tracked
    with pytest.raises(TypeError):
        core.untrack_atomic((flat,))  # type: ignore[arg-type]


def test_a_cold_prompt_leaves_no_tracked_objects_in_the_compiled_memo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the memo keeps of a prompt holds bytes, ints and None only: nothing for the cyclic GC to scan
    # (a cold 8192-token prompt used to leave 96 tracked tuples, scanned at the next young collection).
    monkeypatch.setattr(compiled, "chain_core", require_extension())  # also under KVINDEX_PURE_PYTHON=1
    hasher = BlockHasher("sha256", block_size=16, memo_size=1 << 16)
    assert hasher._compiled is not None
    prompts = [[(p * 8192 + i) % 50_000 for i in range(8192)] for p in range(1, 4)]
    hasher.event_hashes(prompts[0])
    gc.collect()
    tracked_before = len(gc.get_objects())
    for prompt in prompts[1:]:
        digests = hasher.event_hashes(prompt + [1, 2, 3] * 60)  # full segments and a ragged tail
        assert len(digests) == (8192 + 180) // 16
    del digests
    assert len(gc.get_objects()) - tracked_before < 10


@given(
    base=st.lists(st.sampled_from([0, 1, 2, 7, 300, 70_000]), min_size=64 * 6, max_size=64 * 6),
    cuts=st.lists(st.integers(0, 64 * 6), min_size=1, max_size=12),
    variants=st.lists(st.tuples(st.integers(0, 64 * 6 - 1), st.sampled_from([0, 1, 5])), max_size=4),
)
@examples
def test_the_compiled_segment_walk_is_the_python_loop(
    base: list[int], cuts: list[int], variants: list[tuple[int, int]]
) -> None:
    """Two memos fed the same prompts (growing turns of one conversation, some with a token changed), one
    walking its segments in C and one in resolve's loop: the same digests, checks, misses and LRU order."""
    core = require_extension()
    block_size, seg_blocks = 4, memo_module.SEGMENT_BLOCKS
    walked = memo_module.DigestMemo(40 * seg_blocks, core.segment_tags, None, core.walk_segments)
    looped = memo_module.DigestMemo(40 * seg_blocks, core.segment_tags, None, None)
    # As BlockHasher's compiled path uses it: the packer's tags given, no low-id checks wanted.
    tagged = memo_module.DigestMemo(40 * seg_blocks, core.segment_tags, None, core.walk_segments)
    root = bytes(range(32))
    prompts = [base[:cut] for cut in cuts]
    for at, token in variants:
        prompts.append(base[:at] + [token] + base[at + 1 :])
    for tokens in prompts:
        packed = array("I", tokens).tobytes()
        num_blocks = len(tokens) // block_size
        answers = []
        for memo in (walked, looped):
            digests: list[bytes] = []
            low_checks: list[memo_module.LowCheck] = []
            tags: list[int] = []
            missed = memo.resolve(root, packed, 4 * block_size, num_blocks, None, digests, low_checks, tags)
            answers.append((digests, low_checks, missed))
            full = core.chain_packed(root, packed, 0, block_size, num_blocks, False)
            assert full is not None and digests == full[: len(digests)]
            memo.record(root, packed, 4 * block_size, None, full, len(digests), missed, tags)
            for first, stop, key in low_checks:
                if key is not None:
                    memo.settle(
                        key,
                        stop - first == seg_blocks,
                        min(tokens[first * block_size : stop * block_size]) < 2,
                    )
        assert answers[0] == answers[1]
        assert list(walked._segments.items()) == list(looped._segments.items())
        assert list(walked._blocks.items()) == list(looped._blocks.items())
        packed_tagged = core.pack_ids_tagged(tokens, seg_blocks * block_size)
        assert packed_tagged is not None and packed_tagged[0] == packed
        digests, tags = [], packed_tagged[1]
        missed = tagged.resolve(root, packed, 4 * block_size, num_blocks, None, digests, None, tags, True)
        assert (digests, missed) == (answers[0][0], answers[0][2])
        full = core.chain_packed(root, packed, 0, block_size, num_blocks, False)
        assert full is not None
        tagged.record(root, packed, 4 * block_size, None, full, len(digests), missed, tags)
        # The same entries in the same LRU order (has_low is never settled here: nothing asks).
        assert [(k, v[:2]) for k, v in tagged._segments.items()] == [
            (k, v[:2]) for k, v in walked._segments.items()
        ]
        assert list(tagged._blocks) == list(walked._blocks)


def test_bad_arguments_raise() -> None:
    core = require_extension()
    with pytest.raises(ValueError):
        core.chain(bytes(32), [1, 2, 3], 2, 2, False)  # 2 blocks of 2 need 4 tokens
    with pytest.raises(ValueError):
        core.chain(bytes(32), [1, 2], 0, 0, False)
    with pytest.raises(TypeError):
        core.chain(bytes(32), iter([1, 2]), 1, 2, False)  # type: ignore[arg-type]
    packed = array("I", [1, 2, 3]).tobytes()
    with pytest.raises(ValueError):
        core.chain_packed(bytes(32), packed, 2, 2, 1, False)  # block 1 of 2 needs tokens 2..3
    with pytest.raises(ValueError):
        core.chain_packed(bytes(32), packed, -1, 1, 1, False)
    with pytest.raises(TypeError):
        core.chain_packed(bytes(32), [1, 2], 0, 1, 2, False)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        core.segment_tags(b"abc", 0, 2, 2)
    with pytest.raises(ValueError):
        core.segment_tags(b"abc", 4, 1, 0)
    with pytest.raises(TypeError):
        core.event_keys([bytes(32), bytes(7)])  # shorter than an event key
    with pytest.raises(ValueError):
        core.pack_ids_tagged([1, 2], 12)  # runs are whole 32-byte stripes
    with pytest.raises(TypeError):
        core.pack_ids_tagged(iter([1, 2]), 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        core.event_keys((bytes(32),))  # type: ignore[arg-type]


CORE_PROBE = """
import json
from kvindex.hashing import BlockHasher, compiled
print(json.dumps({"core": compiled.chain_core is not None,
                  "hasher": BlockHasher("sha256")._compiled is not None,
                  "describe": compiled.describe()}))
"""


def _probe(pure: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "KVINDEX_PURE_PYTHON"}
    if pure is not None:
        env["KVINDEX_PURE_PYTHON"] = pure
    result = subprocess.run(
        [sys.executable, "-c", CORE_PROBE], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_kvindex_pure_python_forces_the_pure_path() -> None:
    require_extension()  # without the extension both runs are pure anyway; nothing would be shown
    forced = _probe("1")
    assert forced["core"] is False and forced["hasher"] is False
    assert "pure Python (KVINDEX_PURE_PYTHON" in str(forced["describe"])
    assert _probe(None)["core"] is True
    assert _probe("0")["core"] is True
