"""Draft-model proposals: a small model of the target's vocabulary guesses ``k`` tokens greedily, batched over the
step's decoding sequences, on its own paged pool.

Each proposing sequence keeps a ``SequenceKV`` in the draft's pool holding the K/V of ``num_valid`` of its tokens and
of the drafts proposed after them. At the next proposal the drafts the sequence's tokens now repeat (the accepted
ones, or a resampled token equal to a draft) stay, the rest is rolled back (``KVManager.truncate``); the tokens
after that are computed as one chunk (a catch-up prefill whose last row gives draft 0), then ``k - 1`` one-token
forwards give drafts ``1 .. k - 1``: ``k`` forwards a step, each over every proposing sequence. Greedy drafts are a
point mass, so the engine's acceptance rule (``rejection.py``) keeps the target's distribution as for n-gram drafts.
The catch-up chunks of a step hold at most ``max_num_batched_tokens`` tokens together, as the target's steps do: a
sequence whose catch-up does not fit (its whole prompt, at its first proposal) computes what fits and proposes from
a later step on. The draft runs compiled where the engine compiles its target (``ModelRunner``'s compiled forward,
on the draft's own pool), else eagerly.

A sequence whose tokens do not fit the draft's pool, or pass the draft's ``max_position_embeddings``, proposes nothing
(its request never fails for it); its draft KV is freed when it finishes or is preempted by recompute (``release``),
and computed again from its start. A draft with sliding-window layers frees the blocks behind its windows as the
target does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...kv.manager import KVManager
from ...kv.sequence import SequenceKV
from ...kv.sizing import allocate_all
from ...metadata import build_metadata, long_tensor
from ..request import Sequence
from ..runner import ModelRunner, StepInput
from ..validation import vocab_size
from ..worker import prepare_model

logger = logging.getLogger("paged_hf")


@dataclass(slots=True)
class DraftKV:
    """A sequence's K/V in the draft's pool: its first ``num_valid`` tokens, then ``drafts`` (the last proposal's
    drafts that were computed, all but its last one)."""

    kv: SequenceKV
    num_valid: int = 0
    drafts: tuple[int, ...] = ()


def load_draft_model(model, target):
    """``model`` (a loaded model or a folder) ready to draft for ``target``: in the paged attention, on the target's
    device; ValueError naming ``speculative_config['model']`` when its vocabulary size is not the target's."""
    if not isinstance(model, torch.nn.Module):
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 - only a folder needs it

        model = AutoModelForCausalLM.from_pretrained(model, dtype=target.dtype).to(target.device)
    ours = vocab_size(model, model.config.get_text_config(decoder=True))
    theirs = vocab_size(target, target.config.get_text_config(decoder=True))
    if ours != theirs:
        raise ValueError(f"speculative_config['model'] must have the target's vocabulary: its vocab_size is {ours}, "
                         f"the target's {theirs}")
    if model.device != target.device:
        raise ValueError(f"speculative_config['model'] must be on the target's device {target.device}, "
                         f"got {model.device}")
    return prepare_model(model)


