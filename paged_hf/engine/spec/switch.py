"""Switching speculation off for the whole engine where it is slower: measured tokens per second, on and off.

The per-sequence gate (``gate.py``) stops drafts that are seldom accepted, but whether accepted drafts pay depends
on the machine and the batch: a verification forward of ``1 + k`` tokens per sequence costs little more than one
token when a step is bound by overhead or weight reads, and nearly ``1 + k`` times as much when it is bound by
compute (large batches on a CPU). So the engine measures both, side by side: every cycle of decoding steps opens
with a probe of ``2 PROBE_STEPS`` steps that alternate between the two modes, step by step, so that both see the
same batch (the same sequences, at nearly the same lengths) and the same load on the machine; the generated tokens
per second of each mode over the probe decide the mode of the rest of the cycle (the tokens as
``Speculator.end_step`` counts them: where no request waits, only those that bring the batch's last sequence closer
to its end). A cycle lasts ``CYCLE_STEPS`` steps, and twice as long as the one before each time the winner holds (up
to ``MAX_CYCLE_STEPS``): where one mode keeps winning, the loser costs ``PROBE_STEPS`` steps of every
``MAX_CYCLE_STEPS``, and a change of the winner starts short cycles again. A decision holds for the batch it was
measured on: when the number of decoding sequences has doubled or halved since, a new probe starts at once.
Speculation wins only when it measures ``MARGIN`` faster: a tie in the steps' rate is a loss for the batch (its
verification rows cost the machine more than its steps' time shows, and the measurement is noisy). Steps that
compute prompt tokens are not measured (their time says nothing about decoding).
"""

from __future__ import annotations

PROBE_STEPS = 8  # steps of each mode in a probe
CYCLE_STEPS = 64
MAX_CYCLE_STEPS = 512
MARGIN = 1.05  # speculation's tokens/s over those without it, to win


class ThroughputSwitch:
    """Whether the next step speculates (``speculating``), from the decode steps' measured rates (``record``)."""

    def __init__(self) -> None:
        self.num_steps = 0  # decoding steps measured
        self.cycle_steps = CYCLE_STEPS  # the length of the current cycle
        self.winner = True  # speculation, until measured slower
        self.rates: dict[bool, float | None] = {True: None, False: None}  # tokens/s of each mode in the last probe
        self._step_in_cycle = 0
        self._probe = {True: [0, 0.0], False: [0, 0.0]}  # mode -> [tokens, seconds] of this cycle's probe
        self._probed_seqs = 0  # the batch size of the last probe's last step

    def speculating(self) -> bool:
        if self._step_in_cycle < 2 * PROBE_STEPS:
            return self._step_in_cycle % 2 == 0
        return self.winner

    def record(self, speculated: bool, seconds: float, num_tokens: int, num_seqs: int) -> None:
        """Counts one decoding step of ``num_seqs`` sequences that ran in mode ``speculated``, took ``seconds``
        and generated ``num_tokens``; at the end of a probe, the faster mode wins the rest of the cycle."""
        self.num_steps += 1
        if self._step_in_cycle < 2 * PROBE_STEPS:
            measured = self._probe[speculated]
            measured[0] += num_tokens
            measured[1] += seconds
        elif not self._probed_seqs <= 2 * num_seqs <= 4 * self._probed_seqs:  # another batch: probe it now
            self._step_in_cycle, self.cycle_steps = 0, CYCLE_STEPS
            return
        self._step_in_cycle += 1
        if self._step_in_cycle == 2 * PROBE_STEPS:
            self._probed_seqs = num_seqs
            self._decide()
        if self._step_in_cycle >= self.cycle_steps:
            self._step_in_cycle = 0

    def _decide(self) -> None:
        for mode, (tokens, seconds) in self._probe.items():
            self.rates[mode] = tokens / seconds if seconds > 0 else None
            self._probe[mode] = [0, 0.0]
        on, off = self.rates[True], self.rates[False]
        winner = on >= MARGIN * off if on is not None and off is not None else self.winner
        self.cycle_steps = min(2 * self.cycle_steps, MAX_CYCLE_STEPS) if winner == self.winner else CYCLE_STEPS
        self.winner = winner
