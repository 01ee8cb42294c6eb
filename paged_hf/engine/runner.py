"""One forward of the stock HF model over every scheduled sequence.

The scheduled tokens are laid back to back in one row (``input_ids`` ``[1, T]``) with each token's own position;
the ``AttentionMetadata`` (built once, on the model's device) tells the ``"paged"`` attention which tokens belong to
which sequence and where their blocks are. Only the rows whose next token is sampled get logits
(``logits_to_keep``), plus the prompt positions of requests that asked for prompt logprobs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..kv_manager import KVManager
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


class ModelRunner:
    def __init__(self, model, kv: KVManager) -> None:
        self.model = model
        self.kv = kv
        self.cache = EngineCache(kv)
        self.device = model.device
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)

    def prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata]:
        """``input_ids`` ``[1, T]`` and the metadata of the step (host work only; nothing runs on the model)."""
        scheduled = output.scheduled
        d = output.num_decodes
        input_ids = [item.seq.token_ids[item.start] for item in scheduled[:d]]
        for item in scheduled[d:]:
            input_ids.extend(item.seq.token_ids[item.start : item.start + item.num_tokens])
        metadata = build_metadata(
            self.kv, [item.seq.kv for item in scheduled], [item.start for item in scheduled],
            [item.num_tokens for item in scheduled], d, self.device,
        )
        return torch.tensor([input_ids], dtype=torch.long).to(self.device, non_blocking=True), metadata

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """Runs the step's block copies, then the forward; returns the logits the step needs.

        A failure of the copies raises ``BlockCopyError``; a failure of the forward raises what it raised (the copies
        are done then: ``forward`` can run parts of the step again)."""
        try:
            self.kv.apply_copies(output.copies)
        except Exception as error:
            raise BlockCopyError(f"the step's block copies failed: {type(error).__name__}: {error}") from error
        return self.forward(output)

    @torch.inference_mode()
    def forward(self, output: SchedulerOutput) -> ModelOutput:
        """The forward of ``output``'s sequences (its block copies must have run); the logits the step needs."""
        input_ids, metadata = self.prepare(output)
        ends = metadata.query_start_loc[1:] - 1  # [S]: each sequence's last token row
        keep_rows: list[torch.Tensor] = []
        sample_index = [i for i, item in enumerate(output.scheduled) if item.samples]
        prompt_rows: dict[int, tuple[int, int]] = {}
        first = len(sample_index)
        keep_rows.append(ends[torch.tensor(sample_index, dtype=torch.long, device=self.device)]
                         if len(sample_index) != len(output.scheduled) else ends)
        for i, item in enumerate(output.scheduled):
            if item.seq.request.params.prompt_logprobs is not None and item.seq.index == 0:
                count = _prompt_positions(item)
                if count:
                    start = int(metadata.query_start_loc[i])
                    keep_rows.append(torch.arange(start, start + count, device=self.device))
                    prompt_rows[i] = (first, count)
                    first += count
        keep = torch.cat(keep_rows) if len(keep_rows) > 1 else keep_rows[0]
        self.cache.metadata = metadata
        kwargs = {"logits_to_keep": keep} if self.keeps_logits else {}
        try:
            out = self.model(input_ids=input_ids, position_ids=metadata.positions.unsqueeze(0), cache=self.cache,
                             attention_mask=self.no_mask, use_cache=True, **kwargs)
        finally:
            self.cache.metadata = None
        logits = out.logits[0] if self.keeps_logits else out.logits[0, keep]
        return ModelOutput(logits, list(range(len(sample_index))), prompt_rows)


def _prompt_positions(item) -> int:
    """Prompt positions of this chunk whose next token is a prompt token (their logits score the prompt)."""
    prompt_len = len(item.seq.request.prompt_token_ids)
    return max(0, min(item.start + item.num_tokens, prompt_len - 1) - item.start)
