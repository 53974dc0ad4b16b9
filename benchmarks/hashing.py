"""Block-hashing throughput: kvindex's BlockHasher against the vLLM formula, measured in the same run.

The baseline hashes exactly as vLLM does per block — `H(serialize((parent, tuple(tokens), None)))` with
pickle.dumps(protocol 5) or cbor2.dumps(canonical=True), then hashlib/xxhash — chained over full blocks.
Workloads (block size 16, token ids < 150001):
  cold  new, unrelated 8192-token prompts (nothing to reuse), ids uniform over the vocabulary;
  zipf  the same, ids Zipf-Mandelbrot distributed like real text (a few thousand ids cover most
        tokens), ranks mapped to ids by a fixed random permutation so small ids are not favoured;
  hot   conversations sharing a 4096-token system prompt, each growing by 256-token turns up to 8192
        tokens and re-scored every turn (what a router sees), interleaved round-robin.
A second table, bounded hashing: cold 8192-token prompts against an in-memory index holding each one's
first k blocks, hash + lookup per prompt, the whole prompt hashed against hashing stopped soon after the
first block no pod holds (api/score.prompt_holders), answers checked equal.
`python -m benchmarks.hashing [--quick]`.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import pickle
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash
from kvindex.api.score import prompt_holders
from kvindex.hashing import HASH_ALGOS, BlockHasher, HeldCheck
from kvindex.indexer.events import BlocksStored, PodRef
from kvindex.indexer.index import KVIndex

from benchmarks._table import format_table

BLOCK_SIZE = 16
VOCAB = 150_001
PROMPT_TOKENS = 8192
SEED = "0"


def vllm_formula(algo: str) -> Callable[[Sequence[int]], list[bytes]]:
    """The per-block hashing vLLM runs (hash_block_tokens over get_request_block_hasher's loop)."""
    serialize: Callable[[Any], bytes]
    if algo.endswith("_cbor"):

        def serialize(obj: Any) -> bytes:
            return cbor2.dumps(obj, canonical=True)
    else:

        def serialize(obj: Any) -> bytes:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    if algo.startswith("sha256"):

        def digest(data: bytes) -> bytes:
            return hashlib.sha256(data).digest()
    else:
        digest = xxhash.xxh3_128_digest
    root = digest(serialize(SEED))

    def block_hashes(token_ids: Sequence[int]) -> list[bytes]:
        hashes: list[bytes] = []
        parent = None
        for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = digest(serialize((parent or root, tuple(token_ids[start : start + BLOCK_SIZE]), None)))
            hashes.append(parent)
        return hashes

    return block_hashes


def as_decoded(token_ids: list[int]) -> list[int]:
    """The prompt as a router's request arrives: freshly decoded from JSON, sharing no int objects with
    earlier prompts (which would flatter any comparison-based cache)."""
    return json.loads(json.dumps(token_ids))  # type: ignore[no-any-return]


def cold_prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [as_decoded([rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]) for _ in range(count)]


def zipf_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Cold prompts whose ids follow P(rank r) ~ 1 / (r + 2.7) ** 1.1 over the vocabulary."""
    ids = list(range(VOCAB))
    rng.shuffle(ids)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 2.7) ** 1.1 for rank in range(VOCAB)))
    return [as_decoded(rng.choices(ids, cum_weights=cum_weights, k=PROMPT_TOKENS)) for _ in range(count)]


def hot_prompts(rng: random.Random, conversations: int, turn_tokens: int) -> list[list[int]]:
    """Every turn of `conversations` chats over one shared 4096-token system prompt, interleaved."""
    system = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS // 2)]
    chats = [list(system) for _ in range(conversations)]
    prompts: list[list[int]] = []
    while len(chats[0]) + turn_tokens <= PROMPT_TOKENS:
        for chat in chats:
            chat.extend(rng.randrange(VOCAB) for _ in range(turn_tokens))
            prompts.append(as_decoded(chat))
    return prompts


def measure(hash_prompt: Callable[[Sequence[int]], Any], prompts: list[list[int]]) -> float:
    """Blocks per second of this process's CPU time over all prompts (CPU time, not wall time: the
    benchmark shares its cores, and time spent descheduled belongs to neither side)."""
    blocks = sum(len(prompt) // BLOCK_SIZE for prompt in prompts)
    began = time.process_time()
    for prompt in prompts:
        hash_prompt(prompt)
    return blocks / (time.process_time() - began)


def compare(
    baseline: Callable[[Sequence[int]], list[bytes]], algo: str, prompts: list[list[int]], repeats: int
) -> tuple[float, float]:
    """Best blocks/s of the baseline and of a fresh BlockHasher (empty memo) over `prompts`, measured
    alternately so both see the same machine load."""
    base_rate = ours_rate = 0.0
    for _ in range(repeats):
        base_rate = max(base_rate, measure(baseline, prompts))
        ours_rate = max(ours_rate, measure(BlockHasher(algo, BLOCK_SIZE, SEED).block_hashes, prompts))
    return base_rate, ours_rate


def rates(
    workloads: dict[str, list[list[int]]], algos: Sequence[str], repeats: int
) -> list[tuple[str, str, float, float]]:
    """(algo, workload, vLLM's blocks/s, kvindex's blocks/s) of each algorithm on each workload (compare);
    SystemExit if the two hash any algorithm's first prompt differently."""
    measured: list[tuple[str, str, float, float]] = []
    for algo in algos:
        baseline = vllm_formula(algo)
        check = next(iter(workloads.values()))[0]
        if BlockHasher(algo, BLOCK_SIZE, SEED).block_hashes(check) != baseline(check):
            raise SystemExit(
                f"{algo}: kvindex and the vLLM formula disagree; fix hashing before benchmarking"
            )
        for workload, prompts in workloads.items():
            base_rate, ours_rate = compare(baseline, algo, prompts, repeats)
            measured.append((algo, workload, base_rate, ours_rate))
    return measured


