"""BlockHasher: a prompt's token ids -> vLLM's chained block hashes, byte-identical to vLLM 0.33.0.

The read path's first step (HTTP score handler -> block hashes -> index lookup) and the ingest side's
check of stored events. Mirrors `get_request_block_hasher` + `hash_block_tokens`: only full blocks are
hashed; block i hashes (parent digest or NONE_HASH, tuple(tokens of block i), extra keys of block i).
"""

from __future__ import annotations

import pickle
from array import array
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final

import msgspec
import xxhash
from kvindex.hashing import cbor_fast, compiled
from kvindex.hashing.algorithms import (
    SHA256,
    HashAlgo,
    event_hash,
    event_hashes_of,
    get_algo,
    resolve_seed,
    root_hash,
)
from kvindex.hashing.errors import HashingError
from kvindex.hashing.extra_keys import (
    ExtraKeys,
    MMItem,
    RequestExtras,
    make_request_extras,
    per_block_keys,
    untag,
)
from kvindex.hashing.memo import SEGMENT_BLOCKS, DigestMemo, LowCheck

# Digests remembered per BlockHasher (~10 MB with their keys): 64 distinct 8k-token prompts, or far more
# conversations that share a system prompt.
DEFAULT_MEMO_SIZE: Final = 32768
# Bytes per token in the memo's packed keys.
_PACKED_TYPECODE: Final = "I"
_KEY_ITEMSIZE: Final = array(_PACKED_TYPECODE).itemsize
# Event keys packed for a lookup (event_key_array): unsigned 64-bit, native order.
EVENT_KEY_TYPECODE: Final = "Q"
assert array(EVENT_KEY_TYPECODE).itemsize == 8
# With `held`: blocks hashed between two questions, at least this many and an eighth of the chain so far
# (so a long prompt held to its end asks ~log(blocks) times, and hashes at most ~1/8 past where its held run
# ends), each stretch ending on a memo segment boundary. A stretch costs ~2 us besides its blocks (a
# question, a lock and a probe; a call into the hash core), what hashing ~12 blocks does.
MIN_HELD_STRETCH_BLOCKS: Final = 2 * SEGMENT_BLOCKS
HELD_STRETCH_SHARE: Final = 8

# Whether some pod holds the block with this event key (see BlockHasher.event_hashes).
HeldCheck = Callable[[int], bool]
# Appends blocks start..stop-1 to the chain (whose digests hold blocks 0..start-1).
_RangeHasher = Callable[[int, int], None]

_IntTuple = tuple[int, ...]
_NonNegativeTuple = tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
# Ids that cannot be a bool in disguise (True and False pack as 1 and 0).
_AboveOneTuple = tuple[Annotated[int, msgspec.Meta(ge=2)], ...]


def validate_token_ids(token_ids: Sequence[int]) -> tuple[int, ...]:
    """The token ids as a tuple of non-negative ints; HashingError for anything else.

    Bools, floats and strings are refused even though pickle/CBOR would serialise them: they serialise
    differently from the int an engine saw. Negative ids are refused: no vocabulary has them, so no engine
    ever cached them. Int subclasses (IntEnum) become plain ints.
    """
    return _prepare(token_ids)[0]


def _prepare(token_ids: Sequence[int]) -> tuple[tuple[int, ...], bytes | None]:
    """(validated ids, the ids packed as uint32 for memo keys — None if one does not fit in 32 bits)."""
    if isinstance(token_ids, (str, bytes, bytearray)) or not hasattr(token_ids, "__iter__"):
        raise HashingError(f"token_ids must be a list of integers, got {type(token_ids).__name__}")
    if not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)
    try:
        # One C pass for exact ints (bool, float, str refused; IntEnum becomes int).
        tokens = msgspec.convert(token_ids, _IntTuple)
    except msgspec.ValidationError as exc:
        raise HashingError(f"token_ids must be non-negative integers ({exc})") from None
    try:
        # A second C pass packs them for the memo and refuses negatives on the way.
        return tokens, array("I", tokens).tobytes()
    except OverflowError:
        pass
    try:
        msgspec.convert(tokens, _NonNegativeTuple)
    except msgspec.ValidationError as exc:
        raise HashingError(f"token_ids must be non-negative integers ({exc})") from None
    return tokens, None  # ids >= 2**32: valid, hashed without the memo


