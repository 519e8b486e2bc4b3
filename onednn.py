"""Optional, chosen by measurement: float32 CPU matrix products of a few rows (the verify block, the drafter's
queries) through oneDNN with prepacked weights, applied to a loaded model by swapping its linear layers.

    PackedLinear      an nn.Linear (the same Parameters, the same state-dict names) that also keeps a copy of
                      its weight reordered once into oneDNN's blocked layout, and uses it for float32 CPU
                      products of 2..FEW_ROWS rows outside autograd; every other product is F.linear.
    swap_linears_     replaces the nn.Linear layers of a float32 CPU module by PackedLinears (the way gpt-fast's
                      quantize.py swaps linears).
    refresh_          repacks every copy whose weight changed since it was made.
    linear, linear_op the product itself: a direct call for eager code, and a custom op torch.compile can trace.
    lower_linear_op   an inductor lowering so compiled code calls the oneDNN kernel itself, not the custom op
                      (registered when torch.compile first traces linear_op).
    measure           times one step's few-row products both ways, on the models' own linear shapes, now.
    pays              whether the packed products are clearly faster here (the default choice of the command lines).

Why by measurement: on some CPUs oneDNN's kernel on a prepacked weight is much faster than MKL's sgemm for
products of a few rows, on others not (docs/measurements.md names the CPUs), and the copies cost the weights'
size again; so the command lines time both at load (`pays`) and swap only where packed products win by a margin
(--onednn / --no-onednn force it). The same float32 maths summed in another order. Deleting this file and the
flag leaves a working project.

Staleness: a packed copy must never serve a weight it was not made from. Each copy remembers the weight
tensor it was made from (a weak reference), that tensor's data_ptr and its version counter (which every
in-place change moves). Eager calls check these and repack when they differ. Inference-mode tensors keep no
version counter, so an in-place change to such a weight cannot be seen: for them only a replaced tensor is
detected, and refresh_ repacks them every time it runs (weights loaded under no_grad have counters).
Under torch.compile the check is NOT traced -- compiled code uses the copies it finds -- so
apply swap_linears_ after the weights are final: the command lines load, then swap, then build the Engine.
After changing weights of a swapped module that compiled code will run, call refresh_(module).
"""
from __future__ import annotations

import os
import statistics
import time
import weakref
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

AVAILABLE = (hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
             and torch.backends.mkldnn.is_available())
FEW_ROWS = 64            # products of 2..FEW_ROWS rows take the packed path; longer prefills stay in MKL
PACK_ROWS = 16           # the row count the weights are blocked for (the verify block)
MARGIN = 0.1             # `pays` wants the packed products at least this much faster: near a tie, keep MKL


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 on the CPU -> its oneDNN copy in the blocked layout for PACK_ROWS-row products."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
    """x [..., K] float32 on the CPU; packed = pack(weight [n_out, K]); bias [n_out] or None
    -> x weight^T + bias [..., n_out]. Eager code calls this directly: no custom-op dispatch."""
    if x.dim() <= 3 and x.is_contiguous():            # the oneDNN op takes 2-D or 3-D contiguous rows
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "").view(*x.shape[:-1], n_out)


@torch.library.custom_op("dflash_fast::packed_linear", mutates_args=())
def linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> torch.Tensor:
    """`linear` as an op torch.compile can trace (dynamo cannot trace the opaque packed tensor into the oneDNN
    op itself); lower_linear_op turns it back into a direct kernel call in compiled code."""
    return linear(x, packed, bias, n_out)


@linear_op.register_fake
def _(x, packed, bias, n_out):
    # Runs only when torch.compile traces the op, before inductor lowers it: the place to register the lowering,
    # so that eager runs never import inductor (1-2 s).
    lower_linear_op()
    return x.new_empty(*x.shape[:-1], n_out)


_LOWERED = False


