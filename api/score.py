"""The read path, assembled: HTTP handler -> block hashes -> index lookup -> scores -> JSON.

`POST /v1/score` (CONTRACT.md). The request is validated before anything is hashed; the prompt is
hashed with the model's own settings (block size, algo, seed, LoRA table), on the event loop for
ordinary prompts and on one worker thread above `ApiSettings.hash_in_executor_min_tokens`. Against an
in-process index, hashing stops soon after the first block no pod holds (prompt_holders).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web
from kvindex.api.answer import AnswerPolicy, scores_json
from kvindex.api.metrics import RequestMetrics
from kvindex.api.schemas import (
    JSON_ENCODER,
    EncodedScoreResponse,
    RequestError,
    ScoreRequest,
    decode_score_request_exact,
    decode_with_ids,
    split_ids,
    validate_ids,
    validate_score_request,
)
from kvindex.api.settings import ApiSettings
from kvindex.hashing import DEFAULT_MEMO_SIZE, BlockHasher, HashingError, HeldCheck, MMItem
from kvindex.indexer.index import HolderIds
from kvindex.indexer.model import ModelConfig
from kvindex.indexer.registry import ModelRuntime
from kvindex.indexer.status import IngestView
from kvindex.indexer.store import Store

# Always present in `by_tier` (0 when the pod holds none of the run there): routers index into them
# blindly, as CONTRACT.md's example shows. Other tiers appear only with a non-zero run.
ALWAYS_REPORTED_TIERS = ("GPU", "CPU")

# Digests the event loop's per-model hasher memoises: 2M tokens (256 prompts of 8192), ~156 B a block,
# so ~20 MB per model. Hashing is most of a token request's cost (sha256 over pickle: ~1.5 ms for 256
# new blocks, ~0.3 ms for 512 known ones), and routers re-score the same conversations and system
# prompts; the hasher's default (32768 blocks, 64 such prompts) thrashed under 200 rotating prompts.
LOOP_MEMO_BLOCKS = 131_072

# How stale the stream list behind `unknown_pods` may be: reading it builds every pod's status, which a
# router naming a typo in every request must not pay per request.
STREAM_IDS_MAX_AGE_S = 1.0

# Request options remembered (ScoreHandler._parse): a router sends the same few option sets (model,
# answer, pods, ...) with every prompt, so a body whose options were seen before skips their decode,
# validation and model lookup. Bounded in entries and in the bytes of each.
OPTIONS_CACHE_ENTRIES = 256
OPTIONS_CACHE_MAX_BYTES = 4096


class PromptHashers:
    """One BlockHasher per model for one thread.

    Hashers keep a memo, so they are never shared between threads: the event loop has one set, the
    hashing worker thread another, and neither shares the ingest pipeline's.
    """

    def __init__(self, memo_size: int = DEFAULT_MEMO_SIZE, *, defer_records: bool = False) -> None:
        """`defer_records`: the memos remember a prompt's new digests only at `flush` (or before the next
        prompt reads them): see BlockHasher."""
        self._by_model: dict[str, BlockHasher] = {}
        self._memo_size = memo_size
        self._defer_records = defer_records

    def flush(self) -> None:
        """Remember what the memos left queued (`defer_records`)."""
        for hasher in self._by_model.values():
            hasher.flush_memo()

    def block_keys(
        self,
        config: ModelConfig,
        request: ScoreRequest,
        lora_path: str | None,
        held: HeldCheck | None = None,
    ) -> Sequence[int]:
        """The prompt's block keys (with `held`, possibly only up to a block no pod holds: see
        BlockHasher.event_hashes)."""
        hasher = self._by_model.get(config.name)
        if hasher is None:
            hasher = BlockHasher(
                algo=config.hash_algo,
                block_size=config.block_size,
                seed=config.hash_seed,
                memo_size=self._memo_size,
                defer_records=self._defer_records,
            )
            self._by_model[config.name] = hasher
        assert request.token_ids is not None
        mm = None
        if request.mm is not None:
            mm = [MMItem(identifier=m.identifier, offset=m.offset, length=m.length) for m in request.mm]
        try:
            return hasher.event_key_array(
                request.token_ids,
                lora_name=request.lora_name,
                lora_path=lora_path,
                cache_salt=request.cache_salt,
                mm=mm,
                held=held,
            )
        except HashingError as exc:
            # validate_score_request checks what the hasher refuses; this keeps a missed case a 400.
            raise RequestError("body", f"cannot hash this prompt: {exc}") from None


def prompt_holders(
    index: Store,
    hash_prompt: Callable[[HeldCheck | None], Sequence[int]],
    num_blocks: int,
    pods: list[str] | None,
) -> tuple[list[HolderIds], int]:
    """`index.lookup_ids` of a prompt's `num_blocks` block keys, as `hash_prompt(held)` gives them, and how
    many leading blocks that took (hashed, or known to the memo): hashing stops soon after a block no pod
    holds, so only the blocks up to there are hashed.

    The answer is one lookup, as over the whole prompt: it stops at the latest at the first block no pod
    holds, which the keys hashed reach (their last block was unheld when asked). Should that block be
    stored before the lookup, with every block before it held, the prompt may match further: it is then
    hashed whole and looked up again. For an in-process index (a question costs a lock and a probe, not
    a round trip).
    """

    def held(block_key: int) -> bool:
        # Any pod, whatever `pods` names: a block nobody holds ends every pod's run, and the filter would
        # cost each question a pass over the named pods (38 us for 500 names, against 0.4 us).
        return bool(index.lookup_ids((block_key,)))

    block_keys = hash_prompt(held)
    holder_ids = index.lookup_ids(block_keys, pods)
    if len(holder_ids) == len(block_keys) < num_blocks:
        block_keys = hash_prompt(None)
        holder_ids = index.lookup_ids(block_keys, pods)
    return holder_ids, len(block_keys)


def resolve_model(service: IngestView, model_name: str | None) -> ModelRuntime:
    """The runtime of the named model; with no name, the only configured model."""
    names = service.model_names()
    if model_name is None:
        if len(names) != 1:
            raise RequestError("model", f"required, since several models are configured ({', '.join(names)})")
        model_name = names[0]
    runtime = service.model(model_name)
    if runtime is None:
        raise RequestError("model", f"unknown model {model_name!r}; known: {', '.join(names)}", status=404)
    return runtime


def resolve_lora_path(config: ModelConfig, request: ScoreRequest) -> str | None:
    """The adapter path to hash: as given, else from the model's lora_adapters table."""
    if request.lora_name is None or request.lora_path is not None:
        return request.lora_path
    path = config.lora_adapters.get(request.lora_name)
    if path is None:
        known = ", ".join(sorted(config.lora_adapters)) or "none"
        raise RequestError(
            "lora_name",
            f"unknown adapter {request.lora_name!r} for model {config.name!r} (known: {known});"
            " send lora_path or add it to the model's lora_adapters",
        )
    return path


