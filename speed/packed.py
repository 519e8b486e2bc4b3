"""Optional, chosen once per machine: float32 CPU matrix products of a few rows (the verify block, the drafter's
queries) on weights packed once for them, applied to a loaded model by swapping its linear layers.

    KINDS             the packed products: "mkl" (MKL's packed sgemm: the weight packed for products of exactly
                      `rows` rows; any other row count stays F.linear) and "onednn" (oneDNN's linear on the weight
                      reordered into its blocked layout, for products of 2..FEW_ROWS rows). "plain" is F.linear.
                      A weight kept narrower than the float32 arithmetic (model.kept_product) is packed widened;
                      for "mkl" it also keeps the widened float32 weight (`wide`: MKL's kernel takes it beside the
                      packed one), and its products of other row counts, 2..FEW_ROWS, are F.linear over that.
    PackedLinear      an nn.Linear (the same Parameters, the same state-dict names) that also keeps a packed copy of
                      its weight and uses it for the float32 CPU products it applies to, outside autograd.
    PackedGroup       the linears of a layer that read one input (its SHARED_INPUT: q/k/v, gate/up, the GDN input
                      projections) as one packed product, split back (model.linears runs it): fewer, wider products.
    swap_linears_     replaces the nn.Linear layers of a float32 CPU module by PackedLinears of one kind (the way
                      gpt-fast's quantize.py swaps linears); refresh_ repacks copies whose weight changed.
    linear, linear_op the product itself: a direct call for eager code, and a custom op torch.compile can trace.
    lower_linear_op   an inductor lowering so compiled code calls the MKL or oneDNN kernel itself, not the custom op.
    measure, choose   times passes of one step's few-row products (every layer once, in order, as a step reads them)
                      each way; choose keeps the fastest kind (by a margin over plain) and caches the verdict on disk
                      beside inductor's compile cache.

Why measured, and why cached: which product is fastest for a few rows depends on the CPU (docs/measurements.md
names them), and the packed copies cost the weights' size again. A choice measured at every load is a race:
near a tie two runs of one command take different kinds, and each kind compiles its own graphs. So `choose`
measures once per CPU model, thread count, row count, weight shapes and torch version, and every later run reads
the verdict (a fresh TORCHINDUCTOR_CACHE_DIR measures again). The maths is float32 either way, summed in another
order. Deleting this file and the --products flag leaves a working project.

Staleness: a packed copy must never serve a weight it was not made from. Each copy remembers the weight tensor
it was made from (a weak reference), its data_ptr and its version counter (which every in-place change moves);
eager calls check these and repack. Inference-mode tensors keep no version counter: for them only a replaced tensor
is seen, and refresh_ repacks them every time. Under torch.compile the check is NOT traced (compiled code uses the
copies it finds): swap after the weights are final, and call refresh_(module) after changing weights that compiled
code will read.
"""
from __future__ import annotations

import json
import os
import statistics
import time
import weakref
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoint
import model as M
from compiling import cache_folder, cpu_model, read_record, write_record

AVAILABLE = {
    "mkl": torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
           and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"),
    "onednn": torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
              and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"),
}
KINDS = tuple(k for k, ok in AVAILABLE.items() if ok)
FEW_ROWS = M.FEW_ROWS      # the products of 2..FEW_ROWS rows are few-row products; longer prefills stay F.linear
PACK_ROWS = 16           # the default row count weights are packed for (the verify block)
MARGIN = 0.1             # `choose` wants a packed kind at least this much faster than plain: near a tie, plain
KEPT_MARGIN = -0.15      # the same where weights are kept narrower (NARROW): `measure` times eager passes, and
#                          compiled steps over kept weights gain far more from the packed float32 copies than those
#                          show (an AVX2 EPYC: oneDNN's pass 0.91-1.12x plain's from run to run, its compiled verify
#                          1.2-2.2x and draft 1.5-3x faster: docs/measurements.md#packed-products-by-cpu), so there
#                          a packed kind wins unless its pass is more than 15% slower than plain's
NARROW = (torch.bfloat16, torch.float16)   # weights kept narrower than float32 arithmetic (model.kept_product):
#                                            packed as widened float32 copies, by the kinds in KEPT_KINDS only
KEPT_KINDS = ("onednn", "mkl")   # mkl keeps a widened float32 weight beside its packed copy (two copies)
PASS_BYTES = 1 << 29     # `measure`'s pass reads at most about this many bytes of weights (their packed copies are
#                          alive at once), and one layer of every shape past them


