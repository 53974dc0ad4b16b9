"""The HTTP shell around the ingest pipeline (read through `IngestView`): app factory, routes, error middleware.

Routes: POST /v1/score (api/score.py), GET /v1/pods, /metrics, /healthz, /readyz, /openapi.json
(api/openapi.py), and the status page (api/status_page.py): GET / and /ui, and the JSON it polls, GET
/v1/status. Every error a client can cause is a JSON `{"error": "<field>: <what is wrong>"}`; anything
unexpected is a logged 500, never a traceback to the client and never a crash of the server or of ingest.
With an API key set, /v1/* needs it (api/auth.py). Served through api/site.py, whose connections answer plain
scores themselves (api/score_connection.py) with this app's ScoreHandler, and hand everything else here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from aiohttp import HttpVersion11, hdrs, web
from kvindex.api.auth import api_key_middleware, refusal
from kvindex.api.failures import INTERNAL_ERROR, expected_failure
from kvindex.api.metrics import MetricsScraper, RequestMetrics
from kvindex.api.openapi import openapi_handler
from kvindex.api.schemas import JSON_ENCODER, ErrorBody, PodsResponse
from kvindex.api.score import ScoreHandler
from kvindex.api.score_connection import FastScore
from kvindex.api.settings import ApiSettings
from kvindex.api.status_page import StatusPage
from kvindex.indexer.status import IngestView
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter

if TYPE_CHECKING:
    from aiohttp.typedefs import Middleware

logger = logging.getLogger(__name__)


class RequestCounts:
    """`kvindex_http_requests` by (route, status), with each labelled child looked up once (labels()
    builds and locks per call, and every request passes here)."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._children: dict[tuple[str, int], Counter] = {}

    def count(self, route: str, status: int) -> None:
        child = self._children.get((route, status))
        if child is None:
            child = self._children[(route, status)] = self._counter.labels(route, str(status))
        child.inc()


