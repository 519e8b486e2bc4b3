"""Adaptive speculation: draft only while it pays. An optional policy for dflash.Engine (`policy=`), on by default in
generate.py and bench.py (`--no-adaptive` turns it off: pure DFlash, for benchmarks and oracle runs).

A round costs a draft and a B-token verify and commits `tau` tokens on average; a plain step costs one decode and
commits one token. Speculation pays while tau >= round_seconds / plain_seconds, the break-even. Both costs are
measured as the generation runs (medians of the steps' own wall times), because the ratio of a verify to a decode
differs by device, model and context length, and acceptance falls when a prompt is longer than the drafter's
training context. While speculating would lose, the engine takes plain steps: the same target call as AR decoding
plus the token's features appended to the drafter's context (dflash.Engine.decode with plain=True), so the output
stays exactly AR's and drafting can resume at any step.

The policy decides from acceptance and is slow to give rounds up. Tokens per round are bimodal (a round often
commits 1 token or the whole block) and a generation's first rounds are its worst, so a mean over few rounds says
little; rounds that pay but are stopped by a bad start cost far more than rounds that lose a little for a while.
So rounds go on while the mean of the last `window` acceptance samples is at least the break-even times
(1 - margin), with margin = confidence / sqrt(samples in the window) (floored at min_margin): wide after the first
`min_rounds` rounds, narrow once many have been seen. A generation opens with two plain steps (they time a plain
step, the faster of the two, and skip the least predictable first rounds), then rounds.

After a stop, the plain steps test for a comeback with looks: a look drafts as a round would and verifies nothing
(Step.look); the plain tokens that follow show how many of its proposals a round would have accepted, n, and the
look counts as a round of n + 1 tokens in the same mean. Rounds resume as soon as the mean pays; a look that leaves
it below break-even doubles the wait before the next (from `first_wait` plain steps up to `max_wait`). Replayed on
recorded drafts of 88 prompts (docs/method.md#adaptive-speculation-and-the-draft-window), this keeps 97-102% of pure
rounds' speed (geometric mean over the prompts) at every step cost from 1.2 to 3 plain steps a round, and where
rounds lose it loses a third to a half as much as they do.

Output never depends on the policy: every step, round or plain, commits only the target's own tokens
(tests/test_adaptive.py forces arbitrary step patterns).
"""
from __future__ import annotations

import statistics

from dflash import Step


class Adaptive:
    """speculate() -> round (True) or plain step (False); look() -> whether that plain step drafts first (a probe);
    observe(step) after each step. Per generation: reset().

    samples: tokens per round, a round's or (for a judged look) the n + 1 a round started there would have
    committed; tau = their mean over the last `window`. Step times: medians of the last `window` rounds and plain
    steps. Before `min_rounds` samples nothing is judged."""

    def __init__(self, first_wait: int = 8, max_wait: int = 128, window: int = 32, min_rounds: int = 8,
                 confidence: float = 1.0, min_margin: float = 0.05):
        self.first_wait, self.max_wait, self.window, self.min_rounds = first_wait, max_wait, window, min_rounds
        self.confidence, self.min_margin = confidence, min_margin
        self.reset()

    def reset(self) -> None:
        self.samples, self.round_times, self.plain_times = [], [], []   # tokens per round; seconds per step
        self.opening = 2                # the first two steps are plain steps: they time one
        self.speculating = True         # then rounds, until they are judged not to pay
        self.wait, self.left = self.first_wait, 0    # after a stop: plain steps to the next look
        self.looking, self.pending = False, None     # a look is due; a look's proposals and the count matched so far

    def _keep(self, times: list, t: float) -> None:
        times.append(t)
        del times[:-self.window]

    @property
    def break_even(self):
        """Tokens a round must commit to beat plain steps: median round time / plain step time (None before both
        are timed). The plain step time is the median of the last `window`, or the fastest while there are fewer
        than 3: the first plain step after a long prefill can take 2-3 times as long as the next (15 against 6 ms
        after 3,000 tokens here), and a slow outlier there would make losing rounds look paying."""
        if not (self.round_times and self.plain_times):
            return None
        plain = min(self.plain_times) if len(self.plain_times) < 3 else statistics.median(self.plain_times)
        return statistics.median(self.round_times) / plain

    def pays(self, extra=()) -> bool:
        """The acceptance samples (with `extra` ones) pay, within the margin their number allows; True before
        min_rounds samples or before both step kinds are timed."""
        s = (self.samples + list(extra))[-self.window:]
        if len(self.samples) + len(extra) < self.min_rounds or self.break_even is None:
            return True
        margin = max(self.min_margin, self.confidence / len(s) ** 0.5)
        return sum(s) / len(s) >= self.break_even * (1 - margin)

    def speculate(self) -> bool:
        if self.opening:
            self.opening -= 1
            return False
        if self.pending is not None:                       # a look is being matched: plain steps until it is judged
            return False
        if self.speculating:
            return True
        self.left -= 1                                     # plain steps to go; the last one looks
        self.looking = self.left <= 0
        return False

    def look(self) -> bool:
        """Whether the plain step about to run drafts first (asked after speculate() said False)."""
        looking, self.looking = self.looking, False
        return looking

    def observe(self, step) -> None:
        if step.kind == "verify":
            self._keep(self.samples, len(step.tokens))
            self._keep(self.round_times, step.draft_seconds + step.verify_seconds)
            if not self.pays():                            # lost: plain steps, then a look
                self.speculating, self.left = False, self.wait
        elif step.kind == "plain":
            self._keep(self.plain_times, step.verify_seconds)
            if step.look is not None:
                self.pending = (list(step.look), 0)
            if self.pending is not None:
                self._match(step.tokens[0])

    def _match(self, token: int) -> None:
        """A plain step's token against the pending look's next proposal. A round there would have committed at least
        n + 1 tokens once n proposals are matched: rounds resume as soon as that pays, without waiting for the first
        miss (the count is then a lower bound); at the first miss the look is judged with its n + 1."""
        proposals, n = self.pending
        matched = n < len(proposals) and token == proposals[n]
        n += matched
        resume = self.pays([n + 1])
        if not resume and matched and n < len(proposals):  # still matching, not yet paying: not judged yet
            self.pending = (proposals, n)
            return
        self._keep(self.samples, n + 1)                    # judged: a round of n + 1 tokens
        self.pending = None
        if resume:
            self.speculating, self.wait = True, self.first_wait
        else:                                              # it would not have paid
            self.wait = min(2 * self.wait, self.max_wait)
            self.left = self.wait


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


def warm_up(engine, prompt: list, stops, policy) -> None:
    """A throw-away run of a speculative engine; with a policy, every step kind (round, plain, look) runs in it,
    so the timed run compiles nothing new. Then the engine gets `policy` (None: pure rounds)."""
    engine.policy = Pattern([True, "look"]) if policy else None
    engine.run(prompt, 3 * engine.block, stops)
    engine.policy = policy


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
