"""The `kvindex serve` config the benchmarks write is one `kvindex serve` itself accepts."""

from __future__ import annotations

from pathlib import Path

from kvindex.cli.config import load_config_file

from benchmarks.service import config_toml


def test_config_names_replay_sockets_and_ingest_caps(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(
        config_toml(
            ["tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"],
            "m",
            "0",
            16,
            replay_endpoints=["tcp://127.0.0.1:6001", None],
            ingest={"index_max_keys": 20_000, "queue_full_wait_s": 2.0},
        )
    )
    config = load_config_file(path)
    assert [(pod.id, pod.replay) for pod in config.pods] == [
        ("engine-0", "tcp://127.0.0.1:6001"),
        ("engine-1", None),
    ]
    assert config.ingest is not None
    assert (config.ingest.index_max_keys, config.ingest.queue_full_wait_s) == (20_000, 2.0)


def test_without_extras_the_config_is_unchanged() -> None:
    text = config_toml(["tcp://127.0.0.1:5001"], "m", "0", 16)
    assert "replay" not in text and "[ingest]" not in text
