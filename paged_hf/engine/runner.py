"""One forward of the stock HF model over every scheduled sequence.

The scheduled tokens are laid back to back in one row (``input_ids`` ``[1, T]``) with each token's own position;
the step plan tells the ``"paged"`` attention which tokens belong to which sequence and where their blocks are.
Only the rows whose next token is sampled get logits (``logits_to_keep``).
"""

from __future__ import annotations

import inspect

import torch

from ..step_plan import GroupPlan, StepPlan
from .engine_cache import EngineCache
from .request import Sequence


class ModelRunner:
    def __init__(self, model, cache: EngineCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _plan(self, scheduled: list) -> tuple[StepPlan, list[int], list[int], list[int], list[Sequence]]:
        input_ids, positions, new_counts, num_tokens = [], [], [], []
        slots = [[] for _ in self.cache.groups]
        copies = [[] for _ in self.cache.groups]
        sample_rows, sample_seqs = [], []
        for seq, count, per_group in scheduled:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + count])
            positions.extend(range(start, start + count))
            new_counts.append(count)
            num_tokens.append(start + count)
            for g, (group_slots, group_copies) in enumerate(per_group):
                slots[g].extend(group_slots)
                copies[g].extend(group_copies)
            if start + count == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        groups = {}
        for g, group in enumerate(self.cache.groups):
            src = dst = None
            if copies[g]:
                src = torch.tensor([c[0] for c in copies[g]], dtype=torch.long, device=self.device)
                dst = torch.tensor([c[1] for c in copies[g]], dtype=torch.long, device=self.device)
            groups[id(group)] = GroupPlan(
                slots=torch.tensor(slots[g], dtype=torch.long, device=self.device), copy_src=src, copy_dst=dst,
                block_ids=[seq.tables[g].block_ids for seq, _, _ in scheduled],
                block_size=group.block_size, device=self.device,
            )
        plan = StepPlan(batch_size=1, query_len=len(input_ids), new_counts=new_counts, num_tokens=num_tokens,
                        groups=groups, device=self.device)
        return plan, input_ids, positions, sample_rows, sample_seqs

    @torch.inference_mode()
    def execute(self, scheduled: list) -> tuple[list[Sequence], torch.Tensor]:
        """Runs the step; returns the sequences to sample and their logits ``[len(seqs), vocab]``."""
        plan, input_ids, positions, rows, seqs = self._plan(scheduled)
        self.cache.begin_step(plan)
        kwargs = {}
        keep = torch.tensor(rows or [len(input_ids) - 1], dtype=torch.long, device=self.device)
        if self.keeps_logits:
            kwargs["logits_to_keep"] = keep
        out = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=self.device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
            cache=self.cache, use_cache=True, **kwargs,
        )
        logits = out.logits[0] if self.keeps_logits else out.logits[0, keep]
        return seqs, logits[: len(seqs)]
