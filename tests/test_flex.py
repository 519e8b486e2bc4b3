"""The FlexAttention masks (flex.FlexMasks, --attention flex) against the SDPA path (model.DenseMasks).

Eager flex_attention on CPU evaluates only the mask_mod (it ignores the BlockMask's tile lists), so the tile
lists are checked directly here (test_step_masks_*): the mask a fused kernel applies is (tile listed) AND
mask_mod, and it must equal the SDPA path's boolean mask for every start position and step width. The
compiled test runs inductor's CPU flex kernel, which does skip unlisted tiles."""
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import engine
from speed import flex
import model as M
import policy
from helpers import (Early, OracleProposer, fresh_inductor_cache, kind_draft_config, random_drafter, random_target,
                     tiny_draft_config, tiny_target_config)
from test_spec_equals_ar import first_divergence_is_near_tie


# eager flex_attention warns once that it is unfused; that is the point of running it here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def kernel_mask(step) -> torch.Tensor:
    """[Tq, Tk] bool: what a fused flex kernel computes with the sliced BlockMask `step`: only listed tiles are
    visited (every tile is partial), and inside them the mask_mod decides."""
    Tq, Tk = step.seq_lengths
    bq, bk = step.BLOCK_SIZE
    tiles = step.to_dense()[0, 0].bool()                                             # [q tiles, kv tiles]
    listed = tiles.repeat_interleave(bq, 0).repeat_interleave(bk, 1)[:Tq, :Tk]
    return listed & create_mask(step.mask_mod, 1, 1, Tq, Tk, device="cpu")[0, 0]


def dense_draft(capacity, block, window, s, causal=False, sliding=None) -> torch.Tensor:
    """DenseMasks' draft mask for a block at s, laid out over [whole cache ; block] like flex's. With a window
    shorter than the cache the mask covers [the window's slots ; block] (DenseMasks.draft_slots): scattered back
    here to the slots' positions; slots before 0 must be hidden."""
    masks = M.DenseMasks(capacity, block, window)
    mask, slots = masks.draft(torch.tensor([s]), block, causal, sliding), masks.draft_slots(torch.tensor([s]))
    assert (slots is not None) == (window is not None and window < capacity)
    assert mask.shape[:2] == (1, 1)                  # [rows, heads, queries, keys]: one row here
    mask = mask[0, 0]
    if slots is None:
        return mask
    slots = slots[0]
    raw = s - window + torch.arange(window)
    assert torch.equal(slots, raw.clamp(min=0)) and mask.shape == (block, window + block)
    assert not mask[:, :window][:, raw < 0].any()
    full = torch.zeros(block, capacity + block, dtype=torch.bool)
    full[:, raw[raw >= 0]] = mask[:, :window][:, raw >= 0]
    full[:, capacity:] = mask[:, window:]
    return full


@pytest.mark.parametrize("capacity", [300, 256])
def test_step_masks_target(capacity):
    """Prefill (from 0, over one and several tiles), decode and verify (straddling tile borders)."""
    bm = flex.causal_block_mask(capacity, "cpu")
    kpos = torch.arange(capacity)
    calls = [(0, T) for T in (1, 100, 128, 129, 256, 260) if T <= capacity]
    calls += [(s, T) for T in (1, 5, 16) for s in range(1, capacity - T + 1, 7)]
    calls += [(s, 16) for s in (112, 113, 120, 127, 240, capacity - 16)]                 # straddles / the end
    for s, T in calls:
        pos = torch.arange(s, s + T)
        want = M.DenseMasks(capacity).target(pos)                                        # the SDPA path's rule
        assert torch.equal(want, kpos[None, :] <= pos[:, None])
        assert torch.equal(kernel_mask(flex.causal_rows(bm, pos)), want), (s, T)


