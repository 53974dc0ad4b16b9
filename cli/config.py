"""Start-up edge of `kvindex serve`: flags + an optional TOML file -> frozen settings objects.

Read once before anything starts: the models (ModelConfig), connect-mode pods (PodConfig), ingest
settings (IngestSettings) and the HTTP API settings (ApiSettings). Flags override or extend the file; the
environment supplies PYTHONHASHSEED and KVINDEX_API_KEY.
Every problem is a ConfigError carrying one sentence that says what to fix.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Protocol

import msgspec
from kvindex.api.settings import ApiKey, ApiSettings, default_tier_weights
from kvindex.cli.process import EVENT_LOOPS
from kvindex.hashing.algorithms import HASH_ALGOS
from kvindex.indexer.ingest import IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.replay.endpoints import endpoint_problem
from msgspec import Meta

DEFAULT_HTTP = "0.0.0.0:8080"
# The GIL switch interval of `kvindex serve` (Python's default is 5 ms). Ingest threads share the GIL with
# the event loop answering scores; a shorter slice hands it back sooner. benchmarks/score.py --quick,
# HTTP p99 during ingest (median of 6 cells, 2 runs x 3 request kinds, shared 2-core box): 5 ms 69 ms,
# 1 ms 31 ms, 0.5 ms 67 ms (worst cell 300 / 44 / 509 ms); ingest events/s about the same.
DEFAULT_SWITCH_INTERVAL_MS = 1.0
# vLLM reads VLLM_API_KEY when --api-key is not given; ours is named for us, so one host can set both.
API_KEY_ENV = "KVINDEX_API_KEY"


class ConfigError(ValueError):
    """A configuration problem, stated as one sentence saying what to fix."""


class StoreSettings(msgspec.Struct, frozen=True):
    """Where the index lives: in this process (url None, the default) or in a shared Redis/Valkey."""

    url: str | None = None
    num_shards: int = 1 << 16
    socket_timeout_s: float = 5.0


_STORE = StoreSettings()


class ServeConfig(msgspec.Struct, frozen=True):
    models: tuple[ModelConfig, ...]
    pods: tuple[PodConfig, ...]
    # Bind mode: one SUB bound per endpoint (vLLM's DP rank r dials the engine's port + r); () = off.
    listen: tuple[str, ...]
    ingest: IngestSettings
    api: ApiSettings
    store: StoreSettings = StoreSettings()
    log_level: str = "info"
    switch_interval_ms: float = DEFAULT_SWITCH_INTERVAL_MS
    # The HTTP side's event loop (cli/process.event_loop_factory): auto, uvloop or asyncio.
    event_loop: str = "auto"
    # model name -> where its hash seed came from: "--hash-seed", "config file", "PYTHONHASHSEED" or
    # "unset: vLLM default" (logged at start-up so operators can check it against the engines).
    seed_sources: dict[str, str] = {}
    # Where the API key came from ("--api-key", "KVINDEX_API_KEY" or "config file"); None: no key.
    api_key_source: str | None = None
    # (pod id, dp rank) -> where the pod's entry came from: "--pod", "config file", or
    # "--pod, replacing the config file's entry" (logged at start-up).
    pod_sources: dict[tuple[str, int], str] = {}


# --- the TOML file, as written by an operator ------------------------------------------------------
# Every key carries its meaning (Meta description) and its bounds; defaults come from the settings structs
# the key fills, so `python -m kvindex.cli.config_doc` (docs/CONFIGURATION.md) is generated from here.

_INGEST = IngestSettings()
_API = ApiSettings()
_MODEL = ModelConfig(name="")


def _check_store_url(url: str) -> None:
    from kvindex.indexer.stores.redis_store import STORE_SCHEMES  # redis-py: imported only with a store

    if url.partition("://")[0] not in STORE_SCHEMES:
        raise ConfigError(
            "--store must be redis://HOST:PORT/DB, rediss://HOST:PORT/DB, redis+cluster://HOST:PORT or "
            f"rediss+cluster://HOST:PORT, got {url!r}"
        )


def _key(description: str, *, ge: int | None = None, gt: int | None = None) -> Meta:
    """A TOML key's meaning (docs/CONFIGURATION.md prints it) and its bounds (checked on load)."""
    if gt is not None:
        return Meta(description=description, gt=gt)
    if ge is not None:
        return Meta(description=description, ge=ge)
    return Meta(description=description)


