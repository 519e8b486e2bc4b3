"""Adaptive speculation: before each step of the engine, a round of verify block k for every live row, or a plain step.

The rule. Before every step the policy compares what each step kind is expected to commit per second: a plain step
commits one token per live row in `plain` seconds; a round of k commits the sum over live rows of E_r(k) tokens in
`round(k)` seconds; the best k's round is taken when its rate is higher, else a plain step. E_r(k) is row r's expected
tokens from a round of k: a decayed average (weight `keep` per round) of what its rounds committed, min(committed, k) (a
round of K is read as telling what a round of any k <= K would have committed, and of any longer k when it stopped short
of K; one that committed all K counts k, optimistically, until a round of k measures it), mixed with a prior (`prior_p`:
the tokens of a round of k if each proposal were accepted with that probability) worth `prior_weight` rounds at
admission and fading by `keep` with each round of the row's evidence, down to `prior_floor` rounds. The blocks:
engine_blocks (the whole block alone for an Engine of one slot). Every plain step ages the live rows' evidence by
exp(-rate / loss), loss being what the best round would lose on the evidence alone (its seconds in plain steps less its
tokens per row), so an estimate that made rounds lose drifts back to the prior, and a round (a probe) measures the rows
again after a number of plain steps that keeps such probes near `rate` of the time; `rate` starts at `budget`, halves
with each probe that loses (down to budget / 8) and returns to `budget` with any round that pays (its tokens worth more
plain steps than its seconds); an admitted request starts from the prior. While plain steps run, every SHADOW_EVERY-th
hand-over of their features to the drafter's context (one at the first plain step after a round, then one per block of
plain steps) is a shadow draft (`shadow`): a draft of the longest block whose proposals the plain steps after it judge
(engine.Shadows), which tells exactly what a round there would have committed, or, as soon as its first SHADOW_SURE
proposals are confirmed, that a round of SHADOW_SURE + 1 would have committed its whole block; that counts as a round's
evidence (`observe_shadow`), and the rule is asked again at the next step. The seconds are the median of each step
kind's last `window` timings (each from the decision to the rows' next inputs, Engine.step; a round's including what the
plain step after it takes beyond a plain step's: the switch back), starting from a calibration measured once per machine
and shape (Engine.warm_up; cached on disk, `load_costs`) and corrected by every step timed; a block not timed yet is
estimated by interpolating linearly in k between the timed kinds (a plain step standing for k = 0: optimistic, so it is
tried and timed), and with no plain step timed the policy takes one. Nothing else is kept: every decision is made afresh
from the estimates of that moment. A decision for a plain step also decides the plain steps after it, up to the first at
which the rule, with the costs as they stand and the live rows aged by each step, would take a round (at most PLAN):
those take no decision of their own unless a request is admitted or leaves (their timings count from the next decision),
so a run of plain steps costs the rule's Python once per PLAN steps, not at every step.

The output never depends on any of this: every kind of step commits the target's own tokens, and plain steps keep
the drafter's context fed (engine.Pending), so a round can follow any step. Why: docs/method.md#adaptive-speculation.

    Costs      each step kind's measured seconds: seconds(k), k = 0 for a plain step
    Rows       each row's decayed acceptance evidence: expected(b, k)
    Policy     the decisions: speculate() -> 0 (a plain step) or k, shadow() -> 0 or the block of a shadow draft;
               admit / observe_round / observe_plain / observe_shadow; its per-run counts of rounds, plain steps,
               shadow drafts and switches by reason (`counts`)
    Scripted   the protocol an Engine calls a policy by, every observation ignored (a base for scripted policies)
    Alternate  a cycle through every step kind (Engine.warm_up: compiles them all, then times them: `medians`)
    PerRun     a fresh policy for every run (a benchmark's single requests, each as its own generate.py run)
"""
from __future__ import annotations

import collections
import math
import os
import statistics

from model import GenerationError

PLAN = 16           # the most plain steps one decision of the rule takes (Policy.plan)
SHADOW_EVERY = 1    # while plain steps run, every this many hand-overs of the drafter's context is a shadow draft
#                   (0: none)
SHADOW_SURE = 3     # a shadow draft whose first this many proposals are confirmed is reported at once (engine.Shadows)
REASONS = ("to_plain_acceptance", "to_plain_costs", "to_rounds_admission", "to_rounds_shadow", "to_rounds_aging",
           "plain_untimed")


