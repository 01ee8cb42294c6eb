"""``Speculator``: what the scheduler asks about speculation. It proposes the step's drafts once, for every decoding
sequence at the step's start (``begin_step``: n-gram lookups, or a draft model's greedy tokens computed for them at
once), hands each sequence its drafts within the room the step and the request leave (``propose``), records how
many the target accepted and keeps the statistics (vLLM's counters: drafts, draft tokens, accepted tokens, accepted
tokens per position). A step where nothing is proposed schedules as one without speculation."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..request import Sequence, SequenceStatus
from .config import SpeculativeConfig
from .gate import AcceptanceGate
from .ngram import propose_ngram
from .switch import ThroughputSwitch

if TYPE_CHECKING:
    from ..scheduled import ScheduledSequence
    from .verify import VerifiedRun

logger = logging.getLogger("paged_hf")


class Speculator:
    """Proposals and acceptance statistics of one engine (``config``: its ``SpeculativeConfig``).

    ``tail_block_size``: the block size of a KV format with a full-precision tail row (int4), else None. Such a
    format quantizes a block when it fills, from its tail row; a block filled by drafts that are then rejected
    would be requantized from dequantized values, and its bytes would no longer depend only on its tokens. So
    there the newest token and its drafts stay inside one block without filling it: rollback only rewinds the tail
    row, and the output equals that of the engine without speculation.

    ``drafter``: method "draft_model"'s ``DraftModelProposer`` (attached by the engine, which holds the models).
    ``clock``: what the switch times steps by: the process's CPU seconds where the model runs on a CPU (wall time on
    a machine shared with other work counts that work too, and decides the switch by it), else wall time."""

    def __init__(self, config: SpeculativeConfig, tail_block_size: int | None = None) -> None:
        self.config = config
        self.tail_block_size = tail_block_size
        self.drafter = None
        self.disabled = False  # the draft model failed: no step proposes again
        self.clock = time.perf_counter
        self._step_started = 0.0
        self._proposals: dict[int, tuple[int, ...]] = {}  # this step's proposals, by id(seq)
        self.switch = ThroughputSwitch() if config.auto_disable else None
        self.num_drafts = 0  # verified runs that had drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_pos = [0] * config.num_speculative_tokens  # [k]: runs whose draft j was accepted

    def speculating(self) -> bool:
        """Whether this step proposes drafts (the engine-wide switch's choice); the step's clock starts."""
        self._step_started = self.clock()
        return self.switch is None or self.switch.speculating()

    def end_step(self, speculated: bool, num_tokens: int, scheduled: "list[ScheduledSequence]",
                 verified: "list[VerifiedRun]", nothing_waits: bool) -> None:
        """A decoding step of ``scheduled`` ended, having generated ``num_tokens`` (``verified``: its runs with
        drafts): its time since ``speculating`` and its gain, for the switch. While requests wait, the gain is the
        tokens: a sequence that ends sooner lets one of them in. Where nothing waits, the batch ends with its
        longest sequence, and tokens that others gained ahead of it save no step: the gain is the step's sequences
        times the tokens its end came closer by (``batch_progress``), which is the tokens for a step without
        drafts."""
        if self.switch is None:
            return
        seconds = self.clock() - self._step_started
        if nothing_waits and scheduled:
            num_tokens = len(scheduled) * batch_progress(scheduled, verified)
        self.switch.record(speculated, seconds, num_tokens, len(scheduled))

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Whether ``seq``'s request may speculate: user logits processors may keep state, and would see the
        positions of rejected drafts, so their requests decode one token a step; so do requests with images (their
        steps run eagerly, and Qwen2-VL's M-RoPE positions are planned one decode token at a time), and so do
        requests with structured outputs (their drafts would be verified without the grammar's mask)."""
        request = seq.request
        return not request.params.logits_processors and request.images is None and request.compiled_grammar is None

    def _limit(self, seq: Sequence, room: int, max_model_len: int) -> int:
        """The most drafts ``seq`` may propose: at most ``room``, never so many that the accepted drafts plus the
        bonus token pass ``max_tokens`` or ``max_model_len``; 0 when it may not propose or its gate is closed."""
        params = seq.request.params
        num_output = seq.num_output_tokens
        limit = min(self.config.num_speculative_tokens, room, params.max_tokens - num_output - 1,
                    max_model_len - len(seq.token_ids) - 1)
        if self.tail_block_size is not None:  # positions start .. start + k in the newest token's block, not its last
            limit = min(limit, self.tail_block_size - 2 - (len(seq.token_ids) - 1) % self.tail_block_size)
        if limit < 1 or num_output < 1 or not self.eligible(seq):  # a prompt's last token may still fork its samples
            return 0
        if seq.spec_gate is None:
            seq.spec_gate = AcceptanceGate()
        return limit if seq.spec_gate.is_open(num_output) else 0

    def begin_step(self, running: list[Sequence], max_model_len: int) -> bool:
        """A speculating step starts: proposes for every running sequence that decodes (one new token) and may
        propose, as many drafts as its limit allows (the step's room may cut them later); returns whether any
        sequence has drafts (if not, the step schedules as one without speculation)."""
        wanted = []
        for seq in running:
            if seq.num_computed_tokens == len(seq.token_ids) - 1:
                limit = self._limit(seq, self.config.num_speculative_tokens, max_model_len)
                if limit:
                    wanted.append((seq, limit))
        if not wanted or self.disabled:
            self._proposals = {}
        elif self.drafter is not None:
            self._proposals = self._draft(wanted)
        else:
            c = self.config
            self._proposals = {}
            for seq, limit in wanted:
                drafts = propose_ngram(seq.token_ids, limit, c.prompt_lookup_max, c.prompt_lookup_min)
                if drafts:
                    self._proposals[id(seq)] = tuple(drafts)
        return bool(self._proposals)

    def _draft(self, wanted: list[tuple[Sequence, int]]) -> dict[int, tuple[int, ...]]:
        """The draft model's proposals; a draft forward that raises is logged and ends drafting for good (the
        requests go on without drafts, their outputs unchanged): its pool is freed."""
        try:
            return self.drafter.propose(wanted)
        except Exception:  # noqa: BLE001 - the draft model may fail in any way; the target's requests must not
            logger.exception("speculative decoding: the draft model's forward failed; the engine goes on without "
                             "drafts")
            drafter, self.drafter, self.disabled = self.drafter, None, True
            for held, _ in list(drafter.states.values()):
                drafter.release(held)
            return {}

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or lost its K/V (preempted by recompute): its draft K/V, if any, is freed."""
        if self.drafter is not None:
            self.drafter.release(seq)

    def propose(self, seq: Sequence, room: int, max_model_len: int) -> tuple[int, ...]:
        """``seq``'s drafts of this step (``begin_step``) within ``_limit``; () when it proposes none."""
        drafts = self._proposals.get(id(seq), ())
        if not drafts:
            return ()
        limit = self._limit(seq, room, max_model_len)
        if limit >= len(drafts) or self.drafter is not None:
            return drafts[:limit]
        c = self.config  # fewer n-gram drafts may continue another match (the latest one with room to continue)
        return tuple(propose_ngram(seq.token_ids, limit, c.prompt_lookup_max, c.prompt_lookup_min))

    def stats(self) -> dict:
        """The counters under ``EngineStats``' names."""
        return dict(spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=tuple(self.num_accepted_per_pos))

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Counts a verified run of ``seq`` (``num_accepted`` leading drafts of ``num_drafts`` accepted)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.num_accepted_per_pos[j] += 1
        c = self.config
        seq.spec_gate.record(num_drafts, num_accepted, seq.num_output_tokens, 2 * c.num_speculative_tokens,
                             c.min_acceptance_rate)


def batch_progress(scheduled: "list[ScheduledSequence]", verified: "list[VerifiedRun]") -> int:
    """By how many tokens a decoding step shortened the longest budget left among its sequences (``max_tokens``
    less their output tokens; none once finished): 1 for a step without drafts, more only where every sequence
    with the longest budget had drafts accepted."""
    emitted = {id(run.seq): len(run.token_ids) for run in verified}
    before = after = 0
    for item in scheduled:
        seq = item.seq
        left = seq.request.params.max_tokens - seq.num_output_tokens
        before = max(before, left + emitted.get(id(seq), 1))
        after = max(after, 0 if seq.status is SequenceStatus.FINISHED else left)
    return before - after