class _ModelSection(msgspec.Struct, forbid_unknown_fields=True):
    """One served model; pods name it with `model`. `--model NAME` with `--block-size`, `--hash-algo`
    and `--hash-seed` adds a model or changes the file's entry of that name."""

    name: Annotated[str, _key("The model name routers send in `model` and pods name in `model`.")]
    block_size: Annotated[int, _key("Tokens per KV block: the engines' `--block-size`.", ge=1)] = (
        _MODEL.block_size
    )
    hash_algo: Annotated[
        str,
        _key(f"The engines' `--prefix-caching-hash-algo`: one of {', '.join(f'`{a}`' for a in HASH_ALGOS)}."),
    ] = _MODEL.hash_algo
    hash_seed: Annotated[
        str | None,
        _key(
            "The engines' `PYTHONHASHSEED`. Unset: this process's `PYTHONHASHSEED`; if that is unset too, "
            "vLLM's rule (a fixed root for sha256 variants; xxhash variants are refused, since their root "
            "is random per engine process)."
        ),
    ] = None
    lora_adapters: Annotated[
        dict[str, str],
        _key(
            "LoRA adapter name -> path, so routers may send only `lora_name` (vLLM hashes the name and "
            "the path)."
        ),
    ] = {}
    prefix_group_idxs: Annotated[
        list[int],
        _key(
            "KV-cache groups (`group_idx`) whose blocks form the scored prefix; events of other groups "
            "are counted and kept out of scoring."
        ),
    ] = msgspec.field(default_factory=lambda: sorted(_MODEL.prefix_group_idxs))


class _PodSection(msgspec.Struct, forbid_unknown_fields=True):
    """A pod in connect mode (kvindex dials it), one entry per (id, dp rank); the same as `--pod`. A
    `--pod` with the same id and dp rank replaces the entry; two entries for one (id, dp rank) are refused."""

    id: Annotated[str, _key("The pod id routers see in scores and send in `pods` (no `@`).")]
    endpoint: Annotated[str, _key("The engine's PUB socket, `tcp://HOST:PORT` (vLLM's `endpoint`).")]
    replay: Annotated[
        str | None,
        _key(
            "The engine's replay ROUTER socket, `tcp://HOST:PORT` (vLLM's `replay_endpoint`). Unset: "
            "no replay, so a lost message clears the pod until the engine's next `AllBlocksCleared`."
        ),
    ] = None
    model: Annotated[str | None, _key("The model the pod serves; unset: the only configured model.")] = None
    dp_rank: Annotated[
        int,
        _key(
            "The engine's data-parallel rank; vLLM adds it to both ports, so give each rank its own entry "
            "with the offset ports.",
            ge=0,
        ),
    ] = 0
    snapshot: Annotated[
        str | None,
        _key(
            "The pod's sidecar (`kvindex sidecar`) snapshot URL, `http://HOST:8081/v1/snapshot`: a join or "
            "a gap older than the ring loads it instead of clearing the pod (exact, not `partial_view`). "
            "`endpoint` and `replay` are then the sidecar's (5567, 5568)."
        ),
    ] = None


class _TierSection(msgspec.Struct, forbid_unknown_fields=True):
    """How a block of the matched run counts in `score`: the weight of the best tier holding it."""

    weights: Annotated[
        dict[str, Annotated[float, Meta(ge=0)]],
        _key("Tier name (as the engines' events name it) -> weight, >= 0."),
    ] = msgspec.field(default_factory=default_tier_weights)
    unknown_weight: Annotated[
        float,
        _key("The weight of a tier not in `weights` (explicitly low: nobody said how fast it is).", ge=0),
    ] = _API.unknown_tier_weight


class _LimitsSection(msgspec.Struct, forbid_unknown_fields=True):
    """What a client may send to `POST /v1/score`."""

    max_body_bytes: Annotated[
        int, _key("The largest request body accepted; bigger ones answer 413.", ge=1)
    ] = _API.max_body_bytes
    max_tokens: Annotated[
        int,
        _key("The most `token_ids` (or `block_hashes`) one score request may carry; more answer 400.", ge=1),
    ] = _API.max_tokens
    hash_in_executor_min_tokens: Annotated[
        int,
        _key(
            "Prompts of at least this many tokens are hashed on a worker thread, so the event loop keeps "
            "answering other requests meanwhile.",
            ge=1,
        ),
    ] = _API.hash_in_executor_min_tokens


