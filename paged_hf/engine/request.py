"""Requests and their vLLM-shaped outputs.

A ``Request`` holds one prompt and ``n`` ``Sequence``s (parallel samples). Sequences are what the scheduler
runs: each owns block tables (one per layer group) and a count of tokens whose K/V is in the pool.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no KV (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"  # KV moved to CPU
    FORK_PENDING = "fork_pending"  # sample i > 0 of a request: waits for sample 0's prompt, then shares its blocks
    FINISHED = "finished"


@dataclass
class Sequence:
    """One sample of a request. ``token_ids`` = prompt + generated; K/V exists for ``num_computed_tokens``."""

    request: "Request"
    index: int
    token_ids: list[int]
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    tables: list = field(default_factory=list)  # BlockTable per layer group, empty while WAITING
    swapped_blocks: list = field(default_factory=list)  # per group: CPU block ids, while SWAPPED
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks of token_ids
    num_cached_blocks: int = 0  # leading full blocks already registered in the prefix cache
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    logprobs: list = field(default_factory=list)
    generator: torch.Generator | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prefix_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Request:
    """A prompt and its sampling parameters; ``priority`` matters under ``scheduling_policy="priority"``."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.error: BaseException | None = None
        self.sequences = [Sequence(self, i, list(prompt_token_ids)) for i in range(params.n)]
        for seq in self.sequences[1:]:
            seq.status = SequenceStatus.FORK_PENDING
        if params.seed is not None:
            for seq in self.sequences:
                seq.generator = torch.Generator().manual_seed(params.seed + seq.index)

    @property
    def finished(self) -> bool:
        return all(seq.status is SequenceStatus.FINISHED for seq in self.sequences)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None

    @staticmethod
    def of(request: Request) -> "RequestOutput":
        outputs = [
            CompletionOutput(
                index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
            )
            for seq in request.sequences
        ]
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs, request.finished,
            request.metrics, None if request.error is None else f"{type(request.error).__name__}: {request.error}",
        )
