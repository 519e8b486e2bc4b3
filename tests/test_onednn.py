"""onednn.py, the optional float32 CPU products of a few rows through oneDNN: the same products as F.linear up
to float32 rounding, only where they are meant to apply, never from a stale copy of a weight; a swap that keeps
parameters, names and ties and refuses what it cannot serve; compiled code that calls the oneDNN kernel itself."""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import onednn

pytestmark = pytest.mark.skipif(not onednn.AVAILABLE, reason="this torch build has no oneDNN linear")

TOL = 1e-4      # float32 rounding of 48-term sums of order-1 terms, against a float64 reference


def random_linear(n_in, n_out, bias, seed=0, dtype=torch.float32):
    lin = nn.Linear(n_in, n_out, bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=g))
    return lin


def packed_linear(n_in, n_out, bias, seed=0):
    lin = onednn.PackedLinear.from_linear(random_linear(n_in, n_out, bias, seed))
    assert lin.packed is not None
    return lin


def reference(lin, x):
    return F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())


@pytest.fixture
def spy(monkeypatch):
    """Counts the eager packed products (onednn.linear) and the packings (onednn.pack)."""
    calls = {"linear": 0, "pack": 0}
    for name in calls:
        real = getattr(onednn, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)
        monkeypatch.setattr(onednn, name, counted)
    return calls


ROWS = {"1x2": (1, 2, 48), "1x15": (1, 15, 48), "1x16": (1, 16, 48), "64": (64, 48), "2x3": (2, 3, 48),
        "2x2x4": (2, 2, 4, 48), "transposed": (1, 48, 16)}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(rows, bias, spy):
    """2-D, 3-D, 4-D and non-contiguous rows, with and without bias: F.linear's product, by the packed path."""
    lin = packed_linear(48, 200, bias)
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
def test_other_products_are_exactly_f_linear(case, spy):
    """Single rows (AR decode), more than FEW_ROWS rows, autograd and modules converted to other dtypes
    after packing: exactly F.linear, and the packed path never runs."""
    lin = packed_linear(48, 200, True)
    rows = {"one row": 1, "many rows": onednn.FEW_ROWS + 1}.get(case, 16)
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
        assert onednn.refresh_(lin) == 0 and lin.packed is None     # a copy it can no longer use is dropped


def test_a_changed_weight_is_repacked(spy):
    """A copy never serves a weight it was not made from: in-place changes (outside and inside inference
    mode), a replaced Parameter and replaced .data are each repacked once, by the next call or refresh_,
    and the products are then the new weight's."""
    lin = packed_linear(48, 64, False)
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
    assert onednn.refresh_(module) == 64 * 48 * 4           # the explicit refresh ...
    assert onednn.refresh_(module) == 0                     # ... only repacks what changed
    check(0)


def test_an_inference_mode_weight_is_repacked_by_every_refresh(spy):
    """An inference-mode weight has no version counter: refresh_ repacks it every time; a call sees a
    replacement of it."""
    with torch.inference_mode():
        lin = onednn.PackedLinear.from_linear(random_linear(48, 64, True))
        lin.weight = nn.Parameter(torch.randn(64, 48))
        assert lin.weight.is_inference()
        x = torch.randn(16, 48)
        assert (lin(x).double() - reference(lin, x)).abs().max() < 4 * TOL
        assert spy["pack"] == 2                             # made by from_linear, then for the replacement
        assert onednn.refresh_(lin) == onednn.refresh_(lin) == 64 * 48 * 4
        lin.weight.mul_(2.0)
        assert onednn.refresh_(lin) > 0
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


def test_swap_keeps_parameters_names_and_ties():
    m = Tied()
    before = m.state_dict(keep_vars=True)
    params = {name: p for name, p in m.named_parameters(remove_duplicate=False)}
    n_bytes = onednn.swap_linears_(m)
    assert n_bytes == 4 * (48 * 48 + 48 * 96 + 96 * 48 + 32 * 48)
    linears = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert len(linears) == 4 and all(type(mod) is onednn.PackedLinear for mod in linears)
    after = m.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)     # shared, not copied
    assert all(p is params[name] for name, p in m.named_parameters(remove_duplicate=False))
    assert m.head.weight is m.embed.weight and m.alias is m.proj
    assert m.head.packed is not None and m.head._packed_for[0]() is m.embed.weight
    assert onednn.swap_linears_(m) == 0                     # nothing left to swap
    assert onednn.refresh_(m) == 0                          # every copy is current
    m.load_state_dict({k: v.detach().clone() for k, v in before.items()})   # loading into it still works


