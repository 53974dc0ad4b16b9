"""`kvindex serve` configuration: TOML + flags -> settings, and one-sentence errors with exit 2."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvindex.cli import cmd_serve
from kvindex.cli.config import ConfigError, ServeConfig, build_serve_config, parse_pod_flag
from kvindex.cli.main import main

TWO_MODELS_TOML = """
http = "127.0.0.1:9090"
log_level = "debug"

[[models]]
name = "llama-8b"
block_size = 16
hash_algo = "sha256"
hash_seed = "0"
prefix_group_idxs = [0, 2]
[models.lora_adapters]
sql-lora = "/adapters/sql-lora"
chat-lora = "/adapters/chat"

[[models]]
name = "qwen-32b"
block_size = 64
hash_algo = "xxhash_cbor"
hash_seed = "42"

[[pods]]
id = "pod-a"
endpoint = "tcp://10.0.0.1:5557"
replay = "tcp://10.0.0.1:5558"
model = "llama-8b"

[[pods]]
id = "pod-b"
endpoint = "tcp://10.0.0.2:5557"
model = "qwen-32b"
dp_rank = 1

[tiers]
weights = { GPU = 1.0, CPU = 0.5, STORAGE = 0.2 }
unknown_weight = 0.05

[limits]
max_body_bytes = 1048576
max_tokens = 200000

[ingest]
num_workers = 2
replay_timeout_s = 1.5
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_serve.configure(parser)
    return parser.parse_args(argv)


def build(argv: list[str], env: dict[str, str] | None = None) -> ServeConfig:
    return build_serve_config(parse_args(argv), env or {})


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvindex.toml"
    path.write_text(text)
    return str(path)


def test_toml_with_two_models_and_lora_tables(tmp_path: Path) -> None:
    config = build(["--config", write(tmp_path, TWO_MODELS_TOML)])

    llama, qwen = config.models
    assert (llama.name, llama.block_size, llama.hash_algo, llama.hash_seed) == ("llama-8b", 16, "sha256", "0")
    assert llama.lora_adapters == {"sql-lora": "/adapters/sql-lora", "chat-lora": "/adapters/chat"}
    assert llama.prefix_group_idxs == frozenset({0, 2})
    assert (qwen.name, qwen.block_size, qwen.hash_algo, qwen.hash_seed) == (
        "qwen-32b",
        64,
        "xxhash_cbor",
        "42",
    )
    assert qwen.lora_adapters == {}
    assert qwen.prefix_group_idxs == frozenset({0})

    pod_a, pod_b = config.pods
    assert (pod_a.pod_id, pod_a.endpoint, pod_a.replay_endpoint, pod_a.model, pod_a.dp_rank) == (
        "pod-a",
        "tcp://10.0.0.1:5557",
        "tcp://10.0.0.1:5558",
        "llama-8b",
        0,
    )
    assert (pod_b.pod_id, pod_b.replay_endpoint, pod_b.model, pod_b.dp_rank) == ("pod-b", None, "qwen-32b", 1)

    assert (config.api.host, config.api.port) == ("127.0.0.1", 9090)
    assert config.api.tier_weights == {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.2}
    assert config.api.unknown_tier_weight == 0.05
    assert (config.api.max_body_bytes, config.api.max_tokens) == (1048576, 200000)
    assert (config.ingest.num_workers, config.ingest.replay_timeout_s) == (2, 1.5)
    assert config.log_level == "debug"


