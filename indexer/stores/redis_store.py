"""The Redis/Valkey store: the block index kept in a shared server, so several kvindex replicas read and
write one index. An IO shell implementing the store interface (indexer/store.py), with the in-memory
KVIndex's semantics; the server-side logic is the Lua in redis_scripts.py (one script call per batch and
one per lease tick; a clear of a pod runs in calls of at most `clear_chunk_keys` keys, so a big pod's
takeover or restart never holds the server for long). A score is one MGET, no script. On a Redis Cluster (connect()), each script
call names one key of its model, so the cluster runs it on the node of the model's slot, where all of that
model's keys live.

Bounded memory as in KVIndex: keys live in `num_shards` shards, each an exact key LRU (a sorted set of
store clocks) of at most max_keys // num_shards keys, so the whole index is an LRU approximated by shards
(as Redis' own maxmemory-policy approximates one by sampling). A block's holders are a string key of their
own, so a score reads every block of a prompt in one MGET (~0.3 us a block in Redis) instead of a script's
Lua calls into shard hashes (~1.3 us a block). Keep each shard under Redis' zset-max-listpack-entries (128
by default): a listpack LRU costs ~20 B per key, a skiplist several times more. About 92 B per (pod, block)
pair in all at 1M pairs (benchmarks/store.py), 0.94x the in-memory KVIndex's RSS per pair.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Final, cast

import msgspec
import redis
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, PodRef
from kvindex.indexer.index import MAX_COPIES, ApplyStats, Entry, HolderIds, Holders, _checked_keys, apply_each
from kvindex.indexer.store import LeaseClaim, LeaseLost, LeaseView, StoreReset, StoreUnavailable
from kvindex.indexer.stores import redis_scripts
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.connection import parse_url

# The errors redis-py raises for a server that cannot be reached or does not answer in time (a cluster
# client's: no node reachable, a slot without a node, redirections exhausted).
_DOWN: Final = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
    redis.exceptions.RedisClusterException,
    redis.exceptions.ClusterError,
)
log = logging.getLogger("kvindex.indexer.stores")
_BIG_ENDIAN: Final = sys.byteorder == "big"
_ENTRY_NAME = msgspec.json.Encoder()
_ENTRY_DECODE = msgspec.json.Decoder(tuple[str, int, str])
# Log keys one clear call processes: ~25 ms of server time (~5 us a key), the longest a clear makes other
# clients wait (one script of a million-block pod held Redis for seconds).
CLEAR_CHUNK_KEYS: Final = 5_000


def prefix_of(model: str) -> str:
    """A model's key prefix, hash-tagged so a cluster keeps one model's keys in one slot (its scripts
    touch many keys at once) and spreads models over slots. Braces in the name are escaped."""
    return "kvi:{" + model.replace("%", "%25").replace("{", "%7B").replace("}", "%7D") + "}:"


def key_bytes(keys: Sequence[int]) -> bytes:
    """Block keys as one string of 8-byte big-endian keys (checked unsigned 64-bit, like KVIndex)."""
    packed = _checked_keys(keys)
    if not _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _key_of(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


class RedisStore:
    """One model's index in Redis. Thread-safe (redis-py's pool); every call is one round trip, except the
    first sight of an entry id (its name is fetched once) and the whole-index views.

    A connection error raises StoreUnavailable; a store that came back empty raises StoreReset on the next
    write (every cache of entry ids is dropped). Writes of a pod with a fence (`set_fence`) raise LeaseLost
    unless the store's lease for that pod is still the fence's token, atomically with the write.
    """

    blocking_io = True

    def __init__(
        self,
        client: StoreClient,
        model: str,
        *,
        num_shards: int = 1 << 16,
        max_keys: int = 50_000_000,
        max_pods_per_key: int = 256,
        clear_chunk_keys: int = CLEAR_CHUNK_KEYS,
    ) -> None:
        if num_shards < 1 or max_keys < 1 or max_pods_per_key < 1 or clear_chunk_keys < 1:
            raise ValueError(
                f"num_shards, max_keys, max_pods_per_key and clear_chunk_keys must be >= 1, got "
                f"{num_shards}, {max_keys}, {max_pods_per_key}, {clear_chunk_keys}"
            )
        if num_shards > 1 << 32:
            raise ValueError(f"num_shards must be <= 2**32 (shards are the low 32 bits), got {num_shards}")
        self.client = client
        self.model = model
        self.prefix = prefix_of(model)
        # The one key every script call names: a cluster routes the call to its slot, which is the slot of
        # every key the script touches (they share the model's hash tag).
        self._key = [self.prefix + "gen"]
        # MGET pieces: a block's holders key is prefix + "b:" + its 8-byte key (see redis_scripts).
        self._block_prefix = self.prefix.encode() + b"b:"
        gen_name = self._key[0].encode()
        self._gen_record = b"$%d\r\n%s\r\n" % (len(gen_name), gen_name)
        self._block_record = b"$%d\r\n%s%s\r\n" % (len(self._block_prefix) + 8, self._block_prefix, bytes(8))
        self.num_shards = num_shards
        self.max_pods_per_key = max_pods_per_key
        self.clear_chunk_keys = clear_chunk_keys
        self._shard_width = ((num_shards - 1).bit_length() + 7) // 8
        self.shard_capacity = max(1, max_keys // num_shards)
        self.shard_low_water = self.shard_capacity - self.shard_capacity // 64
        self._apply_script = client.register_script(redis_scripts.APPLY)
        self._clear_script = client.register_script(redis_scripts.CLEAR_CHUNK)
        self._tick_script = client.register_script(redis_scripts.LEASE_TICK)
        self._release_script = client.register_script(redis_scripts.LEASE_RELEASE)
        self._lock = threading.Lock()
        self._gen = ""
        # Entry id -> (pod, tier), filled on first sight (ids are never reused within a generation).
        self._entries: dict[int, Entry] = {}
        # Holder strings -> their ids: a shared prefix's blocks answer with one tuple (the scorer groups
        # runs by identity first). Bounded: cleared when it grows past _MAX_PARSED.
        self._parsed: dict[bytes, HolderIds] = {}
        self._fences: dict[PodRef, str] = {}
        self._pod_ids_seen: set[str] = set()

    # -- connection, generation ---------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _DOWN as exc:
            raise StoreUnavailable(f"{self.client_address()}: {exc}") from exc
        except redis.ResponseError as exc:
            if str(exc).startswith("LEASE"):
                raise _Fenced() from exc
            if str(exc).startswith("GEN"):
                self._forget_generation()
                raise StoreReset(f"{self.client_address()}: the store restarted empty") from exc
            raise StoreUnavailable(f"{self.client_address()}: {exc}") from exc

    def client_address(self) -> str:
        if isinstance(self.client, LazyCluster):  # no one pool: name the nodes it knows
            return f"redis cluster {','.join(self.client.node_names())}"
        kwargs = self.client.connection_pool.connection_kwargs
        return f"redis {kwargs.get('host', kwargs.get('path', '?'))}:{kwargs.get('port', '')}"

    def generation(self) -> str:
        """The store's generation token, created if missing (the first process to see an empty store
        sets it); a change drops every cached entry id."""
        _, current = self._call(self._set_and_get_gen, uuid.uuid4().hex)
        gen: str = current.decode()
        with self._lock:
            if gen != self._gen:
                self._entries.clear()
                self._parsed.clear()
                self._pod_ids_seen.clear()
                self._gen = gen
        return gen

    def _set_and_get_gen(self, token: str) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.prefix + "gen", token, nx=True)
        pipe.get(self.prefix + "gen")
        return pipe.execute()

    def _forget_generation(self) -> None:
        with self._lock:
            self._gen = ""
            self._entries.clear()
            self._parsed.clear()
            self._pod_ids_seen.clear()

    def _current_gen(self) -> str:
        return self._gen or self.generation()

    # -- fencing and leases ----------------------------------------------------------------------------

    def set_fence(self, pod: PodRef, token: str | None) -> None:
        """The lease this process holds for `pod` (None: none, writes of it are refused)."""
        with self._lock:
            if token is None:
                self._fences.pop(pod, None)
            else:
                self._fences[pod] = token

    def fence_of(self, pod: PodRef) -> str | None:
        return self._fences.get(pod)

    def lease_tick(
        self, replica_id: str, ttl_ms: int, claims: Sequence[LeaseClaim]
    ) -> tuple[list[str], list[LeaseView]]:
        """One round trip for every pod of this model: heartbeat, renew, take, publish (see LEASE_TICK).
        Returns the live replicas and each claim's lease."""
        args: list[str | int] = [self.prefix, self._current_gen(), replica_id, ttl_ms, ""]
        for claim in claims:
            args += [_pod_key(claim.pod), claim.held or "", "1" if claim.want else "0", claim.state]
        out = self._call(self._tick_script, keys=self._key, args=args)
        values = [v.decode() for v in out]
        split = values.index("")
        replicas = values[:split]
        rest = values[split + 1 :]
        views = [LeaseView(rest[i], rest[i + 1]) for i in range(0, len(rest), 2)]
        return replicas, views

    def release_lease(self, pod: PodRef, token: str) -> None:
        self._call(self._release_script, keys=self._key, args=[self.prefix, _pod_key(pod), token])

    # -- write path ------------------------------------------------------------------------------------

    def _fence_args(self, pod: PodRef, fenced: bool) -> list[str]:
        if not fenced:
            return ["", ""]
        token = self._fences.get(pod)
        if token is None:
            raise LeaseLost(pod)
        return [self.prefix + "lease:" + _pod_key(pod), token]

    def _header(self, pod: PodRef) -> list[str | int | bytes]:
        fenced = self._fenced_mode
        return [
            self.prefix,
            self._current_gen(),
            self.num_shards,
            self.shard_capacity,
            self.shard_low_water,
            self.max_pods_per_key,
            MAX_COPIES,
            *self._fence_args(pod, fenced),
            _pod_key(pod),
            pod.pod_id,
        ]

    # Set by the lease manager: every write must then carry a fence (a pod without one is refused).
    _fenced_mode = False

    def require_fences(self) -> None:
        """From now on, writes of a pod without a fence raise LeaseLost (replicas share this store)."""
        self._fenced_mode = True

    def apply_many(self, batches: Sequence[tuple[PodRef, Sequence[KVEvent]]]) -> list[ApplyStats | Exception]:
        """`apply` of each batch in order (one script call each): its stats, or the exception it raised
        (StoreUnavailable, LeaseLost, a bad event)."""
        return apply_each(self.apply, batches)

    def apply(self, pod: PodRef, events: Iterable[KVEvent]) -> ApplyStats:
        """Apply one pod's events in order, as one atomic script call (see KVIndex.apply for the rules).
        The batch is validated before anything is sent: a bad event raises TypeError/ValueError."""
        steps = self._steps(pod, events)
        if not isinstance(pod, PodRef):
            raise TypeError(f"expected a PodRef, got {pod!r}")
        if not steps:
            return ApplyStats()
        if "C" not in steps:
            return ApplyStats(*self._run_apply(pod, steps))
        # A clear can cost the pod's whole index: each one runs in bounded calls (_clear_in_chunks), then
        # the rest of the batch from it. Readers may see such a batch part-way; the end state and the
        # counts are the single call's.
        totals = [0] * 9
        start = 0
        for end in [i for i, step in enumerate(steps) if step == "C"] + [len(steps)]:
            if end > start:
                totals = [a + b for a, b in zip(totals, self._run_apply(pod, steps[start:end]), strict=True)]
            if end < len(steps):
                totals[4] += self._clear_in_chunks(pod)
            start = end
        return ApplyStats(*totals)

    def _clear_in_chunks(self, pod: PodRef) -> int:
        """Clear the pod's pairs, `clear_chunk_keys` log keys per call; returns the pairs cleared."""
        cleared = 0
        while True:
            try:
                out = self._call(
                    self._clear_script,
                    keys=self._key,
                    args=[*self._header(pod), self.clear_chunk_keys],
                )
            except _Fenced as exc:
                raise LeaseLost(pod) from exc
            cleared += int(out[0])
            if not int(out[1]):
                return cleared

    def _run_apply(self, pod: PodRef, steps: list[str | bytes]) -> list[int]:
        try:
            out = self._call(self._apply_script, keys=self._key, args=[*self._header(pod), *steps])
        except _Fenced as exc:
            raise LeaseLost(pod) from exc
        self._pod_ids_seen.add(pod.pod_id)
        return [int(n) for n in out]

    def _steps(self, pod: PodRef, events: Iterable[KVEvent]) -> list[str | bytes]:
        """The batch as script arguments. Consecutive BlocksStored of one tier continuing the previous
        event's chain merge into one store step, as KVIndex merges them (its LRU evicts per step)."""
        steps: list[str | bytes] = []
        names: dict[str, str] = {}
        last_tier: str | None = None  # the tier of the previous step, if it is a store
        last_key = -1
        store_parts: list[bytes] = []

        def name_of(tier: str) -> str:
            name = names.get(tier)
            if name is None:
                if not isinstance(tier, str):
                    raise TypeError(f"expected a tier name, got {tier!r}")
                name = names[tier] = _ENTRY_NAME.encode((pod.pod_id, pod.dp_rank, tier)).decode()
            return name

        def close_store() -> None:
            if store_parts:
                steps[-1] = b"".join(store_parts)
                store_parts.clear()

        for event in events:
            if isinstance(event, BlocksStored):
                keys = event.block_keys
                packed = key_bytes(keys)
                parent = event.parent_key
                if parent is not None:
                    if last_tier == event.tier and parent == last_key:
                        if keys:
                            store_parts.append(packed)
                            last_key = keys[-1]
                        continue
                    close_store()
                    steps += ["P", key_bytes((parent,))]
                    last_tier = None
                if keys:
                    close_store()
                    steps += ["S", name_of(event.tier), b""]
                    store_parts.append(packed)
                    last_tier, last_key = event.tier, keys[-1]
                else:
                    close_store()
                    last_tier = None
                continue
            close_store()
            last_tier = None
            if isinstance(event, BlocksRemoved):
                packed = key_bytes(event.block_keys)
                name = name_of(event.tier)
                if event.block_keys:
                    steps += ["R", name, packed]
            elif isinstance(event, AllBlocksCleared):
                steps.append("C")
            else:
                raise TypeError(f"not a KV event: {type(event).__name__}")
        close_store()
        return steps

    def clear_pod(self, pod: PodRef) -> int:
        """Drop every entry of one pod, all tiers (cost: that pod's blocks, in calls of at most
        `clear_chunk_keys` keys each, so other clients wait at most one such call)."""
        return self.apply(pod, [AllBlocksCleared()]).cleared_blocks

    # -- read path -------------------------------------------------------------------------------------

    def lookup_ids(self, block_keys: Sequence[int], pods: Collection[str] | None = None) -> list[HolderIds]:
        """Entry ids holding each leading block (one MGET of the generation and every block's holders),
        stopping at the first block no (selected) pod holds. Within one key, ids are least recently
        stored first."""
        if pods is not None and not pods:
            return []
        if not block_keys:
            return []
        out = self._call(self._mget_holders, key_bytes(block_keys))
        gen = out[0].decode() if out[0] is not None else ""
        if gen != self._gen:
            self.generation()  # a restarted store: ids are new
        parsed = self._parsed
        if len(parsed) > _MAX_PARSED:
            parsed.clear()
        result: list[HolderIds] = []
        distinct: set[HolderIds] = set()
        last: bytes | None = None
        ids: HolderIds = ()
        # A shared prefix answers the same holders block after block: parse once per run.
        for raw in itertools.islice(out, 1, None):
            if raw is None:
                break
            if raw != last:
                found = parsed.get(raw)
                if found is None:
                    found = parsed[raw] = _parse_holders(raw)
                ids = found
                distinct.add(ids)
                last = raw
            result.append(ids)
        self._resolve({i for ids in distinct for i in ids})
        if pods is None:
            return result
        entries = self._entries
        allowed = {pod_id for pod_id in pods}
        filtered: list[HolderIds] = []
        for ids in result:
            kept = tuple(i for i in ids if entries[i][0].pod_id in allowed)
            if not kept:
                break
            filtered.append(kept)
        return filtered

    def _mget_holders(self, packed_keys: bytes) -> list[bytes | None]:
        """[generation, holders of each key...] in one MGET. On a single server the command is packed here
        (redis-py packs each of 513 arguments in Python: more than the lookup itself costs)."""
        client = self.client
        names = len(packed_keys) // 8
        if isinstance(client, LazyCluster):
            block = self._block_prefix
            return cast(
                list[bytes | None],
                client.execute_command(
                    "MGET",
                    self._key[0],
                    *(block + packed_keys[i : i + 8] for i in range(0, len(packed_keys), 8)),
                ),
            )
        record = self._block_record
        buf = bytearray(record * names)
        step = len(record)
        offset = step - 10  # the key's place in each record: before its trailing CRLF
        for j in range(8):  # each byte of every key, by strided copies (no per-key Python work)
            buf[offset + j :: step] = packed_keys[j::8]
        command = b"*%d\r\n$4\r\nMGET\r\n%s" % (names + 2, self._gen_record) + buf  # MGET, gen, keys
        pool = client.connection_pool
        connection: Any = pool.get_connection()  # redis-py leaves these methods untyped
        try:
            connection.send_packed_command([command])
            reply = connection.read_response()
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)
        return cast(list[bytes | None], reply)

    def _resolve(self, ids: Iterable[int]) -> None:
        missing = [i for i in ids if i not in self._entries]
        if not missing:
            return
        names = self._call(self.client.hmget, self.prefix + "entn", missing)
        for entry_id, name in zip(missing, names, strict=True):
            if name is None:
                raise StoreUnavailable(f"{self.client_address()}: entry {entry_id} unknown (store reset?)")
            pod_id, rank, tier = _ENTRY_DECODE.decode(name)
            self._entries[entry_id] = (PodRef(pod_id, rank), tier)

    def lookup(self, block_keys: Sequence[int], pods: Collection[str] | None = None) -> list[Holders]:
        entries = self._entries
        return [tuple(entries[i] for i in ids) for ids in self.lookup_ids(block_keys, pods)]

    def entry(self, entry_id: int) -> Entry:
        entry = self._entries.get(entry_id)
        if entry is None:
            self._resolve((entry_id,))
            entry = self._entries[entry_id]
        return entry

    def has_pod_id(self, pod_id: str) -> bool:
        """True once this pod id has held a block here (cached once true: clears do not reset it)."""
        if pod_id in self._pod_ids_seen:
            return True
        if self._call(self.client.hexists, self.prefix + "podids", pod_id):
            self._pod_ids_seen.add(pod_id)
            return True
        return False

    def shard_of(self, block_key: int) -> int:
        return (block_key & 0xFFFFFFFF) % self.num_shards

    def shard_key(self, kind: str, shard_no: int) -> bytes:
        """The Redis key of a shard's holders (`kind` "h") or LRU ("l"): see redis_scripts' layout."""
        return f"{self.prefix}{kind}:".encode() + shard_no.to_bytes(self._shard_width, "big")

    # -- stats -----------------------------------------------------------------------------------------

    def _live(self) -> dict[int, int]:
        raw = self._call(self.client.hgetall, self.prefix + "live")
        live = {int(k): int(v) for k, v in raw.items()}
        self._resolve(live)
        return live

    def num_keys(self) -> int:
        return int(self._call(self.client.get, self.prefix + "nkeys") or 0)

    def num_entries(self) -> int:
        return sum(self._live().values())

    def pod_block_count(self, pod: PodRef, tier: str | None = None) -> int:
        live = self._live()
        entries = self._entries
        return sum(
            n for i, n in live.items() if entries[i][0] == pod and (tier is None or entries[i][1] == tier)
        )

    def pod_block_counts(self) -> dict[PodRef, int]:
        """Every pod's blocks (all tiers) in one round trip: for status pages over many pods."""
        counts: dict[PodRef, int] = {}
        for entry_id, n in self._live().items():
            pod = self._entries[entry_id][0]
            counts[pod] = counts.get(pod, 0) + n
        return counts

    def pods(self) -> list[PodRef]:
        return sorted(pod for pod, n in self.pod_block_counts().items() if n)

    # -- whole-index views, for tests and debugging (O(index)) -------------------------------------------

    def _shards(self) -> dict[int, tuple[dict[bytes, bytes], dict[bytes, float]]]:
        """Every non-empty shard: the holders of its LRU's keys (a key without holders left out) and its
        LRU (with clocks)."""
        shards: dict[int, tuple[dict[bytes, bytes], dict[bytes, float]]] = {}
        start = len(self.prefix.encode()) + 2
        numbers = {
            int.from_bytes(name[start:], "big") for name in self._call(self._scan, self.prefix + "l:*")
        }
        for shard_no in sorted(numbers):
            lru = dict(self._call(self.client.zrange, self.shard_key("l", shard_no), 0, -1, withscores=True))
            values = self._call(self._mget_holders, b"".join(lru)) if lru else [None]
            holders = {key: raw for key, raw in zip(lru, values[1:], strict=True) if raw is not None}
            shards[shard_no] = (holders, lru)
        return shards

    def _holder_keys(self) -> int:
        """How many block holder keys the store has (whatever their LRU says)."""
        return len(self._call(self._scan, self.prefix + "b:*"))

    def _scan(self, pattern: str) -> list[bytes]:
        return list(self.client.scan_iter(match=pattern, count=1000))

    def snapshot(self) -> dict[int, frozenset[Entry]]:
        return {key: frozenset(copies) for key, copies in self.snapshot_copies().items()}

    def snapshot_copies(self) -> dict[int, dict[Entry, int]]:
        result: dict[int, dict[Entry, int]] = {}
        for holders, _ in self._shards().values():
            for raw_key, raw in holders.items():
                copies = _parse_copies(raw)
                self._resolve(copies)
                result[_key_of(raw_key)] = {self._entries[i]: n for i, n in copies.items()}
        return result

    def check_consistency(self) -> list[str]:
        """Violations of the index's invariants (empty when sound): caps, shard routing, holder encoding,
        the LRU sets, live counts, the reverse logs and the key count."""
        problems: list[str] = []
        live: dict[int, int] = {}
        num_keys = 0
        held_by: dict[int, set[bytes]] = {}
        for shard_no, (holders, lru) in self._shards().items():
            if len(holders) > self.shard_capacity:
                problems.append(f"shard {shard_no}: {len(holders)} keys > {self.shard_capacity}")
            if set(holders) != set(lru):
                problems.append(f"shard {shard_no}: LRU members without holders")
            for raw_key, raw in holders.items():
                num_keys += 1
                key = _key_of(raw_key)
                if self.shard_of(key) != shard_no:
                    problems.append(f"key {key} in shard {shard_no}")
                copies = _parse_copies(raw)
                if not 1 <= len(copies) <= self.max_pods_per_key:
                    problems.append(f"key {key}: {len(copies)} holders")
                if not all(1 <= n <= MAX_COPIES for n in copies.values()):
                    problems.append(f"key {key}: copy counts out of range {copies}")
                for entry_id in copies:
                    live[entry_id] = live.get(entry_id, 0) + 1
                    held_by.setdefault(entry_id, set()).add(raw_key)
        counted = {i: n for i, n in self._live().items() if n}
        if counted != live:
            problems.append(f"live counts {counted} != held pairs {live}")
        if self.num_keys() != num_keys:
            problems.append(f"key count {self.num_keys()} != {num_keys} keys held")
        if self._holder_keys() != num_keys:
            problems.append(f"{self._holder_keys()} holder keys != {num_keys} keys in the LRUs")
        for entry_id, keys in held_by.items():
            log = self._call(self.client.get, f"{self.prefix}log:{entry_id}") or b""
            logged = {log[i : i + 8] for i in range(0, len(log), 8)}
            for raw_key in keys - logged:
                problems.append(f"key {_key_of(raw_key)} missing from entry {entry_id}'s log")
        return problems


