"""Adaptive speculation: before each step of the engine, a round (and its verify block k) or a plain step.

The rule. A round of k is worth gain(k) = tokens(k) x plain seconds / round seconds(k) plain steps, where tokens(k)
is what recent rounds committed per live row (a round of K also tells what a round of any k <= K would have
committed: min(committed, k)) and both seconds are medians timed over the same stretch of steps (Costs). Rounds use
the best k and go on while its gain >= 1; after plain steps they come back when it reaches 1 + `margin`. The first
rounds go on whatever they commit until their acceptance holds `opening` rows (16: sixteen rounds of one request,
two of eight), unless even a whole block accepted could not pay. Rounds verify the whole block until the
acceptance holds `min_samples` rows and the best block's gain is below 1 + `margin`; from then on the shorter
blocks are timed too (`min_rounds` times each). While rounds lose, a probe round re-measures the acceptance every
`wait` plain steps, the wait keeping the probes' loss under `budget` of the time. Rounds are given up for the
rest of the run (`feeds` False: plain steps no longer keep features for the drafter's context, so they cost exactly
AR's) when one of these holds once every block is timed `min_rounds` times:
  - even a whole block accepted could not pay at any k (k x plain / round(k) < 1 - margin);
  - `patience` probes in a row lost by more than the margin, or probes in a row near break-even stalled (4 x
    `patience` of them, or `patience` holding 4 x `min_samples` rows) over at least `max_wait` plain steps or
    `settle` seconds, once they hold `min_samples` rows;
  - the ledger (what rounds saved over plain steps, less the drafter's upkeep outside rounds) is below 0 after
    2 x `explore` rounds holding 8 x `min_samples` rows.
A later run (new requests, whose acceptance may differ) feeds the drafter's context again and takes one revival
probe after `first_wait` plain steps, judged on its own acceptance with the kept timings: rounds come back if it
pays by the margin, else they stay given up for that run too. Revivals keep to a budget of their own,
`revival_budget` (a quarter of the probes'): a run revives only once the plain steps since rounds were given up
(counted across runs) reach the last revival's loss / revival_budget, its loss in plain steps being what it cost
over AR's steps (its fed admissions and plain steps, its round) less the tokens it committed; after a verdict
within a run, the loss its last round would take as a probe. A revival costs more than a probe (it feeds the
drafter's context again) and asks a vaguer question (whether new texts draft better), and where rounds lose it is
all DFlash loses to AR.
The output never depends on any of this: every kind of step commits the target's own tokens. Why each part is
there, with the measurements behind it: docs/method.md#adaptive-speculation.

    Costs      each step kind's measured seconds and each block's tokens per row: gain(k), best()
    Policy     the decisions: speculate() -> 0 (a plain step) or k; observe_round / observe_plain / observe_upkeep
    Alternate  a warm-up cycle through every step kind a Policy may take (compiles them all)
    PerRun     a fresh policy for every run (a benchmark's single requests, each as its own generate.py run)
"""
from __future__ import annotations

import collections
import statistics

from model import GenerationError


