"""Structured outputs for ``model.generate()``: transformers ``LogitsProcessor``s, batched, with any cache.

    processor = JSONSchemaLogitsProcessor(schema, tokenizer)
    out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=128)

Each row of the batch keeps its own matcher, synchronized at every call with the row's generated tokens (those
after the prompt): new tokens advance it, and a row whose history changed (beam search reorders its rows, assisted
decoding crops them) is replayed from the start. A row whose grammar has ended (it drew an end token, then
``generate`` pads it) is left unmasked. One processor serves one ``generate`` call (it records the prompt length on
its first call).
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
        self._prompt_len: int | None = None
        self._rows: list[_Row] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``[B, L]`` (prompt + generated), ``scores`` ``[B, vocab]``: the masked scores."""
        if self._compiled is None:
            cache = GrammarCompilerCache(self.tokenizer, scores.shape[-1], self.eos_token_ids)
            self._compiled = cache.compile(self.spec)
            self._prompt_len = input_ids.shape[1]
        while len(self._rows) < input_ids.shape[0]:
            self._rows.append(_Row(self._compiled))
        generated = input_ids[:, self._prompt_len:].tolist()
        grammars = [row.sync(tokens) for row, tokens in zip(self._rows, generated)]
        return mask_logits(scores, grammars).to(scores.dtype)


class JSONSchemaLogitsProcessor(StructuredLogitsProcessor):
    """``generate()``'s output is JSON that validates against ``schema`` (a dict or its JSON text)."""

    def __init__(self, schema: dict | str, tokenizer, eos_token_id: int | list[int] | None = None,
                 disable_any_whitespace: bool = False) -> None:
        super().__init__(StructuredOutputsParams(json=schema, disable_any_whitespace=disable_any_whitespace),
                         tokenizer, eos_token_id)
