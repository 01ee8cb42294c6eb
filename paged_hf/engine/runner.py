"""One forward of the stock HF model over every scheduled sequence.

The scheduled tokens are laid back to back in one row (``input_ids`` ``[1, T]``) with each token's own position;
the ``AttentionMetadata`` (built once, on the model's device) tells the ``"paged"`` attention which tokens belong to
which sequence and where their blocks are. Only the rows whose next token is sampled get logits
(``logits_to_keep``), plus the prompt positions of requests that asked for prompt logprobs.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from ..distributed.group import TensorParallelError
from ..kv.manager import KVManager
from ..metadata import AttentionMetadata, build_metadata
from .forward_cache import EngineCache
from .scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    """Logits of one step: ``logits[i]`` predicts the token after position ``positions[i]`` of sequence
    ``output.scheduled[sequence[i]]``. The last row of each sampling sequence comes first, in scheduled order."""

    logits: torch.Tensor  # [R, vocab]
    sample_rows: list[int]  # rows of `logits` holding each sampling sequence's next-token logits, scheduled order
    prompt_rows: dict[int, tuple[int, int]]  # scheduled index -> (first row, count) of its prompt-logprob rows


class BlockCopyError(RuntimeError):
    """The step's block copies (copy-on-write, swap) failed: any sequence of the step may hold wrong K/V."""


@dataclass
class StepInput:
    """What every rank needs to run one forward: the packed token ids ``[T]``, the attention metadata, the rows of
    logits to keep and the block copies to run first. Built by the leader (``ModelRunner.plan``); under tensor
    parallelism it is broadcast, with its tensors on the CPU, and each rank moves it to its device."""

    input_ids: torch.Tensor
    metadata: AttentionMetadata
    keep: torch.Tensor
    copies: list = field(default_factory=list)
    num_rows: int = 0  # the leader's block-table rows (a follower gives its tail formats as many tail rows)


class ModelRunner:
    """Runs the engine's forwards. ``group``: the tensor-parallel group, whose other ranks run every forward the
    leader plans (the runner broadcasts each ``StepInput`` before running it); None on one process."""

    def __init__(self, model, kv: KVManager, group=None) -> None:
        self.model = model
        self.kv = kv
        self.cache = EngineCache(kv)
        self.device = model.device
        self.group = group
        self.executor = None  # the followers this process started (from_pretrained), checked before each broadcast
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self.last_broadcast = time.monotonic()

    def plan(self, output: SchedulerOutput, copies: list) -> tuple[StepInput, list[int], dict[int, tuple[int, int]]]:
        """The ``StepInput`` of ``output``'s forward (host work only), and where its logits go: the rows of the
        sampling sequences, in scheduled order, and per prompt-logprob sequence ``(first row, count)``."""
        scheduled = output.scheduled
        d = output.num_decodes
        input_ids = [item.seq.token_ids[item.start] for item in scheduled[:d]]
        for item in scheduled[d:]:
            input_ids.extend(item.seq.token_ids[item.start : item.start + item.num_tokens])
        device = "cpu" if self.group is not None else self.device  # broadcast from the host, then moved
        metadata = build_metadata(
            self.kv, [item.seq.kv for item in scheduled], [item.start for item in scheduled],
            [item.num_tokens for item in scheduled], d, device,
        )
        ends = metadata.query_start_loc[1:] - 1  # [S]: each sequence's last token row
        sample_index = [i for i, item in enumerate(scheduled) if item.samples]
        keep_rows = [ends if len(sample_index) == len(scheduled)
                     else ends[torch.tensor(sample_index, dtype=torch.long, device=ends.device)]]
        prompt_rows: dict[int, tuple[int, int]] = {}
        first = len(sample_index)
        for i, item in enumerate(scheduled):
            if item.seq.request.params.prompt_logprobs is not None and item.seq.index == 0:
                count = _prompt_positions(item)
                if count:
                    start = int(metadata.query_start_loc[i])
                    keep_rows.append(torch.arange(start, start + count, device=ends.device))
                    prompt_rows[i] = (first, count)
                    first += count
        keep = torch.cat(keep_rows) if len(keep_rows) > 1 else keep_rows[0]
        step = StepInput(torch.tensor(input_ids, dtype=torch.long), metadata, keep, copies, self.kv.num_rows)
        return step, list(range(len(sample_index))), prompt_rows

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Runs the step's block copies, then the forward; returns the logits the step needs.

        A failure of the copies raises ``BlockCopyError``; a failure of the forward raises what it raised (the copies
        are done then: ``forward`` can run parts of the step again)."""
        return self._run_planned(output, output.copies)

    @torch.inference_mode()
    def forward(self, output: SchedulerOutput) -> ModelOutput:
        """The forward of ``output``'s sequences (its block copies must have run); the logits the step needs."""
        return self._run_planned(output, [])

    def _run_planned(self, output: SchedulerOutput, copies: list) -> ModelOutput:
        step, sample_rows, prompt_rows = self.plan(output, copies)
        self.broadcast(("step", step))
        return ModelOutput(self.run(step), sample_rows, prompt_rows)

    def broadcast(self, message) -> None:
        """Sends ``message`` to the other ranks (tensor parallelism), after checking they are alive."""
        if self.group is None:
            return
        if self.executor is not None:
            self.executor.check()
        self.group.broadcast(message)
        self.last_broadcast = time.monotonic()

    def _check_group(self, error: BaseException) -> None:
        """``TensorParallelError`` if ``error`` (raised by a forward) comes from a broken group: a follower this
        process started has died, or a collective failed."""
        if self.group is None:
            return
        if self.executor is not None:
            self.executor.check()
        if isinstance(error, torch.distributed.DistError):
            raise TensorParallelError(f"a collective of the forward failed: {error}") from error

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Runs ``step`` on this rank: its block copies, then the forward; the kept logits ``[R, vocab]``."""
        self.kv.cover_rows(step.num_rows)
        try:
            self.kv.apply_copies(step.copies)
        except Exception as error:
            raise BlockCopyError(f"the step's block copies failed: {type(error).__name__}: {error}") from error
        metadata = step.metadata if step.metadata.device == self.device else step.metadata.to(self.device)
        keep = step.keep.to(self.device, non_blocking=True)
        self.cache.metadata = metadata
        kwargs = {"logits_to_keep": keep} if self.keeps_logits else {}
        try:
            out = self.model(input_ids=step.input_ids.to(self.device, non_blocking=True).unsqueeze(0),
                             position_ids=metadata.positions.unsqueeze(0), cache=self.cache,
                             attention_mask=self.no_mask, use_cache=True, **kwargs)
        except Exception as error:
            self._check_group(error)
            raise
        finally:
            self.cache.metadata = None
        return out.logits[0] if self.keeps_logits else out.logits[0, keep]


def _prompt_positions(item) -> int:
    """Prompt positions of this chunk whose next token is a prompt token (their logits score the prompt)."""
    prompt_len = len(item.seq.request.prompt_token_ids)
    return max(0, min(item.start + item.num_tokens, prompt_len - 1) - item.start)
