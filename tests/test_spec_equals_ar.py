"""The central property: DFlash greedy output == plain AR greedy output, token for token, on engine.Engine: a request
alone (engine.run) or beside other requests in an Engine of 3 slots, each equal to its own AR run."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash
import engine
import model as M
from helpers import (DRAFTER_KINDS, OracleProposer, kind_draft_config, random_drafter, random_target, tiny_draft_config,
                     tiny_target_config, verify_kernel)

pytestmark = pytest.mark.usefixtures("one_thread")      # tiny eager models: one thread (conftest.py)


@st.composite
def target_configs(draw):
    n_layers = draw(st.integers(1, 5))
    layer_types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=n_layers, max_size=n_layers))
    nkv = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 16]))
    hk = draw(st.sampled_from([1, 2]))
    return tiny_target_config(
        vocab_size=draw(st.integers(20, 90)), hidden_size=draw(st.sampled_from([16, 32])), intermediate_size=24,
        num_hidden_layers=n_layers, layer_types=layer_types,
        num_key_value_heads=nkv, num_attention_heads=nkv * draw(st.sampled_from([1, 2, 3])), head_dim=head_dim,
        partial_rotary_factor=draw(st.sampled_from([0.25, 0.5, 1.0])),
        linear_num_key_heads=hk, linear_num_value_heads=hk * draw(st.sampled_from([1, 2, 3])),
        linear_key_head_dim=draw(st.sampled_from([4, 8])), linear_value_head_dim=draw(st.sampled_from([4, 8, 12])),
        linear_conv_kernel_dim=draw(st.sampled_from([2, 3, 4])), tie_word_embeddings=draw(st.booleans()))


def first_divergence_is_near_tie(target, prompt, ar_out, other_out, tol):
    """float32: where two correct runs differ, the reference must be at a near-tie there (docs/method.md#exactness-and-precision).
    Teacher-forced float64 re-run of the same weights over prompt + the AR tokens before the divergence."""
    i = next(k for k, (a, b) in enumerate(zip(ar_out, other_out)) if a != b)
    t64 = M.Qwen35(target.cfg)
    t64.load_state_dict(target.state_dict())
    t64 = t64.double().eval()
    ids = torch.tensor([prompt + ar_out[:i]])
    with torch.no_grad():
        logits, _ = t64(ids, torch.arange(ids.shape[1]))
    top2 = logits[0, -1].topk(2).values
    return float(top2[0] - top2[1]) < tol


def companions(target, rng, prompt, max_len=60, n=2):
    """n other random requests (prompts distinct from `prompt` and from each other; some stop at a token of their
    own AR run, so the stop lands mid-output) and their AR outputs alone, to ride along with `prompt` in an Engine."""
    V, seen, reqs, outs = target.cfg.vocab_size, {tuple(prompt)}, [], []
    while len(reqs) < n:
        p = [rng.randrange(V) for _ in range(rng.randint(1, max_len))]
        if tuple(p) in seen:
            continue
        seen.add(tuple(p))
        max_new = rng.randint(1, 48)
        out = engine.run(target, p, max_new).output_ids
        stops = ()
        if rng.random() < 0.3:
            stops = (out[rng.randrange(len(out))],)
            out = out[:out.index(stops[0]) + 1]          # greedy: the run with the stop is the run cut at it
        reqs.append(engine.Request(p, max_new, stops))
        outs.append(out)
    return reqs, outs


def run_all(target, reqs, proposer, block, slots):
    """Every request on one engine: engine.run (slots=1, one request) or an Engine of `slots` slots (all at once)."""
    if slots == 1:
        (r,) = reqs
        return [engine.run(target, r.prompt_ids, r.max_new_tokens, r.stop_ids, proposer, block)]
    capacity = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + block - 1
    return engine.Engine(target, proposer, block, slots, capacity).run(reqs)


def check_oracle_plan(results, oracle):
    """Every round of every request accepted exactly what the oracle planned for its row (its corruption index),
    except where cut short (the oracle knows the continuation only up to the AR output: the last round may differ).
    A round of one token (block 1) drafts nothing: the oracle is not asked and the round commits the target's token."""
    planned = {(p, s): a for p, s, a in oracle.asked}
    for res in results:
        for step in [s for s in res.steps if s.kind == "verify" and not s.stop]:
            a = planned[(tuple(res.prompt_ids), step.start)] if step.draft_ids else 0
            assert step.accepted == a and len(step.tokens) == a + 1


def check_spec_equals_ar(target, prompt, max_new, block, seed, stop_from_continuation, dtype, kind="dflash", slots=1):
    """engine.run (slots=1) or an Engine of 3 slots holding this request and two other random ones (slots=3): behind
    the oracle (both verify kernels) and a random drafter of `kind`, every request's output == its own AR run."""
    V = target.cfg.vocab_size
    ar = engine.run(target, prompt, max_new)
    stops = ()
    if stop_from_continuation is not None and len(ar.output_ids) > 1:
        stop = ar.output_ids[stop_from_continuation % len(ar.output_ids)]
        stops = (stop,)
        ar = engine.run(target, prompt, max_new, stops)
        assert ar.output_ids[-1] == stop and ar.output_ids.count(stop) == 1
    reqs, alone, at = [engine.Request(prompt, max_new, stops)], [ar.output_ids], 0
    if slots > 1:
        rng = random.Random(seed + 1)
        others, outs = companions(target, rng, prompt, n=slots - 1)
        at = rng.randrange(slots)                        # this request's slot
        reqs, alone = others[:at] + reqs + others[at:], outs[:at] + alone + outs[at:]
    cont = {tuple(r.prompt_ids): out for r, out in zip(reqs, alone)}
    oracle, oracle_rec = OracleProposer(cont, V, seed), OracleProposer(cont, V, seed)
    sp = run_all(target, reqs, oracle, block, slots)
    with verify_kernel(target, "recurrent"):
        sp_rec = run_all(target, reqs, oracle_rec, block, slots)
    drafter = random_drafter(kind_draft_config(target.cfg, kind, target_layer_ids=[seed % target.cfg.num_hidden_layers],
                                               num_target_layers=None, hidden_size=target.cfg.hidden_size), seed, dtype)
    real = run_all(target, reqs, engine.DrafterProposer(drafter, target), block, slots)
    for results in (sp, sp_rec, real):
        assert len(results) == len(reqs)
        for r, other, want in zip(reqs, results, alone):
            assert other.prompt_ids == r.prompt_ids
            if dtype == torch.float64:
                assert other.output_ids == want
            elif other.output_ids != want:
                assert first_divergence_is_near_tie(target, r.prompt_ids, want, other.output_ids, 1e-4)
            assert sum(other.acceptance_lengths) + 1 == len(other.output_ids)
            assert all(1 <= a <= block for a in other.acceptance_lengths)
            assert set(other.step_kinds) <= {"verify"}       # no policy: a round of the whole block every step
    for results, o in ((sp, oracle), (sp_rec, oracle_rec)):
        check_oracle_plan(results, o)
    return sp[at]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=25)
