"""N-gram proposals by prompt lookup: a sequence's next tokens guessed from its own prompt and output.

The suffix of the last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) is searched in
the earlier tokens; at its most recent earlier occurrence followed by ``num_tokens`` tokens (else its earliest one,
which has the most after it), the tokens that followed it are the proposal. One numpy
comparison per ``n`` over the whole sequence (no Python loop over positions).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], num_tokens: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens continuing ``token_ids`` (prompt + output), or [] when no suffix of
    ``lookup_min`` .. ``lookup_max`` tokens occurred before with a token after it."""
    length = len(token_ids)
    if num_tokens < 1 or length <= lookup_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        # windows starting at 0 .. length - n - 1: each is followed by at least one token, the suffix excluded
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            whole = hits[hits + n + num_tokens <= length]
            start = int(whole[-1] if whole.size else hits[0]) + n
            return tokens[start : start + num_tokens].tolist()
    return []
