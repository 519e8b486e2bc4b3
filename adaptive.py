"""Adaptive speculation: draft only while it pays. An optional policy for dflash.Engine (`policy=`), on by default in
generate.py and bench.py (`--no-adaptive` turns it off: pure DFlash, for benchmarks and oracle runs).

A round costs a draft and a B-token verify and commits `tau` tokens on average; a plain step costs one decode and
commits one token. Speculation pays while tau / round_seconds >= 1 / plain_seconds. Both sides are measured as
the generation runs (medians of the steps' own wall times), because the ratio of a verify to a decode
differs by device, model and context length, and acceptance falls when a prompt is longer than the drafter's
training context. While speculating would lose, the engine takes plain steps: the same target call as AR decoding
plus the token's features appended to the drafter's context (dflash.Engine.decode with plain=True), so the
output stays exactly AR's and drafting can resume at any step.

Whether to speculate is tested by a look, not a round: the drafter drafts once, as a round would, but nothing is
verified (Step.look); the plain steps that follow are the target's own tokens, so they say how many of the look's
proposals a round would have accepted, at the price of a draft alone (about a fifth of a round on the
embedded pair). A generation starts with a look, because its first rounds are its worst: a drafter's acceptance
is lowest before the text settles into a pattern (on the embedded pair the first round of a 30-60 token prompt
commits 1.9 tokens on average, the first three 3.0, against the 2.1-2.8 a round must commit to pay on this CPU), and a
look costs a fraction of what a losing round does. A look that would have paid starts (or resumes) speculation at
once; one that would have lost doubles the wait before the next look (from `first_wait`, 8 plain steps, up to
`max_wait`, 256): after a missed opening look the next one comes 8 plain steps later, then 16, 32, ..., so on a
prompt where the drafter never helps the looks cost about log2(n / 4) drafts in n tokens. Rounds that lose go
back to plain steps for `wait` steps before the next look.

Output never depends on the policy: every step, round or plain, commits only the target's own greedy tokens
(tests/test_adaptive.py forces arbitrary step patterns).
"""
from __future__ import annotations

import statistics

from dflash import Step


class Adaptive:
    """speculate() -> round (True) or plain step (False); look() -> whether that plain step drafts first (a probe);
    observe(step) after each step. Per generation: reset().

    The first step is a plain step that looks. Acceptance per round is noisy and often bimodal (a round commits 1
    token or the whole block), so `tau` is the mean of the last `window` rounds, judged only after `min_rounds` of
    them (after a look started speculation: the look, whose would-be acceptance counts as a round, and one round).
    Step times are medians of the last `window` steps of each kind: a step the OS or another process interrupted is
    an outlier, not a trend. Before any round is timed, a round is estimated as a look plus `verify_steps` plain
    steps (a B-token verify costs 1.3 to 2.3 decode steps on the CPUs measured, about one on a GPU; the first
    rounds then replace the estimate). Speculation stops when it is measured slower than plain steps (by more than
    `margin`, a fraction)."""

    def __init__(self, first_wait: int = 8, max_wait: int = 256, window: int = 8, min_rounds: int = 3,
                 margin: float = 0.0, verify_steps: float = 2.0):
        self.first_wait, self.max_wait, self.window, self.min_rounds = first_wait, max_wait, window, min_rounds
        self.margin, self.verify_steps = margin, verify_steps
        self.reset()

    def reset(self) -> None:
        self.taus, self.round_times, self.plain_times, self.look_times = [], [], [], []   # tokens; seconds per step
        self.wait = self.first_wait
        self.left = 1                               # plain steps to go, the last one a look: the generation opens with one
        self.opening = True                         # that look is not judged yet (a miss waits first_wait, not double)
        self.looking, self.pending = False, None    # a look is due; a look's proposals not yet matched, and the count matched
        self.resumed = False                        # speculating again on a look's word, not yet confirmed by rounds

    def _keep(self, times: list, t: float) -> None:
        times.append(t)
        del times[:-self.window]

    @property
    def round_s(self):
        """Seconds per round: measured, else estimated from a look and a plain step (None before both)."""
        if self.round_times:
            return statistics.median(self.round_times)
        if self.look_times and self.plain_times:
            return statistics.median(self.look_times) + self.verify_steps * self.plain_s
        return None

    @property
    def plain_s(self):
        return statistics.median(self.plain_times) if self.plain_times else None

    def pays(self, tau: float) -> bool:
        """Rounds of tau tokens at least (1 - margin) x as many tokens per second as plain steps."""
        return tau / self.round_s >= (1 - self.margin) / self.plain_s

    def paying(self) -> bool:
        """The mean of the last rounds pays (True until enough rounds and a plain step have been measured; after
        a look resumed speculation, the look and one round are enough)."""
        if len(self.taus) < (2 if self.resumed else self.min_rounds) or self.plain_s is None:
            return True
        return self.pays(sum(self.taus) / len(self.taus))

    def speculate(self) -> bool:
        if self.pending is not None:                       # a look is being matched: plain steps until it is judged
            return False
        if self.left > 0:                                  # plain steps to go; the last one looks
            self.left -= 1
            self.looking = self.left == 0
            return False
        return True

    def look(self) -> bool:
        """Whether the plain step about to run drafts first (asked after speculate() said False)."""
        looking, self.looking = self.looking, False
        return looking

    def observe(self, step) -> None:
        if step.kind == "verify":
            self.taus = (self.taus + [len(step.tokens)])[-self.window:]
            self._keep(self.round_times, step.draft_seconds + step.verify_seconds)
            if not self.paying():                          # lost: plain steps for a while, then a look
                if self.resumed:                           # the look that resumed was lucky: wait longer next time
                    self.wait = min(2 * self.wait, self.max_wait)
                self.left, self.resumed = self.wait, False
            elif len(self.taus) >= self.min_rounds:        # confirmed by rounds: short waits again
                self.wait, self.resumed = self.first_wait, False
        elif step.kind == "plain":
            self._keep(self.plain_times, step.verify_seconds)
            if step.look is not None:
                self._keep(self.look_times, step.draft_seconds)
                self.pending = (list(step.look), 0)
            if self.pending is not None:
                self._match(step.tokens[0])

    def _match(self, token: int) -> None:
        """A plain step's token against the pending look's next proposal; judge the look once it is decided."""
        proposals, n = self.pending
        matched = n < len(proposals) and token == proposals[n]
        n += matched
        # A round would have committed at least n + 1 tokens (n proposals and its bonus token): speculate again as
        # soon as that pays, without waiting for the look's first miss (judged afresh by the rounds that follow).
        if self.round_s is not None and self.pays(n + 1):
            self.pending, self.taus, self.left, self.resumed = None, [n + 1], 0, True
        elif matched and n < len(proposals):
            self.pending = (proposals, n)
        else:                                              # missed: it would have lost
            self.pending = None
            if not self.opening:
                self.wait = min(2 * self.wait, self.max_wait)
            self.left = self.wait
        if self.pending is None:
            self.opening = False


