"""Failing alone: when a step's forward raises, find the sequences that make it raise; the others go on.

This runs only when a forward raised. The step's sequences run again in sub-batches, halving (each half keeps the
scheduled order, so its decodes stay first) down to single sequences: a sequence whose forward raises on its own is a
culprit, and every sub-batch that succeeds keeps its logits. The scheduler already gave every sequence its slots, so
a retry writes the same K/V at the same slots again: the good sequences get the logits of the full batch.

One dependency needs care. A sequence admitted in this step may hit prefix blocks that another sequence of the same
step fills (the scheduler registers them when it schedules: in one forward every layer stores the whole step's K/V
before it attends). Run apart, such a reader must run after its writer succeeded, and if the writer failed, the
blocks hold nothing: the reader goes back to the waiting queue to compute its prompt again. So the sub-batches run in
waves, each wave holding the sequences whose writers all succeeded.

A format with a full-precision tail (int4) adds one more. A prompt chunk that starts inside a block (older tokens in
its tail row) and leaves tokens in a later block writes that tail row after each layer's attention, over the older
tokens; a retry would then quantize the block from the new ones. Such a sequence does not retry: it computes its
tokens again (``tail_rewriters``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..distributed.group import TensorParallelError
from ..kv.manager import KVManager
from .model_output import ModelOutput
from .scheduled import ScheduledSequence, SchedulerOutput


@dataclass
class Isolation:
    """What the retries found. Indices are positions in the failed step's ``scheduled`` list."""

    succeeded: list[tuple[list[int], ModelOutput]] = field(default_factory=list)  # sub-batches that ran
    failed: list[tuple[int, BaseException]] = field(default_factory=list)  # culprits, with their own error
    requeue: list[int] = field(default_factory=list)  # readers of a failed writer's blocks: compute again
    num_forwards: int = 0

    def merged(self, output: SchedulerOutput, keep) -> tuple[SchedulerOutput, ModelOutput] | None:
        """The succeeded sequences that ``keep(item)`` accepts, in scheduled order (decodes first), with their
        logits: what the step's forward would have returned for them alone. None if there are none."""
        where: dict[int, tuple] = {}  # index -> (offset, sample row, prompt rows, draft rows)
        parts, offset = [], 0
        for indices, model_output in self.succeeded:
            sampling = iter(model_output.sample_rows)
            for local, index in enumerate(indices):
                item = output.scheduled[index]
                sample_row = next(sampling) if item.samples and not item.draft_token_ids else None
                where[index] = (offset, sample_row, model_output.prompt_rows.get(local),
                                model_output.draft_rows.get(local))
            parts.append(model_output.logits)
            offset += model_output.logits.shape[0]
        kept = sorted(i for i in where if keep(output.scheduled[i]))
        if not kept:
            return None
        sample_rows, prompt_rows, draft_rows = [], {}, {}
        for new_index, index in enumerate(kept):
            base, sample_row, prompt, drafts = where[index]
            if sample_row is not None:
                sample_rows.append(base + sample_row)
            if prompt is not None:
                prompt_rows[new_index] = (base + prompt[0], prompt[1])
            if drafts is not None:
                draft_rows[new_index] = (base + drafts[0], drafts[1])
        items = [output.scheduled[i] for i in kept]
        num_decodes = sum(1 for i in kept if i < output.num_decodes)
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        return SchedulerOutput(items, num_decodes), ModelOutput(logits, sample_rows, prompt_rows, draft_rows)


def isolate(forward: Callable[[SchedulerOutput], ModelOutput], kv: KVManager, output: SchedulerOutput,
            error: BaseException) -> Isolation:
    """Re-runs the sequences of ``output`` (whose block copies are done and whose forward raised ``error``) in
    sub-batches, each through ``forward``, until each culprit is found alone."""
    items = output.scheduled
    writers = same_step_writers(items, kv)
    result = Isolation()
    succeeded: dict[int, bool] = {}
    for i in tail_rewriters(items, kv):  # their blocks cannot be refilled from their tail rows: compute again
        succeeded[i] = False
        result.requeue.append(i)
    pending = [i for i in range(len(items)) if i not in succeeded]
    # with no dependency and no one set aside, the whole batch is known to raise `error`
    known = error if not any(writers) and not succeeded else None
    while pending:
        blocked = [i for i in pending if any(succeeded.get(w) is False for w in writers[i])]
        for i in blocked:
            succeeded[i] = False
            result.requeue.append(i)
        ready = [i for i in pending if i not in succeeded and all(succeeded.get(w) for w in writers[i])]
        assert ready or blocked, "same-step block dependencies form a cycle"
        _bisect(forward, output, ready, known, succeeded, result)
        known = None
        pending = [i for i in pending if i not in succeeded]
    return result


def _bisect(forward: Callable[[SchedulerOutput], ModelOutput], output: SchedulerOutput, indices: list[int], error: BaseException | None,
            succeeded: dict[int, bool], result: Isolation) -> None:
    if not indices:
        return
    if error is None:
        sub = SchedulerOutput([output.scheduled[i] for i in indices], sum(1 for i in indices if i < output.num_decodes))
        result.num_forwards += 1
        try:
            model_output = forward(sub)
        except TensorParallelError:  # the group broke: no sub-batch can run; the engine fails everything
            raise
        except Exception as raised:  # noqa: BLE001 - a culprit may raise anything; it is reported, not swallowed
            error = raised
        else:
            result.succeeded.append((indices, model_output))
            succeeded.update((i, True) for i in indices)
            return
    if len(indices) == 1:
        succeeded[indices[0]] = False
        result.failed.append((indices[0], error))
        return
    half = len(indices) // 2
    _bisect(forward, output, indices[:half], None, succeeded, result)
    _bisect(forward, output, indices[half:], None, succeeded, result)


def tail_rewriters(items: list[ScheduledSequence], kv: KVManager) -> list[int]:
    """Tail formats: the scheduled sequences whose chunk fills a block that holds older tokens of their tail row and
    leaves new tokens in a later block, i.e. whose tail writes overwrite tokens a retry's block fill reads."""
    if not kv.has_tail:
        return []
    size = kv.block_size
    return [index for index, item in enumerate(items)
            if item.start % size and (item.start + item.num_tokens) % size
            and item.start // size != (item.start + item.num_tokens) // size]


def same_step_writers(items: list[ScheduledSequence], kv: KVManager) -> list[set[int]]:
    """For each scheduled sequence, the others of the step whose new tokens fill blocks it reads as its prefix
    (a prefix hit on a block registered in this step), in any layer group: a hybrid model's sliding group may hit
    older cached blocks where its full group hits one this step fills. Empty sets without prefix caching."""
    if not kv.prefix_caching:
        return [set() for _ in items]
    size = kv.block_size
    filled: dict[tuple[int, int], int] = {}  # (group, block id) -> the sequence writing it this step
    for index, item in enumerate(items):
        for g, table in enumerate(item.seq.kv.tables):
            for block in table.blocks[item.start // size : -(-(item.start + item.num_tokens) // size)]:
                filled[g, block.block_id] = index
    writers = []
    for index, item in enumerate(items):
        writers.append({filled[g, b.block_id] for g, table in enumerate(item.seq.kv.tables)
                        for b in table.blocks[: item.start // size]
                        if b is not None and filled.get((g, b.block_id), index) != index})
    return writers
