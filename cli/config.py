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
from typing import Protocol

import msgspec
from kvindex.api.settings import (
    DEFAULT_HASH_IN_EXECUTOR_MIN_TOKENS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    ApiKey,
    ApiSettings,
    default_tier_weights,
)
from kvindex.cli.endpoints import endpoint_problem
from kvindex.hashing.algorithms import HASH_ALGOS
from kvindex.indexer.ingest import IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.scorer import DEFAULT_UNKNOWN_TIER_WEIGHT

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


class ServeConfig(msgspec.Struct, frozen=True):
    models: tuple[ModelConfig, ...]
    pods: tuple[PodConfig, ...]
    # Bind mode: one SUB bound per endpoint (vLLM's DP rank r dials the engine's port + r); () = off.
    listen: tuple[str, ...]
    ingest: IngestSettings
    api: ApiSettings
    log_level: str = "info"
    switch_interval_ms: float = DEFAULT_SWITCH_INTERVAL_MS
    # model name -> where its hash seed came from: "--hash-seed", "config file", "PYTHONHASHSEED" or
    # "unset: vLLM default" (logged at start-up so operators can check it against the engines).
    seed_sources: dict[str, str] = {}
    # Where the API key came from ("--api-key", "KVINDEX_API_KEY" or "config file"); None: no key.
    api_key_source: str | None = None
    # (pod id, dp rank) -> where the pod's entry came from: "--pod", "config file", or
    # "--pod, replacing the config file's entry" (logged at start-up).
    pod_sources: dict[tuple[str, int], str] = {}


# --- the TOML file, as written by an operator ------------------------------------------------------


