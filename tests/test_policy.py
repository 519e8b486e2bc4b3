"""Adaptive speculation (policy.py): the Policy's decisions on scripted costs, observed as plain data (the tokens each
live row committed, the seconds of each step kind, the drafter's upkeep); on the Engine and through generate.py the
output is AR's whichever steps it takes. And the default draft window: from the drafter's config, the flag
overriding it."""
import json
import random
import statistics

import pytest
import torch

import checkpoint as ckpt
import dflash
import engine
import generate
import prompts
from helpers import embedded_pair, HAS_EMBEDDED_PAIR, kind_draft_config, random_drafter, random_target, tiny_target_config
from policy import Policy, verify_blocks

pytestmark = pytest.mark.usefixtures("one_thread")      # tiny eager models: one thread (conftest.py)


def drive(policy, steps, round_s, tokens, plain_s=0.001, rows=4, blocks=None):
    """`steps` steps under the policy: a round of k commits min(`tokens`, k) in each of `rows` live rows in round_s
    (seconds, or a function of k), a plain step 1 in plain_s (seconds, or a function of whether a round came just
    before) -> the steps as a string (R round, . plain step); each round's k is appended to `blocks` when given."""
    out = ""
    for _ in range(steps):
        seconds = plain_s(out.endswith("R")) if callable(plain_s) else plain_s
        k = policy.speculate()
        if k:
            out += "R"
            if blocks is not None:
                blocks.append(k)
            policy.observe_round([min(tokens, k)] * rows, k, round_s(k) if callable(round_s) else round_s)
        else:
            out += "."
            policy.observe_plain(seconds)
    return out


def test_policy_rounds_while_they_pay_and_probes_rarely_when_they_lose():
    """One verify block (blocks=(16,)): rounds or plain steps, from the measured costs (no opening: these are the
    decisions after it, test_policy_opening_rounds_go_on_until_their_rows_are_in)."""
    p = Policy(opening=0, block=16, blocks=(16,))
    assert drive(p, 40, round_s=0.004, tokens=6) == "..." + "R" * 25 + ".." + "R" * 10   # 6 tokens for 4 plain
    # steps: rounds, with two plain steps after each 16 or more that took 0.1 s (`retime`: here 25; the second
    # re-times a plain step, the first after a round also carries the round's features into the drafter's context)
    p = Policy(opening=0, block=16, blocks=(16,), retime=0.05)
    assert drive(p, 40, round_s=0.004, tokens=6) == "..." + ("R" * 16 + "..") * 2 + "R"   # 16 rounds take 0.064 s
    p = Policy(opening=0, block=16, blocks=(16,))
    kinds = drive(p, 400, round_s=0.010, tokens=6, rows=8)                      # 6 tokens for 10 plain steps: loses
    assert kinds.startswith("...R.") and kinds.count("R") <= 8 and p.feeds      # probes, a few; a full block could pay
    waits = [len(w) for w in kinds.split("R")[1:-1]]                            # every 4 steps until 32 rows' acceptance
    assert waits[:3] == [4, 4, 4] and min(waits[3:]) >= 100                     # is in (4 rounds of 8), then a 4-step
    #                                                                             loss each: waits of 200
    kinds += drive(p, 1600, round_s=0.010, tokens=6, rows=8)
    assert kinds.count("R") == 8 and not p.feeds and kinds.endswith("." * 500)  # timed 3 times and 32 rows seen: 4
    #                                                                             losing probes: given up
    p = Policy(opening=0, block=16, blocks=(16,))
    kinds = drive(p, 1200, round_s=0.0065, tokens=6)              # losing within the margin: probes every 4 steps for
    assert kinds.count("R") == 29 and not p.feeds and kinds.endswith("." * 500)   # 32 rows, then every 26: given up
    #                                                                               when 16 in a row span 512 steps
    p = Policy(opening=0, block=16, blocks=(16,))
    kinds = drive(p, 1200, round_s=0.0057, tokens=6, rows=1)      # gain 1.05, one row: short of 1.1; probes every
    assert kinds.count("R") == 160 and not p.feeds                # 5 steps, given up once they span 512 plain steps
    p = Policy(opening=0, block=16, blocks=(16,))
    assert drive(p, 1200, round_s=0.0065, tokens=6, rows=1).count("R") == 64 and not p.feeds   # losing, one row: 32
    #                         probes at 4-step waits (they never count to give up), then 32 more spanning 512 steps
    p = Policy(opening=0, block=16, blocks=(16,))
    assert drive(p, 600, round_s=0.005, tokens=6, rows=1).count(".") < 80 and p.feeds          # paying, one row
    p = Policy(opening=0, block=16, blocks=(16,))
    kinds = drive(p, 300, round_s=0.020, tokens=15)                             # 20 plain steps a round: never pays
    assert kinds.count("R") == 3 and not p.feeds and kinds.endswith("." * 200)  # given up, the context unfed
    p = Policy(opening=0, block=16, blocks=(16,))      # one row whose first round commits 1 token (a text's first rounds
    assert drive(p, 4, round_s=0.005, tokens=1, rows=1) == "...R"       # are its worst): a probe again after 4 plain
    kinds = drive(p, 60, round_s=0.005, tokens=6, rows=1)                           # steps, not after 200, and rounds
    assert kinds.startswith("....R") and "RRR" in kinds                               # again once the mean pays


