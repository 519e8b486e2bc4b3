"""Tensor parallelism (tp.py).
- The shard maths: each layer cut into `world` parts as the engines cut it, the parts' outputs summed (what an
  all-reduce does) == the whole layer's, in float64, through prefill, a verify block, its rollback and decode steps,
  with each part keeping its own heads' caches; MoE experts cut by channel or by expert, on both expert paths.
- Several processes on gloo (torch.multiprocessing): dense and MoE targets with drafters, replicated and cut, at
  degrees 2 and 4 == one process (logits within 1e-10 in float64, the same bits on every rank, greedy and sampled
  outputs identical, every acceptance length), the bytes all-reduced, compiled steps, the policies' shared times.
- The refusals; a rank's end (tp.exit_process). (The command lines under torchrun: test_torchrun.py.)"""
import datetime
import os
import re
import subprocess
import sys

import pytest
import torch

import model as M
import tp
from helpers import Early, random_drafter, random_target, tiny_draft_config, tiny_target_config



def gdn_cache(layer: M.GatedDeltaNet, max_block: int = 8) -> M.GDNCache:
    z = lambda *s: torch.zeros(1, *s, dtype=torch.float64)
    K1 = layer.kernel - 1
    return M.GDNCache(z(K1, layer.conv_dim), z(layer.hv, layer.dk, layer.dv), z(max_block, layer.hk, layer.dk),
                      z(max_block, layer.hv, layer.dv), z(max_block, layer.hv), z(K1 + max_block, layer.conv_dim))


def summed(parts, call):
    return sum(call(p, i) for i, p in enumerate(parts))


