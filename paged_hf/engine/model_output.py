"""``ModelOutput``: the logits one forward of the engine keeps, and where each sequence's rows are."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModelOutput:
    """Logits of one step. ``sample_rows[j]``: the row predicting the next token of the ``j``-th sampling sequence
    (in scheduled order); ``prompt_rows[i] = (first row, count)``: the prompt-logprob rows of scheduled sequence
    ``i``, predicting its prompt tokens ``start + 1 ..``; ``draft_rows[i] = (first row, 1 + k)``: the rows of
    scheduled sequence ``i`` with ``k`` speculative drafts (its newest token's, then each draft's), which are not among
    ``sample_rows``."""

    logits: torch.Tensor  # [R, vocab]
    sample_rows: list[int]
    prompt_rows: dict[int, tuple[int, int]]
    draft_rows: dict[int, tuple[int, int]] = field(default_factory=dict)
