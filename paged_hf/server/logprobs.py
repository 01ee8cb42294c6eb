"""The engine's logprobs (``{token id: Logprob}`` per token) in OpenAI's two response shapes, and vLLM's.

Completions (OpenAI's legacy shape): tokens are named by the text they add in context (the prompt's last tokens for
the first one), so that the tokens of a
choice concatenate to its text (a SentencePiece token's leading space included, which decoding it alone would
drop); the sampled token's text comes from an incremental detokenizer over the choice's tokens (a token that ends
inside a multi-byte character gets "", the token completing it the character). With ``echo`` the prompt's tokens
come first, the first of them with ``null`` logprobs (nothing predicts it). An alternative that decoding skips (a
special token) is named by its piece, as in vLLM. ``top_logprobs`` is keyed by text, so two tokens of one name keep
one value: the token itself is listed first, and a same-named alternative overwrites it (vLLM's order).

Chat: each entry carries the token's own bytes (``TokenBytes``): a byte-fallback token (``<0xE2>``) or a byte-level
BPE token holds raw bytes; when they are not valid UTF-8 alone (part of a character), ``token`` is OpenAI's
``"bytes:\\xe2\\x80"`` form. A special token (the end-of-turn token that ended the output) gets an entry named by
its piece, as in vLLM: the entries are one per completion token, though the content leaves that token's text out.

An alternative's text is what it would have added after the same previous tokens. One ``ChoiceLogprobs`` per
choice keeps that state across the chunks of a stream.
"""

from __future__ import annotations

import json
import re

from ..engine.detokenizer import IncrementalDetokenizer

CONTEXT_TOKENS = 4  # previous tokens an alternative is decoded after
LOWEST_LOGPROB = -9999.0  # what JSON carries for -inf (a token a constraint masked): vLLM's floor


def json_logprob(value: float) -> float:
    """``value`` as JSON can carry it: -inf (and anything below) is ``LOWEST_LOGPROB``, as vLLM sends it."""
    return max(value, LOWEST_LOGPROB)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenBytes:
    """The raw bytes a token stands for, where the tokenizer says them exactly (byte-fallback pieces, byte-level
    BPE); None for other tokens (their bytes are their text's)."""

    def __init__(self, tokenizer) -> None:
        self.pieces = {i: piece for piece, i in tokenizer.get_vocab().items()}
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self.byte_level = _is_byte_level(tokenizer)
        self.alphabet = _byte_level_alphabet() if self.byte_level else {}

    def raw(self, token_id: int) -> bytes | None:
        piece = self.pieces.get(token_id)
        if piece is None or token_id in self.special_ids:
            return None
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self.byte_level and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        return None


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    return '"ByteLevel"' in json.dumps(decoder)


def openai_token(raw: bytes) -> str:
    """The token string OpenAI gives for ``raw``: its text, or ``bytes:\\x..`` when it is not valid UTF-8 alone."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class ChoiceLogprobs:
    """Names and formats the logprobs of one choice, chunk after chunk."""

    def __init__(self, decode, token_bytes: TokenBytes | None = None, prompt_token_ids=()) -> None:
        """``prompt_token_ids``: the prompt the choice continues (when its tokens are not fed here first, as an
        echo does); its last tokens name the first token in context, as the engine's text has it."""
        self.decode = decode
        self.token_bytes = token_bytes
        self.token_ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.detokenizer = IncrementalDetokenizer(decode, len(self.token_ids), self.token_ids)
        self.special_ids = getattr(decode, "special_tokens", frozenset())  # the tokens decode skips
        self.offset = 0  # characters of text before the next token

    def _in_context(self, window: list[int], token: int, context: str) -> str:
        full = self.decode(window + [token])
        return full[len(context):] if full.startswith(context) else self.decode([token])

    def _named(self, token_ids: list[int], entries: list):
        """(token id, its text, the entry, {alternative id: its text}) per new token (entry None: no names)."""
        out = []
        for token, entry in zip(token_ids, entries):
            window = self.token_ids[-CONTEXT_TOKENS:]
            self.token_ids.append(token)
            text = self.detokenizer.update(self.token_ids)
            context = self.decode(window) if window else ""
            names = {}
            for alternative in entry or ():
                if alternative == token:
                    names[alternative] = text
                elif alternative in self.special_ids:  # named by its piece, as vLLM: decode skips it ("")
                    names[alternative] = self.decode.token_text(alternative)
                else:
                    names[alternative] = self._in_context(window, alternative, context)
            out.append((token, text, entry, names, window, context))
        return out

    def completion(self, token_ids: list[int], entries: list, top: int | None = None) -> dict:
        """``/v1/completions``: {"tokens", "token_logprobs", "top_logprobs", "text_offset"} for the new tokens
        (``top_logprobs``: the top ``top`` (all the entry has when None) and the token itself, text -> logprob; an
        entry None, the first prompt token's, gives ``null``s)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, text, entry, names, _, _ in self._named(token_ids, entries):
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(json_logprob(entry[token].logprob))
            # the token first: an alternative whose text is the same (two tokens, one name) overwrites it, as in
            # vLLM, so the best value listed is the token's only where no listed token beats it (lm-eval's is_greedy)
            ordered = sorted(entry.items(), key=lambda item: item[0] != token)
            out["top_logprobs"].append({names[t]: json_logprob(lp.logprob) for t, lp in ordered
                                        if top is None or lp.rank <= top or t == token})
        return out

    def chat(self, token_ids: list[int], entries: list[dict], top: int) -> dict:
        """``/v1/chat/completions``: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} for the new
        content tokens (``top_logprobs``: the ``top`` most likely, in rank order)."""
        content = []
        for token, _, entry, _, window, context in self._named(token_ids, entries):
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= top)
            name, raw = self._own(window, token, context)
            alternatives = []
            for _, t in ranked:
                alt_name, alt_raw = (name, raw) if t == token else self._own(window, t, context)
                alternatives.append({"token": alt_name, "logprob": json_logprob(entry[t].logprob),
                                     "bytes": list(alt_raw)})
            content.append({"token": name, "logprob": json_logprob(entry[token].logprob), "bytes": list(raw),
                            "top_logprobs": alternatives})
        return {"content": content}

    def _own(self, window: list[int], token: int, context: str) -> tuple[str, bytes]:
        """A token's OpenAI name and its own bytes, after ``window`` (whose text is ``context``)."""
        raw = self.token_bytes.raw(token) if self.token_bytes is not None else None
        if self.token_bytes is not None and token in self.token_bytes.special_ids:  # named by its piece
            piece = self.token_bytes.pieces.get(token, "")
            return piece, piece.encode("utf-8")
        if raw is not None:
            return openai_token(raw), raw
        text = self._in_context(window, token, context)
        return text, text.encode("utf-8")


def vllm_prompt_logprobs(prompt_ids: list[int], entries: list, top: int, decode) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {"<token id>": {"logprob", "rank",
    "decoded_token"}} for the ``top`` most likely and the prompt's own token."""
    out = []
    for token, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                             "decoded_token": lp.decoded_token if lp.decoded_token is not None else decode([t])}
                    for t, lp in entry.items() if lp.rank <= top or t == token})
    return out