@pytest.mark.parametrize("case", ["float64", "bfloat16", "meta", "no oneDNN", "short of memory"])
def test_swap_refuses_what_it_cannot_serve(case, monkeypatch):
    """Other dtypes and devices, a torch without oneDNN's linear, copies over half of the free memory:
    nothing is swapped and 0 is returned."""
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    m = nn.Sequential(nn.Linear(48, 64, bias=False, dtype=dtype, device="meta" if case == "meta" else None))
    need = 48 * 64 * 4
    if case == "no oneDNN":
        monkeypatch.setattr(onednn, "AVAILABLE", False)
    if case == "short of memory":
        monkeypatch.setattr(onednn, "_available_memory", lambda: 2 * need - 1)
    assert onednn.swap_linears_(m) == 0 and type(m[0]) is nn.Linear
    if case == "short of memory":
        monkeypatch.setattr(onednn, "_available_memory", lambda: 2 * need)
        assert onednn.swap_linears_(m) == need and type(m[0]) is onednn.PackedLinear
    free = onednn._available_memory()
    assert free is None or free > 0


@pytest.mark.parametrize("cpp_wrapper", [True, False])
def test_compiled_products_call_onednn_directly(cpp_wrapper, tmp_path, monkeypatch):
    """Compiled code over PackedLinears calls the oneDNN kernel itself (onednn.lower_linear_op, registered by
    the first trace: nothing calls it here), never the custom op through the dispatcher, for 2-D, 3-D, 4-D and
    non-contiguous rows, with and without bias; the results are F.linear's up to float32 rounding, and
    refresh_ reaches the compiled code."""
    import torch._inductor.config as inductor_config
    from torch._inductor.lowering import lowerings
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # no graph compiled before the lowering
    monkeypatch.setattr(onednn, "_LOWERED", False)                  # as in a fresh process: not registered yet
    monkeypatch.delitem(lowerings, torch.ops.dflash_fast.packed_linear.default, raising=False)
    m = nn.Sequential(random_linear(48, 200, True), nn.ReLU(), random_linear(200, 32, False, seed=4))
    assert onednn.swap_linears_(m) > 0
    with_bias, no_bias = m[0], m[2]

    def f(x):
        return no_bias(torch.relu(with_bias(x)) * 2.0)

    def ref(x):
        x64 = x.double()
        return F.linear(torch.relu(reference(with_bias, x64)) * 2.0, no_bias.weight.double())

    def close(got, want):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() < 1e-3 * want.abs().max()

    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(16, 48, generator=g), torch.randn(1, 15, 48, generator=g),
              torch.randn(2, 2, 4, 48, generator=g), torch.randn(1, 48, 16, generator=g).transpose(1, 2)]
    for x in inputs:
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, dynamic=False)
        with torch.inference_mode(), inductor_config.patch(cpp_wrapper=cpp_wrapper, fx_graph_cache=False):
            got, code = run_and_get_code(compiled, x)
        text = "\n".join(code)
        assert re.search(r"_linear_pointwise(\.default)?\(", text)            # the oneDNN kernel called directly,
        assert 'call_dispatcher("dflash_fast' not in text                      # not the custom op (C++ wrapper)
        assert not re.search(r"dflash_fast\.\w+\.default\(", text)             # (Python wrapper)
        close(got, ref(x))
    assert onednn.lower_linear_op() and onednn.lower_linear_op()                # idempotent
    with torch.no_grad():
        no_bias.weight.mul_(-1.0)
    assert onednn.refresh_(m) > 0
    with torch.inference_mode():
        close(compiled(inputs[-1]), ref(inputs[-1]))                           # the refreshed copy is used


def test_swapped_target_logits_equal_unswapped(spy):
    """A tiny random Qwen35 (tied lm_head) swapped: every linear is a PackedLinear, a 16-token call's logits
    are the unswapped model's within float32 tolerance, and after weights are edited between two calls the
    swapped model serves the edited weights (fresh copies), not the copies made before."""
    from helpers import random_target, tiny_target_config
    cfg = tiny_target_config(tie_word_embeddings=True)
    plain, swapped = random_target(cfg, 7, torch.float32), random_target(cfg, 7, torch.float32)
    n_linear = sum(isinstance(m, nn.Linear) for m in swapped.modules())
    keys = list(swapped.state_dict())
    assert onednn.swap_linears_(swapped) > 0
    assert sum(type(m) is onednn.PackedLinear for m in swapped.modules()) == n_linear > 0
    assert list(swapped.state_dict()) == keys and swapped.lm_head.weight is swapped.embed_tokens.weight
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(16)

    def logits(model):
        with torch.inference_mode():
            return model(ids, pos)[0]

    want, got = logits(plain), logits(swapped)
    assert spy["linear"] >= n_linear                        # every product of the call took the packed path
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for model in (plain, swapped):
        with torch.no_grad():
            for layer in model.layers:
                layer.mlp.down_proj.weight.mul_(1.5)
            model.embed_tokens.weight.mul_(-1.0)            # the tied lm_head weight changes with it
    edited, got = logits(plain), logits(swapped)
    assert not torch.allclose(edited, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, edited, rtol=1e-4, atol=1e-4)


