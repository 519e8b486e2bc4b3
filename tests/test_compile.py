"""torch.compile of the step functions: one graph per step kind, no recompiles after warm-up, same tokens."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

import compiling
from speed import cppwrapper
import dflash
import engine
import policy
from helpers import HAS_EMBEDDED_PAIR, ROOT, Early, embedded_pair, fresh_inductor_cache


def region_bodies_and_calls(code: str, wrapper: str) -> tuple:
    """In inductor's generated code of a step: the compiled region bodies it defines, and how often it calls them."""
    pattern = r"auto (\w+) = \[&\]\(" if wrapper == "cpp" else r"\ndef (\w*subgraph_\d+)\("
    bodies = re.findall(pattern, code)
    return bodies, sum(code.count(f"{b}(") for b in bodies) - (0 if wrapper == "cpp" else len(bodies))


def distinct_layers_compiled() -> tuple | None:
    """The work of the test below, in a process of its own (helpers.Early), with a fresh inductor cache: the embedded
    target's compiled decode step under the command lines' CPU wrapper, its weights kept as stored (bfloat16) ->
    (wrapper, region bodies, their calls, the number of generated codes, compiled tokens, eager tokens of the
    target widened at load and of the kept one with every one-row product a compiled multiply-sum, weight shapes
    the step allocated a buffer of)."""
    if not HAS_EMBEDDED_PAIR:
        return None
    from torch._inductor.utils import run_and_get_code
    import checkpoint as ckpt
    import model as M
    from helpers import EMBEDDED_TARGET
    wide, _, p1, _ = embedded_pair()
    target = ckpt.load_target(EMBEDDED_TARGET, torch.float32, weights="auto")
    assert target.lm_head.weight.dtype == torch.bfloat16 and target.dtype == torch.float32
    options = cppwrapper.options()
    wrapper = "cpp" if options.get("cpp_wrapper") else "python"
    eng = engine.Engine(target, None, 1, 1, 256, compile_mode="default", compile_options=options)
    request = [engine.Request(p1, 12)]
    with fresh_inductor_cache():
        got, codes = run_and_get_code(eng.run, request)
    bodies, calls = region_bodies_and_calls(codes[0], wrapper)
    shapes = {tuple(p.shape) for p in target.parameters() if p.dim() == 2 and p.shape[0] > 1}
    allocated = {tuple(int(n) for n in re.findall(r"\d+", dims)) for dims in
                 re.findall(r"int_array_\d+\[\] = \{([\dL, ]+)\}", codes[0]) + re.findall(r"empty_strided_cpu\(\(([\d, ]+)\)", codes[0])}
    eager = engine.Engine(wide, None, 1, 1, 256).run(request)[0].output_ids
    limit, M.EAGER_FUSED = M.EAGER_FUSED, 0
    try:
        kept_eager = engine.Engine(target, None, 1, 1, 256).run(request)[0].output_ids
    finally:
        M.EAGER_FUSED = limit
    return (wrapper, bodies, calls, len(codes), got[0].output_ids, eager, kept_eager, shapes & allocated,
            (len(set(target.cfg.layer_types)), target.cfg.num_hidden_layers))


# started with the suite, in a process of its own
DISTINCT_LAYERS = Early(distinct_layers_compiled, process=True, used_by=["test_each_distinct_layer_compiles_once"])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_each_distinct_layer_compiles_once():
    """With the command lines' CPU wrapper (speed/cppwrapper.py's C++ one; the Python wrapper where this torch cannot take
    the patch): in the compiled decode step of the embedded target each distinct decoder layer is compiled once and
    called per layer (torch.compiler.nested_compile_region), and the tokens are the eager batch's. Inductor lowers a
    region's body once whatever the wrapper; the C++ wrapper's calls of it are speed/cppwrapper.py's own code. One step
    kind: the regions are the model's, whichever step calls it (recompiles and the other kinds: the tests below).
    The target's weights are kept as the checkpoint stores them (bfloat16, under float32 arithmetic: the command
    line's default): the step reads them as they are, widening inside its product loops (no buffer of a weight's
    shape is allocated), and its tokens are those of the eager target widened at load; so are the eager kept
    target's, whose one-row products run model.kept_product's compiled multiply-sum (EAGER_FUSED lowered to 0)."""
    wrapper, bodies, calls, n_codes, got, eager, kept_eager, widened, (kinds, layers) = DISTINCT_LAYERS.result()
    assert n_codes == 1                                                   # the decode step (admission is eager)
    assert len(bodies) == kinds and calls == layers, (wrapper, bodies, calls)
    assert not widened, widened                                           # no widened copy of a weight
    assert got == eager == kept_eager


