"""The write-path fuzzer (benchmarks/fuzz.py, benchmarks/fuzz_frames.py): its frames are seeded and cover
every mutation, its wire rules agree with kvindex's own parsers, and a short run in each mode passes every
check (no exception escapes, the good pods' entries are exact, every bad frame is counted by reason)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvindex.indexer.decode import DecodeError, decode_batch
from kvindex.indexer.ingest.intake import parse_topic
from kvindex.replay.frames import END_SEQ_BYTES, FrameError, encode_seq, parse_live, parse_replay

from benchmarks.fuzz import PORT_TEMPLATE, drop_mismatches, main, run_mode
from benchmarks.fuzz_frames import (
    MODEL_NAMES,
    PAYLOAD_KINDS,
    Corpus,
    Fuzzer,
    Message,
    expected_intake_drop,
    expected_replay_drop,
    load_corpus,
    replayable_pod_id,
    topic_parts,
)

CORPUS = load_corpus()
GOOD_POD = "4242"
NUM_MESSAGES = 20_000


def messages(mode: str, seed: int, n: int = NUM_MESSAGES, corpus: Corpus = CORPUS) -> list[Message]:
    fuzzer = Fuzzer(seed, corpus, mode, victims=[11, 12, 13, 14], good_pod_ids=[GOOD_POD])
    return [fuzzer.message() for _ in range(n)]


@pytest.fixture(scope="module")
def generated() -> dict[str, list[Message]]:
    return {mode: messages(mode, 5) for mode in ("bind", "connect")}


def test_the_frames_are_seeded(generated: dict[str, list[Message]]) -> None:
    assert messages("bind", 5, 2_000) == generated["bind"][:2_000]
    assert messages("bind", 6, 2_000) != generated["bind"][:2_000]


def test_every_mutation_is_generated_and_topics_only_in_bind_mode(
    generated: dict[str, list[Message]],
) -> None:
    kinds = {mode: Counter(k for m in msgs for k in (m.kind, *m.extra)) for mode, msgs in generated.items()}
    frame_kinds = {"frames_1", "frames_2", "frames_4", "frames_10", "frames_empty", "frames_1_empty"}
    seq_kinds = {f"seq_{how}" for how in ("len", "dup", "back", "jump", "zero", "max", "random")}
    topic_kinds = {
        "topic_empty",
        "topic_empty_pod",
        "topic_unknown_model",
        "topic_non_utf8",
        "topic_bit_flip",
    }
    for mode in ("bind", "connect"):
        assert set(PAYLOAD_KINDS) | frame_kinds | seq_kinds <= set(kinds[mode]), mode
    assert topic_kinds <= set(kinds["bind"])
    assert not any(kind.startswith("topic_") for kind in kinds["connect"])


def test_no_bind_topic_names_a_good_pod_or_a_pod_id_kvindex_would_dial(
    generated: dict[str, list[Message]],
) -> None:
    pods = {parts[0] for m in generated["bind"] if len(m.frames) == 3 and (parts := topic_parts(m.frames[0]))}
    assert len(pods) > 30  # odd ones too: non-UTF-8, 64 KB long, bit-flipped
    assert GOOD_POD not in pods
    assert all(replayable_pod_id(pod) for pod in pods)
    assert not replayable_pod_id("1e3") and not replayable_pod_id("h:5558") and replayable_pod_id("h1")


@pytest.mark.parametrize("mode", ["bind", "connect"])
def test_the_intake_rules_agree_with_kvindex_parsers(mode: str, generated: dict[str, list[Message]]) -> None:
    # The fuzzer's expected counts come from its own reading of the spec; kvindex must read frames alike.
    for message in generated[mode]:
        try:
            topic = parse_live(message.frames).topic
            got = None
        except FrameError as exc:
            got = exc.reason
        if got is None and mode == "bind":
            parsed = parse_topic(topic)
            got = "bad_topic" if parsed is None else None if parsed[1] in MODEL_NAMES else "unknown_model"
        assert got == expected_intake_drop(mode, message.frames, MODEL_NAMES), message


def test_the_replay_rules_agree_with_kvindex_parser() -> None:
    seq, payload = encode_seq(3), CORPUS.payloads[0]
    replies = [
        [b"", b"t", seq, payload],
        [b"t", seq, payload],
        [seq, payload],
        [b"", b"", END_SEQ_BYTES, b""],
        [b"x"],
        [b"", b"t", seq, payload, b"extra"],
        [b"not-empty", b"t", seq, payload],
        [b"", b"t", b"\x00\x01", payload],
        [b"", b"", END_SEQ_BYTES, b"payload after the end"],
    ]
    for frames in replies:
        try:
            parse_replay(frames)
            got = None
        except FrameError as exc:
            got = exc.reason
        assert got == expected_replay_drop(frames), frames


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32), st.booleans())
def test_mutated_payloads_raise_nothing_but_decode_error(seed: int, with_token_ids: bool) -> None:
    fuzzer = Fuzzer(seed, CORPUS, "connect")
    for _ in range(20):
        _, payload = fuzzer.payload()
        try:
            decode_batch(payload, with_token_ids=with_token_ids)
        except DecodeError:
            pass


# --- the harness: real ZMQ on 127.0.0.1, a spawned hostile process -------------------------------------


@pytest.mark.parametrize("mode", ["connect", "bind"])
def test_a_short_run_passes_every_check(mode: str) -> None:
    # Bind mode without --listen-replay here: with the port template, see the next test.
    result = run_mode(mode, 10_000, seed=3, bind_replay_template=None)
    assert result.failures == []
    assert result.exceptions == {} and result.threads_alive and result.good_exact
    assert result.frames_sent == 10_000 and result.seen == result.frames_sent + result.good_sent
    assert result.dropped["decode_not_msgpack"] > 0 and result.dropped["bad_frame_count"] > 0
    assert result.counters["events_applied"]["BlockStored"] > 0  # hostile pods' valid events are applied


KNOWN_BUG = "ValueError at endpoints.py:34 (offset_endpoint_port)"


def test_bind_mode_with_a_port_replay_template() -> None:
    result = run_mode("bind", 5_000, seed=4, bind_replay_template=PORT_TEMPLATE)
    assert result.threads_alive and result.good_exact
    assert [f for f in result.failures if not f.startswith("exceptions reached a catch-all")] == []
    assert set(result.exceptions) <= {KNOWN_BUG}
    if result.exceptions:
        # worker._bind_stream lets offset_endpoint_port's ValueError out for a non-numeric pod id at dp
        # rank > 0 (tests/indexer/ingest/test_bind_hostile.py); the frame's drops are counted, its
        # stream never made.
        pytest.xfail(f"{result.exceptions[KNOWN_BUG]} x {KNOWN_BUG}")


def test_the_command_prints_its_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--frames", "2000", "--mode", "bind", "--no-bind-replay"]) == 0
    out = capsys.readouterr().out
    for heading in ("hostile sent", "dropped by reason", "counter", "mutation", "all checks passed"):
        assert heading in out


def test_drop_counts_must_match_exactly_unless_a_queue_overflowed() -> None:
    expected = {"bad_seq": 3, "decode_not_msgpack": 5, "malformed_event": 7}
    assert drop_mismatches(dict(expected), expected) == []
    assert drop_mismatches({**expected, "bad_seq": 2}, expected) == [
        "dropped[bad_seq] = 2, the frames sent deserve 3"
    ]
    assert drop_mismatches({**expected, "bad_topic": 1}, expected) != []
    # Two messages dropped at a full queue (counted there): their payloads' reasons fall short.
    short = {**expected, "decode_not_msgpack": 4, "malformed_event": 2, "queue_full": 2}
    assert drop_mismatches(short, expected) == []
    assert drop_mismatches({**short, "decode_not_msgpack": 2}, expected) != []  # 3 batches short, 2 dropped
    assert drop_mismatches({**short, "malformed_event": 8}, expected) != []  # more than deserved: never
