"""The status page (GET / and /ui) and the JSON it polls (GET /v1/status), over a real fleet: three engine
streams on 127.0.0.1, a real IngestService, the real HTTP app in a thread, and the page in a real headless
browser (the system's Chromium, driven by Playwright; no browser is downloaded).

The screenshot lands in the test's tmp_path and, when KVINDEX_ARTIFACTS names a folder, there too
(`KVINDEX_ARTIFACTS=test-artifacts python -m pytest tests/api/test_status_page.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_harness import ServerThread, start_service, wait_until_ingested
from engines import Engine
from kvindex.api.settings import ApiKey, ApiSettings
from kvindex.indexer.ingest import IngestService
from kvindex.indexer.model import ModelConfig
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelConfig(name="m", block_size=16)  # hash seed unset, as Engine.hasher hashes
PROMPT = list(range(500, 500 + 3 * 16))
WAIT_MS = 15_000  # the page polls every 2 s; a ZMQ disconnect is seen well within this
LIVE_GREEN = "rgb(26, 127, 55)"  # --ok in status.html
DOWN_RED = "rgb(198, 40, 40)"  # --bad


class Fleet:
    def __init__(self, service: IngestService, server: ServerThread, engines: list[Engine]) -> None:
        self.service = service
        self.server = server
        self.engines = engines


@pytest.fixture
def fleet(engines: list[Engine]) -> Iterator[Fleet]:
    """pod-a, and pod-b with two DP ranks; each has published one prompt, pod-a one more we score."""
    engines += [Engine("pod-a"), Engine("pod-b"), Engine("pod-b", dp_rank=1)]
    service = start_service([MODEL], engines)
    server = ServerThread(service).start()
    try:
        for engine in engines:
            engine.store_prompt()
        engines[0].store(engines[0].hasher.event_hashes(PROMPT), PROMPT, block_size=16)
        wait_until_ingested(service, engines)
        yield Fleet(service, server, engines)
    finally:
        server.stop()
        service.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(chromium, os.X_OK):
        message = f"no system Chromium at {chromium} (Debian: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the browser test")
        pytest.skip(message)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


# Plain blocking HTTP: Playwright's sync API keeps an event loop running in the test thread, so
# asyncio.run (and aiohttp's client) cannot be used here. No proxy: the traffic stays on 127.0.0.1.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(method: str, url: str, body: object = None) -> tuple[int, dict[str, str], str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with _HTTP.open(req, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read().decode()


def get_json(url: str) -> Any:
    status, _, text = request("GET", url)
    assert status == 200, text
    return json.loads(text)


def score(fleet: Fleet) -> None:
    status, _, text = request("POST", fleet.server.url + "/v1/score", {"model": "m", "token_ids": PROMPT})
    assert status == 200, text


def open_page(browser: Browser, url: str) -> tuple[Page, list[str]]:
    """The page, and the errors it raises or logs (a CSP refusal included) as they happen."""
    page = browser.new_page(viewport={"width": 1280, "height": 720})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(url)
    return page, errors


def row(page: Page, engine: Engine) -> Locator:
    return page.locator(f'#pods tbody tr[data-pod="{engine.pod_id}"][data-rank="{engine.dp_rank}"]')


def expect_state(page: Page, engine: Engine, state: str, level: str, colour: str) -> None:
    cell = row(page, engine).locator("td.state")
    expect(cell).to_have_text(state, timeout=WAIT_MS)
    expect(cell).to_have_attribute("data-state", state)
    expect(cell).to_have_class(re.compile(rf"\b{level}\b"))
    expect(cell.locator(".pill")).to_have_css("background-color", colour)


def test_status_json_is_what_pods_and_metrics_say(fleet: Fleet) -> None:
    url = fleet.server.url
    score(fleet)
    score(fleet)
    status = get_json(url + "/v1/status")

    stable = ("pod", "model", "dp_rank", "endpoint", "state", "last_seq", "events_total", "blocks")
    pods = get_json(url + "/v1/pods")["pods"]
    assert [{k: p[k] for k in stable} for p in status["pods"]] == [{k: p[k] for k in stable} for p in pods]
    totals = status["totals"]
    assert totals["streams"] == 3
    assert totals["states"] == {
        "live": 3, "replaying": 0, "resyncing": 0, "silent": 0, "hash_mismatch": 0, "disconnected": 0
    }  # fmt: skip
    assert totals["blocks"] == 2 + 2 + 2 + 3
    assert totals["events_total"] == sum(p["events_total"] for p in pods) == 4
    assert totals["gaps_total"] == totals["hash_mismatches_total"] == totals["dropped_total"] == 0

    # The histograms are the registry's own buckets: the same numbers /metrics exposes.
    _, _, metrics_text = request("GET", url + "/metrics")
    exposed: dict[str, list[tuple[float | None, int]]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = None if sample.labels["le"] == "+Inf" else float(sample.labels["le"])
                exposed.setdefault(family.name, []).append((le, int(sample.value)))
    for key, family_name in (
        ("score_latency_seconds", "kvindex_score_latency_seconds"),
        ("score_matched_blocks", "kvindex_score_matched_blocks"),
    ):
        summary = status[key]
        assert summary["count"] == 2
        assert [(b["le"], b["count"]) for b in summary["buckets"]] == exposed[family_name]
    assert status["score_matched_blocks"]["sum"] == 6  # pod-a holds the prompt's 3 blocks, twice scored

    for path in ("/", "/ui"):
        code, headers, body = request("GET", url + path)
        assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert "<title>kvindex status</title>" in body
        assert "default-src 'none'" in headers["Content-Security-Policy"]


def test_page_shows_the_live_fleet_and_a_killed_pod_turning_disconnected(
    fleet: Fleet, browser: Browser, tmp_path: Path
) -> None:
    pod_a, pod_b0, pod_b1 = fleet.engines
    score(fleet)
    page, errors = open_page(browser, fleet.server.url + "/ui")
    try:
        for engine in fleet.engines:
            expect_state(page, engine, "live", "ok", LIVE_GREEN)
            cells = row(page, engine)
            expect(cells.locator("td.seq")).to_have_text(str(engine.publisher.last_seq))
            expect(cells.locator("td.blocks")).to_have_text("5" if engine is pod_a else "2")
            expect(cells.locator("td.gaps")).to_have_text("0")
            expect(cells.locator("td.hash")).to_have_text("ok")
            expect(cells.locator("td.age")).to_have_text(re.compile(r"^\d+(\.\d)? s$"))
        expect(page.locator("#pods tbody tr")).to_have_count(3)
        expect(page.locator("#pods tfoot")).to_contain_text("3 streams")
        expect(page.locator("#fleet")).to_contain_text("3 live")
        expect(page.locator("#matched p")).to_have_text(
            "Mean 3.0, p50 3, 0% matched nothing, since kvindex started."
        )
        expect(page.locator("#latency p")).to_have_text(
            re.compile(
                r"^1 request answered, .*; p50 [\d.]+ ms, p90 [\d.]+ ms, p99 [\d.]+ ms since kvindex started\.$"
            )
        )
        # After a second reading, events/s is a number (0.0 here: nothing was published in between).
        expect(row(page, pod_a).locator("td.rate")).to_have_text(re.compile(r"^\d"), timeout=WAIT_MS)

        pod_b1.close()  # the engine process dies: its PUB socket goes away
        expect_state(page, pod_b1, "disconnected", "bad", DOWN_RED)
        expect(page.locator("#fleet")).to_contain_text("1 down")
        for engine in (pod_a, pod_b0):
            expect_state(page, engine, "live", "ok", LIVE_GREEN)

        shot = tmp_path / "status-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        artifacts = os.environ.get("KVINDEX_ARTIFACTS")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, Path(artifacts) / "status-page.png")

        assert errors == []

        # kvindex itself goes away: the page says so instead of showing the last reading as current.
        fleet.server.stop()
        expect(page.locator("#banner")).to_be_visible(timeout=WAIT_MS)
        expect(page.locator("#banner")).to_contain_text("cannot read v1/status")
        expect(page.locator("body")).to_have_class("stale")
    finally:
        page.close()


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(fleet: Fleet, browser: Browser) -> None:
    """The page is outside /v1 and opens without the key; the /v1/status it polls needs it."""
    keyed = ServerThread(
        fleet.service, ApiSettings(host="127.0.0.1", port=0, api_key=ApiKey("k-123"))
    ).start()
    try:
        page, errors = open_page(browser, keyed.url + "/")
        try:
            form = page.locator("#key")
            expect(form).to_be_visible(timeout=WAIT_MS)
            expect(page.locator("#banner")).to_contain_text("an API key is needed")
            form.locator("input").fill("wrong")
            form.locator("button").click()
            expect(page.locator("#banner")).to_contain_text("that API key was refused", timeout=WAIT_MS)
            form.locator("input").fill("k-123")
            form.locator("button").click()
            for engine in fleet.engines:
                expect_state(page, engine, "live", "ok", LIVE_GREEN)
            expect(form).to_be_hidden()
            expect(page.locator("#banner")).to_be_hidden()
            # Chromium logs each refused fetch ("... status of 401"); nothing else may go wrong.
            assert [e for e in errors if "status of 401" not in e] == []
        finally:
            page.close()
    finally:
        keyed.stop()


def test_page_quantiles_follow_prometheus_histogram_quantile(fleet: Fleet, browser: Browser) -> None:
    page, errors = open_page(browser, fleet.server.url + "/")
    try:
        expect(page.locator("#pods tbody tr")).to_have_count(3, timeout=WAIT_MS)
        # 10 observations: 4 in (0, 1], 4 in (1, 2], 2 above 2.
        buckets = [{"le": 1, "count": 4}, {"le": 2, "count": 8}, {"le": None, "count": 10}]
        assert page.evaluate("b => quantile(b, 0.2)", buckets) == pytest.approx(0.5)  # rank 2 of 4 in (0, 1]
        assert page.evaluate("b => quantile(b, 0.6)", buckets) == pytest.approx(1.5)  # rank 6: halfway (1, 2]
        assert page.evaluate("b => quantile(b, 0.99)", buckets) == 2  # +Inf bucket: the highest finite bound
        assert page.evaluate("b => quantile(b, 0.5)", [{"le": 0, "count": 3}, {"le": None, "count": 3}]) == 0
        assert page.evaluate("quantile([{le: 1, count: 0}, {le: null, count: 0}], 0.5)") is None
        assert errors == []
    finally:
        page.close()


def test_every_static_file_is_package_data() -> None:
    """A regular (non-editable) install carries only what package-data names; .ci/run checks one too."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    static = sorted(p.relative_to(ROOT / "api" / "static") for p in (ROOT / "api" / "static").iterdir())
    assert static, "api/static/ is empty"
    for path in static:
        patterns = globs["kvindex.api.static"]
        assert any(path.match(pattern) for pattern in patterns), f"{path} is not package-data"