def test_policy_opening_rounds_go_on_until_their_rows_are_in():
    """A text's first rounds are its worst: rounds go on whatever they commit until their acceptance holds 16 rows
    (sixteen rounds of one row, two of eight), then the rule decides; not when even a whole block accepted could
    not pay (20 plain steps a round)."""
    p = Policy(block=16, blocks=(16,))
    kinds = drive(p, 60, round_s=0.005, tokens=1, rows=1)          # 1 token for 5 plain steps: loses
    assert kinds == "..." + "R" * 16 + "....R" * 8 + "."          # then quick probes until 32 rows are in
    p = Policy(block=16, blocks=(16,))
    assert drive(p, 10, round_s=0.005, tokens=1, rows=8).startswith("...RR.")
    p = Policy(block=16, blocks=(16,))
    assert drive(p, 10, round_s=0.020, tokens=15, rows=1).startswith("...R.")
    p = Policy(block=16, blocks=(16,))                               # one row whose first rounds commit 1 token,
    kinds = drive(p, 10, round_s=0.005, tokens=1, rows=1)            # then the text turns easy: rounds go on
    kinds += drive(p, 60, round_s=0.005, tokens=12, rows=1)         # (two plain steps after every 0.1 s of
    assert kinds == "..." + ("R" * 20 + "..") * 3 + "R"              # rounds: re-timing)


def test_policy_gives_rounds_up_when_they_do_not_pay_for_the_drafters_upkeep():
    """Rounds worth 1.13 plain steps (6 tokens per row in 5.3 ms, a plain step 1 ms) save 0.7 ms each; the
    drafter's upkeep outside rounds (observe_upkeep: appends, admitted prompts) charged 0.9 ms per step outweighs
    that, and the ledger ends rounds once 32 rounds of 8 rows are counted; at 0.3 ms per step rounds go on."""
    def run(upkeep):
        p, kinds = Policy(block=16, blocks=(16,)), ""
        for _ in range(400):
            kinds += drive(p, 1, round_s=0.0053, tokens=6, rows=8)
            p.observe_upkeep(upkeep)
        return p, kinds
    p, kinds = run(0.0003)
    assert p.feeds and p.ledger > 0 and kinds.count("R") > 300
    p, kinds = run(0.0009)
    assert not p.feeds and p.ledger < 0 and p.ledger_rounds >= 32 and kinds.count("R") < 60
    assert kinds.endswith("." * 300)