def lower_linear_op() -> bool:
    """Let inductor emit a direct call of the oneDNN kernel for linear_op (in its C++ wrapper:
    aoti_torch_cpu__linear_pointwise) instead of a call back into Python through the dispatcher, which costs
    microseconds per product, and a compiled draft + verify round makes dozens of them.
    Inductor's own lowering of the oneDNN op accepts only weights it packed itself (with freezing), so this
    one builds the same IR node (LinearUnary) for ours. It uses inductor internals of the torch this project
    pins; where they are missing the op keeps its dispatcher call (slower, same results). So does a graph
    that inductor's FX graph cache kept from before this lowering was registered (the cache key does not
    cover lowerings): a fresh TORCHINDUCTOR_CACHE_DIR clears that. Idempotent. -> whether it is in place."""
    global _LOWERED
    if _LOWERED:
        return True
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import register_lowering, view
        from torch._inductor.mkldnn_ir import LinearUnary, _create_output_node
    except ImportError:
        return False

    def lowering(x, packed, bias, n_out):
        size = list(x.get_size())
        if len(size) > 3:                  # the oneDNN op takes 2-D or 3-D rows (as `linear`)
            x = view(x, [-1, size[-1]])
        x = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(x))
        inputs = [x, ir.ExternKernel.realize_input(packed)]      # opaque oneDNN tensor: passed as it is
        constant_args = ["none", [-1], ""]                       # no fused activation
        if bias is None:
            constant_args.insert(0, None)
        else:
            inputs.append(ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(bias)))
        layout = ir.FixedLayout(device=x.get_device(), dtype=x.get_dtype(), size=list(x.get_size()[:-1]) + [n_out])
        out = ir.TensorBox.create(_create_output_node(LinearUnary(layout, inputs, constant_args)))
        return view(out, size[:-1] + [n_out]) if len(size) > 3 else out

    register_lowering(torch.ops.dflash_fast.packed_linear.default)(lowering)
    _LOWERED = True
    return True


def _packable(w: torch.Tensor) -> bool:
    return AVAILABLE and w.device.type == "cpu" and w.dtype == torch.float32


def _version(w: torch.Tensor) -> int | None:
    try:
        return w._version
    except RuntimeError:            # an inference-mode tensor keeps no version counter
        return None


