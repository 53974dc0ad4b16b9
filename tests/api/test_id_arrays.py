"""The score API's compiled id-array reader (api/_id_arrays.c) against msgspec, the reference.

The reader may decline any body (the request is then decoded by msgspec as before), but the ids it reads
(token ids as uint32, block hashes as uint64) must be exactly what msgspec decodes from the same top-level
key, and decode_score_request must give the same request or the same error either way."""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from extensions import require_built
from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.api import id_arrays as reader
from kvindex.api.id_arrays import TYPECODES, FindIds
from kvindex.api.schemas import (
    MAX_BLOCK_HASH,
    EventBlockHash,
    RequestError,
    ScoreRequest,
    TokenId,
    decode_score_request,
    decode_score_request_exact,
    validate_score_request,
)

find_ids = reader.load_extension()
# What msgspec decodes each key's array to; block hashes have their 2**64 ceiling checked after decoding.
DECODERS = {
    "token_ids": msgspec.json.Decoder(list[TokenId]),
    "block_hashes": msgspec.json.Decoder(list[EventBlockHash]),
}
KEYS = sorted(DECODERS)
WHITESPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n", "  "])
token_id = st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))
# Block hashes of every length, and the edges where 8-digit chunks and the 2**64 ceiling meet.
block_hash = st.one_of(
    st.integers(0, 2**64 - 1),
    st.integers(0, 10**9),
    st.sampled_from([10**k + d for k in range(21) for d in (-1, 0, 1)]).filter(
        lambda v: 0 <= v <= MAX_BLOCK_HASH
    ),
)
IDS_OF = {"token_ids": token_id, "block_hashes": block_hash}


def built() -> FindIds:
    return require_built(find_ids, "kvindex.api._id_arrays", "a C compiler")


def read_ids(array_text: bytes, key: str = "token_ids") -> bytes | None:
    """The reader's packed ids of `{"<key>": <array_text>}`, checking the key and span it reports."""
    body = b'{"model": "m", "' + key.encode() + b'": ' + array_text + b"}"
    found = built()(body)
    if found is None:
        return None
    found_key, packed, start, stop = found
    assert found_key == key
    assert body[start:stop] == array_text.strip(b" \t\r\n")
    return packed


def _reference(text: bytes, key: str = "token_ids") -> bytes | None:
    """What msgspec decodes `text` to as a list of `key`'s ids, packed; None if it refuses it (or, for block
    hashes, if one is not below 2**64, which validate_score_request refuses)."""
    try:
        ids = DECODERS[key].decode(text)
    except msgspec.DecodeError:
        return None
    if any(value > MAX_BLOCK_HASH for value in ids):
        return None
    return array(TYPECODES[key], ids).tobytes()


@st.composite
def spaced_arrays(draw: st.DrawFn, key: str) -> tuple[list[int], bytes]:
    """A JSON array of valid ids for `key`, with JSON whitespace drawn around every token."""
    ids = draw(st.lists(IDS_OF[key], max_size=60))
    parts = [draw(WHITESPACE), "["]
    for i, value in enumerate(ids):
        parts += [draw(WHITESPACE), str(value), draw(WHITESPACE)]
        if i < len(ids) - 1:
            parts.append(",")
    parts += [draw(WHITESPACE), "]", draw(WHITESPACE)]
    return ids, "".join(parts).encode()


# Pieces that make an array msgspec may or may not accept: signs, fractions, exponents, leading zeros,
# out-of-range ids, other JSON values, stray separators.
PIECES = st.sampled_from(
    [
        "[",
        "]",
        ",",
        " ",
        "0",
        "1",
        "7",
        "00",
        "01",
        "-",
        "-1",
        "1.0",
        ".5",
        "1e3",
        "1E+2",
        "4294967295",
        "4294967296",
        "9999999999999999",
        "10000000000000000",
        "18446744073709551615",
        "18446744073709551616",
        "99999999999999999999",
        "123456789012345678901",
        "true",
        "null",
        '"1"',
        "{}",
        "[1]",
        "\\",
        "\x00",
        "\u00e9",
    ]
)


@st.composite
def array_like(draw: st.DrawFn) -> bytes:
    return ("[" + "".join(draw(st.lists(PIECES, max_size=12))) + draw(st.sampled_from(["]", ""]))).encode()


@pytest.mark.parametrize("key", KEYS)
@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_every_plain_array_is_read_as_msgspec_decodes_it(key: str, data: st.DataObject) -> None:
    ids, text = data.draw(spaced_arrays(key))
    assert read_ids(text, key) == array(TYPECODES[key], ids).tobytes() == _reference(text, key)