def verify_blocks(block: int) -> tuple:
    """The verify blocks a Policy chooses among by default: the whole block, then halved down to 2 (16: 16, 8, 4, 2)."""
    out = [block]
    while out[-1] // 2 >= 2:
        out.append(out[-1] // 2)
    return tuple(out)


def engine_blocks(block: int, slots: int) -> tuple:
    """The verify blocks the policy of an Engine of `slots` slots chooses among: with one slot the whole block alone,
    with several every verify_blocks. A shorter block's draft is not the whole block's first proposals (the drafter
    attends across its block, and drafts worse at a length it was not trained at), which the rows' evidence, read
    from rounds of other blocks, cannot see; a shorter round pays where it costs much less than the whole block's,
    which is where many rows' verify products grow with the block (docs/method.md#adaptive-speculation)."""
    return (block,) if slots == 1 else verify_blocks(block)


def engine_policy(block: int, slots: int, calibration: dict | None = None, **params) -> "Policy":
    """The adaptive policy of an Engine of `slots` slots drafting blocks of `block`: choosing among
    engine_blocks(block, slots) unless params name other `blocks`; params: Policy's other settings."""
    return Policy(block=block, **{"blocks": engine_blocks(block, slots), **params}, calibration=calibration)


class Costs:
    """Each step kind's seconds (k = 0: a plain step, else a round of k): the median of its last `window` timings,
    the calibration's seconds counted as the first."""

    def __init__(self, window: int = 8, calibration: dict | None = None):
        self.samples = collections.defaultdict(lambda: collections.deque(maxlen=window))
        self.medians = {}                                   # each timed kind's median, until its next timing
        self.version = 0                                    # counts the changes (Policy.seconds recomputes on one)
        for k, s in (calibration or {}).items():
            self.samples[int(k)].append(float(s))

    def add(self, k: int, seconds: float) -> None:
        self.samples[k].append(seconds)
        self.medians.pop(k, None)
        self.version += 1

    def charge(self, k: int, seconds: float) -> None:
        """Add `seconds` to kind k's last timing (a round's switch back to plain steps, paid by the plain step after it)."""
        if self.samples.get(k):
            self.samples[k][-1] += seconds
            self.medians.pop(k, None)
            self.version += 1

    def timed(self, k: int) -> bool:
        return bool(self.samples.get(k))

    def seconds(self, k: int) -> float:
        """The kind's median, or (a block not timed yet, with a plain step timed) interpolated linearly in k between
        the nearest timed kinds, a plain step at k = 0; past the longest timed block, its seconds."""
        found = self.medians.get(k)
        if found is not None:
            return found
        if self.timed(k):
            self.medians[k] = statistics.median(self.samples[k])
            return self.medians[k]
        timed = sorted(j for j in self.samples if self.samples[j])
        below = max(j for j in timed if j < k)
        above = [j for j in timed if j > k]
        if not above:
            return self.seconds(below)
        lo, hi = self.seconds(below), self.seconds(above[0])
        return lo + (hi - lo) * (k - below) / (above[0] - below)


class Rows:
    """Each slot's acceptance evidence per verify block: decayed sums of min(committed, k) and of their weights."""

    def __init__(self, blocks: tuple, keep: float, prior_p: float, prior_weight: float, prior_floor: float):
        self.blocks, self.keep, self.prior_weight, self.p = blocks, keep, prior_weight, prior_p
        self.prior_floor = min(prior_floor, prior_weight)
        self.prior_weights = {}         # each row's prior weight now: prior_weight at admission, fading by keep per
        #                                 round of evidence to prior_floor
        self.prior = {k: self.geometric(k) for k in blocks}
        self.sums, self.weights = {}, {}
        self.version = 0                # counts the changes other than aging (Policy.probe_loss recomputes on one)

    def geometric(self, k: int) -> float:
        """The tokens of a round of k if each proposal were accepted with probability prior_p: 1 + p + .. + p^(k-1)."""
        return sum(self.p ** i for i in range(k))

    def censored(self, K: int, k: int) -> float:
        """What a round of k > K is counted for a round of K that committed all K: k, the optimistic reading (a
        round's acceptance is heavy-tailed: one that accepted its whole block often would have accepted more), which
        a round of k then corrects."""
        return k

    def admit(self, b: int) -> None:
        self.sums[b], self.weights[b] = dict.fromkeys(self.blocks, 0.0), dict.fromkeys(self.blocks, 0.0)
        self.prior_weights[b] = self.prior_weight
        self.version += 1

    def add_round(self, b: int, K: int, committed: int) -> None:
        if b not in self.sums:
            self.admit(b)
        sums, weights = self.sums[b], self.weights[b]
        for k in self.blocks:           # what a round of k would have committed: known, unless k > K = committed
            tokens = min(committed, k) if k <= K or committed < K else self.censored(K, k)
            sums[k] = self.keep * sums[k] + tokens
            weights[k] = self.keep * weights[k] + 1
        self.prior_weights[b] = max(self.prior_floor, self.keep * self.prior_weights[b])
        self.version += 1

    def add_plain(self, live, age: float) -> None:
        """A plain step: the live rows' evidence weighs `age` times as much (its ratio, the evidence alone, is kept)."""
        for b in live:
            sums, weights = self.sums.get(b), self.weights.get(b)
            if sums is not None:
                for k in self.blocks:
                    sums[k] *= age
                    weights[k] *= age

    def summed(self, live, prior_weight: float | None = None, age: float = 1.0) -> dict:
        """{k: the expected tokens from a round of k, summed over the rows `live`}: each row's evidence, weighing `age`
        times as much (add_plain), mixed with the prior (prior_weight 0: the evidence alone, the prior where there is
        none)."""
        prior, out = self.prior, dict.fromkeys(self.blocks, 0.0)
        for b in live:
            sums, weights = self.sums.get(b), self.weights.get(b)
            w0 = self.prior_weights.get(b, self.prior_weight) if prior_weight is None else prior_weight
            for k in self.blocks:
                if sums is None or weights[k] * age + w0 <= 0:
                    out[k] += prior[k]
                else:
                    out[k] += (sums[k] * age + w0 * prior[k]) / (weights[k] * age + w0)
        return out


class Policy:
    """Adaptive speculation for a batch (the module docstring states the rule). speculate() -> 0 or the verify block
    of a round; the engine reports each admission (admit), each round's tokens per slot and seconds (observe_round)
    and each plain step's seconds (observe_plain). reset() starts a run: the rows' evidence and the counts start over,
    the step timings are kept (they depend on N, which an Engine fixes)."""

    def __init__(self, block: int = 16, blocks: tuple | None = None, calibration: dict | None = None,
                 keep: float = 0.9, budget: float = 0.1, prior_p: float = 0.9, prior_weight: float = 2.0,
                 prior_floor: float = 0.5,
                 window: int = 8):
        self.blocks = tuple(sorted(set(blocks or verify_blocks(block)), reverse=True))     # longest first
        if self.blocks[-1] < 1 or self.blocks[0] > block:
            raise GenerationError(f"policy blocks {self.blocks} must lie in 1..{block}")
        for name, value, ok, rule in (("keep", keep, 0 <= keep <= 1, "in 0..1"), ("budget", budget, budget > 0, "> 0"),
                                      ("prior_p", prior_p, 0 < prior_p <= 1, "in (0, 1]"),
                                      ("prior_weight", prior_weight, prior_weight >= 0, ">= 0"),
                                      ("prior_floor", prior_floor, prior_floor >= 0, ">= 0"), ("window", window, window >= 1, ">= 1")):
            if not ok:
                raise GenerationError(f"policy setting {name} must be {rule}, got {value}")
        self.params, self.budget = (keep, prior_p, prior_weight, prior_floor), budget
        self.window = window
        self.calibrate(calibration)
        self.reset()

    def calibrate(self, calibration: dict | None) -> None:
        """Step seconds measured on this machine and shape ({k: seconds}, 0 a plain step): the costs start over from
        them."""
        self.calibration = dict(calibration or {})
        self.costs = Costs(self.window, self.calibration)
        self.table = self.loss = None       # seconds(), probe_loss(): (their inputs' versions, the value)

    def reset(self) -> None:
        self.rows = Rows(self.blocks, *self.params)
        self.live, self.admitted = set(), False
        self.shadowed = False                           # a shadow draft judged since the last decision
        self.last, self.after_round = None, None        # the last decision (0 or k); the k of a round just before
        self.basis = None                                # the round seconds that decision used
        self.probe, self.rate = False, self.budget       # whether the coming round is a probe; the aging's budget now
        self.counts = collections.Counter({"rounds": 0, "plain_steps": 0, "shadow_drafts": 0, **dict.fromkeys(REASONS, 0)})
        self.hand_overs = 0             # hand-overs of the drafter's context during plain steps (shadow())
        self.loss = None
        self.ahead = 0                  # plain steps decided already (plan), taken without asking the rule again
        self.aged, self.age = 0, None   # plain steps since the last decision, not yet applied; their aging (plan's)

    def admit(self, b: int) -> None:
        """A request admitted into slot b: its row starts from the prior (and the rule is asked at the next step)."""
        self.catch_up()
        self.rows.admit(b)
        self.live.add(b)
        self.admitted, self.ahead = True, 0

    def tokens(self, prior_weight: float | None = None, age: float = 1.0) -> dict:
        """{k: the live rows' expected tokens from a round of k, summed} for every block (Rows.summed; no live row:
        the prior's)."""
        return self.rows.summed(sorted(self.live) or (None,), prior_weight, age)

    def catch_up(self) -> None:
        """The aging of the plain steps taken since the last decision, applied to the live rows at once."""
        if self.aged:
            age = self.age if self.age is not None else math.exp(-self.rate / max(self.rate, self.probe_loss()))
            self.rows.add_plain(self.live, age ** self.aged)
        self.aged, self.age = 0, None

    def plan(self, seconds: dict) -> int:
        """After the rule took a plain step: how many more it would take before a round, with the costs as they stand
        and the live rows aged by each (at most PLAN), asked here once rather than at each of them."""
        self.age = math.exp(-self.rate / max(self.rate, self.probe_loss()))
        for n in range(1, PLAN + 1):
            if self.choose(self.tokens(age=self.age ** n), seconds):
                return n - 1
        return PLAN

    def seconds(self) -> dict:
        """{k: Costs.seconds(k)} for a plain step (0) and every block, as the costs stand (a new dict after a change)."""
        if self.table is None or self.table[0] != self.costs.version:
            self.table = (self.costs.version, {k: self.costs.seconds(k) for k in (0, *self.blocks)})
        return self.table[1]

    def choose(self, tokens: dict, seconds: dict) -> int:
        """k of the best round, or 0 for a plain step: the round's tokens per second against the plain step's."""
        best = max(self.blocks, key=lambda k: tokens[k] / seconds[k])
        return best if tokens[best] / seconds[best] * seconds[0] / max(1, len(self.live)) > 1 else 0

    def speculate(self) -> int:
        """0 (a plain step) or the verify block k of a round."""
        if self.ahead:                  # decided by the plan of an earlier plain step
            self.ahead -= 1
            return 0
        self.catch_up()
        if not self.costs.timed(0):
            k, reason = 0, "plain_untimed"
        else:
            seconds, tokens = self.seconds(), self.tokens()
            k, reason = self.choose(tokens, seconds), None
            if self.last and not k:                 # rounds -> plain: would the costs of the last decision still
                reason = "to_plain_costs" if self.choose(tokens, self.basis) else "to_plain_acceptance"   # take rounds?
            elif k and self.last == 0:
                reason = ("to_rounds_admission" if self.admitted else "to_rounds_shadow" if self.shadowed
                          else "to_rounds_aging")
            if k:       # (only a switch from rounds reads it; seconds() makes a new dict when the costs change)
                self.basis = seconds
            else:
                self.ahead = self.plan(seconds)
        self.probe = reason == "to_rounds_aging"
        if reason:
            self.counts[reason] += 1
        self.last, self.admitted, self.shadowed = k, False, False
        return k

    def observe_round(self, committed: list, k: int, seconds: float) -> None:
        """A round of k took `seconds`; committed[b]: the tokens slot b committed (None: a free slot)."""
        self.costs.add(k, seconds)
        self.counts["rounds"] += 1
        tokens = sum(c for c in committed if c is not None)
        if tokens * self.costs.seconds(0) >= seconds * max(1, len(self.live)):     # it paid: probe at the budget
            self.rate = self.budget
        elif self.probe:                                                        # a probe that lost: half as often
            self.rate = max(self.rate / 2, self.budget / 8)
        for b, c in enumerate(committed):
            if c is not None:
                self.rows.add_round(b, k, c)
        self.after_round = k

    def observe_plain(self, seconds: float) -> None:
        """A plain step's seconds. The first after a round also carries the round's verify features into the drafter's
        context: its seconds beyond a plain step's are the switch's cost, charged to that round's timing."""
        if self.after_round and self.costs.timed(0):
            self.costs.charge(self.after_round, max(0.0, seconds - self.costs.seconds(0)))
        elif not self.after_round:
            self.costs.add(0, seconds)
        self.counts["plain_steps"] += 1
        self.aged += 1                  # (its aging: catch_up, at the next decision)
        self.after_round = None

    def shadow(self) -> int:
        """At a hand-over of the drafter's context during plain steps: the block K of a shadow draft to take with it
        (engine.Shadows: the plain steps after it judge its proposals, the evidence of a round of K for the price of a
        draft), every SHADOW_EVERY-th hand-over, or 0."""
        if self.last != 0 or self.blocks[0] < 2 or not SHADOW_EVERY:        # (a block of 1 drafts nothing)
            return 0
        self.hand_overs += 1
        if self.hand_overs % SHADOW_EVERY:
            return 0
        self.counts["shadow_drafts"] += 1
        return self.blocks[0]

    def observe_shadow(self, b: int, k: int, committed: int) -> None:
        """Slot b's shadow draft of k judged: a round of k there would have committed `committed` tokens. Evidence as
        a round's (the rule is asked again at the next step)."""
        self.catch_up()
        self.rows.add_round(b, k, committed)
        self.ahead, self.shadowed = 0, True

    def probe_loss(self) -> float:
        """What a probe round is expected to lose, in plain steps per live row, on the rows' evidence alone (which
        aging leaves as it is: recomputed when a round, an admission, a departure or a timing changes its inputs):
        the best block's seconds in plain steps, less the tokens per row it would commit."""
        versions = (self.costs.version, self.rows.version, len(self.live))
        if self.loss is None or self.loss[0] != versions:
            seconds, n, tokens = self.seconds(), max(1, len(self.live)), self.tokens(0)
            k = max(self.blocks, key=lambda j: tokens[j] / seconds[j])
            self.loss = (versions, seconds[k] / seconds[0] - tokens[k] / n)
        return self.loss[1]

    def leave(self, b: int) -> None:
        """Slot b's request finished (the rule is asked at the next step)."""
        self.catch_up()
        self.live.discard(b)
        self.ahead = 0


class Scripted:
    """The protocol an Engine calls its policy by, each observation ignored: a policy whose steps follow a script of
    its own, not what it observes. A subclass gives `blocks` (the verify blocks it may take, longest first) and
    speculate() (0 or the block of a round), and overrides the observations it reads. Optional, looked up by the
    Engine: shadow() and observe_shadow() (shadow drafts), calibrate() (the cached step costs), counts."""
    blocks: tuple = ()

    def reset(self) -> None:
        """A run starts."""

    def speculate(self) -> int:
        raise NotImplementedError

    def admit(self, b: int) -> None:
        """A request admitted into slot b."""

    def leave(self, b: int) -> None:
        """Slot b's request finished."""

    def observe_round(self, committed: list, k: int, seconds: float) -> None:
        """A round of k took `seconds`; committed[b]: the tokens slot b committed (None: a free slot)."""

    def observe_plain(self, seconds: float) -> None:
        """A plain step took `seconds`."""


class Alternate(Scripted):
    """A plain step and a round of each block in `blocks`, in turn: a warm-up that compiles every step kind a Policy
    may take, and times them (medians: {k: seconds}, 0 a plain step; the first plain step after a round is no plain
    step's sample, as in Policy, and charges nothing: the rounds here mostly follow rounds)."""

    def __init__(self, blocks: tuple):
        self.cycle = [0, 0, *blocks]
        self.blocks, self.steps = tuple(blocks), 0
        self.times = collections.defaultdict(list)
        self.after_round = False

    def reset(self) -> None:
        self.steps = 0

    def speculate(self) -> int:
        self.steps += 1
        return self.cycle[(self.steps - 1) % len(self.cycle)]

    def observe_round(self, committed: list, k: int, seconds: float) -> None:
        self.times[k].append(seconds)
        self.after_round = True

    def observe_plain(self, seconds: float) -> None:
        if not self.after_round:
            self.times[0].append(seconds)
        self.after_round = False

    def medians(self) -> dict:
        return {k: statistics.median(t) for k, t in self.times.items() if t}


class PerRun:
    """A policy that starts over for every run of the Engine: make() -> a new policy at each reset(), as each
    generate.py process starts its own (a benchmark's single requests, each timed as its own run), calibrated
    alike."""

    def __init__(self, make):
        self.make, self.calibration = make, None
        self.inner = make()
        self.blocks = self.inner.blocks

    def calibrate(self, calibration: dict | None) -> None:
        self.calibration = calibration
        self.inner.calibrate(calibration)

    def reset(self) -> None:
        self.inner = self.make()
        if self.calibration is not None:
            self.inner.calibrate(self.calibration)
        self.inner.reset()

    @property
    def counts(self):
        return self.inner.counts

    def __getattr__(self, name):        # admit, speculate, observe_round, observe_plain, leave
        return getattr(self.__dict__["inner"], name)


def costs_path() -> str:
    """The file of measured step seconds, in inductor's cache folder (compiling.cache_folder)."""
    import compiling
    return os.path.join(compiling.cache_folder(), "dflash_fast_step_costs.json")


def load_costs(key: str) -> dict | None:
    """The step seconds cached under `key` ({k: seconds}), or None."""
    import compiling
    found = compiling.read_record(costs_path()).get(key)
    return None if found is None else {int(k): float(s) for k, s in found.items()}


def store_costs(key: str, costs: dict) -> None:
    import compiling
    path = costs_path()
    saved = compiling.read_record(path)
    saved[key] = {str(k): s for k, s in costs.items()}
    compiling.write_record(path, saved)


def shadow_verdict(k: int, confirmed: int, refused: bool) -> tuple | None:
    """A shadow draft of k (k - 1 proposals), `confirmed` of them confirmed by the plain steps so far, the latest
    refused or not -> (K, the tokens a round of K there would have committed) once it is reported, else None: at a
    refused proposal or the last one confirmed, a round of k; as soon as SHADOW_SURE are confirmed (and more
    remain), a round of SHADOW_SURE + 1 that committed its whole block (read as a round's whole block is,
    Rows.censored), while the stretch that drafts well lasts. engine.Shadows and tools/policy_sim.py judge by it."""
    if refused or confirmed == k - 1:
        return k, confirmed + 1             # the confirmed proposals, and the target's own token after them
    if confirmed == SHADOW_SURE:
        return confirmed + 1, confirmed + 1
    return None


def counts_of(policy) -> dict | None:
    """A policy's counts for its last run ({"rounds", "plain_steps", "shadow_drafts", and one per switch reason in
    REASONS}), or None (no adaptive policy)."""
    counts = getattr(policy, "counts", None)
    return None if counts is None else {k: int(counts[k]) for k in ("rounds", "plain_steps", "shadow_drafts", *REASONS)}


def describe(counts: dict) -> str:
    """The counts in words, for a statistics line: "policy: R rounds, P plain steps, S shadow drafts; switches:
    <reason> <n>, ..." with each nonzero reason (to plain steps: acceptance, costs; to rounds: admission, shadow,
    aging; untimed: plain steps taken to time one), or "no switch"."""
    return (f"policy: {counts['rounds']} rounds, {counts['plain_steps']} plain steps, {counts['shadow_drafts']} shadow "
            f"drafts; {switches(counts)}")


def switches(counts: dict) -> str:
    """describe's switches: "switches: <reason> <n>, ..." with each nonzero reason, or "no switch"."""
    reasons = ", ".join(f"{k.split('_', 2)[-1]} {counts[k]}" for k in REASONS if counts[k])
    return f"switches: {reasons}" if reasons else "no switch"