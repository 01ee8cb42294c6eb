"""The longest cached prefix every layer group can serve (vLLM's hybrid rule, searched from the right).

A hit of ``L`` tokens (block-aligned) lets the next forward start at position ``L``. Group ``g`` can serve it when
it holds every block the queries from ``L`` on can still see: ``policy.first_needed(L)`` on, i.e. all blocks for
full attention, and only the blocks covering the last ``window - 1`` positions before ``L`` for a sliding window
(older ones may have been freed and evicted; they are never read again). A full group's servable lengths are a
prefix-closed set; a sliding group's are not (a later run of cached blocks can serve a longer hit than an earlier
gap allows), so each group is searched from the right for the longest length it serves at most the current bound,
and the groups are asked in turn until they agree (the bound only falls, so this ends).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..block_pool import KVBlock
from .layer_groups import LayerGroup

HOST = "host"  # a block found in the host tier, not in the device pool


@dataclass(frozen=True)
class GroupHit:
    """One group's part of a hit: ``num_skipped`` leading blocks it does not need (outside its window), then
    ``blocks``: the device blocks it takes a reference to, ``None`` for one the host tier copies in."""

    num_skipped: int
    blocks: tuple[KVBlock | None, ...]

    @property
    def num_host_blocks(self) -> int:
        return sum(b is None for b in self.blocks)


@dataclass(frozen=True)
class PrefixHit:
    """The first ``num_tokens`` tokens served from the cache; ``groups[g]``: group ``g``'s blocks (empty: a miss)."""

    num_tokens: int
    groups: tuple[GroupHit, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Hit blocks of the group holding the most (the full-attention one, when there is one)."""
        return max((len(g.blocks) for g in self.groups), default=0)

    @property
    def num_host_blocks(self) -> int:
        """Of those, the blocks the host tier serves (the hit's host-tier share)."""
        return max((g.num_host_blocks for g in self.groups), default=0)


MISS = PrefixHit(0)

Lookup = Callable[[int, int], "KVBlock | str | None"]  # (group, block index) -> device block, HOST, or None


def longest_servable(cached: Callable[[int], bool], max_blocks: int, first_block: Callable[[int], int]) -> int:
    """The largest ``k <= max_blocks`` such that blocks ``first_block(k) .. k - 1`` are all ``cached`` (0 always
    qualifies). ``first_block`` must not fall as ``k`` grows. Each block is asked at most once per run of ``k``."""
    k = max_blocks
    while k > 0:
        start = max(0, first_block(k))
        j = k - 1
        while j >= start and cached(j):
            j -= 1
        if j < start:
            return k
        k = j  # block j is missing: no length that needs it qualifies, and shorter ones no longer need it
    return 0


def find_longest_hit(groups: list[LayerGroup], lookup: Lookup, max_blocks: int) -> PrefixHit:
    """The longest hit of at most ``max_blocks`` blocks that every group serves, from ``lookup``'s answers (each
    (group, block) is looked up once)."""
    if max_blocks <= 0 or not groups:
        return MISS
    found: dict[tuple[int, int], KVBlock | str | None] = {}

    def where(g: int, i: int):
        if (g, i) not in found:
            found[g, i] = lookup(g, i)
        return found[g, i]

    bs = groups[0].block_size
    firsts = [_first_block(group, bs) for group in groups]
    order = sorted(range(len(groups)), key=lambda g: groups[g].window is not None)  # full groups bound it first
    bound, changed = max_blocks, True
    while changed:  # a pass in which no group lowers the bound: every group serves it
        changed = False
        for g in order:
            if groups[g].window is None:  # prefix-closed: the first missing block, from the left
                k = next((i for i in range(bound) if where(g, i) is None), bound)
            else:
                k = longest_servable(lambda i, g=g: where(g, i) is not None, bound, firsts[g])
            if k != bound:
                bound, changed = k, True
        if bound == 0:
            return MISS
    out = []
    for g, first in enumerate(firsts):
        start = first(bound)
        out.append(GroupHit(start, tuple(None if where(g, i) is HOST else where(g, i) for i in range(start, bound))))
    return PrefixHit(bound * bs, tuple(out))


def _first_block(group: LayerGroup, block_size: int) -> Callable[[int], int]:
    """For a hit of ``k`` blocks, the first block group ``group`` still needs."""
    policy = group.policy
    return lambda k: max(0, policy.first_needed(k * block_size)) // block_size
