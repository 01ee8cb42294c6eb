"""Switching speculation off for the whole engine where it is slower: measured tokens per second, on and off.

The per-sequence gate (``gate.py``) stops drafts that are seldom accepted, but whether accepted drafts pay depends
on the machine and the batch: a verification forward of ``1 + k`` tokens per sequence costs little more than one
token when a step is bound by overhead or weight reads, and nearly ``1 + k`` times as much when it is bound by
compute (large batches on a CPU). So the engine measures both: in every cycle of decoding steps, the
first ``PROBE_STEPS`` run in the mode that is losing (off while speculation wins, on while it loses) and the rest in
the winning one; the generated tokens per second of each mode are compared at the end of each phase. A cycle lasts
``CYCLE_STEPS`` steps, and twice as long as the one before each time the winner holds (up to ``MAX_CYCLE_STEPS``):
where one mode keeps winning, the loser's probes cost at most ``PROBE_STEPS / MAX_CYCLE_STEPS`` of its slowdown,
and a change of the winner starts short cycles again. Steps that compute prompt tokens are not measured (their time
says nothing about decoding).
"""

from __future__ import annotations

PROBE_STEPS = 8
CYCLE_STEPS = 64
MAX_CYCLE_STEPS = 512


class ThroughputSwitch:
    """Whether the next step speculates (``speculating``), from the decode steps' measured rates (``record``)."""

    def __init__(self) -> None:
        self.num_steps = 0  # decoding steps measured
        self.cycle_steps = CYCLE_STEPS  # the length of the current cycle
        self.winner = True  # speculation, until measured slower
        self.rates: dict[bool, float | None] = {True: None, False: None}  # tokens/s of each mode's last phase
        self._step_in_cycle = 0
        self._phase_tokens = 0
        self._phase_seconds = 0.0

    def speculating(self) -> bool:
        probing = self._step_in_cycle < PROBE_STEPS
        return self.winner != probing

    def record(self, speculated: bool, seconds: float, num_tokens: int) -> None:
        """Counts one decoding step that ran in mode ``speculated``, took ``seconds`` and generated
        ``num_tokens``; at the end of a phase, the faster mode wins the next cycle."""
        self._phase_tokens += num_tokens
        self._phase_seconds += seconds
        self.num_steps += 1
        self._step_in_cycle += 1
        if self._step_in_cycle not in (self.cycle_steps, PROBE_STEPS):
            return
        if self._phase_seconds > 0:
            self.rates[speculated] = self._phase_tokens / self._phase_seconds
        self._phase_tokens, self._phase_seconds = 0, 0.0
        if self._step_in_cycle < self.cycle_steps:
            return
        self._step_in_cycle = 0
        on, off = self.rates[True], self.rates[False]
        winner = on >= off if on is not None and off is not None else self.winner
        self.cycle_steps = min(2 * self.cycle_steps, MAX_CYCLE_STEPS) if winner == self.winner else CYCLE_STEPS
        self.winner = winner