@pytest.mark.parametrize("key", KEYS)
@given(text=st.one_of(array_like(), st.binary(max_size=40)))
@settings(max_examples=1000, deadline=None)
def test_what_the_reader_reads_msgspec_decodes_the_same(key: str, text: bytes) -> None:
    packed = read_ids(text, key)
    if packed is not None:
        assert packed == _reference(text, key)


# Long arrays, with every kind of unexpected byte tried at every offset (a reader that takes the array in
# blocks, or stripes, must hand each of them to its exact path).
long_token_id = st.one_of(st.integers(0, 9), st.integers(0, 999_999), st.integers(0, 2**32 - 1))
DAMAGE = st.sampled_from(
    [
        b"x",
        b"-",
        b".",
        b"e",
        b",",
        b" ",
        b"  ",
        b"]",
        b"[",
        b"0",
        b"00",
        b"\x00",
        "\u00e9".encode(),
        b'"',
        b"\n",
    ]
)


@st.composite
def long_arrays(draw: st.DrawFn) -> tuple[list[int], bytes]:
    ids = draw(st.lists(long_token_id, min_size=10, max_size=400))
    spacing = draw(st.sampled_from(["", " ", "mixed"]))
    parts = ["["]
    for i, value in enumerate(ids):
        parts.append(str(value))
        if i < len(ids) - 1:
            parts.append(",")
            parts.append(draw(WHITESPACE) if spacing == "mixed" else spacing)
    parts.append("]")
    return ids, "".join(parts).encode()


@given(long_arrays())
@settings(max_examples=300, deadline=None)
def test_long_plain_arrays_are_read_as_msgspec_decodes_them(case: tuple[list[int], bytes]) -> None:
    ids, text = case
    assert read_ids(text) == array("I", ids).tobytes() == _reference(text)


@given(case=long_arrays(), data=st.data())
@settings(max_examples=500, deadline=None)
def test_a_long_array_damaged_anywhere_is_read_as_msgspec_reads_it_or_declined(
    case: tuple[list[int], bytes], data: st.DataObject
) -> None:
    _, text = case
    at = data.draw(st.integers(0, len(text)))
    cut = data.draw(st.sampled_from([0, 1]))  # insert the damage, or replace the byte there with it
    damaged = text[:at] + data.draw(DAMAGE) + text[at + cut :]
    packed = read_ids(damaged)
    if packed is not None:  # declining is always allowed: msgspec then decides
        assert packed == _reference(damaged)


# Ids of up to 5 digits, and of 9 and 10 (read from two words by the striped path), near the uint32 ceiling.
ID_RUNS = {
    "short": [i * 7919 % 100_000 for i in range(90)],
    "long": [2**32 - 1 - i * 37_000_000 if i % 2 else 100_000_000 + i * 9_876_543 for i in range(90)],
}


@pytest.mark.parametrize("ids", sorted(ID_RUNS))
@pytest.mark.parametrize("separator", [b",", b", ", b" ,\n "])
def test_every_anomaly_at_every_offset_of_a_long_array_is_read_right_or_declined(
    separator: bytes, ids: str
) -> None:
    text = b"[" + separator.join(str(value).encode() for value in ID_RUNS[ids]) + b"]"
    anomalies = [
        b"1 2 3",
        b"1 2",
        b",,",
        b", ,",
        b"01",
        b"-1",
        b"1.5",
        b"1e3",
        b"12345678",
        b",7",
        b"x",
        b"]",
        b"\x00",
    ]
    read = 0
    for at in range(1, len(text)):
        for anomaly in anomalies:
            damaged = text[:at] + anomaly + text[at:]
            packed = read_ids(damaged)
            if packed is not None:
                assert packed == _reference(damaged), (at, anomaly)
                read += 1
    assert (
        read > 0
    )  # some insertions (an id of 8 digits between two commas, ",7", ...) are plain arrays still


