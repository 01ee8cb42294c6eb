"""Stateful property test: random block-table traffic against a small BlockPool.

Alongside the real objects it keeps a model: each table's logical tokens and a fake KV
storage (block_id -> list of slot values). Appends write fresh token values into the returned
slots after applying the returned copies, so any missing or wrong copy-on-write shows up as a
table reading back a token it never wrote, or a cached block whose storage no longer matches
its hashed token ids.
"""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv_probe import block_ids, free_order
from paged_hf.block_pool import BlockPool, NoFreeBlocksError
from paged_hf.block_table import BlockTable, num_blocks_for
from paged_hf.hashing import extend_block_hashes

MAX_BLOCKS = 40
MAX_TABLES = 8
index = st.integers(min_value=0, max_value=1_000)


class PoolMachine(RuleBasedStateMachine):
    pool: BlockPool | None = None

    @initialize(num_blocks=st.integers(8, 20), block_size=st.sampled_from([1, 2, 4, 16]),
                enable_caching=st.booleans(), hash_mod=st.sampled_from([None, 3]))
    def setup(self, num_blocks, block_size, enable_caching, hash_mod):
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.bs = block_size
        self.hash_mod = hash_mod  # 3: a deliberately weak hash, so collisions and duplicates happen
        self.tables: list[BlockTable] = []
        self.contents: list[list[int]] = []  # logical token values of each live table
        self.storage: dict[int, list[int | None]] = {}
        self.hashed_prefixes: list[list[int]] = []  # token prefixes registered in the cache
        self.next_token = 0

    # ------------------------------------------------------------------ helpers

    def snapshot(self):
        pool = self.pool
        return (
            free_order(pool),
            [(b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
            [(block_ids(t), t.num_tokens) for t in self.tables],
        )

    def append(self, table: BlockTable, content: list[int], n: int, values: list[int] | None = None) -> bool:
        """Appends ``n`` tokens (``values``, or fresh ones) to ``table`` and writes them to the fake storage."""
        if values is None:
            values = list(range(self.next_token, self.next_token + n))
            self.next_token += n
        assert len(values) == n
        before = self.snapshot()
        old_ids, old_len = block_ids(table), table.num_tokens
        expected_needed = table.num_new_blocks_needed(n)
        try:
            copies = table.append(n)
        except NoFreeBlocksError as err:
            assert err.num_needed == expected_needed > err.num_free == self.pool.num_free_blocks
            assert self.snapshot() == before, "a failed append changed the pool or a table"
            return False
        assert expected_needed <= n + 1
        assert table.num_tokens == old_len + n
        slots = [table.blocks[p // self.bs].block_id * self.bs + p % self.bs for p in range(old_len, old_len + n)]
        assert len(copies) <= 1
        for src, dst in copies:
            assert old_len % self.bs != 0 and old_ids[-1] == src and block_ids(table)[len(old_ids) - 1] == dst
            self.storage[dst] = list(self.storage[src])
        for slot, value in zip(slots, values):
            self.storage.setdefault(slot // self.bs, [None] * self.bs)[slot % self.bs] = value
            content.append(value)
        return True

    def block_hashes(self, tokens: list[int]) -> list[int]:
        hashes = extend_block_hashes([], tokens, self.bs)
        return hashes if self.hash_mod is None else [h % self.hash_mod for h in hashes]

    def cache_blocks(self, table: BlockTable, content: list[int], ks: list[int]) -> None:
        """Registers the (full, held, unhashed) blocks ``ks`` of ``table`` in the prefix cache."""
        if not ks:
            return
        hashes = self.block_hashes(content[: (max(ks) + 1) * self.bs])
        for k in ks:
            prefix = content[: (k + 1) * self.bs]
            self.pool.cache_full_block(table.blocks[k], hashes[k], prefix[k * self.bs:])
            if self.pool.enable_caching:
                self.hashed_prefixes.append(prefix)

    def cacheable(self, table: BlockTable) -> list[int]:
        full = table.num_tokens // self.bs
        return [k for k in range(full) if table.blocks[k] is not None and table.blocks[k].block_hash is None]

    def pick(self, i):
        k = i % len(self.tables)
        return self.tables[k], self.contents[k], k

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.tables) < MAX_TABLES)
    @rule(x=index)
    def new_table(self, x):
        n = x % (3 * self.bs + 1)  # 0 .. 3 blocks' worth
        table, content = BlockTable(self.pool, self.bs), []
        self.append(table, content, n)
        self.tables.append(table)
        self.contents.append(content)

    @precondition(lambda self: self.tables)
    @rule(i=index, x=index)
    def append_tokens(self, i, x):
        n = x % (2 * self.bs) + 1  # 1 .. 2 blocks' worth
        table, content, _ = self.pick(i)
        self.append(table, content, n)

    @precondition(lambda self: self.tables)
    @rule(i=index)
    def decode_one_token(self, i):
        """A decode's append as the engine's steady step makes it (``KVManager.append_decodes``): in the tail in
        place, or a new block when the tail is full, else (a shared or hashed partial tail) the general append."""
        table, content, _ = self.pick(i)
        if table.append_in_tail():
            position = table.num_tokens - 1
        elif table.num_tokens % self.bs == 0:
            before = self.snapshot()
            if table.append_new_block() is None:
                assert self.pool.num_free_blocks == 0 and self.snapshot() == before
                return
            position = table.num_tokens - 1
            assert position % self.bs == 0 and table.blocks[-1].ref_cnt == 1
        else:
            self.append(table, content, 1)
            return
        assert len(table.blocks) == num_blocks_for(position + 1, self.bs)
        block = table.blocks[position // self.bs]
        self.storage.setdefault(block.block_id, [None] * self.bs)[position % self.bs] = self.next_token
        content.append(self.next_token)
        self.next_token += 1

    @precondition(lambda self: 0 < len(self.tables) < MAX_TABLES)
    @rule(i=index, then=st.sampled_from([None, "parent", "child"]), x=index)
    def fork(self, i, then, x):
        """Forks a table, then maybe appends to one side (a partial shared tail must be copied)."""
        table, content, _ = self.pick(i)
        child = table.fork()
        assert block_ids(child) == block_ids(table) and child.num_tokens == table.num_tokens
        self.tables.append(child)
        self.contents.append(list(content))
        if then == "parent":
            self.append(table, content, x % self.bs + 1)
        elif then == "child":
            self.append(child, self.contents[-1], x % self.bs + 1)

    @precondition(lambda self: self.tables)
    @rule(i=index, x=index, then_append=st.integers(0, 3))
    def truncate(self, i, x, then_append):
        """Rolls a table back (rejected draft tokens), then maybe writes new ones over the old tail."""
        table, content, _ = self.pick(i)
        n = x % (table.num_tokens + 1)
        keep = num_blocks_for(n, self.bs)
        if keep > 0 and table.blocks[keep - 1] is None:
            before = self.snapshot()
            try:
                table.truncate(n)
            except ValueError:
                assert self.snapshot() == before
                return
            raise AssertionError("truncate into freed blocks must raise ValueError")
        table.truncate(n)
        del content[n:]
        self.append(table, content, then_append)

    @precondition(lambda self: self.tables)
    @rule(i=index, x=index)
    def free_blocks_before(self, i, x):
        table, _, _ = self.pick(i)
        position = x % (table.num_tokens + 1)
        old_ids = block_ids(table)
        table.free_blocks_before(position)
        expected = [-1 if (k + 1) * self.bs <= position else b for k, b in enumerate(old_ids)]
        assert block_ids(table) == expected

    @precondition(lambda self: self.tables)
    @rule(i=index, j=index, in_order=st.booleans())
    def cache_full_blocks(self, i, j, in_order):
        """Hashes the full held blocks up to a random one (as the engine does), or one random block."""
        table, content, _ = self.pick(i)
        candidates = self.cacheable(table)
        if candidates:
            last = candidates[j % len(candidates)]
            self.cache_blocks(table, content, [k for k in candidates if k <= last] if in_order else [last])

    def admit(self, tokens: list[int], extra: int) -> None:
        """Admits a sequence as the engine does: verified prefix-cache hits over ``tokens``, then
        the rest of ``tokens`` (recomputed) and ``extra`` fresh tokens."""
        prefix = tokens
        hits = []
        for k, h in enumerate(self.block_hashes(prefix)):
            block = self.pool.get_cached_block(h, prefix[k * self.bs:(k + 1) * self.bs])
            if block is None:
                break
            assert block.token_ids == tuple(prefix[k * self.bs:(k + 1) * self.bs])
            hits.append(block)
        table = BlockTable(self.pool, self.bs)
        table.append_cached_blocks(hits)
        assert block_ids(table) == [b.block_id for b in hits] and table.num_tokens == len(hits) * self.bs
        content = list(prefix[: table.num_tokens])
        self.tables.append(table)
        self.contents.append(content)
        rest = prefix[table.num_tokens:]
        if self.append(table, content, len(rest), rest):
            self.append(table, content, extra)

    @precondition(lambda self: self.hashed_prefixes and len(self.tables) < MAX_TABLES)
    @rule(j=index, x=index)
    def new_table_from_prefix_hit(self, j, x):
        self.admit(self.hashed_prefixes[j % len(self.hashed_prefixes)], x % (2 * self.bs))

    @precondition(lambda self: self.tables)
    @rule(i=index, x=index)
    def finish_and_readmit(self, i, x):
        """Caches a table's full blocks, frees it, and admits its tokens again (prefix hits on ref-0 blocks)."""
        table, content, k = self.pick(i)
        self.cache_blocks(table, content, self.cacheable(table))
        table.free()
        del self.tables[k], self.contents[k]
        self.admit(content, x % self.bs)

    @precondition(lambda self: self.tables)
    @rule(i=index, cache_first=st.booleans())
    def free_table(self, i, cache_first):
        """Frees a table, optionally caching its full blocks first (a finished sequence)."""
        table, content, k = self.pick(i)
        if cache_first:
            self.cache_blocks(table, content, self.cacheable(table))
        table.free()
        assert table.blocks == [] and table.num_tokens == 0
        del self.tables[k], self.contents[k]

    @precondition(lambda self: self.pool is not None and self.pool.num_blocks < MAX_BLOCKS)
    @rule(n=st.integers(0, 4))
    def grow(self, n):
        old = self.pool.num_blocks
        self.pool.grow(n)
        assert self.pool.num_blocks == old + n

    # ------------------------------------------------------------------ invariants

    @invariant()
    def pool_consistent(self):
        if self.pool is None:
            return
        self.pool.check_invariants()
        refs = Counter(b.block_id for t in self.tables for b in t.blocks if b is not None)
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} table references")

    @invariant()
    def tables_consistent(self):
        if self.pool is None:
            return
        for table, content in zip(self.tables, self.contents):
            assert len(content) == table.num_tokens
            assert len(table.blocks) == num_blocks_for(table.num_tokens, self.bs)
            ids = block_ids(table)
            num_none = ids.count(-1)
            assert ids[:num_none] == [-1] * num_none, "freed blocks must form a prefix"
            for p in range(num_none * self.bs, table.num_tokens):
                assert self.storage[ids[p // self.bs]][p % self.bs] == content[p], (
                    f"position {p} reads back a token it did not write")

    @invariant()
    def in_place_tails_are_private(self):
        """A table that would write its partial tail in place (``append_in_tail``) holds it alone, unhashed."""
        if self.pool is None:
            return
        for table in self.tables:
            if table.num_tokens % self.bs and table._tail_private:
                tail = table.blocks[-1]
                assert tail.ref_cnt == 1 and tail.block_hash is None, f"{tail} would be written in place"

    @invariant()
    def cached_blocks_hold_their_tokens(self):
        if self.pool is None:
            return
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert tuple(self.storage[block.block_id]) == block.token_ids

    def teardown(self):
        if self.pool is None:
            return
        for table in self.tables:
            table.free()
        assert self.pool.num_used_blocks == 0
        assert self.pool.num_free_blocks == self.pool.num_blocks
        self.pool.check_invariants()


PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestPoolMachine = PoolMachine.TestCase
