"""The demo's request trace: what a chat fleet's routers see, generated up front from a seed.

Pure and deterministic (no clocks, sockets or global random state): `kvindex demo` replays the same
trace under every routing policy, so their prefix-cache hit rates are comparable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Llama-3's vocabulary has 128,256 ids; the low ids are special and byte tokens, rarely in prompts.
VOCAB_LOW = 1_000
VOCAB_HIGH = 128_000


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of the trace. Lengths are in tokens; ranges are inclusive (low, high)."""

    num_requests: int = 1200
    seed: int = 0
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (256, 768)
    max_active_conversations: int = 16
    turns_per_conversation: tuple[int, int] = (2, 8)
    user_turn_tokens: tuple[int, int] = (16, 128)
    assistant_turn_tokens: tuple[int, int] = (32, 192)
    # Share of requests that are one-off prompts sharing nothing (batch jobs, RAG with fresh context).
    unique_fraction: float = 0.15
    unique_prompt_tokens: tuple[int, int] = (128, 1024)
    max_tokens: int = 16  # output tokens each request asks for


@dataclass(frozen=True)
class DemoRequest:
    """One request of the trace.

    `after` is the index of the request that must finish before this one is sent (the previous turn
    of the same conversation: a user answers only once the reply arrived), or None.
    """

    index: int
    token_ids: tuple[int, ...]
    max_tokens: int
    kind: str  # "turn" | "unique"
    conversation: int | None
    turn: int
    after: int | None


@dataclass
class _Conversation:
    conversation_id: int
    history: list[int]
    turns_left: int
    next_turn: int = 0
    last_request: int | None = None


def _tokens(rng: random.Random, length_range: tuple[int, int]) -> list[int]:
    length = rng.randint(*length_range)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


def generate_trace(spec: WorkloadSpec) -> list[DemoRequest]:
    """The trace for `spec`: same spec, same trace (token for token).

    Conversations start from one of a few shared system prompts (popularity skewed: the first is the
    most common) and grow turn by turn; each turn re-sends the whole history (system prompt, earlier
    user turns and assistant replies) plus the new user tokens. Up to `max_active_conversations` are
    interleaved, as a router sees them.
    """
    if spec.num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if spec.num_system_prompts < 1 or spec.max_active_conversations < 1:
        raise ValueError("need at least one system prompt and one active conversation")
    if not 0.0 <= spec.unique_fraction <= 1.0:
        raise ValueError("unique_fraction must be within [0, 1]")
    rng = random.Random(spec.seed)
    system_prompts = [_tokens(rng, spec.system_prompt_tokens) for _ in range(spec.num_system_prompts)]
    # Zipf-like popularity: prompt k is chosen with weight 1/(k+1).
    prompt_weights = [1.0 / (k + 1) for k in range(spec.num_system_prompts)]
    active: list[_Conversation] = []
    next_conversation_id = 0
    trace: list[DemoRequest] = []
    for index in range(spec.num_requests):
        if rng.random() < spec.unique_fraction:
            trace.append(
                DemoRequest(
                    index=index,
                    token_ids=tuple(_tokens(rng, spec.unique_prompt_tokens)),
                    max_tokens=spec.max_tokens,
                    kind="unique",
                    conversation=None,
                    turn=0,
                    after=None,
                )
            )
            continue
        if len(active) < spec.max_active_conversations and (not active or rng.random() < 0.5):
            system_prompt = rng.choices(system_prompts, weights=prompt_weights)[0]
            active.append(
                _Conversation(
                    conversation_id=next_conversation_id,
                    history=list(system_prompt),
                    turns_left=rng.randint(*spec.turns_per_conversation),
                )
            )
            next_conversation_id += 1
            conversation = active[-1]
        else:
            conversation = rng.choice(active)
        conversation.history.extend(_tokens(rng, spec.user_turn_tokens))
        trace.append(
            DemoRequest(
                index=index,
                token_ids=tuple(conversation.history),
                max_tokens=spec.max_tokens,
                kind="turn",
                conversation=conversation.conversation_id,
                turn=conversation.next_turn,
                after=conversation.last_request,
            )
        )
        # The reply becomes part of the history the next turn re-sends.
        conversation.history.extend(_tokens(rng, spec.assistant_turn_tokens))
        conversation.last_request = index
        conversation.next_turn += 1
        conversation.turns_left -= 1
        if conversation.turns_left == 0:
            active.remove(conversation)
    return trace


def shareable_token_fraction(trace: list[DemoRequest], block_size: int) -> float:
    """Upper bound on any policy's hit rate with unbounded caches: the share of prompt tokens whose
    full block was already sent earlier in the trace with the same prefix (a single-cache ideal)."""
    # Chained block identity, like vLLM's hash chain: (parent block id, block tokens) -> block id.
    block_ids: dict[tuple[int, tuple[int, ...]], int] = {}
    shareable = 0
    total = 0
    for request in trace:
        total += len(request.token_ids)
        parent_id = -1
        for start in range(0, len(request.token_ids) - block_size + 1, block_size):
            block_key = (parent_id, request.token_ids[start : start + block_size])
            known_id = block_ids.get(block_key)
            if known_id is None:
                known_id = len(block_ids)
                block_ids[block_key] = known_id
            else:
                shareable += block_size
            parent_id = known_id
    return shareable / total if total else 0.0