def test_policy_gives_rounds_up_for_a_run_and_probes_once_in_the_next():
    """A verdict lasts for its run (Engine.run). The next run (Policy.reset: new texts), once its revival is due
    (test_policy_spaces_revivals_across_runs_by_their_loss; here the runs are long enough), feeds the drafter's
    context again and probes once after `first_wait` plain steps, judged on that probe's own acceptance with the
    kept timings: rounds come back if it pays by the margin, else they stay given up for that run too."""
    p = Policy(opening=0, block=16, blocks=(16,))
    kinds = drive(p, 3000, round_s=0.010, tokens=6, rows=8)                     # 0.6 plain steps a round: given up
    assert not p.feeds and kinds.endswith("." * 1000)
    rounds_before = kinds.count("R")
    p.reset()
    assert p.feeds                                          # the run's admissions feed the drafter's context again
    assert drive(p, 900, round_s=0.010, tokens=6, rows=8) == "....R" + "." * 895    # one probe, still losing
    assert not p.feeds and list(p.costs.tokens[16]) == [6]                           # (judged on its own acceptance)
    p.reset()
    kinds = drive(p, 300, round_s=0.010, tokens=14, rows=8)                   # the new texts are easy: 1.4 plain steps
    assert kinds.startswith("....RRRR") and kinds.count("R") > 250 and p.feeds
    assert p.ledger_rounds == kinds.count("R") < kinds.count("R") + rounds_before   # every verdict's count started over
    p = Policy(opening=0, block=16, blocks=(16,))
    drive(p, 1100, round_s=0.020, tokens=15)                                 # 20 plain steps a round: never pays
    assert not p.feeds
    p.reset()
    assert drive(p, 100, round_s=0.020, tokens=15) == "....R" + "." * 95 and not p.feeds


def test_policy_spaces_revivals_across_runs_by_their_loss():
    """Revivals keep to their budget (`revival_budget`, 0.5% of the steps): a run revives rounds only once the plain
    steps since they were given up, counted across runs, reach the last revival's loss / revival_budget. Its loss:
    what it cost over AR's steps (here the admissions' context, 6 plain steps' worth, four fed plain steps and its
    round), less what it committed; after a verdict within a run, what its last round loses as a probe."""
    p = Policy(opening=0, block=16, blocks=(16,))
    kinds = drive(p, 3000, round_s=0.010, tokens=6, rows=8)          # a round: 10 plain steps for 6 tokens
    assert not p.feeds and p.revive_after == 800                      # loss 4 / 0.005
    assert p.since == len(kinds) - len(kinds.rstrip(".")) >= 800
    p.reset()
    assert p.feeds                                                    # since >= 800: this run revives
    p.observe_upkeep(0.006)                                           # the admitted prompts' context
    assert drive(p, 100, round_s=0.010, tokens=6, rows=8) == "....R" + "." * 95 and not p.feeds
    assert p.revive_after == 2000                                     # ((6 + 4 + 10) ms / 1 ms - 4 - 6) / 0.005
    runs = []
    for _ in range(25):                                               # runs of 100 steps: the next revival after
        p.reset()                                                     # 95 + 20 x 100 plain steps, none before
        runs.append(drive(p, 100, round_s=0.010, tokens=6, rows=8))
    assert runs[:20] == ["." * 100] * 20 and runs[20] == "....R" + "." * 95 and not p.feeds
    assert "".join(runs[21:]).count("R") == 0
    drive(p, p.revive_after - p.since, round_s=0.010, tokens=6, rows=8)    # (plain steps until the next is due)
    p.reset()                                                         # a revival at break-even (10 tokens for a
    assert p.feeds                                                    # round of 10 plain steps): short of the
    assert drive(p, 100, round_s=0.010, tokens=10, rows=8) == "....R" + "." * 95    # margin, it lost nothing: the
    assert not p.feeds and p.revive_after == p.first_wait             # next run revives again (after at least
    p.reset()                                                         # `first_wait` plain steps)
    assert drive(p, 5, round_s=0.010, tokens=10, rows=8) == "....R"


