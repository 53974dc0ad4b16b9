"""The score API's compiled token-id reader (api/_token_ids.c) against msgspec, the reference.

The reader may decline any body (the request is then decoded by msgspec as before), but the ids it reads
must be exactly what msgspec decodes from the same top-level key, and decode_score_request must give the
same request or the same error either way."""

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
from kvindex.api import token_ids as reader
from kvindex.api.schemas import (
    RequestError,
    ScoreRequest,
    TokenId,
    decode_score_request,
    decode_score_request_exact,
)
from kvindex.api.token_ids import FindTokenIds

find_token_ids = reader.load_extension()
IDS = msgspec.json.Decoder(list[TokenId])
WHITESPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n", "  "])
token_id = st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))


def built() -> FindTokenIds:
    return require_built(find_token_ids, "kvindex.api._token_ids", "a C compiler")


def read_ids(array_text: bytes) -> bytes | None:
    """The reader's packed ids of `{"token_ids": <array_text>}`, checking the span it reports."""
    body = b'{"model": "m", "token_ids": ' + array_text + b"}"
    found = built()(body)
    if found is None:
        return None
    packed, start, stop = found
    assert body[start:stop] == array_text.strip(b" \t\r\n")
    return packed


def _reference(text: bytes) -> bytes | None:
    """What msgspec decodes `text` to as a list of token ids, packed; None if it refuses it."""
    try:
        return array("I", IDS.decode(text)).tobytes()
    except msgspec.DecodeError:
        return None


@st.composite
def spaced_arrays(draw: st.DrawFn) -> tuple[list[int], bytes]:
    """A JSON array of valid ids, with JSON whitespace drawn around every token."""
    ids = draw(st.lists(token_id, max_size=60))
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
        "99999999999999999999",
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


@given(spaced_arrays())
@settings(max_examples=300, deadline=None)
def test_every_plain_array_is_read_as_msgspec_decodes_it(case: tuple[list[int], bytes]) -> None:
    ids, text = case
    assert read_ids(text) == array("I", ids).tobytes() == _reference(text)


@given(st.one_of(array_like(), st.binary(max_size=40)))
@settings(max_examples=1000, deadline=None)
def test_what_the_reader_reads_msgspec_decodes_the_same(text: bytes) -> None:
    packed = read_ids(text)
    if packed is not None:
        assert packed == _reference(text)


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
        assert IDS.decode(text) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"token_ids":[1,2]}', [1, 2]),
        (b' {"a": "x\\"}", "token_ids" : [ 3 ] , "b": [{"token_ids": [9]}, "]"]} ', [3]),
        (b'{"s": "\\\\", "token_ids": [4]}', [4]),  # an escaped backslash ends the string after it
        (b'{"s": "\\"token_ids\\": [5]", "token_ids": [6]}', [6]),  # a key inside a string is not one
        (b'{"token_ids": [1], "token_ids": [2]}', None),  # a duplicate: msgspec decides which counts
        (b'{"token\\u005fids": [1]}', None),  # an escaped key may spell token_ids
        (b'{"token_ids": [1]} x', None),
        (b'{"token_ids": [1]', None),
        (b'{"token_ids": null}', None),
        (b'{"block_hashes": [1]}', None),
        (b"[1]", None),
        (b"{}", None),
        (b"", None),
    ],
)
def test_named_bodies(body: bytes, expected: list[int] | None) -> None:
    found = built()(body)
    assert (None if found is None else found[0]) == (
        None if expected is None else array("I", expected).tobytes()
    )


def test_it_refuses_what_has_no_buffer() -> None:
    with pytest.raises(TypeError):
        built()([1, 2])  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["compiled", "msgspec"])
def reader_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """decode_score_request with the compiled reader, and without it (as where it is not built)."""
    if request.param == "compiled":
        built()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reader, "find_token_ids", find_token_ids if request.param == "compiled" else None)
        yield str(request.param)


def _outcome(decode: Any, body: bytes) -> tuple[str, Any]:
    try:
        request = decode(body)
    except RequestError as exc:
        return "error", str(exc)
    fields = msgspec.structs.asdict(request)
    if fields["token_ids"] is not None:
        fields["token_ids"] = list(fields["token_ids"])
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
    "block_hashes": st.one_of(st.lists(st.integers(0, 2**64 - 1), max_size=5), st.none()),
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
    """Requests that score: plain token ids among other fields whose strings the reader must step over."""
    fields: dict[str, Any] = {"token_ids": draw(st.lists(token_id, min_size=1, max_size=40))}
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


def test_plain_token_ids_come_packed_only_with_the_reader(reader_path: str) -> None:
    request = decode_score_request(b'{"model": "m", "token_ids": [3, 1, 4, 1, 5]}')
    assert isinstance(request, ScoreRequest)
    assert list(request.token_ids or []) == [3, 1, 4, 1, 5]
    assert type(request.token_ids) is (array if reader_path == "compiled" else list)
    assert decode_score_request(b'{"block_hashes": [7]}').token_ids is None
