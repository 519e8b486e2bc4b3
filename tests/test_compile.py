"""torch.compile of the step functions: one graph per step kind, no recompiles after warm-up, same tokens."""
import os

import pytest

import dflash
from helpers import EMBEDDED_DRAFT, embedded_pair


@pytest.mark.skipif(not os.path.exists(os.path.join(EMBEDDED_DRAFT, "model.safetensors")), reason="embedded pair not present")
def test_no_recompiles_after_warmup_and_same_tokens():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    target, drafter, p1, p2 = embedded_pair()
    eng = dflash.Engine(target, dflash.DrafterProposer(drafter, target), 16, 256, compile_mode="default")
    eng.run(p1, 40)                                                       # warm-up: compiles each step once
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        res = eng.run(p2, 120)                                            # another prompt length, many acceptance lengths
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(set(res.acceptance_lengths)) >= 3
    eager = dflash.run(target, p2, 120)
    assert res.output_ids == eager.output_ids


@pytest.mark.skipif(not os.path.exists(os.path.join(EMBEDDED_DRAFT, "model.safetensors")), reason="embedded pair not present")
def test_compiled_sampling_equals_eager_and_follows_new_settings():
    """Sampling constants are compiled into the sampling step: a generation with other constants must run a
    graph made for them (dynamo's guards), never the previous one. Same seed -> the eager engine's tokens."""
    import torch
    target, drafter, p1, p2 = embedded_pair()
    proposer = dflash.DrafterProposer(drafter, target)
    compiled = dflash.Engine(target, proposer, 16, 256, compile_mode="default")
    eager = dflash.Engine(target, proposer, 16, 256)
    for s in (dflash.Sampling(0.7, 0.9, 0), dflash.Sampling(1.3, 1.0, 5), dflash.Sampling(0.7, 0.9, 0)):
        for p in (p1, p2):
            got = compiled.run(p, 40, sampling=s, generator=torch.Generator().manual_seed(7))
            want = eager.run(p, 40, sampling=s, generator=torch.Generator().manual_seed(7))
            assert got.output_ids == want.output_ids, s
