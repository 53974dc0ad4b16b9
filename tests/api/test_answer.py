"""The compiled answer writer (api/_answer.c) against the definition: score_holders + with_health + msgspec.

The writer may decline any answer (the definition then runs), but what it writes must be byte for byte
what msgspec writes for the definition's entries, with the same best match. Indexes are real KVIndex
states built from random stores and removals; healths and policies are drawn the way a fleet produces
them (ages to the millisecond) and the way it should not (ages with 17 digits or an exponent, pod ids
and tiers JSON must escape)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence

import msgspec
import pytest
from answer_paths import COMPILED
from extensions import require_built
from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.api import answer
from kvindex.api.answer import (
    AnswerPolicy,
    EncodeScores,
    HealthsOf,
    answer_scores,
    encode_arguments,
    encode_entries,
    scores_json,
)
from kvindex.api.schemas import JSON_ENCODER, CompactScoreResponse, EncodedScoreResponse, ScoreResponse
from kvindex.indexer.events import BlocksRemoved, BlocksStored, PodRef
from kvindex.indexer.index import HolderIds, KVIndex
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.status import HealthReader, PodHealth

PROMPT = list(range(1, 13))
OTHER_PROMPT = list(range(101, 109))
REPORT_TIERS = ("GPU", "CPU")
STATES = ["live", "silent", "replaying", "resyncing", "hash_mismatch", "disconnected"]


def built() -> EncodeScores:
    return require_built(COMPILED, "kvindex.api._answer", "a C compiler")


def health_table(healths: dict[PodRef, PodHealth | None]):  # type: ignore[no-untyped-def]
    def healths_of(refs: Sequence[PodRef]) -> list[PodHealth | None]:
        return [healths.get(ref) for ref in refs]

    return healths_of


def writer_arguments(
    index: KVIndex,
    holder_ids: list[HolderIds],
    healths: list[PodHealth | None] | HealthReader | None,
    policy: AnswerPolicy,
) -> list[object]:
    """encode_scores' arguments, in order; healths None: every first-block pod's is None."""
    first_entries = [index.entry(entry_id) for entry_id in holder_ids[0]]
    given = [None] * len(first_entries) if healths is None else healths
    return list(encode_arguments(index, holder_ids, first_entries, given, policy))


def first_refs(index: KVIndex, holder_ids: list[HolderIds]) -> list[PodRef]:
    return [index.entry(entry_id)[0] for entry_id in holder_ids[0]]


def compiled_arguments(
    index: KVIndex, holder_ids: list[HolderIds], healths: dict[PodRef, PodHealth | None], policy: AnswerPolicy
) -> list[object]:
    given = health_table(healths)(first_refs(index, holder_ids))
    return writer_arguments(index, holder_ids, given, policy)


def compiled_answer(
    index: KVIndex, holder_ids: list[HolderIds], healths: dict[PodRef, PodHealth | None], policy: AnswerPolicy
) -> tuple[bytes, int] | None:
    return built()(*compiled_arguments(index, holder_ids, healths, policy))  # type: ignore[arg-type]


def definition(
    index: KVIndex, holder_ids: list[HolderIds], healths: dict[PodRef, PodHealth | None], policy: AnswerPolicy
) -> tuple[bytes, int]:
    entries = answer_scores(index, holder_ids, health_table(healths), policy)
    return encode_entries(entries, compact=policy.compact), entries[0].matched_blocks if entries else 0


def store(index: KVIndex, ref: PodRef, keys: Sequence[int], tier: str = "GPU") -> None:
    event = BlocksStored(block_keys=tuple(keys), parent_key=None, token_ids=(), block_size=16, tier=tier)
    index.apply(ref, [event])


def policy_of(**fields: object) -> AnswerPolicy:
    base: dict[str, object] = {
        "block_size": 16,
        "tier_weights": {"GPU": 1.0, "CPU": 0.8},
        "unknown_tier_weight": 0.1,
        "report_tiers": REPORT_TIERS,
        "grace_s": 30.0,
    }
    return AnswerPolicy(**(base | fields))  # type: ignore[arg-type]


# -- drawn fleets --------------------------------------------------------------------------------------

PLAIN_POD_IDS = st.sampled_from(["pod-a", "pod-b", "pod-c", "pod-10", "pod-2", "pod-\u00e9"])
POD_IDS = st.one_of(*[PLAIN_POD_IDS] * 6, st.sampled_from(['pod-"q"', "a\\b"]))
TIERS = st.sampled_from(["GPU"] * 6 + ["CPU"] * 3 + ["STORAGE", "ssd\n1"])
AGES = st.one_of(
    st.none(),
    st.integers(0, 10**7).map(lambda ms: ms / 1000.0),  # what the service reports
    st.integers(0, 10**7).map(lambda ms: ms / 1000.0),
    st.floats(0.0, 1e7, allow_nan=False),
    st.sampled_from([1e-5, 2.5e-7, 1e16, 0.1 + 0.2, -0.0]),
)
HEALTHS = st.one_of(
    st.none(),
    st.builds(
        PodHealth,
        state=st.sampled_from(STATES),
        last_event_age_s=AGES,
        disconnected_for_s=st.one_of(st.none(), st.floats(0.0, 120.0, allow_nan=False)),
    ),
)
POLICIES = st.builds(
    AnswerPolicy,
    block_size=st.sampled_from([1, 16, 256]),
    tier_weights=st.one_of(
        st.just({"GPU": 1.0, "CPU": 0.8}),
        st.fixed_dictionaries(
            {"GPU": st.sampled_from([1.0, 2.0, 1 / 3]), "CPU": st.sampled_from([0.8, 1.0, 1 / 3, 0.0])}
        ),
    ),
    unknown_tier_weight=st.sampled_from([0.1, 0.0, 1.0, 1e-20]),
    report_tiers=st.sampled_from([REPORT_TIERS, (), ("CPU",), ("STORAGE", "GPU")]),
    grace_s=st.sampled_from([0.0, 1.0, 30.0]),
    states=st.one_of(st.none(), st.frozensets(st.sampled_from(STATES), max_size=4)),
    by_score=st.booleans(),
    compact=st.booleans(),
)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[KVIndex, dict[PodRef, PodHealth | None]]:
    index = KVIndex()
    refs = draw(
        st.lists(
            st.builds(PodRef, pod_id=POD_IDS, dp_rank=st.integers(0, 2)), min_size=1, max_size=8, unique=True
        )
    )
    home_tier = {ref: draw(TIERS) for ref in refs}  # most pods keep to one tier, as most engines do
    for _ in range(draw(st.integers(1, 14))):
        ref = draw(st.sampled_from(refs))
        tier = draw(st.one_of(st.just(home_tier[ref]), st.just(home_tier[ref]), TIERS))
        keys = draw(st.sampled_from([PROMPT, OTHER_PROMPT]))
        start = draw(st.one_of(st.just(0), st.integers(0, len(keys) - 1)))  # most runs start at block 0
        stop = draw(st.integers(start + 1, len(keys)))
        if draw(st.integers(0, 5)) == 0:
            index.apply(ref, [BlocksRemoved(block_keys=tuple(keys[start:stop]), tier=tier)])
        else:
            store(index, ref, keys[start:stop], tier)
    healths = {ref: draw(HEALTHS) for ref in refs}
    return index, healths


@settings(max_examples=600, deadline=None)
@given(fleet=fleets(), policy=POLICIES, pods=st.one_of(st.none(), st.none(), st.lists(POD_IDS, max_size=3)))
def test_the_writer_writes_what_the_definition_encodes(
    fleet: tuple[KVIndex, dict[PodRef, PodHealth | None]], policy: AnswerPolicy, pods: list[str] | None
) -> None:
    index, healths = fleet
    holder_ids = index.lookup_ids(PROMPT, pods)
    want = definition(index, holder_ids, healths, policy)
    if holder_ids:
        written = compiled_answer(index, holder_ids, healths, policy)
        if written is not None:
            assert written == want
        # The first block's entries read by the writer itself: from the index's entry table in place, and
        # through any other callable.
        for entry_of in (index.entry, lambda entry_id: index.entry(entry_id)):
            arguments = compiled_arguments(index, holder_ids, healths, policy)
            arguments[1:3] = [None, entry_of]
            assert built()(*arguments) == written  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answer, "encode_scores", built())
        assert scores_json(index, holder_ids, health_table(healths), policy) == want


@settings(max_examples=300, deadline=None)
@given(fleet=fleets(), policy=POLICIES)
def test_a_compact_answer_is_the_full_answer_s_entries_in_brief(
    fleet: tuple[KVIndex, dict[PodRef, PodHealth | None]], policy: AnswerPolicy
) -> None:
    """Whichever writer answers: the same entries, in the same order, as [pod, dp_rank, matched_blocks,
    score], and the same best match."""
    index, healths = fleet
    holder_ids = index.lookup_ids(PROMPT)
    for encode in (built(), None):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(answer, "encode_scores", encode)
            full, best = scores_json(
                index, holder_ids, health_table(healths), policy_of_fields(policy, False)
            )
            brief, brief_best = scores_json(
                index, holder_ids, health_table(healths), policy_of_fields(policy, True)
            )
        entries = msgspec.json.decode(full)
        assert msgspec.json.decode(brief) == [
            [entry["pod"], entry["dp_rank"], entry["matched_blocks"], entry["score"]] for entry in entries
        ]
        assert brief_best == best


def policy_of_fields(policy: AnswerPolicy, compact: bool) -> AnswerPolicy:
    return msgspec.structs.replace(policy, compact=compact)


def fleet_of_one_tier_per_pod() -> tuple[KVIndex, dict[PodRef, PodHealth | None]]:
    """Ten pods on one tier each, runs 1..12 blocks, some CPU; every kind of health."""
    index = KVIndex()
    healths: dict[PodRef, PodHealth | None] = {}
    for number in range(10):
        ref = PodRef(f"pod-{number}", number % 2)
        store(index, ref, PROMPT[: 12 - number], "CPU" if number % 3 == 0 else "GPU")
        state = STATES[number % len(STATES)]
        healths[ref] = (
            None
            if number == 4
            else PodHealth(state, number * 1.125, 40.0 if state == "disconnected" else None)
        )
    return index, healths


@pytest.mark.parametrize(
    "policy",
    [
        policy_of(),
        policy_of(by_score=False),
        policy_of(states=frozenset({"live", "disconnected"})),
        policy_of(tier_weights={"GPU": 1 / 3, "CPU": 0.8}, report_tiers=()),
        policy_of(compact=True),
        policy_of(compact=True, by_score=False, tier_weights={"GPU": 1 / 3, "CPU": 0.8}),
    ],
    ids=["default", "trust", "states", "thirds", "compact", "compact-trust-thirds"],
)
def test_the_common_shape_is_written_not_declined(policy: AnswerPolicy) -> None:
    index, healths = fleet_of_one_tier_per_pod()
    holder_ids = index.lookup_ids(PROMPT)
    written = compiled_answer(index, holder_ids, healths, policy)
    assert written is not None
    assert written == definition(index, holder_ids, healths, policy)
    assert len(msgspec.json.decode(written[0])) > 3


def test_a_pod_whose_other_tier_carries_its_run_on_is_left_to_the_definition() -> None:
    """pod-b holds blocks 0-9 on GPU and 8-11 on CPU: its match is 12 blocks, which only the Python scorer
    (per pod over every tier) computes."""
    index = KVIndex()
    store(index, PodRef("pod-a"), PROMPT[:10])
    store(index, PodRef("pod-b"), PROMPT[:10])
    store(index, PodRef("pod-b"), PROMPT[8:], "CPU")
    holder_ids = index.lookup_ids(PROMPT)
    assert compiled_answer(index, holder_ids, {}, policy_of()) is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answer, "encode_scores", built())
        scores, best = scores_json(index, holder_ids, health_table({}), policy_of())
    assert best == 12
    assert [entry["pod"] for entry in msgspec.json.decode(scores)] == ["pod-b", "pod-a"]


def test_an_answer_the_scorer_sums_per_run_is_left_to_the_definition() -> None:
    """pod-c, on two tiers though in none of block 0's holders, sends score_prefix down its per-pod path,
    which sums weight x run per run of holders: pod-a's 1/3 x (1 + 3 + 1 + 1) is 1.9999999999999998, not
    1/3 x 6 = 2.0. The writer must not answer with the other rounding."""
    index = KVIndex()
    store(index, PodRef("pod-a"), PROMPT[:6])
    store(index, PodRef("pod-c"), PROMPT[1:4])
    store(index, PodRef("pod-c"), PROMPT[4:5], "CPU")
    policy = policy_of(block_size=1, tier_weights={"GPU": 1 / 3, "CPU": 0.8})
    holder_ids = index.lookup_ids(PROMPT)
    assert compiled_answer(index, holder_ids, {}, policy) is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(answer, "encode_scores", built())
        scores, _ = scores_json(index, holder_ids, health_table({}), policy)
    assert (
        b'"pod":"pod-a","dp_rank":0,"matched_blocks":6,"matched_tokens":6,"score":1.9999999999999998'
        in scores
    )


@pytest.mark.parametrize(
    ("pod_id", "age"),
    [('pod-"q"', 1.0), ("a\\b", 1.0), ("tab\there", 1.0), ("pod-a", 1e-05), ("pod-a", 1e16)],
)
def test_what_msgspec_writes_its_own_way_is_declined(pod_id: str, age: float) -> None:
    index = KVIndex()
    ref = PodRef(pod_id)
    store(index, ref, PROMPT[:3])
    holder_ids = index.lookup_ids(PROMPT)
    healths: dict[PodRef, PodHealth | None] = {ref: PodHealth("live", age, None)}
    assert compiled_answer(index, holder_ids, healths, policy_of()) is None


def test_bad_arguments_are_declined_or_refused() -> None:
    index, healths = fleet_of_one_tier_per_pod()
    holder_ids = index.lookup_ids(PROMPT)
    given = health_table(healths)(first_refs(index, holder_ids))
    good = writer_arguments(index, holder_ids, given, policy_of(tier_weights={"GPU": 1.0}))
    assert built()(*good) is not None  # type: ignore[arg-type]
    for position, bad in [(0, tuple(holder_ids)), (1, good[1][:-1]), (3, []), (4, None), (6, 0)]:  # type: ignore[index]
        arguments = list(good)
        arguments[position] = bad
        assert built()(*arguments) is None, position  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        built()(*good[:-1])  # type: ignore[arg-type]


def test_entries_the_writer_reads_itself_fail_as_the_table_s_own_lookup_does() -> None:
    index, healths = fleet_of_one_tier_per_pod()
    holder_ids = index.lookup_ids(PROMPT)
    arguments = compiled_arguments(index, holder_ids, healths, policy_of())
    written = built()(*arguments)  # type: ignore[arg-type]
    assert written is not None
    table = [index.entry(entry_id) for entry_id in range(max(map(max, holder_ids)) + 1)]

    class Table(list):  # type: ignore[type-arg]
        """Not a list exactly: its __getitem__ is called, not read around."""

    for entry_of in (table.__getitem__, Table(table).__getitem__):
        arguments[1:3] = [None, entry_of]
        assert built()(*arguments) == written  # type: ignore[arg-type]
    short = table[: max(holder_ids[0])]  # the first block's last entry is past its end
    for entry_of in (short.__getitem__, Table(short).__getitem__):
        arguments[1:3] = [None, entry_of]
        with pytest.raises(IndexError):
            built()(*arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("unknown_pods", [msgspec.UNSET, [], ["pod-x", "pod-\u00e9"]])
def test_the_encoded_response_is_the_score_response(unknown_pods: list[str] | msgspec.UnsetType) -> None:
    index, healths = fleet_of_one_tier_per_pod()
    holder_ids = index.lookup_ids(PROMPT)
    entries = answer_scores(index, holder_ids, health_table(healths), policy_of())
    fields = {"model": "m", "block_size": 16, "num_blocks": len(PROMPT), "unknown_pods": unknown_pods}
    encoded = EncodedScoreResponse(scores=msgspec.Raw(JSON_ENCODER.encode(entries)), **fields)  # type: ignore[arg-type]
    assert JSON_ENCODER.encode(encoded) == JSON_ENCODER.encode(ScoreResponse(scores=entries, **fields))  # type: ignore[arg-type]
    brief = [(entry.pod_id, entry.dp_rank, entry.matched_blocks, entry.score) for entry in entries]
    encoded = EncodedScoreResponse(scores=msgspec.Raw(encode_entries(entries, compact=True)), **fields)  # type: ignore[arg-type]
    assert JSON_ENCODER.encode(encoded) == JSON_ENCODER.encode(CompactScoreResponse(scores=brief, **fields))  # type: ignore[arg-type]


# -- the writer reading the streams' health itself ---------------------------------------------------

READER_PODS = [PodRef(f"pod-{number}") for number in range(6)]


@pytest.fixture(scope="module")
def service() -> Iterator[IngestService]:
    """A real service (never started: no socket is opened) whose streams' fields a test sets."""
    pods = [
        PodConfig(pod_id=ref.pod_id, model="m", endpoint=f"tcp://127.0.0.1:{20000 + number}")
        for number, ref in enumerate(READER_PODS)
    ]
    ingest = IngestService([ModelConfig(name="m")], pods, settings=IngestSettings(silent_after_s=5.0))
    try:
        yield ingest
    finally:
        ingest.stop()