def test_policy_gives_up_near_break_even_after_seconds_not_only_steps():
    """At N = 32 a plain step takes 16 ms: probes near break-even (gain 0.95) in a row, four or more (each holds 32
    rows: four hold 128), end rounds once they span `settle` seconds (2 s: 125 plain steps), not only after 512
    plain steps (8 s of the batch feeding the drafter's context for nothing)."""
    def until_given_up(policy):
        out = ""
        while policy.feeds and len(out) < 3000:
            out += drive(policy, 1, round_s=0.101, tokens=6, plain_s=0.016, rows=32)
        return out
    quick, slow = (until_given_up(Policy(block=16, blocks=(16,), settle=s)) for s in (2.0, float("inf")))
    assert 7 <= quick.count("R") <= 14 and 125 <= quick.count(".") <= 200
    assert slow.count(".") > 400 and len(slow) < 3000       # the steps' guard (or the ledger, its 32 probes having
    #                                                         lost: 476 plain steps) alone: more than twice as long
    p = Policy(block=16, blocks=(16,))                 # 1 ms steps: 512 of them (0.5 s) end it, after
    kinds = drive(p, 2000, round_s=0.0063, tokens=6, plain_s=0.001, rows=32)   # twice as many probes
    assert 32 <= kinds.count("R") <= 40 and not p.feeds


def test_policy_times_every_block_soon_when_rounds_lose():
    """N = 32 as measured on a CPU (plain step 16 ms; rounds of 16 / 8 / 4 / 2 in 136 / 68 / 60 / 40 ms, 3 tokens
    per row): every block loses (the best, 0.8 plain steps a round). No verdict comes before each block is timed
    three times, so those timings come as quick probes, every 4 plain steps, not at the waits of losing probes
    (38 steps here): rounds are given up after 2.6 s of plain steps, not 6.8 s. (32 rows a round: the first
    round's acceptance already holds enough rows to time the shorter blocks.)"""
    cost, blocks = {16: 0.136, 8: 0.068, 4: 0.060, 2: 0.040}, []
    p, kinds = Policy(block=16), ""
    while p.feeds and len(kinds) < 3000:
        kinds += drive(p, 1, round_s=lambda k: cost[k], tokens=3, plain_s=0.016, rows=32, blocks=blocks)
    assert sorted(blocks[:12]) == sorted([16, 8, 4, 2] * 3) and kinds[:59] == "..." + "R...." * 11 + "R"
    assert len(kinds) < 200 and not p.feeds


def test_policy_probes_remeasure_longer_blocks():
    """A round of k measures the acceptance of blocks up to k only. After a stretch where every block loses and the
    best is the shortest (2 tokens a round), the text turns easy (12 tokens): probes of the best block alone would
    never see it (a round of 2 still commits 2); every other probe takes the next longer block, so the acceptance of
    longer blocks is re-measured, and rounds of 8 and 16 come back."""
    cost = lambda k: 0.002 + 0.0002 * k                          # 16: 5.2 ms, 8: 3.6, 4: 2.8, 2: 2.4; plain 1 ms
    p, blocks = Policy(block=16, patience=10**9), []
    drive(p, 400, round_s=cost, tokens=2, blocks=blocks)
    assert p.costs.best() == 2 and p.feeds
    kinds = drive(p, 1500, round_s=cost, tokens=12, blocks=blocks)
    assert "R" * 16 in kinds and p.costs.best() in (8, 16) and blocks[-20:].count(2) <= 2


def test_policy_compares_costs_timed_over_the_same_stretch():
    """The machine's speed drifts. Rounds pay while the machine is slow (12 tokens for 6.5 ms against 1.3 ms
    plain steps), then the text turns hard (4 tokens) as the machine turns fast (rounds 5 ms, plain steps 1 ms):
    rounds are worth 0.8 plain steps. While rounds go on a plain step is timed once per 16 rounds, so its samples
    reach far back: set against the fast rounds, the slow plain steps made rounds look worth 1.04 and run on for
    about 130 rounds. Compared over the same stretch of steps, the costs say 0.8 within a few rounds."""
    fast = [False]
    plain = lambda after_round: 0.001 if fast[0] else 0.0013
    p = Policy(block=16, blocks=(16,))
    assert drive(p, 300, round_s=0.0065, tokens=12, plain_s=plain).count("R") > 250
    fast[0] = True
    kinds = drive(p, 300, round_s=0.005, tokens=4, plain_s=plain)
    assert kinds.find("." * 20) < 40, kinds[:80]                 # plain steps within a few rounds, and for good
    assert kinds[40:].count("R") < 10


