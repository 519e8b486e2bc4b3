"""Checks that need a CUDA device (skipped elsewhere; bench_gpu.sh runs them): one host-device sync per step of
engine.Engine (a draft-verify round or an AR step of every slot), DFlash == AR on the GPU in float64, compiled
steps replayed as CUDA graphs, and grouped-head attention with a mask on a fused SDPA kernel."""
import warnings

import pytest
import torch

import engine
from helpers import random_drafter, random_target, tiny_draft_config, tiny_target_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Marks(engine.Observer):
    """The synchronising calls warned about so far (`caught`), marked after each admission and after each step."""

    def __init__(self, caught):
        self.caught, self.marks = caught, []

    def mark(self, kind):
        self.marks.append((kind, sum("synchroniz" in str(w.message) for w in self.caught)))

    def stepped(self, live):
        self.mark("step")


@pytest.mark.parametrize("slots", [1, 3])
def test_one_sync_per_step(slots):
    """torch.cuda.set_sync_debug_mode("warn") warns at every synchronising call: each step of the engine (one
    draft-verify round of every slot, or one AR token of every slot) must make exactly one, with 1 or 3 requests
    in flight."""
    tcfg = tiny_target_config()
    target = random_target(tcfg, 0, torch.float32).cuda()
    drafter = random_drafter(tiny_draft_config(tcfg), 1, torch.float32).cuda()
    reqs = [engine.Request(list(range(3 + i, 40 + 2 * i)), 40 - 5 * i) for i in range(slots)]
    for proposer, block in ((engine.DrafterProposer(drafter, target), 8), (None, 1)):
        eng = engine.Engine(target, proposer, block, slots, 128)
        eng.run([engine.Request(r.prompt_ids, 20) for r in reqs])        # warm-up: lazy inits may sync once
        kinds = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            observer = Marks(caught)

            def on_step(index, step):
                kinds.append(step.kind)
                if step.kind == "prefill":          # an admission's own syncs are not a step's
                    observer.mark("prefill")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.run(reqs, on_step, observer)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts = [b - a for (_, a), (kind, b) in zip(observer.marks, observer.marks[1:]) if kind == "step"]
        assert set(kinds) == {"prefill", "verify" if proposer is not None else "decode"}
        assert counts and all(c == 1 for c in counts), counts


@pytest.mark.parametrize("slots", [1, 3])
def test_dflash_equals_ar_on_the_gpu(slots):
    """float64 on the GPU: a request alone (engine.run) or three in an Engine of 3 slots, each == its AR run."""
    tcfg = tiny_target_config()
    target = random_target(tcfg, 2).cuda()
    drafter = random_drafter(tiny_draft_config(tcfg), 3).cuda()
    V = tcfg.vocab_size
    reqs = [engine.Request([t % V for t in range(5 + i, 70 - 7 * i)], 48 - 9 * i) for i in range(slots)]   # ids < V
    ar = [engine.run(target, r.prompt_ids, r.max_new_tokens, block_size=1, capacity=256).output_ids for r in reqs]
    proposer = engine.DrafterProposer(drafter, target)
    if slots == 1:
        sp = [engine.run(target, reqs[0].prompt_ids, 48, proposer=proposer, block_size=8, capacity=256)]
    else:
        sp = engine.Engine(target, proposer, 8, slots, 256).run(reqs)
    assert [r.output_ids for r in sp] == ar


def test_compiled_steps_replay_as_cuda_graphs():
    """reduce-overhead on CUDA: every compiled step runs as a CUDA graph (inductor raises on any skip, e.g.
    "mutated inputs" when a cache is not marked static: compiling.mark_static_), and the tokens are AR's."""
    import torch._inductor.config as inductor_config
    tcfg = tiny_target_config()
    target = random_target(tcfg, 4, torch.float32).cuda()
    drafter = random_drafter(tiny_draft_config(tcfg), 5, torch.float32).cuda()
    prompt = list(range(7, 50))
    ar = engine.run(target, prompt, 40, block_size=1, capacity=160)
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        for proposer, block in ((engine.DrafterProposer(drafter, target), 8), (None, 1)):
            eng = engine.Engine(target, proposer, block, 1, 160, compile_mode="reduce-overhead")
            eng.generate(prompt, 24)                          # warm-up and recording
            assert eng.generate(prompt, 40).output_ids == ar.output_ids


@pytest.mark.parametrize("per_row", [False, True])
def test_grouped_attention_keeps_a_fused_kernel(per_row):
    """model.attention with grouped query heads (4 per kv head) and a boolean mask, as a 16-token verify of 3 rows
    over the cache calls it, runs with SDPA's math path switched off (its query heads folded: model.folded_attention)
    and equals the math path's grouped attention in float32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import model as M
    g = torch.Generator(device="cuda").manual_seed(0)
    B, hkv, G, Tq, S, D = 3, 2, 4, 16, 256, 64
    q = torch.randn(B, hkv * G, Tq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    pos = torch.tensor([[100], [150], [200]], device="cuda") + torch.arange(Tq, device="cuda")
    visible = torch.arange(S, device="cuda") <= pos[..., None]                  # [B,Tq,S]: causal over the cache
    mask = visible[:, None] if per_row else visible[0]
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        got = M.attention(q, k, v, mask)
    torch.testing.assert_close(got.float(), want.transpose(1, 2).reshape(B, Tq, -1), rtol=0, atol=2e-2)
