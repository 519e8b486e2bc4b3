"""speed/packed.py, the optional float32 CPU products of a few rows on packed weights (MKL's packed sgemm, oneDNN): the
same products as F.linear up to float32 rounding, only where they are meant to apply, never from a stale copy of a
weight; a swap that keeps parameters, names and ties and refuses what it cannot serve; compiled code that calls
the kernels themselves; a choice measured once per machine and then read from its cache."""
import json
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import Early
from speed import packed

pytestmark = pytest.mark.skipif(not packed.KINDS, reason="this torch build has neither MKL's nor oneDNN's packed linear")


@pytest.fixture(params=packed.KINDS)
def kind(request):
    return request.param

TOL = 1e-4      # float32 rounding of 48-term sums of order-1 terms, against a float64 reference


def random_linear(n_in, n_out, bias, seed=0, dtype=torch.float32):
    lin = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=g))
    return lin


def packed_linear(n_in, n_out, bias, seed=0, kind="onednn", rows=16):
    lin = packed.PackedLinear.from_linear(random_linear(n_in, n_out, bias, seed), kind, rows)
    assert lin.packed is not None
    return lin


def reference(lin, x):
    return F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())


@pytest.fixture
def spy(monkeypatch):
    """Counts the eager packed products (packed.linear) and the packings (packed.pack)."""
    calls = {"linear": 0, "pack": 0}
    for name in calls:
        real = getattr(packed, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)
        monkeypatch.setattr(packed, name, counted)
    return calls


ROWS = {"1x2": (1, 2, 48), "1x15": (1, 15, 48), "1x16": (1, 16, 48), "64": (64, 48), "2x3": (2, 3, 48),
        "2x2x4": (2, 2, 4, 48), "transposed": (1, 48, 16)}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows, bias, kind, spy):
    """2-D, 3-D, 4-D and non-contiguous rows, with and without bias: F.linear's product, by the packed path (MKL's
    copies are packed for the row count of the call; oneDNN's serve any few rows)."""
    n_rows = torch.Size(ROWS[rows][:-1]).numel() if rows != "transposed" else 16
    lin = packed_linear(48, 200, bias, kind=kind, rows=n_rows)
    x = torch.randn(*ROWS[rows], generator=torch.Generator().manual_seed(1))
    if rows == "transposed":
        x = x.transpose(1, 2)
        assert not x.is_contiguous()
    with torch.inference_mode():
        got = lin(x)
    ref = reference(lin, x)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() < TOL
    assert spy == {"linear": 1, "pack": 1}                  # the packed path ran, on the copy made at the start


@pytest.mark.parametrize("case", ["one row", "many rows", "grad", "float64 module", "bfloat16 module"])
def test_other_products_are_exactly_f_linear(case, kind, spy):
    """Single rows (AR decode), more than FEW_ROWS rows (for MKL: any count but its own), autograd and modules
    converted to other dtypes after packing: exactly F.linear, and the packed path never runs."""
    lin = packed_linear(48, 200, True, kind=kind)
    rows = {"one row": 1, "many rows": packed.FEW_ROWS + 1 if kind == "onednn" else 15}.get(case, 16)
    x = torch.randn(1, rows, 48, generator=torch.Generator().manual_seed(2))
    if case.endswith("module"):
        dtype = torch.float64 if case.startswith("float64") else torch.bfloat16
        lin, x = lin.to(dtype), x.to(dtype)
    if case == "grad":
        out = lin(x)                                        # training: autograd through F.linear
        assert out.requires_grad
    else:
        with torch.inference_mode():
            out = lin(x)
    assert torch.equal(out, F.linear(x, lin.weight, lin.bias))
    assert spy["linear"] == 0
    if case.endswith("module"):
        assert packed.refresh_(lin) == 0 and lin.packed is None     # a copy it can no longer use is dropped


