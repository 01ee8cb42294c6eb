"""Batched sampling from one engine step's logits: tensor ops over the whole batch, per-row parameters as tensors.

Rows are processed in float32: user logits processors (per row, the only Python loop, for rows that have them),
logit biases (one scatter-add over the rows that have them), penalties (rows that use them), then greedy rows take
the argmax and the other rows are tempered and filtered (min-p, top-k, top-p as row-wise thresholds, vLLM's order)
and sampled. A request with a ``seed`` samples with its own ``torch.Generator``, so its tokens do not depend on the
rest of the batch; the others share one draw.

Logprobs are those of the model's raw distribution (``log_softmax`` of the logits, before any processing), as a
plain forward over prompt + output gives them: the sampled token's, its rank, and the top ``k``. Rows constrained by
a grammar (structured outputs) are masked first, before everything else, so their logprobs are those of the masked
distribution, as vLLM's (which masks the logits before its sampler).
A failing logits processor fails its row only.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..kernels import cpu_ext
from ..structured.bitmask import mask_logits
from .request import Logprob, PositionLogprobs, Sequence


@dataclass
class SamplerOutput:
    """Per row: the sampled token id, its logprobs entry (None when not asked) and the error that failed it;
    ``token_tensor``: ``token_ids`` as an int64 host tensor, where the sampler made one (greedy rows on a CPU)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]
    errors: dict[int, BaseException]
    token_tensor: torch.Tensor | None = None


class SamplingSummary(NamedTuple):
    """What a batch of rows needs of the sampler, from one pass over them (``summarize``): ``plain_greedy``: every
    row is plain greedy without ``min_tokens`` (one argmax does it all); ``grammar``: some row has a grammar. Both
    are fixed for a sequence's life, so the runner's persistent decode batch keeps its summary across steps."""

    plain_greedy: bool
    grammar: bool


def summarize(seqs: list[Sequence]) -> SamplingSummary:
    return SamplingSummary(all(seq.request.params.plain_greedy and not seq.request.params.min_tokens for seq in seqs),
                           any(seq.grammar is not None for seq in seqs))