_MAX_PARSED: Final = 65_536


class _Fenced(Exception):
    """The apply script refused a write: the pod's lease is not the fence's token."""


def _pod_key(pod: PodRef) -> str:
    return _ENTRY_NAME.encode((pod.pod_id, pod.dp_rank)).decode()


def _parse_holders(raw: bytes) -> HolderIds:
    """`b"3"` -> (3,); `b"3:2,7"` -> (3, 7): the ids, oldest first."""
    if b"," not in raw and b":" not in raw:
        return (int(raw),)
    return tuple(int(item.split(b":", 1)[0]) for item in raw.split(b","))


def _parse_copies(raw: bytes) -> dict[int, int]:
    copies: dict[int, int] = {}
    for item in raw.split(b","):
        entry_id, _, n = item.partition(b":")
        copies[int(entry_id)] = int(n) if n else 1
    return copies


class LazyCluster:
    """A Redis Cluster client made at its first call, as RedisCluster() needs a reachable node to read
    the slot map: a replica may start before its cluster, and answer 503 until it is up, as it does with
    a single server. Every attribute is a method of the RedisCluster, called through it (its first call
    makes it, and a failure to raises RedisClusterException there, in the store's error handling)."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url = url
        self._options = options
        self._lock = threading.Lock()
        self._made: RedisCluster | None = None

    def cluster(self) -> RedisCluster:
        made = self._made
        if made is not None:  # every call after the first: no lock on the score path
            return made
        with self._lock:
            if self._made is None:
                self._made = RedisCluster.from_url(self.url, **self._options)
            return self._made

    def node_names(self) -> list[str]:
        """host:port of the nodes known so far (before the first call: the URL's)."""
        if self._made is None:
            options = _url_options(self.url)
            return [f"{options.get('host', '?')}:{options.get('port', 6379)}"]
        return sorted(self._made.nodes_manager.startup_nodes)

    def register_script(self, script: str) -> Script:
        # Script calls only evalsha and script_load on its client. Given bytes, it asks the client for no
        # encoder (UTF-8: redis-py's default, which connect() keeps).
        return Script(cast(RedisCluster, self), script.encode())

    def close(self) -> None:
        with self._lock:
            if self._made is not None:
                self._made.close()
                self._made = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.cluster(), name)(*args, **kwargs)

        return call


