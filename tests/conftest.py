"""Shared fixtures for every test: vLLM's recorded vectors, a private ZMQ context per test, and engines
closed at teardown.

This folder is on sys.path (pytest's rootdir conftest), so the helper modules beside this file import by
name: `from waiting import wait_for` (the one deadline poll), `from engines import Engine` (an
EventPublisher with a reference of what it holds), `from replay_support import ...` (vectors, frames).
The repository root is put there too: benchmarks/ is not part of the installed package, and its fault
harness (`benchmarks.faults`) drives the ingest lifecycle tests as well as the benchmark smoke tests.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from engines import Engine
from replay_support import load_vectors

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


@pytest.fixture(scope="session")
def wire_frames() -> dict[str, Any]:
    return load_vectors("vllm-0.33.0-wire-frames.json")


@pytest.fixture(scope="session")
def raw_vectors() -> dict[str, Any]:
    return load_vectors("vllm-0.33.0-raw-vectors.json")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Append the engines a test makes; each is closed when the test ends, passed or failed."""
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[Any]:
    """One real redis-server for the session, on a free 127.0.0.1 port (tests flush it: `redis_url`).
    Without the Debian package the test skips locally and fails under CI=true (.ci/run installs it)."""
    from benchmarks.redis_server import RedisServer

    _need_redis_server()
    with RedisServer() as server:
        yield server


def _need_redis_server() -> None:
    """Skip the test without redis-server locally; fail it under CI=true (.ci/run installs it)."""
    import os

    from benchmarks.redis_server import redis_server_path

    if redis_server_path() is None:
        message = "no redis-server on PATH (Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the Redis store tests")
        pytest.skip(message)


@pytest.fixture
def redis_url(redis_server: Any) -> Iterator[str]:
    """The session's redis-server, emptied for this test (and started again if a test stopped it)."""
    import redis

    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """One real Redis Cluster (3 masters on free 127.0.0.1 ports) for the session; tests flush it
    (`redis_cluster_url`). Skips or fails without redis-server as `redis_server` does."""
    from benchmarks.redis_server import RedisClusterServers

    _need_redis_server()
    with RedisClusterServers() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_cluster: Any) -> str:
    """The session's cluster, emptied for this test: its `redis+cluster://` URL (one node's address)."""
    redis_cluster.flush()
    url: str = redis_cluster.url
    return url
