"""N-gram proposals by prompt lookup: a sequence's next tokens guessed from its own prompt and output.

The suffix of the last ``n`` tokens (the longest ``n`` up to ``prompt_lookup_max``, at least ``prompt_lookup_min``)
is searched in the earlier tokens; at its most recent earlier occurrence followed by ``num_tokens`` tokens (else its
earliest one, which has the most after it), the tokens that followed it are the proposal. Vectorized over the
candidates: one numpy comparison finds the earlier occurrences of the last token, and each further suffix token
narrows them with one more (``prompt_lookup_max`` comparisons over a few candidates, not over the sequence).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], num_tokens: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens continuing ``token_ids`` (prompt + output), or [] when no suffix of
    ``lookup_min`` .. ``lookup_max`` tokens occurred before with a token after it."""
    length = len(token_ids)
    if num_tokens < 1 or length <= lookup_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # earlier ends of a 1-token match
    matched = 1
    while ends.size and matched < lookup_max:
        longer = ends[(ends >= matched) & (tokens[np.maximum(ends - matched, 0)] == tokens[length - 1 - matched])]
        if not longer.size:
            break
        ends, matched = longer, matched + 1
    if matched < lookup_min or not ends.size:
        return []
    whole = ends[ends + num_tokens < length]
    start = int(whole[-1] if whole.size else ends[0]) + 1
    return tokens[start : start + num_tokens].tolist()
