"""Which reader takes a score request's token ids: compiled (api/_token_ids.c) or msgspec's decode.

The compiled reader is built by `pip install` when a C compiler is present. It packs a plain JSON array of
ids straight into the uint32 form the hasher's memo keys on, with no Python int per id; anything else, and
every request when it is absent or KVINDEX_PURE_PYTHON=1 was set at import, is decoded by msgspec as
before (schemas.decode_score_request_exact, the reference).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from kvindex.hashing.compiled import pure_python_forced

PackJsonIds = Callable[[bytes | msgspec.Raw], bytes | None]


def load_extension() -> PackJsonIds | None:
    """kvindex.api._token_ids's pack_json_ids if it was built, whatever KVINDEX_PURE_PYTHON says."""
    try:
        from kvindex.api import _token_ids
    except ImportError:  # not built: no compiler at install time
        return None
    return _token_ids.pack_json_ids


# NOTE: read per request, so a test can run both paths in one process by setting this.
pack_json_ids: PackJsonIds | None = None if pure_python_forced() else load_extension()


def describe() -> str:
    """One line for the logs: which reader runs."""
    if pack_json_ids is not None:
        return "score request token ids: compiled reader"
    if pure_python_forced():
        return "score request token ids: msgspec (KVINDEX_PURE_PYTHON is set)"
    return "score request token ids: msgspec (the compiled reader was not built)"