def widened(weight: torch.Tensor, kind: str) -> torch.Tensor | None:
    """The float32 weight a copy of `kind` keeps beside its packed one: for "mkl" over a weight kept narrower, the
    weight widened (MKL's kernel takes the float32 weight too, and products of other row counts use it); else None
    (the weight itself serves)."""
    return weight.detach().float() if _keeps_wide(weight, kind) else None


def copy_bytes(weight: torch.Tensor, kind: str) -> int:
    """The bytes of the copies a weight of `kind` takes: its packed float32 copy, and its widened one (widened)."""
    return weight.numel() * 4 * (2 if _keeps_wide(weight, kind) else 1)


def _keeps_wide(weight: torch.Tensor, kind: str) -> bool:
    """Whether a copy of `kind` keeps a widened float32 weight beside its packed one: mkl over a weight kept narrower."""
    return kind == "mkl" and weight.dtype in NARROW


def pack(weight: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """weight [N, K] float32 on the CPU (or kept narrower: NARROW, widened first, exactly) -> its packed float32 copy
    of `kind` for products of `rows` rows."""
    weight = weight.detach().float()
    if kind == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def applies(kind: str, rows: int, pack_rows: int) -> bool:
    """Whether a product of `rows` rows takes a copy of `kind` packed for `pack_rows`."""
    return rows == pack_rows if kind == "mkl" else 1 < rows <= FEW_ROWS


def linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str,
           rows: int) -> torch.Tensor:
    """x [..., K] float32 on the CPU; packed = pack(weight [N, K], kind, rows); bias [N] or None -> x weight^T + bias
    [..., N]. Eager code calls this directly: no custom-op dispatch."""
    n_out = weight.shape[0]
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if kind == "mkl":
        out = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, rows)
    else:
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], n_out)


@torch.library.custom_op("dflash_fast::packed_linear", mutates_args=())
def linear_op(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str,
              rows: int) -> torch.Tensor:
    """`linear` as an op torch.compile can trace (dynamo cannot trace the opaque packed tensor into the kernels
    themselves); lower_linear_op turns it back into a direct kernel call in compiled code."""
    return linear(x, packed, weight, bias, kind, rows)


@linear_op.register_fake
def _(x, packed, weight, bias, kind, rows):
    # Runs only when torch.compile traces the op, before inductor lowers it: the place to register the lowering,
    # so that eager runs never import inductor (1-2 s).
    lower_linear_op()
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_LOWERED = False


