"""Settings the service is built from: models (block size, hash settings, LoRA table) and pods.

Frozen values, built once at start-up (flags or TOML) and passed down; nothing here reads the
environment: the CLI edge resolves PYTHONHASHSEED into `hash_seed`.
"""

from __future__ import annotations

import msgspec


class ModelConfig(msgspec.Struct, frozen=True):
    name: str
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # PYTHONHASHSEED of the engines; None = vLLM's unset rule
    # LoRA adapters name -> path, so routers can send just the adapter name (vLLM hashes both).
    lora_adapters: dict[str, str] = {}
    # KV-cache groups whose blocks form the scored prefix (group_idx); events of other groups are
    # kept out of prefix scoring and counted.
    prefix_group_idxs: frozenset[int] = frozenset({0})


class PodConfig(msgspec.Struct, frozen=True):
    """A pod in connect mode: kvindex dials the engine's PUB (and replay ROUTER) endpoints."""

    pod_id: str
    endpoint: str
    model: str
    replay_endpoint: str | None = None
    dp_rank: int = 0
    # The pod's sidecar (`kvindex sidecar`): its GET /v1/snapshot URL. Joins and gaps older than the
    # replay ring then load the sidecar's state instead of clearing the pod (exact, not partial_view).
    snapshot_url: str | None = None
