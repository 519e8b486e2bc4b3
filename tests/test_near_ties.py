"""bfloat16: greedy DFlash and greedy AR on the embedded pair may part, but only at near-ties of the target.

A 16-token verify and a 1-token decode round differently, so where two logits lie within bfloat16's rounding of
each other either run may take either token (docs/method.md#exactness-and-precision). At the first token where
the two runs differ, the target re-run in float32 over the prompt + the tokens both agreed on must put both runs'
tokens within check.NEAR_TIE_STEPS rounding steps of bfloat16 (at the top logit's magnitude) of its best logit.
The measurement over 64 held-out prompts is `python tools/bench.py --threads 1 --parting --dtype bfloat16`.
"""
import math
import os

import pytest
import torch

from tools import bench
import check
import checkpoint as ckpt
import engine
import prompts as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "checkpoints", "tiny-qwen35")
DRAFT = os.path.join(ROOT, "checkpoints", "tiny-qwen35-dflash")
NEW = 128
# Two prompts of the README's examples and two held-out prompts (prompts.heldout_prompts, tools/bench.py's order) that
# part in bfloat16 with one CPU thread: measured here (AMD EPYC, AVX2, torch 2.13.0+cpu, the pass-9 drafter) at
# output tokens 8 and 42, so the test sees partings to judge. Other CPUs or thread counts may part elsewhere; the property must hold
# wherever they do.
TEXTS = ["def fibonacci(n):", "class Stack:"]
HELDOUT = [15, 17]

# The bound: 2 rounding steps of bfloat16 at the top logit's magnitude (eps 2^-7 times 2^floor(log2 |z|); 0.03125
# for logits in [4, 8)). Two runs pick different tokens only where their roundings move the float32 top-2 margin m
# across 0, so |m| is at most the larger of the two moves; over 8,192 positions of the held-out runs a bfloat16
# forward moved m by at most 1.51 steps (median 0.29; AVX2 CPU, docs/measurements.md), while half the positions have
# margins above 21 steps.
BOUND = check.NEAR_TIE_STEPS
assert BOUND == 2.0


@pytest.fixture(scope="module")
def runs(one_thread):
    """The bfloat16 pair and its float32 twin (the same bfloat16 weights, upcast exactly), and for each prompt
    (prompt ids, greedy AR output, greedy DFlash output) in bfloat16."""
    target = ckpt.load_target(TARGET, torch.bfloat16)
    proposer = engine.DrafterProposer(ckpt.load_drafter(DRAFT, target.cfg, torch.bfloat16), target)
    ref = ckpt.load_target(TARGET, torch.float32)
    tok = ckpt.load_tokenizer(TARGET)
    heldout = P.heldout_prompts(tok, max(HELDOUT) + 1)
    prompts = [tok.encode(t).ids for t in TEXTS] + [heldout[i] for i in HELDOUT]
    capacity = bench.bench_capacity(prompts, NEW, 16)
    ar_engine = engine.Engine(target, None, 1, 1, capacity)
    sp_engine = engine.Engine(target, proposer, 16, 1, capacity)
    outs = [(p, ar_engine.generate(p, NEW).output_ids, sp_engine.generate(p, NEW).output_ids) for p in prompts]
    return ref, outs


def test_bfloat16_dflash_and_ar_part_only_at_near_ties(runs):
    ref, outs = runs
    seen = []
    for prompt, ar, sp in outs:
        part = check.parting(ref, prompt, ar, sp)
        if part is None:
            assert ar == sp
            continue
        assert ar[:part.index] == sp[:part.index] and ar[part.index] != sp[part.index]
        assert check.near_tie(part, torch.bfloat16, BOUND), (
            f"prompt {prompt[:8]}...: DFlash {part.dflash} and AR {part.ar} part at output token {part.index} with a "
            f"float32 gap of {part.gap:.5f} = {part.steps(torch.bfloat16):.2f} bfloat16 steps (bound {BOUND})")
        seen.append(part.index)
    # Where bfloat16 runs part depends on the CPU's kernels: on the machine the prompts were chosen on, the two
    # held-out prompts part. Elsewhere none may, and then this test has judged nothing: it says so instead of passing.
    if not seen:
        pytest.skip("no prompt parted on this CPU: nothing to judge (find prompts that part with "
                    "python tools/bench.py --threads 1 --parting --dtype bfloat16)")


def test_a_clear_divergence_is_not_a_near_tie(runs):
    """The same judge on a fabricated parting: at an output position, the second run takes the token float32 ranks
    last (a plain forward here, not bench's); that must be refused as a near-tie."""
    ref, outs = runs
    prompt, ar, _ = outs[0]
    k = 5
    with torch.no_grad():
        ids = torch.tensor([prompt + ar[:k]])
        worst = int(ref(ids, torch.arange(ids.shape[1]))[0][0, -1].argmin())
    fake = ar[:k] + [worst] + ar[k + 1:]
    part = check.parting(ref, prompt, ar, fake)
    assert (part.index, part.dflash, part.ar) == (k, worst, ar[k]) and part.prefers != "dflash"
    assert not check.near_tie(part, torch.bfloat16, BOUND)


@pytest.mark.parametrize("z", [0.75, 1.0, 1.5, -3.0, 6.3125, 8.0, -9.5, 100.0, 3e-3])
def test_rounding_step_is_the_bfloat16_spacing(z):
    """rounding_step(z) == the distance from the bfloat16 number z to the next one away from zero."""
    x = torch.tensor(z, dtype=torch.bfloat16)          # 3e-3 is not a bfloat16 number: its rounding is used
    up = torch.nextafter(x, torch.tensor(math.copysign(math.inf, z), dtype=torch.bfloat16))
    assert check.rounding_step(float(x), torch.bfloat16) == abs(float(up) - float(x))


def test_near_tie_classifier():
    """Fabricated partings at a top logit of 6.0 (a bfloat16 step of 2^-5): inside the bound is a near-tie,
    outside is not, whichever run's token the reference prefers."""
    step = 2.0 ** -5
    for prefers_dflash in (True, False):
        top = 1 if prefers_dflash else 2
        at = lambda gap: check.Parting(index=3, dflash=1, ar=2, top=top, gap=gap, top_logit=6.0)
        assert check.near_tie(at(0.0), torch.bfloat16, BOUND)
        assert check.near_tie(at(BOUND * step), torch.bfloat16, BOUND)
        assert not check.near_tie(at(BOUND * step * 1.01), torch.bfloat16, BOUND)
        assert not check.near_tie(at(0.5), torch.bfloat16, BOUND)          # 16 steps: a clear choice
        assert at(0.0).prefers == ("dflash" if prefers_dflash else "ar")
    assert check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert check.first_difference([1, 2, 3], [1, 4, 3]) == 1
