"""The HTTP edge's optional API key, vLLM's `--api-key` convention: with a key configured, every request
whose path is under /v1 needs `Authorization: Bearer <key>`, else a 401 in our error shape. Health, readiness,
metrics, /openapi.json and pages outside /v1 stay open, so probes and Prometheus need no secret.

Runs inside app.py's error middleware (a 401 is counted like any other response), and from its
`Expect: 100-continue` handler, so an unauthorised client is refused before it sends a body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import hdrs, web
from kvindex.api.schemas import JSON_ENCODER, ErrorBody
from kvindex.api.settings import ApiKey

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler, Middleware

PROTECTED_PREFIX = "/v1"


def is_protected(request: web.Request) -> bool:
    """Whether `request` needs the key: its path is /v1 or under /v1/ (routes that do not exist there
    included, as in vLLM: a 404 would tell an outsider which do). OPTIONS passes, as in vLLM: a CORS
    preflight never carries credentials."""
    if request.method == hdrs.METH_OPTIONS:
        return False
    # request.path is the decoded path; the router matches a form of it that keeps %2F encoded, which
    # cannot start with /v1/ unless this one does.
    path = request.path
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def refusal(request: web.Request, api_key: ApiKey) -> web.Response | None:
    """None when the request may go on; else the 401 to send. Neither the answer nor anything logged
    repeats what the client sent: a wrong key may be a real key of something else."""
    if not is_protected(request):
        return None
    problem = authorization_problem(request.headers.get(hdrs.AUTHORIZATION), api_key)
    return None if problem is None else _unauthorized(*problem)


def authorization_problem(header: str | None, api_key: ApiKey) -> tuple[str, str] | None:
    """None when an Authorization header's value carries `api_key`; else (what is wrong, the
    WWW-Authenticate challenge)."""
    if header is None:
        # RFC 6750 section 3: no error code when the request had no credentials at all.
        return "missing; send Authorization: Bearer <API key>", "Bearer"
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return (
            "expected the Bearer scheme (Authorization: Bearer <API key>)",
            'Bearer error="invalid_request"',
        )
    # Surrounding spaces cannot be part of a key (cli/config.py refuses such keys): RFC 7235 allows
    # several spaces after the scheme.
    if not api_key.matches(token.strip(" ")):
        return "wrong API key", 'Bearer error="invalid_token"'
    return None


def _unauthorized(problem: str, challenge: str) -> web.Response:
    return web.Response(
        body=JSON_ENCODER.encode(ErrorBody(error=f"authorization: {problem}")),
        status=401,
        content_type="application/json",
        headers={hdrs.WWW_AUTHENTICATE: challenge},
    )


def api_key_middleware(api_key: ApiKey) -> Middleware:
    """The middleware refusing requests to /v1 without the key (app.py adds it only when one is set)."""

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = refusal(request, api_key)
        if refused is not None:
            return refused
        return await handler(request)

    return require_api_key
