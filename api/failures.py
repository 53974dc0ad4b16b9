"""What a failed request answers: the one mapping from an exception to (status, message), shared by the
aiohttp error middleware (app.py) and the score fast path (score_connection.py), so both say the same."""

from __future__ import annotations

from kvindex.api.schemas import RequestError
from kvindex.indexer.store import StoreUnavailable

INTERNAL_ERROR = "server: internal error (logged on the server)"


def expected_failure(exc: Exception) -> tuple[int, str] | None:
    """(status, message) for a failure the client caused or the store explains; None for a bug (a logged 500)."""
    if isinstance(exc, RequestError):
        return exc.status, str(exc)
    if isinstance(exc, StoreUnavailable):
        # A shared store (Redis) that cannot be reached: the answer would be a guess.
        return 503, f"store: {exc}"
    return None