@pytest.mark.parametrize("ids", sorted(ID_RUNS))
@pytest.mark.parametrize("separator", [b",", b", "])
def test_every_byte_deleted_from_a_long_array_is_read_right_or_declined(separator: bytes, ids: str) -> None:
    # A deletion takes out a separator's space (at every stripe boundary among others), a comma, a digit
    # or a bracket: what is still a plain array must read as msgspec reads it, the rest is declined.
    text = b"[" + separator.join(str(value).encode() for value in ID_RUNS[ids]) + b"]"
    read = 0
    for at in range(len(text)):
        damaged = text[:at] + text[at + 1 :]
        packed = read_ids(damaged)
        if packed is not None:
            assert packed == _reference(damaged), at
            read += 1
    assert read > 0  # a digit deleted leaves a plain array


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"[]", []),
        (b" [ 0 ,\t1 ,\r\n2 ] ", [0, 1, 2]),
        (b"[4294967295]", [4294967295]),
        (b"[4294967296]", None),
        (b"[-1]", None),
        (b"[-0]", None),  # valid JSON and msgspec reads 0: declined all the same (msgspec decides)
        (b"[01]", None),
        (b"[1.0]", None),
        (b"[1e3]", None),
        (b"[1,]", None),
        (b"[,1]", None),
        (b"[1 2]", None),
        (b"[true]", None),
        (b"[[1]]", None),
        (b'["1"]', None),
        (b"1", None),
        (b"", None),
        (b"[1", None),
        (b"[1]x", None),
        (b"null", None),
    ],
)
def test_named_shapes(text: bytes, expected: list[int] | None) -> None:
    assert read_ids(text) == (None if expected is None else array("I", expected).tobytes())
    if expected is not None:
        assert DECODERS["token_ids"].decode(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"[]", []),
        (b"[0, 7, 12345678, 123456789, 1234567890123456]", [0, 7, 12345678, 123456789, 1234567890123456]),
        (b"[9999999999999999, 10000000000000000]", [9999999999999999, 10000000000000000]),
        (b"[18446744073709551615]", [2**64 - 1]),
        (b"[ 18446744073709551615 ]", [2**64 - 1]),
        (b"[18446744073709551616]", None),
        (b"[99999999999999999999]", None),
        (b"[100000000000000000000]", None),
        (b"[012345678901234567]", None),
        (b"[-1]", None),
        (b"[1234567890123456789.0]", None),
        (b"[1234567890123456789e0]", None),
        (b"[4294967296]", [4294967296]),
    ],
)
def test_named_block_hash_shapes(text: bytes, expected: list[int] | None) -> None:
    assert read_ids(text, "block_hashes") == (None if expected is None else array("Q", expected).tobytes())
    if expected is not None:
        assert DECODERS["block_hashes"].decode(text) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"token_ids":[1,2]}', ("token_ids", [1, 2])),
        (b' {"a": "x\\"}", "token_ids" : [ 3 ] , "b": [{"token_ids": [9]}, "]"]} ', ("token_ids", [3])),
        (b'{"s": "\\\\", "token_ids": [4]}', ("token_ids", [4])),  # an escaped backslash ends the string
        (
            b'{"s": "\\"token_ids\\": [5]", "token_ids": [6]}',
            ("token_ids", [6]),
        ),  # a key in a string is not one
        (b'{"token_ids": [1], "token_ids": [2]}', None),  # a duplicate: msgspec decides which counts
        (b'{"token\\u005fids": [1]}', None),  # an escaped key may spell token_ids
        (b'{"token_ids": [1]} x', None),
        (b'{"token_ids": [1]', None),
        (b'{"token_ids": null}', None),
        (b'{"block_hashes": [1]}', ("block_hashes", [1])),
        (b'{"model": "m", "block_hashes": [1, 2], "answer": "compact"}', ("block_hashes", [1, 2])),
        (b'{"block_hashes": [1], "block_hashes": [2]}', None),
        (b'{"token_ids": [1], "block_hashes": [2]}', None),  # both: the validation names the mistake
        (b'{"block\\u005fhashes": [1]}', None),
        (b"[1]", None),
        (b"{}", None),
        (b"", None),
    ],
)
def test_named_bodies(body: bytes, expected: tuple[str, list[int]] | None) -> None:
    found = built()(body)
    if expected is None:
        assert found is None
    else:
        key, ids = expected
        assert found is not None and found[:2] == (key, array(TYPECODES[key], ids).tobytes())


def test_it_refuses_what_has_no_buffer() -> None:
    with pytest.raises(TypeError):
        built()([1, 2])  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["compiled", "msgspec"])
def reader_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """decode_score_request with the compiled reader, and without it (as where it is not built)."""
    if request.param == "compiled":
        built()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reader, "find_ids", find_ids if request.param == "compiled" else None)
        yield str(request.param)