def sample(logits: torch.Tensor, seqs: list[Sequence], decode_token=None,
           eos_token_ids: Collection[int] = (), summary: SamplingSummary | None = None) -> SamplerOutput:
    """Samples one token per row of ``logits`` ``[R, vocab]`` for ``seqs[r]`` (its request's ``SamplingParams``).

    ``decode_token(id) -> str`` names the tokens of logprob entries (None: no text). ``eos_token_ids``: the model's
    end tokens, which a row still short of its ``min_tokens`` may not draw (nor its ``stop_token_ids``), as vLLM's
    and transformers' ``min_new_tokens``: they get -inf after the other processing, greedy rows included.
    ``summary``: ``summarize(seqs)``, when the caller kept it.
    """
    summary = summary or summarize(seqs)
    if summary.grammar:
        logits = mask_logits(logits, [seq.grammar for seq in seqs])
    if summary.plain_greedy:  # the common fast path: one argmax over the batch
        token_ids, errors, tensor = _greedy_draw(logits)
        return SamplerOutput(token_ids, [None] * len(seqs), errors, tensor)
    params = [seq.request.params for seq in seqs]
    held_back = _held_back_stops(seqs, params, eos_token_ids, logits.shape[-1])
    if held_back and summary.grammar:
        held_back = _yield_to_grammars(logits, seqs, held_back)
    if not held_back and all(p.plain_greedy for p in params):  # min_tokens, all reached
        token_ids, errors = greedy_draw(logits)
        return SamplerOutput(token_ids, [None] * len(seqs), errors)
    raw = logits
    logits = logits.float()
    errors: dict[int, BaseException] = {}
    if any(p.logits_processors for p in params):
        logits = logits.clone()
        for row, (seq, p) in enumerate(zip(seqs, params)):
            try:
                for processor in p.logits_processors:
                    logits[row] = processor(list(seq.output_token_ids), logits[row])
            except Exception as error:  # noqa: BLE001 - a user's logits processor may raise anything
                errors[row] = error
    biased = [r for r, p in enumerate(params) if p.logit_bias]
    if biased:
        logits = _apply_logit_bias(logits if logits is not raw else logits.clone(), biased, params)
    restricted = [r for r, p in enumerate(params) if p.allowed_token_ids is not None]
    if restricted:
        logits = _allow_only(logits if logits is not raw else logits.clone(), restricted, params)
    penalized = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0 or p.presence_penalty
                 or p.frequency_penalty]
    if penalized:
        logits = _apply_penalties(logits, penalized, seqs, params)
    banned = held_back + _bad_word_ends(seqs)  # -inf after the penalties, which keep -inf as it is
    if banned:
        logits = logits if logits is not raw else logits.clone()
        rows, token_ids = zip(*banned)
        logits.index_put_((torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device)),
                          torch.tensor(float("-inf"), device=logits.device))

    greedy = [p.greedy for p in params]
    tokens = greedy_tokens(logits)
    for row, error in _undrawable(logits, tokens).items():
        if greedy[row]:
            errors.setdefault(row, error)
    sampled_rows = [r for r, g in enumerate(greedy) if not g]
    if sampled_rows:
        index = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
        probs = torch.softmax(_filter(logits.index_select(0, index), [params[r] for r in sampled_rows]), dim=-1)
        invalid = ~torch.isfinite(probs).all(-1)  # NaN logits (a model or a logits processor gave them)
        if bool(invalid.any()):
            for i in invalid.nonzero().view(-1).tolist():
                errors.setdefault(sampled_rows[i], ValueError(
                    "the sampling distribution holds NaN or inf (the logits, after logits processors, logit_bias and "
                    "penalties, were not finite): no token can be drawn"))
            probs = torch.where(invalid.unsqueeze(1), torch.ones_like(probs), probs)  # drawn, then discarded
        drawn = _draw(probs, [seqs[r].generator for r in sampled_rows])
        tokens = tokens.index_copy(0, index, drawn)
    token_ids = tokens.tolist()

    logprobs: list[PositionLogprobs | None] = [None] * len(seqs)
    asked = [r for r, p in enumerate(params) if p.logprobs is not None and r not in errors]
    if asked:
        index = torch.tensor(asked, dtype=torch.long, device=logits.device)
        entries = position_logprobs(raw.index_select(0, index), tokens.index_select(0, index),
                                    [params[r].logprobs for r in asked], decode_token,
                                    [params[r].detokenize for r in asked])
        for r, entry in zip(asked, entries):
            logprobs[r] = entry
    return SamplerOutput(token_ids, logprobs, errors)


def _undrawable(logits: torch.Tensor, tokens: torch.Tensor) -> dict[int, BaseException]:
    """The rows whose argmax ``tokens`` is no token: its logit is NaN (a NaN anywhere in the row wins the argmax),
    +inf, or -inf (every token was ruled out). One gather over the batch; the errors that fail those rows."""
    chosen = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    bad = ~torch.isfinite(chosen)
    if not bool(bad.any()):
        return {}
    return {row: _not_drawable() for row in bad.nonzero().view(-1).tolist()}


def _not_drawable() -> ValueError:
    return ValueError("the logits are not finite (NaN or inf, after logits processors, logit_bias and penalties) or "
                      "rule out every token: no token can be drawn")


def greedy_draw(logits: torch.Tensor) -> tuple[list[int], dict[int, BaseException]]:
    """``greedy_tokens(logits).tolist()`` and ``_undrawable``'s errors. On a CPU the C++ kernel marks the rows whose
    maximum is not finite in the tokens themselves (``-1 - argmax``): one op a step, whose result a Python pass reads
    (four tensor ops after a forward cost 0.07 ms at 256 rows, cold)."""
    token_ids, errors, _ = _greedy_draw(logits)
    return token_ids, errors


