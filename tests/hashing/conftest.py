"""The `hash_core` fixture: a module's tests run once with the compiled hash core and once with the
pure-Python one (hashing/compiled.py), so the golden vectors and properties hold for both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hash_cores import require_extension
from kvindex.hashing import compiled


# NOTE: module scope (not monkeypatch's function scope), so hypothesis tests can use it too; BlockHashers
# read the core when they are made, so each test sees the one selected here.
@pytest.fixture(scope="module", params=["compiled", "pure"])
def hash_core(request: pytest.FixtureRequest) -> Iterator[str]:
    """Selects the hash core for the module's tests: the compiled one, or None (pure Python)."""
    core = require_extension() if request.param == "compiled" else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "chain_core", core)
        yield str(request.param)