@given(cfg=target_configs(), seed=st.integers(0, 10**6), prompt_len=st.integers(1, 140),
       max_new=st.integers(1, 48), block=st.integers(1, 16), stop=st.one_of(st.none(), st.integers(0, 100)),
       kind=st.sampled_from(sorted(DRAFTER_KINDS)), slots=st.sampled_from([1, 3]))
def test_dflash_equals_ar(dtype, cfg, seed, prompt_len, max_new, block, stop, kind, slots):
    """Random targets (tied embeddings or not), prompts, blocks and stops; the oracle proposer forces every
    acceptance length and a random drafter of every published kind (DRAFTER_KINDS) runs the real draft path; alone
    (engine.run) or in an Engine of 3 slots beside two other random requests, each equal to its own AR run."""
    target = random_target(cfg, seed, dtype)
    rng = random.Random(seed)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(prompt_len)]
    check_spec_equals_ar(target, prompt, max_new, block, seed, stop, dtype, kind, slots)


@pytest.mark.parametrize("block,slots", [(4, 1), (16, 1), (4, 3)])
def test_every_acceptance_length_occurs(block, slots):
    """With no stop token and room to spare, the oracle plan covers 0..block-1 accepted (block-1 = all), alone and
    beside two other requests."""
    cfg = tiny_target_config(vocab_size=50)
    target = random_target(cfg, 3)
    prompt = [i % 50 for i in range(1, 80)]
    sp = check_spec_equals_ar(target, prompt, 3 * block * block, block, 7, None, torch.float64, slots=slots)
    seen = {s.accepted for s in sp.steps if s.kind == "verify" and not s.stop}
    assert seen == set(range(block))


