"""compose.yaml, deploy/prometheus.yml and the Dockerfile agree with the CLI and with each other.

Docker is not run here: the files are parsed and every `kvindex` command they name goes through the
real argument parser (and, for `serve`, the real configuration builder), so a renamed flag breaks
this test instead of a user's `docker compose up`.
"""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
from kvindex.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _load_yaml(path: Path) -> Any:
    yaml = pytest.importorskip("yaml")  # PyYAML: needed in the [test] extra
    return yaml.safe_load(path.read_text())


def _kvindex_services(compose: dict[str, Any]) -> dict[str, list[str]]:
    """Services running our image -> their command as an argv (the image's entrypoint is `kvindex`)."""
    commands = {}
    for name, service in compose["services"].items():
        if service.get("build") is None and not str(service.get("image", "")).startswith("kvindex"):
            continue
        command = service["command"]
        commands[name] = shlex.split(command) if isinstance(command, str) else list(command)
    return commands


def test_every_kvindex_command_parses() -> None:
    compose = _load_yaml(ROOT / "compose.yaml")
    commands = _kvindex_services(compose)
    assert (
        sorted(command[0] for command in commands.values()) == ["serve"] * 3 + ["sidecar"] * 3 + ["sim"] * 3
    )
    parser = build_parser()
    for name, argv in commands.items():
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse's way of refusing
            raise AssertionError(f"service {name}: `kvindex {' '.join(argv)}` does not parse") from exc
        if argv[0] == "serve":
            from kvindex.cli.config import build_serve_config

            environment = compose["services"][name].get("environment") or {}
            config = build_serve_config(args, {k: str(v) for k, v in environment.items()})
            assert [pod.pod_id for pod in config.pods] == ["engine-a", "engine-b", "engine-c"]
            if "replicas" in (compose["services"][name].get("profiles") or []):
                # The replicas variant: one store, the same pods, distinct replica ids.
                assert config.store.url == "redis://redis:6379/0" and "redis" in compose["services"]
                assert config.ingest.replica_id == name.removeprefix("kvindex-")


def test_serve_dials_each_engine_where_it_binds() -> None:
    compose = _load_yaml(ROOT / "compose.yaml")
    services = compose["services"]
    commands = _kvindex_services(compose)
    pod_flags = [
        argv[i + 1]
        for argv in commands.values()
        if argv[0] == "serve"
        for i, arg in enumerate(argv)
        if arg == "--pod"
    ]
    assert pod_flags
    for flag in pod_flags:
        pod_id, _, rest = flag.partition("=")
        endpoint, _, options = rest.partition(",replay=")
        replay, _, snapshot = options.partition(",snapshot=")
        assert pod_id in services, f"--pod {flag}: no service named {pod_id}"
        engine_argv = commands[pod_id]
        # The engine binds on all interfaces where its sidecar dials it by default (127.0.0.1:5557/5558,
        # the sidecar sharing the engine's network namespace); kvindex dials the sidecar's defaults
        # (*:5567, *:5568, :8081) by the engine's service name.
        assert "tcp://*:5557" in engine_argv and "tcp://*:5558" in engine_argv
        sidecars = [n for n, s in services.items() if s.get("network_mode") == f"service:{pod_id}"]
        assert len(sidecars) == 1, f"pod {pod_id}: one sidecar in its network namespace, got {sidecars}"
        sidecar_argv = commands[sidecars[0]]
        assert sidecar_argv[0] == "sidecar" and sidecar_argv[sidecar_argv.index("--pod") + 1] == pod_id
        assert "--engine" not in sidecar_argv and "--publish" not in sidecar_argv  # the defaults
        assert endpoint == f"tcp://{pod_id}:5567"
        assert replay == f"tcp://{pod_id}:5568"
        assert snapshot == f"http://{pod_id}:8081/v1/snapshot"
    # Same hash seed everywhere, or no prompt hash would match an event hash.
    seeds = {str((services[name].get("environment") or {}).get("PYTHONHASHSEED")) for name in commands}
    assert len(seeds) == 1 and seeds != {"None"}


def test_prometheus_scrapes_kvindex_metrics() -> None:
    compose = _load_yaml(ROOT / "compose.yaml")
    prometheus = compose["services"]["prometheus"]
    mounted = [volume.split(":")[0] for volume in prometheus["volumes"]]
    assert mounted == ["./deploy/prometheus.yml"]
    config = _load_yaml(ROOT / "deploy" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = [t for c in jobs["kvindex"]["static_configs"] for t in c["targets"]]
    assert targets == ["kvindex:8080"]
    assert jobs["kvindex"].get("metrics_path", "/metrics") == "/metrics"
    serve_argv = _kvindex_services(compose)["kvindex"]
    assert serve_argv[serve_argv.index("--http") + 1].endswith(":8080")


def test_dockerfile_installs_the_package_and_runs_kvindex() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert instructions[0] == "FROM python:3.11-slim"
    assert 'ENTRYPOINT ["kvindex"]' in instructions
    assert any(line.startswith("RUN pip install .") for line in instructions)
    for line in instructions:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
    ignored = (ROOT / ".dockerignore").read_text().split()
    # Everything the package is built from must reach the build context.
    for needed in (
        "pyproject.toml",
        "README.md",
        "kvindex",
        "hashing",
        "replay",
        "indexer",
        "api",
        "sidecar",
    ):
        assert needed not in ignored


def test_the_image_copies_every_folder_the_package_installs() -> None:
    """pyproject's package-dir is the list of folders `pip install .` needs; the Dockerfile must copy each
    (it once copied four of seven, and the image had no `kvindex` command)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {
        line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
    }
    assert {folder.split("/")[0] for folder in folders} <= copied
