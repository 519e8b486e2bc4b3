"""Tensor and expert parallelism for the Qwen3.5 target on torch.distributed (docs/method.md#past-one-device).

`torchrun --nproc-per-node N generate.py ...` (and tools/bench.py) runs N processes. Each reads the checkpoint one layer
at a time, and of each layer only the slices its rank holds (`Parallel.load_target`, `Unread`), cut as
gpt-fast's `tp.py` cuts a built model in place: model.py is unchanged, and the cut layers are model.py's own
classes with fewer heads. The ranks' partial sums meet in all-reduces issued by `AllReduce` through torch's
functional collectives (traceable by torch.compile), on the gloo backend on a CPU and NCCL on CUDA. No transport
of our own.

The layout is vLLM's (`model_executor/models/qwen3_next.py`, `qwen3_5.py`) and SGLang's (`srt/models/qwen3_5.py`),
each function's docstring says how it cuts its layer: GDN by key head with the value heads that read it, attention
by query head (KV heads split or replicated), MLPs column- then row-parallel, routed experts by channel or whole
(expert parallel: masked local compute plus one all-reduce). Two all-reduces per layer (after the mixer and the
MLP). The embedding and lm_head stay replicated, so every rank chooses the same token with no broadcast per step;
the drafter is replicated by default, or cut like the target (`shard_drafter`). The adaptive policy decides on
rank 0 for every rank (`Synced`): ranks whose steps differed would issue different collectives.

    shard_gdn(layer, rank, world)        -> GatedDeltaNet with 1/world of the heads
    shard_attention(layer, rank, world)  -> GatedAttention with 1/world of the query heads
    shard_mlp(mlp, rank, world)          -> MLP with 1/world of the intermediate size
    shard_moe(moe, rank, world, ep)      -> SparseMoE with 1/world of every expert, or of the experts
    shard_target(target, rank, world, reduce)   in place, with the all-reduces; target.cfg becomes the shard's
    launch(device)                       -> Parallel (torchrun's environment read, the process group up) or None
    Parallel.load_target(path, ...)      -> the target read layer by layer, only this rank's slices of each
    Unread                               a checkpoint tensor a shard function indexes before any of it is read
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import checkpoint as ckpt
import engine
import mtp
from model import MLP, DecoderLayer, DraftAttention, DFlashDrafter, Experts, GatedAttention, GatedDeltaNet, \
    GenerationError, Qwen35, SparseMoE


def _part(n: int, rank: int, world: int, what: str) -> slice:
    """Rank `rank`'s contiguous share of n items; n must divide by world."""
    if n % world:
        raise GenerationError(f"tensor parallel degree {world} does not divide the {n} {what}; use a degree that divides it")
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def _rows(t: torch.Tensor, idx) -> torch.nn.Parameter:
    return torch.nn.Parameter(t[idx].detach().clone(), requires_grad=False)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype, device="meta")
    lin.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return lin


def _column(lin: nn.Linear, rows) -> nn.Linear:
    """Column-parallel: this rank's output rows (and their bias)."""
    return _linear(lin.weight[rows], None if lin.bias is None else lin.bias[rows])


def _row(lin: nn.Linear, cols, rank: int) -> nn.Linear:
    """Row-parallel: this rank's input columns; a bias is added once, on rank 0 (the ranks' outputs are summed)."""
    bias = None if lin.bias is None else (lin.bias if rank == 0 else torch.zeros(lin.bias.shape, dtype=lin.bias.dtype, device=lin.bias.device))
    return _linear(lin.weight[:, cols], bias)


def _heads(nh: int, nkv: int, rank: int, world: int) -> tuple:
    """This rank's query heads and the KV heads they read: KV split when the degree divides them, else the one KV
    head this rank's query heads share (replicated across the ranks that hold its group)."""
    heads = _part(nh, rank, world, "attention heads")
    if nkv % world == 0:
        return heads, _part(nkv, rank, world, "KV heads")
    if world % nkv:
        raise GenerationError(f"tensor parallel degree {world} and the {nkv} KV heads: one must divide the other")
    first = heads.start // (nh // nkv)
    return heads, slice(first, first + 1)