@pytest.mark.parametrize("window", [None, 1, 20, 130, 290, 400])
def test_step_masks_draft(window):
    """Draft: context [start - W, start) and the whole block, for every start; W None = all context (and so is a
    window as long as the cache, or longer: DenseMasks then masks the whole cache instead of gathering)."""
    capacity = 290
    for block in (16, 5):
        bm = flex.draft_block_mask(capacity, block, window, "cpu")
        kpos = torch.arange(capacity)
        for s in range(1, capacity - block + 1, 3):
            seen = kpos < s
            if window is not None:
                seen &= kpos >= s - window
            want = torch.cat([seen[None].expand(block, -1), torch.ones(block, block, dtype=torch.bool)], 1)
            got = kernel_mask(flex.draft_rows(bm, torch.tensor(s), block, window))
            assert torch.equal(got, want), (s, block, window)
            assert torch.equal(dense_draft(capacity, block, window, s), want), (s, block, window)
    with pytest.raises(ValueError, match="built for 5"):
        flex.draft_rows(bm, torch.tensor(10), 16, window)


@pytest.mark.parametrize("causal,sliding", [(True, None), (True, 7), (False, 7), (False, 1), (True, 200)])
def test_step_masks_draft_layer_kinds(causal, sliding):
    """A causal or sliding drafter layer (docs/method.md#drafter-variants) keeps a subset of the row's keys:
    flex == SDPA == the rule written out here, query by query, with and without a draft window."""
    capacity, block = 150, 8

    def sees(q, k):
        return (not causal or k <= q) and (sliding is None or (q - k < sliding and (causal or k - q < sliding)))
    for window in (None, 20):
        bm = flex.draft_block_mask(capacity, block, window, "cpu")
        for s in (1, 5, 63, 120, capacity - block):
            want = torch.zeros(block, capacity + block, dtype=torch.bool)
            for i in range(block):
                for j in range(capacity):
                    want[i, j] = j < s and (window is None or j >= s - window) and sees(s + i, j)
                for j in range(block):
                    want[i, capacity + j] = sees(s + i, s + j)
            got = kernel_mask(flex.draft_rows(bm, torch.tensor(s), block, window, causal, sliding))
            assert torch.equal(got, want), (s, window)
            assert torch.equal(dense_draft(capacity, block, window, s, causal, sliding), want), (s, window)


@torch.no_grad()
def test_attention_outputs_equal():
    """One cached verify call of a gated attention layer and of a drafter layer: flex == SDPA (float64)."""
    cfg = tiny_target_config(layer_types=["full_attention"], num_hidden_layers=1)
    target = random_target(cfg, 3)
    C, start, T = 200, 121, 16
    pos = torch.arange(start, start + T)
    x = torch.randn(1, T, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    outs = []
    for masks in (M.DenseMasks(C), flex.FlexMasks(C, T, None, "cpu")):
        cache = M.TargetCache(cfg, C, torch.float64, "cpu")
        torch.manual_seed(1)
        cache.layers[0].k.normal_(), cache.layers[0].v.normal_()                     # a filled cache, stale tail
        cos, sin = target.rope(pos, x.dtype)
        outs.append(target.layers[0].self_attn(x, cos, sin, pos, masks.target(pos), cache.layers[0]))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)

    dcfg = tiny_draft_config(cfg, num_hidden_layers=1)
    drafter = random_drafter(dcfg, 4)
    feats = torch.randn(1, T, len(dcfg.target_layer_ids) * cfg.hidden_size, dtype=torch.float64)
    emb = torch.randn(1, T, cfg.hidden_size, dtype=torch.float64)
    outs = []
    for kind, window in ((M.DenseMasks, None), (flex.FlexMasks, None), (M.DenseMasks, 7), (flex.FlexMasks, 7)):
        cache = M.DraftCache(dcfg, C, torch.float64, "cpu")
        torch.manual_seed(2)
        cache.layers[0].k.normal_(), cache.layers[0].v.normal_()
        drafter.append_context(feats, pos - T, cache)
        outs.append(drafter.draft(emb, pos[:1], cache, kind(C, T, window, "cpu")))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(outs[2], outs[3], rtol=0, atol=1e-12)
    assert not torch.allclose(outs[0], outs[2])                                          # the window matters


