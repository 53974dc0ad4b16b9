"""Engine simulator, shell: one simulated vLLM engine = SimPrefixCache + BlockHasher + EventPublisher + HTTP.

The source of a real KV-event stream for demos and tests: prompts arrive over a minimal OpenAI-style
`POST /v1/completions` (token ids only) or by direct call, the pure cache decides hits and evictions, and
each request's events go out as one KVEventBatch on a vLLM-compatible PUB socket with a replay ROUTER.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq
from aiohttp import web
from kvindex.hashing import BlockHasher
from kvindex.replay.publisher import EventPublisher
from kvindex.sim.cache import CapacityError, SimPrefixCache, synthetic_output_tokens

# vLLM rejects token ids outside the vocabulary; the simulator only asks for ints that fit in int32.
MAX_TOKEN_ID = 2**31 - 1
# vLLM's default for /v1/completions.
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class SimEngineConfig:
    """One simulated engine. Endpoints follow vLLM's KVEventsConfig rules (`*` binds, a host connects);
    port 0 picks an ephemeral port, read back from `SimEngine.pub_endpoint` / `.replay_endpoint`."""

    pod_id: str = "sim-0"
    model: str = "sim-model"
    block_size: int = 16
    capacity_blocks: int = 4096
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # PYTHONHASHSEED as vLLM would see it; None = vLLM's unset rule
    pub_endpoint: str = "tcp://127.0.0.1:0"
    replay_endpoint: str | None = "tcp://127.0.0.1:0"
    topic: str = ""
    dp_rank: int = 0
    buffer_steps: int = 10_000
    http_host: str = "127.0.0.1"
    http_port: int = 0
    vocab_size: int = 32_000  # range of the synthetic output tokens


class CompletionResult(msgspec.Struct, frozen=True):
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    output_token_ids: list[int]
    num_events: int


class BadRequest(ValueError):
    """A request the engine refuses (HTTP 400); the message names the bad field."""


class SimEngine:
    """A simulated vLLM engine. Thread-safe: one request runs at a time (one scheduler step each).

    Direct use: `engine.open()` (sockets only), `engine.handle_prompt(...)`, `engine.close()`.
    Server use, inside a running loop: `await engine.start()` ... `await engine.stop()`.
    """

    def __init__(
        self, config: SimEngineConfig, *, zmq_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.config = config
        self._hasher = BlockHasher(algo=config.hash_algo, block_size=config.block_size, seed=config.hash_seed)
        self._cache = SimPrefixCache(capacity_blocks=config.capacity_blocks, block_size=config.block_size)
        self._zmq_ctx = zmq_ctx
        self._publisher: EventPublisher | None = None
        self._step_lock = threading.Lock()
        self._http_lock: asyncio.Lock | None = None
        self._runner: web.AppRunner | None = None
        self._http_url: str | None = None
        self._next_request = 0
        self.num_batches_published = 0
        self.num_batches_dropped = 0

    # --- lifecycle --------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the PUB and replay sockets (idempotent); raises zmq.ZMQError for a bad endpoint."""
        if self._publisher is None:
            self._publisher = EventPublisher(
                self.config.pub_endpoint,
                replay_endpoint=self.config.replay_endpoint,
                topic=self.config.topic,
                buffer_steps=self.config.buffer_steps,
                dp_rank=self.config.dp_rank,
                ctx=self._zmq_ctx,
            )

    def close(self) -> None:
        """Send what is queued (briefly) and close the sockets."""
        if self._publisher is not None:
            self._publisher.close()

    async def start(self) -> None:
        """Open the sockets and serve HTTP on `config.http_host:http_port` (0 = ephemeral)."""
        self.open()
        self._http_lock = asyncio.Lock()
        runner = web.AppRunner(self._build_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.http_host, self.config.http_port)
        await site.start()
        self._runner = runner
        # The bound port (the configured one may be 0).
        port = runner.addresses[0][1]
        host = self.config.http_host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        self._http_url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await asyncio.to_thread(self.close)

    @property
    def http_url(self) -> str:
        if self._http_url is None:
            raise RuntimeError("the HTTP server is not started")
        return self._http_url

    @property
    def pub_endpoint(self) -> str:
        """The PUB socket's effective endpoint (ephemeral port resolved)."""
        return self._require_publisher().endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._require_publisher().replay_endpoint

    @property
    def last_published_seq(self) -> int | None:
        """The seq of the latest batch actually sent on the PUB socket (None before the first)."""
        return self._require_publisher().last_seq

    @property
    def cache(self) -> SimPrefixCache:
        """The engine's cache, for inspection (mutate it only through the engine)."""
        return self._cache

    # --- engine steps -----------------------------------------------------------------------------

    def handle_prompt(self, token_ids: list[int], max_tokens: int = DEFAULT_MAX_TOKENS) -> CompletionResult:
        """Run one request to completion and publish its events as one batch (if it produced any).

        Raises BadRequest for invalid input or a request larger than the cache, leaving state untouched.
        """
        return self._handle_unchecked(token_ids, max_tokens)

    def _handle_unchecked(self, token_ids: object, max_tokens: object) -> CompletionResult:
        # `handle_prompt` for values of any type (raw JSON on the HTTP path): every argument is checked here.
        prompt = _checked_prompt(token_ids)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
        output = synthetic_output_tokens(prompt, max_tokens, self.config.vocab_size)
        sequence = prompt + output
        # The last sampled token never reaches the KV cache: hash only what is computed.
        block_hashes = self._hasher.block_hashes(sequence[:-1])
        with self._step_lock:
            request_id = f"cmpl-{self.config.pod_id}-{self._next_request}"
            self._next_request += 1
            try:
                result = self._cache.run(request_id, sequence, block_hashes, num_prompt_tokens=len(prompt))
            except CapacityError as exc:
                raise BadRequest(f"prompt: {exc}") from exc
            num_events = self._publish_step()
        return CompletionResult(
            request_id=request_id,
            prompt_tokens=result.num_prompt_tokens,
            cached_tokens=result.num_cached_tokens,
            completion_tokens=result.num_output_tokens,
            output_token_ids=output,
            num_events=num_events,
        )

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset: drop every cached block and publish AllBlocksCleared (False if blocks are in use)."""
        with self._step_lock:
            succeeded = self._cache.reset_prefix_cache()
            self._publish_step()
        return succeeded

    def _publish_step(self) -> int:
        events = self._cache.take_events()
        if not events:
            return 0  # vLLM publishes nothing for a step without events
        if self._publisher is None:
            self.num_batches_dropped += 1
        elif self._publisher.publish(events):
            self.num_batches_published += 1
        else:
            self.num_batches_dropped += 1
        return len(events)

    def _require_publisher(self) -> EventPublisher:
        if self._publisher is None:
            raise RuntimeError("the engine is not open: call open() or start() first")
        return self._publisher

    def metrics_text(self) -> str:
        """Prometheus text: vLLM's prefix-cache counters (same names) plus the simulator's own gauges."""
        labels = f'{{engine="{self.config.dp_rank}",model_name="{self.config.model}"}}'
        cache = self._cache
        lines: list[str] = []
        for name, kind, help_text, value in (
            (
                "vllm:prefix_cache_queries",
                "counter",
                "Prefix cache queries, in terms of number of queried tokens.",
                cache.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "counter",
                "Prefix cache hits, in terms of number of cached tokens.",
                cache.prefix_cache_hits,
            ),
            (
                "kvindex_sim_requests",
                "counter",
                "Requests completed by this simulated engine.",
                cache.num_requests,
            ),
            (
                "kvindex_sim_batches_published",
                "counter",
                "KV-event batches handed to the publisher.",
                self.num_batches_published,
            ),
            (
                "kvindex_sim_batches_dropped",
                "counter",
                "KV-event batches the publisher could not queue.",
                self.num_batches_dropped,
            ),
            (
                "kvindex_sim_cached_blocks",
                "gauge",
                "Blocks holding a prefix-cache hash.",
                cache.num_cached_blocks,
            ),
            (
                "kvindex_sim_capacity_blocks",
                "gauge",
                "KV blocks in the simulated pool.",
                cache.capacity_blocks,
            ),
        ):
            series = f"{name}_total" if kind == "counter" else name
            lines += [
                f"# HELP {series} {help_text}",
                f"# TYPE {series} {kind}",
                f"{series}{labels} {float(value)}",
            ]
        return "\n".join(lines) + "\n"

    # --- HTTP -------------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application()
        app[_ENGINE_KEY] = self
        app.router.add_post("/v1/completions", _completions)
        app.router.add_get("/v1/models", _models)
        app.router.add_get("/metrics", _metrics)
        app.router.add_get("/health", _health)
        app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
        return app

    async def run_step(self, token_ids: object, max_tokens: object) -> CompletionResult:
        """`handle_prompt` off the event loop, one at a time per engine (the HTTP path; arguments are
        validated there, so raw JSON values may be passed)."""
        if self._http_lock is None:
            self._http_lock = asyncio.Lock()
        async with self._http_lock:
            return await asyncio.to_thread(self._handle_unchecked, token_ids, max_tokens)


_ENGINE_KEY = web.AppKey("engine", SimEngine)


def _checked_prompt(token_ids: object) -> list[int]:
    """`token_ids` itself once it is a non-empty list of token ids, else BadRequest."""
    if not isinstance(token_ids, list) or not token_ids:
        raise BadRequest("prompt must be a non-empty list of token ids")
    elements: list[object] = token_ids  # unchecked JSON values until the loop below has seen each
    for token_id in elements:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= MAX_TOKEN_ID:
            raise BadRequest(f"prompt: token ids must be integers in [0, {MAX_TOKEN_ID}], got {token_id!r}")
    return token_ids


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _completions(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "body must be a JSON object")
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object")
    model = body.get("model", engine.config.model)
    if model != engine.config.model:
        return _error(
            400, f"model: {model!r} is not served here (this engine serves {engine.config.model!r})"
        )
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    try:
        result = await engine.run_step(body.get("prompt"), max_tokens)
    except BadRequest as exc:
        return _error(400, str(exc))
    choice: dict[str, object] = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    if body.get("return_token_ids"):
        choice["token_ids"] = result.output_token_ids
    return web.json_response(
        {
            "id": result.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": engine.config.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            },
        }
    )


async def _models(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": engine.config.model, "object": "model", "owned_by": "kvindex-sim"}],
        }
    )


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    return web.Response(text=engine.metrics_text(), content_type="text/plain", charset="utf-8")


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE_KEY]
    lock = engine._http_lock
    assert lock is not None
    async with lock:
        succeeded = await asyncio.to_thread(engine.reset_prefix_cache)
    return web.json_response({"success": succeeded}, status=200 if succeeded else 409)