def lower_linear_op() -> bool:
    """Let inductor emit a direct call of the MKL or oneDNN kernel for linear_op (in its C++ wrapper:
    aoti_torch_cpu__mkl_linear, aoti_torch_cpu__linear_pointwise) instead of a call back into Python through the
    dispatcher, which costs microseconds per product, and a compiled draft + verify round makes dozens of them.
    Inductor's own lowerings of these ops accept only weights it packed itself (with freezing), so this one builds
    the same IR nodes (MKLPackedLinear, LinearUnary) for ours. It uses inductor internals of the torch this project
    pins; where they are missing the op keeps its dispatcher call (slower, same results). So does a graph that
    inductor's FX graph cache kept from before this lowering was registered (the cache key does not cover
    lowerings): a fresh TORCHINDUCTOR_CACHE_DIR clears that. Idempotent. -> whether it is in place."""
    global _LOWERED
    if _LOWERED:
        return True
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import register_lowering, view
        from torch._inductor.mkldnn_ir import LinearUnary, MKLPackedLinear, _create_output_node
    except ImportError:
        return False

    def realized(t):
        return ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(t))

    def lowering(x, packed, weight, bias, kind, rows):
        size = list(x.get_size())
        n_out = weight.get_size()[0]
        flat = realized(view(x, [-1, size[-1]]) if len(size) != 2 else x)     # both kernels take rows as 2-D
        packed = ir.ExternKernel.realize_input(packed)                         # opaque: passed as it is
        if kind == "mkl":
            out = ir.TensorBox.create(MKLPackedLinear.create(flat, packed, realized(weight),
                                                             None if bias is None else realized(bias), rows))
        else:
            inputs, constant_args = [flat, packed], ["none", [-1], ""]        # no fused activation
            if bias is None:
                constant_args.insert(0, None)
            else:
                inputs.append(realized(bias))
            layout = ir.FixedLayout(device=flat.get_device(), dtype=flat.get_dtype(), size=[flat.get_size()[0], n_out])
            out = ir.TensorBox.create(_create_output_node(LinearUnary(layout, inputs, constant_args)))
        return view(out, size[:-1] + [n_out]) if len(size) != 2 else out

    register_lowering(torch.ops.dflash_fast.packed_linear.default)(lowering)
    _LOWERED = True
    return True


def _packable(w: torch.Tensor, narrow_ok: bool = False) -> bool:
    """A weight a packed copy is made of: float32 on the CPU, or with narrow_ok (a model of float32 arithmetic whose
    weights are kept narrower, and a kind of KEPT_KINDS) bfloat16 or float16."""
    return w.device.type == "cpu" and (w.dtype == torch.float32 or narrow_ok and w.dtype in NARROW)


