"""Per-block extra keys: what besides the tokens goes into a block hash (LoRA, multimodal, salt, embeds).

Read path, between the prompt and the hash chain. Mirrors `generate_block_hash_extra_keys`,
`generate_lookahead_block_hash_extra_keys` and `to_event_extra_keys` (vLLM 0.33.0 kv_cache_utils.py):
hashes use the *tagged* keys, KV events publish an *untagged* view of the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec
from kvindex.hashing.errors import HashingError

# One block's tagged keys, e.g. (("lora", name, path), ("mm", identifier, -6)), or None when empty.
ExtraKeys: TypeAlias = tuple[Any, ...] | None


class MMItem(msgspec.Struct, frozen=True):
    """A multimodal input's placeholder: `identifier` (vLLM's encoder-cache identifier, LoRA-prefixed when a
    LoRA is active — not mm_hash) occupies tokens [offset, offset + length) of the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RequestExtras:
    """Validated request-level inputs to the extra keys. `lookahead` is vLLM's num_hash_lookahead_tokens."""

    lora: tuple[str, str, str] | None = None
    cache_salt: str | None = None
    mm: tuple[MMItem, ...] = ()
    prompt_embeds_digests: tuple[bytes, ...] | None = None
    lookahead: int = 0

    @property
    def is_plain(self) -> bool:
        """True when every block's extra keys are None (no LoRA, salt, MM, embeds or lookahead)."""
        return (
            self.lora is None
            and not self.cache_salt
            and not self.mm
            and self.prompt_embeds_digests is None
            and not self.lookahead
        )


PLAIN = RequestExtras()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def make_request_extras(
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm: Sequence[MMItem] | None = None,
    prompt_embeds_digests: Sequence[bytes] | None = None,
    lookahead: int = 0,
) -> RequestExtras:
    """Validate the keyword inputs of a hash request; HashingError names the first bad one."""
    if (
        lora_name is None
        and lora_path is None
        and not cache_salt
        and not mm
        and (prompt_embeds_digests is None and lookahead == 0)
    ):
        return PLAIN
    lora: tuple[str, str, str] | None = None
    if lora_name is not None or lora_path is not None:
        if not isinstance(lora_name, str) or not isinstance(lora_path, str):
            raise HashingError(
                "give both lora_name and lora_path as strings: vLLM hashes the adapter path too"
            )
        lora = ("lora", lora_name, lora_path)
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise HashingError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    items = _validate_mm(mm)
    digests = None
    if prompt_embeds_digests is not None:
        digests = tuple(prompt_embeds_digests)
        if not all(isinstance(d, bytes) for d in digests):
            raise HashingError(
                "prompt_embeds_digests must be a sequence of bytes (one sha256 digest per block)"
            )
    if not _is_int(lookahead) or lookahead < 0:
        raise HashingError(f"lookahead must be an integer >= 0, got {lookahead!r}")
    return RequestExtras(lora, cache_salt or None, items, digests, lookahead)


def _validate_mm(mm: Sequence[MMItem] | None) -> tuple[MMItem, ...]:
    if not mm:
        return ()
    items = tuple(mm)
    previous_offset = -1
    for item in items:
        if not isinstance(item, MMItem):
            raise HashingError(
                f"mm items must be MMItem(identifier, offset, length), got {type(item).__name__}"
            )
        if not isinstance(item.identifier, str) or not item.identifier:
            raise HashingError("an mm item's identifier must be a non-empty string")
        if not _is_int(item.offset) or item.offset < 0:
            raise HashingError(
                f"mm item {item.identifier!r}: offset must be an integer >= 0, got {item.offset!r}"
            )
        if not _is_int(item.length) or item.length < 1:
            raise HashingError(
                f"mm item {item.identifier!r}: length must be an integer >= 1, got {item.length!r}"
            )
        # vLLM walks the items with a cursor that assumes placeholder order; unsorted input would hash
        # differently from any engine.
        if item.offset < previous_offset:
            raise HashingError("mm items must be sorted by offset, as they appear in the prompt")
        previous_offset = item.offset
    return items


def _mm_keys(
    items: tuple[MMItem, ...], start: int, end: int, cursor: int
) -> tuple[list[tuple[str, str, int]], int]:
    """vLLM's `_gen_mm_extra_hash_keys`: ("mm", identifier, offset - start) for the items the cursor walk
    finds overlapping [start, end), and the cursor for the next block."""
    keys: list[tuple[str, str, int]] = []
    if not items:
        return keys, cursor
    last = items[-1]
    if last.offset + last.length <= start:
        return keys, cursor
    while cursor < len(items):
        item = items[cursor]
        if end <= item.offset:
            break  # the block ends before this item starts
        if start >= item.offset + item.length:
            cursor += 1  # the block is past this item
            continue
        # NOTE: negative when the item began in an earlier block; vLLM keeps it so.
        keys.append(("mm", item.identifier, item.offset - start))
        if end >= item.offset + item.length:
            cursor += 1  # the item ends here; the block may hold the next one too
        else:
            break
    return keys, cursor


def _window_keys(
    extras: RequestExtras, block_index: int, start: int, end: int, cursor: int
) -> tuple[ExtraKeys, int]:
    """`generate_block_hash_extra_keys` over [start, end): lora + mm... + cache_salt + prompt_embeds."""
    mm_keys, cursor = _mm_keys(extras.mm, start, end, cursor)
    keys: list[Any] = []
    if extras.lora is not None:
        keys.append(extras.lora)
    keys.extend(mm_keys)
    if start == 0 and extras.cache_salt:
        keys.append(("cache_salt", extras.cache_salt))
    if extras.prompt_embeds_digests is not None:
        keys.append(("prompt_embeds", extras.prompt_embeds_digests[block_index]))
    return (tuple(keys) if keys else None), cursor


def per_block_keys(
    extras: RequestExtras, token_ids: Sequence[int], block_size: int, num_blocks: int
) -> tuple[list[ExtraKeys], list[ExtraKeys]]:
    """(keys hashed into each block, keys published for each block in events), for blocks 0..num_blocks-1.

    With lookahead L the published keys E cover the window [start, end + L) and the hashed keys are
    (E, *token_ids[end:end + L]); the event carries those L tokens in its own field.
    """
    digests = extras.prompt_embeds_digests
    if digests is not None and len(digests) < num_blocks:
        raise HashingError(
            f"prompt_embeds_digests has {len(digests)} digests but the prompt has {num_blocks} full blocks"
        )
    lookahead = extras.lookahead
    hashed: list[ExtraKeys] = []
    published: list[ExtraKeys] = []
    cursor = 0
    for index in range(num_blocks):
        start = index * block_size
        end = start + block_size
        if lookahead:
            window_keys, cursor = _window_keys(extras, index, start, end + lookahead, cursor)
            # Rewind so an item reaching past this block is seen again by the next one.
            while cursor > 0:
                previous = extras.mm[cursor - 1]
                if previous.offset + previous.length <= end:
                    break
                cursor -= 1
            hashed.append((window_keys, *token_ids[end : end + lookahead]))
        else:
            window_keys, cursor = _window_keys(extras, index, start, end, cursor)
            hashed.append(window_keys)
        published.append(window_keys)
    return hashed, published


def untag(keys: ExtraKeys) -> tuple[Any, ...] | None:
    """`to_event_extra_keys` for one block: LoRA -> name, mm -> (identifier, offset), salt -> salt,
    prompt_embeds -> digest."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
