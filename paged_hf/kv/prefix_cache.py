"""The prefix cache over one pool: block hashes per sequence, hits, what admitting on hits takes, registering the
blocks a step fills, and the hit statistics.

Works on full-attention models only (a sliding window drops the blocks a later hit would need): the manager turns it
off for any other. Policy: a hit never covers a whole prompt (its last token is always computed); a hit is checked
against the block's stored token ids, so a hash collision never returns wrong K/V; blocks registered for a step
whose forward fails are unregistered (``end_step``).
"""

from __future__ import annotations

from ..block_pool import BlockPool, KVBlock
from ..block_table import num_blocks_for
from ..hashing import extend_block_hashes
from .sequence import SequenceKV


class PrefixCache:
    """Hashes and hits of full blocks in ``pool`` (the full-attention group's). ``enabled=False``: never a hit,
    nothing registered."""

    def __init__(self, pool: BlockPool, block_size: int, kv_format: str, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.kv_format = kv_format  # part of every hash: a block's bytes depend on it
        self.enabled = enabled
        self.queried_tokens = 0
        self.hit_tokens = 0
        self._step_registered: list[KVBlock] = []  # blocks hashed for the step being scheduled / run

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached / prompt tokens looked up (0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def _update_hashes(self, seq: SequenceKV, token_ids: list[int], salt) -> None:
        extend_block_hashes(seq.block_hashes, token_ids, self.block_size, (self.kv_format, salt))

    def find_hits(self, seq: SequenceKV, token_ids: list[int], salt=None) -> list[KVBlock]:
        """Cached blocks covering the longest computed prefix of ``token_ids`` (never its last token)."""
        if not self.enabled:
            return []
        self._update_hashes(seq, token_ids, salt)
        bs = self.block_size
        hits = []
        for i, block_hash in enumerate(seq.block_hashes[: (len(token_ids) - 1) // bs]):
            block = self.pool.get_cached_block(block_hash, token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def admission_blocks(self, hits: list[KVBlock], num_new_tokens: int) -> int:
        """Free blocks admitting a sequence takes: new blocks plus hits that now sit in the free queue."""
        new = num_blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size) - len(hits)
        return new + sum(1 for b in hits if b.ref_cnt == 0)

    def count_query(self, num_prompt_tokens: int, num_hits: int) -> None:
        """Counts one lookup of ``num_prompt_tokens`` that hit ``num_hits`` blocks in the hit-rate statistics."""
        self.queried_tokens += num_prompt_tokens
        self.hit_tokens += num_hits * self.block_size

    def cache_full_blocks(self, seq: SequenceKV, token_ids: list[int], num_tokens: int, salt=None) -> None:
        """Registers the full blocks among the first ``num_tokens`` of ``token_ids`` (``seq``'s table 0).

        Called when a step is scheduled, for the tokens it will have computed: a sequence admitted later in the same
        step can then hit blocks this step's forward fills, which is correct because every layer stores the whole
        step's K/V before it attends. ``end_step(failed=True)`` unregisters them if the forward fails.
        """
        if not self.enabled:
            return
        full = num_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        self._update_hashes(seq, token_ids, salt)
        bs, table = self.block_size, seq.tables[0]
        for i in range(seq.num_cached_blocks, full):
            block = table.blocks[i]
            if block.block_hash is None:
                self.pool.cache_full_block(block, seq.block_hashes[i], token_ids[i * bs : (i + 1) * bs])
                if block.block_hash is not None:
                    self._step_registered.append(block)
        seq.num_cached_blocks = full

    def end_step(self, failed: bool) -> None:
        """Closes a step: after a failed forward, the blocks registered for it hold no K/V: unregister them."""
        if failed:
            for block in self._step_registered:
                if block.block_hash is not None:
                    self.pool.uncache_block(block)
        self._step_registered = []
