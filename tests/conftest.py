"""Shared fixtures for every test: vLLM's recorded vectors and a private ZMQ context per test.

This folder is on sys.path (pytest's rootdir conftest), so helper modules here import by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from replay_support import load_vectors


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
