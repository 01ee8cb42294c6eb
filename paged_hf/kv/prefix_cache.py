"""The prefix cache over every layer group's pool: block hashes per sequence, hits, what admitting on a hit takes,
registering the blocks a step fills, and the hit statistics.

Each group registers its own full blocks under the same chained hashes (a block hash names a token prefix, not a
group), so a hybrid model's sliding-window group keeps the hashes of the blocks its window slid past: they stay
findable while they sit unreferenced in the pool, and with a host tier after their eviction too. A hit is the
longest block-aligned prefix every group can serve (``prefix_hit.find_longest_hit``: a full group needs every
block, a sliding group only those its next query can see).

Policy: a hit never covers a whole prompt (its last token is always computed); a hit is checked against the block's
stored token ids, so a hash collision never returns wrong K/V; blocks registered for a step whose forward fails are
unregistered (``end_step``), and so are blocks loaded from the host tier for it.
"""

from __future__ import annotations

from ..block_pool import BlockPool, KVBlock
from ..block_table import num_blocks_for
from ..hashing import extend_block_hashes
from .host_tier import HostTier
from .layer_groups import LayerGroup
from .prefix_hit import HOST, MISS, PrefixHit, find_longest_hit
from .sequence import SequenceKV


class PrefixCache:
    """Hashes and hits of full blocks in every group's pool; ``host``: the host tier of evicted blocks (or None).
    ``enabled=False``: never a hit, nothing registered."""

    def __init__(self, groups: list[LayerGroup], block_size: int, kv_format: str, enabled: bool,
                 host: HostTier | None = None) -> None:
        self.groups = groups
        self.block_size = block_size
        self.kv_format = kv_format  # part of every hash: a block's bytes depend on it
        self.enabled = enabled
        self.host = host
        if host is not None:
            for g, group in enumerate(groups):
                group.pool.on_evict = host.evict_hook(g)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.host_hit_tokens = 0  # of ``hit_tokens``, those whose blocks came from the host tier
        self._step_registered: list[tuple[BlockPool, KVBlock]] = []  # hashed for the step being scheduled / run

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached / prompt tokens looked up (0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def _update_hashes(self, seq: SequenceKV, token_ids: list[int], salt) -> None:
        extend_block_hashes(seq.block_hashes, token_ids, self.block_size, (self.kv_format, salt))

    def find_hit(self, seq: SequenceKV, token_ids: list[int], salt=None) -> PrefixHit:
        """The longest cached prefix of ``token_ids`` every group can serve (never its last token)."""
        if not self.enabled:
            return MISS
        self._update_hashes(seq, token_ids, salt)
        bs, hashes, host = self.block_size, seq.block_hashes, self.host

        def lookup(g: int, i: int):
            tokens = token_ids[i * bs : (i + 1) * bs]
            block = self.groups[g].pool.get_cached_block(hashes[i], tokens)
            if block is None and host is not None and host.contains(g, hashes[i], tokens):
                return HOST
            return block

        return find_longest_hit(self.groups, lookup, (len(token_ids) - 1) // bs)

    def admission_blocks(self, hit: PrefixHit, num_new_tokens: int) -> list[int]:
        """Free blocks admitting a sequence on ``hit`` takes in each group: new blocks, hits that now sit in the free
        queue, and hits the host tier copies into new blocks."""
        bs, out = self.block_size, []
        first_new = hit.num_tokens // bs
        new = num_blocks_for(hit.num_tokens + num_new_tokens, bs) - first_new
        for g in range(len(self.groups)):
            if not hit.groups:
                out.append(new)
                continue
            blocks = hit.groups[g].blocks
            out.append(new + sum(1 for b in blocks if b is None or b.ref_cnt == 0))
        return out

    def admit(self, seq: SequenceKV, hit: PrefixHit, token_ids: list[int], count_query: bool) -> None:
        """Starts ``seq``'s empty tables on ``hit`` (its room was checked): a reference to each device block, a new
        block for each host-tier one (the copies recorded, the blocks registered again). Device hits are referenced
        before any block is allocated, so the allocation cannot evict them. ``count_query``: count the lookup in
        the hit-rate statistics."""
        seq.num_cached_blocks = hit.num_tokens // self.block_size
        if count_query:
            self.queried_tokens += len(token_ids)
            self.hit_tokens += hit.num_tokens
            self.host_hit_tokens += hit.num_host_blocks * self.block_size
        bs, hashes = self.block_size, seq.block_hashes
        for g, (group, table, part) in enumerate(zip(self.groups, seq.tables, hit.groups)):
            held = [b for b in part.blocks if b is not None]
            group.pool.touch(held)
            missing = [part.num_skipped + i for i, b in enumerate(part.blocks) if b is None]
            blocks = list(part.blocks)
            if missing:
                self.host.pin([(g, hashes[i]) for i in missing])
                new = group.pool.get_new_blocks(len(missing))
                self.host.load(g, [(hashes[i], b.block_id) for i, b in zip(missing, new)])
                for i, block in zip(missing, new):
                    blocks[i - part.num_skipped] = block
                    self._register(group.pool, block, hashes[i], token_ids[i * bs : (i + 1) * bs])
            table.restore(hit.num_tokens, part.num_skipped, blocks)

    def _register(self, pool: BlockPool, block: KVBlock, block_hash: int, token_ids, computed: bool = False) -> None:
        pool.cache_full_block(block, block_hash, token_ids)
        if block.block_hash is not None and not computed:
            self._step_registered.append((pool, block))

    def counters(self) -> dict[str, int]:
        """The ``KVCacheStats`` fields of the prefix cache and its host tier (tokens, blocks)."""
        host = self.host
        return dict(prefix_cache_queries=self.queried_tokens, prefix_cache_hits=self.hit_tokens,
                    prefix_cache_host_hits=self.host_hit_tokens,
                    host_cache_blocks_used=0 if host is None else host.num_used_blocks,
                    host_cache_blocks_total=0 if host is None else host.num_blocks * len(self.groups),
                    host_cache_bytes=0 if host is None else host.nbytes)

    def cache_full_blocks(self, seq: SequenceKV, token_ids: list[int], num_tokens: int, salt=None,
                          computed: bool = False) -> None:
        """Registers the full blocks among the first ``num_tokens`` of ``token_ids`` in every group.

        Called when a step is scheduled, for the tokens it will have computed: a sequence admitted later in the same
        step can then hit blocks this step's forward fills, which is correct because every layer stores the whole
        step's K/V before it attends. ``end_step(failed=True)`` unregisters them if the forward fails, unless
        ``computed``: earlier steps computed these tokens (blocks registered after the fact), their K/V stays.
        """
        if not self.enabled:
            return
        full = num_tokens // self.block_size
        if full <= seq.num_cached_blocks:
            return
        self._update_hashes(seq, token_ids, salt)
        bs = self.block_size
        for group, table in zip(self.groups, seq.tables):
            for i in range(seq.num_cached_blocks, full):
                block = table.blocks[i]
                if block is not None and block.block_hash is None:
                    self._register(group.pool, block, seq.block_hashes[i], token_ids[i * bs : (i + 1) * bs],
                                   computed)
        seq.num_cached_blocks = full

    def check_invariants(self) -> None:
        if self.host is not None:
            self.host.check_invariants()

    def end_step(self, failed: bool) -> None:
        """Closes a step: after a failed forward, the blocks registered for it hold no K/V: unregister them."""
        if failed:
            for pool, block in self._step_registered:
                if block.block_hash is not None:
                    pool.uncache_block(block)
        self._step_registered = []
