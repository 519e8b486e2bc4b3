"""Tiny random models and stand-in proposers shared by the tests."""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pickle
import random
import threading
import traceback

import torch

import checkpoint as ckpt
from check import zlab_module
import engine
import kernels
import model as M


class Early:
    """Slow work of a test module, started in a background thread right after collection when any of the module's
    tests was collected (conftest.py), so that it runs on the core the suite's one-thread tests leave idle: work
    that runs in other processes anyway (process groups of ranks, command lines), or, with process=True, a
    module-level function run in a process of its own (a spawned interpreter, one torch thread; its value must
    pickle). Declared at module level, `runs = Early(fn)` (started when any test of the module was collected) or
    `Early(fn, used_by=[test names])` (when one of those was); a test calls `runs.result()`, which waits for fn's
    value (or raises its exception), and runs fn there and then if nothing started it. The tests' assertions stay in
    the tests; the work only computes what they check."""
    registry: list = []

    def __init__(self, fn, process: bool = False, used_by: tuple = ()):
        self.fn, self.module = (functools.partial(in_own_process, fn) if process else fn), fn.__module__
        self.used_by = set(used_by)
        self.lock, self.done, self.started = threading.Lock(), threading.Event(), False
        self.value = self.error = None
        Early.registry.append(self)

    def start(self) -> None:
        with self.lock:
            if self.started:
                return
            self.started = True
        try:
            self.value = self.fn()
        except BaseException as e:          # raised again in the test that asks for the result
            self.error = e
        finally:
            self.done.set()

    def result(self):
        self.start()
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value

    @staticmethod
    def start_for(tests: set) -> None:
        """Start, one after another in one background thread, the work these tests ((module, function name) pairs,
        the collected ones) use: first the work of a whole module (no used_by), whose tests run in their module's
        place, then the work of named tests, which conftest.py runs last."""
        modules = {m for m, _ in tests}
        jobs = [j for j in Early.registry
                if j.module in modules and (not j.used_by or any((j.module, t) in tests for t in j.used_by))]
        jobs.sort(key=lambda j: bool(j.used_by))
        if jobs:
            threading.Thread(target=lambda: [j.start() for j in jobs], daemon=True).start()


def in_own_process(fn):
    """fn() (a module-level function) in a process of its own that has imported conftest.py first (one torch thread,
    the suite's hypothesis profile, in force before fn's module is imported and its @settings are made), -> its
    value (or its exception raised again here). The process is forked from multiprocessing's fork server, a fresh
    single-threaded interpreter that has imported conftest.py (torch, pytest, hypothesis) and nothing else: each job
    starts from that state instead of paying the imports again (about 3 s a process here), and nothing of this
    process's (its threads, compiled graphs, registered lowerings) reaches it. The process is a daemon: a session
    that ends before it does (a failure under -x) ends it instead of waiting for it."""
    import multiprocessing
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["conftest"])            # (before the server starts: the first call)
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_and_send, args=(fn.__module__, fn.__qualname__, send), daemon=True)
    proc.start()
    send.close()
    try:
        ok, value = pickle.loads(receive.recv_bytes())
    except EOFError:
        proc.join()
        raise RuntimeError(f"{fn.__name__} ended without a result (exit code {proc.exitcode})") from None
    proc.join()
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def fresh_inductor_cache():
    """An empty inductor cache folder for this process while the block runs (fresh code, not a cached graph; removed
    after), -> its path. Inductor first learns which vector instructions the C++ compiler builds by compiling a test
    program for each (about 13 s on 2 cores), once per process and cache folder: asked here in the folder in use
    before the switch, where it is built already, the answer is kept for the process instead of built again."""
    import tempfile
    from torch._inductor import cpu_vec_isa
    cpu_vec_isa.pick_vec_isa()
    with tempfile.TemporaryDirectory() as cache:
        before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            yield cache
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def property_cases(prop, cases: list) -> list:
    """The hypothesis search of `prop` (a @given function that pytest does not collect) once per case (a dict of the
    arguments @given does not draw), for an Early(process=True) job: the suite's hypothesis profile and one torch
    thread (conftest.py, in_own_process) -> per case None, or the exception it raised (its falsifying example in
    its notes)."""
    out = []
    for kwargs in cases:
        try:
            prop(**kwargs)
            out.append(None)
        except Exception as e:
            e.add_note(traceback.format_exc())          # (the traceback does not cross the process boundary)
            out.append(e)
    return out


def raise_case(error) -> None:
    """A property_cases entry in the test that reports it: its exception raised there."""
    if error is not None:
        raise error


def _run_and_send(module: str, name: str, send) -> None:
    import importlib
    try:
        importlib.import_module("conftest")
        out = (True, getattr(importlib.import_module(module), name)())
    except BaseException as e:
        out = (False, e)
    send.send_bytes(pickle.dumps(out))     # by value (tensors too): nothing is left to fetch from this process


