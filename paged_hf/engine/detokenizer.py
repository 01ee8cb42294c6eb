"""Incremental detokenization and stop-string search: work per step proportional to the new tokens.

Each step decodes only a short window: the tokens since the last emitted text (``read_offset``) plus the window
before them (from ``prefix_offset``), and emits what the new tokens add to that window's text. The window keeps
tokenizer context (a SentencePiece token's leading space): the first window reaches ``CONTEXT_TOKENS`` back into
the prompt, as vLLM's does, so the first output token keeps its space too. Text waits for the next token while it
ends in an incomplete character (U+FFFD) or in a byte-fallback token (``<0xE2>``): such a run of byte tokens decodes
all or nothing (one U+FFFD per byte when it is not valid UTF-8), so a window never starts or ends inside one.
Concatenated, the deltas equal what the output adds to the prompt's text: ``decode(prompt + output)`` less
``decode(prompt)`` (``skip_special_tokens=True``), which is ``decode(output)`` for a byte-level tokenizer, less the
U+FFFD of a character the output ends inside.

A stop string is searched in the new text plus the ``len(stop) - 1`` characters before it, so one split across
steps is found, and the search never rescans the whole output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_INCOMPLETE = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens the first window starts with (vLLM's initial offset)
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
        # the named special tokens and every added token marked special (SmolLM2's <repo_name> ...): decode skips both
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special_ids = sorted(set(getattr(tokenizer, "all_special_ids", ())) |
                             {i for i, token in added.items() if getattr(token, "special", False)})
        self.special_tokens = frozenset(special_ids) if skip else frozenset()
        self._anchor = self._anchor_token(vocab)
        # a special token's name in logprobs is its piece ("<|im_end|>"), whether or not the text skips it (vLLM)
        pieces = tokenizer.convert_ids_to_tokens(special_ids) if hasattr(tokenizer, "convert_ids_to_tokens") else []
        self._texts: dict[int, str] = {i: p for i, p in zip(special_ids, pieces) if isinstance(p, str)}

    def __call__(self, ids: Sequence[int]) -> str:
        return self._decode(ids)

    def token_text(self, token_id: int) -> str:
        """The text one token adds after ordinary text (cached per id): a SentencePiece token keeps its leading
        space, which decoding it alone drops (vLLM names logprob tokens in context the same way); a special token
        is named by its piece."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if self._anchor is not None:
                before, after = self._anchor
                full = self._decode([before, token_id])
                if full.startswith(after):
                    text = full[len(after):]
            self._texts[token_id] = text
        return text

    def _anchor_token(self, vocab: dict[str, int]) -> tuple[int, str] | None:
        """A plain letter token and its text, to decode single tokens after (None: no such token)."""
        for piece in ("a", "e", "t", "x"):
            token = vocab.get(piece)
            if token is not None and self._decode([token]) == piece:
                return token, piece
        return None


