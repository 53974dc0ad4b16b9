"""A fixture that runs a test module's score requests through each answer writer: the compiled one
(api/_answer.c) and the Python definition (as where it is not built). Use it with
`pytestmark = pytest.mark.usefixtures("answer_writer")` after importing it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from extensions import require_built
from kvindex.api import answer

COMPILED = answer.load_extension()


@pytest.fixture(scope="module", params=["compiled", "python"])
def answer_writer(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "compiled":
        require_built(COMPILED, "kvindex.api._answer", "a C compiler")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answer, "encode_scores", COMPILED if request.param == "compiled" else None)
        yield str(request.param)
