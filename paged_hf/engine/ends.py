"""The end test run after every sampled token: whether a request's stop tokens, EOS or length end its sequence."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from .request import Request, Sequence


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
        if token in params.stop_token_ids and not held_back:
            return "stop", token
        if not params.ignore_eos and token in self.eos_token_ids and not held_back:
            return "stop", None
        if num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length", None
        return None
