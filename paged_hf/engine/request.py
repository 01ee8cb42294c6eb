"""Requests, their sequences, and their vLLM-shaped outputs.

A ``Request`` holds one prompt and ``n`` ``Sequence``s (parallel samples). Sequences are what the scheduler runs:
each holds a ``SequenceKV`` (its blocks) and a count of tokens whose K/V is in the pool.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..kv.sequence import SequenceKV
from .detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no KV (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"  # KV moved to CPU
    FORK_PENDING = "fork_pending"  # sample i > 0 of a request: waits for sample 0's prompt, then shares its blocks
    FINISHED = "finished"


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's names).

    CUMULATIVE: everything so far, at every step; DELTA: only what is new since the last output (streaming);
    FINAL_ONLY: one output, when the request finishes (``generate``: no per-step text work at all).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class Logprob:
    """vLLM's logprob entry: the token's log-probability under the model's raw distribution, its rank (1 = most
    likely) and its text (None when the engine has no tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One generated (or prompt) position: token id -> Logprob, holding the chosen token and the top-k.
PositionLogprobs = dict[int, Logprob]


class Sequence:
    """One sample of a request. ``token_ids`` = prompt + generated; K/V exists for ``num_computed_tokens``."""

    __slots__ = ("request", "index", "token_ids", "status", "num_computed_tokens", "kv", "finish_reason",
                 "stop_reason", "logprobs", "cumulative_logprob", "generator", "detokenizer", "spec_gate",
                 "grammar")

    def __init__(self, request: "Request", index: int, token_ids: list[int]) -> None:
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.kv: SequenceKV | None = None  # set by the scheduler when the sequence first gets blocks
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[PositionLogprobs] = []
        self.cumulative_logprob = 0.0
        self.generator: torch.Generator | None = None
        self.detokenizer: IncrementalDetokenizer | None = None  # the output stage's
        self.spec_gate = None  # speculative decoding's AcceptanceGate (engine/spec/gate.py), made when it proposes
        self.grammar = None  # its SequenceGrammar (structured outputs), set when its request's grammar is compiled

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.request.prompt_token_ids):]

    @property
    def output_text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def __repr__(self) -> str:
        return f"Sequence({self.request.request_id}#{self.index}, {self.status.value}, {len(self.token_ids)} tokens)"


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
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.reuse_prefix = True  # False: the scheduler looks up no cached prefix for it
        self.images = None  # its RequestImages (multimodal.py), set by the engine for a request with images
        self.compiled_grammar = None  # structured outputs: the Future of its CompiledGrammar (engine.add_request)
        self.bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words tokenized (engine.add_request)
        self.output_kind = output_kind
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.error: BaseException | None = None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = [None] if params.prompt_logprobs is not None \
            else None
        self.sequences = [Sequence(self, i, list(prompt_token_ids)) for i in range(params.n)]
        for seq in self.sequences[1:]:
            seq.status = SequenceStatus.FORK_PENDING
        if params.seed is not None:
            for seq in self.sequences:
                seq.generator = torch.Generator().manual_seed(params.seed + seq.index)

    @property
    def finished(self) -> bool:
        if len(self.sequences) == 1:
            return self.sequences[0].status is SequenceStatus.FINISHED
        return all(seq.status is SequenceStatus.FINISHED for seq in self.sequences)


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's shape). ``logprobs``: one ``{token_id: Logprob}`` per generated token when
    the request asked for them (``SamplingParams(logprobs=k)``), else None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """A request's progress (vLLM's shape); ``error`` names what failed when ``finish_reason == "error"``.

    ``prompt_logprobs``: one entry per prompt token (None for the first) when asked (``prompt_logprobs=k``).
    ``num_cached_tokens``: prompt tokens served from the prefix cache when the request was first scheduled (vLLM's
    field; None before that).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int | None = None