class _StoreSection(msgspec.Struct, forbid_unknown_fields=True):
    """The index's store. Unset `url`: in memory, one per process (several replicas then each consume every
    pod: active-active). A Redis/Valkey URL: one index shared by every replica given the same URL and pod
    list; each pod is ingested by the replica holding its lease."""

    url: Annotated[
        str | None,
        _key(
            "`redis://HOST:PORT/DB` or `rediss://HOST:PORT/DB` (TLS; `redis://user:pass@...` for ACLs); "
            "a Redis Cluster: `redis+cluster://HOST:PORT` or `rediss+cluster://` (any one node; a plain "
            "`redis://` URL of a node with cluster mode on is detected too; DB 0 only). "
            "Unset: the in-memory index."
        ),
    ] = _STORE.url
    lease_ttl_s: Annotated[
        float,
        _key(
            "A pod's ingest lease lapses when its replica has not renewed it for this long; another replica "
            "then takes the pod over (renewed every min(1, ttl/5) s).",
            gt=0,
        ),
    ] = _INGEST.lease_ttl_s
    replica_id: Annotated[
        str, _key("This replica's name in leases and in `/v1/pods` `owner`; empty: host:pid.")
    ] = _INGEST.replica_id
    num_shards: Annotated[
        int,
        _key(
            "Shards of each model's index in the store (each an exact LRU of `max_keys / num_shards` keys); "
            "keep `max_keys / num_shards` at or below Redis' zset-max-listpack-entries (128) for the "
            "compact encoding.",
            ge=1,
        ),
    ] = _STORE.num_shards
    socket_timeout_s: Annotated[
        float, _key("How long one store call may take before it counts as unreachable.", gt=0)
    ] = _STORE.socket_timeout_s


class _IngestSection(msgspec.Struct, forbid_unknown_fields=True):
    """How the write path runs (IngestSettings); the defaults suit a fleet of hundreds of pods."""

    num_workers: Annotated[
        int,
        _key(
            "Threads applying events; each pod always maps to one. More did not ingest faster under the "
            "GIL, and made lookups during ingest slower.",
            ge=1,
        ),
    ] = _INGEST.num_workers
    queue_size: Annotated[
        int,
        _key(
            "Messages queued per worker; past it a message is dropped and the gap repaired by replay.", ge=1
        ),
    ] = _INGEST.queue_size
    queue_full_wait_s: Annotated[
        float,
        _key(
            "How long a full queue holds the poller (messages wait in ZMQ's buffers) before a message is "
            "dropped: a burst costs latency instead of a gap.",
            ge=0,
        ),
    ] = _INGEST.queue_full_wait_s
    max_batch: Annotated[
        int,
        _key("Messages a worker takes per wake-up (one index update per pod among them).", ge=1),
    ] = _INGEST.max_batch
    silent_after_s: Annotated[
        float,
        _key("A connected pod that sent nothing for this long shows `state: silent`.", gt=0),
    ] = _INGEST.silent_after_s
    disconnected_grace_s: Annotated[
        float,
        _key(
            "A disconnected pod's blocks still count in score answers (flagged with its state) for this "
            "long; past it they are kept but left out of answers unless the request asks for "
            "`disconnected` in `states`.",
            gt=0,
        ),
    ] = _INGEST.disconnected_grace_s
    forget_after_s: Annotated[
        float,
        _key(
            "A pod disconnected this long has its blocks dropped to free memory; its return is a fresh join.",
            gt=0,
        ),
    ] = _INGEST.forget_after_s
    quiet_probe_after_s: Annotated[
        float,
        _key(
            "A pod quiet this long after activity (or after connecting) has its replay ring probed, so a "
            "lost last message is found.",
            gt=0,
        ),
    ] = _INGEST.quiet_probe_after_s
    replay_timeout_s: Annotated[
        float,
        _key(
            "A replay request fails when no reply came for this long (an idle timeout: a large ring "
            "streamed at any pace completes).",
            gt=0,
        ),
    ] = _INGEST.replay_timeout_s
    replay_retry_base_s: Annotated[
        float,
        _key(
            "A failed replay request is retried after this delay, doubled per attempt up to "
            "`replay_retry_max_s` (5 attempts in all, each counted in `kvindex_replays_total{outcome}`).",
            gt=0,
        ),
    ] = _INGEST.replay_retry_base_s
    replay_retry_max_s: Annotated[
        float, _key("The longest delay between two attempts of one replay request.", gt=0)
    ] = _INGEST.replay_retry_max_s
    reconnect_settle_s: Annotated[
        float,
        _key(
            "After a SUB (re)connection, wait this long for the subscription to take effect before asking "
            "the ring, so the ring's answer and the live stream overlap.",
            ge=0,
        ),
    ] = _INGEST.reconnect_settle_s
    max_concurrent_replays: Annotated[
        int, _key("Replay requests open at once (one DEALER socket each); more wait their turn.", ge=1)
    ] = _INGEST.max_concurrent_replays
    hash_check_every: Annotated[
        int,
        _key(
            "After each pod's first few, 1 in N eligible `BlockStored` events has its hashes recomputed "
            "from its tokens; a disagreement marks the pod `hash_mismatch`.",
            ge=1,
        ),
    ] = _INGEST.hash_check_every
    index_shards: Annotated[
        int,
        _key("Lock shards per model index; under the GIL more shards only add routing work.", ge=1),
    ] = _INGEST.index_shards
    index_max_keys: Annotated[
        int,
        _key(
            "Block keys per model index; past it the least recently stored keys are evicted (see the "
            "memory table below).",
            ge=1,
        ),
    ] = _INGEST.index_max_keys
    index_max_pods_per_key: Annotated[
        int,
        _key("Pod entries per block key; past it the least recently stored entry is evicted.", ge=1),
    ] = _INGEST.index_max_pods_per_key
    rcvhwm: Annotated[
        int,
        _key(
            "ZMQ receive high-water mark per SUB socket, in messages; when full the engine's PUB drops "
            "(a gap, repaired by replay).",
            ge=1,
        ),
    ] = _INGEST.rcvhwm
    reconnect_ivl_ms: Annotated[
        int, _key("ZMQ's first reconnection delay after a pod's connection drops.", ge=1)
    ] = _INGEST.reconnect_ivl_ms
    reconnect_ivl_max_ms: Annotated[
        int, _key("ZMQ's longest reconnection delay (the delay doubles up to it).", ge=1)
    ] = _INGEST.reconnect_ivl_max_ms
    max_message_bytes: Annotated[
        int,
        _key(
            "Largest message a SUB socket accepts, in bytes; ZMQ drops a sender's connection over it "
            "before reading it (vLLM's batches are a few KB to a few MB).",
            ge=1,
        ),
    ] = _INGEST.max_message_bytes
    snapshot_timeout_s: Annotated[
        float,
        _key("A sidecar snapshot load fails after this long without data (then the ring is replayed).", gt=0),
    ] = _INGEST.snapshot_timeout_s
    snapshot_max_bytes: Annotated[
        int, _key("The largest sidecar snapshot loaded; a bigger one falls back to the ring.", ge=1)
    ] = _INGEST.snapshot_max_bytes