class Pattern:
    """A fixed step pattern, cycled: True = round, False = plain step, "look" = a plain step that drafts first.
    Compile warm-ups use [True, "look"] so every step kind is compiled before the timed run; tests force arbitrary
    patterns with it."""

    def __init__(self, pattern):
        self.pattern = list(pattern)
        self.reset()

    def reset(self) -> None:
        self.i = 0

    def speculate(self) -> bool:
        self.i += 1
        return self.pattern[(self.i - 1) % len(self.pattern)] is True

    def look(self) -> bool:
        return self.pattern[(self.i - 1) % len(self.pattern)] == "look"

    def observe(self, step) -> None:
        pass


def replay(policy, output_ids: list, drafts: list, plain_s: float, look_s: float, round_s: float) -> tuple:
    """A policy's decisions on a recorded generation, without noise: output_ids (the first from prefill included)
    and drafts[t], the proposals a draft after output_ids[t] makes (a generation with a look at every step records
    them: Pattern(["look"]), Step.look). A round at t commits its proposals while they equal the output, plus one;
    steps cost the given seconds. -> (AR time / the policy's time, the steps as a string: R round, . plain, L look).
    The drafts are the same whichever steps a policy takes (the drafter's context is the committed prefix's features
    either way), so one recording replays any policy."""
    N, t, spent, kinds = len(output_ids), 0, 0.0, []
    policy.reset()
    while t < N - 1:
        if policy.speculate():
            props, a = drafts[t], 0
            while a < len(props) and t + 1 + a < N and props[a] == output_ids[t + 1 + a]:
                a += 1
            n = min(a + 1, N - 1 - t)
            policy.observe(Step("verify", t, output_ids[t + 1:t + 1 + n], props, a, verify_seconds=round_s))
            spent, t = spent + round_s, t + n
            kinds.append("R")
        else:
            look = policy.look()
            policy.observe(Step("plain", t, [output_ids[t + 1]], draft_seconds=look_s if look else 0.0,
                                verify_seconds=plain_s, look=drafts[t] if look else None))
            spent, t = spent + plain_s + (look_s if look else 0.0), t + 1
            kinds.append("L" if look else ".")
    return (N - 1) * plain_s / spent if spent else 1.0, "".join(kinds)
