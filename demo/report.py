"""What `kvindex demo` shows: a progress line per policy while it runs, then one table.

Results are plain values (`PolicyResult`) the demo's shell fills in from what the engines answered
(cached tokens) and what the indexer counted (events applied); this module only formats them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TextIO


@dataclass
class PolicyResult:
    """One policy's run over the trace, measured by the engines (tokens) and the indexer (events)."""

    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    events_indexed: int = 0
    # kv-aware only: client-side round trip of each POST /v1/score, in ms.
    score_latencies_ms: list[float] = field(default_factory=list)
    # kv-aware only: scores taken before the indexer had applied every batch the engines published.
    stale_scores: int = 0
    requests_per_pod: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Cached tokens / prompt tokens (0 when nothing was sent)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engines had to compute."""
        return self.prompt_tokens - self.cached_tokens

    def score_latency_ms(self, quantile: float) -> float | None:
        return percentile(self.score_latencies_ms, quantile)

    def to_json(self) -> dict[str, object]:
        data = asdict(self)
        del data["score_latencies_ms"]
        p50 = self.score_latency_ms(0.50)
        p99 = self.score_latency_ms(0.99)
        data.update(
            hit_rate=round(self.hit_rate, 6),
            prefill_tokens=self.prefill_tokens,
            score_p50_ms=None if p50 is None else round(p50, 3),
            score_p99_ms=None if p99 is None else round(p99, 3),
            elapsed_s=round(self.elapsed_s, 3),
        )
        return data


def percentile(values: Sequence[float], quantile: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(quantile * len(ordered)))
    return ordered[rank - 1]


_HEADERS = ("policy", "requests", "hit rate", "prefill tokens", "score p50", "score p99", "events indexed")


def format_table(results: Sequence[PolicyResult]) -> str:
    """One row per policy, columns aligned; score latencies are "-" for policies that never scored."""
    rows = [_HEADERS]
    for result in results:
        p50 = result.score_latency_ms(0.50)
        p99 = result.score_latency_ms(0.99)
        rows.append(
            (
                result.policy,
                str(result.requests),
                f"{100.0 * result.hit_rate:.1f}%",
                f"{result.prefill_tokens:,}",
                "-" if p50 is None else f"{p50:.2f} ms",
                "-" if p99 is None else f"{p99:.2f} ms",
                f"{result.events_indexed:,}",
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(_HEADERS))]
    lines = []
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


class ProgressLine:
    """A line per policy: rewritten in place on a terminal, a few plain lines otherwise (logs, CI)."""

    def __init__(self, stream: TextIO, policy: str, total: int) -> None:
        self._stream = stream
        self._policy = policy
        self._total = total
        self._tty = stream.isatty()
        self._next_plain_step = 0.25  # plain output: one line per quarter of the run

    def _text(self, done: int, result: PolicyResult) -> str:
        return (
            f"{self._policy:<12} {done:>6}/{self._total} requests  "
            f"hit rate {100.0 * result.hit_rate:5.1f}%  events indexed {result.events_indexed:,}"
        )

    def update(self, done: int, result: PolicyResult) -> None:
        if self._tty:
            self._stream.write("\r" + self._text(done, result) + "\x1b[K")
            self._stream.flush()
        elif self._total and done / self._total >= self._next_plain_step and done < self._total:
            self._stream.write(self._text(done, result) + "\n")
            self._stream.flush()
            while done / self._total >= self._next_plain_step:
                self._next_plain_step += 0.25

    def finish(self, done: int, result: PolicyResult) -> None:
        prefix = "\r" if self._tty else ""
        suffix = "\x1b[K" if self._tty else ""
        self._stream.write(
            prefix + self._text(done, result) + f"  ({result.elapsed_s:.1f} s)" + suffix + "\n"
        )
        self._stream.flush()