class _ModelSection(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None
    lora_adapters: dict[str, str] = {}
    prefix_group_idxs: list[int] | None = None


class _PodSection(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    endpoint: str
    replay: str | None = None
    model: str | None = None
    dp_rank: int = 0


class _TierSection(msgspec.Struct, forbid_unknown_fields=True):
    weights: dict[str, float] = msgspec.field(default_factory=default_tier_weights)
    unknown_weight: float = DEFAULT_UNKNOWN_TIER_WEIGHT


class _LimitsSection(msgspec.Struct, forbid_unknown_fields=True):
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int = DEFAULT_MAX_TOKENS
    hash_in_executor_min_tokens: int = DEFAULT_HASH_IN_EXECUTOR_MIN_TOKENS


class _IngestSection(msgspec.Struct, forbid_unknown_fields=True):
    num_workers: int | None = None
    queue_size: int | None = None
    queue_full_wait_s: float | None = None
    silent_after_s: float | None = None
    disconnected_grace_s: float | None = None
    forget_after_s: float | None = None
    quiet_probe_after_s: float | None = None
    replay_timeout_s: float | None = None
    hash_check_every: int | None = None
    index_shards: int | None = None
    index_max_keys: int | None = None
    index_max_pods_per_key: int | None = None


class _ConfigFile(msgspec.Struct, forbid_unknown_fields=True):
    http: str | None = None
    min_live_pods: int | None = None
    api_key: str | None = None
    listen: str | list[str] | None = None
    listen_replay: str | None = None
    log_level: str | None = None
    switch_interval_ms: float | None = None
    models: list[_ModelSection] = []
    pods: list[_PodSection] = []
    tiers: _TierSection | None = None
    limits: _LimitsSection | None = None
    ingest: _IngestSection | None = None


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


def parse_pod_flag(text: str) -> PodFlag:
    """`ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,dp_rank=N]` -> PodFlag."""
    usage = "--pod must look like ID=ENDPOINT[,replay=ENDPOINT][,model=NAME][,dp_rank=N]"
    head, *options = text.split(",")
    pod_id, sep, endpoint = head.partition("=")
    if not sep or not pod_id or not endpoint:
        raise ConfigError(f"{usage}, got {text!r}")
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("replay", "model", "dp_rank") or not value:
            raise ConfigError(f"{usage}; {option!r} in {text!r} is not one of replay=, model=, dp_rank=")
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
    )


class ServeArgs(Protocol):
    """The flags `cmd_serve.configure` defines, as argparse leaves them: None when not given."""

    config: str | None
    http: str | None
    pod: list[str] | None
    listen: list[str] | None
    listen_replay: str | None
    model: str | None
    block_size: int | None
    hash_algo: str | None
    hash_seed: str | None
    switch_interval_ms: float | None
    log_level: str | None
    min_live_pods: int | None
    api_key: str | None


def _min_live_pods(flag: int | None, file_value: int | None) -> int:
    value = int(_first_given(flag, file_value, 1))
    if value < 0:
        raise ConfigError(f"--min-live-pods must be >= 0, got {value}")
    return value


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
    if not pods and not listen:
        raise ConfigError("nothing to subscribe to: give at least one --pod ID=ENDPOINT or --listen ENDPOINT")

    host, port = parse_host_port(args.http or file.http or DEFAULT_HTTP)
    tiers = file.tiers or _TierSection()
    limits = file.limits or _LimitsSection()
    _check_positive("limits.max_body_bytes", limits.max_body_bytes)
    _check_positive("limits.max_tokens", limits.max_tokens)
    for tier, weight in tiers.weights.items():
        if weight < 0:
            raise ConfigError(f"tiers.weights.{tier} must be >= 0, got {weight}")
    if tiers.unknown_weight < 0:
        raise ConfigError(f"tiers.unknown_weight must be >= 0, got {tiers.unknown_weight}")
    api_key, api_key_source = _api_key(args.api_key, env.get(API_KEY_ENV), file.api_key)
    api = ApiSettings(
        host=host,
        port=port,
        max_body_bytes=limits.max_body_bytes,
        max_tokens=limits.max_tokens,
        tier_weights=dict(tiers.weights),
        unknown_tier_weight=tiers.unknown_weight,
        hash_in_executor_min_tokens=limits.hash_in_executor_min_tokens,
        min_live_pods=_min_live_pods(args.min_live_pods, file.min_live_pods),
        api_key=api_key,
    )

    ingest_overrides = {
        key: value
        for key, value in msgspec.structs.asdict(file.ingest or _IngestSection()).items()
        if value is not None
    }
    for key, value in ingest_overrides.items():
        if value <= 0:
            raise ConfigError(f"ingest.{key} must be > 0, got {value}")
    ingest = IngestSettings(listen_replay_template=listen_replay, **ingest_overrides)

    log_level = (args.log_level or file.log_level or "info").lower()
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log level must be one of debug, info, warning, error, got {log_level!r}")
    switch_interval_ms = _first_given(
        args.switch_interval_ms, file.switch_interval_ms, DEFAULT_SWITCH_INTERVAL_MS
    )
    if not 0 < switch_interval_ms <= 1000:
        raise ConfigError(f"--switch-interval-ms must be in (0, 1000], got {switch_interval_ms}")
    return ServeConfig(
        switch_interval_ms=switch_interval_ms,
        models=tuple(models),
        pods=tuple(pods),
        listen=listen,
        ingest=ingest,
        api=api,
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


def _first_given(*values: float | None) -> float:
    return next(value for value in values if value is not None)


def _listen_endpoints(flags: Sequence[str] | None, file_listen: str | list[str] | None) -> tuple[str, ...]:
    """--listen flags (repeatable) replace the file's `listen` (a string or a list); duplicates refused."""
    if flags:
        endpoints, source = list(flags), "--listen"
    elif isinstance(file_listen, str):
        endpoints, source = [file_listen], "listen"
    else:
        endpoints, source = list(file_listen or ()), "listen"
    seen: set[str] = set()
    for endpoint in endpoints:
        if not endpoint:
            raise ConfigError(f"{source} must name an endpoint, e.g. tcp://*:5557")
        problem = endpoint_problem(endpoint, dial=False)
        if problem is not None:
            raise ConfigError(f"{source} {endpoint!r} {problem} (e.g. tcp://*:5557)")
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
    if problem is not None:
        raise ConfigError(f"--listen-replay {template!r} {problem}, e.g. tcp://{{pod}}:5558")


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def _merge_models(
    sections: Sequence[_ModelSection], args: ServeArgs, env: Mapping[str, str]
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
        by_name[args.model] = msgspec.structs.replace(
            section,
            block_size=args.block_size if args.block_size is not None else section.block_size,
            hash_algo=args.hash_algo if args.hash_algo is not None else section.hash_algo,
            hash_seed=args.hash_seed if args.hash_seed is not None else section.hash_seed,
        )
    elif args.block_size is not None or args.hash_algo is not None or args.hash_seed is not None:
        if len(by_name) != 1:
            raise ConfigError(
                "--block-size, --hash-algo and --hash-seed need --model NAME to say which model"
            )
        (only,) = by_name.values()
        by_name[only.name] = msgspec.structs.replace(
            only,
            block_size=args.block_size if args.block_size is not None else only.block_size,
            hash_algo=args.hash_algo if args.hash_algo is not None else only.hash_algo,
            hash_seed=args.hash_seed if args.hash_seed is not None else only.hash_seed,
        )
    if not by_name:
        raise ConfigError("no model configured: pass --model NAME or a --config file with [[models]]")
    if args.hash_seed is not None:
        seed_sources[args.model if args.model is not None else next(iter(by_name))] = "--hash-seed"
    for name in by_name:
        if name not in seed_sources:
            seed_sources[name] = "PYTHONHASHSEED" if env_seed is not None else "unset: vLLM default"
    return [_model_config(section, env_seed) for section in by_name.values()], seed_sources


def _model_config(section: _ModelSection, env_seed: str | None) -> ModelConfig:
    name = section.name
    if not name:
        raise ConfigError("a model name must not be empty")
    block_size = section.block_size if section.block_size is not None else 16
    if block_size < 1:
        raise ConfigError(f"model {name!r}: block size must be >= 1, got {block_size}")
    hash_algo = section.hash_algo or "sha256"
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
    group_idxs = (
        frozenset(section.prefix_group_idxs) if section.prefix_group_idxs is not None else frozenset({0})
    )
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


def _merge_pods(
    sections: Sequence[_PodSection], flags: Sequence[PodFlag], model_names: Sequence[str]
) -> tuple[list[PodConfig], dict[tuple[str, int], str]]:
    """The pods of the file, then of the flags, one per (id, dp rank), with where each came from.

    One (id, dp rank) twice in one source is refused: the index, the stream table and scores all key a
    pod by it, so one entry would silently win. A --pod for a (id, dp rank) the file lists replaces the
    file's entry (flags override the file); the start-up log says so.
    """
    entries = [_PodEntry(s.id, s.endpoint, s.replay, s.model, s.dp_rank, "config file") for s in sections]
    entries += [_PodEntry(f.pod_id, f.endpoint, f.replay, f.model, f.dp_rank, "--pod") for f in flags]
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
        sources[stream] = "--pod, replacing the config file's entry" if stream in sources else source
        by_stream[stream] = PodConfig(
            pod_id=pod_id,
            endpoint=entry.endpoint,
            model=model,
            replay_endpoint=entry.replay,
            dp_rank=entry.dp_rank,
        )
    return list(by_stream.values()), sources
