"""Which core computes the plain blocks of a chain: compiled or pure Python.

The compiled core (kvindex.hashing._chain, hashing/_chain.c) is built by `pip install` when a C compiler
and OpenSSL's headers are present; it serialises blocks without extra keys in C and hashes them with
SHA-256 itself, or, for the xxhash algorithms, with the algorithm's own digest function (core_digest).
The pure-Python code in hasher.py is the reference and runs everything else: blocks with extra keys, and
every block when the extension is absent or KVINDEX_PURE_PYTHON=1 was set at import.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from kvindex.hashing.algorithms import HashAlgo


class ChainCore(Protocol):
    """What hashing/_chain.c exports (see hashing/_chain.pyi); None from either: leave it to Python."""

    def chain(
        self,
        parent: bytes,
        tokens: Sequence[int],
        block_size: int,
        num_blocks: int,
        cbor: bool,
        digest: Callable[[bytes], bytes] | None = None,
        /,
    ) -> list[bytes] | None: ...

    def chain_packed(
        self,
        parent: bytes,
        token_bytes: bytes,
        first: int,
        block_size: int,
        num_blocks: int,
        cbor: bool,
        digest: Callable[[bytes], bytes] | None = None,
        /,
    ) -> list[bytes] | None: ...

    def pack_ids(self, tokens: Sequence[int], /) -> bytes | None: ...

    def event_keys(self, digests: list[bytes], /) -> bytes: ...

    def pack_ids_tagged(self, tokens: Sequence[int], seg_ids: int, /) -> tuple[bytes, list[int]] | None: ...

    def segment_tags(self, data: bytes, start: int, width: int, count: int, /) -> list[int]: ...

    def preimage(self, parent: bytes, tokens: Sequence[int], cbor: bool, /) -> bytes | None: ...

    def untrack_atomic(self, objects: list[object], /) -> None: ...

    def walk_segments(
        self,
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


# The algorithms the core hashes with its own SHA-256; it calls the others' digest function per block.
CORE_SHA256_ALGOS: Final = frozenset({"sha256", "sha256_cbor"})


def pure_python_forced() -> bool:
    """KVINDEX_PURE_PYTHON=1 (or any value but empty and 0) asks for the pure-Python path."""
    return os.environ.get("KVINDEX_PURE_PYTHON", "") not in ("", "0")


def describe_choice(subject: str, compiled: str | None, fallback: str, missing: str) -> str:
    """One log line saying which of two implementations runs: `subject: compiled` when the compiled one
    does (`compiled` is then its name), else `subject: fallback (why)`, why being KVINDEX_PURE_PYTHON or
    `missing` not having been built."""
    if compiled is not None:
        return f"{subject}: {compiled}"
    why = "KVINDEX_PURE_PYTHON is set" if pure_python_forced() else f"{missing} was not built"
    return f"{subject}: {fallback} ({why})"


def load_extension() -> ChainCore | None:
    """The compiled core if it was built and imports, whatever KVINDEX_PURE_PYTHON says; else None."""
    try:
        from kvindex.hashing import _chain
    except ImportError:  # not built: no compiler or no OpenSSL headers at install time
        return None
    return _chain


# NOTE: read when a BlockHasher is made (never per call), so a test can run both cores in one process by
# setting this; everything else treats it as a constant.
chain_core: ChainCore | None = None if pure_python_forced() else load_extension()


def core_digest(algo: HashAlgo) -> Callable[[bytes], bytes] | None:
    """The `digest` argument of the core's chain calls for `algo`: None where the core's own SHA-256 is
    the algorithm's, else the algorithm's digest function (xxhash's xxh3_128_digest, as vLLM calls it)."""
    return None if algo.name in CORE_SHA256_ALGOS else algo.digest


def describe() -> str:
    """One line for the logs: which core runs."""
    compiled = "compiled core (sha256 in C; xxhash algorithms through xxhash's own digest)"
    return describe_choice(
        "block hashing", compiled if chain_core is not None else None, "pure Python", "the compiled core"
    )