class DraftModelProposer:
    """Greedy proposals of ``model`` (prepared by ``load_draft_model``) over a pool of ``num_blocks`` blocks of
    ``block_size`` tokens (full precision, no prefix cache); catch-up chunks of at most ``max_num_batched_tokens``
    tokens a step; the forward compiled if ``compile``."""

    def __init__(self, model, num_blocks: int, block_size: int, max_num_batched_tokens: int,
                 compile: bool = False) -> None:
        self.model = model
        self.device = model.device
        self.max_num_batched_tokens = max_num_batched_tokens
        text_config = model.config.get_text_config(decoder=True)
        self.max_positions = getattr(text_config, "max_position_embeddings", None)  # None: any length
        self.kv = KVManager(text_config, block_size, "auto", num_blocks)
        allocate_all(self.kv, model.dtype, self.device)
        self.runner = ModelRunner(model, self.kv, compile=compile)  # the engine's forward over the draft's own pool
        self.states: dict[int, tuple[Sequence, DraftKV]] = {}  # by id(seq); the seq is held so the id stays its own

    def release(self, seq: Sequence) -> None:
        """Frees ``seq``'s draft K/V (it finished, or its target K/V was dropped)."""
        entry = self.states.pop(id(seq), None)
        if entry is not None:
            self.kv.discard(entry[1].kv)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[int, tuple[int, ...]]:
        """``wanted[i] = (seq, n)``: up to ``n >= 1`` drafts continuing ``seq.token_ids``; returns them by
        ``id(seq)`` (sequences whose tokens do not fit the pool, or whose catch-up does not fit the step's tokens,
        are left out)."""
        runs: list[tuple[Sequence, DraftKV, int, int]] = []  # (seq, state, first new position, drafts wanted)
        partial: list[tuple[Sequence, DraftKV, int, int]] = []  # (seq, state, start, tokens): catch-up only
        budget = self.max_num_batched_tokens
        for seq, n in sorted(wanted, key=lambda w: len(w[0].token_ids) - self._state(w[0]).num_valid):
            if self.max_positions is not None:  # drafts k use positions up to len + k - 2
                n = min(n, self.max_positions - len(seq.token_ids) + 1)
                if n < 1:
                    self.release(seq)
                    continue
            state = self._state(seq)
            start = self._roll_back(seq, state)
            self.kv.slide_windows(state.kv)  # no later query reads before ``start``: rollbacks never go below it
            need = len(seq.token_ids) - start
            if need > budget:  # computes what fits (if anything) now, proposes from a later step on
                if budget > 0 and self.kv.try_append(state.kv, budget):
                    partial.append((seq, state, start, budget))
                    budget = 0
                state.num_valid, state.drafts = start, ()
            elif self.kv.try_append(state.kv, need + n - 1):
                runs.append((seq, state, start, n))
                budget -= need
            else:  # no room: it holds its first ``start`` tokens, and proposes nothing this step
                state.num_valid, state.drafts = start, ()
        if not runs and not partial:
            return {}
        runs.sort(key=lambda r: len(r[0].token_ids) - r[2] > 1)  # one-token catch-ups first (the decode path)
        counts = [len(seq.token_ids) - start for seq, _, start, _ in runs] + [p[3] for p in partial]
        tokens = [t for (seq, _, start, _) in runs for t in seq.token_ids[start:]]
        tokens += [t for (seq, _, start, count) in partial for t in seq.token_ids[start : start + count]]
        kvs = [s.kv for _, s, _, _ in runs] + [p[1].kv for p in partial]
        firsts = self._forward(kvs, [r[2] for r in runs] + [p[2] for p in partial], counts, tokens)
        for _, state, start, count in partial:
            state.num_valid = start + count
        drafts = [[d] for d in firsts[: len(runs)]]
        for j in range(1, max((n for *_, n in runs), default=0)):
            active = [i for i, r in enumerate(runs) if r[3] > j]
            kvs = [runs[i][1].kv for i in active]
            starts = [len(runs[i][0].token_ids) + j - 1 for i in active]
            nexts = self._forward(kvs, starts, [1] * len(active), [drafts[i][-1] for i in active])
            for i, token in zip(active, nexts):
                drafts[i].append(token)
        for (seq, state, _, _), proposal in zip(runs, drafts):
            state.num_valid, state.drafts = len(seq.token_ids), tuple(proposal[:-1])
        return {id(seq): tuple(proposal) for (seq, *_), proposal in zip(runs, drafts)}

    def _state(self, seq: Sequence) -> DraftKV:
        entry = self.states.get(id(seq))
        if entry is None or entry[0] is not seq:
            entry = (seq, DraftKV(self.kv.new_sequence()))
            self.states[id(seq)] = entry
        return entry[1]

    def _roll_back(self, seq: Sequence, state: DraftKV) -> int:
        """Truncates ``state`` to the tokens of ``seq`` it holds (its valid tokens, then the drafts ``seq`` now
        repeats; never its last token, whose row gives draft 0); returns that length."""
        held = state.num_valid
        for draft in state.drafts:
            if held >= len(seq.token_ids) or seq.token_ids[held] != draft:
                break
            held += 1
        held = min(held, len(seq.token_ids) - 1)
        if state.kv.num_tokens > held:
            self.kv.truncate(state.kv, held)
        return held

    def _forward(self, kvs: list[SequenceKV], starts: list[int], counts: list[int], tokens: list[int]) -> list[int]:
        """One forward of the draft model (slots allocated); the argmax token after each sequence's last new one."""
        num_decodes = next((i for i, c in enumerate(counts) if c != 1), len(counts))  # the leading one-token runs
        metadata = build_metadata(self.kv, kvs, starts, counts, num_decodes, self.device)
        keep = metadata.query_start_loc[1:] - 1
        logits = self.runner.run(StepInput(long_tensor(tokens), metadata, keep))
        return logits.argmax(-1).tolist()

    def check_invariants(self) -> None:
        """The draft pool's audit (``KVManager.check_invariants``)."""
        self.kv.check_invariants()
