"""`kvindex sim` as a real process (help, a workload run, bad flags, SIGTERM) and the engine settings it
derives from its flags (bind or connect mode, one port per engine, topics)."""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time

from kvindex.cli.cmd_sim import engine_configs
from kvindex.cli.main import build_parser

TIMEOUT_S = 10.0


def _kvindex(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvindex", *args]


EPHEMERAL = ["--pub", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--http-port-base", "0"]


def test_sim_help_explains_how_to_start_a_fleet() -> None:
    done = subprocess.run(_kvindex("sim", "--help"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "how to start a fleet" in done.stdout
    assert "kvindex serve" in done.stdout and "--engines" in done.stdout


def test_sim_drives_a_workload_and_exits() -> None:
    done = subprocess.run(
        _kvindex(
            "sim", "--engines", "2", "--requests", "5", "--hash-seed", "0", "--block-size", "4", *EPHEMERAL
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["sim-0", "sim-1"]
    assert "index them with: kvindex serve" in done.stdout and "--pod sim-1=tcp://127.0.0.1:" in done.stdout
    requests = sum(int(line.split()[1]) for line in lines if line.startswith("sim-") and "http=" not in line)
    assert requests == 5


def test_sim_refuses_bad_flags_with_one_sentence() -> None:
    done = subprocess.run(_kvindex("sim", "--engines", "0"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "kvindex sim: --engines must be at least 1"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run(
        _kvindex("sim", "--hash-algo", "xxhash", *EPHEMERAL),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "--hash-seed" in done.stderr and "Traceback" not in done.stderr


def test_sim_stops_cleanly_on_sigterm() -> None:
    process = subprocess.Popen(
        _kvindex("sim", "--engines", "1", "--hash-seed", "0", *EPHEMERAL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        stdout_fd = process.stdout.fileno()
        deadline = time.monotonic() + TIMEOUT_S * 3
        seen = b""
        while b"index them with" not in seen:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"kvindex sim did not come up: {seen!r}"
            ready, _, _ = select.select([stdout_fd], [], [], remaining)
            if ready:
                chunk = os.read(stdout_fd, 65536)
                assert chunk, f"kvindex sim exited early: {seen!r}"
                seen += chunk
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=TIMEOUT_S * 3)
        assert process.returncode == 0, stderr
        assert b"Traceback" not in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=TIMEOUT_S)


def _sim_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["sim", *argv])


def test_sim_endpoints_follow_bind_and_connect_modes() -> None:
    bound = engine_configs(_sim_args("--engines", "3", "--hash-seed", "0", "--model", "m"))
    assert [c.pub_endpoint for c in bound] == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert [c.replay_endpoint for c in bound] == ["tcp://*:5600", "tcp://*:5601", "tcp://*:5602"]
    assert [(c.pod_id, c.topic, c.http_port) for c in bound] == [
        ("sim-0", "", 8200),
        ("sim-1", "", 8201),
        ("sim-2", "", 8202),
    ]
    # A host in --pub: every engine dials the same bound indexer, and names itself in the topic.
    dialling = engine_configs(
        _sim_args("--engines", "2", "--hash-seed", "0", "--model", "m", "--pub", "tcp://10.0.0.5:5557")
    )
    assert [c.pub_endpoint for c in dialling] == ["tcp://10.0.0.5:5557"] * 2
    assert [c.topic for c in dialling] == ["kv@sim-0@m", "kv@sim-1@m"]
    assert engine_configs(_sim_args("--replay", "none", "--hash-seed", "0"))[0].replay_endpoint is None


def test_replay_follows_the_pub_host_by_default() -> None:
    def replays(*argv: str) -> list[str | None]:
        return [
            c.replay_endpoint for c in engine_configs(_sim_args("--engines", "2", "--hash-seed", "0", *argv))
        ]

    # Engines dialling a kvindex on loopback keep their replay sockets on loopback (before: tcp://*:5600).
    assert replays("--pub", "tcp://127.0.0.1:5557") == ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"]
    # Engines binding an address bind replay there; an ephemeral --pub port makes replay's ephemeral.
    assert replays("--pub", "tcp://127.0.0.1:0") == ["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"]
    assert replays("--pub", "tcp://*:5557") == ["tcp://*:5600", "tcp://*:5601"]
    # Dialling another machine's kvindex: it must reach the replay sockets, so every interface.
    assert replays("--pub", "tcp://10.0.0.5:5557") == ["tcp://*:5600", "tcp://*:5601"]
    # Given explicitly, --replay wins.
    assert replays("--pub", "tcp://127.0.0.1:5557", "--replay", "tcp://*:7000") == [
        "tcp://*:7000",
        "tcp://*:7001",
    ]


def test_bind_mode_hint_points_serve_at_listen_not_at_its_own_listener() -> None:
    # The engines dial 127.0.0.1:5557 (kvindex's bind mode). Nothing listens there: ZMQ connects lazily.
    done = subprocess.run(
        _kvindex(
            "sim", "--engines", "2", "--pub", "tcp://127.0.0.1:5557", "--replay", "tcp://127.0.0.1:0",
            "--http-port-base", "0", "--requests", "1", "--hash-seed", "0",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    engine_lines = [line for line in done.stdout.splitlines() if " http=" in line]
    assert len(engine_lines) == 2
    assert all("(engine dials: kvindex bind mode)" in line for line in engine_lines), engine_lines
    assert "--pod" not in done.stdout  # a --pod at kvindex's own listener dials nothing
    (hint,) = [line for line in done.stdout.splitlines() if line.startswith("index them with:")]
    assert hint.startswith("index them with: kvindex serve --listen tcp://127.0.0.1:5557 --model sim-model")
    assert "no --listen-replay" in done.stdout


def test_connect_mode_lines_use_serves_words() -> None:
    done = subprocess.run(
        _kvindex("sim", "--engines", "1", "--requests", "1", "--hash-seed", "0", *EPHEMERAL),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if " http=" in line]
    assert "(engine binds: kvindex connect mode)" in line and "serve: --pod sim-0=tcp://127.0.0.1:" in line


def test_sim_refuses_a_pub_that_is_not_a_zmq_address() -> None:
    done = subprocess.run(
        _kvindex("sim", "--pub", "127.0.0.1:5557"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "kvindex sim: --pub '127.0.0.1:5557' is not a ZMQ address; expected tcp://HOST:PORT "
        "(or ipc://PATH, inproc://NAME), e.g. tcp://*:5557"
    )