@pytest.mark.parametrize("cfg_kw", [{}, dict(linear_num_key_heads=4, linear_num_value_heads=8)])
def test_sharded_gdn_equals_the_layer(cfg_kw):
    """Prefill 11 tokens, verify a block of 6, keep 4 of it, then 3 decode steps: every output of the summed parts
    == the whole layer's, each part rolling back its own heads' states."""
    target = random_target(tiny_target_config(**cfg_kw), 3)
    layer = next(l.linear_attn for l in target.layers if l.layer_type == "linear_attention")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, t, target.cfg.hidden_size, generator=g, dtype=torch.float64) for t in (11, 6, 1, 1, 1)]
    for world in [w for w in (2, 4) if layer.hk % w == 0]:
        parts = [tp.shard_gdn(layer, r, world) for r in range(world)]
        assert all(p.hk == layer.hk // world and p.hv == layer.hv // world for p in parts)
        whole_cache, caches = gdn_cache(layer), [gdn_cache(p) for p in parts]
        def run(gdn, x, cache, verify):          # (a verify's kept tensors are the caller's to keep)
            out, kept = gdn(x, cache, verify)
            if kept is not None:
                cache.keep_block(*kept)
            return out

        with torch.no_grad():
            for step, x in enumerate(xs):
                verify = step == 1
                want = run(layer, x, whole_cache, verify)
                got = summed(parts, lambda p, i: run(p, x, caches[i], verify))
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
                if verify:
                    whole_cache.commit(4)
                    for c in caches:
                        c.commit(4)
            torch.testing.assert_close(torch.cat([c.rec for c in caches], 1), whole_cache.rec, rtol=0, atol=1e-12)
        assert layer(xs[0], None)[0].shape == xs[0].shape            # the whole layer is untouched


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_attention_equals_the_layer(world):
    """4 query heads, 2 KV heads: at degree 2 the KV heads are split, at 4 each rank holds the one its heads read."""
    target = random_target(tiny_target_config(), 4)
    layer = next(l.self_attn for l in target.layers if l.layer_type == "full_attention")
    parts = [tp.shard_attention(layer, r, world) for r in range(world)]
    assert all(p.nh == layer.nh // world and p.nkv == max(1, layer.nkv // world) for p in parts)
    cap, H = 32, target.cfg.hidden_size
    caches = [M.AttnCache(*(torch.zeros(1, p.nkv, cap, layer.hd, dtype=torch.float64) for _ in range(2))) for p in parts]
    whole = M.AttnCache(*(torch.zeros(1, layer.nkv, cap, layer.hd, dtype=torch.float64) for _ in range(2)))
    g = torch.Generator().manual_seed(1)
    start = 0
    with torch.no_grad():
        for T in (9, 5, 1):
            pos = torch.arange(start, start + T)
            x = torch.randn(1, T, H, generator=g, dtype=torch.float64)
            cos, sin = target.rope(pos, x.dtype)
            mask = M.DenseMasks(cap).target(pos)
            want = layer(x, cos, sin, pos, mask, whole)
            got = summed(parts, lambda p, i: p(x, cos, sin, pos, mask, caches[i]))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            start += T


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_mlp_equals_the_mlp(world):
    target = random_target(tiny_target_config(), 5)
    mlp = target.layers[0].mlp
    x = torch.randn(1, 7, target.cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        got = summed([tp.shard_mlp(mlp, r, world) for r in range(world)], lambda p, i: p(x))
        torch.testing.assert_close(got, mlp(x), rtol=0, atol=1e-12)


def test_an_indivisible_head_count_is_one_line():
    target = random_target(tiny_target_config(), 6)
    gdn = next(l.linear_attn for l in target.layers if l.layer_type == "linear_attention")
    attn = next(l.self_attn for l in target.layers if l.layer_type == "full_attention")
    with pytest.raises(M.GenerationError, match="degree 3 does not divide the 2 GDN key heads") as e:
        tp.shard_gdn(gdn, 0, 3)
    assert "\n" not in str(e.value)
    with pytest.raises(M.GenerationError, match="degree 3 does not divide the 4 attention heads"):
        tp.shard_attention(attn, 0, 3)
    with pytest.raises(M.GenerationError, match="degree 5 does not divide the 48 MLP intermediate channels"):
        tp.shard_mlp(target.layers[0].mlp, 0, 5)


def moe_config(**kw) -> M.TargetConfig:
    return tiny_target_config(**{**dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=24, intermediate_size=0), **kw})


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_moe_equals_the_moe(world, expert_parallel):
    """Both expert paths: 3 tokens x top-2 <= 8 experts (gathered: static shapes) and 9 tokens (looped)."""
    target = random_target(moe_config(), 7)
    moe = target.layers[0].mlp
    parts = [tp.shard_moe(moe, r, world, expert_parallel) for r in range(world)]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for T, path in ((3, "gathered"), (9, "looped")):
            x = torch.randn(1, T, target.cfg.hidden_size, generator=g, dtype=torch.float64)
            calls = []
            for p in parts:
                real = getattr(p.experts, path)
                p.experts.__dict__[path] = lambda h, idx, _f=real: calls.append(1) or _f(h, idx)
            got = summed(parts, lambda p, i: p(x))
            assert len(calls) == world                               # the path the whole layer takes at this T
            torch.testing.assert_close(got, moe(x), rtol=0, atol=1e-12)
            for p in parts:
                del p.experts.__dict__[path]
    if expert_parallel:
        assert all(p.experts.down_proj.shape[0] == 8 // world for p in parts)
    else:
        assert all(p.experts.down_proj.shape[2] == 16 // world for p in parts)


def test_sharded_draft_attention_equals_the_layer():
    """The drafter's attention (biases included: only rank 0 adds o_proj's) cut in 2: summed == whole."""
    cfg = tiny_target_config()
    drafter = random_drafter(tiny_draft_config(cfg, attention_bias=True), 8)
    layer = drafter.layers[0].self_attn
    parts = [tp.shard_draft_attention(layer, r, 2) for r in range(2)]
    g = torch.Generator().manual_seed(3)
    x, ctx = (torch.randn(1, T, cfg.hidden_size, generator=g, dtype=torch.float64) for T in (4, 6))
    rope, rope_ctx = drafter.rope(torch.arange(6, 10), x.dtype), drafter.rope(torch.arange(6), x.dtype)
    mask = torch.ones(1, 1, 4, 10, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(summed(parts, lambda p, i: p(x, ctx, rope, rope_ctx, mask)),
                                   layer(x, ctx, rope, rope_ctx, mask), rtol=0, atol=1e-12)


def test_refusals_come_before_any_change():
    """A degree that does not divide a count is one line naming it, and leaves the model as it was; so do flags that
    need torchrun in one process, and a backend that does not serve the device."""
    target = random_target(tiny_target_config(intermediate_size=50, **WIDE), 9)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    par = tp.Parallel(0, 4, None, "cpu")
    with pytest.raises(M.GenerationError, match="degree 4 does not divide the 50 MLP intermediate channels") as e:
        par.shard(target, None)
    assert "\n" not in str(e.value)
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(M.GenerationError, match="degree 3 does not divide the 8 routed experts"):
        tp.Parallel(0, 3, None, "cpu", expert_parallel=True).shard(random_target(moe_config(
            num_attention_heads=3, num_key_value_heads=3, linear_num_key_heads=3, linear_num_value_heads=3, head_dim=8,
            moe_intermediate_size=9, shared_expert_intermediate_size=9)), None)
    with pytest.raises(M.GenerationError, match="apply to runs of several processes"):
        tp.launch("cpu", expert_parallel=True)
    assert tp.launch("cpu") == (None, "cpu")


def test_a_backend_that_does_not_serve_the_device(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(M.GenerationError, match="the nccl backend does not serve cpu tensors; use --tp-backend gloo"):
        tp.launch("cpu", "nccl")


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_process_ends_with_its_status_and_its_output(world):
    """tp.exit_process: a torchrun rank (WORLD_SIZE 2) skips the interpreter's teardown (an atexit handler does not
    run) yet ends with the status asked and its buffered output written; a single process ends as sys.exit does."""
    code = ("import atexit, sys, tp; atexit.register(print, 'teardown'); print('out', end=''); "
            "print('err', end='', file=sys.stderr); tp.exit_process(3)")
    p = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(tp.__file__), capture_output=True,
                       text=True, timeout=120, env={**os.environ, "WORLD_SIZE": world})
    assert (p.returncode, p.stdout, p.stderr) == (3, "out" if world == "2" else "outteardown\n", "err")


def test_the_cli_refuses_tp_flags_in_one_process(capsys):
    import generate
    assert generate.cli(["--prompt-ids", "1,2", "--expert-parallel", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --expert-parallel, --tp-drafter and --tp-backend apply to runs of several processes")


# ---- several processes on gloo: == one process ---------------------------------------------------------------

PROMPT = [3, 14, 15, 9, 26, 5, 35, 8, 9]
CASES = {   # name -> (target config kwargs, moe?, expert parallel, sharded drafter); each run at world 2 and 4
    "dense": ({}, False, False, False),
    "dense-sharded-drafter": ({}, False, False, True),
    "moe": ({}, True, False, False),
    "moe-expert-parallel": ({}, True, True, True),
}
AT = {2: list(CASES), 4: ["moe-expert-parallel"]}    # 4 processes on 2 cores are slow: the case that cuts the most
WIDE = dict(linear_num_key_heads=4, linear_num_value_heads=8)      # GDN heads that 4 ranks can share


def build(name: str, world: int):
    kw, moe, _, _ = CASES[name]
    cfg = (moe_config if moe else tiny_target_config)(**{**WIDE, **kw})
    target = random_target(cfg, 11)
    return target, random_drafter(tiny_draft_config(cfg, block_size=8), 12)


def sequence(target, comm=None) -> dict:
    """The cached calls a generation makes, over f64: prefill 9, verify 6, keep 4, two decode steps; their logits, and
    (with comm) the bytes all-reduced by each call."""
    import engine
    cache = M.TargetCache(target.cfg, 64, torch.float64, "cpu", max_block=8)
    logits, sent, start = [], [], 0
    for ids, verify in ((PROMPT, False), ([7, 1, 2, 3, 4, 5], True), ([6], False), ([40], False)):
        before = comm.bytes if comm else 0
        with torch.no_grad():
            lg, _ = target(torch.tensor([ids]), torch.arange(start, start + len(ids)), cache, verify=verify)
        logits.append(lg)
        sent.append((comm.bytes - before) if comm else 0)
        if verify:
            cache.commit(torch.tensor(4))
            start += 4
        else:
            start += len(ids)
    ar = engine.run(target, PROMPT, 60)
    from helpers import OracleProposer
    oracle = engine.run(target, PROMPT, 60, proposer=OracleProposer({tuple(PROMPT): ar.output_ids}, target.cfg.vocab_size, 1, 8),
                        block_size=8)
    return dict(logits=logits, sent=sent, ar=ar.output_ids, oracle=oracle.output_ids, oracle_lengths=oracle.acceptance_lengths)


def generations(target, drafter) -> dict:
    import engine
    from sampling import Sampling
    proposer = engine.DrafterProposer(drafter, target)
    s = Sampling(0.9)
    return dict(dflash=engine.run(target, PROMPT, 24, proposer=proposer, block_size=8).output_ids,
                sampled_ar=engine.run(target, PROMPT, 24, sampling=s, seed=5).output_ids,
                sampled_dflash=engine.run(target, PROMPT, 24, proposer=proposer, block_size=8, sampling=s,
                                                  seed=5).output_ids)


def mtp_pair():
    import mtp
    from helpers import randomize_
    target, _ = build("dense", 2)
    return target, mtp.MTPProposer(randomize_(mtp.MTPHead(target.cfg), 13).to(torch.float64).eval(), target, 3)


def mtp_run(target, proposer) -> tuple:
    import engine
    res = engine.run(target, PROMPT, 24, proposer=proposer, block_size=4)
    return res.output_ids, res.acceptance_lengths


def tree_run(target, drafter) -> list:
    import engine
    import tree
    trees = tree.DFlashTree(engine.DrafterProposer(drafter, target), 3)
    return tree.TreeEngine(target, trees, 6, 64).generate(PROMPT, 20).output_ids


class Recording:
    """A policy.Policy that records what it would decide itself (every rank's own, from its own times); `slow`: the
    rounds' seconds it is told are that many times what they took (a rank whose clock runs slow then)."""

    def __init__(self, block: int, slow: float = 1.0):
        import policy
        self.inner, self.own, self.slow = policy.Policy(block=block), [], slow
        self.blocks = self.inner.blocks

    def reset(self):
        self.inner.reset()

    def speculate(self):
        self.own.append(self.inner.speculate())
        return self.own[-1]

    def observe_round(self, committed, k, seconds):
        self.inner.observe_round(committed, k, seconds * self.slow)

    def observe_plain(self, seconds):
        self.inner.observe_plain(seconds)

    def shadow(self):
        return self.inner.shadow()

    def observe_shadow(self, b, k, committed):
        self.inner.observe_shadow(b, k, committed)

    def admit(self, b):
        self.inner.admit(b)

    def leave(self, b):
        self.inner.leave(b)

    def calibrate(self, calibration):
        self.inner.calibrate(calibration)


class Skewed:
    """time for engine.py on a rank whose clock disagrees: every reading a random 0-50 ms later than the last
    (a rank descheduled at random on a busy machine), so its policy measures other step costs than rank 0's."""

    def __init__(self, seed: int):
        import random
        self.rng, self.offset = random.Random(seed), 0.0

    def perf_counter(self) -> float:
        import time
        self.offset += self.rng.uniform(0.0, 0.05)
        return time.perf_counter() + self.offset


def decided_once(target, drafter, rank: int, par) -> dict:
    """24 requests at 3 slots under the default policy, rank 1's clock skewed (and its policy told its rounds took 100
    times as long): every rank must take rank 0's steps
    (else the ranks' collectives part and the run aborts) and give the same outputs; `own`: what each rank's policy
    would have decided alone."""
    import engine
    requests = [engine.Request([(7 * i + j) % 50 + 1 for j in range(3 + i % 5)], 16 + i % 3) for i in range(24)]
    policy = Recording(8, slow=100.0 if rank == 1 else 1.0)       # rank 1's own policy: rounds never pay once timed
    eng = engine.Engine(target, engine.DrafterProposer(drafter, target), 8, 3, 64, policy=par.synced(policy))
    real = engine.time
    if rank == 1:
        engine.time = Skewed(rank)
    try:
        results = eng.run(requests)
    finally:
        engine.time = real
    return {"outputs": [r.output_ids for r in results], "kinds": [r.step_kinds for r in results], "own": policy.own}


def rank_main(rank: int, world: int, store: str) -> None:
    """One rank of the gloo runs: every case cut to this rank's part, its results saved for the parent."""
    import torch.distributed as dist
    import engine
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))     # a mismatch fails, never hangs
    out = {}
    for name in AT[world]:
        _, _, expert_parallel, shard_drafter = CASES[name]
        target, drafter = build(name, world)
        par = tp.Parallel(rank, world, dist.group.WORLD, "cpu", expert_parallel, shard_drafter)
        par.shard(target, engine.DrafterProposer(drafter, target))
        out[name] = {**sequence(target, par.comm), **generations(target, drafter), "cfg": target.cfg,
                     "drafter_kv": drafter.cfg.num_key_value_heads}
    par = tp.Parallel(rank, world, dist.group.WORLD, "cpu")
    out["same"] = par.same(rank + 10)                   # rank 0's value (a random seed) on every rank
    if world == 2:      # the policy decides on rank 0 only, whatever the other ranks' clocks say
        target, drafter = build("dense", world)
        tp.Parallel(rank, world, dist.group.WORLD, "cpu").shard(target, engine.DrafterProposer(drafter, target))
        out["decided"] = decided_once(target, drafter, rank, par)
    if world == 2:      # the MTP head, cut as the target's layers are (its cache from the shard's config)
        target, proposer = mtp_pair()
        tp.Parallel(rank, world, dist.group.WORLD, "cpu").shard(target, proposer)
        out["mtp"] = mtp_run(target, proposer)
        target, drafter = build("dense", world)         # a tree verify: GDN per node on each rank's heads
        tp.Parallel(rank, world, dist.group.WORLD, "cpu", shard_drafter=True).shard(target, engine.DrafterProposer(drafter, target))
        out["tree"] = tree_run(target, drafter)
    out["compiler_imported"] = "torch._dynamo" in sys.modules       # every call so far was eager
    if world == 2:      # compile on each rank: the all-reduces traced into the compiled decode step
        target, _ = build("dense", world)
        tp.Parallel(rank, world, dist.group.WORLD, "cpu").shard(target, None)
        eng = engine.Engine(target, None, 1, 1, 64, compile_mode="default")
        out["compiled_ar"] = eng.generate(PROMPT, 12).output_ids
    torch.save(out, f"{store}/rank{rank}.pt")
    dist.destroy_process_group()


def run_ranks() -> dict:
    """degree -> every rank's results: the gloo process groups of 2, then of 4 ranks."""
    import tempfile
    import torch.multiprocessing as mp
    out = {}
    for world in (2, 4):
        with tempfile.TemporaryDirectory(prefix=f"tp{world}") as store:
            mp.spawn(rank_main, args=(world, store), nprocs=world, join=True, daemon=True)   # (daemons: end with the session)
            out[world] = [torch.load(f"{store}/rank{r}.pt", weights_only=False) for r in range(world)]
    return out


RANKS = Early(run_ranks)        # started with the suite, on the core its one-thread tests leave idle


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, RANKS.result()[request.param]


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_equal_one_process(ranks, name):
    """Logits within 1e-10 of the whole model's (f64), the same bits on every rank; greedy AR, DFlash (a random
    drafter, replicated or cut, and an oracle forcing every acceptance length) and sampled outputs identical to one
    process's, and DFlash == AR under TP."""
    world, results = ranks
    if name not in AT[world]:
        pytest.skip(f"{name} runs at degree 2 (the shard maths at 4: the unit tests above)")
    target, drafter = build(name, world)
    want = {**sequence(target), **generations(target, drafter)}
    for r, got in enumerate(results):
        got = got[name]
        assert got["cfg"].num_attention_heads == 4 // world and got["cfg"].linear_num_value_heads == 8 // world
        assert got["drafter_kv"] == (max(1, 2 // world) if CASES[name][3] else 2)
        for g, w in zip(got["logits"], want["logits"]):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
        for g, r0 in zip(got["logits"], results[0][name]["logits"]):
            assert torch.equal(g, r0)                                  # every rank chooses from the same numbers
        for key in ("ar", "oracle", "oracle_lengths", "dflash", "sampled_ar", "sampled_dflash"):
            assert got[key] == want[key], (r, key)
        assert got["dflash"] == got["ar"][:24] and got["oracle"] == got["ar"]
        assert got["sampled_dflash"] == got["sampled_ar"]
        assert sorted(set(got["oracle_lengths"])) == list(range(1, 9))         # every acceptance length, 0..7 + 1
        H, L, size = target.cfg.hidden_size, target.cfg.num_hidden_layers, 8
        assert got["sent"] == [tp.allreduce_bytes(target.cfg, T, size) for T in (9, 6, 1, 1)] == \
               [2 * L * T * H * size for T in (9, 6, 1, 1)]


def test_eager_ranks_never_import_the_compiler(ranks):
    """Eager all-reduces go through torch.distributed itself: functional collectives' first eager call would import
    torch._dynamo (1.5 s and more in each rank's process)."""
    world, results = ranks
    assert not any(r["compiler_imported"] for r in results)


def test_every_rank_takes_rank_0s_decisions_and_seed(ranks):
    """tp.Synced: rank 0's policy decides every step (a round of k or a plain step) for every rank, so a rank whose clock disagrees (rank 1's skewed at random) still takes the same steps
    and the run completes with the outputs of one process; Parallel.same: rank 0's value everywhere."""
    world, results = ranks
    assert [r["same"] for r in results] == [10] * world
    if world != 2:
        return
    decided = [r["decided"] for r in results]
    assert decided[0]["kinds"] == decided[1]["kinds"] and decided[0]["outputs"] == decided[1]["outputs"]
    kinds = [k for run in decided[0]["kinds"] for k in run]
    assert "verify" in kinds and "plain" in kinds                # the policy did choose, both ways
    # the skewed rank's own policy would have taken other steps (plain steps where rank 0 took rounds): the
    # disagreement the broadcast overrides
    assert decided[1]["own"] != decided[0]["own"]
    import engine
    target, drafter = build("dense", 2)
    alone = [engine.run(target, r.prompt_ids, r.max_new_tokens).output_ids
             for r in [engine.Request([(7 * i + j) % 50 + 1 for j in range(3 + i % 5)], 16 + i % 3) for i in range(24)]]
    assert decided[0]["outputs"] == alone


def test_the_mtp_head_under_tp(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("the MTP head runs at degree 2")
    want = mtp_run(*mtp_pair())
    assert all(r["mtp"] == want for r in results)
    assert want[0] == __import__("engine").run(build("dense", 2)[0], PROMPT, 24).output_ids


def test_a_tree_under_tp(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("trees run at degree 2")
    target, drafter = build("dense", 2)
    want = tree_run(target, drafter)
    assert all(r["tree"] == want for r in results)
    assert want == __import__("engine").run(target, PROMPT, 20).output_ids


def test_compiled_steps_under_tp(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("compiled at degree 2 only (a minute of compiling per degree on a CPU)")
    target, _ = build("dense", world)
    want = __import__("engine").run(target, PROMPT, 12).output_ids
    assert all(r["compiled_ar"] == want for r in results)


@pytest.mark.parametrize("kind", ["dense", "moe", "moe-expert-parallel", "tied"])
def test_reading_layer_by_layer_equals_cutting_the_loaded_model(kind, tmp_path, monkeypatch):
    """Parallel.load_target (each layer read, cut and placed before the next is read) == ckpt.load_target then
    Parallel.shard, tensor for tensor, on every rank; no read holds two layers' tensors; and a rank copies out of
    the files exactly the elements it keeps (its slices of the cut weights, the replicated ones whole): per-expert
    files (moe) included."""
    import checkpoint as ckpt
    cfg = moe_config(**WIDE) if kind.startswith("moe") else tiny_target_config(**WIDE, tie_word_embeddings=kind == "tied")
    ckpt.save_target(random_target(cfg, 14, torch.float32), str(tmp_path), dtype=torch.float32)
    reads = []
    real = ckpt.read_safetensors
    monkeypatch.setattr(ckpt, "read_safetensors", lambda *a, **kw: reads.append(real(*a, **kw)) or reads[-1])
    copied = []                 # every tensor copied out of a file: what Stored.fill filled, what read_part returned
    fill, read_part = ckpt.Stored.fill, ckpt.Stored.read_part
    monkeypatch.setattr(ckpt.Stored, "fill", lambda self, out: copied.append(out.numel()) or fill(self, out))
    monkeypatch.setattr(ckpt.Stored, "read_part", lambda self, *a: copied.append(read_part(self, *a)) or copied[-1])
    for rank in range(2):
        par = tp.Parallel(rank, 2, None, "cpu", expert_parallel=kind == "moe-expert-parallel")
        reads.clear(), copied.clear()
        streamed = par.load_target(str(tmp_path), torch.float64, "cpu")
        held = sum(p.numel() for p in streamed.parameters())       # (a tied head counted once)
        assert sum(c if isinstance(c, int) else c.numel() for c in copied) == held
        layers_per_read = [{n.split(".")[2] for n in r if n.startswith("model.layers.")} for r in reads]
        assert max(len(l) for l in layers_per_read) == 1 and len(reads) == cfg.num_hidden_layers + 1
        par.shard(streamed, None)
        whole = ckpt.load_target(str(tmp_path), torch.float64, "cpu")
        par.shard(whole, None)
        a, b = streamed.state_dict(), whole.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert streamed.cfg == whole.cfg and streamed.cfg.num_attention_heads == 2
        assert (streamed.lm_head.weight is streamed.embed_tokens.weight) == (kind == "tied")
        pos = torch.arange(3)
        torch.testing.assert_close(streamed.rope(pos, torch.float64), whole.rope(pos, torch.float64))


@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.3.up_proj.weight",      # a per-expert file's part
                                  "model.layers.3.self_attn.o_proj.weight"])           # a row-parallel slice
def test_a_rank_finds_a_nan_in_the_slice_it_reads(name, tmp_path):
    """A NaN in a cut weight is found by the rank whose slice holds it, reading only its slice, and named with its
    tensor and file (as a whole read names it); the other rank, which never reads that element, loads."""
    import checkpoint as ckpt
    from safetensors.torch import load_file, save_file
    ckpt.save_target(random_target(moe_config(**WIDE), 15, torch.float32), str(tmp_path), dtype=torch.float32)
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    tensors[name][-1, -1] = float("nan")            # the last row and column: rank 1's slice either way
    save_file(tensors, f, metadata={"format": "pt"})
    tp.Parallel(0, 2, None, "cpu").load_target(str(tmp_path), torch.float32, "cpu")
    with pytest.raises(ckpt.CheckpointError, match=f"tensor {re.escape(name)} in {re.escape(f)} holds NaN or infinite values"):
        tp.Parallel(1, 2, None, "cpu").load_target(str(tmp_path), torch.float32, "cpu")
