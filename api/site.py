"""The API's TCP listener: aiohttp's TCPSite, except that each connection starts on the score fast path
(api/score_connection.py) when the app has one, and idle fast connections are closed as aiohttp closes its
own. `kvindex serve`, the demo and the API tests listen through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

from aiohttp import web
from kvindex.api.app import FAST_SCORE
from kvindex.api.score_connection import ScoreConnection

# aiohttp's default keepalive_timeout: connections handed to aiohttp keep it, fast ones get the same.
KEEPALIVE_TIMEOUT_S = 3630.0
SWEEP_INTERVAL_S = 60.0


class ApiSite(web.BaseSite):
    """Listens on host:port for `runner`'s app (after `runner.setup()`); `runner.cleanup()` stops it,
    closing its fast connections. `fast_score=False` leaves every request to aiohttp."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str | None,
        port: int,
        *,
        fast_score: bool = True,
        keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._fast = runner.app.get(FAST_SCORE) if fast_score else None
        self._keepalive_timeout_s = keepalive_timeout_s
        self._sweep_interval_s = sweep_interval_s
        self._connections: set[ScoreConnection] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host or '0.0.0.0'}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        aiohttp_server = self._runner.server
        assert aiohttp_server is not None
        fast = self._fast
        factory: Callable[[], asyncio.BaseProtocol] = (
            aiohttp_server
            if fast is None
            else partial(ScoreConnection, fast, aiohttp_server, self._connections)
        )
        self._server = await loop.create_server(factory, self._host, self._port, backlog=self._backlog)
        if fast is not None:
            self._sweeper = loop.call_later(self._sweep_interval_s, self._sweep)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await super().stop()
        for connection in list(self._connections):
            connection.close()

    def _sweep(self) -> None:
        idle_since = time.monotonic() - self._keepalive_timeout_s
        for connection in list(self._connections):
            if connection.last_active < idle_since:
                connection.close()
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_interval_s, self._sweep)
