"""Which reader takes a score request's id arrays: compiled (api/_id_arrays.c) or msgspec's decode.

The compiled reader is built by `pip install` when a C compiler is present. It reads a body's plain
top-level token_ids array straight into the uint32 form the hasher's memo keys on, or its block_hashes
into the uint64 form the index's lookup reads in place, with no Python int per id; anything else, and
every request when it is absent or KVINDEX_PURE_PYTHON=1 was set at import, is decoded by msgspec as before
(schemas.decode_score_request_exact, the reference).
"""

from __future__ import annotations

from collections.abc import Callable

from kvindex.hashing.compiled import describe_choice, pure_python_forced

# body -> (which key: "token_ids" or "block_hashes", its array packed as native uint32 or uint64, start,
# stop of the array's bytes) or None.
FindIds = Callable[[bytes], tuple[str, bytes, int, int] | None]

# The array typecode of each key's packed ids.
TYPECODES = {"token_ids": "I", "block_hashes": "Q"}


def load_extension() -> FindIds | None:
    """kvindex.api._id_arrays's find_ids if it was built, whatever KVINDEX_PURE_PYTHON says."""
    try:
        from kvindex.api import _id_arrays
    except ImportError:  # not built: no compiler at install time
        return None
    return _id_arrays.find_ids


# NOTE: read per request, so a test can run both paths in one process by setting this.
find_ids: FindIds | None = None if pure_python_forced() else load_extension()


def describe() -> str:
    """One line for the logs: which reader runs."""
    compiled = "compiled reader" if find_ids is not None else None
    return describe_choice("score request ids", compiled, "msgspec", "the compiled reader")
