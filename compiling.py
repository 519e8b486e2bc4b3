"""How engine.Engine compiles its step functions: the inductor options per device, the checks dynamo skips
before each call, and what stands in for them.

    inductor_options  the options of a --compile-mode, with the changes the steps get on a CPU (below).
    compile_step      torch.compile(fullgraph=True, dynamic=False) of one step function, over a copy of its code
                      of its own and without dynamo's per-call checks of the models; each call a new step for
                      CUDA graphs, or one that continues the step before it.
    model_state       what compiled steps take as fixed in the models; the Engine compares it once per generation.
    ModelGuard        the models an engine's compiled steps read, their model_state, and that comparison.
    mark_static_      a cache's tensors as static addresses (CUDA graphs replay steps that write them).
    graph_counts      graphs inductor compiled so far in this process, and graphs its on-disk cache served.

One-row products on a CPU. MKL's sgemm of one row streams the weights at about half the rate of inductor's own
vectorised loops, which its `decompose_mm_pass` writes for products of one row; the pass's CPU size limit (both
other dimensions <= 2048, read once at import) is raised by `inductor_options`, so every product of one row is
written as loops (faster on every shape measured: docs/measurements.md).

Dynamo's checks. Before every call of a compiled step dynamo checks everything the step read: for the embedded
target's decode step 641 checks, 531 of them of the models (each parameter's dtype, shape and strides, each
module's type, attributes and hooks), about a tenth of the step on a CPU, and more per round (draft, verify and
commit each check). The models do not change under an Engine, so `compile_step` drops the checks whose source is
a module (torch.compiler.skip_guard_on_all_nn_modules_unsafe) and the Engine compares `model_state` once per
generation instead, refusing models changed since it compiled (about 1 ms for the embedded pair, 11-17 ms for
the 32- and 40-layer preset shapes: a walk over every module in Python). Dynamo keeps compiled graphs per code
object, and with those checks gone one Engine's graphs could run for another Engine's models of the same shapes
(say, with another norm epsilon, a constant of the graphs): so each compiled step runs over a fresh copy of its
function's code, and an Engine's graphs are its own. Values of the weights are not checked and need not be: they
are inputs of every call, so weights edited in place are used by the next one.
"""
from __future__ import annotations

import getpass
import json
import os
import platform
import tempfile
import types
from dataclasses import is_dataclass

import torch

from model import GenerationError

ONE_ROW_LIMIT = 1 << 31        # decompose_mm_pass's CPU limit on the other two dimensions: no limit
# max-autotune's reports on stderr (each autotuned product's table of timings, and its choice statistics: about a
# hundred lines per cold compile) off, each unless its inductor environment variable asks for it.
QUIET = {option: value for option, value, env in (
    ("autotune_num_choices_displayed", 0, "TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED"),
    ("max_autotune_report_choices_stats", False, "TORCHINDUCTOR_MAX_AUTOTUNE_REPORT_CHOICES_STATS")) if env not in os.environ}


def inductor_options(mode: str, extra: dict, device: torch.device) -> dict:
    """The inductor options of torch.compile mode `mode` with `extra` (speed/cppwrapper.py's) added and autotune's reports
    off (QUIET); on a CPU without max-autotune's CUDA graphs and with every one-row product written as multiply-sum
    loops (module docstring; `extra` may set post_grad_fusion_options itself)."""
    from torch._inductor import list_mode_options
    options = {**list_mode_options(mode, False), **QUIET, **extra}
    if torch.device(device).type == "cpu":
        options.pop("triton.cudagraphs", None)      # nothing to capture on a CPU
        # the limit in the options too, although the pass reads the module variable: it keys inductor's caches,
        # so a graph compiled under another limit is not served from its on-disk cache
        one_row = {"cpu_max_other_dimension_decomposition": ONE_ROW_LIMIT}
        options.setdefault("post_grad_fusion_options", {"decompose_mm_pass": one_row})
        try:
            from torch._inductor.fx_passes import decompose_mem_bound_mm
            decompose_mem_bound_mm.cpu_max_other_dimension_decomposition = ONE_ROW_LIMIT
        except ImportError:          # another torch: the pass keeps its own limit (slower, same results)
            pass
    return options


