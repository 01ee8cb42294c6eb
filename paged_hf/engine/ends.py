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
    needs the output stage per token (each reports only when it ends, ``FINAL_ONLY``, and has no stop strings)."""

    quiet: bool
    max_len: torch.Tensor  # [S] int64
    stop_ids: torch.Tensor  # [K] int64

    @classmethod
    def of(cls, seqs: list[Sequence], ends: Mapping[str, RequestEnds]) -> BatchEnds:
        row_ends = [ends[seq.request.request_id] for seq in seqs]
        quiet = all(seq.grammar is None and seq.request.params.logprobs is None and not seq.request.params.stop
                    and seq.request.output_kind is RequestOutputKind.FINAL_ONLY for seq in seqs)
        return cls(quiet, long_tensor([e.max_len for e in row_ends]),
                   long_tensor(sorted(frozenset().union(*(e.token_ids for e in row_ends)))))

    def ending_rows(self, lengths: torch.Tensor, token_ids: torch.Tensor) -> list[int]:
        """The rows that may end now, at ``lengths`` tokens after appending ``token_ids`` (``[S]`` each)."""
        maybe = lengths >= self.max_len
        if self.stop_ids.numel():
            maybe |= torch.isin(token_ids, self.stop_ids)
        return maybe.nonzero().view(-1).tolist()
