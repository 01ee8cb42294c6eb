"""The runner's persistent decode batch: what a steady decode step needs, kept as tensors from one step to the next.

A decode-only step whose sequences all sample (no prompt logprobs, no forks) records, per row ``s`` of its scheduled
order: the sequence, its block-table row, the position its next input token takes and that token (the one the step
sampled). When the next step schedules the same sequences in the same order and nothing changed the running set in
between (the scheduler's ``SchedulerOutput.epoch``, bumped on every admission, finish, preemption, swap and reorder),
its metadata is built from these tensors with one op per field (``metadata.decode_metadata``) and the sampler reads
the batch's ``SamplingSummary`` instead of every row's parameters: no Python pass over the sequences for either.

Invariant (``check``, run by ``PagedEngine.check_invariants``): a batch that ``matches`` a
step holds, per row, ``seq.kv.row``, ``seq.num_computed_tokens`` and ``seq.token_ids[seq.num_computed_tokens]``.
Any other step, a failed one included, drops the batch; it is rebuilt from the sequences at the next decode-only step.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..metadata import DecodeLayout, decode_layout, long_tensor
from .request import Sequence
from .sampler import SamplingSummary, summarize
from .scheduled import SchedulerOutput


@dataclass
class DecodeBatch:
    """``seqs[s]`` is row ``s``; ``rows`` / ``positions`` / ``token_ids`` ``[S]`` int64 host tensors: its
    block-table row, the position of its next input token, that token (valid once ``advance``d); ``longest``:
    ``max(positions) + 1``; ``epoch``: the scheduler's epoch the batch was built or advanced at; ``layout``: what
    every step's metadata shares (``decode_layout(rows)``)."""

    seqs: list[Sequence]
    rows: torch.Tensor
    positions: torch.Tensor
    token_ids: torch.Tensor | None
    longest: int
    summary: SamplingSummary
    epoch: int
    layout: DecodeLayout

    @classmethod
    def of(cls, output: SchedulerOutput) -> DecodeBatch | None:
        """The batch of a decode-only step whose every sequence samples (None for any other step)."""
        scheduled = output.scheduled
        if output.num_decodes != len(scheduled) or not scheduled:
            return None
        seqs = []
        for item in scheduled:
            if not item.samples or item.forks or item.seq.request.params.prompt_logprobs is not None:
                return None
            seqs.append(item.seq)
        starts = [item.start for item in scheduled]
        rows = long_tensor([seq.kv.row for seq in seqs])
        return cls(seqs, rows, long_tensor(starts), None, max(starts) + 1, summarize(seqs), output.epoch,
                   decode_layout(rows))

    def matches(self, output: SchedulerOutput) -> bool:
        """Whether ``output`` schedules this batch's next step: advanced, the same epoch, the same sequences in the
        same order, each one token further."""
        scheduled = output.scheduled
        return (self.token_ids is not None and output.epoch == self.epoch and len(scheduled) == len(self.seqs)
                and output.num_decodes == len(scheduled)
                and all(map(operator.is_, (item.seq for item in scheduled), self.seqs)))

    def advance(self, token_ids: list[int], tensor: torch.Tensor | None = None) -> None:
        """After the step sampled ``token_ids[s]`` for every row: the next step's inputs. ``tensor``: the same ids as
        an int64 host tensor, where the sampler has one."""
        self.token_ids = long_tensor(token_ids) if tensor is None else tensor
        self.positions = self.positions + 1
        self.longest += 1

    def check(self) -> None:
        """AssertionError unless every row's tensors equal what its sequence holds now (the invariant above); for a
        batch that can still match (advanced, and the scheduler's epoch unchanged since)."""
        assert self.token_ids is not None, "the decode batch was kept without being advanced"
        expected = ([seq.kv.row for seq in self.seqs], [seq.num_computed_tokens for seq in self.seqs],
                    [seq.token_ids[seq.num_computed_tokens] for seq in self.seqs])
        actual = (self.rows.tolist(), self.positions.tolist(), self.token_ids.tolist())
        assert actual == expected, f"the persistent decode batch is stale: {actual} != {expected}"
        assert self.longest == max(expected[1]) + 1, f"longest {self.longest} != {max(expected[1]) + 1}"
        assert self.summary == summarize(self.seqs), f"sampling summary {self.summary} is stale"
        expected_layout = decode_layout(self.rows)
        assert all(map(torch.equal, self.layout[:3], expected_layout[:3])) and \
            self.layout.num_rows == expected_layout.num_rows, "the decode layout is stale"
