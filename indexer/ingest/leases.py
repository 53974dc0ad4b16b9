"""Replicas: which kvindex process ingests which pod, through a lease per pod kept in the shared store.

One thread per process ticks every `tick_s`: in one store round trip per model it heartbeats this
replica, renews the leases it holds, takes free leases it should own, and publishes its pods' ingest
states (so every replica's /v1/pods and scores show them). A pod this replica comes to own is handed to
its worker as an `own` control item (fresh tracker, the pod's entries cleared, a join from its ring: the
store becomes exact again); a lease lost (expired while this process stalled, taken by another replica,
the store restarted empty) is a `disown` (the worker stops applying that pod). Fencing makes the handover
safe: every write of a pod carries the lease token and the store's script refuses it unless that token
is still the lease, so two replicas never interleave writes of one pod.

Who takes a free pod: the live replica that rendezvous hashing prefers (pods spread over replicas), or
any replica once the pod has been free for FREE_TICKS_BEFORE_ANY ticks (the preferred one is not taking
it). A dead replica's heartbeat expires with its leases, so its pods' preferred replicas change then, and
they are taken within the TTL plus one tick.

Rebalancing: a replica that joins later (or came back after a restart) would otherwise own nothing until
another one died. So an owner hands a pod over (releases its lease; the preferred replica takes it at its
next tick and rejoins it from the ring) once the preferred replica has been live for REBALANCE_AFTER_TICKS
ticks in a row, at most max(1, held / REBALANCE_SHARE) pods per tick: a flickering heartbeat moves
nothing, and a big owner sheds its pods gradually, each rebuilt before the next few go.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeGuard

import xxhash
from kvindex.indexer.events import PodRef
from kvindex.indexer.ingest.streams import ControlItem, Stream, StreamTable
from kvindex.indexer.registry import ModelRegistry
from kvindex.indexer.store import LeaseClaim, LeaseStore, StoreReset, StoreUnavailable

log = logging.getLogger("kvindex.indexer.ingest")

FREE_TICKS_BEFORE_ANY = 3
REBALANCE_AFTER_TICKS = 10
REBALANCE_SHARE = 10
# A pod handed over is not handed over again for this many ticks: if the preferred replica never takes it
# (its pod list lacks it), it comes back to us through FREE_TICKS_BEFORE_ANY and stays, instead of
# bouncing every few ticks.
REBALANCE_BACKOFF_TICKS = 300


def preferred_replica(pod: PodRef, replicas: Sequence[str]) -> str | None:
    """Rendezvous hashing: the replica with the highest hash of (replica, pod); stable as others come
    and go (only the pods of a replica that left move)."""
    if not replicas:
        return None
    name = f"{pod.pod_id}\0{pod.dp_rank}"
    return max(replicas, key=lambda replica: xxhash.xxh64_intdigest(f"{replica}\0{name}".encode()))


class LeaseManager:
    """Keeps this replica's pod leases (see the module docstring). `state_of(stream)` is the pod's
    current ingest state, published for the other replicas while this one owns the pod."""

    def __init__(
        self,
        replica_id: str,
        ttl_s: float,
        streams: StreamTable,
        models: ModelRegistry,
        submit: Callable[[str, ControlItem], None],
        state_of: Callable[[Stream], str],
    ) -> None:
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        self.tick_s = min(1.0, ttl_s / 5)
        self._streams = streams
        self._submit = submit
        self._state_of = state_of
        self._stores: dict[str, LeaseStore] = {}
        for runtime in models:
            store = runtime.index
            if not _is_lease_store(store):
                raise TypeError(f"model {runtime.config.name!r}: its store keeps no leases")
            store.require_fences()
            self._stores[runtime.config.name] = store
        self._held: dict[PodRef, str] = {}  # pod -> lease token this replica holds
        self._owners: dict[PodRef, str] = {}  # pod -> owning replica id ('' = nobody)
        self._published: dict[PodRef, str] = {}  # pod -> state its owner published
        self._free_ticks: dict[PodRef, int] = {}
        self._replicas: dict[str, list[str]] = {}  # model -> live replica ids
        self._live_ticks: dict[str, dict[str, int]] = {}  # model -> replica -> ticks live in a row
        self._handed_at: dict[PodRef, int] = {}  # pod -> tick of its last handover
        self._ticks = 0
        self._last_ok: dict[str, float] = {}  # model -> when its last tick succeeded
        self.store_error: str | None = None  # the last tick's store error (None: the store answered)
        self.takeovers = 0  # leases taken
        self.losses = 0  # leases lost (not released)
        self.handovers = 0  # leases released to the replica that rendezvous hashing prefers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- queries (any thread) ------------------------------------------------------------------------

    def owner_of(self, pod: PodRef) -> str | None:
        return self._owners.get(pod) or None

    def owns(self, pod: PodRef) -> bool:
        return pod in self._held

    def published_state(self, pod: PodRef) -> str | None:
        return self._published.get(pod) or None

    def owned_count(self) -> int:
        return len(self._held)

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvindex-leases", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop ticking and release the leases still held (another replica need not wait out the TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for pod, token in list(self._held.items()):
            stream = self._streams.get(pod)
            store = self._stores.get(stream.model) if stream is not None else None
            if store is None:
                continue
            try:
                store.release_lease(pod, token)
            except StoreUnavailable:
                pass  # it expires within the TTL
            store.set_fence(pod, None)
        self._held.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.tick()
            self._stop.wait(max(0.0, self.tick_s - (time.monotonic() - started)))

    # -- one tick ------------------------------------------------------------------------------------

    def tick(self) -> None:
        self._ticks += 1
        by_model: dict[str, list[Stream]] = {}
        for stream in self._streams.all():
            by_model.setdefault(stream.model, []).append(stream)
        errors: list[str] = []
        for model, streams in by_model.items():
            store = self._stores.get(model)
            if store is None:
                continue
            try:
                self._tick_model(model, store, streams)
                self._last_ok[model] = time.monotonic()
            except StoreReset as exc:
                errors.append(f"store: {exc}")
                log.warning("model %s: %s; every pod of this replica rejoins", model, exc)
                self._lose_all(streams, store)
                try:
                    store.generation()
                except StoreUnavailable:
                    pass
            except StoreUnavailable as exc:
                errors.append(f"store: {exc}")
                # Past the TTL without a renewal the store has let our leases go (or will when it is
                # back): stop claiming those pods.
                if time.monotonic() - self._last_ok.get(model, 0.0) > self.ttl_s:
                    self._lose_all(streams, store)
        self.store_error = "; ".join(errors) or None

    def _tick_model(self, model: str, store: LeaseStore, streams: list[Stream]) -> None:
        replicas = self._replicas.get(model) or [self.replica_id]
        claims: list[LeaseClaim] = []
        for stream in streams:
            pod = stream.ref
            held = self._held.get(pod)
            want = held is None and (
                preferred_replica(pod, replicas) == self.replica_id
                or self._free_ticks.get(pod, 0) >= FREE_TICKS_BEFORE_ANY
            )
            state = self._state_of(stream) if held is not None and stream.owned else ""
            claims.append(LeaseClaim(pod, held, want, state))
        live, views = store.lease_tick(self.replica_id, int(self.ttl_s * 1000), claims)
        self._replicas[model] = live
        before = self._live_ticks.get(model, {})
        self._live_ticks[model] = {replica: before.get(replica, 0) + 1 for replica in live}
        for stream, claim, view in zip(streams, claims, views, strict=True):
            pod = stream.ref
            token = view.token
            self._owners[pod] = token.rsplit(" ", 1)[0] if token else ""
            self._published[pod] = view.state
            self._free_ticks[pod] = 0 if token else self._free_ticks.get(pod, 0) + 1
            if claim.held is not None and token == claim.held:
                if not stream.owned and not stream.own_pending:
                    # Ours, but the worker let the pod go (a store error mid-write): rebuild it.
                    stream.own_pending = True
                    self._submit(pod.pod_id, ControlItem("own", pod))
                continue
            if claim.held is not None:
                self.losses += 1
                log.warning(
                    "pod %s rank %d: ingest lease lost (now %s); this replica stops ingesting it",
                    pod.pod_id,
                    pod.dp_rank,
                    self._owners[pod] or "free",
                )
                self._disown(stream, store)
            if token and claim.want and token.rsplit(" ", 1)[0] == self.replica_id:
                self._held[pod] = token
                store.set_fence(pod, token)
                self.takeovers += 1
                log.info(
                    "pod %s rank %d: ingest lease taken (%s); joining from its ring",
                    pod.pod_id,
                    pod.dp_rank,
                    token,
                )
                stream.own_pending = True
                self._submit(pod.pod_id, ControlItem("own", pod))
        self._hand_over(model, store, streams)

    def _hand_over(self, model: str, store: LeaseStore, streams: list[Stream]) -> None:
        """Release held pods that a long-live other replica is preferred for (see the module docstring)."""
        live = self._replicas.get(model, [])
        settled = [r for r, n in self._live_ticks.get(model, {}).items() if n >= REBALANCE_AFTER_TICKS]
        if len(settled) < 2 or self.replica_id not in live:
            return
        mine = [stream for stream in streams if stream.ref in self._held and stream.owned]
        budget = max(1, len(self._held) // REBALANCE_SHARE)
        for stream in mine:
            preferred = preferred_replica(stream.ref, live)
            if preferred == self.replica_id or preferred not in settled:
                continue
            if (
                self._ticks - self._handed_at.get(stream.ref, -REBALANCE_BACKOFF_TICKS)
                < REBALANCE_BACKOFF_TICKS
            ):
                continue
            token = self._held[stream.ref]
            self._disown(stream, store)  # no write of ours after the release: the fence goes first
            try:
                store.release_lease(stream.ref, token)
            except StoreUnavailable:
                return  # it lapses within the TTL; the preferred replica takes it then
            self.handovers += 1
            self._handed_at[stream.ref] = self._ticks
            log.info(
                "pod %s rank %d: ingest lease handed over to %s (rendezvous hashing prefers it)",
                stream.ref.pod_id,
                stream.ref.dp_rank,
                preferred,
            )
            budget -= 1
            if not budget:
                return

    def _disown(self, stream: Stream, store: LeaseStore) -> None:
        self._held.pop(stream.ref, None)
        store.set_fence(stream.ref, None)
        self._submit(stream.ref.pod_id, ControlItem("disown", stream.ref))

    def _lose_all(self, streams: list[Stream], store: LeaseStore) -> None:
        for stream in streams:
            self._owners[stream.ref] = ""
            self._published[stream.ref] = ""
            if stream.ref in self._held:
                self.losses += 1
                self._disown(stream, store)


def _is_lease_store(store: object) -> TypeGuard[LeaseStore]:
    return all(
        hasattr(store, name) for name in ("lease_tick", "set_fence", "require_fences", "release_lease")
    )
