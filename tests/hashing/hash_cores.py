"""The compiled hash core for tests that need it (skipped without it locally, a failure under CI=true), and
the token ids at every serialisation width boundary the hashing tests share."""

from __future__ import annotations

from extensions import require_built
from kvindex.hashing import compiled
from kvindex.hashing.compiled import ChainCore


def require_extension() -> ChainCore:
    """The compiled core; the test skips without it, and fails under CI=true, which must test both."""
    return require_built(
        compiled.load_extension(), "kvindex.hashing._chain", "a C compiler and OpenSSL headers: libssl-dev"
    )


# Every width boundary of pickle's BININT1/BININT2/BININT/LONG1 and of CBOR's heads, both sides, below
# 2**64 (what the compiled encoder covers; tests of the pure path add ids past it).
EDGE_IDS = [
    0,
    1,
    23,
    24,
    255,
    256,
    65535,
    65536,
    2**18 - 1,
    2**18,
    2**30 - 1,
    2**30,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**40,
    2**56 - 1,
    2**56,
    2**63 - 1,
    2**63,
    2**64 - 1,
]
