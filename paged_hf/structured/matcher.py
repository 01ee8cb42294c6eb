"""``SequenceGrammar``: one sequence's place in its grammar.

Each sample of a request has its own (the samples of ``n > 1`` diverge); it is advanced by every token the
sequence appends. A sequence preempted by recompute keeps its tokens, so its matcher stays where it is: nothing is
replayed. ``terminated``: the grammar accepted an end token (it allows one only where the output can end).
"""

from __future__ import annotations

from .grammar import xgrammar_module


class GrammarRejected(ValueError):
    """A token the grammar does not allow was drawn (something after the mask forced it: a logits processor, a
    logit bias or ``allowed_token_ids`` leaving no allowed token)."""


class SequenceGrammar:
    __slots__ = ("matcher", "num_accepted")

    def __init__(self, compiled, stop_tokens: list[int] | None = None) -> None:
        """``stop_tokens``: the tokens that end the output, when not the compiled grammar's (a request's
        ``stop_token_ids`` with the end tokens): allowed only where the grammar can end, as vLLM's."""
        self.matcher = xgrammar_module().GrammarMatcher(compiled, override_stop_tokens=stop_tokens)
        self.num_accepted = 0

    def accept(self, token: int) -> None:
        """Advances past ``token``; ``GrammarRejected`` if the grammar does not allow it here."""
        if not self.matcher.accept_token(token):
            raise GrammarRejected(f"token {token} at output position {self.num_accepted} is not allowed by the "
                                  f"request's structured output grammar (a logits processor, logit_bias or "
                                  f"allowed_token_ids forced it past the mask)")
        self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        """Writes the tokens allowed next into row ``row`` of ``bitmask`` ``[R, ceil(vocab / 32)]`` (int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
