"""ZMQ endpoint syntax (replay/endpoints.py): what libzmq would refuse, or a dialler could never reach, is
named before any socket exists; everything libzmq accepts for the use stays accepted."""

from __future__ import annotations

import pytest
import zmq
from kvindex.replay.endpoints import endpoint_problem, tcp_host_port

DIALLED_OK = [
    "tcp://127.0.0.1:5557",
    "tcp://pod-a.ns.svc.cluster.local:5557",
    "tcp://pod_a:1",
    "tcp://[::1]:5557",
    "tcp://10.0.0.9:6000;10.0.0.1:5557",  # ZMQ's SOURCE;DESTINATION form
    "ipc:///tmp/kv.sock",
    "inproc://engine-0",
]
BOUND_OK = ["tcp://*:5557", "tcp://*:*", "tcp://127.0.0.1:0", "tcp://eth0:5557", "tcp://[::]:5557"]


@pytest.mark.parametrize("endpoint", DIALLED_OK)
def test_dialled_endpoints_that_zmq_accepts_pass(endpoint: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    assert endpoint_problem(endpoint, dial=True) is None
    assert endpoint_problem(endpoint, dial=False) is None
    with ctx.socket(zmq.SUB) as sock:
        sock.connect(endpoint)  # libzmq agrees (resolution is deferred: no DNS needed)


@pytest.mark.parametrize("endpoint", BOUND_OK)
def test_bound_endpoints_pass(endpoint: str) -> None:
    assert endpoint_problem(endpoint, dial=False) is None


@pytest.mark.parametrize(
    ("endpoint", "dial", "problem"),
    [
        ("127.0.0.1:45715", True, "is not a ZMQ address; expected tcp://HOST:PORT"),
        ("http://h:1", False, "is not a ZMQ address"),
        ("tcp://127.0.0.1", True, "has no port"),
        ("tcp://:5557", True, "has no host"),
        ("tcp://h:port", True, "malformed port 'port'"),
        ("tcp://h:65536", False, "malformed port '65536'"),
        ("tcp://h:-1", True, "malformed port '-1'"),
        ("tcp://a b:1", True, "malformed host 'a b'"),
        ("tcp://*:5557", True, "cannot be dialled"),
        ("tcp://h:*", True, "malformed port '*'"),
        ("tcp://h:0", True, "port 0"),
        ("ipc://", False, "names no ipc path"),
        ("inproc://", True, "names no inproc path"),
    ],
)
def test_bad_endpoints_say_what_is_expected(endpoint: str, dial: bool, problem: str) -> None:
    found = endpoint_problem(endpoint, dial=dial)
    assert found is not None and problem in found, found
    assert "tcp://HOST:PORT" in found


def test_tcp_host_port() -> None:
    assert tcp_host_port("tcp://pod-a:5557") == ("pod-a", 5557)
    assert tcp_host_port("tcp://[::1]:5557") == ("::1", 5557)
    assert tcp_host_port("tcp://10.0.0.9:6000;pod-a:5557") == ("pod-a", 5557)
    assert tcp_host_port("tcp://*:5557") is None
    assert tcp_host_port("ipc:///tmp/x") is None