def test_engine_over_a_swapped_pair_serves_edited_weights():
    """dflash.Engine over a swapped pair: weights edited between two generations give the edited model's tokens,
    and DFlash over the swapped pair gives AR's tokens."""
    import dflash
    from helpers import random_drafter, random_target, tiny_draft_config, tiny_target_config
    target = random_target(tiny_target_config(), 3, torch.float32)
    drafter = random_drafter(tiny_draft_config(target.cfg), 3, torch.float32)
    assert onednn.swap_linears_(target) > 0 and onednn.swap_linears_(drafter) > 0
    prompt = list(range(5, 25))
    engine = dflash.Engine(target, dflash.DrafterProposer(drafter, target), 16, 1, 64)
    first = engine.generate(prompt, 16).output_ids
    assert first == dflash.Engine(target, None, 1, 1, 64).generate(prompt, 16).output_ids
    with torch.no_grad():
        for layer in target.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    again = engine.generate(prompt, 16).output_ids
    assert again != first and again == dflash.Engine(target, None, 1, 1, 64).generate(prompt, 16).output_ids


# --------------------------------------------------------------------------------------------------
# the default choice: measured at load
# --------------------------------------------------------------------------------------------------

def test_measure_times_both_kinds_on_the_models_shapes(monkeypatch):
    """measure times each weight shape once however many layers share it (the layers' count weights it), on
    rows of the asked count, and adds nothing for what cannot be swapped (bfloat16, or no linear at all)."""
    calls = []
    real = onednn.linear

    def counted(x, packed, bias, n_out):
        calls.append((tuple(x.shape), n_out))
        return real(x, packed, bias, n_out)

    monkeypatch.setattr(onednn, "linear", counted)
    same = [random_linear(32, 48, False, seed=s) for s in range(3)]          # one shape, three layers
    other = random_linear(48, 16, True)
    m = nn.Sequential(*same, nn.Sequential(other), random_linear(16, 8, False, dtype=torch.bfloat16))
    plain, packed = onednn.measure([m, None], rows=12, trials=3, batch_seconds=1e-4)
    assert plain > 0 and packed > 0
    assert {shape for shape, _ in calls} == {(12, 32), (12, 48)} and {n for _, n in calls} == {48, 16}
    monkeypatch.setattr(onednn, "_seconds", lambda fn, reps: 1.0)          # every product "takes" 1 s:
    assert onednn.measure([m], rows=12) == (4.0, 4.0)                       # 3 layers of one shape + 1 other
    assert onednn.measure([nn.Sequential(nn.ReLU())], rows=12) == (0.0, 0.0)
    assert onednn.measure([random_linear(16, 8, False, dtype=torch.bfloat16)], rows=12) == (0.0, 0.0)


def test_pays_wants_a_margin_and_few_rows(monkeypatch):
    """pays swaps only when the packed products are at least MARGIN faster; rows that never take the packed
    path (1, or more than FEW_ROWS) are not measured at all."""
    m = random_linear(32, 48, False)
    timings = {"t": (1.0, 0.85)}

    def fake_measure(modules, rows):
        assert 1 < rows <= onednn.FEW_ROWS
        return timings["t"]

    monkeypatch.setattr(onednn, "measure", fake_measure)
    assert onednn.pays([m], 16) == (True, 0.85)
    timings["t"] = (1.0, 1.0 - onednn.MARGIN / 2)             # faster, but within the margin: keep MKL
    assert onednn.pays([m], 16) == (False, 1.0 - onednn.MARGIN / 2)
    timings["t"] = (0.0, 0.0)                                 # nothing swappable
    assert onednn.pays([m], 16) == (False, None)
    assert onednn.pays([m], 1) == (False, None) and onednn.pays([m], onednn.FEW_ROWS + 1) == (False, None)


def test_eager_use_never_imports_inductor():
    """Swapping and running eager products does not import torch._inductor (a second or two of start-up):
    the lowering is registered when torch.compile first traces the op."""
    import os
    import subprocess
    import sys
    code = ("import sys, torch, onednn\n"
            "m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 8))\n"
            "assert onednn.pays([m], 16)[1] is not None and onednn.swap_linears_(m) > 0\n"
            "with torch.no_grad():\n"
            "    m(torch.randn(16, 32))\n"
            "assert 'torch._inductor' not in sys.modules, 'inductor imported'\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
