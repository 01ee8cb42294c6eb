"""The acceptance rule of speculative decoding, for drafts proposed as a point mass (n-gram lookup, greedy drafts).

The accepted-or-resampled rule (Leviathan et al., Chen et al.) accepts draft ``d`` with probability
``min(1, p(d) / q(d))`` and, on rejection, draws from ``norm(max(p - q, 0))``. For a point-mass draft ``q = 1{d}`` it
accepts with probability ``p(d)`` and resamples from ``p`` with ``d`` zeroed, renormalized. That is exactly the law
of one draw ``x ~ p``: ``x == d`` (probability ``p(d)``) accepts, any other ``x`` is the resampled token with
probability ``p(x)``. So each verified position draws one token from the target's distribution (after every
sampling parameter, as an unspeculated step would), and the drafts are accepted while the draws equal them; greedy
rows draw the argmax, so greedy output is token for token that of the engine without speculation. The first draw
that differs (or the draw after the last draft: the bonus token) is emitted too, then the run stops.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(target_token_ids: Sequence[int], draft_token_ids: Sequence[int]) -> int:
    """How many leading drafts the target's draws at their positions accept (``target_token_ids[j]`` was drawn at
    draft ``j``'s position; it has one more entry than ``draft_token_ids``, the bonus draw)."""
    accepted = 0
    for target, draft in zip(target_token_ids, draft_token_ids):
        if target != draft:
            break
        accepted += 1
    return accepted
