"""The one rule for tests of an optional compiled core: skipped without it locally, a failure under CI=true
(which builds every core and must test each against its pure-Python path)."""

from __future__ import annotations

import os
from typing import TypeVar

import pytest

T = TypeVar("T")


def require_built(core: T | None, module: str, needs: str) -> T:
    """`core` (a loaded extension's function or type); skip or fail the test when it is None."""
    if core is None:
        message = f"{module} was not built (needs {needs})"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must test the compiled cores too")
        pytest.skip(message)
    return core
