"""vLLM-compatible prefix-cache block hashing (vLLM 0.33.0, byte-exact).

The first step of the read path: a prompt's token ids (plus LoRA, multimodal, cache-salt, prompt-embeds
and lookahead inputs) -> the chained block digests, and the 64-bit form KV events carry. Pure code: no IO,
no globals but one, the hash core chosen at import (compiled or pure Python: hashing/compiled.py); the
seed is an argument.
"""

from kvindex.hashing.algorithms import DEFAULT_NONE_HASH_SEED, HASH_ALGOS, event_hash, root_hash
from kvindex.hashing.errors import HashingError
from kvindex.hashing.extra_keys import MMItem
from kvindex.hashing.granularity import hybrid_block_hashes
from kvindex.hashing.hasher import DEFAULT_MEMO_SIZE, BlockHasher, HeldCheck, validate_token_ids

__all__ = [
    "DEFAULT_MEMO_SIZE",
    "DEFAULT_NONE_HASH_SEED",
    "HASH_ALGOS",
    "BlockHasher",
    "HashingError",
    "HeldCheck",
    "MMItem",
    "event_hash",
    "hybrid_block_hashes",
    "root_hash",
    "validate_token_ids",
]
