"""A reference of vLLM's block hashes written from its rules, for the property tests: the plain formula
vLLM runs per block — H(pickle.dumps / cbor2.dumps(canonical) of (parent or NONE_HASH, tuple(block tokens),
extra keys)) — with extra keys built by brute force from the rules in spec §4.4 (every MM item overlapping
the block, offset relative to the block start)."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import cbor2
import xxhash
from hypothesis import strategies as st


def reference_hash(algo: str, obj: Any) -> bytes:
    data = cbor2.dumps(obj, canonical=True) if algo.endswith("_cbor") else pickle.dumps(obj, protocol=5)
    return hashlib.sha256(data).digest() if algo.startswith("sha256") else xxhash.xxh3_128_digest(data)


def reference_extra_keys(
    start: int,
    end: int,
    lora: tuple[str, str] | None,
    mm: list[tuple[str, int, int]],
    salt: str | None,
    digest: bytes | None,
) -> tuple[Any, ...] | None:
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", *lora))
    keys += [
        ("mm", ident, offset - start)
        for ident, offset, length in mm
        if offset < end and offset + length > start
    ]
    if start == 0 and salt:
        keys.append(("cache_salt", salt))
    if digest is not None:
        keys.append(("prompt_embeds", digest))
    return tuple(keys) or None


def reference_chain(
    algo: str,
    seed: str,
    block_size: int,
    tokens: list[int],
    lora: tuple[str, str] | None = None,
    mm: list[tuple[str, int, int]] | None = None,
    salt: str | None = None,
    digests: list[bytes] | None = None,
    lookahead: int = 0,
) -> list[bytes]:
    root = reference_hash(algo, seed)
    parent = None
    hashes = []
    for index in range((len(tokens) - lookahead) // block_size if len(tokens) >= lookahead else 0):
        start, end = index * block_size, (index + 1) * block_size
        extra = reference_extra_keys(
            start, end + lookahead, lora, mm or [], salt, None if digests is None else digests[index]
        )
        if lookahead:
            extra = (extra, *tokens[end : end + lookahead])
        parent = reference_hash(algo, (parent or root, tuple(tokens[start:end]), extra))
        hashes.append(parent)
    return hashes


@st.composite
def mm_items(draw: st.DrawFn, length: int) -> list[tuple[str, int, int]]:
    """Sorted, non-overlapping placeholders inside [0, length + 8)."""
    items = []
    position = draw(st.integers(0, 6))
    while position < length + 8 and draw(st.booleans()):
        size = draw(st.integers(1, 40))
        items.append((draw(st.sampled_from(["img-a", "img-b", "lora:aud"])), position, size))
        position += size + draw(st.integers(0, 20))
    return items