def full_acceptance(target, oracle, slots, capacity):
    """An Engine behind `oracle` whose every row offers the true continuation every round (set after the engine's
    proposer.reset): a stop token or max_new_tokens lands inside an accepted run."""
    eng = engine.Engine(target, oracle, 16, slots, capacity)
    oracle.plans = [[15] * 100 for _ in range(slots)]
    return eng


def test_stop_token_inside_an_accepted_run():
    cfg = tiny_target_config(vocab_size=50)
    target = random_target(cfg, 5)
    prompt = list(range(3, 40))
    ar = engine.run(target, prompt, 40)
    stop = ar.output_ids[9]
    j = ar.output_ids.index(stop)
    oracle = OracleProposer({tuple(prompt): ar.output_ids}, 50, 0)
    sp = full_acceptance(target, oracle, 1, len(prompt) + 40 + 15).generate(prompt, 40, [stop])
    assert sp.output_ids == ar.output_ids[:j + 1]
    assert sp.steps[-1].stop and sp.steps[-1].tokens[-1] == stop
    assert [a for _, _, a in oracle.asked] == [15] * len(oracle.asked)


@pytest.mark.parametrize("slots", [1, 3])
def test_max_new_tokens_cuts_a_block(slots):
    """Each max_new_tokens cut inside a fully accepted block: one request at a time, or all six through 3 slots
    (admitted as slots free)."""
    cfg = tiny_target_config(vocab_size=50)
    target = random_target(cfg, 6)
    prompt = list(range(2, 30))
    lengths = (1, 2, 5, 16, 17, 20)
    ar = engine.run(target, prompt, max(lengths))      # greedy: a shorter run is a prefix of the longest
    oracle = OracleProposer({tuple(prompt): ar.output_ids}, 50, 0)
    eng = full_acceptance(target, oracle, slots, len(prompt) + max(lengths) + 15)
    if slots == 1:
        results = [eng.generate(prompt, n) for n in lengths]
    else:
        results = eng.run([engine.Request(prompt, n) for n in lengths])
    for n, sp in zip(lengths, results):
        assert sp.output_ids == ar.output_ids[:n] and len(sp.output_ids) == n
        assert engine.run(target, prompt, n).output_ids == sp.output_ids


def scratch_mask(start: int, block: int, causal: bool, sliding):
    """Keys [context 0..start-1 ; block start..start+block-1] of a from-scratch draft, written as the z-lab
    package's rule reads: causal hides later keys, a window hides keys `sliding` or more positions away."""
    qpos = torch.arange(start, start + block)[:, None]
    kpos = torch.arange(start + block)[None, :]
    m = torch.ones(block, start + block, dtype=torch.bool)
    if causal:
        m &= kpos <= qpos
    if sliding is not None:
        m &= (qpos - kpos < sliding) & ((kpos - qpos < sliding) | causal)
    return m


@pytest.mark.parametrize("block,seed,kind,slots", [(4, 0, "dflash", 1), (8, 1, "dflash", 3), (16, 2, "dflash", 1),
                                                  (8, 3, "sliding", 3), (16, 4, "noncausal-window", 3),
                                                  (8, 5, "causal", 1), (8, 6, "dflash2", 3)])