class IncrementalDetokenizer:
    """The text of one sequence's output tokens ``token_ids[origin:]``, extended as tokens arrive.

    ``token_ids`` is the sequence's own list (prompt + output), read in place: no per-step copy of the output.
    """

    __slots__ = ("decode", "origin", "text", "prefix_offset", "read_offset", "base", "base_text", "done")

    def __init__(self, decode: Decoder, origin: int, token_ids: Sequence[int] = ()) -> None:
        """``origin``: the index of the first output token (the prompt length) in ``token_ids``, the sequence's
        tokens so far (their last ``CONTEXT_TOKENS`` before ``origin`` give the first token its context)."""
        self.decode = decode
        self.origin = origin
        self.text = ""
        base = max(origin - CONTEXT_TOKENS, 0) if len(token_ids) >= origin else origin
        while 0 < base < origin and token_ids[base] in decode.byte_tokens:  # never start inside a byte run
            base -= 1
        base_text = decode(list(token_ids[base:origin])) if base < origin else ""
        if base < origin and token_ids[origin - 1] in decode.byte_tokens and base_text.endswith(_INCOMPLETE):
            base, base_text = origin, ""  # the prompt ends inside a character, which the output may finish
        self.base = base  # first context token: the text is what the output adds to decode(token_ids[base:origin])
        self.base_text = base_text
        self.prefix_offset = base  # first token of the context window
        self.read_offset = origin  # first token whose text is not emitted yet
        self.done = False  # the text is final (finished, or cut at a stop string)

    def update(self, token_ids: list[int]) -> str:
        """Emits the text the tokens after ``read_offset`` add (possibly "" while a character is incomplete)."""
        if len(token_ids) <= self.read_offset or self._ends_in_byte_token(token_ids):
            return ""
        context, full = self._window(token_ids)
        if len(full) <= len(context) or full.endswith(_INCOMPLETE):
            return ""
        delta = full[len(context) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta

    def pending(self, token_ids: list[int]) -> str:
        """The text the tokens after ``read_offset`` would add if the output ended with them: what ``update`` holds
        back while they end in a byte-fallback token (a newline's ``<0x0A>``) or an incomplete character, less the
        incomplete character. Nothing is emitted; a stop string found in it ends the output here, which makes it
        final (``accept``)."""
        if len(token_ids) <= self.read_offset:
            return ""
        context, full = self._window(token_ids)
        return full[len(context) :].rstrip(_INCOMPLETE) if full.startswith(context) else ""

    def accept(self, pending: str, token_ids: list[int]) -> None:
        """Emits ``pending`` (``pending(token_ids)``) as the text of the output, which ends here."""
        self.text += pending
        self.prefix_offset = self.read_offset = len(token_ids)

    def _window(self, token_ids: list[int]) -> tuple[str, str]:
        """The text of the window's context (``prefix_offset .. read_offset``) and of the whole window."""
        context = self.decode(token_ids[self.prefix_offset : self.read_offset]) \
            if self.read_offset > self.prefix_offset else ""
        return context, self.decode(token_ids[self.prefix_offset :])

    def _ends_in_byte_token(self, token_ids: list[int]) -> bool:
        """Whether the last token that has text is a byte-fallback token (a skipped special token between byte
        tokens does not end their run: decoding drops it and joins the bytes)."""
        skipped = self.decode.special_tokens
        for index in range(len(token_ids) - 1, self.read_offset - 1, -1):
            if token_ids[index] not in skipped:
                return token_ids[index] in self.decode.byte_tokens
        return False

    def finish(self, token_ids: list[int]) -> str:
        """Completes the text with one decode of the whole output (what is still held back for an incomplete
        character, or all of it when the text was never needed per step); returns what it added. A character the
        output ends inside (its last bytes never came: U+FFFD at the very end) is left out, as vLLM does. Once
        only: the text is final after it (and after ``truncate``)."""
        if self.done:
            return ""
        self.done = True
        full = self.decode(token_ids[self.base :])
        if not full.startswith(self.base_text + self.text):  # a tokenizer whose window text is not a prefix
            return ""
        delta = full[len(self.base_text) + len(self.text) :].rstrip(_INCOMPLETE)  # a character cut off by the end
        self.text += delta
        self.prefix_offset = self.read_offset = len(token_ids)
        return delta

    def truncate(self, length: int) -> None:
        """Cuts the text at ``length`` characters (a stop string) for good."""
        self.text = self.text[:length]
        self.done = True


def find_stop(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The stop string that ``text``'s last ``num_new_chars`` characters complete first, and where it starts: of the
    stops that end in the new text, the one that ends earliest (the first listed on a tie, as vLLM picks). Each stop
    is searched from ``len(stop) - 1`` characters before the new text, so a stop that lies wholly in older text (one
    that ``min_tokens`` held back) is never found again."""
    found, found_end = None, len(text) + 1
    for stop in stops:
        at = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if at >= 0 and at + len(stop) < found_end:
            found, found_end = (stop, at), at + len(stop)
    return found
