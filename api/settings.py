"""The HTTP side's settings: limits on what a client may send, how scores weigh tiers, and the optional API
key. Frozen, built once at start-up (cli/config.py fills them from flags, the environment and the TOML file)."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
from kvindex.indexer.scorer import DEFAULT_TIER_WEIGHTS, DEFAULT_UNKNOWN_TIER_WEIGHT

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 1_000_000
DEFAULT_HASH_IN_EXECUTOR_MIN_TOKENS = 16_384


def default_tier_weights() -> dict[str, float]:
    """A fresh, mutable copy of the scorer's default tier weights (GPU 1.0, CPU 0.8)."""
    return dict(DEFAULT_TIER_WEIGHTS)


class ApiKey:
    """The key `/v1/*` requires (`Authorization: Bearer <key>`), kept as its SHA-256 only.

    Settings objects get printed; a key must never be: the repr shows nothing of it. `matches` compares
    digests with hmac.compare_digest, so the time taken says nothing about the key, its length included
    (vLLM's AuthenticationMiddleware compares the same way).
    """

    __slots__ = ("_digest",)

    def __init__(self, key: str) -> None:
        self._digest = _sha256(key)

    def matches(self, presented: str) -> bool:
        return hmac.compare_digest(self._digest, _sha256(presented))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKey) and hmac.compare_digest(self._digest, other._digest)

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        return "ApiKey(<redacted>)"


def _sha256(text: str) -> bytes:
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way; they must not raise here.
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


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
    # With a key, every request under /v1/ needs `Authorization: Bearer <key>` (api/auth.py); None: open.
    api_key: ApiKey | None = None