MOSTLY = st.sampled_from([True, True, True, False])  # most streams are live: the writer's own case
RARELY = st.sampled_from([False, False, False, True])
STREAM_STATES = st.fixed_dictionaries(
    {
        "connected": MOSTLY,
        "joined": MOSTLY,
        "resyncing": RARELY,
        "hash_mismatch": RARELY,
        "heard_s_ago": st.one_of(st.none(), st.floats(-0.01, 12.0, allow_nan=False)),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    stream_states=st.lists(STREAM_STATES, min_size=len(READER_PODS), max_size=len(READER_PODS)),
    runs=st.lists(st.integers(1, len(PROMPT)), min_size=len(READER_PODS), max_size=len(READER_PODS)),
    policy=POLICIES,
)
def test_health_read_from_the_streams_is_what_pod_healths_says(
    service: IngestService, stream_states: list[dict[str, object]], runs: list[int], policy: AnswerPolicy
) -> None:
    """The writer's own reading of each stream (its common live case, the service's pod_healths for the
    rest) writes the same bytes as the writer given pod_healths' answers at the same clock reading."""
    index = KVIndex()
    now = time.monotonic()
    for ref, fields, run in zip(READER_PODS, stream_states, runs, strict=True):
        stream = service._streams.get(ref)
        assert stream is not None
        stream.connected = bool(fields["connected"])
        stream.joined = bool(fields["joined"])
        stream.tracker.resyncing = bool(fields["resyncing"])
        stream.hash_mismatch = bool(fields["hash_mismatch"])
        heard = fields["heard_s_ago"]
        stream.last_event_at = None if heard is None else now - float(heard)  # type: ignore[arg-type]
        store(index, ref, PROMPT[:run])
    holder_ids = index.lookup_ids(PROMPT)
    reader = service.health_reader()
    given_healths = service.pod_healths(first_refs(index, holder_ids), now=reader.now)
    from_list = built()(*writer_arguments(index, holder_ids, given_healths, policy))  # type: ignore[arg-type]
    from_streams = built()(*writer_arguments(index, holder_ids, reader, policy))  # type: ignore[arg-type]
    assert from_streams == from_list
    healths_at_now = functools.partial(service.pod_healths, now=reader.now)
    assert from_streams is None or from_streams == definition_with(index, holder_ids, healths_at_now, policy)


def definition_with(
    index: KVIndex, holder_ids: list[HolderIds], healths_of: HealthsOf, policy: AnswerPolicy
) -> tuple[bytes, int]:
    entries = answer_scores(index, holder_ids, healths_of, policy)
    return encode_entries(entries, compact=policy.compact), entries[0].matched_blocks if entries else 0


def test_the_streams_a_replica_does_not_own_are_left_to_the_service(service: IngestService) -> None:
    """With replicas sharing a store, a stream this one does not own is never live by the writer's own
    reading: the service says what it is (here: what its `slow` answers)."""
    index = KVIndex()
    for ref in READER_PODS:
        stream = service._streams.get(ref)
        assert stream is not None
        stream.connected, stream.joined, stream.last_event_at = True, True, time.monotonic()
        stream.tracker.resyncing = stream.hash_mismatch = False
        stream.owned = ref != READER_PODS[0]
        store(index, ref, PROMPT[:4])
    asked: list[PodRef] = []

    def slow(ref: PodRef) -> PodHealth | None:
        asked.append(ref)
        return PodHealth("replaying", None, None)

    reader = service.health_reader()._replace(unowned_matter=True, slow=slow)
    holder_ids = index.lookup_ids(PROMPT)
    written = built()(*writer_arguments(index, holder_ids, reader, policy_of(by_score=False)))  # type: ignore[arg-type]
    assert written is not None
    states = {entry["pod"]: entry["state"] for entry in msgspec.json.decode(written[0])}
    assert asked == [READER_PODS[0]]
    assert states == {ref.pod_id: "replaying" if ref == READER_PODS[0] else "live" for ref in READER_PODS}
