"""The engine's logprobs (``{token id: Logprob}`` per generated token) in OpenAI's two response shapes.

Tokens are named by the text they add in context (the prompt's last tokens for the first one), so that the tokens
of a choice concatenate to its text (a SentencePiece token's leading space included, which decoding it alone would
drop). The sampled token's text comes
from an incremental detokenizer over the choice's tokens (a token that ends inside a multi-byte character gets "",
the token completing it the character); an alternative's text is what it would have added after the same previous
tokens. One ``ChoiceLogprobs`` per choice keeps that state across the chunks of a stream.
"""

from __future__ import annotations

from ..engine.detokenizer import IncrementalDetokenizer

CONTEXT_TOKENS = 4  # previous tokens an alternative is decoded after


class ChoiceLogprobs:
    """Names and formats the logprobs of one choice, chunk after chunk."""

    def __init__(self, decode, prompt_token_ids: list[int]) -> None:
        """``prompt_token_ids``: the prompt the choice continues; its last tokens name the first token in context."""
        self.decode = decode
        self.token_ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.detokenizer = IncrementalDetokenizer(decode, len(self.token_ids), self.token_ids)
        self.offset = 0  # characters of text before the next token

    def _named(self, token_ids: list[int], entries: list[dict]):
        """(token id, its text, the entry, {alternative id: its text}) per new token."""
        out = []
        for token, entry in zip(token_ids, entries):
            window = self.token_ids[-CONTEXT_TOKENS:]
            self.token_ids.append(token)
            text = self.detokenizer.update(self.token_ids)
            context = self.decode(window) if window else ""
            names = {}
            for alternative in entry:
                if alternative == token:
                    names[alternative] = text
                    continue
                full = self.decode(window + [alternative])
                names[alternative] = full[len(context):] if full.startswith(context) else self.decode([alternative])
            out.append((token, text, entry, names))
        return out

    def completion(self, token_ids: list[int], entries: list[dict]) -> dict:
        """``/v1/completions``: {"tokens", "token_logprobs", "top_logprobs", "text_offset"} for the new tokens
        (``top_logprobs``: the top k and the sampled token, text -> logprob)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, text, entry, names in self._named(token_ids, entries):
            out["tokens"].append(text)
            out["token_logprobs"].append(entry[token].logprob)
            out["top_logprobs"].append({names[t]: lp.logprob for t, lp in entry.items()})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def chat(self, token_ids: list[int], entries: list[dict], top: int) -> dict:
        """``/v1/chat/completions``: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]} for the new
        tokens (``top_logprobs``: the ``top`` most likely, in rank order)."""
        content = []
        for token, text, entry, names in self._named(token_ids, entries):
            ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= top)
            content.append({
                "token": text, "logprob": entry[token].logprob, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": names[t], "logprob": entry[t].logprob,
                                  "bytes": list(names[t].encode("utf-8"))} for _, t in ranked],
            })
        return {"content": content}
