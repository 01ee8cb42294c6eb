"""Verification of a step's drafts: every one of a sequence's ``1 + k`` rows drawn by the engine's sampler, as the
sequence would be after the drafts before it were accepted, then the acceptance rule (``rejection.py``).

A row ``j`` of a sequence with drafts ``d_0 .. d_{k-1}`` predicts the token after ``d_{j-1}``: the sampler sees the
sequence extended by ``d_0 .. d_{j-1}`` (``DraftView``), so ``min_tokens``, penalties and logits processors apply to
each position as an unspeculated step would apply them. Logprobs are the target's raw ones at each emitted position.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from ..request import PositionLogprobs, Request, Sequence
from ..sampler import sample
from .rejection import num_accepted


class DraftView:
    """What the sampler reads of ``seq`` extended by ``drafts`` (the drafts before one verified row)."""

    __slots__ = ("request", "generator", "grammar", "_seq", "_drafts")

    def __init__(self, seq: Sequence, drafts: tuple[int, ...]) -> None:
        self.request = seq.request
        self.generator = seq.generator
        self.grammar = None  # requests with a grammar never speculate (``Speculator.eligible``)
        self._seq, self._drafts = seq, drafts

    @property
    def token_ids(self) -> list[int]:  # built when read (penalties, logits processors): most steps never do
        return self._seq.token_ids + list(self._drafts) if self._drafts else self._seq.token_ids

    @property
    def num_output_tokens(self) -> int:
        return self._seq.num_output_tokens + len(self._drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt_token_ids):]


@dataclass
class VerifiedRun:
    """One sequence's verified drafts: ``token_ids`` (the accepted drafts, then the resampled or bonus token) with
    their ``logprobs`` entries (None when not asked); ``num_drafts`` proposed, ``num_accepted`` of them accepted."""

    seq: Sequence
    start: int  # the position of the step's first token (the sequence's last sampled token)
    num_drafts: int
    num_accepted: int
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


def verify(logits: torch.Tensor, runs: list[tuple[Sequence, int, tuple[int, ...], int]], decode_token=None,
           eos_token_ids: Collection[int] = ()) -> tuple[list[VerifiedRun], list[tuple[Request, BaseException]]]:
    """``runs[i] = (seq, start, drafts, first row)``: its ``1 + len(drafts)`` rows of ``logits`` ``[R, vocab]``
    begin at ``first row``. One sampler call over every row; a sequence whose emitted rows failed (a raising
    logits processor, NaN logits) is returned among the errors instead."""
    views, rows = [], []
    for seq, _, drafts, first in runs:
        for j in range(len(drafts) + 1):
            views.append(DraftView(seq, drafts[:j]))
            rows.append(first + j)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    drawn = sample(logits.index_select(0, index), views, decode_token, eos_token_ids)
    verified, errors = [], []
    base = 0
    for seq, start, drafts, _ in runs:
        count = len(drafts) + 1
        tokens = drawn.token_ids[base : base + count]
        accepted = num_accepted(tokens, drafts)
        emitted = accepted + 1
        failed = next((drawn.errors[r] for r in range(base, base + emitted) if r in drawn.errors), None)
        if failed is not None:
            errors.append((seq.request, failed))
        else:
            verified.append(VerifiedRun(seq, start, len(drafts), accepted, tokens[:emitted],
                                        drawn.logprobs[base : base + emitted]))
        base += count
    return verified, errors