def verify_blocks(block: int) -> tuple:
    """The verify blocks a Policy chooses among by default: the whole block, then halved down to 2 (16: 16, 8, 4, 2)."""
    out = [block]
    while out[-1] // 2 >= 2:
        out.append(out[-1] // 2)
    return tuple(out)


class Costs:
    """Measured step seconds (the last 4 x window of each kind, each with the index of its step) and the tokens per
    live row of the last `window` rounds, per verify block in `blocks`."""

    def __init__(self, blocks: tuple, window: int):
        self.blocks = blocks
        self.seconds = {k: collections.deque(maxlen=4 * window) for k in blocks}     # per round of k
        self.seconds_at = {k: collections.deque(maxlen=4 * window) for k in blocks}
        self.plain, self.plain_at = collections.deque(maxlen=4 * window), collections.deque(maxlen=4 * window)
        self.tokens = {k: collections.deque(maxlen=window) for k in blocks}    # per row, per round of >= k
        self.count, self._memo = 0, {}          # steps observed; costs(k) until the next sample

    def add_round(self, k: int, committed: list, seconds: float) -> None:
        """A round that verified k tokens per row and committed `committed` tokens in its live rows."""
        self.seconds[k].append(seconds)
        self.seconds_at[k].append(self.count)
        self.count += 1
        self._memo.pop(k, None)
        for j in self.blocks:
            if j <= k:          # what a round of j would have committed per row: min(committed, j)
                self.tokens[j].append(statistics.fmean(min(c, j) for c in committed))

    def add_plain(self, seconds: float) -> None:
        self.plain.append(seconds)
        self.plain_at.append(self.count)
        self._memo.clear()

    def add_to_last_round(self, k: int, seconds: float) -> None:
        self.seconds[k][-1] += seconds
        self._memo.pop(k, None)

    def costs(self, k: int) -> tuple:
        """(plain step seconds, round-of-k seconds): the medians of each over the same stretch of steps, the stretch
        both kept samples span (but at least the last 3 of each): a shared machine's speed drifts by tens of percent
        within seconds, and the sparse kind's samples reach far back."""
        if k not in self._memo:
            plain_at, round_at = self.plain_at, self.seconds_at[k]
            start = min(max(plain_at[0], round_at[0]), plain_at[-min(3, len(plain_at))], round_at[-min(3, len(round_at))])
            self._memo[k] = (statistics.median(s for i, s in zip(plain_at, self.plain) if i >= start),
                             statistics.median(s for i, s in zip(round_at, self.seconds[k]) if i >= start))
        return self._memo[k]

    def gain(self, k: int) -> float:
        """Plain steps a round of k is worth: its mean tokens per row x plain seconds / its seconds."""
        plain_s, round_s = self.costs(k)
        return statistics.fmean(self.tokens[k]) * plain_s / round_s

    def best(self) -> int:
        """The block whose round is worth the most plain steps, among those timed."""
        return max((k for k in self.blocks if self.seconds[k] and self.tokens[k]), key=self.gain)

    def least_timed(self) -> int:
        """The block timed the fewest times (the longest among equals: a round of the whole block measures every
        block's acceptance)."""
        return min(self.blocks, key=lambda j: len(self.seconds[j]))

    def timed(self, times: int) -> bool:
        return all(len(self.seconds[k]) >= times for k in self.blocks)

    def full_block_gain(self) -> float:
        """What a whole block accepted would be worth at the best k, in plain steps."""
        return max(j * self.costs(j)[0] / self.costs(j)[1] for j in self.blocks if self.seconds[j])


class Policy:
    """Adaptive speculation for a batch (the module docstring states the rule). speculate() -> 0 or the verify block
    of a round; the engine reports each step's seconds back (observe_round, observe_plain) and the drafter's upkeep
    outside rounds (observe_upkeep). Timings carry over from one run of the Engine to the next (the costs depend on
    N, which an Engine fixes); a verdict that gave rounds up lasts for its run, and the next run starts with a
    revival probe (reset)."""

    def __init__(self, window: int = 16, first_wait: int = 4, max_wait: int = 512, budget: float = 0.02,
                 margin: float = 0.1, block: int = 16, min_rounds: int = 3, patience: int = 4,
                 blocks: tuple | None = None, explore: int = 16, min_samples: int = 32, first_plain: int = 3,
                 settle: float = 2.0, opening: int = 16, retime: float = 0.1, revival_budget: float = 0.005):
        self.first_wait, self.max_wait, self.budget, self.margin = first_wait, max_wait, budget, margin
        self.revival_budget = revival_budget
        self.opening = opening
        self.settle, self.first_plain, self.retime = settle, first_plain, retime
        self.min_rounds, self.patience, self.explore, self.min_samples = min_rounds, patience, explore, min_samples
        self.blocks = tuple(sorted(set(blocks or verify_blocks(block)), reverse=True))     # longest first
        if self.blocks[-1] < 1 or self.blocks[0] > block:
            raise GenerationError(f"policy blocks {self.blocks} must lie in 1..{block}")
        self.costs = Costs(self.blocks, window)
        self.feeds = True                                   # plain steps keep features for the drafter's context
        self._count_verdicts_afresh()
        self.k = self.last_k = self.blocks[0]               # the block of the next round; of the last one
        self.rounds = self.rows_seen = 0                    # rounds observed, and the live rows they held
        self.since, self.next_probe = 0, 0                  # plain steps since the last round (across runs while
        #                                                     rounds stay given up); when to probe
        self.streak, self.streak_seconds = 0, 0.0           # rounds since the last plain step, and their seconds
        self.retiming = False                               # the next step is a plain step, timed (observe_plain)
        self.shortening = False                             # shorter blocks than the whole are being timed
        self.reviving = False                               # the next round is a revival probe (reset)
        self.revival_seconds, self.revival_steps = 0.0, 0   # a revival's seconds and plain steps so far (reset)
        self.revive_after = 0                               # plain steps since rounds were given up before a run
        #                                                     revives them

    def reset(self) -> None:
        """A new run of requests (the timings are kept). If rounds were given up at least `revive_after` plain steps
        ago, the run feeds the drafter's context again and probes once after `first_wait` plain steps, on acceptance
        measured afresh (the old rounds' tokens are the old texts'); every verdict's count starts over. If not, they
        stay given up for this run too, and its plain steps go on counting in `since`."""
        if not self.feeds and self.since < self.revive_after:
            return
        self.since = 0
        if not self.feeds:
            self.feeds, self.reviving, self.next_probe = True, True, self.first_wait
            self.revival_seconds, self.revival_steps = 0.0, 0
            for tokens in self.costs.tokens.values():
                tokens.clear()
            self._count_verdicts_afresh()

    def _count_verdicts_afresh(self) -> None:
        """What the verdicts count (_judge), from zero."""
        self.losing = 0                                     # probes in a row that lost by more than the margin
        self.stalled = self.stalled_rows = 0                # probes in a row that did not bring rounds back; their rows
        self.stalled_steps, self.stalled_seconds = 0, 0.0   # and the plain steps between them, and their seconds
        self.ledger, self.ledger_rows, self.ledger_rounds = 0.0, 0, 0    # seconds saved, from when all are timed

    def timed(self) -> bool:
        """Every block's round timed `min_rounds` times: no verdict rests on one timing of a shared machine."""
        return self.costs.timed(self.min_rounds)

    def speculate(self) -> int:
        """0 (a plain step) or the verify block k of a round."""
        if len(self.costs.plain) < self.first_plain or self._due() or self.retiming:
            return 0            # plain steps time one: the first ones, and two after a long run of rounds (_due)
        if not self.feeds:
            return 0
        if not self.costs.seconds[self.blocks[0]]:
            return self.blocks[0]       # the whole block first: its rounds measure every block's acceptance
        return self.k if self.since >= self.next_probe else 0

    def observe_round(self, committed: list, k: int, seconds: float) -> None:
        """A round of k took `seconds` and committed `committed` tokens in each live row."""
        committed = committed or [1]
        self.last_k = k
        self.costs.add_round(k, committed, seconds)
        speculating = self.rounds > 0 and self.next_probe == 0     # rounds were on (not a probe after plain steps)
        waited = self.since                                        # plain steps before this round
        self.since, self.rounds, self.streak = 0, self.rounds + 1, self.streak + 1
        self.streak_seconds += seconds
        self.rows_seen += len(committed)
        if not self.costs.plain:
            self.next_probe = 0
            return
        if self.timed():
            self.ledger += statistics.fmean(committed) * self.costs.costs(k)[0] - seconds
            self.ledger_rows, self.ledger_rounds = self.ledger_rows + len(committed), self.ledger_rounds + 1
        best = self.costs.best()
        gain, tokens = self.costs.gain(best), statistics.fmean(self.costs.tokens[best])
        # Shorter blocks are timed from when the acceptance holds min_samples rows and the best block does not pay
        # by the margin: until then (a text's first rounds are its worst, and a round's acceptance says little:
        # most commit a few tokens, a few the whole block) every round verifies the whole block, which measures
        # the acceptance of every block. Each timing of a shorter block costs a round that commits at most its k.
        self.shortening = self.shortening or (self.rows_seen >= self.min_samples and gain < 1 + self.margin)
        self.next_probe = 0 if gain >= (1 if speculating else 1 + self.margin) else self.wait(gain, tokens)
        if self.next_probe and (self.rows_seen < self.min_samples or not self.timed()):
            self.next_probe = self.first_wait       # too few rows, or blocks timed too few times: probe again soon
        if self.rows_seen < self.opening and self.costs.full_block_gain() >= 1 - self.margin:
            self.next_probe = 0     # the opening: rounds go on until their acceptance holds `opening` rows
        self.k = self._next_block(best, explore=self.next_probe > 0 or self.rounds % self.explore == 0)
        if self.reviving:       # a revival probe that did not pay by the margin: given up for this run too
            self.reviving, self.feeds = False, self.next_probe == 0
            if not self.feeds:  # its loss: what the revival cost over AR's steps, less what it committed
                spent = self.revival_seconds + seconds
                self._gave_up(spent / self.costs.costs(k)[0] - self.revival_steps - statistics.fmean(committed))
            return
        self._judge(gain, len(committed), waited)
        if not self.feeds:
            self._gave_up(self._loss(gain, tokens))

    def observe_plain(self, seconds: float) -> None:
        """A plain step's seconds. The first after a round also carries the round's verify features into the drafter's
        context, a cost of switching: it is not a plain step's sample, and its extra over one is the last round's.
        When a plain step is due (`_due`) that first step is followed by one more plain step, which is timed."""
        if self.streak == 0:
            self.costs.add_plain(seconds)
        elif self.costs.plain and self.costs.seconds[self.last_k]:
            extra = max(0.0, seconds - self.costs.costs(self.last_k)[0])
            self.costs.add_to_last_round(self.last_k, extra)
            if self.timed():
                self.ledger -= extra
        self.costs.count += 1            # every step counts, so that stretches of steps line up
        if self.reviving:
            self.revival_seconds, self.revival_steps = self.revival_seconds + seconds, self.revival_steps + 1
        self.retiming = self._due()
        self.since, self.streak, self.streak_seconds = self.since + 1, 0, 0.0

    def _due(self) -> bool:
        """A plain step is due to be timed again: `explore` rounds in a row that took `retime` seconds together. The
        plain step's time drifts with the machine's speed over seconds, not over a count of rounds: a count alone
        would cost a short generation of fast rounds two plain steps of its twenty."""
        return self.streak >= self.explore and self.streak_seconds >= self.retime

    def observe_upkeep(self, seconds: float) -> None:
        """Seconds the drafter's context cost outside rounds (a full run of plain steps' features appended, an admitted
        prompt's), charged to the ledger, and to a revival's loss while one runs."""
        if self.reviving:
            self.revival_seconds += seconds
        if self.timed():
            self.ledger -= seconds

    def _loss(self, gain: float, tokens: float) -> float:
        """What a probe round loses, in plain steps: its cost in plain steps, minus its tokens per row."""
        return tokens / gain - tokens if gain > 0 else self.max_wait

    def wait(self, gain: float, tokens: float) -> int:
        """Plain steps before the next probe: a probe's loss over the wait stays within `budget`."""
        return int(min(self.max_wait, max(self.first_wait, self._loss(gain, tokens) / self.budget)))

    def _gave_up(self, loss: float) -> None:
        """Rounds given up (by a verdict, or a revival probe that did not pay), a revival having lost `loss` plain
        steps: a later run revives them once `loss / revival_budget` plain steps have passed since this round
        (reset; `since` counts them)."""
        self.revive_after = int(max(self.first_wait, loss / self.revival_budget))

    def _next_block(self, best: int, explore: bool) -> int:
        """The best block, or when exploring a block timed fewer than `min_rounds` times (once shorter blocks are
        timed at all: `shortening`), else (while rounds go on, and on every other probe) the next longer block than
        the best, whose acceptance a round of best cannot show."""
        if not explore:
            return best
        fewest = self.costs.least_timed()
        if self.shortening and len(self.costs.seconds[fewest]) < self.min_rounds:
            return fewest
        longer = [j for j in self.blocks if j > best]
        return longer[-1] if longer and (self.next_probe == 0 or self.rounds % 2) else best

    def _judge(self, gain: float, rows: int, waited: int) -> None:
        """After a round: whether rounds are given up for the rest of the run (the module docstring's three verdicts)."""
        timed = self.timed()
        counts = timed and self.rows_seen > self.min_samples
        self.losing = self.losing + 1 if gain < 1 - self.margin and counts else 0
        if self.next_probe > 0 and counts:                  # a probe that did not bring rounds back
            self.stalled, self.stalled_rows = self.stalled + 1, self.stalled_rows + rows
            self.stalled_steps += waited
            self.stalled_seconds += waited * statistics.median(self.costs.plain)
        else:
            self.stalled = self.stalled_rows = self.stalled_steps = self.stalled_seconds = 0
        spread = self.stalled_steps >= self.max_wait or self.stalled_seconds >= self.settle    # not a noisy moment
        enough = self.stalled >= 4 * self.patience or (self.stalled >= self.patience and
                                                       self.stalled_rows >= 4 * self.min_samples)
        if self.stalled_rows >= self.min_samples and (self.losing >= self.patience or (enough and spread)):
            self.feeds = False
        if self.ledger < 0 and self.ledger_rounds >= 2 * self.explore and self.ledger_rows >= 8 * self.min_samples:
            self.feeds = False
        if self.costs.full_block_gain() < 1 - self.margin:  # not even a whole block accepted could pay
            if timed:
                self.feeds = False
            else:
                self.next_probe = min(self.next_probe, self.first_wait)   # re-time soon rather than after a long wait


class Alternate:
    """A plain step, a round of each block in `blocks`, and a plain step without feeding the drafter, in turn: a
    warm-up that compiles every step kind a Policy may take."""

    def __init__(self, blocks: tuple):
        self.cycle = [0, *blocks, None]          # None: a plain step that does not feed the drafter's context
        self.blocks, self.steps, self.feeds = tuple(blocks), 0, True

    def reset(self) -> None:
        self.steps, self.feeds = 0, True

    def speculate(self) -> int:
        kind = self.cycle[self.steps % len(self.cycle)]
        self.steps += 1
        self.feeds = kind is not None
        return kind or 0

    def observe_round(self, committed: list, k: int, seconds: float) -> None:
        pass

    def observe_plain(self, seconds: float) -> None:
        pass

    def observe_upkeep(self, seconds: float) -> None:
        pass


class PerRun:
    """A policy that starts over for every run of the Engine: make() -> a new policy at each reset(), as each
    generate.py process starts its own (a benchmark's single requests, each timed as its own run)."""

    def __init__(self, make):
        self.make = make
        self.inner = make()
        self.blocks = self.inner.blocks

    @property
    def feeds(self) -> bool:
        return self.inner.feeds

    def reset(self) -> None:
        self.inner = self.make()

    def speculate(self) -> int:
        return self.inner.speculate()

    def observe_round(self, committed: list, k: int, seconds: float) -> None:
        self.inner.observe_round(committed, k, seconds)

    def observe_plain(self, seconds: float) -> None:
        self.inner.observe_plain(seconds)

    def observe_upkeep(self, seconds: float) -> None:
        self.inner.observe_upkeep(seconds)
