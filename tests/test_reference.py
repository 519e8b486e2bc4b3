"""The reference loop and the engine, twins: dflash.generate (one request, eager, the method on one page) gives
plain greedy decoding's tokens, computed here without any cache; and the engine that users run (engine.Engine:
N slots, admissions as slots free, plain steps between rounds, every proposer, compiled steps) gives the
reference loop's tokens for every request, token for token, in float64. The compiled engine's tokens are held to the
reference loop's in tests/test_compile.py (test_compiled_batch_with_a_dflash2_drafter)."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import dflash
import engine
from helpers import (DRAFTER_KINDS, OracleProposer, kind_draft_config, random_drafter, random_target,
                     tiny_target_config)
from policy import Alternate, Policy

pytestmark = pytest.mark.usefixtures("one_thread")      # tiny eager models: one thread (conftest.py)


def greedy_without_cache(target, prompt: list, max_new_tokens: int, stop_ids=()) -> list:
    """Plain greedy decoding written out: the whole sequence through the target (no cache, no state carried) for
    every new token, which is its argmax at the last position."""
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < max_new_tokens and not (len(ids) > len(prompt) and ids[-1] in stop_ids):
            logits, _ = target(torch.tensor([ids]), torch.arange(len(ids)))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@st.composite
def pairs(draw):
    """A tiny float64 target of random layer pattern and a drafter of a random published kind over it."""
    n_layers = draw(st.integers(1, 4))
    types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=n_layers, max_size=n_layers))
    cfg = tiny_target_config(vocab_size=draw(st.integers(20, 60)), num_hidden_layers=n_layers, layer_types=types,
                             linear_conv_kernel_dim=draw(st.sampled_from([2, 4])))
    seed = draw(st.integers(0, 10_000))
    target = random_target(cfg, seed)
    kind = draw(st.sampled_from(sorted(DRAFTER_KINDS)))
    layers = draw(st.lists(st.integers(0, n_layers - 1), min_size=1, max_size=2, unique=True))
    drafter = random_drafter(kind_draft_config(cfg, kind, block_size=8, target_layer_ids=sorted(layers),
                                               num_target_layers=None), seed + 1)
    return target, drafter


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=pairs(), data=st.data())
def test_reference_loop_equals_greedy_decoding(pair, data):
    """dflash.generate == greedy decoding without a cache, for every block size up to the drafter's, with and
    without a stop token inside the output."""
    target, drafter = pair
    V = target.cfg.vocab_size
    prompt = data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=30))
    max_new = data.draw(st.integers(1, 40))
    block = data.draw(st.integers(1, 8))
    want = greedy_without_cache(target, prompt, max_new)
    assert dflash.generate(target, drafter, prompt, max_new, block) == want
    stop = want[len(want) // 2]
    assert dflash.generate(target, drafter, prompt, max_new, block, (stop,)) == want[:want.index(stop) + 1]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=pairs(), data=st.data())
def test_engine_equals_the_reference_loop(pair, data):
    """engine.Engine with the DFlash drafter: random requests (prompts, lengths, stop tokens) arriving in a random
    order into 1-3 slots, a random block size, pure rounds or rounds with plain steps between them (policy.Alternate,
    policy.Policy) -> every request's tokens are the reference loop's. The same requests behind the oracle proposer
    (helpers.OracleProposer: every acceptance length, 0 .. B-1, in every row) give them too."""
    target, drafter = pair
    V, rng = target.cfg.vocab_size, random.Random(data.draw(st.integers(0, 10_000)))
    block = data.draw(st.integers(1, 8))
    reqs = []
    for _ in range(data.draw(st.integers(1, 5))):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 25))]
        reqs.append(engine.Request(prompt, rng.randint(1, 30)))
    refs = [dflash.generate(target, drafter, r.prompt_ids, r.max_new_tokens, block) for r in reqs]
    for i, r in enumerate(reqs):                    # some stop at a token of their own output
        if rng.random() < 0.4:
            r.stop_ids = (refs[i][rng.randrange(len(refs[i]))],)
            refs[i] = refs[i][:refs[i].index(r.stop_ids[0]) + 1]
    order = data.draw(st.permutations(range(len(reqs))))
    slots = data.draw(st.integers(1, 3))
    policy = data.draw(st.sampled_from(["none", "alternate", "policy"]))
    policy = {"none": None, "alternate": Alternate(tuple(sorted({block, max(1, block // 2)}))),
              "policy": Policy(block=block)}[policy]
    capacity = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + block
    eng = engine.Engine(target, engine.DrafterProposer(drafter, target), block, slots, capacity, policy=policy)
    got = eng.run([reqs[i] for i in order])
    assert [g.output_ids for g in got] == [refs[i] for i in order]
    oracle = OracleProposer({tuple(r.prompt_ids): ref for r, ref in zip(reqs, refs)}, V, rng.randrange(100), block)
    got = engine.Engine(target, oracle, block, slots, capacity).run([reqs[i] for i in order])
    assert [g.output_ids for g in got] == [refs[i] for i in order]


def test_reference_loop_refuses_bad_requests():
    """The reference loop checks a request as the engine does: one GenerationError naming the problem."""
    target = random_target(tiny_target_config(), 1)
    drafter = random_drafter(kind_draft_config(target.cfg, "dflash", block_size=4), 2)
    for args, words in ((([], 4), "empty"), (([1, 2], 0), "max_new_tokens"), (([999], 4), "outside the vocabulary"),
                        (([1, 2], 4, 5), "exceeds the drafter's block_size 4")):
        with pytest.raises(engine.GenerationError, match=words):
            dflash.generate(target, drafter, *args)