class _ConfigFile(msgspec.Struct, forbid_unknown_fields=True):
    """The file `--config FILE` names; every key is optional. Flags override it."""

    http: Annotated[str, _key("Where to serve the HTTP API, `HOST:PORT` (IPv6 as `[::1]:8080`).")] = (
        DEFAULT_HTTP
    )
    min_live_pods: Annotated[
        int,
        _key(
            "`/readyz` answers 200 once at least this many pods are live and no reachable pod is in its "
            "first sync (0: ready without any).",
            ge=0,
        ),
    ] = _API.min_live_pods
    api_key: Annotated[
        str | None,
        _key(
            "The key `/v1/*` requires (`Authorization: Bearer <key>`; health, readiness and metrics stay "
            f"open). `--api-key`, then `{API_KEY_ENV}`, beat it; prefer the variable to a file that many "
            "can read. Unset: `/v1/*` is open."
        ),
    ] = None
    listen: Annotated[
        str | list[str],
        _key(
            "Bind mode: bind a SUB socket here for engines that dial in (topic `kv@<pod>@<model>`). vLLM "
            "offsets the endpoint an engine dials by its DP rank, so give one endpoint per rank "
            '(`["tcp://*:5557", "tcp://*:5558"]` for DP size 2). Empty: no bind mode.'
        ),
    ] = msgspec.field(default_factory=list)
    listen_replay: Annotated[
        str | None,
        _key(
            "Bind mode: the replay endpoint of a pod that dialled in, a template with `{pod}` and `{model}` "
            "(e.g. `tcp://{pod}:5558`); rank r > 0 is reached at the template's port + r. Unset: no "
            "replay, so a gap clears the pod until it resyncs."
        ),
    ] = None
    listen_snapshot: Annotated[
        str | None,
        _key(
            "Bind mode: the snapshot URL of a pod's sidecar that dialled in, a template with `{pod}` and "
            "`{model}` (e.g. `http://{pod}:8081/v1/snapshot`; one sidecar serves every rank). Unset: no "
            "snapshots."
        ),
    ] = None
    log_level: Annotated[str, _key("Log verbosity: `debug`, `info`, `warning` or `error`.")] = "info"
    switch_interval_ms: Annotated[
        float,
        _key(
            "The GIL switch interval (`sys.setswitchinterval`), in (0, 1000]: shorter hands the GIL from "
            "ingest threads to the score path sooner (Python's own default is 5)."
        ),
    ] = DEFAULT_SWITCH_INTERVAL_MS
    event_loop: Annotated[
        str,
        _key(
            "The HTTP API's event loop: `auto` (uvloop when installed, else asyncio's), `uvloop` (refuse to "
            "start without it) or `asyncio`."
        ),
    ] = "auto"
    models: list[_ModelSection] = []
    pods: list[_PodSection] = []
    tiers: _TierSection = msgspec.field(default_factory=_TierSection)
    limits: _LimitsSection = msgspec.field(default_factory=_LimitsSection)
    ingest: _IngestSection = msgspec.field(default_factory=_IngestSection)
    store: _StoreSection = msgspec.field(default_factory=_StoreSection)


