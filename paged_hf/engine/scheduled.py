"""What the scheduler hands the runner each step: the sequences that run, how many tokens each, and the block copies
to run before the forward."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv.copies import BlockCopy
from .request import Sequence


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
    """One step's work: the scheduled sequences (decodes first), and the block copies to run before the forward.
    ``epoch``: the scheduler's count of changes to its running sequences (admissions, finishes, preemptions, swaps,
    reorders) when it was made: two outputs of the same epoch run the same sequences, in the same order (-1: an
    output the scheduler did not make)."""

    scheduled: list[ScheduledSequence]
    num_decodes: int
    copies: list[BlockCopy] = field(default_factory=list)
    epoch: int = -1

    @property
    def num_tokens(self) -> int:
        """Tokens of the step: one per decode (the first ``num_decodes``), and the others' counts."""
        return self.num_decodes + sum(s.num_tokens for s in self.scheduled[self.num_decodes:])