def test_a_changed_weight_is_repacked(kind, spy):
    """A copy never serves a weight it was not made from: in-place changes (outside and inside inference
    mode), a replaced Parameter and replaced .data are each repacked once, by the next call or refresh_,
    and the products are then the new weight's."""
    lin = packed_linear(48, 64, False, kind=kind)
    x = torch.randn(1, 16, 48, generator=torch.Generator().manual_seed(3))

    def check(repacks):
        before = spy["pack"]
        with torch.inference_mode():
            got = lin(x)
            lin(x)                                          # unchanged since: not repacked again
        assert (got.double() - reference(lin, x)).abs().max() < 4 * TOL
        assert spy["pack"] - before == repacks

    check(0)
    with torch.no_grad():
        lin.weight.mul_(-2.0)                               # in place: the version counter moves
    check(1)
    with torch.inference_mode():
        lin.weight.mul_(0.5)                                # in place in inference mode: it moves too
    check(1)
    lin.weight = nn.Parameter(torch.randn(64, 48))          # replaced: another tensor
    check(1)
    lin.weight.data = torch.randn(64, 48)                   # same Parameter, other storage
    check(1)
    with torch.no_grad():
        lin.weight.add_(1.0)
    module = nn.Sequential(lin)
    assert packed.refresh_(module) == 64 * 48 * 4           # the explicit refresh ...
    assert packed.refresh_(module) == 0                     # ... only repacks what changed
    check(0)


def test_an_inference_mode_weight_is_repacked_by_every_refresh(kind, spy):
    """An inference-mode weight has no version counter: refresh_ repacks it every time; a call sees a
    replacement of it."""
    with torch.inference_mode():
        lin = packed.PackedLinear.from_linear(random_linear(48, 64, True), kind)
        lin.weight = nn.Parameter(torch.randn(64, 48))
        assert lin.weight.is_inference()
        x = torch.randn(16, 48)
        assert (lin(x).double() - reference(lin, x)).abs().max() < 4 * TOL
        assert spy["pack"] == 2                             # made by from_linear, then for the replacement
        assert packed.refresh_(lin) == packed.refresh_(lin) == 64 * 48 * 4
        lin.weight.mul_(2.0)
        assert packed.refresh_(lin) > 0
        assert (lin(x).double() - reference(lin, x)).abs().max() < 8 * TOL


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 48)
        self.proj = nn.Linear(48, 48)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 48, bias=False))])
        self.alias = self.proj                              # one layer under two names
        self.head = nn.Linear(48, 32, bias=False)
        self.head.weight = self.embed.weight                # tied


def test_swap_keeps_parameters_names_and_ties(kind):
    m = Tied()
    before = m.state_dict(keep_vars=True)
    params = {name: p for name, p in m.named_parameters(remove_duplicate=False)}
    n_bytes = packed.swap_linears_(m, kind)
    assert n_bytes == 4 * (48 * 48 + 48 * 96 + 96 * 48 + 32 * 48)
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert len(linears) == 4 and all(type(mod) is packed.PackedLinear and mod.kind == kind for mod in linears)
    assert packed.kind_of([None, m]) == kind and packed.kind_of([Tied()]) == "plain"
    after = m.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)     # shared, not copied
    assert all(p is params[name] for name, p in m.named_parameters(remove_duplicate=False))
    assert m.head.weight is m.embed.weight and m.alias is m.proj
    assert m.head.packed is not None and m.head._packed_for[0]() is m.embed.weight
    assert packed.swap_linears_(m) == 0                     # nothing left to swap
    assert packed.refresh_(m) == 0                          # every copy is current
    m.load_state_dict({k: v.detach().clone() for k, v in before.items()})   # loading into it still works


