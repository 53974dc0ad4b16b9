"""Hand-built canonical CBOR for the block-hash preimage `(parent, tokens, extra_keys)`.

Used on the read path by the sha256_cbor / xxhash_cbor algorithms: byte-identical to
`cbor2.dumps(obj, canonical=True)` (the tests prove it), but without cbor2's per-object dispatch. Token
ints come from a precomputed table, built on first use; extra keys, rare and repeated on every block, go
through cbor2.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Final

import cbor2

# Token ids below this bound are encoded by table lookup; it covers every vocabulary in use today (Gemma's
# 256k is the largest) at ~12 MB. Larger ids fall back to arithmetic, ids >= 2**64 to cbor2 (bignum tag).
TABLE_SIZE: Final = 1 << 18

_NULL: Final = b"\xf6"
_ARRAY3: Final = b"\x83"


def _uint_head(major: int, value: int) -> bytes:
    """The minimal CBOR head for `major` type with argument `value` (RFC 8949 §3, canonical form)."""
    if value < 24:
        return bytes((major | value,))
    if value < 0x100:
        return bytes((major | 24, value))
    if value < 0x10000:
        return bytes((major | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((major | 26,)) + value.to_bytes(4, "big")
    return bytes((major | 27,)) + value.to_bytes(8, "big")


def _build_table() -> tuple[bytes, ...]:
    return tuple(_uint_head(0, value) for value in range(TABLE_SIZE))


# NOTE: the table is a constant, but building it costs its ~12 MB and a pause that only the *_cbor
# algorithms need, so it is not built at import: the first caller of token_table() builds it (under the
# lock, so exactly once per process) and it never changes after. None until then.
_token_table: tuple[bytes, ...] | None = None
_token_table_lock: Final = threading.Lock()


def token_table() -> tuple[bytes, ...]:
    """The canonical CBOR of every int below TABLE_SIZE, by value; built on the first call in the
    process (safe from several threads at once), then returned as is."""
    global _token_table
    table = _token_table
    if table is None:
        with _token_table_lock:
            table = _token_table
            if table is None:
                table = _token_table = _build_table()
    return table


def encode_token(token_id: int) -> bytes:
    """Canonical CBOR of one non-negative int."""
    if token_id < TABLE_SIZE:
        return token_table()[token_id]
    if token_id < 1 << 64:
        return _uint_head(0, token_id)
    return cbor2.dumps(token_id, canonical=True)


def encode_tokens(token_ids: Sequence[int]) -> tuple[bytes, ...]:
    """The canonical CBOR item of each token id (all >= 0), in order."""
    if len(token_ids) == 1:
        return (encode_token(token_ids[0]),)
    if not token_ids:
        return ()
    try:
        return itemgetter(*token_ids)(token_table())  # type: ignore[no-any-return]
    except IndexError:  # an id beyond the table: rare, so the slow path is fine
        return tuple(map(encode_token, token_ids))


def bstr_head(length: int) -> bytes:
    """Head of a byte string of `length` bytes (the parent digest)."""
    return _uint_head(0x40, length)


def array_head(length: int) -> bytes:
    """Head of an array of `length` items (the block's token tuple)."""
    return _uint_head(0x80, length)


def encode_extra(extra_keys: Any) -> bytes:
    """Canonical CBOR of a block's extra keys (None or a tuple of tagged keys)."""
    if extra_keys is None:
        return _NULL
    return cbor2.dumps(extra_keys, canonical=True)


def preimage_head(parent_size: int) -> bytes:
    """The bytes before the parent digest: array(3) head, then the head of a `parent_size`-byte string."""
    return _ARRAY3 + bstr_head(parent_size)
