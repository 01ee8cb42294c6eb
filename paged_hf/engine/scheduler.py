"""Iteration-level scheduler: which sequences run in the next forward, and how many tokens each.

Each step: running sequences first (decodes, then prefill chunks still under way), then swapped-out sequences
come back, then waiting ones are admitted, all within ``max_num_batched_tokens`` and ``max_num_seqs``. When
blocks run out a victim is preempted: the newest sequence under "fcfs", the lowest priority (largest value)
under "priority"; by swap to CPU or by recompute (drop its KV, prefill it again later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..config import EngineConfig
from .kv_manager import KVCacheManager
from .request import Sequence, SequenceStatus

# "auto" preemption swaps a sequence with at least this many computed blocks (recomputing it would cost more
# than copying its blocks both ways); shorter ones are recomputed.
AUTO_SWAP_MIN_BLOCKS = 4


@dataclass
class SchedulerOutput:
    # (sequence, tokens to compute this step, per layer group (slots, copy-on-write copies)), in running order
    scheduled: list[tuple[Sequence, int, list]]
    preempted: list[Sequence]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def _order(self, seq: Sequence) -> tuple:
        """Sort key: who runs first (and, reversed, who is preempted first)."""
        arrival = seq.request.metrics.arrival_time
        if self.config.scheduling_policy == "priority":
            return (seq.request.priority, arrival, seq.index)
        return (arrival, seq.index)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if self.config.scheduling_policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=self._order))

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)

    # ------------------------------------------------------------------------------ preemption
    def _preempt(self, victim: Sequence, preempted: list[Sequence]) -> None:
        self.running.remove(victim)
        victim.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        mode = self.config.preemption_mode
        blocks = victim.num_computed_tokens // self.kv.block_size
        swap = mode == "swap" or (mode == "auto" and blocks >= AUTO_SWAP_MIN_BLOCKS)
        if swap and self.kv.can_swap_out(victim):
            self.kv.swap_out(victim)
            victim.status = SequenceStatus.SWAPPED
            self.swapped.append(victim)
            self.num_swapped_out += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.num_cached_blocks = 0
            victim.status = SequenceStatus.WAITING
            self.waiting.appendleft(victim)
            if self.config.scheduling_policy == "priority":
                self.waiting = deque(sorted(self.waiting, key=self._order))
        preempted.append(victim)

    # -------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list = []
        preempted: list[Sequence] = []
        self.running.sort(key=self._order)

        # 1. running sequences, oldest / most important first; decodes take one token
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = min(seq.num_uncomputed_tokens, budget)
            while self.kv.blocks_to_append(seq, count) > self.kv.num_free_blocks:
                victim = max(self.running[index:], key=self._order)
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            else:
                self.kv_reserve(seq, count, scheduled)
                budget -= count
                index += 1
                continue
            # seq itself was preempted: later ones have lower priority, stop here
            break

        # 2. swapped sequences come back first, unless this step had to preempt
        while self.swapped and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            need = self.kv.swap_in_blocks(seq) + 1
            if need > self.kv.num_free_blocks:
                break
            self.swapped.popleft()
            self.kv.swap_in(seq)
            seq.status = SequenceStatus.RUNNING
            self.num_swapped_in += 1
            self.running.append(seq)
            count = min(seq.num_uncomputed_tokens, budget)
            if self.kv.blocks_to_append(seq, count) > self.kv.num_free_blocks:
                break  # runs next step
            self.kv_reserve(seq, count, scheduled)
            budget -= count

        # 3. waiting sequences (new, or preempted by recompute), in order: no overtaking
        while self.waiting and not self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.find_prefix_hits(seq)
            count = min(len(seq.token_ids) - len(hits) * self.kv.block_size, budget)
            if self.kv.admission_blocks(seq, hits, count) > self.kv.num_free_blocks:
                break
            self.waiting.popleft()
            self.kv.admit(seq, hits)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.monotonic()
                seq.request.metrics.num_prefix_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.kv_reserve(seq, count, scheduled)
            budget -= count
        return SchedulerOutput(scheduled, preempted)

    def kv_reserve(self, seq: Sequence, count: int, scheduled: list) -> None:
        """Allocates the slots of ``count`` tokens of ``seq`` (capacity was checked), schedules them, and registers
        the blocks they fill in the prefix cache (later admissions of this step may hit them)."""
        scheduled.append((seq, count, self.kv.append_slots(seq, count)))
        self.kv.cache_full_blocks(seq, seq.num_computed_tokens + count)
