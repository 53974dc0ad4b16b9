"""kvindex_score_prompt_blocks_total from a running server's GET /metrics, for the tests of the score
path's early stop (tests/api) and of serve on a shared store (tests/cli)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def prompt_block_counts(base_url: str) -> dict[str, float]:
    """kvindex_score_prompt_blocks_total by its `hashed` label ("true" / "false"; absent until counted)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        sample.labels["hashed"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvindex_score_prompt_blocks_total"
    }
