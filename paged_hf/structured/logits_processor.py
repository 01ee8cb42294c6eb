"""Structured outputs for ``model.generate()``: transformers ``LogitsProcessor``s, batched, with any cache.

    processor = JSONSchemaLogitsProcessor(schema, tokenizer)
    out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=128)

Each row of the batch keeps its own matcher, synchronized at every call with the row's generated tokens (those
after the prompt): new tokens advance it, and a row whose history changed (beam search reorders its rows, assisted
decoding crops them) is replayed from the start. A row whose grammar has ended (it drew an end token, then
``generate`` pads it) is left unmasked. Where the processors before this one left a row none of the tokens its
grammar allows (``min_new_tokens`` holding back the end token of a complete value), those tokens get score 0: the
constraint wins, as in vLLM's engine. The processor records its ``generate`` call's prompt on its first call; a call
with another prompt (another batch, or the same processor passed to a second ``generate``) starts it afresh. A
second call whose prompt extends the first one's output needs a new processor.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from .bitmask import mask_logits
from .compiler import GrammarCompilerCache
from .grammar import build_grammar
from .matcher import GrammarRejected, SequenceGrammar
from .params import StructuredOutputsParams


class _Row:
    """One batch row's matcher and the tokens it has accepted."""

    __slots__ = ("compiled", "grammar", "tokens", "ended")

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.grammar = SequenceGrammar(compiled)
        self.tokens: list[int] = []
        self.ended = False

    def sync(self, generated: list[int]) -> SequenceGrammar | None:
        """Brings the matcher to the end of ``generated``; the grammar to mask with, or None (ended or broken)."""
        if generated[: len(self.tokens)] != self.tokens:  # another history: replay it
            self.grammar, self.tokens, self.ended = SequenceGrammar(self.compiled), [], False
        for token in generated[len(self.tokens):]:
            if self.ended:
                break
            try:
                self.grammar.accept(token)
            except GrammarRejected:  # a pad after the end, or a token forced past the mask
                self.ended = True
                break
            self.tokens.append(token)
            self.ended = self.grammar.terminated
        return None if self.ended else self.grammar


class StructuredLogitsProcessor(LogitsProcessor):
    """Masks each row's scores to the tokens ``spec`` allows next (a ``StructuredOutputsParams``).

    ``tokenizer``: the model's (a transformers tokenizer); ``eos_token_id``: the token(s) that end an output (default
    the tokenizer's), allowed only where the grammar can end. A spec the backend cannot compile raises
    ``GrammarError`` here. The vocabulary is the scores' width, read on the first call.
    """

    def __init__(self, spec: StructuredOutputsParams, tokenizer, eos_token_id: int | list[int] | None = None) -> None:
        if not isinstance(spec, StructuredOutputsParams):
            raise ValueError(f"spec must be a paged_hf.StructuredOutputsParams, got {type(spec).__name__}")
        build_grammar(spec)  # a spec the backend refuses fails here, not in the middle of generate
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.spec = spec
        self.tokenizer = tokenizer
        self.eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self._compiled = None
        self._prompt: torch.Tensor | None = None  # [B, prompt length]: the ids of this generate call's prompt
        self._rows: list[_Row] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``[B, L]`` (prompt + generated), ``scores`` ``[B, vocab]``: the masked scores."""
        if self._compiled is None:
            cache = GrammarCompilerCache(self.tokenizer, scores.shape[-1], self.eos_token_ids)
            self._compiled = cache.compile(self.spec)
        if not self._same_call(input_ids):
            self._prompt, self._rows = input_ids.clone(), []
        while len(self._rows) < input_ids.shape[0]:
            self._rows.append(_Row(self._compiled))
        generated = input_ids[:, self._prompt.shape[1]:].tolist()
        grammars = [row.sync(tokens) for row, tokens in zip(self._rows, generated)]
        masked = mask_logits(scores, grammars)
        emptied = [r for r, grammar in enumerate(grammars)
                   if grammar is not None and not bool(torch.isfinite(masked[r]).any())]
        if emptied:  # the processors before this one removed every allowed token: the grammar's own mask wins
            allowed = mask_logits(torch.zeros_like(scores[emptied]), [grammars[r] for r in emptied])
            masked[emptied] = allowed
        return masked.to(scores.dtype)

    def _same_call(self, input_ids: torch.Tensor) -> bool:
        """Whether ``input_ids`` continue the prompt this processor started on (else a new ``generate`` call)."""
        prompt = self._prompt
        return prompt is not None and input_ids.shape[0] == prompt.shape[0] and \
            input_ids.shape[1] >= prompt.shape[1] and torch.equal(input_ids[:, :prompt.shape[1]], prompt)


class JSONSchemaLogitsProcessor(StructuredLogitsProcessor):
    """``generate()``'s output is JSON that validates against ``schema`` (a dict or its JSON text)."""

    def __init__(self, schema: dict | str, tokenizer, eos_token_id: int | list[int] | None = None,
                 disable_any_whitespace: bool = False) -> None:
        super().__init__(StructuredOutputsParams(json=schema, disable_any_whitespace=disable_any_whitespace),
                         tokenizer, eos_token_id)
