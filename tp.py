"""Tensor parallelism for the Qwen3.5 target, first part: the shard maths (docs/qwen35.md#checkpoint-tensor-names
names the tensors). Not yet wired to torch.distributed: each function cuts one layer of a built model into the
part rank `rank` of `world` holds, and the tests check that the ranks' outputs summed (what an all-reduce does)
equal the whole layer's.

The layout is the one vLLM (`qwen3_next.py`, `qwen3_5.py`) and SGLang (`models/qwen3_5.py`) use:
- Gated DeltaNet (`shard_gdn`): rank r holds key heads r*hk/w .. and the value heads that read them (value head h
  reads key head h // (hv/hk), so a contiguous split keeps each group whole). in_proj_qkv and the depthwise
  conv are split per segment (its q rows, its k rows, its v rows), in_proj_z / in_proj_b / in_proj_a, A_log and
  dt_bias by value head; the gated norm is per head (replicated weight, no communication); out_proj is split by
  its input columns (row-parallel): the ranks' outputs sum to the layer's. The recurrent and conv states, and the
  rollback, are per head: each rank keeps its own heads' (TargetCache built from the shard's config).
- Gated attention (`shard_attention`): query heads split, each head's query and gate rows together (q_proj
  interleaves them per head); KV heads split when the degree divides them, else replicated so that each rank
  holds the KV head its query heads read; q_norm / k_norm replicated; o_proj row-parallel.
- MLP (`shard_mlp`): gate_proj / up_proj by output rows (column-parallel), down_proj by input columns
  (row-parallel). The embedding and lm_head stay replicated in this first part.

    shard_gdn(layer, rank, world)        -> GatedDeltaNet with 1/world of the heads
    shard_attention(layer, rank, world)  -> GatedAttention with 1/world of the query heads
    shard_mlp(mlp, rank, world)          -> MLP with 1/world of the intermediate size
"""
from __future__ import annotations

import copy

import torch

from model import MLP, GatedAttention, GatedDeltaNet, GenerationError


def _part(n: int, rank: int, world: int, what: str) -> slice:
    """Rank `rank`'s contiguous share of n items; n must divide by world."""
    if n % world:
        raise GenerationError(f"tensor parallel degree {world} does not divide the {n} {what}; use a degree that divides it")
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def _rows(t: torch.Tensor, idx) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.detach()[idx].clone(), requires_grad=False)


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    lin.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    return lin


@torch.no_grad()
def shard_gdn(layer: GatedDeltaNet, rank: int, world: int) -> GatedDeltaNet:
    hk, hv, dk, dv = layer.hk, layer.hv, layer.dk, layer.dv
    keys = _part(hk, rank, world, "GDN key heads")
    vals = _part(hv, rank, world, "GDN value heads")
    qk_rows = torch.arange(hk * dk).view(hk, dk)[keys].flatten()
    v_rows = torch.arange(hv * dv).view(hv, dv)[vals].flatten()
    conv_rows = torch.cat([qk_rows, hk * dk + qk_rows, 2 * hk * dk + v_rows])       # its q, its k, its v channels
    out = copy.copy(layer)                       # a shallow copy: submodules replaced below, the original kept
    out._modules, out._parameters = dict(layer._modules), dict(layer._parameters)
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
def shard_attention(layer: GatedAttention, rank: int, world: int) -> GatedAttention:
    nh, nkv, hd = layer.nh, layer.nkv, layer.hd
    heads = _part(nh, rank, world, "attention heads")
    if nkv % world == 0:
        kv = _part(nkv, rank, world, "KV heads")
    else:                                        # replicated: the KV heads this rank's query heads read
        if world % nkv:
            raise GenerationError(f"tensor parallel degree {world} and the {nkv} KV heads: one must divide the other")
        group = nh // nkv
        first = heads.start // group
        kv = slice(first, first + 1)
    q_rows = torch.arange(nh * 2 * hd).view(nh, 2 * hd)[heads].flatten()            # each head's query and gate
    kv_rows = torch.arange(nkv * hd).view(nkv, hd)[kv].flatten()
    out = copy.copy(layer)
    out._modules, out._parameters = dict(layer._modules), dict(layer._parameters)
    out.nh, out.nkv = heads.stop - heads.start, kv.stop - kv.start
    out.q_proj = _linear(layer.q_proj.weight[q_rows])
    out.k_proj = _linear(layer.k_proj.weight[kv_rows])
    out.v_proj = _linear(layer.v_proj.weight[kv_rows])
    out.o_proj = _linear(layer.o_proj.weight[:, torch.arange(nh * hd).view(nh, hd)[heads].flatten()])
    return out


@torch.no_grad()
def shard_mlp(mlp: MLP, rank: int, world: int) -> MLP:
    inter = _part(mlp.gate_proj.weight.shape[0], rank, world, "MLP intermediate channels")
    out = copy.copy(mlp)
    out._modules = dict(mlp._modules)
    out.gate_proj = _linear(mlp.gate_proj.weight[inter])
    out.up_proj = _linear(mlp.up_proj.weight[inter])
    out.down_proj = _linear(mlp.down_proj.weight[:, inter])
    return out
