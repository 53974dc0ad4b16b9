"""Ingest-side guard: do the engines hash blocks the way this model's settings say?

For a sample of BlocksStored events that can be recomputed from their own fields (a run from block 0 with
no extra keys), recompute the block hashes with the model's BlockHasher and compare. A mismatch would
make every score for the model 0, silently; `diagnose_mismatch` names the setting that most likely differs.
Pure: no IO, clocks or threads.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

from kvindex.hashing import HASH_ALGOS, BlockHasher, HashingError
from kvindex.hashing.hasher import EVENT_KEY_TYPECODE
from kvindex.indexer.events import BlocksStored
from kvindex.indexer.model import ModelConfig

# Always check the first few eligible events of each stream, then 1 in `every`.
ALWAYS_CHECK_FIRST = 4
# Seeds tried when diagnosing: vLLM's unset rule and the most common explicit value.
COMMON_SEEDS: tuple[str | None, ...] = (None, "0")


def could_be_checkable(event: BlocksStored, block_size: int) -> bool:
    """`is_checkable` minus the token count: for events decoded without their token ids (cheap filter
    before paying for a full decode)."""
    if event.parent_key is not None or not event.block_keys or event.block_size != block_size:
        return False
    if event.lora_name is not None or event.lookahead_token_ids is not None:
        return False
    extra_keys = event.extra_keys
    return extra_keys is None or extra_keys.count(None) == len(extra_keys)


def is_checkable(event: BlocksStored, block_size: int, token_ids: Sequence[int] | None = None) -> bool:
    """True when the event's keys can be recomputed from its token ids with `block_size` (`token_ids`: the
    event's ids read apart from it, for an event decoded without them).

    Needs: a run from block 0 (no parent), no extra keys (LoRA paths, MM, salts are not all published),
    no lookahead, and token ids covering exactly the blocks (no skipped null blocks).
    """
    ids = event.token_ids if token_ids is None else token_ids
    return could_be_checkable(event, block_size) and len(ids) == len(event.block_keys) * block_size


def hashes_agree(event: BlocksStored, hasher: BlockHasher) -> bool:
    """The event's keys equal the hasher's event hashes of its tokens (call only if `is_checkable`)."""
    return keys_agree(event.block_keys, event.token_ids, hasher)


def keys_agree(block_keys: Sequence[int], token_ids: Sequence[int], hasher: BlockHasher) -> bool:
    """`hashes_agree` of an event's keys and token ids held apart (the ids may be a packed array('I'),
    which the hasher takes as it is)."""
    try:
        return hasher.event_key_array(token_ids) == array(EVENT_KEY_TYPECODE, block_keys)
    except (HashingError, OverflowError):  # OverflowError: a key outside 64 bits cannot be vLLM's
        return False


def diagnose_mismatch(event: BlocksStored, config: ModelConfig) -> str:
    """One sentence naming the setting that most likely differs between kvindex and the engines.

    Tries the other algorithms, the unset seed and "0", and the event's own block size; the first
    combination that reproduces the event's keys is reported.
    """
    for algo, seed, block_size in _candidates(event, config):
        try:
            hasher = BlockHasher(algo=algo, block_size=block_size, seed=seed, memo_size=0)
        except HashingError:
            continue
        if len(event.token_ids) != len(event.block_keys) * block_size:
            continue
        if hashes_agree(event, hasher):
            differences = []
            if algo != config.hash_algo:
                differences.append(f"hash_algo={algo} (configured {config.hash_algo})")
            if seed != config.hash_seed:
                differences.append(
                    f"hash_seed={_seed_text(seed)} (configured {_seed_text(config.hash_seed)})"
                )
            if block_size != config.block_size:
                differences.append(f"block_size={block_size} (configured {config.block_size})")
            return "engines hash with " + ", ".join(differences)
    return (
        f"no algorithm/seed tried reproduces the engines' hashes: unknown seed (check PYTHONHASHSEED of "
        f"the engines and --hash-seed; configured {config.hash_algo}, seed {_seed_text(config.hash_seed)})"
    )


def _candidates(event: BlocksStored, config: ModelConfig) -> Iterator[tuple[str, str | None, int]]:
    seeds = [config.hash_seed] + [s for s in COMMON_SEEDS if s != config.hash_seed]
    algos = [config.hash_algo] + [a for a in HASH_ALGOS if a != config.hash_algo]
    block_sizes = [config.block_size]
    if event.block_size > 0 and event.block_size != config.block_size:
        block_sizes.append(event.block_size)
    for block_size in block_sizes:
        for algo in algos:
            for seed in seeds:
                if (algo, seed, block_size) != (config.hash_algo, config.hash_seed, config.block_size):
                    yield algo, seed, block_size


def _seed_text(seed: str | None) -> str:
    return "unset" if seed is None else repr(seed)


class HashCheckSampler:
    """Which eligible events to check: the first ALWAYS_CHECK_FIRST of each stream, then 1 in `every`."""

    def __init__(self, every: int) -> None:
        self.every = max(1, every)
        self._seen: dict[object, int] = {}

    def should_check(self, stream: object) -> bool:
        seen = self._seen.get(stream, 0)
        self._seen[stream] = seen + 1
        return seen < ALWAYS_CHECK_FIRST or (seen - ALWAYS_CHECK_FIRST) % self.every == 0
