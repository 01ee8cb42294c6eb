"""The grammar masks of one step, applied to every constrained row of the logits at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .grammar import xgrammar_module
from .matcher import SequenceGrammar


def mask_logits(logits: torch.Tensor, grammars: Sequence[SequenceGrammar | None]) -> torch.Tensor:
    """A float32 copy of ``logits`` ``[R, vocab]`` where each row ``r`` with a grammar keeps only the tokens it
    allows next (the others are -inf); rows without one are copied unchanged. One bitmask ``[R, ceil(vocab / 32)]``
    is filled (a row per constrained sequence) and applied to all of them in one call."""
    masked = logits.to(torch.float32, copy=True)
    rows = [r for r, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return masked
    xgr = xgrammar_module()
    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[-1])
    for r in rows:
        grammars[r].fill(bitmask, r)
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device, non_blocking=True), indices=rows)
    return masked
