"""The operator's view: `GET /` and `GET /ui` serve one static HTML page (api/static/status.html) that
polls `GET /v1/status` and draws the fleet at a glance.

`/v1/status` (api/schemas.py's StatusResponse) reads what the server already has: the pods' statuses
(as `/v1/pods`), totals over them, and the score histograms as the app's Prometheus registry holds them
(cumulative buckets, as `/metrics` exposes them). Rates and quantiles are the page's business: it diffs
successive readings, so the server keeps no history for it. With an API key set, /v1/status needs it
like all of /v1 (api/auth.py); the page asks for it and keeps it for the browser tab only.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

from aiohttp import web
from kvindex.api.metrics import RequestMetrics
from kvindex.api.schemas import JSON_ENCODER, HistogramBucket, HistogramSummary, StatusResponse, StatusTotals
from kvindex.indexer.status import ALL_STATES, IngestView, PodStatus
from prometheus_client import Histogram

# The page needs nothing from anywhere but this server: the policy makes a CDN link fail, not load.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; connect-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"
    ),
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def histogram_summary(histogram: Histogram) -> HistogramSummary:
    """The histogram as the registry holds it: its `_bucket`, `_count` and `_sum` samples."""
    buckets: list[HistogramBucket] = []
    count = 0
    total = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                buckets.append(
                    HistogramBucket(le=None if le == float("inf") else le, count=int(sample.value))
                )
            elif sample.name.endswith("_count"):
                count = int(sample.value)
            elif sample.name.endswith("_sum"):
                total = sample.value
    return HistogramSummary(count=count, sum=total, buckets=buckets)


def status_totals(pods: list[PodStatus], dropped_total: int) -> StatusTotals:
    states = dict.fromkeys(ALL_STATES, 0)
    for pod in pods:
        states[pod.state] = states.get(pod.state, 0) + 1
    return StatusTotals(
        streams=len(pods),
        states=states,
        blocks=sum(pod.blocks for pod in pods),
        events_total=sum(pod.events_total for pod in pods),
        gaps_total=sum(pod.gaps_total for pod in pods),
        replays_total=sum(pod.replays_total for pod in pods),
        hash_mismatches_total=sum(pod.hash_mismatches_total for pod in pods),
        restarts_total=sum(pod.restarts_total for pod in pods),
        dropped_total=dropped_total,
    )


class StatusPage:
    """The page and the JSON it polls, for one app."""

    def __init__(
        self, service: IngestView, request_metrics: RequestMetrics, store_executor: ThreadPoolExecutor
    ) -> None:
        """`store_executor`: where pod states are read (their block counts may come from a remote store)."""
        self._service = service
        self._store_executor = store_executor
        self._metrics = request_metrics
        self._page = (resources.files("kvindex.api") / "static" / "status.html").read_bytes()

    async def handle_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self._page, content_type="text/html", charset="utf-8", headers=_PAGE_HEADERS)

    async def handle_status(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        pods = await loop.run_in_executor(self._store_executor, self._service.pod_statuses)
        dropped = sum(self._service.counters().dropped.values())
        body = StatusResponse(
            pods=pods,
            totals=status_totals(pods, dropped),
            score_latency_seconds=histogram_summary(self._metrics.score_latency),
            score_matched_blocks=histogram_summary(self._metrics.matched_blocks),
        )
        return web.Response(body=JSON_ENCODER.encode(body), content_type="application/json")