def compile_step(method, options: dict, *, continues: bool = False):
    """torch.compile(fullgraph=True, dynamic=False) of bound method `method` with inductor `options`: over a copy
    of its function's code (its compiled graphs are this call's own) and without the checks of the models (the
    caller compares model_state instead; module docstring).

    Each call begins a new step for CUDA graphs (torch.compiler.cudagraph_mark_step_begin), unless `continues`:
    cudagraph trees keep a graph's outputs in memory they own, and a new step may overwrite the previous step's
    outputs. So a caller reads a step's outputs before the next call of any compiled step, except through a
    `continues` step, which runs in the same step as the call before it and may take that call's outputs as
    inputs (a round's verify takes its draft's tokens and distributions). On a CPU the mark only counts."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    compiled = torch.compile(types.MethodType(own, method.__self__), fullgraph=True, dynamic=False,
                             options={**options, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    if continues:
        return compiled

    def step(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)
    return step


def model_state(*modules) -> list:
    """What compiled steps take as fixed in the models, beyond their tensors' values: per module (named_modules
    order) its type and public attributes (numbers, strings, flags, configs), its hooks, and every parameter's,
    buffer's and tensor attribute's dtype, device, shape and strides. -> a list to compare with =="""
    def summary(v):
        if isinstance(v, torch.Tensor):
            return v.dtype, v.device, tuple(v.shape), v.stride()
        if isinstance(v, (bool, int, float, str, torch.dtype, torch.device, type(None))):
            return v
        if isinstance(v, (tuple, list)):
            return tuple(summary(x) for x in v)
        return repr(v) if is_dataclass(v) else type(v)        # a config by value; anything else by its type
    out = []
    for root in modules:
        for name, m in root.named_modules(remove_duplicate=False):
            out.append((name, type(m)))
            for key, v in vars(m).items():
                if key in ("_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks"):
                    out.append((name, key, tuple((k, summary(x)) for k, x in v.items())))
                elif not key.startswith("_"):
                    out.append((name, key, summary(v)))
    return out


class ModelGuard:
    """What stands in for the model checks compile_step drops: the models an engine's compiled steps read (the
    target and the proposer's modules: a drafter, an MTP head), their model_state when it compiled, and `check`,
    which the engine calls once per run of requests (engine.Engine.check)."""

    def __init__(self, target: torch.nn.Module, proposer, owner: str):
        held = [target, *(vars(proposer).values() if proposer is not None else ())]
        self.models = list({id(m): m for m in held if isinstance(m, torch.nn.Module)}.values())
        self.state, self.owner = model_state(*self.models), owner

    def check(self) -> None:
        if model_state(*self.models) != self.state:
            raise GenerationError(f"the models changed (a dtype, device, shape, attribute or hook) since this {self.owner} "
                                  f"compiled its steps, which take them as fixed; build a new {self.owner} for them")


def mark_static_(cache) -> None:
    """Mark every cache tensor as a static address for torch.compile: CUDA graphs (cudagraph trees) replay a
    graph that writes an input in place only when that input is static, and every step writes the caches.
    Unguarded: cudagraph trees re-record a graph whose static input moved (a cache of another capacity)."""
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t, guard=False)


def graph_counts() -> dict:
    """{"graphs_compiled": graphs inductor generated code for, "graphs_cached": graphs its on-disk FX graph cache
    served} so far in this process. A second run of the same command (same shapes, options, torch and, with
    --products auto, the same cached choice of products) finds every graph in the cache: 0 compiled."""
    from torch._dynamo.utils import counters
    c = counters["inductor"]
    return {"graphs_compiled": c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"], "graphs_cached": c["fxgraph_cache_hit"]}


def cache_folder() -> str:
    """Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, else its default), where the measurements that compiled
    steps depend on are kept beside them (speed/packed.py's product choices, policy.py's step costs)."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "torchinductor_" + getpass.getuser().replace("/", "_"))


def read_record(path: str) -> dict:
    """A JSON record kept in the cache folder (speed/packed.py's verdicts, policy.py's step costs), or {} where it
    is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_record(path: str, record: dict) -> None:
    """`record` to `path` whole or not at all (written aside, then renamed); a read-only place is skipped: the
    numbers are measured again next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), for the record beside every number."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