def _head_rows(n: int, width: int, part: slice) -> torch.Tensor:
    """The rows of heads `part` in a projection of n heads of `width` rows each."""
    return torch.arange(n * width).view(n, width)[part].flatten()


def _copy(module: nn.Module) -> nn.Module:
    """A shallow copy whose submodules and parameters can be replaced without touching the original."""
    out = copy.copy(module)
    out._modules, out._parameters = dict(module._modules), dict(module._parameters)
    return out


class Unread:
    """A checkpoint tensor not read yet (checkpoint.Stored or Joined), standing in for a layer's parameter while
    Parallel.load_target cuts the layer: indexing it as the shard functions index a weight (a slice or a 1-D index
    tensor per dimension) narrows what will be read, and only those elements are read, in `dtype`
    (Stored.read_part) into a tensor of its own on clone(), where the shard functions copy a weight's rows with
    .detach().clone(). shape, dtype, device and dim() as the tensor's."""

    device = torch.device("cpu")

    def __init__(self, stored, dtype, index: tuple | None = None):
        self.stored, self.dtype = stored, dtype
        self.index = index or (None,) * stored.dim()        # per dimension: a 1-D index tensor, or None (all)
        self.shape = torch.Size(n if ix is None else len(ix) for n, ix in zip(stored.shape, self.index))

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key) -> "Unread":
        index = list(self.index)
        for d, k in enumerate(key if isinstance(key, tuple) else (key,)):
            if isinstance(k, slice) and k == slice(None):
                continue
            if not isinstance(k, (slice, torch.Tensor)):
                raise TypeError(f"an Unread weight is indexed by slices and 1-D index tensors, not {type(k).__name__}")
            at = torch.arange(self.shape[d])[k]                  # positions within what is selected so far
            index[d] = at if index[d] is None else index[d][at]
        return Unread(self.stored, self.dtype, tuple(index))

    def detach(self) -> "Unread":
        return self

    def clone(self) -> torch.Tensor:
        """The selected elements read from the file (what a tensor's detach().clone() gives: a tensor of its own)."""
        return self.stored.read_part(self.index[0], self.index[1:], self.dtype)


@torch.no_grad()
def shard_gdn(layer: GatedDeltaNet, rank: int, world: int) -> GatedDeltaNet:
    hk, hv, dk, dv = layer.hk, layer.hv, layer.dk, layer.dv
    keys = _part(hk, rank, world, "GDN key heads")
    vals = _part(hv, rank, world, "GDN value heads")
    qk_rows = torch.arange(hk * dk).view(hk, dk)[keys].flatten()
    v_rows = torch.arange(hv * dv).view(hv, dv)[vals].flatten()
    conv_rows = torch.cat([qk_rows, hk * dk + qk_rows, 2 * hk * dk + v_rows])       # its q, its k, its v channels
    out = _copy(layer)
    out.hk, out.hv = hk // world, hv // world
    out.key_dim, out.value_dim = out.hk * dk, out.hv * dv
    out.conv_dim = 2 * out.key_dim + out.value_dim
    out.in_proj_qkv = _linear(layer.in_proj_qkv.weight[conv_rows])
    out.in_proj_z = _linear(layer.in_proj_z.weight[v_rows])
    out.in_proj_b = _linear(layer.in_proj_b.weight[vals])
    out.in_proj_a = _linear(layer.in_proj_a.weight[vals])
    out.conv_weight = _rows(layer.conv_weight, conv_rows)
    out.A_log, out.dt_bias = _rows(layer.A_log, vals), _rows(layer.dt_bias, vals)
    out.out_proj = _linear(layer.out_proj.weight[:, v_rows])                        # row-parallel: partial sums
    return out


@torch.no_grad()
def _cut_heads(layer, rank: int, world: int, q_width: int):
    """An attention layer (nh, nkv, hd, q/k/v/o_proj) cut by head; q_proj has q_width rows per head."""
    heads, kv = _heads(layer.nh, layer.nkv, rank, world)
    out = _copy(layer)
    out.nh, out.nkv = heads.stop - heads.start, kv.stop - kv.start
    out.q_proj = _column(layer.q_proj, _head_rows(layer.nh, q_width, heads))
    kv_rows = _head_rows(layer.nkv, layer.hd, kv)
    out.k_proj, out.v_proj = _column(layer.k_proj, kv_rows), _column(layer.v_proj, kv_rows)
    out.o_proj = _row(layer.o_proj, _head_rows(layer.nh, layer.hd, heads), rank)
    return out


