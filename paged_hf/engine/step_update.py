"""The second half of a step, as ``Scheduler`` methods: ``update_from_output`` applies the runner's output to the
sequences (computed tokens, prompt logprobs, the samples of ``n > 1`` joining their prompt, new tokens and their
logprobs, verified speculative drafts, grammar matchers, finishing on EOS / stop tokens / lengths / a grammar's end /
stop strings, failures, the prefix cache's step).

``StepUpdate`` is a base of ``Scheduler`` and never made alone: the state it changes (``requests``, ``running``,
``kv``, ``speculator``, ``_ends``, ``_forking``, ``_batch_ends``) is the scheduler's, declared in
``Scheduler.__init__``; this file only keeps the scheduler's file to one half of the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..structured.matcher import GrammarRejected
from .ends import BatchEnds
from .request import Request, Sequence, SequenceStatus
from .scheduled import SchedulerOutput

if TYPE_CHECKING:  # the runner imports the scheduler
    from .decode_batch import DecodeBatch
    from .runner import RunnerOutput
    from .spec.verify import VerifiedRun


class StepUpdate:
    def update_from_output(self, output: SchedulerOutput, result: "RunnerOutput",
                           stop_string: Callable[[Sequence], str | None]) -> list[Request]:
        """Applies one step's ``result`` to its sequences; returns the requests it changed (a token, prompt
        logprobs, a failure, an end), in order (a step of quiet decodes, ``_apply_quiet_decodes``, leaves out the
        ``FINAL_ONLY`` requests that did not end: they have no output to give). ``stop_string(seq)``: the output
        stage's verdict on a sequence that just got a token (the stop string its text now ends with, or None)."""
        touched: dict[str, Request] = {}
        if result.step_error is not None:  # nothing of the step ran: its requests (every request: a broken group) fail
            failing = list(self.requests.values()) if result.broken else \
                list({id(i.seq.request): i.seq.request for i in output.scheduled}.values())
            for request in failing:
                self.fail(request, result.step_error)
                touched[request.request_id] = request
            self.kv.end_step(failed=True)
            return list(touched.values())
        if result.batch is not None and self._apply_quiet_decodes(result.batch, result.token_ids, touched):
            self._end_step(output, result)
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
                if item.forks:  # its prompt completed: the other samples share its blocks, before it gets a token
                    self._join_forks(seq, item.forks)  # (which may end it and free them)
        for item, entries in result.prompt_logprobs:
            request = item.seq.request
            if item.seq.status is SequenceStatus.RUNNING and request.prompt_logprobs is not None:
                skip = len(request.prompt_logprobs) - (item.start + 1)  # recorded before (a recomputed chunk)
                request.prompt_logprobs.extend(entries[max(0, skip):])
                touched[request.request_id] = request
        now = time.monotonic()
        for seq, token, entry in zip(result.seqs, result.token_ids, result.logprobs):
            if seq.status is not running:
                continue
            self._emit(seq, token, entry, now, stop_string)
            touched[seq.request.request_id] = seq.request
        for run in result.verified:
            if run.seq.status is SequenceStatus.RUNNING:
                self._apply_verified(run, now, stop_string)
                touched[run.seq.request.request_id] = run.seq.request
        self._end_step(output, result)
        return list(touched.values())

    def _end_step(self, output: SchedulerOutput, result: "RunnerOutput") -> None:
        self.kv.end_step(failed=result.retried)
        if self.speculator is not None and all(i.num_tokens == 1 + len(i.draft_token_ids) for i in output.scheduled):
            self.speculator.end_step(self._speculating,
                                     len(result.token_ids) + sum(len(r.token_ids) for r in result.verified),
                                     output.scheduled, result.verified, not (self.waiting or self.swapped))

    def _apply_quiet_decodes(self, batch: "DecodeBatch", token_ids: list[int], touched: dict[str, Request]) -> bool:
        """A step that ran from the persistent decode batch, in one pass, when its rows are quiet (``BatchEnds``):
        each row computed its token and appends the one it drew; only the rows that may end (``BatchEnds``: a set
        test, a vector test once a row may reach its length) go through ``RequestEnds.reached``. Returns False,
        changing nothing, for a batch that is not quiet."""
        if self._batch_ends is None or self._batch_ends[0] is not batch:
            self._batch_ends = (batch, BatchEnds.of(batch.seqs, self._ends, batch.positions, batch.longest))
        ends = self._batch_ends[1]
        if not ends.quiet:
            return False
        for seq, token in zip(batch.seqs, token_ids):
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)
        self.num_generated_tokens += len(token_ids)
        for row in ends.ending_rows(batch.positions, batch.token_ids, token_ids, batch.longest):  # advanced
            seq = batch.seqs[row]
            end = self._ends[seq.request.request_id].reached(seq, token_ids[row])
            if end is not None:
                self.finish(seq, *end)
                touched[seq.request.request_id] = seq.request
        return True

    def _join_forks(self, leader: Sequence, forks: tuple[Sequence, ...]) -> None:
        """The samples of ``leader``'s request still waiting for its prompt (``FORK_PENDING``) run from now on, on
        its blocks (their first tokens were drawn from its logits this step)."""
        for seq in forks:
            if seq.status is SequenceStatus.FORK_PENDING:
                seq.kv = self.kv.fork(leader.kv)
                seq.num_computed_tokens = leader.num_computed_tokens
                seq.status = SequenceStatus.RUNNING
                self._join_running(seq)
        self._forking.discard(leader.request.request_id)

    def _emit(self, seq: Sequence, token: int, entry, now: float, stop_string) -> None:
        """Appends one sampled token (advancing ``seq``'s grammar first: a token it rejects fails the request) and its
        logprobs, then finishes ``seq`` on a stop token, EOS or a length (``RequestEnds``), if its grammar reached
        its end, or if its text now ends in a stop string. Run once per sampled token: the common case (no grammar,
        no logprobs, no end) is a few attribute reads and one set lookup."""
        grammar = seq.grammar
        if grammar is not None:
            try:
                grammar.accept(token)
            except GrammarRejected as error:
                self.fail(seq.request, error)
                return
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
        if token in ends.token_ids or len(token_ids) >= ends.max_len:  # else nothing can end it (``reached``)
            end = ends.reached(seq, token)
            if end is not None:
                self.finish(seq, *end)
        if grammar is not None and grammar.terminated and seq.status is SequenceStatus.RUNNING:
            self.finish(seq, "stop")  # the grammar took an end token that ignore_eos does not stop on
        stop = stop_string(seq)
        if stop is not None:
            if seq.status is SequenceStatus.FINISHED:  # by length: the stop string came first
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.finish(seq, "stop", stop)

    def _apply_verified(self, run: "VerifiedRun", now: float, stop_string) -> None:
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
        if seq.status is not SequenceStatus.RUNNING:
            return
        self._register(seq)  # the blocks the accepted drafts filled hold their K/V now: registered at once
        if seq.kv.num_tokens > seq.num_computed_tokens:
            self.kv.truncate(seq.kv, seq.num_computed_tokens)