def _greedy_draw(logits: torch.Tensor) -> tuple[list[int], dict[int, BaseException], torch.Tensor | None]:
    """``greedy_draw``, and the kernel's tokens as a tensor when it ran and every row drew (else None)."""
    kernel = _greedy_kernel_for(logits)
    if kernel is None:
        tokens = greedy_tokens(logits)
        return tokens.tolist(), _undrawable(logits, tokens), None
    tokens = kernel(logits, True)
    token_ids = tokens.tolist()
    if not token_ids or min(token_ids) >= 0:
        return token_ids, {}, tokens
    errors: dict[int, BaseException] = {row: _not_drawable() for row, token in enumerate(token_ids) if token < 0}
    return [token if token >= 0 else -1 - token for token in token_ids], errors, None


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``argmax(logits, dim=-1)`` (``[R, vocab]`` -> ``[R]``: the first index of each row's maximum; a NaN counts
    as the maximum). On a CPU, float32 and bfloat16 rows go through the C++ kernel (``cpu_ext.greedy_kernel``: one
    pass a row, 2.5-4x faster than ``max(dim=-1)``), other dtypes or no kernels through ``max(dim=-1)``, itself
    2.5-4x faster than ``argmax`` (its generic reduction: 28 ms for 256 rows of a 49k vocabulary in float32)."""
    kernel = _greedy_kernel_for(logits)
    if kernel is not None:
        return kernel(logits)
    if logits.device.type == "cpu":
        return torch.max(logits, dim=-1).indices
    return torch.argmax(logits, dim=-1)


def _greedy_kernel_for(logits: torch.Tensor):
    """``cpu_ext.greedy_kernel()`` where it serves ``logits`` (``[R, vocab]`` float32 or bfloat16 on a CPU), else
    None."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_ext.greedy_kernel()


def position_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top_k: list[int],
                      decode_token=None, named: list[bool] | None = None) -> list[PositionLogprobs]:
    """For each row of raw ``logits`` ``[R, vocab]``: the chosen token's and the ``top_k[r]`` best tokens'
    ``Logprob`` (raw ``log_softmax``, computed in float32; rank 1 = the most likely token), named by
    ``decode_token`` where ``named[r]`` (default: every row; a ``detokenize=False`` request's are not)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = chosen.view(-1, 1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(1) + 1
    k = max(top_k)
    top = torch.topk(logprobs, k, dim=-1) if k else None
    chosen_l, chosen_lp_l, ranks_l = chosen.view(-1).tolist(), chosen_lp.view(-1).tolist(), ranks.tolist()
    top_ids = top.indices.tolist() if top is not None else None
    top_lps = top.values.tolist() if top is not None else None
    out = []
    for r, want in enumerate(top_k):
        name = decode_token if named is None or named[r] else None
        entry: PositionLogprobs = {}
        for rank, (tid, lp) in enumerate(zip(top_ids[r][:want], top_lps[r][:want]) if want else (), start=1):
            entry[tid] = Logprob(lp, rank, name(tid) if name else None)
        token = chosen_l[r]
        if token not in entry:
            entry[token] = Logprob(chosen_lp_l[r], ranks_l[r], name(token) if name else None)
        out.append(entry)
    return out


def _held_back_stops(seqs: list[Sequence], params, eos_token_ids: Collection[int],
                     vocab: int) -> list[tuple[int, int]]:
    """``(row, token id)`` pairs a row may not draw yet: its stop token ids and the end tokens (unless it ignores
    EOS) while it has fewer than ``min_tokens`` output tokens."""
    pairs = []
    for row, (seq, p) in enumerate(zip(seqs, params)):
        if p.min_tokens and seq.num_output_tokens < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            pairs.extend((row, token) for token in sorted(stops) if 0 <= token < vocab)
    return pairs


def _yield_to_grammars(masked: torch.Tensor, seqs: list[Sequence], held_back: list[tuple[int, int]]
                       ) -> list[tuple[int, int]]:
    """``held_back`` without the pairs of a row whose grammar allows nothing else now (its value is complete: only
    an end token may follow): the constraint wins over ``min_tokens``, as in vLLM. ``masked``: the grammar-masked
    logits."""
    by_row: dict[int, set[int]] = {}
    for row, token in held_back:
        if seqs[row].grammar is not None:
            by_row.setdefault(row, set()).add(token)
    complete = {row for row, tokens in by_row.items()
                if set(torch.isfinite(masked[row]).nonzero().view(-1).tolist()) <= tokens}
    return [(row, token) for row, token in held_back if row not in complete]


def _bad_word_ends(seqs) -> list[tuple[int, int]]:
    """``(row, token)`` pairs a row may not draw: the last token of each of its request's bad-word sequences
    whose other tokens its output ends with (a one-token word: always), as vLLM's ``bad_words``."""
    pairs = []
    for row, seq in enumerate(seqs):
        sequences = seq.request.bad_words_token_ids
        if not sequences:
            continue
        output = seq.output_token_ids
        for ids in sequences:
            before = len(ids) - 1
            if before == 0 or (len(output) >= before and tuple(output[-before:]) == ids[:-1]):
                pairs.append((row, ids[-1]))
    return pairs


