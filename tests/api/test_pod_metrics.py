"""The per-pod families of GET /metrics: the directly written text is prometheus_client's own rendering of
the reference families, byte for byte, whatever the statuses hold (quotes, backslashes and newlines in
label values, absent ages and seqs, huge counters, lease owners)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kvindex.api.metrics import Collected, MetricsScraper
from kvindex.api.pod_metrics import pod_exposition, pod_families
from kvindex.indexer.ingest import IngestService, IngestSettings
from kvindex.indexer.model import ModelConfig, PodConfig
from kvindex.indexer.status import ALL_STATES, PodStatus
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

LABEL_TEXT = st.text(
    st.sampled_from(["a", "Z", "0", "-", '"', "\\", "\n", "{", "}", "=", ",", " ", "é", "🙂"])
)
COUNT = st.integers(0, 2**64)
STATUSES = st.lists(
    st.builds(
        PodStatus,
        pod=LABEL_TEXT,
        model=LABEL_TEXT,
        dp_rank=st.integers(0, 1023),
        endpoint=LABEL_TEXT,
        state=st.sampled_from([*ALL_STATES, "unheard-of"]),
        last_seq=st.none() | COUNT,
        last_event_age_s=st.none() | st.floats(0, 1e12, allow_nan=False) | st.just(float("inf")),
        events_total=COUNT,
        gaps_total=COUNT,
        replays_total=COUNT,
        blocks=COUNT,
        hash_mismatches_total=COUNT,
        partial_view=st.booleans(),
        restarts_total=COUNT,
        owner=st.none() | LABEL_TEXT,
    ),
    max_size=6,
)


@given(statuses=STATUSES)
def test_the_written_text_is_generate_latest_of_the_reference_families(statuses: list[PodStatus]) -> None:
    assert pod_exposition(statuses).encode() == generate_latest(Collected(pod_families(statuses)))


def test_a_scrape_of_a_thousand_pods_parses_to_one_sample_set_per_stream() -> None:
    """The whole scrape parses, and holds each stream's families once (14 samples a stream)."""
    model = ModelConfig(name="m", block_size=16, hash_seed="0")
    pods = [PodConfig(f"pod-{i}", f"tcp://127.0.0.1:{20_000 + i}", "m") for i in range(1000)]
    service = IngestService([model], pods, settings=IngestSettings())
    try:
        text = MetricsScraper(service).scrape().decode()
    finally:
        service.stop()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    state = families["kvindex_pod_state"]
    assert len(state.samples) == 1000 * len(ALL_STATES)
    assert {s.labels["pod"] for s in state.samples if s.value == 1.0} == {f"pod-{i}" for i in range(1000)}
    assert len(families["kvindex_pod_info"].samples) == 1000
    assert len(families["kvindex_pod_events"].samples) == 1000
    assert families["kvindex_store_up"].samples[0].value == 1.0
