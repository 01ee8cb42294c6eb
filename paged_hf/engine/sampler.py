"""Per-request sampling from the last-token logits of one engine step.

Each sequence samples with its own ``torch.Generator`` when its request has a ``seed`` (so its text does not
depend on which other requests share the batch). A failure in one request's logits processors fails that
request only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingParams
from .request import Sequence


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    error: BaseException | None = None


def _plain_greedy(params: SamplingParams) -> bool:
    return (params.greedy and params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty and not params.logits_processors and params.logprobs is None)


def apply_penalties(logits: torch.Tensor, seq: Sequence, params: SamplingParams) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output, presence and frequency over the output."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        if output.numel():
            counts = torch.bincount(output, minlength=logits.shape[-1]).to(logits.dtype)
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (removed tokens get -inf)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, seq: Sequence) -> Sample:
    params = seq.request.params
    logits = logits.float().clone()
    for processor in params.logits_processors:
        logits = processor(list(seq.output_token_ids), logits)
    logits = apply_penalties(logits, seq, params)
    if params.greedy:
        token = int(torch.argmax(logits))
        dist = logits
    else:
        dist = filter_logits(logits, params)
        token = int(torch.multinomial(torch.softmax(dist, dim=-1), 1, generator=seq.generator))
    if params.logprobs is None:
        return Sample(token)
    logprobs = torch.log_softmax(dist, dim=-1)
    top = torch.topk(logprobs, params.logprobs) if params.logprobs else None
    top_logprobs = {} if top is None else {int(i): float(v) for v, i in zip(top.values, top.indices)}
    return Sample(token, float(logprobs[token]), top_logprobs)


def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[Sample]:
    """One ``Sample`` per row of ``logits`` ``[len(seqs), vocab]``; errors are returned, not raised."""
    if all(_plain_greedy(s.request.params) for s in seqs):
        return [Sample(int(t)) for t in torch.argmax(logits, dim=-1).tolist()]
    samples = []
    for row, seq in enumerate(seqs):
        try:
            samples.append(sample_one(logits[row], seq))
        except Exception as error:  # noqa: BLE001 - a user's logits processor may raise anything
            samples.append(Sample(-1, error=error))
    return samples