def test_policy_times_plain_steps_without_the_switch_from_rounds():
    """The first plain step after a round also carries the round's features into the drafter's context (here 3 ms
    against 1 ms). Rounds pay (6 tokens in 5 ms), then cost 7 ms (0.86 plain steps): the plain steps that re-time
    one after 16 rounds must say 1 ms, or rounds would look worth 2.6 plain steps and go on losing."""
    p = Policy(block=16, blocks=(16,))
    switch = lambda after_round: 0.003 if after_round else 0.001
    assert drive(p, 300, round_s=0.005, tokens=6, plain_s=switch).count("R") > 250
    assert drive(p, 300, round_s=0.007, tokens=6, plain_s=switch).count("R") < 40
    assert max(p.costs.plain) == 0.001


def test_policy_charges_the_switch_after_a_round_to_that_round():
    """A probe between plain steps costs its round and the next plain step's extra (the round's features carried
    into the drafter's context: 2 ms here). Probes of 5.2 ms for 6 tokens alone would look worth 1.15 plain steps
    and bring rounds back; with the switch, 7.2 ms (0.83): rounds stay off."""
    switch = lambda after_round: 0.003 if after_round else 0.001
    p = Policy(opening=0, block=16, blocks=(16,), min_samples=4, min_rounds=1)
    drive(p, 30, round_s=0.010, tokens=6, plain_s=switch)                           # losing: plain steps, probes
    assert "RR" not in drive(p, 600, round_s=0.0052, tokens=6, plain_s=switch)
    assert statistics.median(p.costs.seconds[16]) == pytest.approx(0.0072)
    p = Policy(opening=0, block=16, blocks=(16,), min_samples=4, min_rounds=1)         # without a switch's cost the same
    drive(p, 30, round_s=0.010, tokens=6)                                           # probes bring rounds back
    assert "RRR" in drive(p, 600, round_s=0.0052, tokens=6)


def test_policy_margin_keeps_noise_near_break_even_from_starting_rounds():
    p = Policy(opening=0, block=16, blocks=(16,), min_samples=4, min_rounds=1)     # (no quick probes after the first round)
    drive(p, 5, round_s=0.010, tokens=6)                                       # loses: plain steps
    assert drive(p, 20, round_s=0.0058, tokens=6).count("R") <= 1              # gain 1.03: not enough to come back
    assert "RRR" in drive(p, 600, round_s=0.005, tokens=6)                     # gain 1.2: rounds again