def _exact_ints(token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids as exact ints; HashingError for bools and anything else that is not an int."""
    try:
        return msgspec.convert(token_ids, _IntTuple)
    except msgspec.ValidationError as exc:
        raise HashingError(f"token_ids must be non-negative integers ({exc})") from None


class BlockHasher:
    """Block hashes of one model's prompts, as its vLLM engines compute them.

    `algo` is `--prefix-caching-hash-algo`, `block_size` the hash block size, `seed` the engines'
    PYTHONHASHSEED string (None: vLLM's rule for an unset variable, which only works for sha256 variants).
    A bounded memo (`memo_size` digests, 0 disables it) makes re-hashing a known prefix nearly free; it
    never changes a result. Safe to call from several threads. With `defer_records`, a prompt's newly
    hashed digests are queued for the memo and remembered by `flush_memo` (or before the next prompt
    reads the memo), so a caller can answer first.
    """

    def __init__(
        self,
        algo: str = "sha256",
        block_size: int = 16,
        seed: str | None = None,
        memo_size: int = DEFAULT_MEMO_SIZE,
        defer_records: bool = False,
    ) -> None:
        self._algo: HashAlgo = get_algo(algo)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise HashingError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(memo_size, int) or isinstance(memo_size, bool) or memo_size < 0:
            raise HashingError(f"memo_size must be an integer >= 0, got {memo_size!r}")
        self._block_size = block_size
        self._seed = resolve_seed(self._algo, seed)
        self._root = root_hash(self._algo, seed)
        self._cbor_array_head = cbor_fast.array_head(block_size)
        self._cbor_parent_head = cbor_fast.preimage_head(len(self._root))
        self._compiled = compiled.chain_core
        # The core's SHA-256 (None), or the digest function it calls per block for the xxhash algorithms.
        self._core_digest = compiled.core_digest(self._algo)
        self._memo = self._make_memo(memo_size, defer_records)
        if self._algo.uses_cbor:
            # Built here rather than by the first prompt, so a service that makes its hashers at start-up
            # does not make its first request wait for the table.
            cbor_fast.token_table()

    def _make_memo(self, memo_size: int, defer_records: bool) -> DigestMemo | None:
        if not memo_size:
            return None
        if self._compiled is not None:
            compiled = self._compiled
            return DigestMemo(
                memo_size,
                compiled.segment_tags,
                compiled.untrack_atomic,
                compiled.walk_segments,
                defer_records=defer_records,
            )
        return DigestMemo(memo_size, defer_records=defer_records)

    def flush_memo(self) -> None:
        """Remember what `defer_records` left queued (a no-op without it)."""
        if self._memo is not None:
            self._memo.flush()

    @property
    def algo(self) -> str:
        """The `--prefix-caching-hash-algo` name."""
        return self._algo.name

    @property
    def block_size(self) -> int:
        """Tokens per hashed block (vLLM's hash_block_size)."""
        return self._block_size

    @property
    def seed(self) -> str:
        """The seed string the root was derived from (after vLLM's unset-seed rule)."""
        return self._seed

    @property
    def root(self) -> bytes:
        """NONE_HASH: the digest block 0 chains from."""
        return self._root

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMItem] | None = None,
        prompt_embeds_digests: Sequence[bytes] | None = None,
        lookahead: int = 0,
    ) -> list[bytes]:
        """Raw digests of the prompt's full blocks, in order (vLLM's `request.block_hashes`)."""
        return self._chain(token_ids, lora_name, lora_path, cache_salt, mm, prompt_embeds_digests, lookahead)

    def event_hashes(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMItem] | None = None,
        prompt_embeds_digests: Sequence[bytes] | None = None,
        lookahead: int = 0,
        held: HeldCheck | None = None,
    ) -> list[int]:
        """The same blocks in the form KV events carry: unsigned 64-bit ints (last 8 digest bytes).

        `held(event_key)`, when given, is asked now and then (after the memo's known blocks, then after
        every stretch of MIN_HELD_STRETCH_BLOCKS or an eighth of the chain so far) whether any pod holds a
        block: hashing stops after the first block it says no to. The answer is then a prefix of the
        whole prompt's keys that ends in that block, so a longest-prefix lookup stops where it would over
        the whole prompt: a prompt that leaves the cached prefixes early costs the blocks up to there,
        not all of them.
        """
        digests = self._chain(
            token_ids, lora_name, lora_path, cache_salt, mm, prompt_embeds_digests, lookahead, held
        )
        return event_hashes_of(digests, self._algo.digest_size)

    def event_key_array(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMItem] | None = None,
        prompt_embeds_digests: Sequence[bytes] | None = None,
        lookahead: int = 0,
        held: HeldCheck | None = None,
    ) -> array[int]:
        """`event_hashes`, as an array('Q'): the same keys, for a lookup that reads them without an int
        object per block (the compiled core packs a 512-block prompt's keys in ~1 us, against ~15 us for
        the list of ints)."""
        digests = self._chain(
            token_ids, lora_name, lora_path, cache_salt, mm, prompt_embeds_digests, lookahead, held
        )
        keys = array(EVENT_KEY_TYPECODE)
        if self._compiled is None:
            keys.fromlist(event_hashes_of(digests, self._algo.digest_size))
        else:
            keys.frombytes(self._compiled.event_keys(digests))
        return keys

    def block_hashes_after(self, parent: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """Raw digests of plain full blocks (no extra keys) continuing a chain whose last block's digest
        is `parent`: what vLLM computes for the blocks it appends after a cached prefix. With `parent`
        = `root` this is `block_hashes(token_ids)`."""
        tokens, _ = _prepare(token_ids)
        digests = [parent]
        num_blocks = len(tokens) // self._block_size
        self._hash_blocks(tokens, None, 0, num_blocks, digests)
        return digests[1:]

    def event_extra_keys(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm: Sequence[MMItem] | None = None,
        prompt_embeds_digests: Sequence[bytes] | None = None,
        lookahead: int = 0,
    ) -> list[tuple[Any, ...] | None]:
        """Per full block, the untagged extra keys vLLM publishes in BlockStored.extra_keys (None: none).

        LoRA -> name (the path is hashed but never published), mm -> (identifier, offset), cache_salt ->
        salt, prompt_embeds -> digest. With lookahead the lookahead tokens are not included: events carry
        them in `lookahead_token_ids`.
        """
        tokens = validate_token_ids(token_ids)
        extras = make_request_extras(
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            mm=mm,
            prompt_embeds_digests=prompt_embeds_digests,
            lookahead=lookahead,
        )
        num_blocks = max(0, (len(tokens) - extras.lookahead) // self._block_size)
        _, published = per_block_keys(extras, tokens, self._block_size, num_blocks)
        return [untag(keys) for keys in published]

    def _chain(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        lora_path: str | None,
        cache_salt: str | None,
        mm: Sequence[MMItem] | None,
        prompt_embeds_digests: Sequence[bytes] | None,
        lookahead: int,
        held: HeldCheck | None = None,
    ) -> list[bytes]:
        request_extras = make_request_extras(
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
            mm=mm,
            prompt_embeds_digests=prompt_embeds_digests,
            lookahead=lookahead,
        )
        if type(token_ids) is array:
            # Packed ids (the score API's compiled reader): already exact ints in [0, 2**32).
            if token_ids.typecode == _PACKED_TYPECODE and self._memo is not None and request_extras.is_plain:
                return self._chain_packed(self._memo, token_ids.tobytes(), token_ids, held)
            token_ids = token_ids.tolist()
        if self._memo is not None and request_extras.is_plain and type(token_ids) in (list, tuple):
            digests = None
            if self._compiled is not None:
                digests = self._chain_exact(
                    self._compiled,
                    self._memo,
                    token_ids,  # type: ignore[arg-type]
                    held,
                )
            if digests is None:
                digests = self._chain_plain(self._memo, token_ids, held)  # type: ignore[arg-type]
            if digests is not None:
                return digests
        return self._chain_validated(token_ids, request_extras, held)

    def _chain_exact(
        self,
        core: compiled.ChainCore,
        memo: DigestMemo,
        token_ids: list[int] | tuple[int, ...],
        held: HeldCheck | None = None,
    ) -> list[bytes] | None:
        """_chain_plain for the compiled core: its packer also proves every id an exact int, so neither
        the memo hits' low-id re-checks nor a validation pass over the rest are needed. None when an id
        is not an exact int below 2**32: _chain_plain then takes the prompt."""
        # The memo made with this core tags its segments with the core's XXH64: the packer's tags.
        packed = core.pack_ids_tagged(token_ids, SEGMENT_BLOCKS * self._block_size)
        if packed is None:
            return None
        token_bytes, seg_tags = packed
        return self._chain_packed(memo, token_bytes, token_ids, held, seg_tags)

    def _chain_packed(
        self,
        memo: DigestMemo,
        token_bytes: bytes,
        token_ids: Sequence[int],
        held: HeldCheck | None = None,
        seg_tags: list[int] | None = None,
    ) -> list[bytes]:
        """The memoised chain of plain blocks whose ids are known to be exact ints in [0, 2**32) and
        packed as `token_bytes` (array('I') bytes): no id needs checking, only the memo's misses hashing.
        `seg_tags`: the memo's tags of every full segment, when the packer computed them."""
        block_size = self._block_size
        block_width = _KEY_ITEMSIZE * block_size
        num_blocks = len(token_ids) // block_size
        digests: list[bytes] = []
        tags_known = seg_tags is not None
        if seg_tags is None:
            seg_tags = []
        # No low-id checks: every id is an exact int, so a hit's values are its types too.
        missed_segments = memo.resolve(
            self._root, token_bytes, block_width, num_blocks, None, digests, None, seg_tags, tags_known
        )
        first_new = len(digests)
        if first_new < num_blocks:

            def hash_range(start: int, stop: int) -> None:
                found = None
                if self._compiled is not None:
                    # Straight from the packed bytes: a list of 4,096 ints to build and read back was a
                    # fifth of a half-new prompt's hashing.
                    found = self._compiled.chain_packed(
                        digests[-1] if digests else self._root,
                        token_bytes,
                        start * block_size,
                        block_size,
                        stop - start,
                        self._algo.uses_cbor,
                        self._core_digest,
                    )
                if found is not None:
                    digests.extend(found)
                    return
                rest = token_ids[start * block_size : stop * block_size]
                if type(rest) is array:
                    rest = rest.tolist()
                self._hash_blocks(rest, None, start, stop, digests)

            if _hash_while_held(hash_range, digests, first_new, num_blocks, held) > first_new:
                memo.record(
                    self._root, token_bytes, block_width, None, digests, first_new, missed_segments, seg_tags
                )
        return digests

    def _chain_plain(
        self, memo: DigestMemo, token_ids: list[int] | tuple[int, ...], held: HeldCheck | None = None
    ) -> list[bytes] | None:
        """The memoised path for prompts without extra keys: one C pass packs every id (refusing
        non-ints, negatives and ids >= 2**32), and only the ids that are not memoised are validated
        exactly. None when the ids do not pack: the caller validates them all and says what is wrong."""
        packed = array("I")
        try:
            packed.fromlist(token_ids if type(token_ids) is list else list(token_ids))
        except (TypeError, OverflowError):
            return None
        token_bytes = packed.tobytes()
        block_size = self._block_size
        block_width = _KEY_ITEMSIZE * block_size
        num_blocks = len(token_ids) // block_size
        digests: list[bytes] = []
        low_checks: list[LowCheck] = []
        seg_tags: list[int] = []
        missed_segments = memo.resolve(
            self._root, token_bytes, block_width, num_blocks, None, digests, low_checks, seg_tags
        )
        # A memo hit proves the values, not the types: True packs as 1. Re-check hits with ids below 2.
        for first, stop, unsettled_key in low_checks:
            ids = token_ids[first * block_size : stop * block_size]
            try:
                msgspec.convert(ids, _AboveOneTuple)
                has_low = False
            except msgspec.ValidationError:
                _exact_ints(ids)
                has_low = True
            if unsettled_key is not None:
                memo.settle(unsettled_key, stop - first > 1, has_low)
        first_new = len(digests)
        # One C pass: exact ints (bools, floats, strings refused); the pack already refused negatives.
        rest = _exact_ints(token_ids[first_new * block_size :])
        if first_new < num_blocks:

            def hash_range(start: int, stop: int) -> None:
                at = (start - first_new) * block_size
                self._hash_blocks(rest[at : at + (stop - start) * block_size], None, start, stop, digests)

            if _hash_while_held(hash_range, digests, first_new, num_blocks, held) > first_new:
                memo.record(
                    self._root, token_bytes, block_width, None, digests, first_new, missed_segments, seg_tags
                )
        return digests

    def _chain_validated(
        self, token_ids: Sequence[int], request_extras: RequestExtras, held: HeldCheck | None = None
    ) -> list[bytes]:
        """Every id validated up front: prompts with extra keys, memo off, or ids that do not pack."""
        tokens, token_bytes = _prepare(token_ids)
        block_size = self._block_size
        num_blocks = max(0, (len(tokens) - request_extras.lookahead) // block_size)
        extras: list[ExtraKeys] | None = None
        if not request_extras.is_plain:
            extras, _ = per_block_keys(request_extras, tokens, block_size, num_blocks)
        digests: list[bytes] = []
        memo = self._memo if token_bytes is not None else None
        missed_segments: list[int] = []
        if memo is not None and token_bytes is not None:
            # Every id was validated above, so the hits' low-id checks are not needed here.
            missed_segments = memo.resolve(
                self._root, token_bytes, _KEY_ITEMSIZE * block_size, num_blocks, extras, digests, []
            )
        first_new = len(digests)
        if first_new < num_blocks:

            def hash_range(start: int, stop: int) -> None:
                self._hash_blocks(
                    tokens[start * block_size : stop * block_size], extras, start, stop, digests
                )

            hashed_to = _hash_while_held(hash_range, digests, first_new, num_blocks, held)
            if memo is not None and token_bytes is not None and hashed_to > first_new:
                memo.record(
                    self._root,
                    token_bytes,
                    _KEY_ITEMSIZE * block_size,
                    extras,
                    digests,
                    first_new,
                    missed_segments,
                )
        return digests

    def _hash_blocks(
        self,
        tokens: Sequence[int],
        extras: list[ExtraKeys] | None,
        first: int,
        stop: int,
        digests: list[bytes],
    ) -> None:
        """Append blocks first..stop-1 to `digests` (which holds blocks 0..first-1); `tokens` starts at
        block `first`. Plain blocks go to the compiled core when it is in use."""
        if extras is None and self._compiled is not None:
            found = self._compiled.chain(
                digests[-1] if digests else self._root,
                tokens,
                self._block_size,
                stop - first,
                self._algo.uses_cbor,
                self._core_digest,
            )
            if found is not None:  # None: what C leaves to the reference (ids >= 2**64, huge blocks)
                digests.extend(found)
                return
        if type(tokens) is not tuple:  # the compiled path passes lists; pickle must see vLLM's tuple
            tokens = tuple(tokens)
        if self._algo.uses_cbor:
            self._hash_cbor(tokens, extras, first, stop, digests)
        else:
            self._hash_pickle(tokens, extras, first, stop, digests)

    def _hash_pickle(
        self,
        tokens: tuple[int, ...],
        extras: list[ExtraKeys] | None,
        first: int,
        stop: int,
        digests: list[bytes],
    ) -> None:
        """Append blocks first..stop-1 to `digests` (which holds blocks 0..first-1); `tokens` starts at
        block `first`."""
        # pickle.dumps is C already; what is saved here is vLLM's per-block Python calls and list copies.
        dumps = pickle.dumps
        protocol = pickle.HIGHEST_PROTOCOL
        block_size = self._block_size
        parent = digests[-1] if digests else self._root
        append = digests.append
        start = 0
        if self._algo.digest_size == 32:
            sha256 = SHA256
            for index in range(first, stop):
                keys = None if extras is None else extras[index]
                parent = sha256(dumps((parent, tokens[start : start + block_size], keys), protocol)).digest()
                append(parent)
                start += block_size
        else:
            xxh = xxhash.xxh3_128_digest
            for index in range(first, stop):
                keys = None if extras is None else extras[index]
                parent = xxh(dumps((parent, tokens[start : start + block_size], keys), protocol))
                append(parent)
                start += block_size

    def _hash_cbor(
        self,
        tokens: tuple[int, ...],
        extras: list[ExtraKeys] | None,
        first: int,
        stop: int,
        digests: list[bytes],
    ) -> None:
        """Append blocks first..stop-1 to `digests`, building each canonical-CBOR preimage by hand;
        `tokens` starts at block `first`."""
        block_size = self._block_size
        token_items = cbor_fast.encode_tokens(tokens[: (stop - first) * block_size])
        digest = self._algo.digest
        sha256 = SHA256 if self._algo.digest_size == 32 else None
        head = self._cbor_parent_head
        array_head = self._cbor_array_head
        join = b"".join
        parent = digests[-1] if digests else self._root
        append = digests.append
        extra_cache: dict[Any, bytes] = {}
        extra_bytes = b"\xf6"
        offset = 0
        for index in range(first, stop):
            if extras is not None:
                keys = extras[index]
                extra_bytes = extra_cache.get(keys) or extra_cache.setdefault(
                    keys, cbor_fast.encode_extra(keys)
                )
            preimage = (
                head + parent + array_head + join(token_items[offset : offset + block_size]) + extra_bytes
            )
            parent = sha256(preimage).digest() if sha256 is not None else digest(preimage)
            append(parent)
            offset += block_size


def _hash_while_held(
    hash_range: _RangeHasher, digests: list[bytes], first_new: int, num_blocks: int, held: HeldCheck | None
) -> int:
    """Hash blocks first_new.. on (all of them without `held`, else stretch by stretch until `held` says
    no to a stretch's last block); returns how many blocks `digests` holds then."""
    if held is None:
        hash_range(first_new, num_blocks)
        return num_blocks
    done = first_new
    if done and not held(event_hash(digests[-1])):
        return done
    while done < num_blocks:
        stretch = max(MIN_HELD_STRETCH_BLOCKS, done // HELD_STRETCH_SHARE)
        stop = min(num_blocks, -(-(done + stretch) // SEGMENT_BLOCKS) * SEGMENT_BLOCKS)
        hash_range(done, stop)
        done = stop
        if done < num_blocks and not held(event_hash(digests[-1])):
            break
    return done


__all__ = ["DEFAULT_MEMO_SIZE", "BlockHasher", "event_hash", "validate_token_ids"]
