"""Iteration-level scheduler: the owner of every request and sequence state. It picks which sequences run in the
next forward and how many tokens each (``schedule``), and makes every change after the forward
(``update_from_output``): computed tokens, prompt logprobs, the samples of ``n > 1`` joining their prompt, the new
tokens and their logprobs, finishing (EOS, stop tokens, lengths, and stop strings on the output stage's verdict),
failures, and the prefix cache's step.

Each step: running sequences first (oldest / most important first), then swapped-out sequences come back, then
waiting ones are admitted, all within ``max_num_batched_tokens`` and ``max_num_seqs``. When blocks run out a victim
is preempted: the newest sequence under "fcfs", the lowest priority (largest value) under "priority" and "lpm"; by
swap to CPU or by recompute (drop its KV, prefill it again later). The output lists one-token sequences (decodes)
first. Under "lpm" the waiting queue is ordered each step by the longest cached prefix within a priority level
(``lpm.py``).

A prompt in flight never makes a later admission compute its prefix again: running sequences are scheduled first,
the blocks a chunk fills are registered when it is scheduled (so admissions of the same step hit them), and a chunk
shorter than the rest of its prompt used up the step's token budget (or a sliding window's whole pool: a prompt with
more blocks than that pool is computed in chunks it holds, ``KVManager.max_chunk``), so nothing is admitted after it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, NamedTuple

from ..config import EngineConfig
from ..kv.copies import BlockCopy
from ..kv.manager import KVManager
from ..kv.prefix_hit import MISS, PrefixHit
from .lpm import lpm_order
from .multimodal import ImageChunks
from ..structured.matcher import GrammarRejected, SequenceGrammar
from .request import Request, Sequence, SequenceStatus
from .spec import Speculator

if TYPE_CHECKING:  # the runner imports this module
    from .runner import RunnerOutput

logger = logging.getLogger("paged_hf")

# "auto" preemption swaps a sequence with at least this many computed blocks (recomputing it would cost more
# than copying its blocks both ways); shorter ones are recomputed.
AUTO_SWAP_MIN_BLOCKS = 4
# With nothing else to run, the engine waits this long (seconds) for a grammar being compiled before it steps again.
GRAMMAR_WAIT_S = 0.01


class _Ends(NamedTuple):
    """What can end a request, for the test after each sampled token: ``token_ids`` (its stop token ids, and EOS
    unless it ignores EOS; ``min_tokens`` may still hold them back) and ``max_len`` (prompt + ``max_tokens``, or
    ``max_model_len`` if shorter: at this many tokens it ends by length)."""

    token_ids: frozenset[int]
    max_len: int


@dataclass(slots=True)
class ScheduledSequence:
    """``seq`` computes tokens ``start .. start + num_tokens - 1`` this step; ``samples``: the last of them is its
    newest token, so the step samples the next one. ``forks``: the other samples of an ``n > 1`` request whose
    prompt this chunk completes; they draw their first tokens from the same logits and then share its blocks.
    ``draft_token_ids``: a decoding sequence's speculative drafts, computed after its newest token (``num_tokens``
    counts them); the step verifies them (``engine/spec``)."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    forks: tuple[Sequence, ...] = ()
    draft_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    """One step's work: the scheduled sequences (decodes first), and the block copies to run before the forward."""

    scheduled: list[ScheduledSequence]
    num_decodes: int
    copies: list[BlockCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
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
        self.compiling: list[Request] = []  # structured outputs whose grammar is compiling: queued once it is ready
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
        self._step_started = 0.0
        self._ends: dict[str, _Ends] = {}  # per request id not finished

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
        params = request.params
        self._ends[request.request_id] = _Ends(
            frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)),
            min(len(request.prompt_token_ids) + params.max_tokens, self.max_model_len))
        grammar = request.compiled_grammar
        if grammar is None or (grammar.done() and grammar.exception() is None):
            self._enqueue(request)
        else:  # compiling, or failed: admit_compiled queues or fails it
            self.compiling.append(request)

    def _enqueue(self, request: Request) -> None:
        if request.compiled_grammar is not None:  # each sample follows the grammar on its own
            for seq in request.sequences:
                seq.grammar = SequenceGrammar(request.compiled_grammar.result())
        self.waiting.append(request.sequences[0])
        if self._priority:
            self.waiting = deque(sorted(self.waiting, key=self._order))

    def admit_compiled(self) -> list[Request]:
        """Queues the requests whose grammar compiled; fails those whose compilation raised and returns them. With
        nothing else to run, first waits up to ``GRAMMAR_WAIT_S`` for a compilation to end."""
        if not self.compiling:
            return []
        if not (self.running or self.waiting or self.swapped):
            wait([r.compiled_grammar for r in self.compiling], timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        failed, pending = [], []
        for request in self.compiling:
            if request.finished:  # aborted while its grammar compiled
                continue
            grammar = request.compiled_grammar
            if not grammar.done():
                pending.append(request)
            elif grammar.exception() is not None:
                self.fail(request, grammar.exception())
                failed.append(request)
            else:
                self._enqueue(request)
        self.compiling = pending
        return failed

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
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        if seq.kv is not None:
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

    # ------------------------------------------------------------------------------ preemption
    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        victim.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
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
        images = ImageChunks(self.config.max_num_encoder_input_tokens)
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        preempted = False
        if not self._running_sorted:
            self.running.sort(key=self._order)
            self._running_sorted = True
        kv = self.kv
        if self.speculator is not None:
            self._speculating = self.speculator.speculating()
            self._step_started = time.perf_counter()
            if self._speculating:
                self.speculator.begin_step(self.running, self.max_model_len)

        # 1. running sequences, oldest / most important first; decodes take one token
        index = 0
        while index < len(self.running) and budget > 0:
            if not self._has_windows and not self._speculating:  # most of them: decodes that have room (drafts
                # and sliding windows take the loop below)
                taken = self._schedule_decodes(index, budget, decodes)
                index, budget = index + taken, budget - taken
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
            if kv.num_swap_in_blocks(seq.kv) + 1 > kv.num_free_blocks:
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
            kv.admit(seq.kv, hit, seq.token_ids, count_query=seq.index == 0 or seq.request.params.n == 1)
            seq.num_computed_tokens = hit.num_tokens
            if first_admission:
                seq.request.metrics.first_scheduled_time = time.monotonic()
                seq.request.metrics.num_prefix_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self._join_running(seq)
            kv.append(seq.kv, count)  # admission_blocks checked the room
            self._schedule(seq, count, decodes if count == 1 else prefills)
            budget -= count
        return SchedulerOutput(decodes + prefills, len(decodes), kv.take_copies())

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """The tokens ``seq`` computes this step from position ``start``: the rest of it within ``budget``, and, with
        sliding windows, within what its pools hold (``KVManager.max_chunk``: a prompt longer than a window group's
        pool is computed in chunks). Such a capped chunk takes a whole pool, so nothing is admitted after it."""
        count = min(len(seq.token_ids) - start, budget)
        if self._has_windows and count > 1:
            return min(count, self.kv.max_chunk(start))
        return count

    def _prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The prefix hit of waiting ``seq`` (which has its ``kv``). Prompt logprobs need the logits of every prompt
        position: such a request computes its whole prompt, as does one that asked for no prefix reuse."""
        if seq.request.params.prompt_logprobs is not None or not seq.request.reuse_prefix:
            return MISS
        return self.kv.find_prefix_hit(seq.kv, seq.token_ids, seq.request.cache_salt)

    def _cached_tokens(self, seq: Sequence) -> int:
        """LPM's key: the prompt tokens waiting ``seq`` would find cached now."""
        if seq.kv is None:
            seq.kv = self.kv.new_sequence()
        return self._prefix_hit(seq).num_tokens

    def _schedule_decodes(self, index: int, budget: int, out: list[ScheduledSequence]) -> int:
        """Schedules the running decodes from ``running[index]`` on (at most ``budget``) up to the first that is not
        one (a prompt chunk) or finds no room (preemption is the caller's); returns how many. What the caller's loop
        does with ``try_append`` and ``_schedule``, one decode at a time, in fewer passes: every decode step's steady
        state."""
        run = []
        for seq in islice(self.running, index, index + budget):
            if len(seq.token_ids) - seq.num_computed_tokens != 1:
                break
            run.append(seq)
        kv = self.kv
        # with prefix caching, a decode that takes a block (it may evict a cached one) goes after the registrations
        # of those before it: the caller's loop does it, in order
        count = kv.append_decodes([seq.kv for seq in run], grow=not kv.prefix_caching)
        block_size = kv.block_size if kv.prefix_caching else 0
        for seq in run[:count]:
            start = seq.num_computed_tokens
            if block_size and (start + 1) // block_size > seq.kv.num_cached_blocks:  # a block fills: register it
                kv.cache_full_blocks(seq.kv, seq.token_ids, start + 1, seq.request.cache_salt)
            if seq.index == 0 and seq.request.params.n > 1:  # the chunk completing its prompt: the other samples fork
                forks = tuple(s for s in seq.request.sequences[1:] if s.status is SequenceStatus.FORK_PENDING)
                out.append(ScheduledSequence(seq, start, 1, True, forks))
            else:
                out.append(ScheduledSequence(seq, start, 1, True))
        return count

    def _join_running(self, seq: Sequence) -> None:
        if self.running and self._order(seq) < self._order(self.running[-1]):
            self._running_sorted = False
        self.running.append(seq)

    def _drafts(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """Speculative drafts for decoding ``seq`` (at most ``room``) with their slots allocated, or () (none
        proposed, or no free blocks for them: speculation never preempts)."""
        if not self._speculating or room < 1:
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

    # -------------------------------------------------------------------------- after the step
    def update_from_output(self, output: SchedulerOutput, result: "RunnerOutput",
                           stop_string: Callable[[Sequence], str | None]) -> list[Request]:
        """Applies one step's ``result`` to its sequences; returns the requests it changed (a token, prompt
        logprobs, a failure, an end), in order. ``stop_string(seq)``: the output stage's verdict on a sequence that
        just got a token (the stop string its text now ends with, or None)."""
        touched: dict[str, Request] = {}
        if result.step_error is not None:  # nothing of the step ran: its requests (every request: a broken group) fail
            failing = list(self.requests.values()) if result.broken else \
                list({id(i.seq.request): i.seq.request for i in output.scheduled}.values())
            for request in failing:
                self.fail(request, result.step_error)
                touched[request.request_id] = request
            self.kv.end_step(failed=True)
            return list(touched.values())
        for request, error in result.errors:
            self.fail(request, error)
            touched[request.request_id] = request
        for seq in result.requeue:
            if seq.status is SequenceStatus.RUNNING:
                self.requeue(seq)
        running = SequenceStatus.RUNNING
        for item in output.scheduled:
            seq = item.seq
            if seq.status is running:
                seq.num_computed_tokens += item.num_tokens
        for item, entries in result.prompt_logprobs:
            request = item.seq.request
            if item.seq.status is SequenceStatus.RUNNING and request.prompt_logprobs is not None:
                skip = len(request.prompt_logprobs) - (item.start + 1)  # recorded before (a recomputed chunk)
                request.prompt_logprobs.extend(entries[max(0, skip):])
                touched[request.request_id] = request
        now = time.monotonic()
        for seq, token, entry in zip(result.seqs, result.token_ids, result.logprobs):
            if seq.status is not running:
                if seq.status is not SequenceStatus.FORK_PENDING:
                    continue
                # its prompt completed this step: share sample 0's blocks
                leader = seq.request.sequences[0]
                if leader.status is not running:
                    continue
                seq.kv = self.kv.fork(leader.kv)
                seq.num_computed_tokens = leader.num_computed_tokens
                seq.status = running
                self._join_running(seq)
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self._emit(seq, token, entry, now, stop_string)
            touched[seq.request.request_id] = seq.request
        for run in result.verified:
            if run.seq.status is SequenceStatus.RUNNING:
                self._apply_verified(run, now, stop_string)
                touched[run.seq.request.request_id] = run.seq.request
        self.kv.end_step(failed=result.retried)
        if self.speculator is not None and all(i.num_tokens == 1 + len(i.draft_token_ids) for i in output.scheduled):
            self.speculator.end_step(self._speculating, time.perf_counter() - self._step_started,
                                          len(result.token_ids) + sum(len(r.token_ids) for r in result.verified))
        return list(touched.values())

    def _emit(self, seq: Sequence, token: int, entry, now: float, stop_string) -> None:
        """Appends one sampled token (advancing ``seq``'s grammar first: a token it rejects fails the request), then
        finishes ``seq`` if its grammar reached its end or its text now ends in a stop string."""
        if seq.grammar is not None:
            try:
                seq.grammar.accept(token)
            except GrammarRejected as error:
                self.fail(seq.request, error)
                return
        self._append(seq, token, entry, now)
        if seq.grammar is not None and seq.grammar.terminated and seq.status is SequenceStatus.RUNNING:
            self.finish(seq, "stop")  # the grammar took an end token that ignore_eos does not stop on
        stop = stop_string(seq)
        if stop is not None:
            if seq.status is SequenceStatus.FINISHED:  # by length: the stop string came first
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.finish(seq, "stop", stop)

    def _apply_verified(self, run, now: float, stop_string) -> None:
        """A sequence's verified drafts: its K/V holds its last token and the accepted drafts, the rejected ones'
        slots are given back; the accepted drafts and the resampled (or bonus) token are appended one by one, as
        single steps would, so that EOS, stop tokens, stop strings and lengths end the run where they occur."""
        seq = run.seq
        seq.num_computed_tokens = run.start + 1 + run.num_accepted
        for token, entry in zip(run.token_ids, run.logprobs):
            self._emit(seq, token, entry, now, stop_string)
            if seq.status is not SequenceStatus.RUNNING:
                break
        self.speculator.record(seq, run.num_drafts, run.num_accepted)
        if seq.status is SequenceStatus.RUNNING and seq.kv.num_tokens > seq.num_computed_tokens:
            self.kv.truncate(seq.kv, seq.num_computed_tokens)

    def _append(self, seq: Sequence, token: int, entry, now: float) -> None:
        """Appends a sampled token (and its logprobs) and finishes ``seq`` on a stop token, EOS or a length."""
        token_ids = seq.token_ids
        token_ids.append(token)
        self.num_generated_tokens += 1
        request = seq.request
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if entry is not None:
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[token].logprob
        ends = self._ends[request.request_id]
        if token not in ends.token_ids and len(token_ids) < ends.max_len:  # most tokens: no end is possible
            return
        params = request.params
        num_output = len(seq.token_ids) - len(seq.request.prompt_token_ids)
        held_back = num_output <= params.min_tokens  # the sampler masks stops until min_tokens are out
        if token in params.stop_token_ids and not held_back:
            self.finish(seq, "stop", token)
        elif not params.ignore_eos and token in self.eos_token_ids and not held_back:
            self.finish(seq, "stop", None)
        elif num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self.finish(seq, "length")