class Cycle(policy.Scripted):
    """A policy stand-in: the steps of `kinds` in turn (0: a plain step, k: a round verifying k), every plain step feeding
    the drafter's context."""

    def __init__(self, kinds: list):
        self.kinds, self.blocks, self.i = list(kinds), tuple(sorted({k for k in kinds if k}, reverse=True)), 0

    def reset(self):
        self.i = 0

    def speculate(self) -> int:
        self.i += 1
        return self.kinds[(self.i - 1) % len(self.kinds)]


def compiled_sampling() -> dict:
    """The work of the test below, in a process of its own (helpers.Early): the embedded pair's sampled generations,
    compiled and eager, pure rounds and mixed with plain steps, and plain eager sampled decoding."""
    if not HAS_EMBEDDED_PAIR:
        return {}
    target, drafter, p1, p2 = embedded_pair()
    compiled = engine.Engine(target, engine.DrafterProposer(drafter, target), 16, capacity=256, compile_mode="default")
    eager = engine.Engine(target, engine.DrafterProposer(drafter, target), 16, capacity=256)
    s = engine.Sampling(0.7, 0.9, 5)
    out = {"rounds": [(compiled.generate(p, 40, sampling=s, seed=7).output_ids,
                       eager.generate(p, 40, sampling=s, seed=7).output_ids) for p in (p1, p2)]}
    compiled.policy = Cycle([0, 0, 16, 0])             # plain steps (feeding the drafter's context) and rounds
    mixed = compiled.generate(p1, 40, sampling=s, seed=7)
    out["mixed"] = (set(mixed.step_kinds), mixed.output_ids, eager.generate(p1, 40, sampling=s, seed=7).output_ids,
                    engine.run(target, p1, 40, sampling=s, seed=7).output_ids)
    return out


# started with the suite, in a process of its own
SAMPLING = Early(compiled_sampling, process=True, used_by=["test_compiled_sampling_equals_eager"])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_compiled_sampling_equals_eager():
    """Sampled steps compiled by inductor (temperature, top-p and top-k, so both cuts' code): same seed -> the eager
    engine's tokens, and plain eager sampled decoding's (the position-keyed noise computed inside the compiled steps is
    the eager one), with pure rounds and with rounds and plain steps. (Other settings run other graphs: the test
    below.)"""
    r = SAMPLING.result()
    for got, want in r["rounds"]:
        assert got == want
    kinds, mixed, eager, ar = r["mixed"]
    assert kinds == {"plain", "verify"}
    assert mixed == eager == ar


