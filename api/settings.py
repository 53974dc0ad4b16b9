"""The HTTP side's settings: limits on what a client may send and how scores weigh tiers. Frozen, built
once at start-up (cli/config.py fills them from flags and the TOML file)."""

from __future__ import annotations

import msgspec
from kvindex.indexer.scorer import DEFAULT_TIER_WEIGHTS, DEFAULT_UNKNOWN_TIER_WEIGHT

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 1_000_000
DEFAULT_HASH_IN_EXECUTOR_MIN_TOKENS = 16_384


def default_tier_weights() -> dict[str, float]:
    """A fresh, mutable copy of the scorer's default tier weights (GPU 1.0, CPU 0.8)."""
    return dict(DEFAULT_TIER_WEIGHTS)


class ApiSettings(msgspec.Struct, frozen=True):
    """The HTTP side: limits on what a client may send and how scores weigh tiers."""

    host: str = "0.0.0.0"
    port: int = 8080
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int = DEFAULT_MAX_TOKENS
    # A block of the matched run counts with the weight of its best tier; tiers not listed count
    # `unknown_tier_weight` (explicitly low: we do not know how fast such a tier is).
    tier_weights: dict[str, float] = msgspec.field(default_factory=default_tier_weights)
    unknown_tier_weight: float = DEFAULT_UNKNOWN_TIER_WEIGHT
    # Prompts longer than this are hashed on a worker thread so the event loop keeps serving.
    hash_in_executor_min_tokens: int = DEFAULT_HASH_IN_EXECUTOR_MIN_TOKENS
    # /readyz: ready once at least this many pods are live (and no reachable pod is in its first sync).
    min_live_pods: int = 1