# A client of one server or of a Redis Cluster (connect() picks).
StoreClient = redis.Redis | LazyCluster

# The explicit cluster schemes and the scheme redis-py knows each by.
_CLUSTER_SCHEMES: Final = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
STORE_SCHEMES: Final = ("redis", "rediss", *_CLUSTER_SCHEMES)


def connect(url: str, *, socket_timeout_s: float = 5.0) -> StoreClient:
    """A client for `redis://HOST:PORT/DB` or `rediss://...` (TLS), with timeouts so an unreachable store
    fails a call in bounded time instead of hanging a worker. A Redis Cluster (`redis+cluster://HOST:PORT`,
    `rediss+cluster://`, or a plain URL whose server has cluster mode on) gets a cluster client, which
    routes each call to the slot of its keys. A cluster URL naming a DB other than 0 is a ValueError."""
    timeouts: dict[str, Any] = dict(
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        health_check_interval=0,
        retry_on_timeout=False,
    )
    scheme, sep, rest = url.partition("://")
    if scheme in _CLUSTER_SCHEMES:
        return _cluster_client(url, _CLUSTER_SCHEMES[scheme] + sep + rest, timeouts)
    if _says_cluster(url, timeouts):
        client = _cluster_client(url, url, timeouts)
        log.info("%s has cluster mode on: using a Redis Cluster client", redacted(url))
        return client
    return redis.Redis.from_url(url, **timeouts)


