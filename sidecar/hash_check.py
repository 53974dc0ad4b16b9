"""The sidecar's full-rate hash check: every BlockStored whose blocks can be recomputed from the event is
recomputed, not a sample. A run from the prompt's first block chains from the root; a run that continues a
cached prefix chains from its parent's full digest, which the sidecar kept when it checked the parent (the
event form is only the digest's last 8 bytes, so a parent it never saw cannot be extended: counted as
unverifiable). Pure: no IO, clocks or threads."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.hashing import BlockHasher, HashingError, event_hash
from kvindex.indexer.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent


class RankHashCheck:
    """One DP rank's checker: block key -> the full digest of each block checked and still held."""

    def __init__(self, hasher: BlockHasher) -> None:
        self._hasher = hasher
        self._block_size = hasher.block_size
        self._digests: dict[int, bytes] = {}
        self.checked = 0  # BlockStored events recomputed
        self.mismatched = 0  # of those, the ones whose recomputed keys differ
        self.unverifiable = 0  # with tokens, but a parent never checked (or extra keys / lookahead)

    def apply(self, events: Sequence[KVEvent]) -> list[BlocksStored]:
        """Check the batch's events in order (decoded with their token ids); the mismatching ones."""
        mismatches = []
        for event in events:
            if type(event) is BlocksStored:
                if not self._check(event):
                    mismatches.append(event)
            elif type(event) is BlocksRemoved:
                for key in event.block_keys:
                    self._digests.pop(key, None)  # a child of it can only be checked while it is held
            elif type(event) is AllBlocksCleared:
                self._digests.clear()
        return mismatches

    def clear(self) -> None:
        self._digests.clear()

    def _check(self, event: BlocksStored) -> bool:
        """False only for a mismatch; events that cannot be recomputed count as unverifiable."""
        keys = event.block_keys
        if not keys or not event.token_ids:
            return True  # nothing to recompute from (tokens not published)
        plain = (
            event.lora_name is None
            and event.lookahead_token_ids is None
            and (event.extra_keys is None or all(k is None for k in event.extra_keys))
            and event.block_size == self._block_size
            and len(event.token_ids) == len(keys) * self._block_size
        )
        parent = self._hasher.root if event.parent_key is None else self._digests.get(event.parent_key)
        if not plain or parent is None:
            self.unverifiable += 1
            return True
        try:
            digests = self._hasher.block_hashes_after(parent, event.token_ids)
        except HashingError:
            digests = []
        self.checked += 1
        if [event_hash(d) for d in digests] != list(keys):
            self.mismatched += 1
            return False
        self._digests.update(zip(keys, digests, strict=True))
        return True