def shard_attention(layer: GatedAttention, rank: int, world: int) -> GatedAttention:
    return _cut_heads(layer, rank, world, 2 * layer.hd)          # q_proj: each head's query and gate rows together


def shard_draft_attention(layer: DraftAttention, rank: int, world: int) -> DraftAttention:
    """The drafter's Qwen3 attention: as the target's, without the gate rows (and with biases where it has them)."""
    return _cut_heads(layer, rank, world, layer.hd)


@torch.no_grad()
def shard_mlp(mlp: MLP, rank: int, world: int) -> MLP:
    inter = _part(mlp.gate_proj.weight.shape[0], rank, world, "MLP intermediate channels")
    out = _copy(mlp)
    out.gate_proj, out.up_proj = _column(mlp.gate_proj, inter), _column(mlp.up_proj, inter)
    out.down_proj = _row(mlp.down_proj, inter, rank)
    return out


class LocalExperts(Experts):
    """Expert parallelism: whole experts `first` .. first + n - 1 of the E. A token's chosen experts that live on
    another rank give zero here (that rank adds them in the all-reduce). Both of Experts' paths, idx [N, k] over
    all E experts -> [N, k, H]."""

    def __init__(self, experts: Experts, part: slice):
        nn.Module.__init__(self)
        self.first = part.start
        self.gate_up_proj, self.down_proj = _rows(experts.gate_up_proj, part), _rows(experts.down_proj, part)

    def _here(self, idx):
        here = (idx >= self.first) & (idx < self.first + self.down_proj.shape[0])
        return here, torch.where(here, idx - self.first, 0)

    def gathered(self, h, idx):
        """Static shapes (compiled steps): every chosen slot is computed, those of other ranks' experts masked out."""
        here, local = self._here(idx)
        return torch.where(here[..., None], super().gathered(h, local), 0)

    def looped(self, h, idx):
        """Only the slots whose expert lives here run (eager, long prompts)."""
        here, local = self._here(idx)
        y = h.new_zeros(*idx.shape, h.shape[-1])
        rows, slots = here.nonzero(as_tuple=True)
        if rows.numel():
            y[rows, slots] = super().looped(h[rows], local[rows, slots, None])[:, 0]
        return y


@torch.no_grad()
def shard_moe(moe: SparseMoE, rank: int, world: int, expert_parallel: bool = False) -> SparseMoE:
    """Router replicated; shared expert as an MLP; routed experts cut per expert (tensor parallel: each expert's
    intermediate channels) or by expert (expert_parallel: whole experts). Its output is this rank's partial sum."""
    out = _copy(moe)
    out.shared_expert = shard_mlp(moe.shared_expert, rank, world)   # sigmoid(gate(h)) * shared(h): linear in shared(h)
    ex = moe.experts
    if expert_parallel:
        out.experts = LocalExperts(ex, _part(ex.down_proj.shape[0], rank, world, "routed experts"))
    else:
        inter = ex.down_proj.shape[2]
        cut = _part(inter, rank, world, "expert intermediate channels")
        gate_up = torch.cat([torch.arange(inter)[cut], inter + torch.arange(inter)[cut]])     # its gate rows, its up rows
        out.experts = _copy(ex)
        out.experts.gate_up_proj = _rows(ex.gate_up_proj, (slice(None), gate_up))
        out.experts.down_proj = _rows(ex.down_proj, (slice(None), slice(None), cut))
    return out


# ---- the runtime: all-reduces, the sharded model in place, torchrun ------------------------------------------

class Comm:
    """What the all-reduces carried, counted on eager calls (a compiled step runs no Python): bytes of the summed
    tensors (the payload; a ring all-reduce sends 2 (w - 1) / w of it from each rank)."""

    def __init__(self):
        self.bytes = 0