def test_policy_chooses_the_verify_block_that_pays_most():
    """A verify whose cost grows with its tokens (a compute-bound batch): 1 ms + 0.45 ms per token, a plain step 1 ms,
    6 tokens accepted of any longer block. Per round: 16 -> 6 tokens in 8.2 ms (0.73 plain steps), 8 -> 6 in 4.6
    (1.30), 4 -> 4 in 2.8 (1.43), 2 -> 2 in 1.9 (1.05). The policy verifies the whole block (quick probes while
    it loses) until the acceptance holds 32 rows, then times each shorter block and takes rounds of 4, with a round
    of 8 now and then (its acceptance re-measured); where no block pays it takes plain steps. Where the whole block
    pays, shorter blocks are never timed: rounds stay with it."""
    assert verify_blocks(16) == (16, 8, 4, 2) and verify_blocks(6) == (6, 3) == Policy(opening=0, block=6).blocks
    p = Policy(opening=0, block=16)
    assert drive(p, 4, round_s=0.01, tokens=6) == "...R"          # one round of 16 estimates every shorter block
    assert {k: list(v) for k, v in p.costs.tokens.items()} == {16: [6], 8: [6], 4: [4], 2: [2]}
    p, blocks = Policy(opening=0, block=16), []
    kinds = drive(p, 300, round_s=lambda k: 0.001 + 0.00045 * k, tokens=6, blocks=blocks)
    assert kinds.startswith("..." + "R...." * 8 + "RRRR") and kinds.count(".") < 70 and blocks[:8] == [16] * 8
    assert {8, 4, 2} <= set(blocks[8:40]) and blocks[40:].count(4) > 0.9 * len(blocks[40:]) and 8 in blocks[40:]
    p, blocks = Policy(opening=0, block=16), []                                   # 0.3 ms + 0.9 ms per token: none pays
    kinds = drive(p, 1000, round_s=lambda k: 0.0003 + 0.0009 * k, tokens=1, blocks=blocks)    # each block timed 3
    assert blocks[:8] == [16] * 8 and sorted(blocks[8:17]) == sorted([8, 4, 2] * 3)  # times once 32 rows are
    assert kinds.count("R") == 24 and kinds.endswith("." * 100) and not p.feeds      # in, then losing probes: given up
    p = Policy(opening=0, block=16)                                               # the same with one row: no verdict
    kinds = drive(p, 600, round_s=lambda k: 0.0003 + 0.0009 * k, tokens=1, rows=1)    # from 4 probes of one row
    assert p.feeds and kinds.count("R") > 8
    p, blocks = Policy(opening=0, block=16), []                                   # 3 ms + 0.1 ms per token, 12 accepted
    kinds = drive(p, 200, round_s=lambda k: 0.003 + 0.0001 * k, tokens=12, blocks=blocks)
    assert blocks == [16] * len(blocks) and kinds.count(".") < 30                # the whole block pays: only it
    first = {}                                  # a slow moment of the machine times the first rounds of 8 and 4 at 3x

    def noisy(k):
        first[k] = first.get(k, 0) + 1
        return (0.001 + 0.00045 * k) * (3 if k in (8, 4) and first[k] == 1 else 1)
    p, blocks = Policy(opening=0, block=16), []
    kinds = drive(p, 300, round_s=noisy, tokens=6, blocks=blocks)     # probes re-time them: rounds of 4 again
    assert kinds.count("R") > 200 and blocks[-100:].count(4) > 90
    with pytest.raises(dflash.GenerationError, match="policy blocks"):
        Policy(block=8, blocks=(16, 4))


# ---- The Policy on the Engine, and through generate.py ----------------------------------------------------------