# IngestSettings fields the [ingest] table does not carry, and where they come from instead.
INGEST_FIELDS_ELSEWHERE = {
    "listen_replay_template": "the top-level `listen_replay` key or `--listen-replay`",
    "listen_snapshot_template": "the top-level `listen_snapshot` key or `--listen-snapshot`",
    "lease_ttl_s": "the `[store]` table's `lease_ttl_s` or `--lease-ttl`",
    "replica_id": "the `[store]` table's `replica_id` or `--replica-id`",
}


def load_config_file(path: str | Path) -> _ConfigFile:
    """Parse and type-check a TOML config file (unknown keys are errors)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    try:
        return msgspec.convert(raw, _ConfigFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config file {path}: {_describe_validation(str(exc))}") from None


def _describe_validation(message: str) -> str:
    # "Object contains unknown field `x` - at `$.models[0]`" -> "models[0]: object contains unknown ..."
    if " - at `$" in message:
        problem, _, where = message.rpartition(" - at `$")
        where = where.rstrip("`").lstrip(".")
        return f"{where or 'top level'}: {problem[:1].lower()}{problem[1:]}"
    return message[:1].lower() + message[1:]


# --- flags --------------------------------------------------------------------------------------


def parse_host_port(text: str, *, what: str = "--http") -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:8080`) -> (host, port); port 0 picks a free one."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"{what} {text!r} must be HOST:PORT, e.g. 0.0.0.0:8080")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port_text)


class PodFlag(msgspec.Struct, frozen=True):
    pod_id: str
    endpoint: str
    replay: str | None = None
    model: str | None = None
    dp_rank: int = 0
    snapshot: str | None = None


POD_FLAG_FORM = "ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,dp_rank=N][,snapshot=URL]"


def parse_pod_flag(text: str) -> PodFlag:
    """`ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,dp_rank=N][,snapshot=URL]` -> PodFlag."""
    usage = f"--pod must look like {POD_FLAG_FORM}"
    head, *options = text.split(",")
    pod_id, sep, endpoint = head.partition("=")
    if not sep or not pod_id or not endpoint:
        raise ConfigError(f"{usage}, got {text!r}")
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("replay", "model", "dp_rank", "snapshot") or not value:
            raise ConfigError(
                f"{usage}; {option!r} in {text!r} is not one of replay=, model=, dp_rank=, snapshot="
            )
        if key in values:
            raise ConfigError(f"{usage}; {key}= is given twice in {text!r}")
        values[key] = value
    dp_rank_text = values.get("dp_rank", "0")
    if not dp_rank_text.isdigit():
        raise ConfigError(f"{usage}; dp_rank must be a non-negative integer in {text!r}")
    return PodFlag(
        pod_id=pod_id,
        endpoint=endpoint,
        replay=values.get("replay"),
        model=values.get("model"),
        dp_rank=int(dp_rank_text),
        snapshot=values.get("snapshot"),
    )


class ModelFlags(Protocol):
    """The model flags `kvindex serve` and `kvindex sidecar` share (None when not given)."""

    config: str | None
    model: str | None
    block_size: int | None
    hash_algo: str | None
    hash_seed: str | None


class ServeArgs(Protocol):
    """The flags `cmd_serve.configure` defines, as argparse leaves them: None when not given."""

    config: str | None
    http: str | None
    pod: list[str] | None
    listen: list[str] | None
    listen_replay: str | None
    listen_snapshot: str | None
    model: str | None
    block_size: int | None
    hash_algo: str | None
    hash_seed: str | None
    switch_interval_ms: float | None
    event_loop: str | None
    log_level: str | None
    min_live_pods: int | None
    api_key: str | None
    store: str | None
    lease_ttl: float | None
    replica_id: str | None


def build_serve_config(args: ServeArgs, env: Mapping[str, str]) -> ServeConfig:
    """Merge the TOML file named by `args.config` (if any) with the flags; flags win.

    `args` is the parsed `kvindex serve` command line (an argparse.Namespace). `env` supplies PYTHONHASHSEED, the
    default hash seed of every model whose seed is not given (unset -> vLLM's rule, None), and
    KVINDEX_API_KEY, the API key when --api-key is not given (it beats the file's `api_key`, as a flag would).
    """
    file = load_config_file(args.config) if args.config else _ConfigFile()

    models, seed_sources = _merge_models(file.models, args, env)
    model_names = [model.name for model in models]
    pods, pod_sources = _merge_pods(file.pods, [parse_pod_flag(text) for text in args.pod or ()], model_names)

    listen = _listen_endpoints(args.listen, file.listen)
    listen_replay = args.listen_replay or file.listen_replay
    if listen_replay is not None and not listen:
        raise ConfigError("--listen-replay only applies with --listen (bind mode)")
    if listen_replay is not None:
        _check_replay_template(listen_replay)
    listen_snapshot = args.listen_snapshot or file.listen_snapshot
    if listen_snapshot is not None and not listen:
        raise ConfigError("--listen-snapshot only applies with --listen (bind mode)")
    if listen_snapshot is not None:
        _check_snapshot_template(listen_snapshot)
    if not pods and not listen:
        raise ConfigError("nothing to subscribe to: give at least one --pod ID=ENDPOINT or --listen ENDPOINT")

    host, port = parse_host_port(args.http or file.http)
    api_key, api_key_source = _api_key(args.api_key, env.get(API_KEY_ENV), file.api_key)
    api = ApiSettings(
        host=host,
        port=port,
        max_body_bytes=file.limits.max_body_bytes,
        max_tokens=file.limits.max_tokens,
        tier_weights=dict(file.tiers.weights),
        unknown_tier_weight=file.tiers.unknown_weight,
        hash_in_executor_min_tokens=file.limits.hash_in_executor_min_tokens,
        min_live_pods=args.min_live_pods if args.min_live_pods is not None else file.min_live_pods,
        api_key=api_key,
    )
    if api.min_live_pods < 0:  # --min-live-pods (the file's value is bounded on load)
        raise ConfigError(f"--min-live-pods must be >= 0, got {api.min_live_pods}")
    lease_ttl_s = args.lease_ttl if args.lease_ttl is not None else file.store.lease_ttl_s
    if not lease_ttl_s > 0:
        raise ConfigError(f"--lease-ttl must be > 0 seconds, got {lease_ttl_s}")
    ingest = IngestSettings(
        listen_replay_template=listen_replay,
        listen_snapshot_template=listen_snapshot,
        lease_ttl_s=lease_ttl_s,
        replica_id=args.replica_id if args.replica_id is not None else file.store.replica_id,
        **msgspec.structs.asdict(file.ingest),
    )
    store_url = args.store or file.store.url
    if store_url is not None:
        _check_store_url(store_url)
    store = StoreSettings(
        url=store_url, num_shards=file.store.num_shards, socket_timeout_s=file.store.socket_timeout_s
    )

    log_level = (args.log_level or file.log_level).lower()
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log level must be one of debug, info, warning, error, got {log_level!r}")
    switch_interval_ms = (
        args.switch_interval_ms if args.switch_interval_ms is not None else file.switch_interval_ms
    )
    if not 0 < switch_interval_ms <= 1000:
        raise ConfigError(f"--switch-interval-ms must be in (0, 1000], got {switch_interval_ms}")
    event_loop = args.event_loop or file.event_loop
    if event_loop not in EVENT_LOOPS:
        raise ConfigError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {event_loop!r}")
    return ServeConfig(
        switch_interval_ms=switch_interval_ms,
        event_loop=event_loop,
        models=tuple(models),
        pods=tuple(pods),
        listen=listen,
        ingest=ingest,
        api=api,
        store=store,
        log_level=log_level,
        seed_sources=seed_sources,
        api_key_source=api_key_source,
        pod_sources=pod_sources,
    )


def _api_key(
    flag: str | None, env_value: str | None, file_value: str | None
) -> tuple[ApiKey | None, str | None]:
    """The API key and where it came from: --api-key, else KVINDEX_API_KEY, else the file's api_key
    (vLLM takes --api-key, else VLLM_API_KEY).

    An empty variable counts as unset (compose writes one for an undefined ${VAR}); an empty flag or file
    value is refused rather than read as "no key". No message repeats the key.
    """
    candidates = [
        (flag, "--api-key", "--api-key"),
        (env_value or None, API_KEY_ENV, API_KEY_ENV),
        (file_value, "config file", "the config file's api_key"),
    ]
    for value, source, name in candidates:
        if value is None:
            continue
        if not value:
            raise ConfigError(f"{name} is empty; leave it out to serve /v1/* without an API key")
        if value != value.strip():
            raise ConfigError(
                f"{name} starts or ends with whitespace, which HTTP strips from a header: no client could send it"
            )
        if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
            raise ConfigError(f"{name} contains a control character, which an HTTP header cannot carry")
        return ApiKey(value), source
    return None, None


def _listen_endpoints(flags: Sequence[str] | None, file_listen: str | list[str]) -> tuple[str, ...]:
    """--listen flags (repeatable) replace the file's `listen` (a string or a list); duplicates refused."""
    if flags:
        endpoints, source = list(flags), "--listen"
    elif isinstance(file_listen, str):
        endpoints, source = [file_listen], "listen"
    else:
        endpoints, source = list(file_listen), "listen"
    seen: set[str] = set()
    for endpoint in endpoints:
        if not endpoint:
            raise ConfigError(f"{source} must name an endpoint, e.g. tcp://*:5557")
        problem = endpoint_problem(endpoint, dial=False)
        if problem is not None:
            raise ConfigError(f"{source} {endpoint!r} {problem}, e.g. tcp://*:5557")
        # An ephemeral port (":*" or ":0") binds a fresh socket each time; only a fixed one can clash.
        if endpoint in seen and not endpoint.endswith((":*", ":0")):
            raise ConfigError(
                f"{source} {endpoint} is given twice; bind each endpoint once (one per DP rank)"
            )
        seen.add(endpoint)
    return tuple(endpoints)


def _check_replay_template(template: str) -> None:
    """The ingest service fills in {pod} and {model} only; anything else would fail per pod at run time."""
    hint = "use the placeholders {pod} and {model} only, e.g. tcp://{pod}:5558"
    try:
        filled = template.format(pod="pod", model="model")
    except KeyError as exc:
        raise ConfigError(
            f"--listen-replay {template!r} uses the unknown placeholder {{{exc.args[0]}}}; {hint}"
        ) from None
    except (IndexError, ValueError) as exc:
        raise ConfigError(f"--listen-replay {template!r} is not a valid template ({exc}); {hint}") from None
    problem = endpoint_problem(filled, dial=True)
    # A placeholder may carry the port too (pod ids such as `engine-3:5558` with tcp://{pod}): then each
    # pod's endpoint is checked when it dials in (and said once if it makes none).
    if problem is not None and ("{pod}" in template or "{model}" in template):
        carried = template.format(pod="pod:5558", model="model:5558")
        if endpoint_problem(carried, dial=True) is None:
            problem = None
    if problem is not None:
        raise ConfigError(f"--listen-replay {template!r} {problem}, e.g. tcp://{{pod}}:5558")


def snapshot_url_problem(url: str) -> str | None:
    """Why `url` cannot be a sidecar snapshot URL, or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// URL with a host, e.g. http://pod-a:8081/v1/snapshot"
    return None


def _check_snapshot_template(template: str) -> None:
    hint = "use the placeholders {pod} and {model} only, e.g. http://{pod}:8081/v1/snapshot"
    try:
        filled = template.format(pod="pod", model="model")
    except KeyError as exc:
        raise ConfigError(
            f"--listen-snapshot {template!r} uses the unknown placeholder {{{exc.args[0]}}}; {hint}"
        ) from None
    except (IndexError, ValueError) as exc:
        raise ConfigError(f"--listen-snapshot {template!r} is not a valid template ({exc}); {hint}") from None
    problem = snapshot_url_problem(filled)
    if problem is not None:
        raise ConfigError(f"--listen-snapshot {template!r} {problem}")


def _merge_models(
    sections: Sequence[_ModelSection], args: ModelFlags, env: Mapping[str, str]
) -> tuple[list[ModelConfig], dict[str, str]]:
    env_seed = env.get("PYTHONHASHSEED")
    by_name: dict[str, _ModelSection] = {}
    for section in sections:
        if section.name in by_name:
            raise ConfigError(f"model {section.name!r} is defined twice in the config file")
        by_name[section.name] = section
    seed_sources = {name: "config file" for name, s in by_name.items() if s.hash_seed is not None}
    if args.model is not None:
        section = by_name.get(args.model) or _ModelSection(name=args.model)
        by_name[args.model] = _with_model_flags(section, args)
    elif args.block_size is not None or args.hash_algo is not None or args.hash_seed is not None:
        if len(by_name) != 1:
            raise ConfigError(
                "--block-size, --hash-algo and --hash-seed need --model NAME to say which model"
            )
        (only,) = by_name.values()
        by_name[only.name] = _with_model_flags(only, args)
    if not by_name:
        raise ConfigError("no model configured: pass --model NAME or a --config file with [[models]]")
    if args.hash_seed is not None:
        seed_sources[args.model if args.model is not None else next(iter(by_name))] = "--hash-seed"
    for name in by_name:
        if name not in seed_sources:
            seed_sources[name] = "PYTHONHASHSEED" if env_seed is not None else "unset: vLLM default"
    return [_model_config(section, env_seed) for section in by_name.values()], seed_sources


def _with_model_flags(section: _ModelSection, args: ModelFlags) -> _ModelSection:
    return msgspec.structs.replace(
        section,
        block_size=args.block_size if args.block_size is not None else section.block_size,
        hash_algo=args.hash_algo if args.hash_algo is not None else section.hash_algo,
        hash_seed=args.hash_seed if args.hash_seed is not None else section.hash_seed,
    )


def _model_config(section: _ModelSection, env_seed: str | None) -> ModelConfig:
    name = section.name
    if not name:
        raise ConfigError("a model name must not be empty")
    block_size = section.block_size
    if block_size < 1:  # --block-size (the file's value is bounded on load)
        raise ConfigError(f"model {name!r}: block size must be >= 1, got {block_size}")
    hash_algo = section.hash_algo
    if hash_algo not in HASH_ALGOS:
        raise ConfigError(
            f"model {name!r}: hash algo must be one of {', '.join(HASH_ALGOS)}, got {hash_algo!r}"
        )
    hash_seed = section.hash_seed if section.hash_seed is not None else env_seed
    if hash_seed is None and hash_algo.startswith("xxhash"):
        raise ConfigError(
            f"model {name!r}: {hash_algo} needs the engines' PYTHONHASHSEED (pass --hash-seed or set hash_seed),"
            " since without it every vLLM engine picks a random root"
        )
    for adapter, path in section.lora_adapters.items():
        if not adapter or not path:
            raise ConfigError(f"model {name!r}: lora_adapters entries need a non-empty name and path")
    group_idxs = frozenset(section.prefix_group_idxs)
    if not group_idxs or min(group_idxs) < 0:
        raise ConfigError(f"model {name!r}: prefix_group_idxs must be a non-empty list of group ids >= 0")
    return ModelConfig(
        name=name,
        block_size=block_size,
        hash_algo=hash_algo,
        hash_seed=hash_seed,
        lora_adapters=dict(section.lora_adapters),
        prefix_group_idxs=group_idxs,
    )


class _PodEntry(msgspec.Struct, frozen=True):
    pod_id: str
    endpoint: str
    replay: str | None
    model: str | None
    dp_rank: int
    source: str  # "config file" or "--pod"
    snapshot: str | None = None


def _merge_pods(
    sections: Sequence[_PodSection], flags: Sequence[PodFlag], model_names: Sequence[str]
) -> tuple[list[PodConfig], dict[tuple[str, int], str]]:
    """The pods of the file, then of the flags, one per (id, dp rank), with where each came from.

    One (id, dp rank) twice in one source is refused: the index, the stream table and scores all key a
    pod by it, so one entry would silently win. A --pod for a (id, dp rank) the file lists replaces the
    file's entry (flags override the file); the start-up log says so.
    """
    entries = [
        _PodEntry(s.id, s.endpoint, s.replay, s.model, s.dp_rank, "config file", s.snapshot) for s in sections
    ]
    entries += [
        _PodEntry(f.pod_id, f.endpoint, f.replay, f.model, f.dp_rank, "--pod", f.snapshot) for f in flags
    ]
    by_stream: dict[tuple[str, int], PodConfig] = {}
    sources: dict[tuple[str, int], str] = {}
    seen: set[tuple[str, int, str]] = set()  # (pod id, dp rank, source)
    for entry in entries:
        pod_id, source = entry.pod_id, entry.source
        stream = (pod_id, entry.dp_rank)
        if (*stream, source) in seen:
            given = "in the config file" if source == "config file" else "(--pod and --pod)"
            raise ConfigError(
                f"pod {pod_id!r} dp rank {entry.dp_rank} is given twice {given}; "
                "pod ids must be unique per dp rank"
            )
        seen.add((*stream, source))
        model = entry.model
        if model is None:
            if len(model_names) != 1:
                raise ConfigError(
                    f"pod {pod_id!r} ({source}) needs model=NAME since several models are configured"
                )
            model = model_names[0]
        elif model not in model_names:
            raise ConfigError(
                f"pod {pod_id!r} ({source}) names unknown model {model!r}; known: {', '.join(model_names)}"
            )
        if entry.dp_rank < 0:
            raise ConfigError(f"pod {pod_id!r} ({source}): dp_rank must be >= 0")
        for what, endpoint in (("endpoint", entry.endpoint), ("replay endpoint", entry.replay)):
            problem = None if endpoint is None else endpoint_problem(endpoint, dial=True)
            if problem is not None:
                raise ConfigError(f"pod {pod_id!r} ({source}): {what} {endpoint!r} {problem}")
        problem = None if entry.snapshot is None else snapshot_url_problem(entry.snapshot)
        if problem is not None:
            raise ConfigError(f"pod {pod_id!r} ({source}): snapshot {entry.snapshot!r} {problem}")
        sources[stream] = "--pod, replacing the config file's entry" if stream in sources else source
        by_stream[stream] = PodConfig(
            pod_id=pod_id,
            endpoint=entry.endpoint,
            model=model,
            replay_endpoint=entry.replay,
            dp_rank=entry.dp_rank,
            snapshot_url=entry.snapshot,
        )
    return list(by_stream.values()), sources


def build_sidecar_model(args: ModelFlags, env: Mapping[str, str]) -> ModelConfig:
    """The one model a sidecar's engine serves: `--model` (required) with the hash flags, over that
    model's `[[models]]` entry in `--config` (the same file `kvindex serve` reads); PYTHONHASHSEED as the
    default seed, exactly as for serve."""
    if args.model is None:
        raise ConfigError("--model NAME is required: the model the engine serves")
    file = load_config_file(args.config) if args.config else _ConfigFile()
    models, _ = _merge_models(file.models, args, env)
    return next(model for model in models if model.name == args.model)