class AllReduce(nn.Module):
    """A row-parallel piece (`inner`, whose output is this rank's partial sum) followed by the sum over the ranks."""

    def __init__(self, inner: nn.Module, group, comm: Comm):
        super().__init__()
        self.inner, self.group, self.comm = inner, group, comm

    def forward(self, *args):
        y = self.inner(*args)
        if torch.compiler.is_compiling():
            return funcol.all_reduce(y, "sum", self.group)      # traced: the compiled step holds the collective
        self.comm.bytes += y.numel() * y.element_size()
        dist.all_reduce(y, group=self.group)    # eager: the same sum, in place on the fresh partial sum (funcol's
        return y                                # first eager call would import torch._dynamo: seconds per process)


def shard_config(cfg, world: int):
    """The config of one rank's part (its caches are built from it): the head counts divided by the degree (KV heads
    at least one: replicated)."""
    heads = dict(num_attention_heads=cfg.num_attention_heads // world,
                 num_key_value_heads=max(1, cfg.num_key_value_heads // world))
    if hasattr(cfg, "linear_num_key_heads"):
        heads.update(linear_num_key_heads=cfg.linear_num_key_heads // world,
                     linear_num_value_heads=cfg.linear_num_value_heads // world)
    return dataclasses.replace(cfg, **heads)


def shard_layer(layer: DecoderLayer, rank: int, world: int, wrap, expert_parallel: bool = False) -> None:
    """One target (or MTP) decoder layer cut in place; wrap(module) adds the all-reduce after a row-parallel piece."""
    if layer.layer_type == "linear_attention":
        layer.linear_attn = shard_gdn(layer.linear_attn, rank, world)
        layer.linear_attn.out_proj = wrap(layer.linear_attn.out_proj)
    else:
        layer.self_attn = shard_attention(layer.self_attn, rank, world)
        layer.self_attn.o_proj = wrap(layer.self_attn.o_proj)
    moe = isinstance(layer.mlp, SparseMoE)
    layer.mlp = wrap(shard_moe(layer.mlp, rank, world, expert_parallel) if moe else shard_mlp(layer.mlp, rank, world))


def check_degree(target: Qwen35, rank: int, world: int, expert_parallel: bool = False) -> None:
    """A dry run on a copy of one layer of each kind: a degree that does not divide a count is refused before
    anything changes (on meta tensors too: nothing is computed)."""
    for layer in [copy.deepcopy(target.layers[i]) for i in _kinds(target)]:
        shard_layer(layer, rank, world, lambda m: m, expert_parallel)


def shard_target(target: Qwen35, rank: int, world: int, wrap, expert_parallel: bool = False) -> None:
    """Every layer of the target cut in place (checked whole first); target.cfg becomes the shard's, which the
    caches are built from."""
    check_degree(target, rank, world, expert_parallel)
    for layer in target.layers:
        shard_layer(layer, rank, world, wrap, expert_parallel)
    target.cfg = shard_config(target.cfg, world)


def _kinds(target: Qwen35) -> list:
    """One layer index of each layer type."""
    return list({l.layer_type: i for i, l in enumerate(target.layers)}.values())


def shard_drafter(drafter: DFlashDrafter, rank: int, world: int, wrap) -> None:
    """The DFlash drafter cut like the target: attention by head, MLP column / row, all-reduced; fc, the norms and
    DFlash2's convolutions and selector replicated. drafter.cfg becomes the shard's (its context cache)."""
    shard_draft_attention(drafter.layers[0].self_attn, rank, world)                  # refusals before any change
    shard_mlp(drafter.layers[0].mlp, rank, world)
    for layer in drafter.layers:
        layer.self_attn = shard_draft_attention(layer.self_attn, rank, world)
        layer.self_attn.o_proj = wrap(layer.self_attn.o_proj)
        layer.mlp = wrap(shard_mlp(layer.mlp, rank, world))
    drafter.cfg = shard_config(drafter.cfg, world)


BACKENDS = {"cuda": "nccl", "cpu": "gloo"}         # the backend each device takes unless --tp-backend says otherwise
SERVES = {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}}


@dataclasses.dataclass
class Parallel:
    """This process's place in a tensor-parallel run: its rank of `world`, the process group, its device, and how
    the MoE experts and the drafter are cut."""
    rank: int
    world: int
    group: object
    device: str
    expert_parallel: bool = False
    shard_drafter: bool = False
    comm: Comm = dataclasses.field(default_factory=Comm)

    def wrap(self, module: nn.Module) -> AllReduce:
        return AllReduce(module, self.group, self.comm)

    def load_target(self, path: str, dtype, device) -> Qwen35:
        """The target read one layer at a time, each layer cut to this rank's part and moved to `device` before the
        next is read. The cut weights are never read whole: each parameter of a layer starts as an Unread handle on
        its checkpoint tensor, the shard functions index it as they would the weight, and only the rows and columns
        they keep are read from the file (checkpoint.Stored.read_part). So a rank reads its slices (and the
        replicated embedding, head, norms and routers), never the whole checkpoint or a whole layer. target.cfg stays
        the whole model's until `shard` (the proposer is built from it)."""
        path = ckpt.resolve_dir(path)
        raw = ckpt.read_config(path)
        cfg = ckpt.target_config(raw)
        with torch.device("meta"):
            model = Qwen35(cfg)
        check_degree(model, self.rank, self.world, self.expert_parallel)
        outer = nn.Module()          # the parts outside the layers, replicated
        outer.embed_tokens, outer.norm = model.embed_tokens, model.norm
        if not cfg.tie_word_embeddings:
            outer.lm_head = model.lm_head
        outer.to_empty(device="cpu")
        tensors = ckpt.target_tensors(path, cfg, lambda k: not k.startswith("layers."))
        ckpt.load_into(outer, tensors, dtype, "target embedding and head", keep_fp32=ckpt.TARGET_FP32)
        outer.to(device)
        for i, layer in enumerate(model.layers):
            prefix = f"layers.{i}."
            tensors = {k[len(prefix):]: t for k, t in ckpt.target_tensors(path, cfg, lambda k: k.startswith(prefix)).items()}
            for name, p, t, kept in ckpt.matched(layer, tensors, dtype, f"target layers.{i}", keep_fp32=ckpt.TARGET_FP32):
                owner, _, leaf = name.rpartition(".")
                layer.get_submodule(owner)._parameters[leaf] = Unread(t, kept)
            shard_layer(layer, self.rank, self.world, self.wrap, self.expert_parallel)
            for module in layer.modules():          # what no cut read (norms, the router): read whole
                for leaf, p in module._parameters.items():
                    if isinstance(p, Unread):
                        module._parameters[leaf] = nn.Parameter(p.clone(), requires_grad=False)
            layer.to(device)
        for name, buf in model.named_buffers(recurse=False):
            setattr(model, name, torch.empty_like(buf, device=device))
        model.tie_weights_()
        model.init_buffers_()
        model.path, model.cut = path, True
        return model.eval()

    def shard(self, target: Qwen35, proposer) -> None:
        """The target cut in place (unless `load_target` cut it as it read it), with the proposer: a DFlash drafter
        replicated or cut (shard_drafter), the MTP head cut as the target's layers are (it is one of them, and its
        cache is built from the shard's config), an EAGLE-3 head replicated. target.cfg becomes the shard's."""
        if getattr(target, "cut", False):
            target.cfg = shard_config(target.cfg, self.world)
        else:
            shard_target(target, self.rank, self.world, self.wrap, self.expert_parallel)
        if isinstance(proposer, mtp.MTPProposer):
            for layer in proposer.head.layers:
                shard_layer(layer, self.rank, self.world, self.wrap, self.expert_parallel)
        drafter = proposer.drafter if isinstance(proposer, engine.DrafterProposer) else None
        if self.shard_drafter:
            if drafter is None:
                raise GenerationError("--tp-drafter sharded applies to DFlash drafters; this proposer is replicated")
            shard_drafter(drafter, self.rank, self.world, self.wrap)

    def same(self, value):
        """Rank 0's value on every rank (once per run: a seed drawn at random)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group, device=torch.device(self.device))
        return box[0]

    def synced(self, policy):
        return None if policy is None else Synced(policy, self)


class Synced:
    """An adaptive policy that decides once, on rank 0, for every rank. Every rank runs the same steps or the
    collectives of different steps meet and the run aborts; a policy decides from measured times, which differ
    between processes (a rank descheduled on a busy machine). So rank 0's policy decides each step (a round of k or
    a plain step) and the decision is broadcast, one small broadcast per step; every rank's own policy still
    observes its own times, but only rank 0's decides. Tokens need no broadcast: every rank computes the same."""

    def __init__(self, policy, parallel: Parallel):
        self.policy, self.parallel = policy, parallel
        self.blocks = policy.blocks

    @property
    def counts(self):
        return self.policy.counts

    def calibrate(self, calibration) -> None:
        self.policy.calibrate(calibration)

    def reset(self) -> None:
        self.policy.reset()

    def _rank_0s(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.parallel.device)
        dist.broadcast(t, src=0, group=self.parallel.group)
        return int(t.item())

    def speculate(self) -> int:
        """Rank 0's decision on every rank: 0 (a plain step) or the block k of a round."""
        return self._rank_0s(self.policy.speculate())

    def shadow(self) -> int:
        """Rank 0's shadow draft (Policy.shadow) on every rank: the block K, or 0."""
        return self._rank_0s(self.policy.shadow())

    def observe_shadow(self, b: int, k: int, committed: int) -> None:
        self.policy.observe_shadow(b, k, committed)

    def admit(self, b: int) -> None:
        self.policy.admit(b)

    def leave(self, b: int) -> None:
        self.policy.leave(b)

    def observe_round(self, committed: list, k: int, seconds: float) -> None:
        self.policy.observe_round(committed, k, seconds)

    def observe_plain(self, seconds: float) -> None:
        self.policy.observe_plain(seconds)


def world_size() -> int:
    """The number of processes torchrun started (its WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch(device: str | None, backend: str | None = None, expert_parallel: bool = False,
           shard_drafter: bool = False) -> tuple:
    """Under torchrun (WORLD_SIZE > 1): the process group up on the device's backend, this rank's device chosen (CUDA:
    its LOCAL_RANK's GPU), stdout and stderr of ranks other than 0 silenced (every rank computes the same; rank 0
    prints). -> (Parallel, device); (None, device) for one process."""
    world = world_size()
    if world == 1:
        if expert_parallel or shard_drafter or backend:
            raise GenerationError("--expert-parallel, --tp-drafter and --tp-backend apply to runs of several processes: "
                                  "launch with torchrun --nproc-per-node N")
        return None, device
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or BACKENDS[kind]
    if kind not in SERVES[backend]:
        raise GenerationError(f"the {backend} backend does not serve {kind} tensors; use --tp-backend "
                              f"{BACKENDS[kind]} or --device {sorted(SERVES[backend])[0]}")
    if kind == "cuda":
        local, have = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= have:
            raise GenerationError(f"{world} processes but torch sees {have} CUDA device(s) here; use --nproc-per-node "
                                  f"{have} or fewer (or --device cpu)")
        torch.cuda.set_device(local)
        kind = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank = dist.get_rank()
    if rank:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    return Parallel(rank, world, dist.group.WORLD, kind, expert_parallel, shard_drafter), kind


def close() -> None:
    """The process group down at the end of a torchrun process (nothing in a single one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End the process with exit status `code`: sys.exit in a single process; a torchrun rank (WORLD_SIZE > 1, its
    process group closed) flushes its output and ends at once (os._exit), skipping the interpreter's teardown. There
    a rank aborted now and then after its output was complete (SIGABRT, "terminate called without an active
    exception", no Python frame left: a C++ thread of torch's still joinable when static objects are destroyed),
    and torchrun then failed the whole run."""
    if world_size() > 1:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)


def allreduce_bytes(cfg, tokens: int, itemsize: int, draft_layers: int = 0, draft_tokens: int = 0) -> int:
    """The payload all-reduced by one call of the sharded target over `tokens` tokens: two [tokens, H] sums per layer
    (mixer, MLP); plus, with a sharded drafter, two [draft_tokens, H] per drafter layer."""
    return 2 * cfg.hidden_size * itemsize * (cfg.num_hidden_layers * tokens + draft_layers * draft_tokens)
