"""Block hashes of a KV-cache group whose block size is a multiple of the hash block size (hybrid models).

Read path, after hashing: vLLM hashes at `hash_block_size` (HB) and a group with blocks of k*HB tokens uses,
as its i-th block hash, the *last* fine-grained hash inside that block — not a combination
(`BlockHashListWithBlockSize._get_value_at`, vLLM 0.33.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from kvindex.hashing.errors import HashingError

HashT = TypeVar("HashT", bytes, int)


def hybrid_block_hashes(
    block_hashes: Sequence[HashT], hash_block_size: int, group_block_size: int
) -> list[HashT]:
    """The group's block hashes: `block_hashes[(i + 1) * k - 1]` for each full group block, k = group/HB."""
    for name, value in (("hash_block_size", hash_block_size), ("group_block_size", group_block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise HashingError(f"{name} must be a positive integer, got {value!r}")
    if group_block_size % hash_block_size:
        raise HashingError(
            f"group_block_size {group_block_size} must be a multiple of hash_block_size {hash_block_size}"
        )
    scale = group_block_size // hash_block_size
    return list(block_hashes[scale - 1 :: scale])