def test_flags_override_and_extend_the_file(tmp_path: Path) -> None:
    argv = [
        "--config",
        write(tmp_path, TWO_MODELS_TOML),
        "--http",
        "127.0.0.1:0",
        "--model",
        "llama-8b",
        "--block-size",
        "32",
        "--pod",
        "pod-c=tcp://10.0.0.3:5557,replay=tcp://10.0.0.3:5558,model=qwen-32b,dp_rank=3",
        "--pod",
        "pod-a=tcp://10.9.9.9:5557,model=llama-8b",
        "--log-level",
        "warning",
    ]
    config = build(argv)
    llama = config.models[0]
    assert (llama.block_size, llama.hash_seed, llama.lora_adapters["sql-lora"]) == (
        32,
        "0",
        "/adapters/sql-lora",
    )
    assert (config.api.host, config.api.port) == ("127.0.0.1", 0)
    by_id = {(p.pod_id, p.dp_rank): p for p in config.pods}
    assert by_id[("pod-a", 0)].endpoint == "tcp://10.9.9.9:5557"  # the flag replaced the file's entry
    assert by_id[("pod-a", 0)].replay_endpoint is None
    assert config.pod_sources == {
        ("pod-a", 0): "--pod, replacing the config file's entry",
        ("pod-b", 1): "config file",
        ("pod-c", 3): "--pod",
    }
    pod_c = by_id[("pod-c", 3)]
    assert (pod_c.endpoint, pod_c.replay_endpoint, pod_c.model) == (
        "tcp://10.0.0.3:5557",
        "tcp://10.0.0.3:5558",
        "qwen-32b",
    )
    assert config.log_level == "warning"


def test_flags_only_and_defaults() -> None:
    config = build(["--model", "m", "--pod", "p0=tcp://127.0.0.1:5557"])
    (model,) = config.models
    assert (model.name, model.block_size, model.hash_algo, model.hash_seed) == ("m", 16, "sha256", None)
    assert config.pods[0].model == "m"  # the only model is the default for pods
    assert (config.api.host, config.api.port) == ("0.0.0.0", 8080)
    assert config.api.tier_weights == {"GPU": 1.0, "CPU": 0.8}
    assert 0 < config.api.unknown_tier_weight < config.api.tier_weights["CPU"]
    assert config.listen == ()
    assert config.switch_interval_ms == 1.0


@pytest.mark.parametrize(
    "url", ["redis://h:1/2", "rediss://h:1/0", "redis+cluster://h:7000", "rediss+cluster://u:p@h:7000"]
)
def test_store_urls_of_a_server_or_a_cluster_are_accepted(url: str) -> None:
    config = build(["--model", "m", "--pod", "p0=tcp://127.0.0.1:5557", "--store", url])
    assert config.store.url == url


def test_hash_seed_defaults_to_pythonhashseed_and_the_flag_wins() -> None:
    base = ["--model", "m", "--pod", "p0=tcp://127.0.0.1:5557"]
    assert build(base, {"PYTHONHASHSEED": "1234567"}).models[0].hash_seed == "1234567"
    assert build([*base, "--hash-seed", "7"], {"PYTHONHASHSEED": "1234567"}).models[0].hash_seed == "7"


def test_listen_mode_with_replay_template() -> None:
    config = build(["--model", "m", "--listen", "tcp://*:5557", "--listen-replay", "tcp://{pod}:5558"])
    assert config.listen == ("tcp://*:5557",)
    assert config.ingest.listen_replay_template == "tcp://{pod}:5558"
    assert config.pods == ()


def test_switch_interval_from_file_and_flag(tmp_path: Path) -> None:
    path = write(tmp_path, "switch_interval_ms = 2.5\n[[models]]\nname = 'm'\n")
    base = ["--config", path, "--listen", "tcp://*:5557"]
    assert build(base).switch_interval_ms == 2.5
    assert build([*base, "--switch-interval-ms", "0.5"]).switch_interval_ms == 0.5


def test_event_loop_defaults_to_auto_and_the_flag_beats_the_file(tmp_path: Path) -> None:
    assert build(["--model", "m", "--listen", "tcp://*:5557"]).event_loop == "auto"
    path = write(tmp_path, "event_loop = 'asyncio'\n[[models]]\nname = 'm'\n")
    base = ["--config", path, "--listen", "tcp://*:5557"]
    assert build(base).event_loop == "asyncio"
    assert build([*base, "--event-loop", "uvloop"]).event_loop == "uvloop"


def test_an_unknown_event_loop_in_the_file_is_one_sentence(tmp_path: Path) -> None:
    path = write(tmp_path, "event_loop = 'trio'\n[[models]]\nname = 'm'\n")
    with pytest.raises(ConfigError, match=r"^event loop must be one of auto, uvloop, asyncio, got 'trio'$"):
        build(["--config", path, "--listen", "tcp://*:5557"])


