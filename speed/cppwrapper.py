"""Optional: inductor's C++ wrapper for the compiled steps on a CPU, with the layers' compile regions.

Inductor drives every compiled step through a wrapper that calls its kernels one by one. The default wrapper is
Python; the C++ wrapper (inductor option cpp_wrapper) does the same from C++ and is much cheaper for the small
graphs of a decode, verify or draft step on a CPU. But torch 2.13's C++ wrapper refuses the nested compile
regions of model.py's layers (NotImplementedError in CppWrapperCpu.codegen_invoke_subgraph). `options()`
teaches it: each region body (one per kind of layer) is written ONCE, as a C++ lambda at its first call site,
and every layer calls the lambda. Written out again at every call site, the entry function would hold one copy
per layer, and g++ -O3 on that huge function is most of a CPU compilation.

generate.py and tools/bench.py use it when they compile on a CPU (`--no-cpp-wrapper` keeps the Python wrapper).
It patches a private inductor method of the torch this project pins; where that method is missing, options()
returns {} and the Python wrapper is used. Deleting this file and the lines that call it leaves a working
project (compiled CPU steps then run the Python wrapper).
"""
from __future__ import annotations

import logging

_PATCHED = False
TESTED = (2, 13)      # the first torch release the patch was written and tested against: its memory planner and
                      # its C++ wrapper's calls; torch 2.11's planner fails on the lambdas (an index out of bounds)


def _torch_release() -> tuple:
    """(major, minor) of the running torch."""
    import torch
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def options() -> dict:
    """-> the inductor options that turn the C++ wrapper on (patched for compile regions), or {} where it
    cannot be patched."""
    global _PATCHED
    if not _PATCHED:
        try:
            from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
        except ImportError:
            return {}
        if not hasattr(CppWrapperCpu, "codegen_invoke_subgraph") or _torch_release() < TESTED:
            return {}
        CppWrapperCpu.codegen_invoke_subgraph = _codegen_invoke_subgraph
        logging.getLogger("torch._inductor.ir").addFilter(_no_c_shim_note)
        _PATCHED = True
    return {"cpp_wrapper": True}


def _codegen_invoke_subgraph(self, invoke_subgraph) -> None:
    """CppWrapperCpu's code for one call of a region: the body as a lambda of the entry function (written at the
    first call of that body), then a call of it. Inductor lowers each region body once, for any wrapper."""
    from torch._inductor import ir
    from torch._inductor.codegen.wrapper import EnterSubgraphLine, ExitSubgraphLine
    from torch._inductor.virtualized import V
    subgraph = invoke_subgraph.subgraph
    graph = subgraph.graph
    outs = [(i, o) for i, o in enumerate(invoke_subgraph.outputs) if isinstance(o, ir.MultiOutput)]
    fn = f"{graph.name}_fn"
    written = self.__dict__.setdefault("_written_regions", set())
    if fn not in written:
        written.add(fn)
        ins = [f"in{i}" for i in range(len(graph.graph_inputs))]
        params = [f"AtenTensorHandle {n}" for n in ins] + [f"RAIIAtenTensorHandle& out{i}" for i, _ in outs]
        arrays = set(self.codegen_int_array_var_cache)
        self.writeline(f"auto {fn} = [&]({', '.join(params)}) {{")
        self.writeline(EnterSubgraphLine(self, graph))
        self.push_codegened_graph(graph)
        try:
            self.codegen_subgraph_prefix(subgraph, ins, None)
            parent = V.graph
            with V.set_graph_handler(graph):
                graph.codegen_subgraph(parent_graph=parent)
            for i, _ in outs:
                self.writeline(f"out{i} = std::move({graph.graph_outputs[i].codegen_reference()});")
        finally:
            self.pop_codegened_graph()
        self.writeline(ExitSubgraphLine(self))
        self.writeline("};")
        for key in set(self.codegen_int_array_var_cache) - arrays:   # declared inside the lambda: not visible after it
            del self.codegen_int_array_var_cache[key]
    for _, o in outs:
        self.writeline(f"RAIIAtenTensorHandle {o.get_name()};")
    self.writeline(f"{fn}({', '.join([b.codegen_reference() for b in invoke_subgraph.inputs] + [o.get_name() for _, o in outs])});")


def _no_c_shim_note(record: logging.LogRecord) -> bool:
    """Drops inductor's note that an op (linalg_solve_triangular) has no C shim in the C++ wrapper and runs
    through its proxy executor: expected and harmless, but printed on every CPU compilation."""
    return "missing a c-shim implementation" not in record.getMessage()