@pytest.mark.parametrize("slots", [1, 3])
def test_policy_plain_steps_and_rounds_are_both_exact(slots):
    """policy.Policy on an Engine whose drafter never agrees: it turns to plain steps, probes with a round now and
    then, and every request's output is AR's, on one slot (the requests one after another: the Policy's verdicts
    carry over, so the later ones may run plain steps only) or three."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 12)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 6)
    rng = random.Random(4)
    reqs = [engine.Request([rng.randrange(40) for _ in range(20)], 60) for _ in range(3)]
    res = engine.Engine(target, engine.DrafterProposer(d, target), 8, slots, 100, policy=Policy(block=8)).run(reqs)
    for i, (r, got) in enumerate(zip(reqs, res)):
        assert got.output_ids == engine.run(target, r.prompt_ids, r.max_new_tokens).output_ids
        assert {"plain", "verify"} <= set(got.step_kinds) or (slots == 1 and i > 0 and set(got.step_kinds) == {"plain"})


def test_policy_revives_rounds_in_the_next_run_of_the_engine():
    """An Engine whose policy gave rounds up in one run (its plain steps fed nothing) probes again in the next: the
    run's admissions feed the drafter's context, one round is taken after `first_wait` plain steps; a run before the
    next revival is due takes none and feeds nothing; every output is AR's in all three runs."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 12)
    d = random_drafter(kind_draft_config(cfg, "dflash", block_size=8), 6)
    rng = random.Random(5)
    reqs = [engine.Request([rng.randrange(40) for _ in range(12)], 30) for _ in range(2)]
    p = Policy(block=8, opening=0)
    eng = engine.Engine(target, engine.DrafterProposer(d, target), 8, 1, 64, policy=p)
    first = eng.run(reqs)
    assert "verify" in first[0].step_kinds
    p.feeds = False                                         # a verdict, as _judge gives one
    second = eng.run(reqs)
    kinds = [k for r in second for k in r.step_kinds]
    assert kinds.count("verify") == 1 and kinds.index("verify") == 4      # 4 plain steps, then the probe
    assert not p.feeds                      # the probe's drafts (this drafter never agrees) did not pay: given up again
    p.revive_after, since = 10 ** 6, p.since    # a revival not due yet (its loss / budget is further off): the next
    third = eng.run(reqs)                       # run stays given up, its admissions and plain steps unfed
    assert all(set(r.step_kinds) == {"plain"} for r in third) and not p.feeds and not eng.feeding
    assert p.since == since + sum(len(r.step_kinds) for r in third)         # (counted on across runs)
    for r, a, b, c in zip(reqs, first, second, third):
        assert a.output_ids == b.output_ids == c.output_ids == engine.run(target, r.prompt_ids, r.max_new_tokens).output_ids


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_adaptive_generate_equals_ar_on_a_long_prompt(capsys):
    """The embedded pair on a prompt longer than its training context, default settings (the Policy): the output is
    AR's and the trace's contract holds (plain steps appear as 1 with no drafts). (--no-adaptive's text == the
    Policy's == AR's: test_cli.py's test_same_seed_same_text_whatever_the_step_pattern.)"""
    target, drafter, _, _ = embedded_pair()
    prompt = prompts.long_prompts(ckpt.load_tokenizer(target.path), 1, 600)[0]
    ids = ",".join(map(str, prompt))
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "48", "--json", "--draft", "none"]) == 0
    ar = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "48", "--json"]) == 0
    sp = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sp["output_ids"] == ar["output_ids"] and len(sp["prompt_ids"]) == 600 and sp["adaptive"] is True
    assert 1 + sum(sp["acceptance_lengths"]) == 48 and len(sp["step_kinds"]) == len(sp["draft_ids"]) == len(sp["acceptance_lengths"])
    assert all((a, d) == (1, []) for a, d, k in zip(sp["acceptance_lengths"], sp["draft_ids"], sp["step_kinds"]) if k == "plain")


# ---- The default draft window ------------------------------------------------------------------------------

def test_default_window_from_the_config(tmp_path):
    """train_context_length (dflash_config, written by tools/train.py), else none, a sliding drafter's included (its
    sliding layers keep their own window, its full layers see everything: the z-lab package's reading);
    generate.py applies it unless --draft-window says otherwise (0 = none)."""
    from helpers import tiny_draft_config
    cfg = tiny_target_config()
    assert ckpt.default_draft_window(tiny_draft_config(cfg)) is None
    assert ckpt.default_draft_window(kind_draft_config(cfg, "sliding")) is None
    assert ckpt.draft_window(kind_draft_config(cfg, "sliding"), 7) == 7
    assert ckpt.default_draft_window(tiny_draft_config(cfg, train_context_length=300)) == 300
    d = random_drafter(tiny_draft_config(cfg, train_context_length=300, num_target_layers=None), 1, torch.float32)
    ckpt.save_drafter(d, str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"]["train_context_length"] == 300
    assert ckpt.load_drafter(str(tmp_path), cfg).cfg.train_context_length == 300


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
@pytest.mark.parametrize("flag, window", [([], 208), (["--draft-window", "0"], None), (["--draft-window", "64"], 64)])
def test_generate_applies_the_default_window(capsys, flag, window):
    assert generate.main(["--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json", *flag]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["draft_window"] == window and res["adaptive"] is True
