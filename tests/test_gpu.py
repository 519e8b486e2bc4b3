"""Checks that need a CUDA device (skipped elsewhere; bench_gpu.sh runs them): one host-device sync per
draft-verify round, and DFlash == AR on the GPU in float64."""
import warnings

import pytest
import torch

import dflash
from helpers import random_drafter, random_target, tiny_draft_config, tiny_target_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_one_sync_per_round():
    """torch.cuda.set_sync_debug_mode("warn") warns at every synchronising call: between two steps of a
    generation (one draft-verify round, or one AR token) there must be exactly one."""
    tcfg = tiny_target_config()
    target = random_target(tcfg, 0, torch.float32).cuda()
    drafter = random_drafter(tiny_draft_config(tcfg), 1, torch.float32).cuda()
    prompt = list(range(3, 40))
    for proposer, block in ((dflash.DrafterProposer(drafter, target), 8), (None, 1)):
        engine = dflash.Engine(target, proposer, block, 128)
        engine.run(prompt, 20)                                   # warm-up: lazy inits may sync once
        steps = engine.generate(prompt, 40)
        next(steps)                                              # prefill
        torch.cuda.set_sync_debug_mode("warn")
        try:
            counts = []
            while True:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        step = next(steps)
                    except StopIteration:
                        break
                counts.append(sum("synchroniz" in str(w.message) for w in caught))
                assert step.kind in ("verify", "decode")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert counts and all(c == 1 for c in counts), counts


def test_dflash_equals_ar_on_the_gpu():
    tcfg = tiny_target_config()
    target = random_target(tcfg, 2).cuda()
    drafter = random_drafter(tiny_draft_config(tcfg), 3).cuda()
    prompt = list(range(5, 70))
    ar = dflash.run(target, prompt, 48, block_size=1, capacity=256)
    sp = dflash.run(target, prompt, 48, proposer=dflash.DrafterProposer(drafter, target), block_size=8, capacity=256)
    assert sp.output_ids == ar.output_ids


def test_compiled_steps_replay_as_cuda_graphs():
    """reduce-overhead on CUDA: every compiled step runs as a CUDA graph (inductor raises on any skip, e.g.
    "mutated inputs" when a cache is not marked static: compiling.mark_static_), and the tokens are AR's."""
    import torch._inductor.config as inductor_config
    tcfg = tiny_target_config()
    target = random_target(tcfg, 4, torch.float32).cuda()
    drafter = random_drafter(tiny_draft_config(tcfg), 5, torch.float32).cuda()
    prompt = list(range(7, 50))
    ar = dflash.run(target, prompt, 40, block_size=1, capacity=160)
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        for proposer, block in ((dflash.DrafterProposer(drafter, target), 8), (None, 1)):
            engine = dflash.Engine(target, proposer, block, 160, compile_mode="reduce-overhead")
            engine.run(prompt, 24)                               # warm-up and recording
            assert engine.run(prompt, 40).output_ids == ar.output_ids