def _arithmetic(module) -> torch.dtype | None:
    """The arithmetic dtype of a model of this project (model.Qwen35.dtype, DFlashDrafter.dtype), else None."""
    dtype = getattr(module, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _narrow_ok(module, kind: str | None = None) -> bool:
    """Whether `module`'s weights kept narrower may be packed (for `kind`; None: for some kind): its arithmetic is
    float32 (what a packed product computes in)."""
    return _arithmetic(module) == torch.float32 and (kind is None or kind in KEPT_KINDS)


def _version(w: torch.Tensor) -> int | None:
    try:
        return w._version
    except RuntimeError:            # an inference-mode tensor keeps no version counter
        return None


def _made_from(w: torch.Tensor) -> tuple:
    """What a packed copy remembers of the weight it was made from (PackedLinear._stale compares it)."""
    return weakref.ref(w), w.data_ptr(), _version(w)


class PackedLinear(nn.Linear):
    """nn.Linear with the same Parameters (shared with the layer it replaced, not copied) and state-dict names, plus
    `packed`, a copy of the weight of `kind` packed for `rows`-row products. Float32 CPU products outside autograd
    that the kind applies to (`applies`) use the copy (eager: a direct call of `linear`; under torch.compile:
    linear_op, which lower_linear_op turns into a direct kernel call); every other product is F.linear. Eager calls
    repack a copy whose weight changed since it was made (module docstring); compiled calls do not check."""

    packed: torch.Tensor | None = None     # pack(weight, kind, rows), or None: always F.linear
    wide: torch.Tensor | None = None       # widened(weight, kind): the kept weight widened, for "mkl"
    _packed_for = None                     # (weakref to the weight, its data_ptr, its _version or None)
    narrow_ok = False                      # its weight may be kept narrower (NARROW): packed widened
    grouped = False                        # a PackedGroup's member: the group holds the packed copy, not the layer
    group = None                           # the PackedGroup whose first member this layer is (model.linears runs it)

    @classmethod
    def sharing(cls, lin: nn.Linear, kind: str = "onednn", rows: int = PACK_ROWS, narrow_ok: bool = False) -> "PackedLinear":
        """A PackedLinear over lin's own weight and bias Parameters (nothing copied), not packed yet; narrow_ok: a
        weight kept narrower is packed widened (_packable)."""
        if kind not in AVAILABLE:
            raise ValueError(f"unknown kind of packed product {kind!r}: one of {sorted(AVAILABLE)}")
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        new._parameters["weight"] = lin._parameters["weight"]
        new._parameters["bias"] = lin._parameters["bias"]
        new.kind, new.rows, new.narrow_ok = kind, rows, narrow_ok and kind in KEPT_KINDS
        new.train(lin.training)
        return new

    @classmethod
    def from_linear(cls, lin: nn.Linear, kind: str = "onednn", rows: int = PACK_ROWS) -> "PackedLinear":
        """`sharing(lin)`, packed when its weight is float32 on the CPU (for a lone linear; swap_linears_
        replaces the linears inside a module)."""
        new = cls.sharing(lin, kind, rows)
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
        self.wide = widened(w, self.kind)
        self.packed = pack(w if self.wide is None else self.wide, self.kind, self.rows)
        self._packed_for = _made_from(w)
        return self.packed

    def refresh_(self) -> int:
        """Repack the copy if its weight changed since it was made (always, for an inference-mode weight);
        drop it when the weight is no longer float32 on the CPU. -> bytes packed now."""
        if self.grouped:                     # its PackedGroup packs it (PackedGroup.refresh_)
            return 0
        w = self.weight
        if not _packable(w, self.narrow_ok):
            self.packed = self.wide = self._packed_for = None
            return 0
        if self.packed is not None and not self._stale(unversioned_stale=True):
            return 0
        self._pack()
        return copy_bytes(w, self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The cheap tests first: this runs for every product of an eager step.
        if self.packed is None or torch.is_grad_enabled() or not _serves(x, self.kind, self.rows, self.wide):
            return M.kept_product(x, self.weight, self.bias)
        if not torch.compiler.is_compiling() and self._stale(unversioned_stale=False):   # (not traced: docstring)
            if not _packable(self.weight, self.narrow_ok):     # converted to another dtype or device since it was packed
                self.packed = self.wide = self._packed_for = None
                return M.kept_product(x, self.weight, self.bias)
            self._pack()
        return _copy_product(x, self.packed, self.wide, self.weight, _wide(self.bias), self.kind, self.rows)


def _wide(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias for a packed (float32) product: widened where it is kept narrower."""
    return bias if bias is None or bias.dtype == torch.float32 else bias.float()


def _serves(x: torch.Tensor, kind: str, rows: int, wide: torch.Tensor | None = None) -> bool:
    """Whether a copy of `kind` packed for `rows` (with `wide`, its widened weight, or None) serves the product of
    x [..., K]: float32 on the CPU, a row count the kind applies to, or with a widened weight any of 2..FEW_ROWS."""
    n = x.numel() // max(x.shape[-1], 1)
    return (x.dtype == torch.float32 and x.device.type == "cpu"
            and (applies(kind, n, rows) or wide is not None and 1 < n <= FEW_ROWS))


def _copy_product(x, packed, wide, weight, bias, kind: str, rows: int) -> torch.Tensor:
    """A product _serves: over the packed copy where the kind applies to x's rows, else F.linear over the widened
    weight `wide`."""
    if applies(kind, x.numel() // x.shape[-1], rows):
        return _packed_product(x, packed, weight if wide is None else wide, bias, kind, rows)
    return F.linear(x, wide, bias)


def _packed_product(x, packed, weight, bias, kind: str, rows: int) -> torch.Tensor:
    """The product over a packed copy: under torch.compile the custom op (lowered to a direct kernel call), else the
    direct call."""
    return (linear_op if torch.compiler.is_compiling() else linear)(x, packed, weight, bias, kind, rows)


class PackedGroup:
    """Linears that all read one input (the members: PackedLinears of one kind and row count, all with a bias or all
    without) as one product. Their weights become row blocks of one tensor, `weight` (each member's Parameter a view
    of it: the same names, values and memory), packed once; `__call__` splits the product back into each member's
    output, in order. The members keep no packed copy of their own. Eager calls check each member's weight as
    PackedLinear checks its own (a member's weight replaced, moved or changed in place) and join and pack again;
    products the kind does not apply to (one row, another row count) are F.linear over the joined weight (for mkl
    over kept weights, 2..FEW_ROWS rows over the joined weight widened: `wide`). Not an
    nn.Module: it adds no parameters."""

    def __init__(self, members: tuple, kind: str, rows: int):
        self.members, self.kind, self.rows = tuple(members), kind, rows
        self.sizes = [m.out_features for m in self.members]
        self.weight = self.bias = self.packed = self.wide = None
        for m in self.members:
            m.grouped, m.packed = True, None
        self.refresh_()

    def _stale(self, unversioned_stale: bool) -> bool:
        return self.packed is None or any(m._stale(unversioned_stale) for m in self.members)

    def refresh_(self) -> int:
        """Join the members' current weights (and biases) into one tensor and pack it, if any changed since the last
        time (always, for inference-mode weights); no copy when a weight is no longer float32 on the CPU. -> bytes
        packed now."""
        if not all(_packable(m.weight, m.narrow_ok) for m in self.members):
            self.weight = self.bias = self.packed = self.wide = None
            return 0
        if not self._stale(unversioned_stale=True):
            return 0
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in self.members])
            parts = [("weight", self.weight)]
            if self.members[0].bias is not None:
                self.bias = torch.cat([m.bias.detach() for m in self.members])
                parts.append(("bias", self.bias))
            for name, joined in parts:                 # the members' Parameters become views of the joined tensor
                for m, view in zip(self.members, joined.split(self.sizes)):
                    getattr(m, name).data = view
        self.wide = widened(self.weight, self.kind)
        self.packed = pack(self.weight if self.wide is None else self.wide, self.kind, self.rows)
        for m in self.members:
            m._packed_for = _made_from(m.weight)
        return copy_bytes(self.weight, self.kind)

    def __call__(self, x: torch.Tensor) -> tuple:
        """x [..., K] -> each member's output [..., N_i], in order: one product over the joined weight (packed where
        the kind applies, else F.linear), split. Where autograd records, or the weights are no longer float32 on the
        CPU, each member runs its own. Compiled code reads only the joined tensors, never the members' views of
        them (a compiled layer region refuses inputs that alias one another)."""
        if self.packed is None or torch.is_grad_enabled():
            return tuple(m(x) for m in self.members)
        if not torch.compiler.is_compiling() and self._stale(unversioned_stale=False):    # (not traced)
            self.refresh_()
            if self.packed is None:
                return tuple(m(x) for m in self.members)
        if _serves(x, self.kind, self.rows, self.wide):
            out = _copy_product(x, self.packed, self.wide, self.weight, _wide(self.bias), self.kind, self.rows)
        else:
            out = M.kept_product(x, self.weight, self.bias)
        return out.split(self.sizes, -1)


def _groups(module: nn.Module, narrow_ok: bool = False) -> list:
    """The SHARED_INPUT groups of module's layers that swap_linears_ joins: (layer, names) whose members are all
    swappable nn.Linears, distinct, all with a bias or all without."""
    out = []
    for layer in module.modules():
        for names in getattr(type(layer), "SHARED_INPUT", ()):
            members = [getattr(layer, n, None) for n in names]
            if (all(_swappable(m, narrow_ok) for m in members) and len({m.bias is None for m in members}) == 1
                    and len(set(map(id, members))) == len(members)):
                out.append((layer, names))
    return out


def _available_memory() -> int | None:
    """Bytes of memory a process may still take (MemAvailable: free pages and the page cache the kernel can drop;
    the free pages alone read low after large files were read or written), or None where that cannot be read."""
    return checkpoint.available_memory("cpu")


def _swappable(m: nn.Module, narrow_ok: bool = False) -> bool:
    return (isinstance(m, nn.Linear) and not isinstance(m, PackedLinear)
            and not torch.nn.utils.parametrize.is_parametrized(m) and _packable(m.weight, narrow_ok))


def _within(todo: list, groups: list, budget: int | None, kind: str) -> tuple:
    """The (parent, name, linear) entries of `todo` and the SHARED_INPUT `groups` whose copies of `kind` (copy_bytes)
    fit in `budget` bytes (None: all): each group, and each other weight with every linear that shares it, one unit,
    taken largest first while the total fits -> (todo, groups) kept, and the bytes of their copies."""
    members = {id(getattr(layer, n)): i for i, (layer, names) in enumerate(groups) for n in names}
    units = {}                  # ("group", its index) or ("weight", id) -> ({id: weight}, {id: linear})
    for _, _, child in todo:
        key = ("group", members[id(child)]) if id(child) in members else ("weight", id(child.weight))
        weights, linears = units.setdefault(key, ({}, set()))
        weights[id(child.weight)] = child.weight
        linears.add(id(child))
    size = {key: sum(copy_bytes(w, kind) for w in weights.values()) for key, (weights, _) in units.items()}
    kept = set(units)
    if budget is not None and sum(size.values()) > budget:
        kept, total = set(), 0
        for key in sorted(units, key=lambda k: -size[k]):
            if total + size[key] <= budget:
                kept.add(key)
                total += size[key]
    linears = {i for key in kept for i in units[key][1]}
    return ([t for t in todo if id(t[2]) in linears], [g for i, g in enumerate(groups) if ("group", i) in kept],
            sum(size[key] for key in kept))


def swap_linears_(module: nn.Module, kind: str = "onednn", rows: int = PACK_ROWS) -> int:
    """Replace every nn.Linear of `module` whose weight is float32 on the CPU by a PackedLinear of `kind` for
    `rows`-row products over the same Parameters (tied weights stay tied: lm_head.weight is still
    embed_tokens.weight; state_dict keys do not change). Changes nothing when the kind is unavailable in this torch
    or when no linear is float32 on the CPU. The copies may take half of the memory available now: where all of them
    would take more, the largest products are swapped first, as many as fit (a big model keeps F.linear for the rest
    rather than run out of memory; _within). The linears of a layer's SHARED_INPUT groups are joined into one
    PackedGroup each (model.linears runs it), packed once as one product; their Parameters become views of the
    joined weight. `module.few_row_products` then names the kind (engine.cost_key reads it). `module` itself is not
    replaced: wrap a lone linear with PackedLinear.from_linear. Apply after the weights are final (module docstring).
    -> bytes of copies made."""
    if not AVAILABLE.get(kind):
        return 0
    narrow_ok = _narrow_ok(module, kind)
    todo = [(parent, name, child) for parent in module.modules() for name, child in parent._modules.items()
            if child is not None and _swappable(child, narrow_ok)]     # (named_children would skip a second name)
    groups = _groups(module, narrow_ok)
    free = _available_memory()
    todo, groups, need = _within(todo, groups, None if free is None else free // 2, kind)     # need: the copies' bytes
    if not todo:
        return 0
    joined = {id(getattr(layer, n)) for layer, names in groups for n in names}    # packed by their group only
    made, copies = {}, {}
    for parent, name, child in todo:
        if id(child) not in made:            # a layer reachable under two names gets one replacement
            new = made[id(child)] = PackedLinear.sharing(child, kind, rows, narrow_ok)
            w = child.weight                 # one copy per weight, however many layers share it
            if id(child) not in joined:
                if id(w) not in copies:
                    new._pack()
                    copies[id(w)] = (new.packed, new.wide, new._packed_for)
                new.packed, new.wide, new._packed_for = copies[id(w)]
        setattr(parent, name, made[id(child)])
    for layer, names in groups:               # (the layers are the swapped ones now)
        members = tuple(getattr(layer, n) for n in names)
        members[0].group = PackedGroup(members, kind, rows)
    module.few_row_products = kind
    return need


def refresh_(module: nn.Module) -> int:
    """Repack every PackedLinear copy in `module` (itself included) whose weight changed since it was made --
    eager calls do this on their own; do it before running compiled code after such a change. Inference-mode
    weights are always repacked. -> bytes packed now."""
    linears = [m for m in module.modules() if isinstance(m, PackedLinear)]
    groups = {id(m.group): m.group for m in linears if m.group is not None}
    return sum(m.refresh_() for m in linears) + sum(g.refresh_() for g in groups.values())


def kind_of(modules) -> str:
    """The kind of packed products `modules` (None entries skipped) run: "plain" when none is swapped."""
    for module in modules:
        for m in (module.modules() if module is not None else ()):
            if isinstance(m, PackedLinear) and (m.packed is not None or m.grouped):
                return m.kind
    return "plain"


# ---- the choice: measured once per machine ---------------------------------------------------------

def _linears(modules) -> list:
    """The swappable linears of `modules` (None entries skipped), each once, in the order the modules list them
    (the order a step runs them in)."""
    seen, out = set(), []
    for module in modules:
        narrow_ok = _narrow_ok(module)
        for m in (module.modules() if module is not None else ()):
            if id(m) not in seen and _swappable(m, narrow_ok):
                seen.add(id(m))
                out.append(m)
    return out


def _shape(lin: nn.Linear) -> tuple:
    """What a measured verdict and a pass tell a layer's product by: (out features, in features, whether biased)."""
    return lin.out_features, lin.in_features, lin.bias is not None


def _pass_layers(lins: list) -> list:
    """The layers `measure` runs a pass through: from the first, in order, those that fit in PASS_BYTES of weights,
    and the first layer of every shape not among them. (A model larger than that streams its weights from memory in
    a step, as the first PASS_BYTES of them already do in the pass; all of them packed at once could double its
    memory.)"""
    out, shapes, total = [], set(), 0
    for lin in lins:
        shape, size = _shape(lin), lin.weight.nbytes
        if total + size <= PASS_BYTES or shape not in shapes:
            out.append(lin)
            shapes.add(shape)
            total += size
    return out


def _seconds(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


@torch.no_grad()
def measure(modules, rows: int, trials: int = 9, batch_seconds: float = 2e-3) -> dict:
    """Seconds that one pass of `rows`-row products through every swappable linear of `modules` takes, per kind
    ("plain" and each available kind that applies to `rows`), measured now on this machine's threads.

    A pass runs every layer's product once, in the modules' order, as a step does: each weight is read once per
    pass, after the others have taken the caches (past PASS_BYTES of weights, one layer of each other shape only:
    `_pass_layers`). Repeating one layer's product while its weight stays hot in the core's cache would favour
    plain products, which repack the weight at every call: on a CPU whose last-level cache barely holds the model,
    that inverts the verdict. One warm-up pass per kind, then `trials` rounds of the kinds in turn (so all see the
    same moments of a noisy machine), each timing passes for about `batch_seconds`; the median round. Random rows,
    the layers' own weights (copies packed for the measurement, dropped afterwards). Where weights are kept narrower
    than the float32 arithmetic, plain is model.kept_product (each weight widened at the call, a product over a large
    weight through the custom op compiled steps call, `opaque`: eager calls skip its dispatch, about 50 us a call),
    and the kinds timed are those `_weighed` admits.
    -> {kind: seconds}, all 0 when nothing is swappable."""
    lins = _pass_layers(_linears(modules))
    kinds = ["plain"] + _weighed(modules, rows)
    if not lins:
        return dict.fromkeys(kinds, 0.0)
    xs = [torch.randn(rows, lin.in_features) for lin in lins]
    wides = {k: [widened(lin.weight, k) for lin in lins] for k in kinds[1:]}
    copies = {k: [pack(lin.weight if w is None else w, k, rows) for lin, w in zip(lins, wides[k])] for k in kinds[1:]}

    def one_pass(kind):
        if kind == "plain":
            for lin, x in zip(lins, xs):
                M.kept_product(x, lin.weight, lin.bias, opaque=True)        # as a compiled step calls it
        else:
            for lin, x, copy, w in zip(lins, xs, copies[kind], wides[kind]):
                linear(x, copy, lin.weight if w is None else w, _wide(lin.bias), kind, rows)
    runs = {k: (lambda k=k: one_pass(k)) for k in kinds}
    for run in runs.values():                                       # the first calls set things up
        run()
    reps = max(1, int(batch_seconds / max(max(_seconds(run, 1) for run in runs.values()), 1e-7)))
    times = {k: [] for k in kinds}
    for _ in range(trials):
        for k, run in runs.items():
            times[k].append(_seconds(run, reps))
    return {k: statistics.median(t) for k, t in times.items()}


def _weighed(modules, rows: int) -> list:
    """The packed kinds `measure` and `choose` weigh for `rows`-row products of `modules`: those available that apply
    to `rows`; where weights are kept narrower, those of KEPT_KINDS, and "mkl" (two float32 copies of each weight)
    only where all its copies fit in a quarter of the machine's memory (else the products it would leave unpacked
    could cost more than it saves). The machine's total, not what is free now: the verdict's cache key names these
    kinds, and a key that moved with the free memory would measure again, and perhaps choose otherwise, run to run."""
    lins = _linears(modules)
    narrow = _narrow(lins)
    total = _total_memory()
    return [k for k in KINDS if applies(k, rows, rows) and (not narrow or k in KEPT_KINDS and (
        k != "mkl" or total is None or sum(copy_bytes(lin.weight, k) for lin in lins) <= total // 4))]


def _narrow(lins: list) -> bool:
    """Whether any of the linears `lins` keeps its weight narrower than the float32 arithmetic (NARROW)."""
    return any(lin.weight.dtype in NARROW for lin in lins)


def _total_memory() -> int | None:
    """Bytes of memory the machine has (MemTotal), or None where that cannot be read."""
    return checkpoint.meminfo("MemTotal")


def cache_path() -> str:
    """The file of `choose`'s verdicts: in inductor's cache folder (compiling.cache_folder), beside the compiled
    graphs that depend on it."""
    return os.path.join(cache_folder(), "dflash_fast_products.json")


def _key(modules, rows: int) -> str:
    # a layer kept narrower (NARROW) is told by its dtype too: it measures other products
    shapes = sorted(Counter((*_shape(lin), *([str(lin.weight.dtype)] if lin.weight.dtype in NARROW else []))
                            for lin in _linears(modules)).items())
    # "passes": how `measure` times (a verdict measured another way, or by an older version, is measured again);
    # the kinds it weighs (a verdict reached among other kinds is measured again)
    return json.dumps(["passes", cpu_model(), torch.__version__, torch.get_num_threads(), rows, shapes,
                       _weighed(modules, rows)])


def choose(modules, rows: int) -> tuple:
    """The kind of `rows`-row products for `modules` on this machine: the fastest packed kind if it takes at most
    (1 - MARGIN) of plain's time (`verdict`), else "plain"; measured once (`measure`) and cached (cache_path: the same CPU model,
    threads, rows, shapes and torch read the verdict, so every run chooses alike and hits its compiled graphs).
    Rows outside 2..FEW_ROWS and models with nothing swappable: ("plain", None, False), nothing measured.
    -> (kind, {kind: time / plain's time} as measured, whether the verdict came from the cache)."""
    if not KINDS or not 1 < rows <= FEW_ROWS or not _linears(modules):
        return "plain", None, False
    path, key = cache_path(), _key(modules, rows)
    verdicts = read_record(path)
    narrow = _narrow(_linears(modules))
    if key in verdicts:             # (the measurement is what is kept; the verdict follows this rule)
        measured = verdicts[key]["measured"]
        return verdict(measured, narrow), measured, True
    times = measure(modules, rows)
    measured = {k: t / times["plain"] for k, t in times.items() if k != "plain"}
    kind = verdict(measured, narrow)
    verdicts[key] = {"kind": kind, "measured": measured, "date": time.strftime("%Y-%m-%d")}
    write_record(path, verdicts)
    return kind, measured, False


def verdict(measured: dict, narrow: bool) -> str:
    """{kind: time / plain's time} -> the fastest kind if it takes at most 1 - MARGIN of plain's time (1 - KEPT_MARGIN
    where weights are kept narrower: `narrow`), else "plain"."""
    best = min(measured, key=measured.get, default=None)
    return best if best is not None and measured[best] <= 1 - (KEPT_MARGIN if narrow else MARGIN) else "plain"
