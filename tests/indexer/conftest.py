"""The `index_core` fixture: a module's tests run once on the compiled shard core and once on the
pure-Python one (indexer/compiled.py), so every KVIndex they make is built on each in turn."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from index_cores import CORES, using_core


# NOTE: module scope (not monkeypatch's function scope), so hypothesis tests can use it too.
@pytest.fixture(scope="module", params=CORES)
def index_core(request: pytest.FixtureRequest) -> Iterator[str]:
    with using_core(str(request.param)):
        yield str(request.param)