class PackedLinear(nn.Linear):
    """nn.Linear with the same Parameters (shared with the layer it replaced, not copied) and state-dict names,
    plus `packed`, a oneDNN copy of the weight. Float32 CPU products of 2..FEW_ROWS rows outside autograd use
    the copy (eager: a direct call of `linear`; under torch.compile: linear_op, which lower_linear_op turns
    into a direct kernel call). Single rows (AR decode), longer prefills, other dtypes and autograd use F.linear.
    Eager calls repack a copy whose weight changed since it was made (module docstring); compiled calls
    do not check."""

    packed: torch.Tensor | None = None     # pack(weight), or None: always F.linear
    _packed_for = None                     # (weakref to the weight, its data_ptr, its _version or None)

    @classmethod
    def sharing(cls, lin: nn.Linear) -> "PackedLinear":
        """A PackedLinear over lin's own weight and bias Parameters (nothing copied), not packed yet."""
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        new._parameters["weight"] = lin._parameters["weight"]
        new._parameters["bias"] = lin._parameters["bias"]
        new.train(lin.training)
        return new

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "PackedLinear":
        """`sharing(lin)`, packed when its weight is float32 on the CPU (for a lone linear; swap_linears_
        replaces the linears inside a module)."""
        new = cls.sharing(lin)
        new.refresh_()
        return new

    def _stale(self, unversioned_stale: bool) -> bool:
        """Whether the copy was made from another weight than the current one. A weight without a version
        counter (inference mode) counts as stale when unversioned_stale, since its in-place changes are
        invisible; else only its replacement is seen."""
        if self._packed_for is None:
            return True
        w = self.weight
        ref, ptr, version = self._packed_for
        if ref() is not w or ptr != w.data_ptr():
            return True
        return unversioned_stale if version is None else version != w._version

    def _pack(self) -> torch.Tensor:
        w = self.weight
        self.packed = pack(w)
        self._packed_for = (weakref.ref(w), w.data_ptr(), _version(w))
        return self.packed

    def refresh_(self) -> int:
        """Repack the copy if its weight changed since it was made (always, for an inference-mode weight);
        drop it when the weight is no longer float32 on the CPU. -> bytes packed now."""
        w = self.weight
        if not _packable(w):
            self.packed = self._packed_for = None
            return 0
        if self.packed is not None and not self._stale(unversioned_stale=True):
            return 0
        self._pack()
        return w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The cheap tests first: this runs for every product of an eager step.
        if (self.packed is None or x.dtype != torch.float32 or torch.is_grad_enabled()
                or not 1 < x.numel() // max(x.shape[-1], 1) <= FEW_ROWS or x.device.type != "cpu"):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():     # the staleness check is not traced (module docstring)
            return linear_op(x, self.packed, self.bias, self.out_features)
        if self._stale(unversioned_stale=False):
            if not _packable(self.weight):     # converted to another dtype or device since it was packed
                self.packed = self._packed_for = None
                return F.linear(x, self.weight, self.bias)
            self._pack()
        return linear(x, self.packed, self.bias, self.out_features)


def _available_memory() -> int | None:
    """Bytes of physical memory free now (Linux), or None where that cannot be read."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _swappable(m: nn.Module) -> bool:
    return (isinstance(m, nn.Linear) and not isinstance(m, PackedLinear)
            and not torch.nn.utils.parametrize.is_parametrized(m) and _packable(m.weight))


def swap_linears_(module: nn.Module) -> int:
    """Replace every nn.Linear of `module` whose weight is float32 on the CPU by a PackedLinear over the same
    Parameters (tied weights stay tied: lm_head.weight is still embed_tokens.weight; state_dict keys do not
    change). Changes nothing when oneDNN's linear is unavailable, when no
    linear is float32 on the CPU, or when the copies would take more than half of the memory free now (a big
    float32 model keeps MKL rather than run out of memory). `module` itself is not replaced: wrap a lone
    linear with PackedLinear.from_linear. Apply after the weights are final (module docstring).
    -> bytes of packed copies made."""
    if not AVAILABLE:
        return 0
    todo = [(parent, name, child) for parent in module.modules() for name, child in parent._modules.items()
            if child is not None and _swappable(child)]     # (named_children would skip a second name)
    weights = {id(child.weight): child.weight for _, _, child in todo}
    need = sum(w.numel() * w.element_size() for w in weights.values())
    free = _available_memory()
    if not todo or (free is not None and need > free // 2):
        return 0
    made, copies = {}, {}
    for parent, name, child in todo:
        if id(child) not in made:            # a layer reachable under two names gets one replacement
            new = made[id(child)] = PackedLinear.sharing(child)
            w = child.weight                 # one copy per weight, however many layers share it
            if id(w) not in copies:
                new._pack()
                copies[id(w)] = (new.packed, new._packed_for)
            new.packed, new._packed_for = copies[id(w)]
        setattr(parent, name, made[id(child)])
    return need


def refresh_(module: nn.Module) -> int:
    """Repack every PackedLinear copy in `module` (itself included) whose weight changed since it was made --
    eager calls do this on their own; do it before running compiled code after such a change. Inference-mode
    weights are always repacked. -> bytes packed now."""
    return sum(m.refresh_() for m in module.modules() if isinstance(m, PackedLinear))


def _linears(modules) -> Counter:
    """How many swappable linears of `modules` (None entries skipped) have each weight shape, keyed by one
    such layer: {nn.Linear: count}. One step runs each of them once per few-row product."""
    seen, by_shape, counts = set(), {}, Counter()
    for module in modules:
        for m in (module.modules() if module is not None else ()):
            if id(m) in seen or not _swappable(m):
                continue
            seen.add(id(m))
            key = (m.out_features, m.in_features, m.bias is not None)
            counts[by_shape.setdefault(key, m)] += 1
    return counts


def _seconds(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


@torch.no_grad()
def measure(modules, rows: int, trials: int = 7, batch_seconds: float = 2e-3) -> tuple[float, float]:
    """Seconds that one pass of `rows`-row products through every swappable linear of `modules` takes,
    (plain F.linear, packed oneDNN), measured now on this machine's threads. Per weight shape: one warm-up call
    each, then `trials` alternating batches of about `batch_seconds` (so both kinds see the same moments of a
    noisy machine), and the median batch; shapes are weighted by their layer count. Random rows, the layers'
    own weights (one packed copy per shape, dropped afterwards). -> (0, 0) when nothing is swappable."""
    plain = packed = 0.0
    for lin, count in _linears(modules).items():
        w, b, n_out = lin.weight, lin.bias, lin.out_features
        copy = pack(w)
        x = torch.randn(rows, lin.in_features, dtype=w.dtype)
        run_plain = lambda: F.linear(x, w, b)                       # noqa: E731
        run_packed = lambda: linear(x, copy, b, n_out)              # noqa: E731
        run_plain(), run_packed()                                   # the first calls set things up
        reps = max(1, int(batch_seconds / max(_seconds(run_plain, 1), _seconds(run_packed, 1), 1e-7)))
        a, p = [], []
        for _ in range(trials):
            a.append(_seconds(run_plain, reps))
            p.append(_seconds(run_packed, reps))
        plain += count * statistics.median(a)
        packed += count * statistics.median(p)
    return plain, packed


def pays(modules, rows: int) -> tuple[bool, float | None]:
    """Whether swapping `modules`' linears makes their `rows`-row products (a step's verify block or draft
    queries) at least MARGIN faster, measured now (`measure`). Rows outside 2..FEW_ROWS never take the packed
    path, and a machine without oneDNN's linear has nothing to measure: (False, None) for both.
    -> (swap or not, packed time / plain time as measured)."""
    if not AVAILABLE or not 1 < rows <= FEW_ROWS:
        return False, None
    plain, packed = measure(modules, rows)
    if plain <= 0:
        return False, None
    return packed <= (1 - MARGIN) * plain, packed / plain