class ScoreHandler:
    """`POST /v1/score`; holds what the handler needs so the app wires it once."""

    def __init__(
        self,
        service: IngestView,
        settings: ApiSettings,
        metrics: RequestMetrics,
        executor: ThreadPoolExecutor,
        store_executor: ThreadPoolExecutor,
    ) -> None:
        """`executor`: one thread, for hashing long prompts; `store_executor`: for remote stores' reads."""
        self._service = service
        self._settings = settings
        self._metrics = metrics
        self._executor = executor
        self._store_executor = store_executor
        self._tier_weights = dict(settings.tier_weights)
        # The event loop's memos remember a prompt after its answer is written (after_answer).
        self._loop_hashers = PromptHashers(LOOP_MEMO_BLOCKS, defer_records=True)
        self._worker_hashers = PromptHashers()  # used only on the executor's single thread
        # (hashed, unhashed) blocks of the prompt the event loop hashed last, until _count_prompt_blocks
        self._uncounted_blocks: tuple[int, int] | None = None
        # model -> pod ids of its streams, for `unknown_pods` (see _unknown_pods)
        self._stream_ids: dict[str, frozenset[str]] = {}
        self._stream_ids_read_at = -math.inf
        # A body without its id array (split_ids' rest) -> the request it decoded to with those ids left
        # out, which passed validate_score_request, and its model's runtime (the registry is fixed).
        self._known_options: dict[bytes, tuple[ScoreRequest, ModelRuntime]] = {}
        # (states, rank, answer, block size) -> the AnswerPolicy they make with this server's settings
        self._policies: dict[tuple[tuple[str, ...] | None, str, str, int], AnswerPolicy] = {}

    async def handle(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        body = await request.read()
        score_request, runtime = self._parse(body)
        loop = asyncio.get_running_loop()
        if runtime.index.blocking_io:
            # A remote store's round trip (or its timeout, when it is unreachable) must not hold up the
            # event loop: health checks and other requests go on meanwhile. One lookup of every block:
            # asking it block by block where to stop hashing would cost a round trip each.
            block_keys = await self._block_keys(runtime.config, score_request)
            if score_request.token_ids is not None:
                self._metrics.observe_prompt_blocks(len(block_keys), 0)
            answer = await loop.run_in_executor(
                self._store_executor, self._answer_keys, runtime, block_keys, score_request
            )
        else:
            holder_ids = self._holders_now(runtime, score_request)
            if holder_ids is None:
                holder_ids = await loop.run_in_executor(
                    self._executor,
                    self._prompt_holders,
                    self._worker_hashers,
                    runtime,
                    score_request,
                    resolve_lora_path(runtime.config, score_request),
                )
            answer = self._answer(runtime, holder_ids, score_request)
        encoded, best = self._encode(runtime.config, score_request, answer)
        self._count_prompt_blocks()
        self._metrics.observe_score(started, best)
        # Runs once this task yields, after aiohttp has written the response.
        loop.call_soon(self._loop_hashers.flush)
        return web.Response(body=encoded, content_type="application/json")

    def answer_now(self, body: bytes) -> tuple[bytes, float, int] | None:
        """The encoded 200 answer to a request `body`, computed on the calling (event loop) thread, with when
        it began (perf_counter) and its best match, for `after_answer` once the answer is on its way; None when
        it needs a thread (a prompt of `hash_in_executor_min_tokens` or more, or a remote store): `handle`
        answers those. A client mistake raises RequestError, as in `handle`."""
        started = time.perf_counter()
        score_request, runtime = self._parse(body)
        if runtime.index.blocking_io:
            return None
        holder_ids = self._holders_now(runtime, score_request)
        if holder_ids is None:
            return None
        encoded, best = self._encode(
            runtime.config, score_request, self._answer(runtime, holder_ids, score_request)
        )
        return encoded, started, best

    def after_answer(self, started: float | None, best_matched_blocks: int) -> None:
        """What an answer of `answer_now` leaves for after it is written: the event loop memos' records
        of its prompt, the count of its blocks and, unless it failed (`started` None), its score metrics
        (latency from `started` to now, best match). Live, at p50: 15 us after a 512-hash answer, 29 us
        after a fresh 8192-token prompt's."""
        self._loop_hashers.flush()
        self._count_prompt_blocks()
        if started is not None:
            self._metrics.observe_score(started, best_matched_blocks)

    def _parse(self, body: bytes) -> tuple[ScoreRequest, ModelRuntime]:
        """The request, validated, and its model's runtime; RequestError for a client mistake.

        A plain id array's request whose other fields are byte for byte those of one that passed before
        (the same `rest`) is that request with these ids: only the checks on the ids' count are left
        (validate_ids; requests with `mm`, whose checks depend on the prompt, are never remembered)."""
        max_tokens = self._settings.max_tokens
        split = split_ids(body)
        decoded = None
        if split is not None:
            key, ids, rest = split
            known = self._known_options.get(rest)
            if known is not None:
                template, runtime = known
                score_request = msgspec.structs.replace(template, **{key: ids})
                validate_ids(score_request, max_tokens=max_tokens)
                return score_request, runtime
            decoded = decode_with_ids(key, ids, rest)
        # Otherwise the exact decoder's request or error, and nothing to remember.
        score_request = decode_score_request_exact(body) if decoded is None else decoded
        validate_score_request(score_request, max_tokens=max_tokens)
        runtime = resolve_model(self._service, score_request.model)
        if decoded is not None and decoded.mm is None and len(rest) <= OPTIONS_CACHE_MAX_BYTES:
            if len(self._known_options) >= OPTIONS_CACHE_ENTRIES:
                self._known_options.clear()  # a client varying its options per request: start over
            self._known_options[rest] = (msgspec.structs.replace(decoded, **{key: None}), runtime)
        return score_request, runtime

    def _encode(
        self,
        config: ModelConfig,
        request: ScoreRequest,
        answer: tuple[bytes, int, list[str] | msgspec.UnsetType],
    ) -> tuple[bytes, int]:
        """The response body, and the best entry's matched blocks (for `observe`)."""
        scores, best, unknown_pods = answer
        response = EncodedScoreResponse(
            model=config.name,
            block_size=config.block_size,
            num_blocks=_num_blocks(config, request),
            scores=msgspec.Raw(scores),
            unknown_pods=unknown_pods,
        )
        return JSON_ENCODER.encode(response), best

    def _answer_keys(
        self, runtime: ModelRuntime, block_keys: Sequence[int], request: ScoreRequest
    ) -> tuple[bytes, int, list[str] | msgspec.UnsetType]:
        """_answer of the lookup of `block_keys` (any thread)."""
        return self._answer(runtime, runtime.index.lookup_ids(block_keys, request.pods), request)

    def _answer(
        self, runtime: ModelRuntime, holder_ids: list[HolderIds], request: ScoreRequest
    ) -> tuple[bytes, int, list[str] | msgspec.UnsetType]:
        """The answer from the index's lookup (any thread): the `scores` JSON, the best match, the unknown
        pods."""
        config = runtime.config
        policy = self._policy(config, request)
        scores, best = scores_json(
            runtime.index, holder_ids, self._service.pod_healths, policy, self._service.health_reader()
        )
        if request.pods is None:
            return scores, best, msgspec.UNSET
        return scores, best, self._unknown_pods(runtime, request.pods)

    def _policy(self, config: ModelConfig, request: ScoreRequest) -> AnswerPolicy:
        """The AnswerPolicy of the request's asks (made once per set of asks and block size)."""
        states = None if request.states is None else tuple(request.states)
        key = (states, request.rank, request.answer, config.block_size)
        policy = self._policies.get(key)
        if policy is None:
            policy = AnswerPolicy(
                block_size=config.block_size,
                tier_weights=self._tier_weights,
                unknown_tier_weight=self._settings.unknown_tier_weight,
                report_tiers=ALWAYS_REPORTED_TIERS,
                grace_s=self._service.settings.disconnected_grace_s,
                states=None if states is None else frozenset(states),
                by_score=request.rank == "score",
                compact=request.answer == "compact",
            )
            if len(self._policies) >= OPTIONS_CACHE_ENTRIES:
                self._policies.clear()
            self._policies[key] = policy
        return policy

    def _unknown_pods(self, runtime: ModelRuntime, pod_ids: list[str]) -> list[str]:
        """The ids no stream of this model has and the model's index never held, in request order.

        Most ids are answered by the index alone; the rest (a pod with no block yet, or a typo) are looked
        up among the streams, whose list is read at most once per STREAM_IDS_MAX_AGE_S (a pod that
        appeared since, and has no block yet, is reported unknown until the next read)."""
        index = runtime.index
        candidates = [pod_id for pod_id in dict.fromkeys(pod_ids) if not index.has_pod_id(pod_id)]
        if not candidates:
            return []
        now = time.monotonic()
        if now - self._stream_ids_read_at > STREAM_IDS_MAX_AGE_S:
            by_model: dict[str, set[str]] = {}
            for status in self._service.pod_statuses():
                by_model.setdefault(status.model, set()).add(status.pod)
            self._stream_ids = {model: frozenset(ids) for model, ids in by_model.items()}
            self._stream_ids_read_at = now
        streams = self._stream_ids.get(runtime.config.name, frozenset())
        return [pod_id for pod_id in candidates if pod_id not in streams]

    async def _block_keys(self, config: ModelConfig, request: ScoreRequest) -> Sequence[int]:
        block_keys = self._block_keys_now(config, request)
        if block_keys is not None:
            return block_keys
        lora_path = resolve_lora_path(config, request)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._worker_hashers.block_keys, config, request, lora_path
        )

    def _block_keys_now(self, config: ModelConfig, request: ScoreRequest) -> Sequence[int] | None:
        """The request's block keys, hashed on this thread; None for a prompt the worker thread hashes."""
        if request.block_hashes is not None:
            return request.block_hashes
        if self._for_hashing_thread(request):
            return None
        return self._loop_hashers.block_keys(config, request, resolve_lora_path(config, request))

    def _for_hashing_thread(self, request: ScoreRequest) -> bool:
        """A token prompt long enough to be hashed on the worker thread, not the event loop."""
        assert request.token_ids is not None
        return len(request.token_ids) >= self._settings.hash_in_executor_min_tokens

    def _holders_now(self, runtime: ModelRuntime, request: ScoreRequest) -> list[HolderIds] | None:
        """The in-process index's lookup of the request's blocks, hashed on this thread; None for a
        prompt the worker thread hashes (_prompt_holders there)."""
        if request.block_hashes is not None:
            return runtime.index.lookup_ids(request.block_hashes, request.pods)
        if self._for_hashing_thread(request):
            return None
        return self._prompt_holders(
            self._loop_hashers,
            runtime,
            request,
            resolve_lora_path(runtime.config, request),
            count_later=True,
        )

    def _prompt_holders(
        self,
        hashers: PromptHashers,
        runtime: ModelRuntime,
        request: ScoreRequest,
        lora_path: str | None,
        *,
        count_later: bool = False,
    ) -> list[HolderIds]:
        """prompt_holders of a token prompt (any thread), its blocks counted in the metrics; with
        `count_later` (the event loop's thread only), by _count_prompt_blocks, once the answer is out."""
        config = runtime.config

        def hash_prompt(held: HeldCheck | None) -> Sequence[int]:
            return hashers.block_keys(config, request, lora_path, held)

        num_blocks = _num_blocks(config, request)
        holder_ids, hashed_blocks = prompt_holders(runtime.index, hash_prompt, num_blocks, request.pods)
        if count_later:
            self._uncounted_blocks = (hashed_blocks, num_blocks - hashed_blocks)
        else:
            self._metrics.observe_prompt_blocks(hashed_blocks, num_blocks - hashed_blocks)
        return holder_ids

    def _count_prompt_blocks(self) -> None:
        """Count the blocks of the prompt the event loop last hashed, if not yet counted."""
        uncounted = self._uncounted_blocks
        if uncounted is not None:
            self._uncounted_blocks = None
            self._metrics.observe_prompt_blocks(*uncounted)


def _num_blocks(config: ModelConfig, request: ScoreRequest) -> int:
    """The prompt's full blocks (the answer's `num_blocks`, whatever part of them was hashed)."""
    if request.block_hashes is not None:
        return len(request.block_hashes)
    assert request.token_ids is not None
    return len(request.token_ids) // config.block_size
