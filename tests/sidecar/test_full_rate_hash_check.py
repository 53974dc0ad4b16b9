"""The sidecar's full-rate hash check: roots and continued chains recomputed (expected keys from vLLM's
rule as the hasher computes the whole prompt at once), mismatches counted, a parent never checked leaves
its children unverifiable rather than passed."""

from __future__ import annotations

import pytest
from kvindex.hashing import BlockHasher
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored
from kvindex.sidecar.hash_check import RankHashCheck

BLOCK = 16


def stored(keys: list[int], tokens: list[int], parent: int | None) -> BlocksStored:
    return BlocksStored(tuple(keys), parent, tuple(tokens), BLOCK, extra_keys=(None,) * len(keys))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_after_continues_the_chain(algo: str) -> None:
    hasher = BlockHasher(algo=algo, block_size=BLOCK, seed="0")
    tokens = list(range(100, 100 + 5 * BLOCK))
    whole = hasher.block_hashes(tokens)
    assert hasher.block_hashes_after(hasher.root, tokens) == whole
    assert hasher.block_hashes_after(whole[1], tokens[2 * BLOCK :]) == whole[2:]


def test_roots_and_continuations_are_checked_and_mismatches_counted() -> None:
    hasher = BlockHasher(algo="sha256", block_size=BLOCK, seed=None)
    tokens = list(range(1, 1 + 6 * BLOCK))
    keys = hasher.event_hashes(tokens)
    check = RankHashCheck(hasher)
    assert check.apply([stored(keys[:2], tokens[: 2 * BLOCK], None)]) == []
    assert check.apply([stored(keys[2:4], tokens[2 * BLOCK : 4 * BLOCK], keys[1])]) == []
    wrong = stored([keys[4] ^ 1], tokens[4 * BLOCK : 5 * BLOCK], keys[3])
    assert check.apply([wrong]) == [wrong]
    assert (check.checked, check.mismatched, check.unverifiable) == (3, 1, 0)
    # A parent that was removed (or never seen) cannot be extended: unverifiable, not passed.
    check.apply([BlocksRemoved((keys[3],))])
    check.apply([stored([keys[4]], tokens[4 * BLOCK : 5 * BLOCK], keys[3])])
    check.apply([stored([keys[5]], tokens[5 * BLOCK :], 12345)])
    assert (check.checked, check.unverifiable) == (3, 2)
    check.apply([AllBlocksCleared(), stored([keys[2]], tokens[2 * BLOCK : 3 * BLOCK], keys[1])])
    assert check.unverifiable == 3


def test_a_seed_mismatch_is_caught_on_every_root() -> None:
    engine = BlockHasher(algo="sha256", block_size=BLOCK, seed="1")
    check = RankHashCheck(BlockHasher(algo="sha256", block_size=BLOCK, seed=None))
    for n in range(5):
        tokens = list(range(n * 1000, n * 1000 + BLOCK))
        check.apply([stored(engine.event_hashes(tokens), tokens, None)])
    assert (check.checked, check.mismatched) == (5, 5)