SERVICE = web.AppKey("service", IngestView)
SETTINGS = web.AppKey("settings", ApiSettings)
REGISTRY = web.AppKey("registry", CollectorRegistry)
SCRAPER = web.AppKey("scraper", MetricsScraper)
REQUEST_METRICS = web.AppKey("request_metrics", RequestMetrics)
HASH_EXECUTOR = web.AppKey("hash_executor", ThreadPoolExecutor)
STORE_EXECUTOR = web.AppKey("store_executor", ThreadPoolExecutor)
STORE_READ_THREADS = 4
REQUEST_COUNTS = web.AppKey("request_counts", RequestCounts)
FAST_SCORE = web.AppKey("fast_score", FastScore)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(value: object, *, status: int = 200) -> web.Response:
    return web.Response(body=JSON_ENCODER.encode(value), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return json_response(ErrorBody(error=message), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON error and count every response by route and status."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        response = _http_exception_response(request, exc)
    except asyncio.CancelledError:
        raise  # the client went away or the server is stopping
    except Exception as exc:
        failure = expected_failure(exc)
        if failure is None:
            logger.exception("unhandled error answering %s %s", request.method, request.path)
            failure = (500, INTERNAL_ERROR)
        response = error_response(*failure)
    request.app[REQUEST_COUNTS].count(route, response.status)
    return response


def _http_exception_response(request: web.Request, exc: web.HTTPException) -> web.Response:
    if exc.status < 400:
        raise exc  # a redirect or similar: not an error
    if exc.status == 413:
        return _body_too_large(request)
    if exc.status == 404:
        message = f"path: no route {request.path}"
    elif exc.status == 405:
        message = f"method: {request.method} is not allowed on {request.path}"
    else:
        message = f"request: {exc.reason}"
    response = error_response(exc.status, message)
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


def _body_too_large(request: web.Request) -> web.Response:
    return error_response(413, f"body: larger than the limit of {request.app[SETTINGS].max_body_bytes} bytes")


async def expect_body_within_limit(request: web.Request) -> web.Response | None:
    """`Expect: 100-continue` (curl sends it for bodies over 1 MB): refuse a body whose Content-Length
    is over the limit before the client sends it, else let it continue (aiohttp's default behaviour).

    aiohttp calls this before the middlewares, so it counts its own 413.
    """
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11:
        return None
    api_key = request.app[SETTINGS].api_key
    refused = refusal(request, api_key) if api_key is not None else None
    if refused is not None:
        response = refused  # before the body is sent, and before it learns our limits
    elif expect.lower() != "100-continue":
        response = error_response(417, f"request: unknown Expect: {expect}")
    elif request.content_length is not None and request.content_length > request.app[SETTINGS].max_body_bytes:
        response = _body_too_large(request)
    else:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the 100 is not part of the response body
        return None
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[REQUEST_COUNTS].count(route, response.status)
    return response


async def handle_pods(request: web.Request) -> web.Response:
    # Off the loop: block counts come from the store, which may be remote.
    loop = asyncio.get_running_loop()
    statuses = await loop.run_in_executor(request.app[STORE_EXECUTOR], request.app[SERVICE].pod_statuses)
    return json_response(PodsResponse(pods=statuses))


async def handle_ingest(request: web.Request) -> web.Response:
    # The process-wide counters alone: a progress check that costs the same at 1,000 pods as at one (the
    # per-pod /v1/pods and /metrics cost milliseconds there, on the GIL the write path needs).
    return json_response(request.app[SERVICE].counters())


async def handle_metrics(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(request.app[STORE_EXECUTOR], request.app[SCRAPER].scrape)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def handle_healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def handle_readyz(request: web.Request) -> web.Response:
    readiness = request.app[SERVICE].readiness(request.app[SETTINGS].min_live_pods)
    if readiness.ready:
        return json_response({"ready": True, "live_pods": readiness.live_pods})
    return json_response(
        {"ready": False, "live_pods": readiness.live_pods, "error": readiness.reason}, status=503
    )


def create_app(
    service: IngestView, settings: ApiSettings | None = None, *, manage_service: bool = False
) -> web.Application:
    """The aiohttp application serving `service`.

    With `manage_service`, the app starts the service on start-up and stops it on clean-up (what
    `kvindex serve` does); otherwise the caller owns the service's lifetime.
    """
    settings = settings or ApiSettings()
    middlewares: list[Middleware] = [error_middleware]
    if settings.api_key is not None:
        middlewares.append(api_key_middleware(settings.api_key))  # inside: its 401s are counted
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    scraper = MetricsScraper(service)
    request_metrics = scraper.requests
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvindex-hash")
    # Reads of a remote store (Redis) block on the network: run off the event loop, a few at a time.
    store_executor = ThreadPoolExecutor(max_workers=STORE_READ_THREADS, thread_name_prefix="kvindex-store")
    app[SERVICE] = service
    app[SETTINGS] = settings
    app[REGISTRY] = scraper.registry
    app[SCRAPER] = scraper
    app[REQUEST_METRICS] = request_metrics
    app[REQUEST_COUNTS] = RequestCounts(request_metrics.requests)
    app[HASH_EXECUTOR] = executor

    async def own_executor(app: web.Application) -> AsyncIterator[None]:
        yield
        executor.shutdown(wait=True, cancel_futures=True)
        store_executor.shutdown(wait=True, cancel_futures=True)

    app.cleanup_ctx.append(own_executor)
    if manage_service:
        app.cleanup_ctx.append(_own_service)

    app[STORE_EXECUTOR] = store_executor
    score = ScoreHandler(service, settings, request_metrics, executor, store_executor)
    # api/site.py answers plain scores with it, before aiohttp (api/score_connection.py)
    app[FAST_SCORE] = FastScore(score, settings.max_body_bytes, settings.api_key, app[REQUEST_COUNTS].count)
    status_page = StatusPage(service, request_metrics, store_executor)
    app.router.add_routes(
        [
            web.post("/v1/score", score.handle, expect_handler=expect_body_within_limit),
            web.get("/v1/pods", handle_pods),
            web.get("/v1/ingest", handle_ingest),
            web.get("/metrics", handle_metrics),
            web.get("/healthz", handle_healthz),
            web.get("/readyz", handle_readyz),
            web.get("/openapi.json", openapi_handler(bearer_auth=settings.api_key is not None)),
            web.get("/", status_page.handle_page),
            web.get("/ui", status_page.handle_page),
            web.get("/v1/status", status_page.handle_status),
        ]
    )
    return app


async def _own_service(app: web.Application) -> AsyncIterator[None]:
    service = app[SERVICE]
    loop = asyncio.get_running_loop()
    # start() and stop() dial sockets and join threads: keep them off the event loop.
    await loop.run_in_executor(None, service.start)
    try:
        yield
    finally:
        await loop.run_in_executor(None, service.stop)
