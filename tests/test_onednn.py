"""The float32 CPU products of a few rows through oneDNN (kernels.onednn_linear, model.pack_for_cpu_):
the same products as F.linear up to float32 rounding, only where they are meant to apply, and never from a
stale copy of a weight."""
import re

import pytest
import torch
import torch.nn.functional as F

import kernels
import model as M

pytestmark = pytest.mark.skipif(not kernels.ONEDNN_LINEAR, reason="this torch build has no oneDNN linear")


def packed_linear(n_in, n_out, bias, seed=0):
    lin = M.Linear(n_in, n_out, bias=bias)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=g))
    assert M.pack_for_cpu_(lin) == n_out * n_in * 4
    return lin


@pytest.mark.parametrize("shape", [(1, 2, 48), (1, 15, 48), (1, 16, 48), (64, 48), (2, 3, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear(shape, bias):
    lin = packed_linear(48, 200, bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = lin(x)
    ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() < 1e-4      # float32 rounding of 48-term sums of order-1 terms
    called = []
    real = kernels.onednn_linear_impl
    kernels.onednn_linear_impl = lambda *a: called.append(1) or real(*a)
    try:
        with torch.inference_mode():
            lin(x)
    finally:
        kernels.onednn_linear_impl = real
    assert called == [1]                                    # the packed path really ran


@pytest.mark.parametrize("case", ["one row", "many rows", "grad", "float64"])
def test_other_products_are_exactly_f_linear(case):
    lin = packed_linear(48, 200, True)
    rows = {"one row": 1, "many rows": kernels.FEW_ROWS + 1}.get(case, 16)
    x = torch.randn(1, rows, 48, generator=torch.Generator().manual_seed(2))
    if case == "float64":
        lin = lin.double()
        M.pack_for_cpu_(lin)
        assert lin.packed is None
        x = x.double()
    if case == "grad":
        out = lin(x)                                        # training: autograd through F.linear
        assert out.requires_grad
    else:
        with torch.inference_mode():
            out = lin(x)
    assert torch.equal(out, F.linear(x, lin.weight, lin.bias))


def test_a_changed_weight_is_repacked():
    lin = packed_linear(48, 64, False)
    x = torch.randn(1, 16, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        lin.weight.mul_(-2.0)                               # in place: the version counter moves
    assert M.pack_for_cpu_(lin) > 0
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-4)
    lin.weight = torch.nn.Parameter(torch.randn(64, 48))   # replaced: another tensor
    assert M.pack_for_cpu_(lin) > 0
    assert M.pack_for_cpu_(lin) == 0                       # nothing changed since: nothing repacked
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-4)


def test_engine_serves_a_changed_target_from_fresh_copies():
    """An Engine packs at the start of every generation: weights edited between two generations give the
    edited model's tokens (the same as a fresh Engine's), DFlash == AR, and the packed path ran."""
    import dflash
    from helpers import embedded_pair
    target, drafter, p1, _ = embedded_pair()
    engine = dflash.Engine(target, dflash.DrafterProposer(drafter, target), 16, 128)
    engine.run(p1, 24)
    assert target.lm_head.packed is not None and drafter.fc.packed is not None
    with torch.no_grad():
        for layer in target.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    again = engine.run(p1, 24).output_ids
    fresh_ar = dflash.Engine(target, None, 1, 128).run(p1, 24).output_ids
    assert again == fresh_ar


def test_no_copies_when_memory_is_short(monkeypatch):
    """Copies that would take more than half of the free memory are not made: MKL serves every product."""
    lin = M.Linear(48, 64, bias=False)
    monkeypatch.setattr(M, "_available_memory", lambda: 2 * 48 * 64 * 4 - 1)
    assert M.pack_for_cpu_(lin) == 0 and lin.packed is None
    monkeypatch.setattr(M, "_available_memory", lambda: 2 * 48 * 64 * 4)
    assert M.pack_for_cpu_(lin) == 48 * 64 * 4 and lin.packed is not None
    free = M._available_memory()
    assert free is None or free > 0


@pytest.mark.parametrize("cpp_wrapper", [True, False])
def test_compiled_products_call_onednn_directly(cpp_wrapper):
    """Compiled code calls the oneDNN kernel itself (kernels.lower_onednn_linear), not the Python custom op
    through the dispatcher, for 2-D, 3-D, 4-D and non-contiguous rows, with and without bias, and the results
    are F.linear's up to float32 rounding."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code
    assert kernels.lower_onednn_linear() and kernels.lower_onednn_linear()      # idempotent
    with_bias, no_bias = packed_linear(48, 200, True), packed_linear(200, 32, False, seed=4)

    def f(x):
        return no_bias(torch.relu(with_bias(x)) * 2.0)

    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(16, 48, generator=g), torch.randn(1, 15, 48, generator=g),
              torch.randn(2, 2, 4, 48, generator=g), torch.randn(1, 48, 16, generator=g).transpose(1, 2)]
    for x in inputs:
        torch._dynamo.reset()
        with torch.inference_mode(), inductor_config.patch(cpp_wrapper=cpp_wrapper, fx_graph_cache=False):
            got, code = run_and_get_code(torch.compile(f, fullgraph=True, dynamic=False), x)
        text = "\n".join(code)
        assert re.search(r"_linear_pointwise(\.default)?\(", text)        # the oneDNN kernel called directly,
        assert 'call_dispatcher("dflash_fast' not in text and "dflash_fast.onednn_linear.default(" not in text
        x64 = x.double()
        h = torch.relu(F.linear(x64, with_bias.weight.double(), with_bias.bias.double())) * 2.0
        ref = F.linear(h, no_bias.weight.double())
        assert got.shape == ref.shape
        assert (got.double() - ref).abs().max() < 1e-3 * ref.abs().max()