def test_listen_is_repeatable_one_per_dp_rank() -> None:
    config = build(["--model", "m", "--listen", "tcp://*:5557", "--listen", "tcp://*:5558"])
    assert config.listen == ("tcp://*:5557", "tcp://*:5558")


@pytest.mark.parametrize(
    ("toml_listen", "expected"),
    [
        ('"tcp://*:6000"', ("tcp://*:6000",)),
        ('["tcp://*:6000", "tcp://*:6001"]', ("tcp://*:6000", "tcp://*:6001")),
    ],
    ids=["string", "list"],
)
def test_toml_listen_is_a_string_or_a_list(
    tmp_path: Path, toml_listen: str, expected: tuple[str, ...]
) -> None:
    path = write(tmp_path, f"listen = {toml_listen}\n[[models]]\nname = 'm'\n")
    assert build(["--config", path]).listen == expected
    # --listen flags replace the file's list rather than adding to it.
    assert build(["--config", path, "--listen", "tcp://*:7000"]).listen == ("tcp://*:7000",)


def test_seed_source_of_each_model(tmp_path: Path) -> None:
    path = write(tmp_path, "[[models]]\nname = 'a'\nhash_seed = '1'\n[[models]]\nname = 'b'\n")
    listen = ["--listen", "tcp://*:5557"]
    assert build(["--config", path, *listen], {"PYTHONHASHSEED": "9"}).seed_sources == {
        "a": "config file",
        "b": "PYTHONHASHSEED",
    }
    assert build(["--config", path, *listen]).seed_sources["b"] == "unset: vLLM default"
    flagged = build(["--config", path, *listen, "--model", "b", "--hash-seed", "5"], {"PYTHONHASHSEED": "9"})
    assert flagged.seed_sources == {"a": "config file", "b": "--hash-seed"}
    assert {m.name: m.hash_seed for m in flagged.models} == {"a": "1", "b": "5"}


def test_api_key_from_the_flag_the_environment_or_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "api_key = 'key-from-file'\n[[models]]\nname = 'm'\n")
    base = ["--config", path, "--listen", "tcp://*:5557"]
    env_key = {"KVINDEX_API_KEY": "key-from-env"}
    cases = [
        ([], {}, "key-from-file", "config file"),
        ([], env_key, "key-from-env", "KVINDEX_API_KEY"),
        (["--api-key", "key-from-flag"], env_key, "key-from-flag", "--api-key"),  # the flag wins
        ([], {"KVINDEX_API_KEY": ""}, "key-from-file", "config file"),  # an empty variable is unset
    ]
    for flags, env, key, source in cases:
        config = build([*base, *flags], env)
        assert config.api.api_key is not None and config.api.api_key.matches(key), (flags, env)
        assert config.api_key_source == source
        assert key not in repr(config)
    # Without the file: the variable, or no key at all.
    bare = ["--model", "m", "--listen", "tcp://*:5557"]
    from_env = build(bare, env_key)
    assert from_env.api.api_key is not None and from_env.api.api_key.matches("key-from-env")
    assert not from_env.api.api_key.matches("key-from-file")
    open_config = build(bare)
    assert (open_config.api.api_key, open_config.api_key_source) == (None, None)


@pytest.mark.parametrize(
    ("argv", "env", "toml_key", "message"),
    [
        (["--api-key", ""], {}, None, "--api-key is empty"),
        ([], {}, "", "the config file's api_key is empty"),
        (["--api-key", " s3cret-key"], {}, None, "--api-key starts or ends with whitespace"),
        ([], {"KVINDEX_API_KEY": "s3cret-key\n"}, None, "KVINDEX_API_KEY starts or ends with whitespace"),
        ([], {"KVINDEX_API_KEY": "s3cret\x00key"}, None, "KVINDEX_API_KEY contains a control character"),
        ([], {}, "s3cret\tkey", "the config file's api_key contains a control character"),
    ],
    ids=["empty flag", "empty in file", "space", "newline", "nul", "tab"],
)
def test_unusable_api_keys_are_refused_without_repeating_them(
    tmp_path: Path, argv: list[str], env: dict[str, str], toml_key: str | None, message: str
) -> None:
    toml = "[[models]]\nname = 'm'\n"
    if toml_key is not None:
        toml = f"api_key = {json.dumps(toml_key)}\n{toml}"  # a basic string: TOML decodes its escapes
    with pytest.raises(ConfigError) as raised:
        build(["--config", write(tmp_path, toml), "--listen", "tcp://*:5557", *argv], env)
    assert str(raised.value).startswith(message)
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    "text",
    [
        "pod-a",
        "=tcp://h:1",
        "pod-a=",
        "pod-a=tcp://h:1,replay",
        "pod-a=tcp://h:1,colour=red",
        "pod-a=tcp://h:1,dp_rank=-1",
        "pod-a=tcp://h:1,dp_rank=x",
        "pod-a=tcp://h:1,model=a,model=b",
    ],
)
def test_bad_pod_syntax(text: str) -> None:
    with pytest.raises(ConfigError, match="--pod"):
        parse_pod_flag(text)


