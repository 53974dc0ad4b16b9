"""vLLM's four prefix-cache hash functions and the chain root (NONE_HASH) derived from a seed.

First stage of the read path (prompt -> block hashes): mirrors `vllm/utils/hashing.py` and
`init_none_hash` in `vllm/v1/core/kv_cache_utils.py` (vLLM 0.33.0). The seed is always an argument here;
reading PYTHONHASHSEED is the job of the shell (CLI, config loader).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import cbor2
import xxhash
from kvindex.hashing.errors import HashingError

# `--prefix-caching-hash-algo` values, vLLM's default first.
HASH_ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

# The seed vLLM uses for cryptographic algorithms when PYTHONHASHSEED is unset (DEFAULT_NONE_HASH_SEED).
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"


def _pickle_v5(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_canonical(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


# NOTE: the SHA-256 constructor of every hash in this package. hashlib.sha256 is OpenSSL's
# (`_hashlib.openssl_sha256`) whenever CPython is linked against OpenSSL, and on the ~100-byte preimages
# of a block it beats CPython's own implementation (`_sha256.sha256` up to 3.11, `_sha2.sha256` from
# 3.12), with or without SHA-NI; without OpenSSL, hashlib itself falls back to that built-in one.
SHA256: Final = hashlib.sha256


def _sha256_digest(data: bytes) -> bytes:
    return SHA256(data).digest()


@dataclass(frozen=True, slots=True)
class HashAlgo:
    """One hash algorithm: how a Python object is serialised, and which digest is taken of the bytes."""

    name: str
    uses_cbor: bool
    # Non-cryptographic algorithms get a random per-process root in vLLM when the seed is unset.
    is_cryptographic: bool
    digest_size: int
    serialize: Callable[[Any], bytes]
    digest: Callable[[bytes], bytes]

    def hash_object(self, obj: Any) -> bytes:
        """H(obj) exactly as vLLM's hash function of the same name computes it."""
        return self.digest(self.serialize(obj))


_ALGOS: Final[dict[str, HashAlgo]] = {
    "sha256": HashAlgo("sha256", False, True, 32, _pickle_v5, _sha256_digest),
    "sha256_cbor": HashAlgo("sha256_cbor", True, True, 32, _cbor_canonical, _sha256_digest),
    "xxhash": HashAlgo("xxhash", False, False, 16, _pickle_v5, xxhash.xxh3_128_digest),
    "xxhash_cbor": HashAlgo("xxhash_cbor", True, False, 16, _cbor_canonical, xxhash.xxh3_128_digest),
}


def get_algo(name: str) -> HashAlgo:
    """The algorithm called `name`; HashingError for anything vLLM's option would refuse."""
    algo = _ALGOS.get(name) if isinstance(name, str) else None
    if algo is None:
        raise HashingError(f"unknown hash algorithm {name!r}: use one of {', '.join(HASH_ALGOS)}")
    return algo


def resolve_seed(algo: HashAlgo, seed: str | None) -> str:
    """The seed string the root is derived from, by vLLM's rule for an engine whose PYTHONHASHSEED is `seed`.

    An unset seed means "vllm-none-hash" for sha256 variants. For xxhash variants vLLM then draws a random
    root per engine process that is never published, so no indexer can reproduce it: refuse.
    """
    if seed is None:
        if algo.is_cryptographic:
            return DEFAULT_NONE_HASH_SEED
        raise HashingError(
            f"{algo.name} without a seed cannot match any engine: vLLM then uses a random per-process root, "
            "so set PYTHONHASHSEED to the same value on every engine and pass that seed here"
        )
    if not isinstance(seed, str):
        raise HashingError(
            f"the hash seed must be a string (the PYTHONHASHSEED value), got {type(seed).__name__}"
        )
    return seed


def root_hash(algo: HashAlgo, seed: str | None) -> bytes:
    """NONE_HASH: the parent of block 0, H(seed string)."""
    return algo.hash_object(resolve_seed(algo, seed))


def event_hash(digest: bytes) -> int:
    """The form vLLM publishes in KV events (`int.from_bytes(digest[-8:], "big")`): the digest's last 8
    bytes as a big-endian unsigned int. The one home of this fold; everything else imports it."""
    return int.from_bytes(digest[-8:], "big")


def event_hashes_of(digests: Sequence[bytes], digest_size: int) -> list[int]:
    """`event_hash` of each of `digests`, all `digest_size` bytes long, in order."""
    if not digests:
        return []
    # NOTE: one struct.unpack over the joined digests instead of one event_hash call per block: about a
    # third of the time for a long prompt's digests.
    layout = f"{digest_size - 8}xQ" * len(digests)
    return list(struct.unpack(">" + layout, b"".join(digests)))
