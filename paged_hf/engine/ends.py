"""The end test run after every sampled token: whether a request's stop tokens, EOS or length end its sequence."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

import torch

from ..metadata import long_tensor
from .request import Request, RequestOutputKind, Sequence


class RequestEnds(NamedTuple):
    """What can end ``request``, fixed when it is added: ``token_ids`` (its stop token ids, and EOS unless it ignores
    EOS; ``min_tokens`` may still hold them back) and ``max_len`` (prompt + ``max_tokens``, or ``max_model_len`` if
    shorter: at this many tokens it ends by length)."""

    token_ids: frozenset[int]
    max_len: int
    eos_token_ids: frozenset[int]
    max_model_len: int

    @classmethod
    def of(cls, request: Request, eos_token_ids: Collection[int], max_model_len: int) -> RequestEnds:
        params = request.params
        eos = frozenset(eos_token_ids)
        return cls(frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos),
                   min(len(request.prompt_token_ids) + params.max_tokens, max_model_len), eos, max_model_len)

    def reached(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """``(finish_reason, stop_reason)`` if ``token``, just appended to ``seq``, ends it; else None. Only a token in
        ``token_ids`` or a sequence at ``max_len`` tokens can end (the scheduler asks only then: most tokens are ruled
        out by that set lookup and length test, before any call)."""
        params = seq.request.params
        num_output = len(seq.token_ids) - len(seq.request.prompt_token_ids)
        held_back = num_output <= params.min_tokens  # the sampler masks stops until min_tokens are out
        if not params.ignore_eos and token in self.eos_token_ids and not held_back:
            return "stop", None  # EOS first, as vLLM: a stop token id that is EOS gives no stop_reason
        if token in params.stop_token_ids and not held_back:
            return "stop", token
        if num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length", None
        return None


class BatchEnds(NamedTuple):
    """The end tests of a persistent decode batch's rows as tensors (``DecodeBatch.seqs``; built once per batch):
    row ``r`` may end when its length reaches ``max_len[r]`` or it draws one of ``stop_ids`` (every row's stop token
    ids, a superset for each row: ``RequestEnds.reached`` decides). ``quiet``: no row has a grammar or logprobs or
    needs the output stage per token (each reports only when it ends, ``FINAL_ONLY``, and has no stop strings).
    Every row grows by one token a step, so no row reaches its length before the batch's ``longest`` is ``margin``
    past ``start`` (its value at the build): until then, a step whose tokens avoid ``stop_set`` ends no row, and
    ``ending_rows`` says so without a tensor op."""

    quiet: bool
    max_len: torch.Tensor  # [S] int64
    stop_ids: torch.Tensor  # [K] int64
    stop_set: frozenset[int]  # the same ids
    margin: int  # min(max_len - lengths) at the build
    start: int  # the batch's ``longest`` at the build

    @classmethod
    def of(cls, seqs: list[Sequence], ends: Mapping[str, RequestEnds], positions: torch.Tensor,
           longest: int) -> BatchEnds:
        """The ends of rows ``seqs`` whose next input tokens take ``positions`` (their lengths - 1), the longest of
        which is ``longest`` tokens long."""
        row_ends = [ends[seq.request.request_id] for seq in seqs]
        quiet = all(seq.grammar is None and seq.request.params.logprobs is None and not seq.request.params.stop
                    and seq.request.output_kind is RequestOutputKind.FINAL_ONLY for seq in seqs)
        max_len = long_tensor([e.max_len for e in row_ends])
        stops = frozenset().union(*(e.token_ids for e in row_ends))
        margin = int((max_len - (positions + 1)).min()) if seqs else 0
        return cls(quiet, max_len, long_tensor(sorted(stops)), stops, margin, longest)

    def ending_rows(self, positions: torch.Tensor, token_ids: torch.Tensor, tokens: list[int],
                    longest: int) -> list[int]:
        """The rows that may end now, after appending ``token_ids`` (``[S]``; ``tokens``: as a list) at
        ``positions`` (``[S]``, the batch's: lengths - 1) in the batch whose longest row is now ``longest``."""
        if longest - self.start < self.margin and self.stop_set.isdisjoint(tokens):
            return []
        maybe = positions + 1 >= self.max_len
        if self.stop_ids.numel():
            maybe |= torch.isin(token_ids, self.stop_ids)
        return maybe.nonzero().view(-1).tolist()