def _allow_only(logits: torch.Tensor, rows: list[int], params) -> torch.Tensor:
    """Sets each of ``rows``' logits outside its ``allowed_token_ids`` to -inf, in place."""
    keep = torch.zeros((len(rows), logits.shape[-1]), dtype=torch.bool, device=logits.device)
    for i, r in enumerate(rows):
        keep[i, list(params[r].allowed_token_ids)] = True
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits.index_select(0, index).masked_fill(~keep, float("-inf"))
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: list[int], params) -> torch.Tensor:
    """Adds each row's ``logit_bias`` {token id: bias} to its logits, in place (one scatter-add for all rows)."""
    row_ids, token_ids, biases = [], [], []
    for r in rows:
        bias = params[r].logit_bias
        row_ids.extend([r] * len(bias))
        token_ids.extend(bias)
        biases.extend(bias.values())
    device = logits.device
    index = (torch.tensor(row_ids, dtype=torch.long, device=device), torch.tensor(token_ids, dtype=torch.long,
                                                                                device=device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)
    return logits


def _apply_penalties(logits: torch.Tensor, rows: list[int], seqs: list[Sequence], params) -> torch.Tensor:
    """vLLM's penalties on ``rows`` at once: repetition over prompt + output, presence and frequency over the
    output. Token counts come from one scatter over the rows' padded token ids (``vocab`` pads them)."""
    device, vocab = logits.device, logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.long, device=device)

    def counts_of(token_lists: list[list[int]]) -> torch.Tensor:  # [R, vocab] occurrences
        width = max(1, max(len(t) for t in token_lists))
        ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for i, tokens in enumerate(token_lists):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        counts = torch.zeros((len(token_lists), vocab + 1), dtype=logits.dtype, device=device)
        counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, dtype=logits.dtype, device=device))
        return counts[:, :vocab]

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[r], name) for r in rows], dtype=logits.dtype, device=device).view(-1, 1)

    block = logits.index_select(0, index)
    seen = counts_of([seqs[r].token_ids for r in rows]) > 0
    repetition = per_row("repetition_penalty")
    penalized = torch.where(block > 0, block / repetition, block * repetition)
    block = torch.where(seen, penalized, block)
    output = counts_of([seqs[r].output_token_ids for r in rows])
    block = block - per_row("frequency_penalty") * output - per_row("presence_penalty") * (output > 0).to(block.dtype)
    return logits.index_copy(0, index, block)


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p as row-wise thresholds (removed tokens get -inf), in vLLM's order:
    min-p is measured on the tempered distribution, and top-p on what min-p and top-k left (renormalized), so a
    token min-p removed never counts toward top-p's mass."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature.unsqueeze(1)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_p, dtype=probs.dtype, device=device).view(-1, 1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        if any(k < vocab for k in top_k):  # keep logits >= the k-th largest (ties at the k-th stay)
            kth = sorted_logits.gather(1, torch.tensor(top_k, device=device).view(-1, 1) - 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):  # drop tokens once the more likely ones already hold top_p
            probs = torch.softmax(sorted_logits, dim=-1)
            threshold = torch.tensor(top_p, dtype=probs.dtype, device=device).view(-1, 1)
            drop_sorted = probs.cumsum(-1) - probs > threshold
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs``: rows with a generator draw from it alone, the others in one batched draw."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    shared = [r for r, g in enumerate(generators) if g is None]
    if shared:
        index = torch.tensor(shared, dtype=torch.long, device=probs.device)
        out[index] = torch.multinomial(probs.index_select(0, index), 1).view(-1)
    for r, generator in enumerate(generators):
        if generator is not None:  # on the generator's device, so the draw is the same on any model device
            out[r] = torch.multinomial(probs[r].to(generator.device), 1, generator=generator)[0]
    return out
