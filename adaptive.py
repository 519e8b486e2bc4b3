"""Adaptive speculation: draft only while it pays. An optional policy for dflash.Engine (`policy=`), on by default in
generate.py and bench.py (`--no-adaptive` turns it off: pure DFlash, for benchmarks and oracle runs).

A round costs a draft and a B-token verify and commits `tau` tokens on average; a plain step costs one decode and
commits one token. Speculation pays while tau / round_seconds > 1 / plain_seconds. Both sides are measured as the
generation runs (moving averages of the steps' own wall times), because the ratio of a verify to a decode differs
by device, model and context length, and acceptance falls when a prompt is longer than the drafter's training
context. While speculating would lose, the engine takes plain steps: the same target call as AR decoding plus the
token's features appended to the drafter's context (dflash.Engine._plain), so the output stays exactly AR's and
drafting can resume at any step. It resumes for one probe round after `wait` plain steps; a probe that loses
again doubles the wait (up to `max_wait`), one that wins returns to speculating.

Output never depends on the policy: every step, round or plain, commits only the target's own greedy tokens
(tests/test_adaptive.py forces arbitrary step patterns).
"""
from __future__ import annotations


class Adaptive:
    """speculate() -> round (True) or plain step (False); observe(step) after each step. Per generation: reset().

    Acceptance per round is noisy and often bimodal (a round commits 1 token or the whole block), so `tau` is the
    mean of the last `window` rounds, judged only after `min_rounds` of them; step times are moving averages.
    Speculation is switched off only when it is measured more than `margin` slower than plain steps, and a probe
    round is judged with the rounds before it, so one lucky or unlucky round does not flip the decision."""

    def __init__(self, first_wait: int = 8, max_wait: int = 256, window: int = 8, min_rounds: int = 3,
                 margin: float = 0.1, smoothing: float = 0.3):
        self.first_wait, self.max_wait, self.window, self.min_rounds = first_wait, max_wait, window, min_rounds
        self.margin, self.alpha = margin, smoothing
        self.reset()

    def reset(self) -> None:
        self.taus, self.round_s, self.plain_s = [], None, None     # last rounds' tokens; seconds per step
        self.wait, self.left, self.probing, self.rounds = self.first_wait, 0, False, 0

    def _mix(self, old, new):
        return new if old is None else old + self.alpha * (new - old)

    def paying(self) -> bool:
        """Rounds' tokens per second at least (1 - margin) x plain steps' (True until both have been measured)."""
        if len(self.taus) < self.min_rounds or self.plain_s is None:
            return True
        tau = sum(self.taus) / len(self.taus)
        return tau / self.round_s >= (1 - self.margin) / self.plain_s

    def speculate(self) -> bool:
        if self.plain_s is None and self.rounds >= 2:   # measure one plain step early: the baseline to beat
            return False
        if self.left > 0:                                  # plain steps to go; the last one is replaced by a probe round
            self.left -= 1
            self.probing = self.left == 0
            return self.probing
        return True

    def observe(self, step) -> None:
        if step.kind == "verify":
            self.rounds += 1
            self.taus = (self.taus + [len(step.tokens)])[-self.window:]
            self.round_s = self._mix(self.round_s, step.draft_seconds + step.verify_seconds)
            if self.paying():
                self.probing, self.wait = False, self.first_wait
            else:                                          # lost: plain steps for a while, longer after a failed probe
                if self.probing:
                    self.wait = min(2 * self.wait, self.max_wait)
                self.left, self.probing = self.wait, False
        elif step.kind == "plain":
            self.plain_s = self._mix(self.plain_s, step.verify_seconds)


class Pattern:
    """A fixed step pattern, cycled: True = round, False = plain step. Compile warm-ups use [True, False] so both
    step kinds are compiled before the timed run; tests force arbitrary patterns with it."""

    def __init__(self, pattern):
        self.pattern = list(pattern)
        self.reset()

    def reset(self) -> None:
        self.i = 0

    def speculate(self) -> bool:
        self.i += 1
        return self.pattern[(self.i - 1) % len(self.pattern)]

    def observe(self, step) -> None:
        pass