@pytest.mark.parametrize("kind", ["dflash", "sliding", "dflash2"])
def test_same_tokens_ar_and_dflash(kind):
    """Greedy AR and DFlash (random drafter of each kind, with and without --draft-window) give the same tokens
    and the same proposals with flex as with SDPA; the prompt and the verify blocks cross the 128-position tile."""
    cfg = tiny_target_config()
    target = random_target(cfg, 0)
    drafter = random_drafter(kind_draft_config(cfg, kind), 1)
    prompt = torch.randint(0, cfg.vocab_size, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = {}
    for att, masks in (("sdpa", M.DenseMasks), ("flex", flex.FlexMasks)):
        runs[att, "ar"] = engine.run(target, prompt, 30, masks=masks)
        for window in (None, 9):
            proposer = engine.DrafterProposer(drafter, target, window)
            runs[att, window] = engine.run(target, prompt, 30, proposer=proposer, block_size=16, masks=masks)
    for key in ("ar", None, 9):
        assert runs["flex", key].output_ids == runs["sdpa", key].output_ids
        assert runs["flex", key].draft_ids == runs["sdpa", key].draft_ids
    assert runs["sdpa", None].output_ids == runs["sdpa", "ar"].output_ids == runs["sdpa", 9].output_ids
    assert runs["sdpa", None].draft_ids != runs["sdpa", 9].draft_ids                     # the window is in effect


@pytest.mark.parametrize("block", [16, 5])
def test_every_acceptance_length(block):
    """An oracle stand-in forces every acceptance length 0..B-1 and full; flex output == AR output."""
    cfg = tiny_target_config()
    target = random_target(cfg, 2)
    prompt = torch.randint(0, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(6)).tolist()
    n_new = 1 + sum(range(1, block + 1)) + block                 # enough for one whole plan: lengths 0..B-1 each once
    ar = engine.run(target, prompt, n_new)
    oracle = OracleProposer({tuple(prompt): ar.output_ids}, cfg.vocab_size, seed=block)
    sp = engine.run(target, prompt, n_new, proposer=oracle, block_size=block, masks=flex.FlexMasks)
    assert sp.output_ids == ar.output_ids
    assert {a for _, _, a in oracle.asked} == set(range(block))


def test_masks_built_once_per_engine(monkeypatch):
    calls = []
    for name in ("causal_block_mask", "draft_block_mask"):
        real = getattr(flex, name)
        monkeypatch.setattr(flex, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    cfg = tiny_target_config()
    target = random_target(cfg, 0)
    proposer = engine.DrafterProposer(random_drafter(tiny_draft_config(cfg), 1), target)
    eng = engine.Engine(target, proposer, 8, capacity=100, masks=flex.FlexMasks)
    for n in (5, 20):
        eng.generate([1, 2, 3], n)
    assert sorted(calls) == ["causal_block_mask", "draft_block_mask"]


def compiled_flex_batch() -> dict:
    """The work of the test below, in a process of its own (helpers.Early): a 2-slot batch compiled with flex
    attention and the command lines' CPU options, warmed up on two requests, then three more run with recompiles
    raising; and the eager SDPA batch on those three."""
    import argparse
    import random
    import torch._dynamo
    from torch._dynamo.utils import counters
    import options as opts
    with fresh_inductor_cache():
        cfg = tiny_target_config(vocab_size=40)
        target = random_target(cfg, 4, torch.float32)
        drafter = random_drafter(kind_draft_config(cfg, "dflash", block_size=4, target_layer_ids=[0, 2],
                                                   num_target_layers=None), 5, torch.float32)
        options = opts.compile_options(argparse.Namespace(cpp_wrapper=True, attention="flex"), "cpu")
        rng = random.Random(2)

        def requests(lengths):
            return [engine.Request([rng.randrange(40) for _ in range(n)], rng.randint(5, 30)) for n in lengths]
        early, later = requests((30, 9)), requests((140, 3, 121))
        eng = engine.Engine(target, engine.DrafterProposer(drafter, target), 4, 2, 256, "default", options,
                            masks=flex.FlexMasks, policy=policy.Alternate((4,)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng.warm_up(early)                                    # every step kind compiles once
            graphs = counters["stats"]["unique_graphs"]
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = eng.run(later)
        want = engine.Engine(target, None, 1, 2, 256).run(later)
        return {"epilogue_fusion": options.get("epilogue_fusion"), "graphs": (graphs, counters["stats"]["unique_graphs"]),
                "kinds": {k for r in got for k in r.step_kinds}, "target": target,
                "pairs": [(a.prompt_ids, a.output_ids, b.output_ids) for a, b in zip(got, want)]}


# started with the suite, in a process of its own
FLEX_BATCH = Early(compiled_flex_batch, process=True,
                   used_by=["test_compiled_flex_batch_as_the_command_lines_compile_it"])


def test_compiled_flex_batch_as_the_command_lines_compile_it():
    """A batch of 2 slots compiled with flex attention (batched block masks) and the command lines' CPU options
    (options.compile_options: the C++ wrapper, and no epilogue fusion, which torch 2.13's CPU flex kernel refuses
    for the one-query steps): DFlash through rounds and plain steps (which keep the drafter's context fed), every
    step kind warmed up by policy.Alternate. Requests coming and
    going after the warm-up never recompile, and the tokens are the eager SDPA batch's. Prompts cross the
    128-position tile, so inductor's CPU flex kernel, which visits only the listed tiles, runs the tile lists for
    real."""
    r = FLEX_BATCH.result()
    assert r["epilogue_fusion"] is False
    assert r["graphs"][0] == r["graphs"][1]
    assert {"plain", "verify"} <= r["kinds"]
    for prompt, got, want in r["pairs"]:    # (float32: another summation order may part them at a near-tie only)
        assert got == want or first_divergence_is_near_tie(r["target"], prompt, want, got, 1e-4)


def test_prefill_does_not_call_flex(monkeypatch):
    """Prefill runs eager; with FlexMasks it goes through SDPA's dense mask, so it neither prints PyTorch's
    "flex_attention called without torch.compile" warning nor materialises flex's unfused scores (counted:
    no flex_attention call during prefill, one per attention layer in a decode step); the tokens are SDPA's."""
    import torch.nn.attention.flex_attention as fa
    calls = []
    real = fa.flex_attention
    monkeypatch.setattr(fa, "flex_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = random_target(tiny_target_config(), 3, torch.float32)
    prompt = list(range(1, 40))
    seen = []                                      # (flex calls so far, the step's kind and tokens) after each step
    got = engine.Engine(target, None, 1, capacity=64, masks=flex.FlexMasks).generate(
        prompt, 4, on_step=lambda s: seen.append((len(calls), s.kind, s.tokens)))
    assert [(n, kind) for n, kind, _ in seen[:2]] == [(0, "prefill"), (target.cfg.layer_types.count("full_attention"), "decode")]
    assert got.output_ids == engine.Engine(target, None, 1, capacity=64).generate(prompt, 4).output_ids


@pytest.mark.parametrize("kind,window", [("dflash", None), ("sliding", None), ("dflash2", 9)])
def test_batch_rows_with_flex_equal_sdpa(kind, window):
    """A batch with FlexAttention masks (each row at its own positions: a batched block mask, row b's start in the
    mask_mod): every row's tokens and proposals == the SDPA batch's, at N = 1 and 3, through rounds of shorter
    verify blocks (each its own draft mask) and plain steps; prompts and blocks cross the 128-position tile."""
    import random
    cfg = tiny_target_config(vocab_size=40)
    target = random_target(cfg, 2)
    d = random_drafter(kind_draft_config(cfg, kind, block_size=8, target_layer_ids=[0, 2], num_target_layers=None), 3)
    rng = random.Random(1)
    reqs = [engine.Request([rng.randrange(40) for _ in range(n)], rng.randint(3, 30)) for n in (140, 5, 121, 60, 1)]
    for slots in (1, 3):
        runs = [engine.Engine(target, engine.DrafterProposer(d, target, window), 8, slots, 200,
                              policy=policy.Alternate((8, 3, 8)), masks=masks).run(reqs)
                for masks in (M.DenseMasks, flex.FlexMasks)]
        for dense, fl in zip(*runs):
            assert fl.output_ids == dense.output_ids and fl.draft_ids == dense.draft_ids, (slots, dense.prompt_ids)
