"""The hash-compatibility harness: recompute a `kvindex-hash-vectors/1` file and compare, case by case.

Off the data path: `kvindex compat vectors` runs it to prove the hasher matches the vLLM release that
produced the file. Pure: takes the file's bytes, returns a report; reading the file and printing are the
CLI's job.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
from kvindex.hashing.errors import HashingError
from kvindex.hashing.extra_keys import MMItem
from kvindex.hashing.hasher import BlockHasher

VECTORS_FORMAT: Final = "kvindex-hash-vectors/1"


class VectorsFileError(HashingError):
    """The file is not a readable kvindex-hash-vectors/1 document."""


class _Lora(msgspec.Struct, frozen=True):
    name: str
    path: str
    int_id: int | None = None


class _Expected(msgspec.Struct, frozen=True):
    root_hex: str
    block_hashes_hex: list[str]
    event_hashes: list[int]
    event_extra_keys: list[Any] | None


class _Case(msgspec.Struct, frozen=True):
    id: str
    algo: str
    seed: str | None
    block_size: int
    prompt: str
    expected: _Expected
    lora: _Lora | None = None
    cache_salt: str | None = None
    mm: list[MMItem] | None = None  # decoded straight into the hasher's own type
    lookahead: int = 0
    prompt_embeds_digests_hex: list[str] | None = None


_CASE_FIELDS: Final = frozenset(_Case.__struct_fields__)


class CaseFailure(msgspec.Struct, frozen=True):
    id: str
    first_bad_block: int


class CaseSkip(msgspec.Struct, frozen=True):
    id: str
    reason: str


class CompatReport(msgspec.Struct, frozen=True):
    """`first_bad_block` is the first block whose hash, event hash or event extra keys differ (0 when the
    root differs, since every block chains from it)."""

    total: int
    passed: int
    failed: list[CaseFailure]
    skipped: list[CaseSkip]


def _parse(data: bytes) -> tuple[dict[str, list[int]], list[dict[str, Any]]]:
    try:
        document = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise VectorsFileError(f"the vectors file is not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise VectorsFileError("the vectors file must be a JSON object with format, prompts and cases")
    if document.get("format") != VECTORS_FORMAT:
        raise VectorsFileError(
            f"the vectors file's format must be {VECTORS_FORMAT!r}, got {document.get('format')!r}"
        )
    try:
        prompts = msgspec.convert(document.get("prompts"), dict[str, list[int]])
        cases = msgspec.convert(document.get("cases"), list[dict[str, Any]])
    except msgspec.ValidationError as exc:
        raise VectorsFileError(
            f"the vectors file needs 'prompts' (name -> token ids) and 'cases' (a list of objects): {exc}"
        ) from None
    return prompts, cases


def _decode_case(raw: dict[str, Any], prompts: dict[str, list[int]], position: int) -> _Case:
    try:
        case = msgspec.convert(raw, _Case)
    except msgspec.ValidationError as exc:
        raise VectorsFileError(f"case #{position} ({raw.get('id')!r}) is malformed: {exc}") from None
    if case.prompt not in prompts:
        raise VectorsFileError(f"case {case.id!r} names prompt {case.prompt!r}, which is not in 'prompts'")
    return case


def _hex(value: str, what: str, case_id: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise VectorsFileError(f"case {case_id!r}: {what} {value!r} is not hex") from None


def _jsonable(value: Any) -> Any:
    """Our event extra keys in the file's JSON shape: tuples as lists, bytes as {"bytes_hex": ...}."""
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(item) for item in value]
    return value


def _first_mismatch(expected: list[Any], actual: list[Any]) -> int | None:
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want != got:
            return index
    if len(expected) != len(actual):
        return min(len(expected), len(actual))
    return None


def _check_case(case: _Case, tokens: list[int]) -> int | None:
    """The first bad block of one case, or None when everything agrees. Raises HashingError if the case
    cannot be computed."""
    hasher = BlockHasher(algo=case.algo, block_size=case.block_size, seed=case.seed, memo_size=0)
    keywords: dict[str, Any] = {"lookahead": case.lookahead}
    if case.lora is not None:
        keywords.update(lora_name=case.lora.name, lora_path=case.lora.path)
    if case.cache_salt is not None:
        keywords["cache_salt"] = case.cache_salt
    if case.mm is not None:
        keywords["mm"] = case.mm
    if case.prompt_embeds_digests_hex is not None:
        keywords["prompt_embeds_digests"] = [
            _hex(value, "prompt-embeds digest", case.id) for value in case.prompt_embeds_digests_hex
        ]
    expected = case.expected
    if hasher.root.hex() != expected.root_hex.lower():
        return 0
    digests = hasher.block_hashes(tokens, **keywords)
    events = hasher.event_hashes(tokens, **keywords)
    extra_keys = _jsonable(hasher.event_extra_keys(tokens, **keywords))
    want_extra = expected.event_extra_keys
    # NOTE: null means "no block carries extra keys" (the file writes it for lookahead cases, where vLLM's
    # BlockPool publishes [null, ...]); it matches a list of nulls of any length.
    if want_extra is None:
        want_extra = [None] * len(extra_keys)
    bad = [
        _first_mismatch([value.lower() for value in expected.block_hashes_hex], [d.hex() for d in digests]),
        _first_mismatch(expected.event_hashes, events),
        _first_mismatch(want_extra, extra_keys),
    ]
    found = [index for index in bad if index is not None]
    return min(found) if found else None


def check_vectors(data: bytes) -> CompatReport:
    """Recompute every case of a kvindex-hash-vectors/1 file.

    A case passes only if its root, block hashes, event hashes and event extra keys all agree. A case that
    cannot be computed (an algorithm or field this version does not know, xxhash with an unset seed, ...)
    is skipped with the reason, never passed. VectorsFileError if the file itself is malformed.
    """
    prompts, raw_cases = _parse(data)
    passed = 0
    failed: list[CaseFailure] = []
    skipped: list[CaseSkip] = []
    for position, raw in enumerate(raw_cases):
        case_id = str(raw.get("id", f"#{position}"))
        unknown = sorted(set(raw) - _CASE_FIELDS)
        if unknown:
            skipped.append(CaseSkip(case_id, f"unsupported case field(s): {', '.join(unknown)}"))
            continue
        case = _decode_case(raw, prompts, position)
        try:
            first_bad = _check_case(case, prompts[case.prompt])
        except VectorsFileError:
            raise
        except HashingError as exc:
            skipped.append(CaseSkip(case.id, str(exc)))
            continue
        if first_bad is None:
            passed += 1
        else:
            failed.append(CaseFailure(case.id, first_bad))
    return CompatReport(len(raw_cases), passed, failed, skipped)