def speedups(quick: bool) -> list[tuple[str, str, float, float]]:
    """rates of every algorithm on cold prompts and hot conversations: the hashing rows of
    `python -m benchmarks`."""
    cold_count, conversations, repeats = (2, 2, 1) if quick else (12, 4, 5)
    turn_tokens = 1024 if quick else 256
    rng = random.Random(20261130)
    workloads = {"cold": cold_prompts(rng, cold_count), "hot": hot_prompts(rng, conversations, turn_tokens)}
    return rates(workloads, ("sha256",) if quick else HASH_ALGOS, repeats)


BOUNDED_HEADERS = ["held blocks of 512", "whole µs/prompt", "stopped µs/prompt", "stopped/whole"]


def bounded_rows(quick: bool) -> list[list[object]]:
    """Per k held blocks of each 512-block prompt: CPU µs per prompt to hash (fresh memo) and look it
    up, whole against stopped early; best of alternating repeats."""
    rng = random.Random(20261203)
    prompts = cold_prompts(rng, 2 if quick else 12)
    num_blocks = PROMPT_TOKENS // BLOCK_SIZE
    rows: list[list[object]] = []
    for held_blocks in (0, 16, 256, num_blocks):
        index = KVIndex()
        for number, prompt in enumerate(prompts):
            keys = BlockHasher("sha256", BLOCK_SIZE, SEED).event_hashes(prompt)
            if held_blocks:
                stored = BlocksStored(tuple(keys[:held_blocks]), None, (), BLOCK_SIZE)
                index.apply(PodRef(f"pod-{number}"), [stored])

        def whole(prompts: list[list[int]] = prompts, index: KVIndex = index) -> list[Any]:
            hasher = BlockHasher("sha256", BLOCK_SIZE, SEED)
            return [index.lookup_ids(hasher.event_hashes(prompt)) for prompt in prompts]

        def stopped(prompts: list[list[int]] = prompts, index: KVIndex = index) -> list[Any]:
            hasher = BlockHasher("sha256", BLOCK_SIZE, SEED)
            answers = []
            for prompt in prompts:

                def hash_prompt(held: HeldCheck | None, prompt: list[int] = prompt) -> list[int]:
                    return hasher.event_hashes(prompt, held=held)

                answers.append(prompt_holders(index, hash_prompt, num_blocks, None)[0])
            return answers

        if whole() != stopped():
            raise SystemExit(f"{held_blocks} held blocks: the stopped answers differ from the whole prompt's")
        best = {whole: float("inf"), stopped: float("inf")}
        for _ in range(1 if quick else 7):
            for run in best:
                began = time.process_time()
                run()
                best[run] = min(best[run], time.process_time() - began)
        whole_us, stopped_us = (best[run] / len(prompts) * 1e6 for run in (whole, stopped))
        rows.append([held_blocks, round(whole_us), round(stopped_us), f"{stopped_us / whole_us:.2f}x"])
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hashing", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny run (smoke test), numbers meaningless")
    args = parser.parse_args(argv)
    cold_count, conversations, repeats = (2, 2, 1) if args.quick else (12, 4, 9)
    turn_tokens = 1024 if args.quick else 256
    rng = random.Random(20261130)
    workloads = {
        "cold": cold_prompts(rng, cold_count),
        "zipf": zipf_prompts(rng, cold_count),
        "hot": hot_prompts(rng, conversations, turn_tokens),
    }
    per_prompt = PROMPT_TOKENS // BLOCK_SIZE
    rows: list[list[object]] = [
        [
            algo,
            workload,
            round(base_rate),
            round(ours_rate),
            round(per_prompt / base_rate * 1e6),
            round(per_prompt / ours_rate * 1e6),
            f"{ours_rate / base_rate:.2f}x",
        ]
        for algo, workload, base_rate, ours_rate in rates(workloads, HASH_ALGOS, repeats)
    ]
    headers = [
        "algo",
        "workload",
        "vLLM blocks/s",
        "kvindex blocks/s",
        "vLLM µs/8k prompt",
        "kvindex µs/8k prompt",
        "speed-up",
    ]
    print(
        f"block size {BLOCK_SIZE}, {PROMPT_TOKENS}-token prompts{' (--quick: meaningless numbers)' if args.quick else ''}"
    )
    print(format_table(headers, rows))
    print()
    print("bounded hashing: sha256, 8192-token prompts, an index holding each one's first k blocks")
    print(format_table(BOUNDED_HEADERS, bounded_rows(args.quick)))


if __name__ == "__main__":
    main()
