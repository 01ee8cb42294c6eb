"""Forwards the engine runs before serving (the compile warm-up, the attention probe) on scratch pools shaped as
the engine's: a few blocks of their own, so the engine's pools and prefix cache stay untouched."""

from __future__ import annotations

import contextlib

import torch

from ..kv.manager import KVManager
from ..kv.sizing import allocate_all
from ..metadata import AttentionMetadata, build_metadata
from .forward_cache import EngineCache

SCRATCH_BLOCKS = 16
# the most tokens and sequences one scratch step holds (the compile warm-up's mixed step: 20 tokens in 3 sequences)
SCRATCH_TOKENS, SCRATCH_SEQS = 32, 4


def scratch_blocks(block_size: int) -> int:
    """Blocks enough for any scratch step at ``block_size`` (each sequence may end in a part-filled block), and at
    least ``SCRATCH_BLOCKS``."""
    return max(SCRATCH_BLOCKS, -(-SCRATCH_TOKENS // block_size) + SCRATCH_SEQS)


class ScratchForwards:
    """Scratch pools shaped as ``kv``'s (``scratch_blocks`` blocks) and an ``EngineCache`` over them."""

    def __init__(self, kv: KVManager, dtype: torch.dtype, device) -> None:
        self.kv = KVManager(kv.text_config, kv.block_size, kv.kv_cache_dtype, num_blocks=scratch_blocks(kv.block_size),
                            tp_size=kv.tp_size, recurrent_states=kv.recurrent is not None)
        allocate_all(self.kv, dtype, device)
        self.cache = EngineCache(self.kv)
        self.device = device

    @contextlib.contextmanager
    def step(self, starts: tuple[int, ...], counts: tuple[int, ...], num_decodes: int,
             attention_mask: torch.Tensor, keeps_logits: bool):
        """The metadata and model inputs of a step whose sequence ``s`` holds ``starts[s]`` tokens and adds
        ``counts[s]`` (the first ``num_decodes`` add one), token ids all 1, the cache holding the metadata; its
        sequences are freed after."""
        seqs = [self.kv.new_sequence() for _ in starts]
        for seq, start, count in zip(seqs, starts, counts):
            self.kv.append(seq, start + count)
        metadata: AttentionMetadata = build_metadata(self.kv, seqs, list(starts), list(counts), num_decodes,
                                                     self.device)
        inputs = dict(input_ids=torch.ones((1, metadata.num_tokens), dtype=torch.long, device=self.device),
                      position_ids=metadata.positions.unsqueeze(0), cache=self.cache,
                      attention_mask=attention_mask, use_cache=True)
        if keeps_logits:
            inputs["logits_to_keep"] = metadata.query_start_loc[1:] - 1
        if metadata.recurrent is not None:  # no scratch sequence ever wrote a state
            metadata.recurrent = metadata.recurrent.all_fresh()
        self.cache.metadata = metadata
        try:
            yield metadata, inputs
        finally:
            self.cache.metadata = None
            if self.kv.recurrent is not None:
                self.kv.recurrent.discard()
            for seq in seqs:
                self.kv.free(seq)
