"""Fault harness, the engine side: a simulated vLLM engine (the simulator's prefix cache, which keeps
vLLM's BlockPool rules, behind the vLLM-identical publisher) that can start late, restart on its
endpoints, clear and stop; a TCP link between it and kvindex that can be cut; and loopback ports.

The engine's cache is the reference: at quiescence kvindex must hold exactly what it holds.
"""

from __future__ import annotations

import fcntl
import os
import random
import selectors
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from kvindex.hashing import BlockHasher
from kvindex.replay.publisher import EventPublisher
from kvindex.replay.wire import BlockStored
from kvindex.sim.cache import SimPrefixCache, synthetic_output_tokens

from benchmarks.faults.schedule import EngineSpec

BLOCK_SIZE = 16
HASH_SEED = "0"
VOCAB_SIZE = 32_000
NUM_PREFIXES = 6
_REBIND_TIMEOUT_S = 10.0
# Ports handed out by `reserve_ports` come from below Linux's ephemeral range (32768+), so a socket
# some library binds to port 0 never takes one between our check and our bind.
_PORT_LOW, _PORT_HIGH = 20_000, 32_000
LOOPBACK = "127.0.0.1"
_LOCK_DIR = Path(tempfile.gettempdir()) / "kvindex-faults-ports"


def prefix_pool(prefix_seed: int) -> list[list[int]]:
    """The shared system prompts of a schedule: 1-4 whole blocks each, the same for every engine."""
    rng = random.Random(prefix_seed)
    return [
        [rng.randrange(VOCAB_SIZE) for _ in range(BLOCK_SIZE * rng.randint(1, 4))]
        for _ in range(NUM_PREFIXES)
    ]


def prompts(prefixes: list[list[int]], seed: int, n: int) -> list[tuple[list[int], int]]:
    """`n` (prompt, max_tokens): a shared prefix (or none) and at least one block of fresh tokens, so
    every request stores at least one new block and publishes exactly one batch."""
    rng = random.Random(seed)
    result = []
    for _ in range(n):
        prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
        suffix = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(BLOCK_SIZE, 3 * BLOCK_SIZE))]
        result.append((prefix + suffix, rng.randint(1, 24)))
    return result


