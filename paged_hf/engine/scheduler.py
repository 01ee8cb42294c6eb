"""Iteration-level scheduler: the owner of every request and sequence state. It picks which sequences run in the
next forward and how many tokens each (``schedule``), and makes every change after the forward
(``update_from_output``, in ``step_update.py``): computed tokens, prompt logprobs, the samples of ``n > 1`` joining
their prompt, the new tokens and their logprobs, finishing (EOS, stop tokens, lengths, and stop strings on the output
stage's verdict), failures, and the prefix cache's step. Requests whose grammar compiles wait in ``grammar_queue.py``;
the end test after each token is ``ends.py``; the step's typed output is ``scheduled.py``.

Each step: running sequences first (oldest / most important first), then swapped-out sequences come back, then
waiting ones are admitted, all within ``max_num_batched_tokens`` and ``max_num_seqs``. When blocks run out a victim
is preempted: the newest sequence under "fcfs", the lowest priority (largest value) under "priority" and "lpm"; by
swap to CPU or by recompute (drop its KV, prefill it again later). The output lists one-token sequences (decodes)
first. Under "lpm" the waiting queue is ordered each step by the longest cached prefix within a priority level
(``lpm.py``).

Blocks that decode steps fill are registered in the prefix cache before the next lookup (``_register_running``) or
when their sequence ends or is preempted, not by the steps themselves: a steady decode step hashes nothing.
A prompt in flight never makes a later admission compute its prefix again: running sequences are scheduled first,
the blocks a chunk fills are registered when it is scheduled (so admissions of the same step hit them), and a chunk
shorter than the rest of its prompt used up the step's token budget (or a sliding window's whole pool: a prompt with
more blocks than that pool is computed in chunks it holds, ``KVManager.max_chunk``), so nothing is admitted after it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from itertools import islice

from ..config import EngineConfig
from ..kv.manager import KVManager
from ..kv.prefix_hit import MISS, PrefixHit
from .ends import RequestEnds
from .grammar_queue import GrammarQueue, give_matchers
from .lpm import lpm_order
from .multimodal import ImageChunks
from .request import Request, Sequence, SequenceStatus
from .scheduled import ScheduledSequence, SchedulerOutput
from .spec import Speculator
from .step_update import StepUpdate

logger = logging.getLogger("paged_hf")

# "auto" preemption swaps a sequence with at least this many computed blocks (recomputing it would cost more
# than copying its blocks both ways); shorter ones are recomputed.
AUTO_SWAP_MIN_BLOCKS = 4


class Scheduler(StepUpdate):
    """The owner of request and sequence state (this module's docstring); the after-step half of its methods
    (``update_from_output``) is in ``step_update.py``."""

    def __init__(self, config: EngineConfig, kv: KVManager, eos_token_ids: set[int], max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}  # every request not finished, by id
        self.num_generated_tokens = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.compiling = GrammarQueue()  # structured outputs whose grammar is compiling: queued once it is ready
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self._priority = config.scheduling_policy in ("priority", "lpm")
        self._lpm = config.scheduling_policy == "lpm" and kv.prefix_caching
        self._running_sorted = True  # ``running`` is in ``_order``; appending may break that
        self._has_windows = any(g.window is not None for g in kv.groups)
        spec = config.speculative_config
        self.speculator = Speculator(spec, kv.block_size if kv.has_tail else None) if spec is not None else None
        self._speculating = False  # this step's mode (the speculator's switch)
        self._drafting = False  # whether this step has drafts (speculating, and something was proposed)
        self._ends: dict[str, RequestEnds] = {}  # per request id not finished
        self.epoch = 0  # bumped by every change to ``running`` but a sequence's next token (``SchedulerOutput.epoch``)
        self._batch_ends = None  # (the runner's persistent decode batch, its BatchEnds), built at its first step
        self._forking: set[str] = set()  # requests of n > 1 whose other samples wait for the prompt (FORK_PENDING)
        # (epoch, the running sequences, their kv, ``kv.decode_tables`` of those) when the last step's decodes were
        # all of them, in order: at the same epoch each is a decode again (it got its token, nothing else changed)
        self._decode_run: tuple | None = None
        # with prefix caching, whether decode runs (``_schedule_decodes``, which registers nothing) scheduled tokens
        # since the last lookup: the running sequences' computed blocks are registered before the next lookup
        # (``_register_running``), and a sequence's own before it leaves ``running`` (``_register``)
        self.unregistered_decodes = False

    def _order(self, seq: Sequence) -> tuple:
        """Sort key: who runs first (and, reversed, who is preempted first)."""
        arrival = seq.request.metrics.arrival_time
        if self._priority:
            return (seq.request.priority, arrival, seq.index)
        return (arrival, seq.index)

    def add(self, request: Request) -> None:
        """Queues a checked request (its other samples wait for its prompt, ``FORK_PENDING``); one whose grammar is
        still compiling waits in ``compiling`` without holding up the others (``admit_compiled``)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self._ends[request.request_id] = RequestEnds.of(request, self.eos_token_ids, self.max_model_len)
        if request.params.n > 1:
            self._forking.add(request.request_id)
        if not self.compiling.hold(request):  # compiling, or failed: admit_compiled queues or fails it
            self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        give_matchers(request, self.eos_token_ids)
        self.waiting.append(request.sequences[0])
        if self._priority:
            self.waiting = deque(sorted(self.waiting, key=self._order))

    def admit_compiled(self) -> list[Request]:
        """Queues the requests whose grammar compiled; fails those whose compilation raised and returns them."""
        ready, failed = self.compiling.settle(idle=not (self.running or self.waiting or self.swapped))
        for request in ready:
            self._enqueue(request)
        for request, error in failed:
            self.fail(request, error)
        return [request for request, _ in failed]

    def abort(self, request_id: str) -> Request | None:
        """Stops a request and frees its blocks (no output follows); unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            for seq in request.sequences:
                self.finish(seq, "abort")
        return request

    def fail(self, request: Request, error: BaseException) -> None:
        """Ends every sample of ``request`` with ``finish_reason="error"``; the first error is the one reported."""
        if request.error is not None:
            return
        request.error = error
        for seq in request.sequences:
            self.finish(seq, "error")
        logger.warning("request %s failed: %s: %s", request.request_id, type(error).__name__, error)

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """Ends ``seq``: out of every queue, its blocks freed; its request leaves when its last sample ends."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self.epoch += 1
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        if seq.kv is not None:
            if seq.status is SequenceStatus.RUNNING:
                self._register(seq)
            self.kv.discard(seq.kv)
            seq.kv = None
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.request.finished:
            seq.request.metrics.finished_time = time.monotonic()
            self.requests.pop(seq.request.request_id, None)
            self._ends.pop(seq.request.request_id, None)
            self._forking.discard(seq.request.request_id)

    # ------------------------------------------------------------------------------ preemption
    def _preempt(self, victim: Sequence) -> None:
        self.epoch += 1
        self.running.remove(victim)
        victim.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._register(victim)
        mode = self.config.preemption_mode
        blocks = victim.num_computed_tokens // self.kv.block_size
        swap = mode == "swap" or (mode == "auto" and blocks >= AUTO_SWAP_MIN_BLOCKS)
        if swap and self.kv.can_swap_out(victim.kv):
            self.kv.swap_out(victim.kv)
            victim.status = SequenceStatus.SWAPPED
            self.swapped.append(victim)
            self.num_swapped_out += 1
            logger.debug("preempted %r by swap (%d blocks)", victim, blocks)
        else:
            self._recompute(victim)
            logger.debug("preempted %r by recompute", victim)

    def _recompute(self, seq: Sequence) -> None:
        """Drops ``seq``'s KV; it waits at the head of the queue to compute its tokens again."""
        self.epoch += 1
        self.kv.free(seq.kv)
        if self.speculator is not None:
            self.speculator.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        if self._priority:
            self.waiting = deque(sorted(self.waiting, key=self._order))

    def requeue(self, seq: Sequence) -> None:
        """Sends a running ``seq`` back to the waiting queue without its KV (a failed step left its prefix blocks
        empty: it computes them again)."""
        self.running.remove(seq)
        self._recompute(seq)

    # -------------------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        last_run, self._decode_run = self._decode_run, None  # only the step right after it may reuse it
        images = ImageChunks(self.config.max_num_encoder_input_tokens)
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        preempted = False
        if not self._running_sorted:
            self.running.sort(key=self._order)
            self._running_sorted = True
            self.epoch += 1
        kv = self.kv
        if self.speculator is not None:
            self._speculating = self.speculator.speculating()
            self._drafting = self._speculating and self.speculator.begin_step(self.running, self.max_model_len)

        # 1. running sequences, oldest / most important first; decodes take one token
        index = 0
        decode_runs = 0  # sequences scheduled by decode runs (their filled blocks are registered later)
        while index < len(self.running) and budget > 0:
            if not self._has_windows and not self._drafting:  # most of them: decodes that have room (drafts
                # and sliding windows take the loop below)
                taken = self._schedule_decodes(index, budget, decodes, last_run)
                index, budget, decode_runs = index + taken, budget - taken, decode_runs + taken
                if index == len(self.running) or budget <= 0:
                    break
            seq = self.running[index]
            count = images.chunk(seq.request, seq.num_computed_tokens,
                                 self._chunk(seq, seq.num_computed_tokens, budget))
            if count == 0:  # its next image does not fit what is left of this step: next step
                index += 1
                continue
            if self._has_windows:
                kv.slide_windows(seq.kv)
            drafts = self._drafts(seq, budget - (len(self.running) - index)) if count == 1 else ()
            if drafts:  # their slots are allocated
                self._schedule(seq, 1 + len(drafts), prefills, drafts)
                budget -= 1 + len(drafts)
                index += 1
                continue
            while not kv.try_append(seq.kv, count):
                victim = max(self.running[index:], key=self._order)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._schedule(seq, count, decodes if count == 1 else prefills)
                budget -= count
                index += 1
                continue
            break  # seq itself was preempted: later ones have lower priority, stop here

        # 2. swapped sequences come back first, unless this step had to preempt
        while self.swapped and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            # a block of headroom for its next token while others run; alone, it may take the whole pool (add_request
            # checked that its tokens fit it: one that held every block, shared ones too, comes back)
            if kv.num_swap_in_blocks(seq.kv) + bool(self.running) > kv.num_free_blocks:
                break
            self.swapped.popleft()
            kv.swap_in(seq.kv)
            seq.status = SequenceStatus.RUNNING
            self.num_swapped_in += 1
            self._join_running(seq)
            count = images.chunk(seq.request, seq.num_computed_tokens,
                                 self._chunk(seq, seq.num_computed_tokens, budget))
            if count == 0 or not kv.try_append(seq.kv, count):
                break  # runs next step
            self._schedule(seq, count, decodes if count == 1 else prefills)
            budget -= count

        # 3. waiting sequences (new, or preempted by recompute), in order: no overtaking
        if self._lpm and self.waiting and not self.swapped:
            self.waiting = lpm_order(self.waiting, self._cached_tokens, self._order)
        while self.waiting and not self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.kv is None:
                seq.kv = kv.new_sequence()
            hit = self._prefix_hit(seq)
            count = images.chunk(seq.request, hit.num_tokens, self._chunk(seq, hit.num_tokens, budget))
            if count == 0 or not kv.has_room(kv.admission_blocks(hit, count)):
                break
            self.waiting.popleft()
            first_admission = seq.request.metrics.first_scheduled_time is None
            # as vLLM's counters: each request's first lookup, once for its samples; none where it skips the cache
            kv.admit(seq.kv, hit, seq.token_ids, count_query=first_admission and self._looks_up(seq) and (
                seq.index == 0 or seq.request.params.n == 1))
            seq.num_computed_tokens = hit.num_tokens
            if first_admission:
                seq.request.metrics.first_scheduled_time = time.monotonic()
                seq.request.metrics.num_prefix_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self._join_running(seq)
            kv.append(seq.kv, count)  # admission_blocks checked the room
            self._schedule(seq, count, decodes if count == 1 else prefills)
            budget -= count
        if decode_runs and kv.prefix_caching:  # after this step's lookups: the blocks its decodes fill wait too
            self.unregistered_decodes = True
        return SchedulerOutput(decodes + prefills, len(decodes), kv.take_copies(), self.epoch)

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """The tokens ``seq`` computes this step from position ``start``: the rest of it within ``budget``, and, with
        sliding windows, within what its pools hold (``KVManager.max_chunk``: a prompt longer than a window group's
        pool is computed in chunks). Such a capped chunk takes a whole pool, so nothing is admitted after it."""
        count = min(len(seq.token_ids) - start, budget)
        if self._has_windows and count > 1:
            return min(count, self.kv.max_chunk(start))
        return count

    def _looks_up(self, seq: Sequence) -> bool:
        """Whether ``seq`` looks for a cached prefix: prefix caching is on, and its request needs no logits of its
        prompt positions (prompt logprobs: it computes its whole prompt) and did not ask for no prefix reuse."""
        return self.kv.prefix_cache.enabled and seq.request.params.prompt_logprobs is None and \
            seq.request.reuse_prefix

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The prefix hit of waiting ``seq`` (which has its ``kv``); MISS where it does not look one up."""
        if not self._looks_up(seq):
            return MISS
        if self.unregistered_decodes:
            self._register_running()
        return self.kv.find_prefix_hit(seq.kv, seq.token_ids, seq.request.cache_salt)

    def _register(self, seq: Sequence) -> None:
        """Registers running ``seq``'s computed full blocks in the prefix cache (those its decode runs filled). A
        sequence that verified drafts computed some past the end token it accepted: its tokens end there."""
        if self.kv.prefix_caching:
            self.kv.cache_full_blocks(seq.kv, seq.token_ids, min(seq.num_computed_tokens, len(seq.token_ids)),
                                      seq.request.cache_salt, computed=True)

    def _register_running(self) -> None:
        """Registers every running sequence's computed full blocks (before a lookup: a prompt may continue a
        generated text). A pass over the running sequences at the first lookup after decode runs, instead of a
        registration inside each run's step (16 a step at 256 decodes, 0.17 ms: each reads a block's tokens and
        its sequence's objects after the forward evicted them from the CPU's caches)."""
        for seq in self.running:
            self._register(seq)
        self.unregistered_decodes = False

    def _cached_tokens(self, seq: Sequence) -> int:
        """LPM's key: the prompt tokens waiting ``seq`` would find cached now."""
        if seq.kv is None:
            seq.kv = self.kv.new_sequence()
        return self._prefix_hit(seq).num_tokens

    def _schedule_decodes(self, index: int, budget: int, out: list[ScheduledSequence],
                          last: tuple | None = None) -> int:
        """Schedules the running decodes from ``running[index]`` on (at most ``budget``) up to the first that is not
        one (a prompt chunk) or finds no room (preemption is the caller's); returns how many. What the caller's loop
        does with ``try_append`` and ``_schedule``, one decode at a time, in fewer passes: every decode step's steady
        state. ``last``: the previous step's ``_decode_run``."""
        kv = self.kv
        if index == 0 and last is not None and last[0] == self.epoch and len(last[1]) <= budget:
            run, kvs, tables = list(last[1]), last[2], last[3]  # the same sequences as the last step, one token on
        else:
            run, kvs = [], []
            for seq in islice(self.running, index, index + budget):
                if len(seq.token_ids) - seq.num_computed_tokens != 1:
                    break
                run.append(seq)
                kvs.append(seq.kv)
            tables = kv.decode_tables(kvs)
        if index == 0 and len(run) == len(self.running):  # every running sequence decodes: the next step's run
            self._decode_run = (self.epoch, tuple(run), kvs, tables)
        # the blocks these decodes fill are registered later, when a lookup or the sequence's end may use them
        count = kv.append_decodes(kvs, tables=tables)
        if count < len(run):
            del run[count:]
        if not self._forking:  # the steady state: one object per decode, nothing else
            out.extend([ScheduledSequence(seq, seq.num_computed_tokens, 1, True) for seq in run])
            return count
        for seq in run:
            start = seq.num_computed_tokens
            if seq.index == 0 and seq.request.params.n > 1:  # the chunk completing its prompt: the other samples fork
                forks = tuple(s for s in seq.request.sequences[1:] if s.status is SequenceStatus.FORK_PENDING)
                out.append(ScheduledSequence(seq, start, 1, True, forks))
            else:
                out.append(ScheduledSequence(seq, start, 1, True))
        return count

    def _join_running(self, seq: Sequence) -> None:
        self.epoch += 1
        if self.running and self._order(seq) < self._order(self.running[-1]):
            self._running_sorted = False
        self.running.append(seq)

    def _drafts(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """Speculative drafts for decoding ``seq`` (at most ``room``) with their slots allocated, or () (none
        proposed, or no free blocks for them: speculation never preempts)."""
        if not self._drafting or room < 1:
            return ()
        drafts = self.speculator.propose(seq, room, self.max_model_len)
        if drafts and not self.kv.try_append(seq.kv, 1 + len(drafts)):
            return ()
        return drafts

    def _schedule(self, seq: Sequence, count: int, out: list[ScheduledSequence], drafts: tuple[int, ...] = ()) -> None:
        """Schedules ``count`` tokens of ``seq`` (their slots are allocated; ``drafts`` are the last of them) and
        registers the blocks they fill in the prefix cache (later admissions of this step may hit them); blocks
        of drafts are registered once the drafts are accepted, by a later step."""
        start = seq.num_computed_tokens
        if self.kv.prefix_caching:
            self.kv.cache_full_blocks(seq.kv, seq.token_ids, start + count - len(drafts), seq.request.cache_salt)
        samples = start + count - len(drafts) == len(seq.token_ids)
        if samples and seq.request.params.n > 1 and seq.index == 0:
            forks = tuple(s for s in seq.request.sequences[1:] if s.status is SequenceStatus.FORK_PENDING)
            out.append(ScheduledSequence(seq, start, count, samples, forks, drafts))
        else:
            out.append(ScheduledSequence(seq, start, count, samples, (), drafts))