def test_one_pod_id_may_have_several_dp_ranks(tmp_path: Path) -> None:
    pods = ["--pod", "p=tcp://h:5557", "--pod", "p=tcp://h:5558,dp_rank=1"]
    assert [(p.pod_id, p.dp_rank) for p in build(["--model", "m", *pods]).pods] == [("p", 0), ("p", 1)]


TWO_P1_ENTRIES = """
[[models]]
name = "a"
[[models]]
name = "b"
[[pods]]
id = "p1"
endpoint = "tcp://10.0.0.1:5557"
model = "a"
[[pods]]
id = "p1"
endpoint = "tcp://10.0.0.2:5557"
model = "b"
"""


BAD_CONFIGS = [
    # One (pod, dp rank) twice: the index and the stream table key pods by it, so one entry would win.
    (
        None,
        ["--model", "m", "--pod", "sim-0=tcp://h:1", "--pod", "sim-0=tcp://h:2"],
        "pod 'sim-0' dp rank 0 is given twice (--pod and --pod); pod ids must be unique per dp rank",
    ),
    (
        None,
        ["--model", "m", "--pod", "p=tcp://h:1,dp_rank=2", "--pod", "p=tcp://h:9,dp_rank=2"],
        "pod 'p' dp rank 2 is given twice (--pod and --pod)",
    ),
    (TWO_P1_ENTRIES, [], "pod 'p1' dp rank 0 is given twice in the config file"),
    # Endpoints: named with the pod, what was given and what is expected, before any socket exists.
    (
        None,
        ["--model", "m", "--pod", "pod-a=127.0.0.1:45715"],
        "pod 'pod-a' (--pod): endpoint '127.0.0.1:45715' is not a ZMQ address; expected tcp://HOST:PORT",
    ),
    (
        None,
        ["--model", "m", "--pod", "pod-a=tcp://h:5557,replay=h:5558"],
        "pod 'pod-a' (--pod): replay endpoint 'h:5558' is not a ZMQ address",
    ),
    (None, ["--model", "m", "--pod", "pod-a=tcp://*:5557"], "cannot be dialled"),
    (None, ["--model", "m", "--pod", "pod-a=tcp://h:0"], "port 0"),
    (None, ["--model", "m", "--pod", "pod-a=tcp://h:555700"], "malformed port '555700'"),
    (None, ["--model", "m", "--pod", "pod-a=tcp://h"], "has no port"),
    (None, ["--model", "m", "--pod", "pod-a=http://h:1"], "is not a ZMQ address"),
    (
        "[[models]]\nname = 'x'\n[[pods]]\nid = 'p'\nendpoint = 'p:5557'",
        [],
        "pod 'p' (config file): endpoint 'p:5557' is not a ZMQ address",
    ),
    (None, ["--model", "m", "--listen", "127.0.0.1:5557"], "--listen '127.0.0.1:5557' is not a ZMQ address"),
    ("listen = 'tcp://*'\n[[models]]\nname = 'x'", [], "listen 'tcp://*' has no port"),
    (
        None,
        ["--model", "m", "--listen", "tcp://*:1", "--listen-replay", "{pod}:5558"],
        "--listen-replay '{pod}:5558' is not a ZMQ address",
    ),
    # Bounds of the TOML keys, checked on load with the key's path.
    ("[[models]]\nname = 'x'\n[ingest]\nnum_workers = 0", ["--pod", "p=tcp://h:1"], "ingest.num_workers"),
    ("[[models]]\nname = 'x'\n[ingest]\nrcvhwm = -1", ["--pod", "p=tcp://h:1"], "ingest.rcvhwm"),
    ("[[models]]\nname = 'x'\n[tiers]\nunknown_weight = -1", ["--pod", "p=tcp://h:1"], "unknown_weight"),
    ("[[models]]\nname = 'x'\nblock_size = 0", ["--pod", "p=tcp://h:1"], "models[0].block_size"),
    # (TOML text or None, extra argv, a word the one-sentence error must contain)
    ("[[models]\nname = 'x'", [], "not valid TOML"),
    ("[[models]]\nname = 'x'\ncolour = 'red'", ["--pod", "p=tcp://h:1"], "colour"),
    ("surprise = 1\n[[models]]\nname = 'x'", ["--pod", "p=tcp://h:1"], "surprise"),
    ("[[models]]\nname = 'x'\nblock_size = 'big'", ["--pod", "p=tcp://h:1"], "block_size"),
    ("[[models]]\nname = 'x'\n[[models]]\nname = 'y'", ["--pod", "p=tcp://h:1"], "model=NAME"),
    ("[[models]]\nname = 'x'\nhash_algo = 'md5'", ["--pod", "p=tcp://h:1"], "hash algo"),
    ("[[models]]\nname = 'x'\nhash_algo = 'xxhash'", ["--pod", "p=tcp://h:1"], "PYTHONHASHSEED"),
    ("[[models]]\nname = 'x'\n[limits]\nmax_tokens = 0", ["--pod", "p=tcp://h:1"], "max_tokens"),
    (None, ["--pod", "p=tcp://h:1"], "--model"),
    (None, ["--model", "m"], "--pod"),
    (None, ["--model", "m", "--pod", "p=tcp://h:1,model=other"], "unknown model"),
    (None, ["--model", "m", "--pod", "p=tcp://h:1", "--http", "localhost"], "HOST:PORT"),
    (None, ["--model", "m", "--pod", "p=tcp://h:1", "--block-size", "0"], "block size"),
    (None, ["--model", "m", "--listen", "tcp://*:1", "--listen", "tcp://*:1"], "given twice"),
    (None, ["--model", "m", "--listen", ""], "--listen"),
    ("listen = 5\n[[models]]\nname = 'x'", [], "listen"),
    (None, ["--model", "m", "--pod", "p=tcp://h:1", "--switch-interval-ms", "0"], "--switch-interval-ms"),
    (None, ["--model", "m", "--listen-replay", "tcp://{pod}:1", "--pod", "p=tcp://h:1"], "--listen"),
    (None, ["--model", "m", "--listen", "tcp://*:1", "--listen-replay", "tcp://{dp_rank}:1"], "{pod}"),
    (None, ["--model", "m", "--listen", "tcp://*:1", "--listen-replay", "tcp://{pod:1"], "{model}"),
    (None, ["--model", "m", "--pod", "p=tcp://h:1", "--api-key", ""], "--api-key"),
    ("api_key = 5\n[[models]]\nname = 'x'", ["--pod", "p=tcp://h:1"], "api_key"),
    (None, ["--model", "m", "--pod", "p=tcp://h:1", "--store", "redis+clustr://h:1"], "redis+cluster://"),
    ("[store]\nurl = 'http://h:1'\n[[models]]\nname = 'x'", ["--pod", "p=tcp://h:1"], "--store must be"),
]


@pytest.mark.parametrize(("toml_text", "argv", "word"), BAD_CONFIGS)
def test_config_errors_are_one_sentence_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    toml_text: str | None,
    argv: list[str],
    word: str,
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("KVINDEX_API_KEY", raising=False)
    if toml_text is not None:
        argv = ["--config", write(tmp_path, toml_text), *argv]
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert word in err
    assert err.startswith("kvindex serve: ")
    assert err.count("\n") == 1, err
    assert "Traceback" not in err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def test_real_process_reports_bad_pod_and_exits_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvindex", "serve", "--model", "m", "--pod", "pod-a"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--pod must look like" in result.stderr
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