def test_swap_packs_the_largest_products_that_fit(kind, monkeypatch):
    """Copies of every linear would take more than half the memory available: the largest products are swapped
    first, as many as fit (a SHARED_INPUT group counts whole, a weight shared by two linears once), the rest stay
    nn.Linear, and the products are the same either way."""
    import model as M
    torch.manual_seed(0)
    mlp = M.MLP(32, 48).float()                       # gate/up: one group of 2 x 48 x 32; down: 32 x 48
    head = nn.Linear(32, 200, bias=False)             # the largest: 200 x 32
    tied = nn.Linear(32, 200, bias=False)
    tied.weight = head.weight                         # shares head's weight: counted once
    small = nn.Linear(32, 8, bias=False)
    m = nn.ModuleDict({"mlp": mlp, "head": head, "tied": tied, "small": small})
    x = torch.randn(16, 32)
    with torch.no_grad():
        want = {n: mod(x) for n, mod in m.items()}
    f32 = 4
    budget = (200 * 32 + 2 * 48 * 32) * f32           # the head (with its twin) and the gate/up group
    monkeypatch.setattr(packed, "_available_memory", lambda: 2 * budget)
    with torch.no_grad():
        made = packed.swap_linears_(m, kind)
    assert made == budget
    assert isinstance(m["head"], packed.PackedLinear) and isinstance(m["tied"], packed.PackedLinear)
    assert m["head"].weight is m["tied"].weight
    assert isinstance(m["mlp"].gate_proj, packed.PackedLinear) and m["mlp"].gate_proj.group is not None
    assert not isinstance(m["mlp"].down_proj, packed.PackedLinear) and type(m["small"]) is nn.Linear
    with torch.no_grad():
        for n, mod in m.items():
            torch.testing.assert_close(mod(x), want[n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["float64", "bfloat16", "meta", "kind unavailable", "short of memory"])
def test_swap_refuses_what_it_cannot_serve(case, kind, monkeypatch):
    """Other dtypes and devices, a torch without the kind's linear, a copy larger than half the available memory:
    nothing is swapped and 0 is returned; an unknown kind is refused by name."""
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    m = nn.Sequential(nn.Linear(48, 64, bias=False, dtype=dtype, device="meta" if case == "meta" else None))
    need = 48 * 64 * 4
    if case == "kind unavailable":
        monkeypatch.setitem(packed.AVAILABLE, kind, False)
    if case == "short of memory":
        monkeypatch.setattr(packed, "_available_memory", lambda: 2 * need - 1)
    assert packed.swap_linears_(m, kind) == 0 and type(m[0]) is nn.Linear
    if case == "short of memory":
        monkeypatch.setattr(packed, "_available_memory", lambda: 2 * need)
        assert packed.swap_linears_(m, kind) == need and type(m[0]) is packed.PackedLinear
    free = packed._available_memory()
    assert free is None or free > 0
    with pytest.raises(ValueError, match="unknown kind"):
        packed.PackedLinear.sharing(nn.Linear(4, 4), "blas")


COMPILED_KINDS = [("mkl", True), ("mkl", False), ("onednn", True)]      # (kind, the C++ wrapper?)


def compiled_products() -> dict:
    """The work of the test below, in a process of its own (helpers.Early), for each (kind, cpp_wrapper) of
    COMPILED_KINDS whose kernel this torch has, as in a fresh process (the lowering not registered yet, no graph
    compiled before it, recompiled for each input): a small model of PackedLinears compiled over 2-D, 3-D, 4-D and
    non-contiguous rows -> per input (the generated code, whether a packed copy serves those rows, the compiled
    result, the float64 reference); whether lowering again is idempotent; after a weight edit and refresh_, how many
    copies were refreshed and the compiled result beside the reference."""
    import torch._inductor.config as inductor_config
    from torch._inductor.lowering import lowerings
    from torch._inductor.utils import run_and_get_code
    from helpers import fresh_inductor_cache
    out = {}
    for kind, cpp_wrapper in COMPILED_KINDS:
        if not packed.AVAILABLE[kind]:
            continue
        packed._LOWERED = False                                        # not registered yet
        lowerings.pop(torch.ops.dflash_fast.packed_linear.default, None)
        m = nn.Sequential(random_linear(48, 200, True), nn.ReLU(), random_linear(200, 32, False, seed=4))
        assert packed.swap_linears_(m, kind, 16) > 0
        with_bias, no_bias = m[0], m[2]

        def f(x):
            return no_bias(torch.relu(with_bias(x)) * 2.0)

        def ref(x):
            x64 = x.double()
            return F.linear(torch.relu(reference(with_bias, x64)) * 2.0, no_bias.weight.double())

        g = torch.Generator().manual_seed(5)
        inputs = [torch.randn(16, 48, generator=g), torch.randn(1, 15, 48, generator=g),
                  torch.randn(2, 2, 4, 48, generator=g), torch.randn(1, 48, 16, generator=g).transpose(1, 2)]
        rows = []
        with fresh_inductor_cache():                                   # no graph compiled before the lowering
            for x in inputs:
                torch._dynamo.reset()
                compiled = torch.compile(f, fullgraph=True, dynamic=False)
                with torch.inference_mode(), inductor_config.patch(cpp_wrapper=cpp_wrapper, fx_graph_cache=False):
                    got, code = run_and_get_code(compiled, x)
                rows.append(("\n".join(code), packed.applies(kind, x.numel() // 48, 16), got, ref(x)))
            idempotent = packed.lower_linear_op() and packed.lower_linear_op()
            with torch.no_grad():
                no_bias.weight.mul_(-1.0)
            refreshed = packed.refresh_(m)
            with torch.inference_mode():
                after = (compiled(inputs[-1]), ref(inputs[-1]))
        out[kind, cpp_wrapper] = dict(rows=rows, idempotent=idempotent, refreshed=refreshed, after=after)
    return out


# started with the suite, in a process of its own
COMPILED_PRODUCTS = Early(compiled_products, process=True, used_by=["test_compiled_products_call_the_kernels_directly"])


@pytest.mark.parametrize("kind, cpp_wrapper", COMPILED_KINDS)
def test_compiled_products_call_the_kernels_directly(kind, cpp_wrapper):
    """Compiled code over PackedLinears calls the MKL or oneDNN kernel itself (packed.lower_linear_op, registered
    by the first trace: nothing calls it here), never the custom op through the dispatcher, for 2-D, 3-D, 4-D and
    non-contiguous rows, with and without bias; rows a copy does not serve (MKL's: 15 of a copy for 16) are
    F.linear's; the results are F.linear's up to float32 rounding, and refresh_ reaches the compiled code."""
    if not packed.AVAILABLE[kind]:
        pytest.skip(f"no {kind} packed linear in this torch")
    r = COMPILED_PRODUCTS.result()[kind, cpp_wrapper]
    kernel = r"_mkl_linear(\.default)?\(" if kind == "mkl" else r"_linear_pointwise(\.default)?\("

    def close(got, want):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() < 1e-3 * want.abs().max()

    assert len(r["rows"]) == 4
    for text, served, got, want in r["rows"]:
        assert bool(re.search(kernel, text)) == served                        # the kernel called directly,
        assert 'call_dispatcher("dflash_fast' not in text                      # not the custom op (C++ wrapper)
        assert not re.search(r"dflash_fast\.\w+\.default\(", text)             # (Python wrapper)
        close(got, want)
    assert r["idempotent"]
    assert r["refreshed"] > 0
    close(*r["after"])                                                         # the refreshed copy is used


def test_swapped_target_logits_equal_unswapped(kind, spy):
    """A tiny random Qwen35 (tied lm_head) swapped: every linear is a PackedLinear, the linears of each layer's
    SHARED_INPUT groups run as one product (packed.PackedGroup), a 16-token call's logits are the unswapped model's
    within float32 tolerance, and after weights are edited between two calls (grouped ones among them) the swapped
    model serves the edited weights (fresh copies), not the copies made before."""
    from helpers import random_target, tiny_target_config
    cfg = tiny_target_config(tie_word_embeddings=True)
    plain, swapped = random_target(cfg, 7, torch.float32), random_target(cfg, 7, torch.float32)
    n_linear = sum(isinstance(m, nn.Linear) for m in swapped.modules())
    keys = list(swapped.state_dict())
    assert packed.swap_linears_(swapped, kind, 16) > 0
    assert sum(type(m) is packed.PackedLinear for m in swapped.modules()) == n_linear > 0
    assert list(swapped.state_dict()) == keys and swapped.lm_head.weight is swapped.embed_tokens.weight
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(16)

    def logits(model):
        with torch.inference_mode():
            return model(ids, pos)[0]

    groups = [m.group for m in swapped.modules() if getattr(m, "group", None) is not None]
    declared = [names for m in swapped.modules() for names in getattr(type(m), "SHARED_INPUT", ())]
    assert len(groups) == len(declared) == 2 * cfg.num_hidden_layers      # (the attention's or GDN's, the MLP's)
    products = n_linear - sum(len(g.members) - 1 for g in groups)
    want, got = logits(plain), logits(swapped)
    assert spy["linear"] == products                        # every product of the call took the packed path
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for model in (plain, swapped):
        with torch.no_grad():
            for layer in model.layers:
                layer.mlp.down_proj.weight.mul_(1.5)
                layer.mlp.up_proj.weight.mul_(-2.0)         # a grouped weight: its group packs again
            model.embed_tokens.weight.mul_(-1.0)            # the tied lm_head weight changes with it
    edited, got = logits(plain), logits(swapped)
    assert not torch.allclose(edited, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, edited, rtol=1e-4, atol=1e-4)


def test_engine_over_a_swapped_pair_serves_edited_weights():
    """engine.Engine over a swapped pair: weights edited between two generations give the edited model's tokens,
    and DFlash over the swapped pair gives AR's tokens."""
    import engine
    from helpers import random_drafter, random_target, tiny_draft_config, tiny_target_config
    target = random_target(tiny_target_config(), 3, torch.float32)
    drafter = random_drafter(tiny_draft_config(target.cfg), 3, torch.float32)
    assert packed.swap_linears_(target, "mkl" if packed.AVAILABLE["mkl"] else "onednn", 16) > 0
    assert packed.swap_linears_(drafter, "onednn" if packed.AVAILABLE["onednn"] else "mkl", 16) > 0
    prompt = list(range(5, 25))
    eng = engine.Engine(target, engine.DrafterProposer(drafter, target), 16, 1, 64)
    first = eng.generate(prompt, 16).output_ids
    assert first == engine.Engine(target, None, 1, 1, 64).generate(prompt, 16).output_ids
    with torch.no_grad():
        for layer in target.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    again = eng.generate(prompt, 16).output_ids
    assert again != first and again == engine.Engine(target, None, 1, 1, 64).generate(prompt, 16).output_ids


# --------------------------------------------------------------------------------------------------
# the default choice: measured once per machine, then cached
# --------------------------------------------------------------------------------------------------

def test_measure_times_passes_through_every_layer_in_order(monkeypatch):
    """measure times whole passes: each swappable layer's product once per pass, in the modules' order, on its own
    weight and rows of the asked count, for plain and every kind (so a shape shared by three layers is three
    products, as in a step); a layer two modules share counts once; nothing that cannot be swapped (bfloat16, no
    linear at all) is timed."""
    calls, plain = [], []
    real, real_f = packed.linear, F.linear

    def counted(x, copy, weight, bias, kind, rows):
        calls.append((tuple(x.shape), weight.data_ptr(), kind))
        return real(x, copy, weight, bias, kind, rows)

    def counted_plain(x, weight, bias=None):
        plain.append((tuple(x.shape), weight.data_ptr()))
        return real_f(x, weight, bias)

    monkeypatch.setattr(packed, "linear", counted)
    monkeypatch.setattr(F, "linear", counted_plain)      # (torch.nn.functional: what packed.py's plain products call)
    same = [random_linear(32, 48, False, seed=s) for s in range(3)]          # one shape, three layers
    other = random_linear(48, 16, True)
    m = nn.Sequential(*same, nn.Sequential(other), random_linear(16, 8, False, dtype=torch.bfloat16))
    order = [((12, lin.in_features), lin.weight.data_ptr()) for lin in (*same, other)]   # (x's shape, weight)
    times = packed.measure([m, None, other], rows=12, trials=3, batch_seconds=0)
    assert set(times) == {"plain", *packed.KINDS} and all(t > 0 for t in times.values())
    passes = 1 + 1 + 3                  # a warm-up pass, one that sizes the batches, one per trial (batch_seconds 0)
    assert plain == order * passes
    for kind in packed.KINDS:
        assert [c[:2] for c in calls if c[2] == kind] == order * passes
    monkeypatch.setattr(packed, "_seconds", lambda fn, reps: 1.0)          # every pass "takes" 1 s
    assert set(packed.measure([m], rows=12).values()) == {1.0}
    assert set(packed.measure([nn.Sequential(nn.ReLU())], rows=12).values()) == {0.0}
    assert set(packed.measure([random_linear(16, 8, False, dtype=torch.bfloat16)], rows=12).values()) == {0.0}


def test_measure_bounds_the_weights_a_pass_packs(monkeypatch):
    """A model of more weights than PASS_BYTES: the pass runs the first layers that fit in them, in order, and the
    first layer of every other shape (here the lm_head-like last one), so the copies measure packs at once stay
    bounded; a model within the bound runs every layer."""
    shape_a = [random_linear(32, 48, False, seed=s) for s in range(4)]       # 4 x 6 KB
    last = random_linear(48, 8, False, seed=9)
    m = nn.Sequential(*shape_a, last)
    monkeypatch.setattr(packed, "PASS_BYTES", 2 * shape_a[0].weight.nbytes)
    assert packed._pass_layers(packed._linears([m])) == [shape_a[0], shape_a[1], last]
    plain = []
    real_f = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: plain.append(w.data_ptr()) or real_f(x, w, b))
    packed.measure([m], rows=4, trials=1, batch_seconds=0)
    assert set(plain) == {shape_a[0].weight.data_ptr(), shape_a[1].weight.data_ptr(), last.weight.data_ptr()}
    monkeypatch.setattr(packed, "PASS_BYTES", 1 << 29)
    assert packed._pass_layers(packed._linears([m])) == [*shape_a, last]


def test_measure_times_plain_products_as_compiled_steps_call_them(monkeypatch):
    """Over a kept weight large enough for model.few_row_product, measure's plain pass calls it through its custom op
    (few_row_product_op), as a compiled step does, dispatch included; an eager product calls it directly."""
    import model as M
    calls = []
    real = M.few_row_product_op
    monkeypatch.setattr(M, "few_row_product_op", lambda x, w: calls.append(1) or real(x, w))
    kept = random_linear(256, M.WIDEN_CHUNK // 256 + 8, False, dtype=torch.bfloat16)
    kept.dtype = torch.float32                          # the arithmetic (a model's `dtype`, as model.Qwen35's)
    packed.measure([kept], rows=4, trials=1, batch_seconds=0)
    assert calls
    n = len(calls)
    y = M.kept_product(torch.randn(4, 256), kept.weight)
    assert len(calls) == n and y.dtype == torch.float32


@pytest.mark.parametrize("near", [1.0 - packed.MARGIN / 2, 1.0 - packed.KEPT_MARGIN / 2])
def test_kept_weights_take_a_packed_kind_unless_clearly_slower(monkeypatch, tmp_path, near):
    """Where weights are kept narrower than the arithmetic, choose takes the fastest packed kind unless its eager pass
    is more than -KEPT_MARGIN slower than plain's, where float32 weights want a packed kind MARGIN faster; a cached
    measurement is judged by that rule too (a verdict cached by an older rule does not stick). near: a kind faster
    than plain within MARGIN, and one slower within -KEPT_MARGIN."""
    assert packed.KEPT_MARGIN < 0
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(packed, "measure", lambda modules, rows: {"plain": 1.0, **dict.fromkeys(packed.KINDS, near)})
    wide, kept = random_linear(32, 48, False), random_linear(32, 48, False, dtype=torch.bfloat16)
    kept.dtype = torch.float32                          # the arithmetic (a model's `dtype`, as model.Qwen35's)
    if not packed.KINDS:
        pytest.skip("no packed kind on this build")
    assert packed.choose([wide], 16)[0] == "plain"
    kind, measured, cached = packed.choose([kept], 16)
    assert kind in packed.KEPT_KINDS and measured[kind] == near and not cached
    with open(packed.cache_path()) as f:
        saved = json.load(f)
    for v in saved.values():
        v["kind"] = "plain"                             # a verdict written by an older rule
    with open(packed.cache_path(), "w") as f:
        json.dump(saved, f)
    assert packed.choose([kept], 16)[:3:2] == (kind, True)
    slow = 1.0 - packed.KEPT_MARGIN + 0.01              # clearly slower: plain
    assert packed.verdict(dict.fromkeys(packed.KINDS, slow), narrow=True) == "plain"


def test_choose_wants_a_margin_and_caches_its_verdict(monkeypatch, tmp_path):
    """choose takes the fastest kind only when it is at least MARGIN faster than plain; it measures once per
    machine, threads, rows and shapes and then reads the verdict from its file (so a second run chooses alike even
    if a measurement would now say otherwise); rows that never take a packed path and models with nothing to swap
    are not measured at all."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    m = random_linear(32, 48, False)
    timings, asked = {"plain": 1.0, **{k: 1.0 for k in packed.KINDS}}, []
    fastest = packed.KINDS[0]

    def fake_measure(modules, rows):
        asked.append(rows)
        return dict(timings)

    monkeypatch.setattr(packed, "measure", fake_measure)
    timings[fastest] = 1.0 - packed.MARGIN / 2                  # faster, but within the margin: plain
    assert packed.choose([m], 16)[:2] == ("plain", {k: timings[k] for k in packed.KINDS})
    timings[fastest] = 0.5
    assert packed.choose([m], 16) == ("plain", {k: (1.0 - packed.MARGIN / 2 if k == fastest else 1.0) for k in packed.KINDS}, True)
    assert asked == [16]                                        # the second call read the cache
    kind, measured, cached = packed.choose([m], 8)              # other rows: measured now
    assert (kind, measured[fastest], cached, asked) == (fastest, 0.5, False, [16, 8])
    assert packed.choose([m], 8)[0] == fastest and asked == [16, 8]
    with open(packed.cache_path()) as f:
        assert len(json.load(f)) == 2
    assert packed.choose([m], 1) == ("plain", None, False) and packed.choose([m], packed.FEW_ROWS + 1)[0] == "plain"
    assert packed.choose([nn.Sequential(nn.ReLU())], 16) == ("plain", None, False)
    assert asked == [16, 8]


def test_eager_use_never_imports_inductor():
    """Swapping and running eager products does not import torch._inductor (a second or two of start-up):
    the lowering is registered when torch.compile first traces the op."""
    import os
    import subprocess
    import sys
    code = ("import sys, torch\nfrom speed import packed\n"
            "m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 8))\n"
            "assert packed.measure([m], 16)['plain'] > 0\n"
            "assert all(packed.swap_linears_(m, kind, 16) > 0 for kind in packed.KINDS[:1])\n"
            "with torch.no_grad():\n"
            "    m(torch.randn(16, 32))\n"
            "assert 'torch._inductor' not in sys.modules, 'inductor imported'\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


class Shared(nn.Module):
    """Three linears that read one input, declared as a group (model.linears' contract), and a lone fourth."""
    SHARED_INPUT = (("a", "b", "c"),)

    def __init__(self, bias: bool):
        super().__init__()
        self.a, self.b, self.c = (random_linear(48, n, bias, seed) for seed, n in enumerate((64, 8, 40)))
        self.d = random_linear(48, 16, bias, seed=9)

    def forward(self, x):
        from model import linears
        return (*linears(x, self.a, self.b, self.c), self.d(x))


def assert_compiled_equals_eager(m, x):
    """m's outputs for x, compiled (fullgraph, static shapes, from a reset dynamo), equal its eager ones to float32
    rounding."""
    with torch.inference_mode():
        eager = m(x)
        torch._dynamo.reset()
        compiled = torch.compile(m, fullgraph=True, dynamic=False)(x)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_a_group_is_its_members_products(kind, bias, spy):
    """swap_linears_ groups a layer's SHARED_INPUT linears (packed.PackedGroup): one packed product over their
    weights side by side, split back, equal to each member's own product for the rows the kind serves, for one row
    (F.linear over the joined weight) and compiled; the members' Parameters become views of the joined weight
    (same names and values, no copy), a lone member still runs, and grad-enabled calls reach the Parameters."""
    m = Shared(bias)
    want_state = {k: v.clone() for k, v in m.state_dict().items()}
    assert packed.swap_linears_(m, kind, 16) > 0
    group = m.a.group
    assert group is not None and group.members == (m.a, m.b, m.c) and m.d.group is None
    assert all(x.grouped and x.packed is None for x in group.members) and m.d.packed is not None
    assert m.a.weight.data_ptr() == group.weight.data_ptr() and m.c.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    assert list(m.state_dict()) == list(want_state)
    assert all(torch.equal(v, want_state[k]) for k, v in m.state_dict().items())
    g = torch.Generator().manual_seed(3)
    for shape in [(16, 48), (1, 16, 48), (1, 1, 48), (2, 3, 48)]:
        x = torch.randn(*shape, generator=g)
        spy["linear"] = 0
        with torch.inference_mode():
            got = m(x)
        served = packed.applies(kind, x.numel() // 48, 16)
        assert spy["linear"] == (2 if served else 0)            # the group's one product and the lone layer's
        for out, lin in zip(got, (m.a, m.b, m.c, m.d)):
            assert out.shape == (*shape[:-1], lin.out_features)
            assert (out.double() - reference(lin, x)).abs().max() < TOL * 48
    x = torch.randn(1, 16, 48, generator=g)
    assert_compiled_equals_eager(m, x)
    assert m.b(x).shape == (1, 16, 8)                            # a member alone: its own F.linear
    out = m(x)                                                   # grad enabled: each member's own, through autograd
    out[1].sum().backward()
    assert m.b.weight.grad is not None and m.a.weight.grad is None


def test_a_group_packs_again_when_a_member_changes(kind):
    """A member's weight changed in place, or replaced by a new Parameter, between two eager calls: the group joins
    and packs the current weights again (the members' views of the new joined weight); refresh_ counts the bytes."""
    m = Shared(False)
    packed.swap_linears_(m, kind, 16)
    x = torch.randn(1, 16, 48, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        m.b.weight.mul_(-3.0)
    with torch.inference_mode():
        got = m(x)
    assert (got[1].double() - reference(m.b, x)).abs().max() < TOL * 48 * 3
    m.c.weight = nn.Parameter(torch.randn(40, 48), requires_grad=False)
    with torch.inference_mode():
        got = m(x)
    assert (got[2].double() - reference(m.c, x)).abs().max() < TOL * 48
    assert m.c.weight.data_ptr() == m.a.group.weight.data_ptr() + (64 + 8) * 48 * 4
    with torch.no_grad():
        m.a.weight.add_(1.0)
    assert packed.refresh_(m) == (64 + 8 + 40) * 48 * 4        # the group's joined weight, packed again
    assert packed.refresh_(m) == 0


def kept_shared():
    """Shared's linears with their weights kept in bfloat16 under float32 arithmetic (model.kept_product's case; the
    model's `dtype` says the arithmetic, as model.Qwen35's does)."""
    m = Shared(False)
    for lin in (m.a, m.b, m.c, m.d):
        lin.weight.data = lin.weight.data.bfloat16()
    m.dtype = torch.float32
    return m


@pytest.mark.parametrize("kept_kind", [k for k in packed.KEPT_KINDS if k in packed.KINDS])
def test_kept_weights_are_served_by_widened_copies(kept_kind, spy):
    """Weights kept in bfloat16 under float32 arithmetic: the copies are widened (mkl also keeps the widened weight
    beside its packed copy: twice the bytes), the Parameters stay bfloat16, and every product of 1 to FEW_ROWS + 1
    rows (a packed copy where the kind applies, mkl's other few-row counts F.linear over the widened weight, the
    rest model.kept_product) is the product over the weights widened at load, to float32 rounding, eager and
    compiled; a weight changed in place is widened again before its next product."""
    m = kept_shared()
    lins = (m.a, m.b, m.c, m.d)
    wide = kept_kind == "mkl"
    assert packed.swap_linears_(m, kept_kind, 16) == sum(l.weight.numel() for l in lins) * 4 * (2 if wide else 1)
    assert all(l.weight.dtype == torch.bfloat16 for l in lins)
    assert (m.a.group.wide is not None, m.d.wide is not None) == (wide, wide)
    g = torch.Generator().manual_seed(5)
    for rows in (1, 2, 3, 16, packed.FEW_ROWS, packed.FEW_ROWS + 1):
        x = torch.randn(rows, 48, generator=g)
        spy["linear"] = 0
        with torch.inference_mode():
            got = m(x)
        assert spy["linear"] == (2 if packed.applies(kept_kind, rows, 16) else 0)
        for out, lin in zip(got, lins):
            assert out.dtype == torch.float32 and (out.double() - reference(lin, x)).abs().max() < TOL * 48
    for rows in (2, 16):
        assert_compiled_equals_eager(m, torch.randn(rows, 48, generator=g))
    with torch.no_grad():
        m.d.weight.mul_(-2.0)                               # (exact in bfloat16)
    x = torch.randn(3, 48, generator=g)
    with torch.inference_mode():
        got = m(x)[3]
    assert (got.double() - reference(m.d, x)).abs().max() < TOL * 48 * 2


def test_mkl_is_weighed_for_kept_weights_only_where_both_its_copies_fit(monkeypatch):
    """mkl over kept weights holds two float32 copies of each: `choose` weighs it only where all of them fit in a
    quarter of the machine's memory (its total: the verdict's cache key does not move with the free memory),
    onednn's single copies either way; float32 weights unchanged."""
    if not {"mkl", "onednn"} <= set(packed.KINDS):
        pytest.skip("needs both kinds")
    m = kept_shared()
    need = sum(l.weight.numel() for l in (m.a, m.b, m.c, m.d)) * 8
    monkeypatch.setattr(packed, "_available_memory", lambda: 0)          # what is free now does not decide
    monkeypatch.setattr(packed, "_total_memory", lambda: 4 * need)
    assert set(packed._weighed([m], 16)) == {"mkl", "onednn"}
    monkeypatch.setattr(packed, "_total_memory", lambda: 4 * need - 4)
    assert packed._weighed([m], 16) == ["onednn"]
    assert set(packed._weighed([Shared(False)], 16)) == {"mkl", "onednn"}