def tiny_target_config(**kw) -> M.TargetConfig:
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 0])
    base.update(kw)
    return M.TargetConfig(**base)


def tiny_draft_config(target: M.TargetConfig, **kw) -> M.DraftConfig:
    base = dict(hidden_size=target.hidden_size, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=target.vocab_size,
                target_layer_ids=ckpt.default_target_layer_ids(target.num_hidden_layers, 2),
                mask_token_id=target.vocab_size - 1, block_size=16, num_target_layers=target.num_hidden_layers,
                rope_theta=10000.0)
    base.update(kw)
    return M.DraftConfig(**base)


DRAFTER_KINDS = {
    "dflash": {},
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),    # causal, windowed
    "causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None),  # no use_sliding_window
    "noncausal-window": dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=3, is_causal=False),
    "dflash2": dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=3),
}


def kind_draft_config(target: M.TargetConfig, kind: str, **kw) -> M.DraftConfig:
    """A tiny two-layer drafter of one of DRAFTER_KINDS (the published variants: docs/method.md#drafter-variants)."""
    return tiny_draft_config(target, **{**DRAFTER_KINDS[kind], **kw})


def randomize_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights with every norm weight randomised too, so a (1 + w) slip changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                centre = 0.0 if isinstance(module, M.Qwen35) and "linear_attn.norm" not in name else 1.0
                p.copy_(centre + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv_weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # linear layers: unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return module


def random_target(cfg: M.TargetConfig, seed=0, dtype=torch.float64) -> M.Qwen35:
    return randomize_(M.Qwen35(cfg), seed).to(dtype).eval()


def random_drafter(cfg: M.DraftConfig, seed=0, dtype=torch.float64) -> M.DFlashDrafter:
    return randomize_(M.DFlashDrafter(cfg), seed).to(dtype).eval()


@contextlib.contextmanager
def verify_kernel(target: M.Qwen35, kernel: str):
    """Verify calls of `target` inside the block run GDN with `kernel`: "block" (the closed form, the default)
    or "recurrent" (the step-by-step reference, the same maths token by token)."""
    rule = {"block": kernels.block_gated_delta_rule, "recurrent": kernels.recurrent_gated_delta_rule}[kernel]
    layers = [m for m in target.modules() if isinstance(m, M.GatedDeltaNet)]
    for m in layers:
        m.block_rule = rule
    try:
        yield
    finally:
        for m in layers:
            del m.block_rule


class OracleProposer:
    """Stand-in engine.Proposer: for each row, the true continuation of the request in it (known from an AR run alone)
    with one corruption at an index drawn per row and per round, so every row accepts exactly what its own plan
    says, independently of the other rows; each row's plan cycles through a seeded shuffle of 0..n (n = all
    accepted), so every acceptance length occurs. continuations: {tuple(prompt ids): the AR output ids}.
    `asked`: (prompt, start, planned acceptance) per live row and round."""

    feature_layers = ()
    wants_next_ids = False
    samples_drafts = False
    window = None
    cache = None

    def __init__(self, continuations: dict, vocab: int, seed: int = 0, max_block_size: int = 16):
        self.cont, self.V, self.rng = continuations, vocab, random.Random(seed)
        self.max_block_size = max_block_size
        self.asked = []

    def reset(self, slots, capacity, masks=None):
        self.rows, self.plans = [None] * slots, [[] for _ in range(slots)]

    def admit(self, row, feats, pos, prompt_ids, first):
        self.rows[row] = tuple(prompt_ids)

    def append(self, feats, pos, next_ids):
        pass

    def propose(self, last, start, feats, feat_pos, n, next_ids, rows=None, temperature=None):
        out = []
        for b, prompt in enumerate(self.rows):
            if prompt is None or int(start[b]) < len(prompt):      # a free slot (it rides along at position 0)
                out.append([0] * n)
                continue
            cont = self.cont[prompt]
            if not self.plans[b]:
                self.plans[b] = list(range(n + 1))
                self.rng.shuffle(self.plans[b])
            a = self.plans[b].pop()
            i = int(start[b]) - len(prompt) + 1                 # index in the continuation of the token after last
            row = (cont[i:i + n] + [self.rng.randrange(self.V) for _ in range(n)])[:n]
            if a < n:
                row[a] = (row[a] + 1 + self.rng.randrange(self.V - 1)) % self.V   # anything but the true token
            self.asked.append((prompt, int(start[b]), a))
            out.append(row)
        return engine.Draft(torch.tensor(out, dtype=torch.long, device=last.device))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED_TARGET = os.path.join(ROOT, "checkpoints", "tiny-qwen35")
EMBEDDED_DRAFT = os.path.join(ROOT, "checkpoints", "tiny-qwen35-dflash")
HAS_EMBEDDED_PAIR = os.path.exists(os.path.join(EMBEDDED_DRAFT, "model.safetensors"))


def embedded_pair():
    """The embedded target and drafter in float32, and two Python prompts of different lengths (token ids)."""
    target = ckpt.load_target(EMBEDDED_TARGET, torch.float32)
    drafter = ckpt.load_drafter(EMBEDDED_DRAFT, target.cfg, torch.float32)
    tok = ckpt.load_tokenizer(EMBEDDED_TARGET)
    p1 = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(").ids
    p2 = tok.encode("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def").ids
    return target, drafter, p1, p2


def hf_text_config(**kw):
    from transformers import Qwen3_5TextConfig
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1]})
    base.update(kw)
    return Qwen3_5TextConfig(**base)