def _outcome(decode: Any, body: bytes) -> tuple[str, Any]:
    """The decoded and validated request, as plain values, or the error."""
    try:
        request = decode(body)
        validate_score_request(request, max_tokens=8192)
    except RequestError as exc:
        return "error", str(exc)
    fields = msgspec.structs.asdict(request)
    for key in KEYS:
        if fields[key] is not None:
            fields[key] = list(fields[key])
    return "request", fields


# Strings the reader must step over exactly: ones that look like keys or end early, escapes, brackets.
TRICKY_TEXT = st.one_of(
    st.sampled_from(['"token_ids": [1]', '\\"', "\\", "]}", "[", '{"token_ids": [2]}', "\u00e9", ""]),
    st.text(max_size=6),
)
BODY_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("m"), st.none(), st.integers(), TRICKY_TEXT),
    "cache_salt": TRICKY_TEXT,
    "states": st.lists(TRICKY_TEXT, max_size=3),
    "token_ids": st.one_of(
        st.lists(token_id, max_size=20), st.none(), st.just("1,2"), st.lists(st.integers())
    ),
    "block_hashes": st.one_of(
        st.lists(block_hash, max_size=5), st.none(), st.lists(st.integers(-1, 2**65), max_size=3)
    ),
    "lora_name": st.one_of(st.text(max_size=5), st.none()),
    "pods": st.one_of(st.lists(TRICKY_TEXT, max_size=3), st.none()),
    # Not a field: refused, but its value (nested token_ids keys, brackets in strings) must be stepped over.
    "extra": st.recursive(
        TRICKY_TEXT | st.integers(),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(TRICKY_TEXT, c, max_size=3),
    ),
    "rank": st.sampled_from(["trust", "score", "best"]),
    "prompt": st.text(max_size=5),  # not a field: refused
    "token_id": st.lists(token_id, max_size=3),  # a misspelling: refused with a hint
}


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    names = draw(st.lists(st.sampled_from(sorted(BODY_FIELDS)), unique=True, max_size=5))
    body = json.dumps({name: draw(BODY_FIELDS[name]) for name in names}).encode()
    if draw(st.booleans()):  # msgspec's spacing instead of json's
        body = msgspec.json.encode(msgspec.json.decode(body))
    if draw(st.booleans()):
        return body
    cut = draw(st.integers(0, len(body)))  # damaged: truncated, or a byte replaced
    return body[:cut] + draw(st.sampled_from([b"", b"x", b"]", b"-", b"\xff"])) + body[cut + 1 :]


@st.composite
def good_bodies(draw: st.DrawFn) -> bytes:
    """Requests that score: plain token ids or block hashes among other fields whose strings the reader must
    step over."""
    key = draw(st.sampled_from(KEYS))
    fields: dict[str, Any] = {key: draw(st.lists(IDS_OF[key], min_size=1, max_size=40))}
    for name, values in [
        ("model", TRICKY_TEXT),
        ("cache_salt", TRICKY_TEXT),
        ("pods", st.lists(TRICKY_TEXT, min_size=1)),
    ]:
        if draw(st.booleans()):
            fields[name] = draw(values)
    names = draw(st.permutations(sorted(fields)))
    body = json.dumps({name: fields[name] for name in names}, ensure_ascii=draw(st.booleans())).encode()
    return msgspec.json.encode(msgspec.json.decode(body)) if draw(st.booleans()) else body


@given(body=good_bodies())
@settings(max_examples=300, deadline=None)
def test_a_good_request_is_read_by_the_reader_and_decodes_the_same(reader_path: str, body: bytes) -> None:
    if reader_path == "compiled":
        assert built()(body) is not None
    assert _outcome(decode_score_request, body) == _outcome(decode_score_request_exact, body)


@given(body=bodies())
@settings(max_examples=400, deadline=None)
def test_a_request_decodes_the_same_with_either_path(reader_path: str, body: bytes) -> None:
    assert _outcome(decode_score_request, body) == _outcome(decode_score_request_exact, body)


def test_plain_ids_come_packed_only_with_the_reader(reader_path: str) -> None:
    request = decode_score_request(b'{"model": "m", "token_ids": [3, 1, 4, 1, 5]}')
    assert isinstance(request, ScoreRequest)
    assert list(request.token_ids or []) == [3, 1, 4, 1, 5]
    assert type(request.token_ids) is (array if reader_path == "compiled" else list)
    assert request.block_hashes is None
    request = decode_score_request(b'{"block_hashes": [7, 18446744073709551615]}')
    assert list(request.block_hashes or []) == [7, 2**64 - 1]
    assert type(request.block_hashes) is (array if reader_path == "compiled" else list)
    assert request.token_ids is None
