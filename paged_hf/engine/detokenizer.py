"""Incremental detokenization and stop-string search: work per step proportional to the new tokens.

Each step decodes only a short window: the tokens since the last emitted text (``read_offset``) plus the window
before them (from ``prefix_offset``), and emits what the new tokens add to that window's text. The window keeps
tokenizer context (a SentencePiece token's leading space). Text waits for the next token while it ends in an
incomplete character (U+FFFD) or in a byte-fallback token (``<0xE2>``): such a run of byte tokens decodes all or
nothing (one U+FFFD per byte when it is not valid UTF-8), so a window never starts or ends inside one.
Concatenated, the deltas equal ``tokenizer.decode(output_ids, skip_special_tokens=True)``.

Stop strings are searched in the new text plus the last ``len(longest stop) - 1`` characters before it, so a stop
string split across steps is found and the search never rescans the whole output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Decoder:
    """``decoder(ids) -> text`` with special tokens skipped, and the ids of the tokenizer's byte-fallback tokens.

    Uses the tokenizer's Rust backend when it has one and decoding needs no Python post-processing (an order of
    magnitude faster per call), else its ``decode``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        skip = skip_special_tokens
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False) and \
                spaces_between_special_tokens:
            self._decode = lambda ids: backend.decode(list(ids), skip_special_tokens=skip)
        elif spaces_between_special_tokens:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip,
                                                        spaces_between_special_tokens=False)
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.byte_tokens = frozenset(i for piece, i in vocab.items() if _BYTE_TOKEN.fullmatch(piece))

    def __call__(self, ids: Sequence[int]) -> str:
        return self._decode(ids)


def decoder_for(tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> Decoder:
    return Decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)


class IncrementalDetokenizer:
    """The text of one sequence's output tokens ``token_ids[origin:]``, extended as tokens arrive.

    ``token_ids`` is the sequence's own list (prompt + output), read in place: no per-step copy of the output.
    """

    __slots__ = ("decode", "origin", "text", "prefix_offset", "read_offset")

    def __init__(self, decode: Decoder, origin: int) -> None:
        self.decode = decode
        self.origin = origin  # index of the first output token (the prompt length)
        self.text = ""
        self.prefix_offset = origin  # first token of the context window
        self.read_offset = origin  # first token whose text is not emitted yet

    def update(self, token_ids: list[int]) -> str:
        """Emits the text the tokens after ``read_offset`` add (possibly "" while a character is incomplete)."""
        if len(token_ids) <= self.read_offset or token_ids[-1] in self.decode.byte_tokens:
            return ""
        context = self.decode(token_ids[self.prefix_offset : self.read_offset]) \
            if self.read_offset > self.prefix_offset else ""
        full = self.decode(token_ids[self.prefix_offset :])
        if len(full) <= len(context) or full.endswith(_INCOMPLETE):
            return ""
        delta = full[len(context) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta

    def finish(self, token_ids: list[int]) -> str:
        """Completes the text with one decode of the whole output (what is still held back for an incomplete
        character, or all of it when the text was never needed per step); returns what it added."""
        full = self.decode(token_ids[self.origin :])
        if not full.startswith(self.text):  # a tokenizer whose window text is not a prefix of the whole
            return ""
        delta = full[len(self.text) :]
        self.text = full
        self.prefix_offset = self.read_offset = len(token_ids)
        return delta

    def truncate(self, length: int) -> None:
        """Cuts the text at ``length`` characters (a stop string) for good."""
        self.text = self.text[:length]


def find_stop(text: str, num_new_chars: int, stops: tuple[str, ...], longest: int) -> tuple[str, int] | None:
    """The first stop string that ends in the last ``num_new_chars`` characters of ``text``, and where it starts;
    the search starts ``longest - 1`` characters before the new text."""
    start = max(0, len(text) - num_new_chars - (longest - 1))
    found = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (found is None or at < found[1]):
            found = (stop, at)
    return found