class FaultEngine:
    """One (pod, dp rank) engine process, and its successors after restarts.

    `pub_base` / `replay_base` are the base endpoints (vLLM offsets both by the DP rank, as here).
    `bind_pub`: None keeps vLLM's bind-or-connect rule; True binds the fixed loopback port (connect mode).
    `topic`: vLLM's KVEventsConfig.topic (bind mode: `kv@<pod>@<model>`).
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        pub_base: str,
        replay_base: str,
        bind_pub: bool | None,
        topic: str,
        prefixes: list[list[int]],
        hasher: BlockHasher,
    ) -> None:
        self.spec = spec
        self.topic = topic
        self.pub_base = pub_base
        self.replay_base = replay_base
        self.bind_pub = bind_pub
        self.prefixes = prefixes
        self.hasher = hasher
        self.cache = SimPrefixCache(capacity_blocks=spec.capacity_blocks, block_size=BLOCK_SIZE)
        self.ever: set[int] = set()  # every event hash any incarnation stored
        self.incarnation = 0
        self.batches = 0  # published by the current incarnation
        # Batches since the cache was last known empty (this incarnation's start, or its last
        # AllBlocksCleared, that batch included): the history a ring must hold to rebuild the cache.
        self.history = 0
        self.opened = False
        self.opened_at = 0.0  # when this incarnation's sockets came up (monotonic)
        self.last_batch_at: float | None = None
        self.stopped = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._publisher: EventPublisher | None = None
        self._next_request = 0

    @property
    def active(self) -> bool:
        return self.opened and not self.stopped

    def open(self) -> None:
        """Create this incarnation's sockets (retrying while a predecessor's ports are still released)."""
        deadline = time.monotonic() + _REBIND_TIMEOUT_S
        while True:
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
            try:
                self._publisher = EventPublisher(
                    self.pub_base,
                    replay_endpoint=self.replay_base,
                    topic=self.topic,
                    buffer_steps=self.spec.ring,
                    hwm=self.spec.hwm,
                    dp_rank=self.spec.rank,
                    ctx=ctx,
                    bind=self.bind_pub,
                )
            except zmq.ZMQError as exc:
                ctx.destroy(linger=0)
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)  # ok: waiting for the kernel to release the old incarnation's port
                continue
            self._ctx = ctx
            self.opened = True
            self.opened_at = time.monotonic()
            return

    def requests(self, n: int, seed: int) -> None:
        """Run `n` requests back to back, each one engine step published as one batch."""
        if not self.active or n <= 0:
            return
        publisher = self._require_publisher()
        for prompt, max_tokens in prompts(self.prefixes, seed, n):
            sequence = prompt + synthetic_output_tokens(prompt, max_tokens, VOCAB_SIZE)
            block_hashes = self.hasher.block_hashes(sequence[:-1])
            request_id = f"{self.spec.name}-{self.incarnation}-{self._next_request}"
            self._next_request += 1
            self.cache.run(request_id, sequence, block_hashes, num_prompt_tokens=len(prompt))
            self._publish(publisher)

    def clear(self) -> None:
        """vLLM's reset_prefix_cache: every block dropped, AllBlocksCleared published."""
        if not self.active:
            return
        assert self.cache.reset_prefix_cache(), "no request runs between steps"
        self.history = 0
        self._publish(self._require_publisher())

    def restart(self) -> None:
        """The engine process dies and a new one comes up on the same endpoints: empty cache, seq 0."""
        if not self.active:
            return
        self.close()
        self.cache = SimPrefixCache(capacity_blocks=self.spec.capacity_blocks, block_size=BLOCK_SIZE)
        self.incarnation += 1
        self.batches = 0
        self.history = 0
        self.open()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued batch is on the wire."""
        if self._publisher is not None:
            assert self._publisher.flush(timeout_s), f"{self.spec.name}: publisher did not drain"

    def held(self) -> frozenset[int]:
        """What the engine holds now (the reference kvindex is compared with)."""
        return self.cache.cached_event_hashes()

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        if self._ctx is not None:
            # Terminating the context waits for its sockets to close, so the ports are free again.
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _publish(self, publisher: EventPublisher) -> None:
        events = self.cache.take_events()
        for event in events:
            if isinstance(event, BlockStored):
                self.ever.update(h for h in event.block_hashes if isinstance(h, int))
        assert publisher.publish(events), f"{self.spec.name}: publisher queue full"
        self.batches += 1
        self.history += 1
        self.last_batch_at = time.monotonic()

    def _require_publisher(self) -> EventPublisher:
        assert self._publisher is not None, f"{self.spec.name} is not open"
        return self._publisher


def make_hasher() -> BlockHasher:
    return BlockHasher(algo="sha256", block_size=BLOCK_SIZE, seed=HASH_SEED)


# --- ports ---------------------------------------------------------------------------------------


class PortPool:
    """Runs of consecutive free loopback ports (vLLM puts DP rank r at base port + r), held until `close`.

    A schedule binds its ports late (a late engine at its start step) and lets them go and takes them
    again (a restart, a kill -9'd kvindex serve): another schedule running at the same time must not be
    handed one of them meanwhile, or its sockets would answer this schedule's kvindex. So every port
    handed out is also locked (an flock on a file named after it, shared by every process on the host)
    until the pool is closed.
    """

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._locks: dict[int, int] = {}  # port -> the open lock file's descriptor
        _LOCK_DIR.mkdir(exist_ok=True)

    def run(self, count: int) -> int:
        """The first port of `count` consecutive loopback ports that are free now and locked by no pool."""
        for _ in range(500):
            base = self._rng.randrange(_PORT_LOW, _PORT_HIGH - count)
            ports = range(base, base + count)
            if any(port in self._locks for port in ports):
                continue
            taken = [port for port in ports if self._lock(port)]
            if len(taken) == count and all(_port_is_free(port) for port in ports):
                return base
            for port in taken:
                self._unlock(port)
        raise RuntimeError("no run of free loopback ports found")

    def close(self) -> None:
        for port in list(self._locks):
            self._unlock(port)

    def _lock(self, port: int) -> bool:
        fd = os.open(_LOCK_DIR / str(port), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._locks[port] = fd
        return True

    def _unlock(self, port: int) -> None:
        os.close(self._locks.pop(port))  # closing the descriptor drops the lock


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def tcp(port: int) -> str:
    return f"tcp://{LOOPBACK}:{port}"


# --- a link that can be cut -----------------------------------------------------------------------


class _Pair:
    __slots__ = ("client", "upstream", "to_upstream", "to_client")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.to_upstream = bytearray()
        self.to_client = bytearray()


# Bytes the proxy holds per direction, about one socket buffer: a stalled reader backs up to the PUB
# (whose high-water mark then drops) instead of into the proxy's memory.
_MAX_BUFFERED = 64 * 1024
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


class LinkProxy:
    """A TCP forwarder from 127.0.0.1:`port` to 127.0.0.1:`target_port`: an engine's network link.

    `cut()` resets every forwarded connection, and every connection a peer makes until `restore()`, so
    peers see a dead link on every retry. The port stays bound meanwhile (nobody else can take it). One
    thread moves the bytes (non-blocking: a side that stops reading holds back only its own connection).
    """

    def __init__(self, port: int, target_port: int) -> None:
        self.port = port
        self.target_port = target_port
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._pairs: dict[socket.socket, _Pair] = {}
        self._masks: dict[socket.socket, int] = {}  # what each forwarded socket is registered for
        self._commands: list[tuple[Callable[[], None], threading.Event]] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._running = True
        self._cut_off = False
        self.accepted = 0  # connections forwarded
        self.refused = 0  # connections closed because nothing listened behind the link
        self._listen()
        self._thread = threading.Thread(target=self._run, name=f"link-proxy-{port}", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return tcp(self.port)

    def describe(self) -> str:
        state = "cut" if self._cut_off else "up"
        alive = "" if self._thread.is_alive() else ", its thread is dead"
        return (
            f"link {self.endpoint} -> :{self.target_port} {state}, {len(self._pairs) // 2} connections, "
            f"{self.accepted} forwarded, {self.refused} refused upstream{alive}"
        )

    def cut(self) -> None:
        self._call(self._cut)

    def restore(self) -> None:
        self._call(self._restore)

    def close(self) -> None:
        if not self._running:
            return
        self._call(self._cut)
        self._running = False
        os.write(self._wake_w, b"\0")
        self._thread.join(5)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- proxy thread ------------------------------------------------------------------------------

    def _call(self, command: Callable[[], None]) -> None:
        done = threading.Event()
        with self._lock:
            self._commands.append((command, done))
        os.write(self._wake_w, b"\0")
        assert done.wait(5), "link proxy thread did not answer"

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, self.port))
        listener.listen(64)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ)
        self._listener = listener

    def _cut(self) -> None:
        self._cut_off = True
        for pair in list(self._pairs.values()):
            self._drop(pair)

    def _restore(self) -> None:
        self._cut_off = False

    def _drop(self, pair: _Pair) -> None:
        for sock in (pair.client, pair.upstream):
            self._pairs.pop(sock, None)
            self._set(sock, 0)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except OSError:
                pass
            sock.close()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._cut_off:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            client.close()
            return
        try:
            upstream = socket.create_connection((LOOPBACK, self.target_port), timeout=1.0)
        except OSError:
            client.close()  # nothing behind the link right now: the peer retries
            self.refused += 1
            return
        self.accepted += 1
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, upstream)
        self._pairs[client] = pair
        self._pairs[upstream] = pair
        self._set(client, selectors.EVENT_READ)
        self._set(upstream, selectors.EVENT_READ)

    def _interest(self, pair: _Pair) -> None:
        """Read a side only while its outbound buffer has room; write a side while it has bytes due."""
        for sock, inbound, outbound in (
            (pair.client, pair.to_upstream, pair.to_client),
            (pair.upstream, pair.to_client, pair.to_upstream),
        ):
            events = selectors.EVENT_WRITE if outbound else 0
            if len(inbound) < _MAX_BUFFERED:
                events |= selectors.EVENT_READ
            self._set(sock, events)

    def _set(self, sock: socket.socket, events: int) -> None:
        current = self._masks.get(sock, 0)
        if events == current:
            return
        if not events:
            self._selector.unregister(sock)
            del self._masks[sock]
            return
        if current:
            self._selector.modify(sock, events)
        else:
            self._selector.register(sock, events)
        self._masks[sock] = events

    def _pump(self, sock: socket.socket, mask: int) -> None:
        pair = self._pairs.get(sock)
        if pair is None:
            return
        from_client = sock is pair.client
        inbound = pair.to_upstream if from_client else pair.to_client
        outbound = pair.to_client if from_client else pair.to_upstream
        try:
            if mask & selectors.EVENT_READ:
                data = sock.recv(1 << 16)
                if not data:
                    self._drop(pair)
                    return
                inbound.extend(data)
                peer = pair.upstream if from_client else pair.client
                self._flush(peer, inbound)
            if mask & selectors.EVENT_WRITE and outbound:
                self._flush(sock, outbound)
        except OSError:
            self._drop(pair)
            return
        self._interest(pair)

    @staticmethod
    def _flush(sock: socket.socket, buffer: bytearray) -> None:
        try:
            sent = sock.send(buffer)
        except BlockingIOError:
            return
        del buffer[:sent]

    def _run(self) -> None:
        while self._running:
            for key, mask in self._selector.select(timeout=1.0):
                if key.fileobj == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    with self._lock:
                        commands, self._commands = self._commands, []
                    for command, done in commands:
                        try:
                            command()
                        finally:
                            done.set()
                elif key.fileobj is self._listener:
                    self._accept()
                else:
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    self._pump(sock, mask)
        for pair in list(self._pairs.values()):
            self._drop(pair)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