def sampling_settings_graphs() -> list:
    """The work of the test below, in a process of its own (helpers.Early): four sampled generations with other
    settings, traced (helpers.dynamo_only) and eager -> per generation (compiled tokens, eager tokens, dynamo's
    unique graphs so far)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from helpers import dynamo_only, random_drafter, random_target, tiny_draft_config, tiny_target_config
    with pytest.MonkeyPatch.context() as monkeypatch:
        dynamo_only(monkeypatch)
        cfg = tiny_target_config(vocab_size=60)
        target = random_target(cfg, 3, torch.float32)
        drafter = random_drafter(tiny_draft_config(cfg, block_size=4), 4, torch.float32)
        engines = [engine.Engine(target, engine.DrafterProposer(drafter, target), 4, capacity=64, **kw)
                   for kw in ({"compile_mode": "default", "policy": Cycle([4])}, {"policy": Cycle([4])})]
        prompt, out = list(range(5, 25)), []
        for s in SETTINGS:
            got, want = (e.generate(prompt, 24, sampling=s, seed=11) for e in engines)
            out.append((got.output_ids, want.output_ids, counters["stats"]["unique_graphs"]))
        return out


SETTINGS = [engine.Sampling(0.7, 0.9, 0), engine.Sampling(1.3, 1.0, 5), engine.Sampling(0.7, 0.9, 0),
            engine.Sampling(1.0, 0.8, 3)]
# started with the suite, in a process of its own
SAMPLING_SETTINGS = Early(sampling_settings_graphs, process=True,
                          used_by=["test_new_sampling_settings_run_graphs_made_for_them"])


def test_new_sampling_settings_run_graphs_made_for_them():
    """Which cuts a run's sampling makes (top-k, top-p) are constants of the compiled steps: a generation with other
    settings must run a graph made for them (dynamo's guards), never the previous one, and settings seen before run
    their graph again without compiling. Each generation gives the eager engine's tokens for the same seed. Which
    graph a call runs is dynamo's decision, so the steps run traced, without inductor's code (helpers.dynamo_only;
    inductor's sampled code: the test above)."""
    runs = SAMPLING_SETTINGS.result()
    for (got, want, _), s in zip(runs, SETTINGS):
        assert got == want, s
    graphs = [g for *_, g in runs]
    new = [b > a for a, b in zip(graphs, graphs[1:])]
    assert new == [True, False, True], graphs              # top-k only; top-p again; both


def test_mark_static_covers_every_cache_tensor():
    """Every tensor a compiled step may write in place (all of TargetCache's and DraftCache's) is marked, so
    CUDA graphs can replay those steps (compiling.mark_static_; the replay itself is tests/test_gpu.py's)."""
    import torch
    from helpers import tiny_draft_config, tiny_target_config
    import model as M
    tcfg = tiny_target_config()
    caches = [M.TargetCache(tcfg, 32, torch.float32, "cpu", max_block=8),
              M.DraftCache(tiny_draft_config(tcfg), 32, torch.float32, "cpu")]
    seen = 0
    for cache in caches:
        compiling.mark_static_(cache)
        for layer in cache.layers:
            for name, t in vars(layer).items():
                if isinstance(t, torch.Tensor):
                    assert getattr(t, "_dynamo_static_input_type", None) == "unguarded", (type(layer).__name__, name)
                    seen += 1
    n_gdn = sum(t != "full_attention" for t in tcfg.layer_types)
    assert seen == 6 * n_gdn + 2 * (len(tcfg.layer_types) - n_gdn) + 2 * tiny_draft_config(tcfg).num_hidden_layers


def test_a_layer_cache_hands_its_fields_in_order():
    """A decoder layer's compiled region takes its cache as the tensors of cache.tensors(), which rebuild the
    cache by position (DecoderLayer.layer): every field, in the dataclass's order, the same tensor objects."""
    import dataclasses
    from helpers import tiny_target_config
    import model as M
    cache = M.TargetCache(tiny_target_config(), 32, torch.float32, "cpu", max_block=8)
    for layer in cache.layers:
        names = [f.name for f in dataclasses.fields(layer)]
        assert len(layer.tensors()) == len(names)
        assert all(t is getattr(layer, n) for t, n in zip(layer.tensors(), names)), type(layer).__name__
        assert type(layer)(*layer.tensors()) == layer

def compiled_dflash2_batch() -> list:
    """The work of the test below, in a process of its own (helpers.Early): a 2-slot DFlash2 batch compiled, warmed
    up, then run on later requests with recompiles raising; and the eager batch with the same history. -> per
    request (compiled output, compiled drafts, eager output, eager drafts, whether it verified)."""
    import random
    import torch._dynamo
    from helpers import kind_draft_config, random_drafter, random_target, tiny_target_config
    with fresh_inductor_cache():
        target = random_target(tiny_target_config(vocab_size=40), 11, torch.float32)
        dcfg = kind_draft_config(target.cfg, "dflash2", block_size=4, target_layer_ids=[0, 2], num_target_layers=None)
        drafter = random_drafter(dcfg, 12, torch.float32)
        make = lambda: engine.DrafterProposer(drafter, target)
        rng = random.Random(3)

        def requests(k):
            return [engine.Request([rng.randrange(1, 40) for _ in range(rng.randint(5, 30))], rng.randint(8, 24))
                    for _ in range(k)]
        early, later = requests(2), requests(3)
        eng = engine.Engine(target, make(), 4, 2, 64, compile_mode="default")
        eng.warm_up(early)                                                       # every step kind
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = eng.run(later)
        # the eager engine with the same history (a warm-up on the same requests): both start the later requests
        # from the same state
        eager = engine.Engine(target, make(), 4, 2, 64)
        eager.warm_up(early)
        eager = eager.run(later)
        reference = [dflash.generate(target, drafter, r.prompt_ids, r.max_new_tokens, 4) for r in later]
        return [(a.output_ids, a.draft_ids, b.output_ids, b.draft_ids, bool(a.verify_lengths), ref)
                for a, b, ref in zip(got, eager, reference)]


# started with the suite, in a process of its own
DFLASH2_BATCH = Early(compiled_dflash2_batch, process=True, used_by=["test_compiled_batch_with_a_dflash2_drafter"])


def test_compiled_batch_with_a_dflash2_drafter():
    """The batch's steps as the command lines compile them (inductor, fullgraph: DFlash2's row-by-row candidate
    choice, its sort and gathers, stays on the device), 2 slots, pure rounds of the whole block: after a warm-up,
    no recompiles, and the eager batch's tokens and proposals. Run for DFlash2's rounds only: its plain steps and
    appends are a DFlash drafter's (compiled in test_flex.py), and the sliding-window drafter and the
    MTP head are made of the ops of the graphs compiled in the other tests (attention under a mask, decoder
    layers); their batches' recompiles are tested traced (test_batching.py). Each request's tokens are also the
    reference loop's (dflash.generate), the compiled twin of tests/test_reference.py's property."""
    rows = DFLASH2_BATCH.result()
    assert any(verified for *_, verified, _ in rows)
    for out, drafts, eager_out, eager_drafts, _, reference in rows:
        assert out == eager_out and drafts == eager_drafts
        assert out == reference                 # the reference loop's tokens (dflash.generate; float32 here)


TWO_LENGTHS_FLAGS = ["--compile", "--compile-mode", "default", "--max-new-tokens", "20", "--json",
                     "--block-size", "2", "--no-adaptive"]    # (pure rounds of 2: three step kinds to compile, not six)


def two_prompt_lengths_compiled() -> dict | None:
    """The work of the test below, in a process of its own (helpers.Early), with a fresh inductor cache: generate.py's
    command line run twice in this process for two prompt lengths (per run: its JSON, its stderr, inductor's
    counters after it), then once more in a process of its own (its return code, JSON line and stderr)."""
    if not HAS_EMBEDDED_PAIR:
        return None
    import contextlib
    import io
    import json
    from torch._dynamo.utils import counters
    import generate
    runs = []
    with fresh_inductor_cache() as cache:
        for prompt in ("def f(x):", "class Stack:\n    def push(self, item):\n        self.items.append(item)"):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = generate.cli(["--prompt", prompt, *TWO_LENGTHS_FLAGS])
            runs.append((rc, json.loads(out.getvalue().strip().splitlines()[-1]), err.getvalue(), dict(counters["inductor"])))
        done = subprocess.run([sys.executable, "generate.py", "--prompt", "def f(x):", *TWO_LENGTHS_FLAGS,  # the suite's
                               "--threads", str(torch.get_num_threads())], cwd=ROOT,  # 1 thread: threads shape the code
                              env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}, capture_output=True, text=True, timeout=600)
    third = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    return {"runs": runs, "third": (done.returncode, third, done.stderr)}


# started with the suite, in a process of its own
TWO_LENGTHS = Early(two_prompt_lengths_compiled, process=True, used_by=["test_two_prompt_lengths_compile_once"])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_two_prompt_lengths_compile_once():
    """`generate.py --compile` for two prompts of different lengths (one process, a fresh inductor cache): the
    default cache length is the same power of two for both, so the second run compiles no graph anew (with
    caches sized exactly, its new shapes would). Across processes the same shapes make inductor's on-disk
    cache serve the graphs: a second process compiles none. Each run says that it compiles, how long it took and
    how many graphs it compiled."""
    r = TWO_LENGTHS.result()
    (rc1, first, err1, c1), (rc2, second, err2, c2) = r["runs"]
    assert rc1 == rc2 == 0
    assert len(first["prompt_ids"]) != len(second["prompt_ids"]) and first["cache_len"] == second["cache_len"] == 256
    assert c1.get("fxgraph_cache_miss", 0) > 0                                       # the first run compiled
    assert c2.get("fxgraph_cache_miss", 0) == c1["fxgraph_cache_miss"], (c1, c2)     # the second compiled nothing
    for err in (err1, err2):
        assert "compiling the step functions for a 256-position cache" in err and "compiled in " in err, err
    assert first["graphs_compiled"] > 0 and second["graphs_compiled"] == 0
    # a second process running the first command again: every graph from inductor's on-disk cache, none compiled
    rc3, third, err3 = r["third"]
    assert rc3 == 0, err3
    assert third["graphs_compiled"] == 0 and third["graphs_cached"] > 0, third
    assert third["output_ids"] == first["output_ids"] and "graphs compiled, " in err3


def test_default_capacity_is_a_power_of_two():
    need = [1, 100, 256, 257, 1000, 5000]
    assert [dflash.default_capacity(n, 10 ** 6) for n in need] == [256, 256, 256, 512, 1024, 8192]
    assert dflash.default_capacity(5000, 6000) == 6000          # capped by what max_position_embeddings allows
    assert dflash.default_capacity(300, 200) == 300             # never below the need (check_inputs refuses it later)


def test_compiled_steps_check_the_models_once_per_generation(monkeypatch):
    """Compiled steps skip dynamo's per-call checks of the models (Engine._compile) and the Engine checks them once
    per generation instead (compiling.model_state). So: two Engines over models of the same shapes that differ only in
    a constant compiled into the steps (the norms' eps) each run steps of their own and give their eager tokens;
    weights edited in place are read by the next call; a model changed in what the steps take as fixed (a dtype,
    an attribute, a hook) is refused with a one-line error before any step runs. Which graph a call runs is dynamo's
    decision, so the steps run traced, without inductor's code (helpers.dynamo_only)."""
    import torch
    import torch._dynamo
    from helpers import dynamo_only, random_target, tiny_target_config
    dynamo_only(monkeypatch)
    torch._dynamo.reset()
    prompt = list(range(3, 20))
    models = [random_target(tiny_target_config(rms_norm_eps=eps), 21, torch.float32) for eps in (1e-6, 4.0)]
    engines = [engine.Engine(m, None, 1, capacity=64, compile_mode="default") for m in models]
    outs = [e.generate(prompt, 12).output_ids for e in engines]
    wants = [engine.run(m, prompt, 12).output_ids for m in models]
    assert outs == wants and wants[0] != wants[1]
    target, eng = models[0], engines[0]
    with torch.no_grad():
        target.layers[0].mlp.down_proj.weight.mul_(-3.0)                 # values: read by every call
    assert eng.generate(prompt, 12).output_ids == engine.run(target, prompt, 12).output_ids
    hook = []
    changes = [(lambda: setattr(target.norm, "eps", 0.5), lambda: setattr(target.norm, "eps", 1e-6)),
               (lambda: target.to(torch.float64), lambda: target.to(torch.float32)),
               (lambda: hook.append(target.layers[1].register_forward_hook(lambda *a: None)), lambda: hook.pop().remove())]
    for change, undo in changes:
        change()
        with pytest.raises(dflash.GenerationError, match="the models changed .* build a new Engine") as e:
            eng.generate(prompt, 4)
        assert "\n" not in str(e.value)
        undo()
        assert eng.generate(prompt, 12).output_ids == engine.run(target, prompt, 12).output_ids     # as compiled


def test_autotune_reports_are_off_unless_asked(monkeypatch):
    """max-autotune's stderr reports (a table per autotuned product, choice statistics) are off in the options every
    compiled step gets, by inductor options this torch knows; each comes back when its environment variable is set."""
    import importlib
    import torch
    import torch._inductor.config as inductor_config
    options = compiling.inductor_options("max-autotune", {}, torch.device("cpu"))
    assert options["autotune_num_choices_displayed"] == 0 and options["max_autotune_report_choices_stats"] is False
    assert all(hasattr(inductor_config, name) for name in compiling.QUIET)
    monkeypatch.setenv("TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED", "3")
    try:
        assert set(importlib.reload(compiling).QUIET) == {"max_autotune_report_choices_stats"}
    finally:
        monkeypatch.delenv("TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED")
        importlib.reload(compiling)


def test_cache_writes_compile_in_place():
    """model.write_slots inside a compiled step writes the call's rows where the cache lies: every loop of inductor's
    code spans the call's rows, none the cache (a scatter_ into a step's input compiles to a copy of the whole
    cache, the scatter and a copy back: two passes over every attention cache per call)."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code
    import model as M
    torch._dynamo.reset()
    cache, want = torch.zeros(2, 2, 512, 16), torch.zeros(2, 2, 512, 16)
    pos, x = torch.tensor([[3, 4, 5], [100, 101, 102]]), torch.randn(2, 2, 3, 16)
    step = torch.compile(M.write_slots, fullgraph=True, dynamic=False)
    _, codes = run_and_get_code(step, cache, pos, x)
    bounds = [int(n) for n in re.findall(r"x\d+<static_cast<int64_t>\((\d+)L\)", "\n".join(codes))]
    assert bounds and max(bounds) <= 2 * 2 * 3 * 16, bounds
    want[0, :, 3:6], want[1, :, 100:103] = x[0], x[1]
    assert torch.equal(cache, want)


class CudaGraphLifetimes:
    """On a CPU, the rule by which cudagraph trees (torch.compile on CUDA under reduce-overhead and max-autotune)
    free a compiled step's outputs: a call begins a new step when torch.compiler.cudagraph_mark_step_begin was
    called since the previous call, or on every call while it never was; a new step may overwrite every output of
    the steps before it. Here each compiled step runs eagerly (torch.compile patched to this object's wrapper) and a
    new step (1) poisons the earlier outputs that alias nothing the engine keeps (NaN, or a huge id: a token read
    from them later breaks the run) and (2) remembers them, so that passing one into a compiled step raises."""

    def __init__(self, engine_state):
        self.engine_state, self.marks, self.seen, self.live, self.freed = engine_state, 0, None, [], []

    def mark(self) -> None:
        self.marks += 1

    def compile(self, fn, **_):
        def call(*args, **kwargs):
            if self.marks == 0 or self.seen != self.marks:         # a new step: the earlier outputs are gone
                self.free()
            self.seen = self.marks
            gone = {t.untyped_storage().data_ptr() for t in self.freed}
            for t in tensors((args, kwargs)):
                assert t.untyped_storage().data_ptr() not in gone, \
                    f"{fn.__name__} read an output of an earlier CUDA graph step, which that step's successor frees"
            out = fn(*args, **kwargs)
            kept = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs, self.engine_state()))}
            self.live += [t for t in tensors(out) if t.untyped_storage().data_ptr() not in kept]
            return out
        return call

    def free(self) -> None:
        for t in self.live:
            t.fill_(float("nan") if t.is_floating_point() else 1 << 40 if t.dtype == torch.long else 0)
        self.freed += self.live
        self.live = []


def tensors(obj, depth: int = 0) -> list:
    """Every tensor in obj: tensors, tuples, lists, dicts and the attributes of plain objects (a few levels)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 4 or isinstance(obj, torch.nn.Module):
        return []
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors(x, depth + 1)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors(x, depth + 1)]
    if hasattr(obj, "__dict__"):
        return tensors(vars(obj), depth + 1)
    return []


def test_no_compiled_step_reads_what_cuda_graphs_free(monkeypatch):
    """Each compiled step marks the start of a CUDA graph step, except the verify, which reads its draft's tokens
    and distributions (compiling.compile_step): under the lifetime rule of cudagraph trees (CudaGraphLifetimes),
    no compiled step reads a freed output and the tokens are the eager engine's. Every step kind runs: rounds of
    two verify blocks, plain steps (policy.Alternate), admissions into a busy batch, and a sampled
    request whose DFlash2 draft hands its distributions q to the verify. Two slots, three requests."""
    from helpers import kind_draft_config, random_drafter, random_target, tiny_target_config
    from policy import Alternate
    target = random_target(tiny_target_config(vocab_size=40), 21)
    drafter = random_drafter(kind_draft_config(target.cfg, "dflash2", block_size=4, target_layer_ids=[0, 2],
                                               num_target_layers=None), 22)
    reqs = [engine.Request([(7 * i + 3 * j) % 39 + 1 for j in range(6 + 5 * i)], 14 + 3 * i) for i in range(3)]
    reqs[1] = dataclasses.replace(reqs[1], sampling=engine.Sampling(0.8, draft_rule="ratio"), seed=5)

    def make(compiled: bool):
        return engine.Engine(target, engine.DrafterProposer(drafter, target), 4, 2, 64, policy=Alternate((4, 2)),
                             compile_mode="default" if compiled else None)

    held = []
    lifetimes = CudaGraphLifetimes(lambda: (vars(held[0]), held[0].cache.layers,
                                            held[0].proposer.cache.layers, vars(held[0].pending)))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lifetimes.compile(fn, **kw))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lifetimes.mark)
    held.append(make(compiled=True))
    got = [r.output_ids for r in held[0].run(reqs)]
    monkeypatch.undo()
    assert lifetimes.marks > 0 and lifetimes.freed
    assert got == [r.output_ids for r in make(compiled=False).run(reqs)]
