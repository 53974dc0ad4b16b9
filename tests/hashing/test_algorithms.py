"""hashing/algorithms.py: which SHA-256 implementation every block hash goes through."""

from __future__ import annotations

import hashlib

import pytest
from kvindex.hashing import algorithms, hasher


def test_block_hashes_use_openssls_sha256() -> None:
    """The chain and the root hash with OpenSSL's SHA-256 on every Python that has it.

    Measured on ~100-byte block preimages (the size of one block's pickle or CBOR), OpenSSL 3.0 beat
    CPython's built-in SHA-256 on 3.10 to 3.13, with SHA-NI and with it masked off
    (OPENSSL_ia32cap): the built-in is `_sha256.sha256` up to 3.11 and `_sha2.sha256` from 3.12, and
    `from _sha256 import sha256` silently stops finding it on 3.12. So the choice must be hashlib's
    constructor, which is OpenSSL's here, and no private module's.
    """
    _hashlib = pytest.importorskip("_hashlib", reason="this Python has no OpenSSL: hashlib uses its own")
    assert algorithms.SHA256 is hashlib.sha256 is _hashlib.openssl_sha256
    assert hasher.SHA256 is algorithms.SHA256
