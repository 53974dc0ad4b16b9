"""Stage 1 of the read path: the HTTP request and response shapes of the score API (CONTRACT.md).

Request bodies are decoded straight into these Structs by msgspec; `validate_score_request` adds the
checks a type cannot express (limits, exclusive fields). Every failure is a `RequestError` naming the
field, which the HTTP layer turns into `{"error": "<field>: <what is wrong>"}`.
"""

from __future__ import annotations

import difflib
import re
from array import array
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
from kvindex.api import id_arrays
from kvindex.indexer.scorer import PodScore
from kvindex.indexer.status import ALL_STATES, PodStatus
from msgspec import Meta

MAX_TOKEN_ID = 2**32 - 1  # vLLM token ids are 32-bit vocabulary indices
MAX_BLOCK_HASH = 2**64 - 1  # event-form hashes are unsigned 64-bit

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
# msgspec cannot bound an int beyond int64, so the 2**64 ceiling is checked after decoding.
EventBlockHash = Annotated[int, Meta(ge=0, description="an event-form block hash: an unsigned 64-bit int")]


class RequestError(ValueError):
    """A client mistake: `field` is the JSON path of the bad value ("body" for the whole document)."""

    def __init__(self, field: str, problem: str, *, status: int = 400) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
        self.status = status


class ScoreRequestMMItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One entry of a score request's `mm`: a multimodal item's encoder-cache identifier and where its
    placeholder tokens sit. The JSON shape of CONTRACT.md (unknown fields refused, checked with field paths
    by `validate_score_request`); api/score.py turns it into the hasher's kvindex.hashing.MMItem."""

    identifier: str
    offset: int
    length: int


class ScoreRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/score`. Exactly one of `token_ids` / `block_hashes`; extra keys only with token_ids.

    Unknown fields are refused (400 naming the field): a router sending `prompt` or a misspelt
    `token_id` must hear that it was not understood, not get a score for something else."""

    model: str | None = None
    # Decoded as a list; the compiled reader hands over an array('I') of the same ids (decode_score_request).
    token_ids: Sequence[TokenId] | None = None
    # Decoded as a list; the compiled reader hands over an array('Q') of the same hashes.
    block_hashes: Sequence[EventBlockHash] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm: list[ScoreRequestMMItem] | None = None
    pods: list[str] | None = None
    # Pod states to answer for; None: every state, but a pod disconnected for longer than the grace
    # (IngestSettings.disconnected_grace_s) is left out.
    states: list[str] | None = None
    # "trust": pods kvindex can vouch for (live) rank above the others, each group by score; "score":
    # by score alone.
    rank: Literal["trust", "score"] = "trust"
    # "compact": each entry as [pod, dp_rank, matched_blocks, score] (CompactScoreResponse), the same
    # entries in the same order, without by_tier and health: for routers that read only the match,
    # whose JSON parse of a full answer (~150 B an entry, 100-200 entries) cost more than the score.
    answer: Literal["full", "compact"] = "full"


class ScoreResponse(msgspec.Struct, frozen=True):
    model: str
    block_size: int
    num_blocks: int
    scores: list[PodScore]  # best first; encoded as CONTRACT.md's entries
    # Extension: the request's `pods` that name no pod of this model (no stream, never a block), in
    # request order; sent exactly when the request names `pods` (UNSET: left out of the JSON).
    unknown_pods: list[str] | msgspec.UnsetType = msgspec.UNSET


# A compact answer's entry: pod, dp_rank, matched_blocks, score (the full entry's fields of those names).
CompactPodScore = tuple[str, int, int, float]


class CompactScoreResponse(msgspec.Struct, frozen=True):
    """`POST /v1/score` with `"answer": "compact"`: ScoreResponse's entries as CompactPodScore arrays."""

    model: str
    block_size: int
    num_blocks: int
    scores: list[CompactPodScore]  # best first, the same entries as the full answer's
    unknown_pods: list[str] | msgspec.UnsetType = msgspec.UNSET


class EncodedScoreResponse(msgspec.Struct, frozen=True):
    """ScoreResponse (or CompactScoreResponse) with its `scores` already JSON (api/answer.py writes
    them): the same bytes."""

    model: str
    block_size: int
    num_blocks: int
    scores: msgspec.Raw
    unknown_pods: list[str] | msgspec.UnsetType = msgspec.UNSET


class PodsResponse(msgspec.Struct, frozen=True):
    pods: list[PodStatus]


class ErrorBody(msgspec.Struct, frozen=True):
    """Every 4xx and 5xx: `<field>: <what is wrong>`, the field being the JSON path of the bad value."""

    error: str


# The bodies of /healthz and /readyz, for the OpenAPI document: api/app.py's handlers send them as dicts,
# and tests/api/test_openapi.py fails on any key they send that is not described here.
class HealthBody(msgspec.Struct, frozen=True):
    """`GET /healthz`: the process is up."""

    status: Literal["ok"]


class ReadyBody(msgspec.Struct, frozen=True):
    """`GET /readyz`: 200 once at least `--min-live-pods` pods are live and no reachable pod is in its
    first sync; else 503, with why in `error`."""

    ready: bool
    live_pods: int
    error: str | msgspec.UnsetType = msgspec.UNSET


class HistogramBucket(msgspec.Struct, frozen=True):
    le: float | None  # upper bound; None is +Inf
    count: int  # observations <= le (cumulative, as Prometheus)


class HistogramSummary(msgspec.Struct, frozen=True):
    """A request-path histogram as the app's registry holds it (the numbers /metrics exposes)."""

    count: int
    sum: float
    buckets: list[HistogramBucket]  # ascending, the +Inf bucket last


class StatusTotals(msgspec.Struct, frozen=True):
    streams: int
    states: dict[str, int]  # every state, 0 included
    blocks: int
    events_total: int
    gaps_total: int
    replays_total: int
    hash_mismatches_total: int
    restarts_total: int
    dropped_total: int  # events or messages dropped, every reason (kvindex_events_dropped_total)


class StatusResponse(msgspec.Struct, frozen=True):
    """`GET /v1/status`, what the status page polls: the pods as /v1/pods, totals, score histograms."""

    pods: list[PodStatus]
    totals: StatusTotals
    score_latency_seconds: HistogramSummary
    score_matched_blocks: HistogramSummary


SCORE_REQUEST_DECODER = msgspec.json.Decoder(ScoreRequest)
JSON_ENCODER = msgspec.json.Encoder()

_PATH_SUFFIX = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
# The fields an object at a path may carry (list indices dropped from the path).
_FIELDS_AT = {
    "": tuple(msgspec.structs.fields(ScoreRequest)),
    "mm": tuple(msgspec.structs.fields(ScoreRequestMMItem)),
}
# What routers send instead of token ids, and what to send instead.
_TEXT_HINT = "text is not accepted; send token_ids (tokenize with the model's tokenizer) or block_hashes"
_INSTEAD = {
    "prompt": _TEXT_HINT,
    "messages": _TEXT_HINT,
    "input_ids": "unknown field; did you mean token_ids?",
}


def decode_score_request(body: bytes) -> ScoreRequest:
    """Decode a request body; malformed JSON or a wrong type raises RequestError naming the field.

    With the compiled reader, plain token ids come back as an array('I') and plain block hashes as an
    array('Q'), read straight from the JSON (the rest of the body is decoded with them replaced by null);
    every other body, and every failure, is decode_score_request_exact's (the same values or error).
    """
    split = split_ids(body)
    if split is not None:
        request = decode_with_ids(*split)
        if request is not None:
            return request
    return decode_score_request_exact(body)


def split_ids(body: bytes) -> tuple[str, array[int], bytes] | None:
    """With the compiled reader, a body's plain id array: (its key, the ids as array('I') or array('Q'),
    the body with the array replaced by null); None for any other body, or without the reader."""
    find = id_arrays.find_ids
    found = None if find is None else find(body)
    if found is None:
        return None
    key, packed, start, stop = found
    ids = array(id_arrays.TYPECODES[key])
    ids.frombytes(packed)
    return key, ids, body[:start] + b"null" + body[stop:]


def decode_with_ids(key: str, ids: array[int], rest: bytes) -> ScoreRequest | None:
    """The request `split_ids` took apart; None if `rest` does not decode (decode_score_request_exact of
    the whole body then gives the error, naming the field)."""
    try:
        template = SCORE_REQUEST_DECODER.decode(rest)
    except msgspec.DecodeError:  # ValidationError included
        return None
    return msgspec.structs.replace(template, **{key: ids})


def decode_score_request_exact(body: bytes) -> ScoreRequest:
    """decode_score_request by msgspec alone (token ids as a list): the reference, and the fallback."""
    try:
        return SCORE_REQUEST_DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise RequestError("body", f"not valid JSON ({exc})") from None


def _validation_error(message: str) -> RequestError:
    """msgspec's "Expected `int`, got `str` - at `$.token_ids[3]`" -> field "token_ids[3]"."""
    match = _PATH_SUFFIX.search(message)
    problem, path = (message[: match.start()], match.group("path")) if match else (message, "")
    unknown = _UNKNOWN_FIELD.match(problem)
    if unknown is not None:
        return _unknown_field_error(path, unknown.group("name"))
    return RequestError(path or "body", _lower_first(problem))


def _unknown_field_error(path: str, name: str) -> RequestError:
    """`{"prompt": ...}` -> "prompt: text is not accepted; ..."; `token_id` -> "did you mean token_ids?"."""
    shown = name if len(name) <= 64 else name[:61] + "..."  # the key is the client's: bound the echo
    field = f"{path}.{shown}" if path else shown
    if not path and name in _INSTEAD:
        return RequestError(field, _INSTEAD[name])
    known = [f.encode_name for f in _FIELDS_AT.get(re.sub(r"\[\d+\]", "", path), ())]
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return RequestError(field, f"unknown field; did you mean {close[0]}?")
    return RequestError(field, f"unknown field (known: {', '.join(known)})" if known else "unknown field")


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def validate_score_request(request: ScoreRequest, *, max_tokens: int) -> None:
    """Checks beyond the types. Raises RequestError for the first problem found.

    - exactly one of token_ids / block_hashes, non-empty, at most `max_tokens` tokens (block hashes:
      at most `max_tokens` too, a generous bound since each stands for a whole block);
    - block hashes below 2**64;
    - lora_name, lora_path, cache_salt and mm only with token_ids (block hashes are already hashed);
      lora_path needs lora_name; mm items lie inside the prompt, in prompt order without overlap, with
      a non-empty identifier;
    - pods, when given, is non-empty.
    """
    has_tokens = request.token_ids is not None
    has_hashes = request.block_hashes is not None
    if has_tokens == has_hashes:
        which = "both" if has_tokens else "neither"
        raise RequestError("token_ids", f"give exactly one of token_ids or block_hashes (got {which})")
    validate_ids(request, max_tokens=max_tokens)
    if request.block_hashes is not None:
        # One C pass; the index only on failure. An array('Q') (the compiled reader's) holds nothing larger.
        if type(request.block_hashes) is not array and max(request.block_hashes) > MAX_BLOCK_HASH:
            i = next(i for i, block_hash in enumerate(request.block_hashes) if block_hash > MAX_BLOCK_HASH)
            raise RequestError(f"block_hashes[{i}]", "expected an unsigned 64-bit int (< 2**64)")
        for name in ("lora_name", "lora_path", "cache_salt", "mm"):
            if getattr(request, name) is not None:
                raise RequestError(name, "only applies with token_ids (block_hashes are already hashed)")
    if request.lora_path is not None and request.lora_name is None:
        raise RequestError("lora_path", "needs lora_name as well (vLLM hashes both)")
    if request.lora_name is not None and not request.lora_name:
        raise RequestError("lora_name", "must not be empty")
    if request.mm is not None and request.token_ids is not None:
        _check_mm(request.mm, len(request.token_ids))
    if request.pods is not None and not request.pods:
        raise RequestError("pods", "empty list (omit it to score every pod)")
    if request.states is not None:
        if not request.states:
            raise RequestError("states", "empty list (omit it for every state but long-disconnected pods)")
        for i, state in enumerate(request.states):
            if state not in ALL_STATES:
                raise RequestError(f"states[{i}]", f"unknown state {state!r}; one of {', '.join(ALL_STATES)}")


def validate_ids(request: ScoreRequest, *, max_tokens: int) -> None:
    """The checks of validate_score_request that depend on how many ids there are (not on `mm`'s): what
    is left to check of a request whose options passed it with other ids of the same key, as an
    array('I') or array('Q') (every id in range)."""
    if request.token_ids is not None:
        _check_length("token_ids", len(request.token_ids), max_tokens)
    if request.block_hashes is not None:
        _check_length("block_hashes", len(request.block_hashes), max_tokens)


def _check_length(field: str, length: int, max_length: int) -> None:
    if length == 0:
        raise RequestError(field, "empty prompt")
    if length > max_length:
        raise RequestError(field, f"{length} items is more than the limit of {max_length}")


def _check_mm(items: list[ScoreRequestMMItem], num_tokens: int) -> None:
    previous_end = 0
    for i, item in enumerate(items):
        field = f"mm[{i}]"
        if not item.identifier:
            raise RequestError(f"{field}.identifier", "must not be empty")
        if item.offset < 0:
            raise RequestError(f"{field}.offset", "must be >= 0")
        if item.length < 1:
            raise RequestError(f"{field}.length", "must be >= 1")
        if item.offset + item.length > num_tokens:
            raise RequestError(
                field, f"offset {item.offset} + length {item.length} runs past the {num_tokens}-token prompt"
            )
        # vLLM's placeholders are disjoint and hashed in prompt order; anything else is a client bug.
        if i > 0 and item.offset < previous_end:
            raise RequestError(
                f"{field}.offset",
                f"{item.offset} overlaps or precedes mm[{i - 1}], which ends at {previous_end}; "
                "give items in prompt order without overlap",
            )
        previous_end = item.offset + item.length
