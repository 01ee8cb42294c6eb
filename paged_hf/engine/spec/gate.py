"""Switching speculation off where it does not pay: one gate per sequence.

Drafts cost a longer verification forward whether or not they are accepted. Each sequence counts its drafts and
their acceptances over a window of at least ``2 k`` draft tokens; a window accepted below ``min_acceptance_rate``
closes the gate for ``pause`` output tokens, and the pause doubles at each poor window in a row (up to
``MAX_PAUSE``), so text that does not repeat itself runs nearly as without speculation while text that does keeps
speculating.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_PAUSE = 8  # output tokens without proposals after the first poor window
MAX_PAUSE = 256


@dataclass(slots=True)
class AcceptanceGate:
    """One sequence's speculation switch. ``resume_at``: the output length from which it proposes again."""

    num_drafted: int = 0  # draft tokens of the current window
    num_accepted: int = 0
    resume_at: int = 0
    pause: int = FIRST_PAUSE

    def is_open(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.resume_at

    def record(self, num_drafts: int, num_accepted: int, num_output_tokens: int, window: int,
               min_rate: float) -> None:
        """Counts one verified run; at the end of a window, closes the gate if acceptance was poor."""
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted
        if self.num_drafted < window:
            return
        if self.num_accepted < min_rate * self.num_drafted:
            self.resume_at = num_output_tokens + self.pause
            self.pause = min(2 * self.pause, MAX_PAUSE)
        else:
            self.pause = FIRST_PAUSE
        self.num_drafted = self.num_accepted = 0