def test_engine_drafts_equal_drafter_from_scratch(block, seed, kind, slots):
    """Every proposal the engine made == the drafter run from scratch (no cache) on full-forward target features
    of the committed prefix: the incremental context appends (whole verify blocks, stale rows hidden) and the
    per-kind masks of the cached path are exact; with 3 slots, for every row, whatever the other rows hold."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, seed)
    dcfg = kind_draft_config(cfg, kind, block_size=16, target_layer_ids=[0, 2, 3], num_target_layers=None)
    drafter = random_drafter(dcfg, seed)
    rng = random.Random(seed)
    reqs = [engine.Request([rng.randrange(40) for _ in range(n)], max_new)
            for n, max_new in ((23, 60), (9, 25), (31, 45))[:slots]]
    results = run_all(target, reqs, engine.DrafterProposer(drafter, target), block, slots)
    for res in results:
        seq = torch.tensor([res.prompt_ids + res.output_ids])
        with torch.no_grad():
            _, feats = target(seq, torch.arange(seq.shape[1]), feature_layers=tuple(dcfg.target_layer_ids))
            for step in [s for s in res.steps if s.kind == "verify"]:
                start = step.start + 0
                blk = torch.full((1, block), dcfg.mask_token_id)
                blk[0, 0] = seq[0, start]
                masks = {k: scratch_mask(start, block, *k) for k in set(drafter.kinds)}
                h = drafter(target.embed_tokens(blk), feats[:, :start], torch.arange(start, start + block), torch.arange(start), masks)
                assert drafter.propose(h[0, 1:], blk[0, :1], target.lm_head)[0].tolist() == step.draft_ids


def test_draft_window():
    """A window as long as the context changes nothing; a short one changes the drafts, never the output."""
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 9)
    dcfg = tiny_draft_config(cfg, block_size=8, target_layer_ids=[1, 3], num_target_layers=None)
    drafter = random_drafter(dcfg, 9)
    prompt = [random.Random(9).randrange(40) for _ in range(50)]
    full = engine.run(target, prompt, 40, (), engine.DrafterProposer(drafter, target), 8)
    wide = engine.run(target, prompt, 40, (), engine.DrafterProposer(drafter, target, window=200), 8)
    short = engine.run(target, prompt, 40, (), engine.DrafterProposer(drafter, target, window=3), 8)
    assert wide.draft_ids == full.draft_ids
    assert short.draft_ids != full.draft_ids
    assert short.output_ids == full.output_ids
    with pytest.raises(dflash.GenerationError):
        engine.DrafterProposer(drafter, target, window=0)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dflash", "sliding", "noncausal-window", "causal", "dflash2"])
def test_windowed_draft_reads_only_its_window(kind):
    """A draft window shorter than the cache: DenseMasks gathers the window's slots (draft_slots) and masks
    [window ; block]; the drafter's output == the same draft over the whole cache with the full mask (float64),
    for starts before the window has filled, at its edge and past it."""
    cfg = tiny_target_config()
    dcfg = kind_draft_config(cfg, kind, target_layer_ids=[0, 2], num_target_layers=None, block_size=8)
    drafter = random_drafter(dcfg, 11, torch.float64)
    C, T, W = 64, 8, 10
    gen = torch.Generator().manual_seed(3)
    cache = M.DraftCache(dcfg, C, torch.float64, "cpu")
    drafter.append_context(torch.randn(1, C, 2 * cfg.hidden_size, dtype=torch.float64, generator=gen), torch.arange(C), cache)
    gathered, full = M.DenseMasks(C, T, W), M.DenseMasks(C, T, W)
    full.gathers = False                                   # the whole-cache path with the same window rule
    assert gathered.draft_slots(torch.tensor(5)) is not None and full.draft_slots(torch.tensor(5)) is None
    for start in (1, 5, W, W + 1, 33, C - T):
        emb = torch.randn(1, T, cfg.hidden_size, dtype=torch.float64, generator=gen)
        s = torch.tensor([start])
        torch.testing.assert_close(drafter.draft(emb, s, cache, gathered), drafter.draft(emb, s, cache, full), rtol=0, atol=1e-12)
