"""The compiled hash core for tests that need it: skipped without it locally, a failure under CI=true."""

from __future__ import annotations

import os

import pytest
from kvindex.hashing import compiled
from kvindex.hashing.compiled import ChainCore


def require_extension() -> ChainCore:
    """The compiled core; the test skips without it, and fails under CI=true, which must test both."""
    core = compiled.load_extension()
    if core is None:
        message = "kvindex.hashing._chain was not built (needs a C compiler and OpenSSL headers: libssl-dev)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must test the compiled core too")
        pytest.skip(message)
    return core
