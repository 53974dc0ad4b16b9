"""Which reader takes a score request's token ids: compiled (api/_token_ids.c) or msgspec's decode.

The compiled reader is built by `pip install` when a C compiler is present. It reads a body's plain
top-level token_ids array straight into the uint32 form the hasher's memo keys on, with no Python int per
id; anything else, and every request when it is absent or KVINDEX_PURE_PYTHON=1 was set at import, is
decoded by msgspec as before (schemas.decode_score_request_exact, the reference).
"""

from __future__ import annotations

from collections.abc import Callable

from kvindex.hashing.compiled import pure_python_forced

# body -> (the top-level token_ids packed as uint32, start, stop of the array's bytes) or None.
FindTokenIds = Callable[[bytes], tuple[bytes, int, int] | None]


def load_extension() -> FindTokenIds | None:
    """kvindex.api._token_ids's find_token_ids if it was built, whatever KVINDEX_PURE_PYTHON says."""
    try:
        from kvindex.api import _token_ids
    except ImportError:  # not built: no compiler at install time
        return None
    return _token_ids.find_token_ids


# NOTE: read per request, so a test can run both paths in one process by setting this.
find_token_ids: FindTokenIds | None = None if pure_python_forced() else load_extension()


def describe() -> str:
    """One line for the logs: which reader runs."""
    if find_token_ids is not None:
        return "score request token ids: compiled reader"
    if pure_python_forced():
        return "score request token ids: msgspec (KVINDEX_PURE_PYTHON is set)"
    return "score request token ids: msgspec (the compiled reader was not built)"