def _cluster_client(given: str, url: str, timeouts: dict[str, Any]) -> LazyCluster:
    """A cluster client for `url` (redis-py's scheme); `given` is the URL as the user wrote it."""
    db = _url_options(url).get("db", 0)
    if db != 0:
        raise ValueError(
            f"{redacted(given)} is a Redis Cluster, which has only DB 0: drop /{db} from the URL"
        )
    return LazyCluster(url, timeouts)


def _says_cluster(url: str, timeouts: dict[str, Any]) -> bool:
    """True if the server at `url` answers INFO with cluster_enabled:1. Asked on DB 0, as a cluster node
    refuses SELECT. A server that cannot tell (unreachable, or INFO refused by its ACL) is taken as a single
    server, with a warning: replicas may start before their store."""
    options = {**_url_options(url), "db": 0, **timeouts}
    probe = redis.Redis(connection_pool=redis.ConnectionPool(**options))
    try:
        info = probe.info("cluster")
    except (*_DOWN, redis.ResponseError) as exc:
        log.warning(
            "%s did not answer INFO cluster (%s): taken as a single server, not a cluster (name a "
            "cluster redis+cluster://HOST:PORT to skip this check)",
            redacted(url),
            exc,
        )
        return False
    finally:
        probe.close()
    return bool(info.get("cluster_enabled"))


def _url_options(url: str) -> dict[str, Any]:
    """redis-py's own reading of a URL (host, port, db from the path or ?db=, TLS, credentials)."""
    options: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]  # untyped in redis-py
    return options


def redacted(url: str) -> str:
    """A store URL without its password (logs are read by many)."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}" if sep else url
