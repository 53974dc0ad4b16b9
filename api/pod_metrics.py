"""The per-stream metric families of `GET /metrics` (`kvindex_pod_*`): fourteen lines a stream.

At 1,000 streams that is ~14,000 samples and ~1 MB of text. Built as prometheus_client metric families and
formatted by its generate_latest, one scrape held the GIL for ~155 ms (the score path waits on it), so
`pod_exposition` writes the same text directly. `pod_families` is the reference it must equal, byte for
byte (tests/api/test_pod_metrics.py compares the two on generated statuses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvindex.indexer.status import ALL_STATES, PodStatus
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# How prometheus_client writes a sample's value (Go's float formatting); untyped upstream.
_go_float: Callable[[float], str] = floatToGoString

_STREAM_LABELS = ["pod", "dp_rank", "model"]


class _Family(NamedTuple):
    name: str
    help: str


INFO = _Family("kvindex_pod_info", "Always 1; labels name the stream and where it is read from.")
AGE = _Family(
    "kvindex_pod_last_event_age_seconds", "Seconds since the pod's last event (absent before its first)."
)
STATE = _Family("kvindex_pod_state", "Pod stream state, one-hot over the states.")
BLOCKS = _Family("kvindex_pod_blocks", "Blocks the index holds for the pod.")
LAST_SEQ = _Family("kvindex_pod_last_seq", "Last batch seq applied (absent before the first).")
PARTIAL = _Family(
    "kvindex_pod_partial_view", "1 if the stream joined after the engine's replay ring had moved past seq 0."
)
OWNER = _Family(
    "kvindex_pod_owner",
    "Always 1; `owner` is the replica holding the pod's ingest lease (replicas sharing a store only).",
)
# PodStatus field -> its counter family (exported as <name>_total).
COUNTERS = {
    "events_total": _Family("kvindex_pod_events", "Events applied, per stream."),
    "gaps_total": _Family("kvindex_pod_gaps", "Sequence gaps, per stream."),
    "replays_total": _Family("kvindex_pod_replays", "Replay requests, per stream."),
    "hash_mismatches_total": _Family("kvindex_pod_hash_mismatches", "Sampled hash mismatches, per stream."),
    "restarts_total": _Family("kvindex_pod_restarts", "Engine restarts detected, per stream."),
}


def pod_families(statuses: Sequence[PodStatus]) -> list[Metric]:
    """Per (pod, dp rank) stream: info, state one-hot, blocks, last seq, event age, per-stream counters."""
    info = GaugeMetricFamily(*INFO, labels=[*_STREAM_LABELS, "endpoint"])
    age = GaugeMetricFamily(*AGE, labels=_STREAM_LABELS)
    state = GaugeMetricFamily(*STATE, labels=[*_STREAM_LABELS, "state"])
    blocks = GaugeMetricFamily(*BLOCKS, labels=_STREAM_LABELS)
    last_seq = GaugeMetricFamily(*LAST_SEQ, labels=_STREAM_LABELS)
    partial = GaugeMetricFamily(*PARTIAL, labels=_STREAM_LABELS)
    owner = GaugeMetricFamily(*OWNER, labels=[*_STREAM_LABELS, "owner"])
    per_stream = {
        field: CounterMetricFamily(*family, labels=_STREAM_LABELS) for field, family in COUNTERS.items()
    }
    for status in statuses:
        stream = [status.pod, str(status.dp_rank), status.model]
        info.add_metric([*stream, status.endpoint], 1.0)
        if status.owner is not None:
            owner.add_metric([*stream, status.owner], 1.0)
        if status.last_event_age_s is not None:
            age.add_metric(stream, status.last_event_age_s)
        if status.last_seq is not None:
            last_seq.add_metric(stream, status.last_seq)
        blocks.add_metric(stream, status.blocks)
        partial.add_metric(stream, 1.0 if status.partial_view else 0.0)
        for name in ALL_STATES:
            state.add_metric([*stream, name], 1.0 if status.state == name else 0.0)
        for field_name, family in per_stream.items():
            family.add_metric(stream, getattr(status, field_name))
    return [info, age, state, blocks, last_seq, partial, owner, *per_stream.values()]


def _escape(value: str) -> str:
    """A label value as the text format quotes it (prometheus_client's escaping of label values)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _text(name: str, help_text: str, kind: str, samples: list[str]) -> str:
    """One family: its HELP and TYPE lines, then `name` + each sample's `{labels} value` line."""
    help_line = help_text.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {help_line}\n# TYPE {name} {kind}\n" + "".join(name + sample for sample in samples)


def pod_exposition(statuses: Sequence[PodStatus]) -> str:
    """generate_latest's text of `pod_families(statuses)`, written directly (a whole scrape of 1,000 pods: 15 ms, was 161).

    Labels are in name order, as generate_latest sorts them: dp_rank, endpoint, model, owner, pod, state.
    """
    go = _go_float
    info: list[str] = []
    age: list[str] = []
    state: list[str] = []
    blocks: list[str] = []
    last_seq: list[str] = []
    partial: list[str] = []
    owner: list[str] = []
    counters: dict[str, list[str]] = {field: [] for field in COUNTERS}
    for status in statuses:
        rank = f'{{dp_rank="{status.dp_rank}"'
        model = f'model="{_escape(status.model)}"'
        pod = f'pod="{_escape(status.pod)}"'
        labels = f"{rank},{model},{pod}}}"
        info.append(f'{rank},endpoint="{_escape(status.endpoint)}",{model},{pod}}} 1.0\n')
        if status.owner is not None:
            owner.append(f'{rank},{model},owner="{_escape(status.owner)}",{pod}}} 1.0\n')
        if status.last_event_age_s is not None:
            age.append(f"{labels} {go(status.last_event_age_s)}\n")
        if status.last_seq is not None:
            last_seq.append(f"{labels} {go(status.last_seq)}\n")
        blocks.append(f"{labels} {go(status.blocks)}\n")
        partial.append(f"{labels} {'1.0' if status.partial_view else '0.0'}\n")
        one_hot = f"{rank},{model},{pod},state="
        for name in ALL_STATES:
            state.append(f'{one_hot}"{name}"}} {"1.0" if status.state == name else "0.0"}\n')
        for field_name, samples in counters.items():
            samples.append(f"{labels} {go(getattr(status, field_name))}\n")
    parts = [
        _text(*INFO, "gauge", info),
        _text(*AGE, "gauge", age),
        _text(*STATE, "gauge", state),
        _text(*BLOCKS, "gauge", blocks),
        _text(*LAST_SEQ, "gauge", last_seq),
        _text(*PARTIAL, "gauge", partial),
        _text(*OWNER, "gauge", owner),
    ]
    for field_name, family in COUNTERS.items():
        parts.append(_text(f"{family.name}_total", family.help, "counter", counters[field_name]))
    return "".join(parts)