def randomize_hf_norms_(hf_model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name and "visual" not in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return hf_model


def save_hf_causal_lm(path, seed=0, **kw):
    """A tiny transformers Qwen3_5ForCausalLM with random weights (norms randomised) saved in fp32."""
    from transformers import Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    hf = randomize_hf_norms_(Qwen3_5ForCausalLM(hf_text_config(**kw)).float().eval(), seed)
    hf.save_pretrained(path)
    return hf


def save_hf_conditional(path, seed=0, **kw):
    """The multimodal layout (model.language_model.*, model.visual.*) of Qwen3_5ForConditionalGeneration."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    tc = hf_text_config(**kw)
    vc = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=tc.hidden_size,
              num_position_embeddings=16)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=tc.to_dict(), vision_config=vc)).float().eval()
    randomize_hf_norms_(hf, seed)
    hf.save_pretrained(path)
    return hf


def save_zlab_drafter(path, target_layers: int, vocab: int, hidden: int, seed=0, n_layers=2, block_size=8,
                      mask_token_id=None, layer_ids=None, dflash2=None, **kw):
    """A z-lab DFlashDraftModel with random weights (norms randomised), saved with save_pretrained. dflash2: the
    DFlash2 keys of dflash_config (conv_kernel_size, ...) for a DFlash2DraftModel; kw: more Qwen3Config keys
    (layer_types, sliding_window, use_sliding_window, is_causal, ...)."""
    from transformers import Qwen3Config
    zm = zlab_module()
    dcfg = {"mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id, "block_size": block_size,
            **(dflash2 or {})}
    if layer_ids is not None:
        dcfg["target_layer_ids"] = layer_ids
    base = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=80, num_hidden_layers=n_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
                num_target_layers=target_layers, dflash_config=dcfg)
    base.update(kw)
    cfg = Qwen3Config(**base)
    cfg.architectures = ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    torch.manual_seed(seed)
    d = (zm.DFlash2DraftModel if dflash2 else zm.DFlashDraftModel)(cfg).float().eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:                # linear layers, codebooks, DFlash2's base kernels (allocated uninitialised)
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    d.save_pretrained(path)
    return d


def edit_json(path, fn):
    with open(path) as fh:
        d = json.load(fh)
    fn(d)
    with open(path, "w") as fh:
        json.dump(d, fh)


def speculators_eagle3_layer():
    """The `speculators` package's (vLLM's checkpoint format) EAGLE-3 decoder layer for Llama-style drafters,
    LlamaDecoderEagle3FirstLayer, loaded from its file alone: the package's own __init__ pulls in its training stack
    (openai, datasets), and the file needs only transformers and its `base_components` registry, stubbed here."""
    import importlib.metadata
    import importlib.util
    import sys
    import types
    f = importlib.metadata.distribution("speculators").locate_file("speculators/models/eagle3/model_definitions.py")
    stub = types.ModuleType("speculators.models")
    stub.base_components = types.SimpleNamespace(override_components=lambda *a, **k: None, ModelComponents=object)
    saved = {k: sys.modules.get(k) for k in ("speculators", "speculators.models")}
    sys.modules["speculators"], sys.modules["speculators.models"] = types.ModuleType("speculators"), stub
    try:
        spec = importlib.util.spec_from_file_location("speculators_eagle3_model_definitions", f)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod.LlamaDecoderEagle3FirstLayer


def dynamo_only(monkeypatch) -> None:
    """torch.compile's steps traced by dynamo and AOTAutograd as the command lines trace them, but run without
    inductor's code generation (backend aot_eager, the inductor options dropped but the guard filter kept). What is
    guarded and what recompiles is decided before inductor: a test of recompiles asks only this, in a fraction of
    the time (inductor's code is tested by the compiled tests that compare tokens with eager)."""
    import compiling
    real = torch.compile

    def compile_(fn, mode=None, options=None, **kw):
        keep = {"guard_filter_fn": options["guard_filter_fn"]} if options and "guard_filter_fn" in options else None
        return real(fn, backend="aot_eager", options=keep, **kw)
    monkeypatch.setattr(compiling.torch, "compile", compile_)
