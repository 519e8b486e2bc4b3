"""Qwen3.5 (dense, hybrid Gated DeltaNet + gated attention) target and the DFlash block-diffusion drafter,
in plain PyTorch, with static caches and loaders for the real Hugging Face checkpoint formats.

Follows ../shared/qwen35-spec.md (sections cited as "spec N") and ../shared/dflash-notes.md ("notes N").

Glossary (code name -> meaning; symbols of the DFlash paper in brackets):
    cfg: TargetConfig / DraftConfig   checkpoint config.json read by explicit keys
    H                      hidden size                          (d)
    L                      number of target decoder layers
    T                      tokens in this forward call; B (lower-case `bsz` in code) is the batch, always 1 in decoding
    pos                    absolute positions of the T tokens, a LongTensor [T]
    feature_layers         target layers whose OUTPUT the drafter reads (`target_layer_ids`; notes 1)
    feats                  concatenated outputs of those layers, [B, T, n_feat * H]        (target context features)
    ctx                    hidden_norm(fc(feats)): the drafter's injected context, [B, T, H]
    block                  [last committed token, MASK x (block_size - 1)]                   (the noised block)
    block_size             tokens per draft/verify step                                     (B in the paper, 16)
    GDN                    Gated DeltaNet (linear attention) layer; its state is (conv state, recurrent state S)
    capacity               positions the static KV caches hold (prompt + new tokens + one block of slack)

Forward modes of the target (`Qwen35.forward(..., gdn=...)`):
    "chunked"   prefill: GDN runs the chunked rule from the cached state and writes the final state at once
    "decode"    AR decode (T=1): GDN runs the recurrent rule and keeps the state after the token at once.
    "recurrent" verify (T=block): GDN computes each token's output and its state WRITE
                (kernels: S_t = e^gamma_t S_0 + sum_j e^(gamma_t - gamma_j) k_j e_j^T) and keeps (k, writes, g)
                of the call; the state itself is untouched until `TargetCache.commit(n)` builds the state after
                the n-th token from them. This is the exact rollback (notes 3): the state before the call plus
                the writes of the committed tokens only. Chosen over per-token state slots (16 x 48 MiB at 9B,
                written on every verify) and over snapshot-and-replay (a variable number of sequential steps):
                the shapes stay static and the commit is one small matmul per layer.
    "block"     as "recurrent", but the outputs and writes of a multi-token call come from the closed form of
                one chunk (kernels.block_gated_delta_rule): a few matmuls instead of T sequential steps.
                Same maths; in floats it rounds differently from the step-by-step rule, like any two matmul
                shapes do (a [16, H] and a [1, H] projection already differ in the last bit).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be used; the message says what is wrong and what to do."""


@dataclass
class TargetConfig:
    """The text model of a dense Qwen3.5 checkpoint (every size differs only in these numbers; spec 1)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: list
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    mrope_section: list = field(default_factory=lambda: [11, 11, 10])
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    eos_token_id: list = field(default_factory=list)
    image_token_id: int = 248056     # <|image_pad|>: its embeddings are replaced by image tokens (vision.py)

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(f"config has {len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        bad = set(self.layer_types) - {"linear_attention", "full_attention"}
        if bad:
            raise CheckpointError(f"unknown layer types {sorted(bad)}; only linear_attention and full_attention exist in Qwen3.5")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise CheckpointError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CheckpointError(f"partial_rotary_factor {self.partial_rotary_factor} gives an invalid rotary dim {self.rotary_dim}")
        if sum(self.mrope_section) != self.rotary_dim // 2:
            # The interleaved layout needs one section entry per frequency column; for 1-D text positions
            # the sections do not matter, so fall back to all-T rather than refuse a valid checkpoint.
            self.mrope_section = [self.rotary_dim // 2, 0, 0]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """Evenly spaced target layers between 1 and L-3 (notes 1); [L // 2] for a one-layer drafter."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DraftConfig:
    """A z-lab DFlash drafter: Qwen3 decoder layers with the target's features injected as K/V (notes 1)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list
    mask_token_id: int
    block_size: int = 16
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        if self.block_size < 1:
            raise CheckpointError(f"drafter block_size {self.block_size} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("drafter num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise CheckpointError("drafter target_layer_ids is empty")


# ==================================================================================================
# Building blocks
# ==================================================================================================

class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5 RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, cast back at the end (spec 2).
    The stored weight is an offset (initialised to 0)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(xf.dtype))).to(x.dtype)


class RMSNorm(nn.Module):
    """Ordinary (Qwen3) RMSNorm used by the drafter: y = w * cast(x * rsqrt(mean(x^2) + eps))."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm (spec 2): normalise one value head, cast, multiply by w (used directly, no 1+),
    then by silu(z) in float32, cast back. One [dv] weight shared by all value heads."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, z):
        xf = x.float() if x.dtype != torch.float64 else x
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        n = self.weight * n
        return (n * F.silu(z.to(xf.dtype))).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names). After `pack_for_cpu_`, its float32 CPU products of
    2..kernels.FEW_ROWS rows outside autograd use the packed oneDNN copy (kernels.onednn_linear says why)."""
    packed = None            # kernels.onednn_pack(weight), or None: always F.linear
    packed_from = None       # (weight.data_ptr(), weight._version) when packed: a later change is detected

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        if (self.packed is not None and 1 < rows <= kernels.FEW_ROWS and x.dtype == torch.float32
                and not torch.is_grad_enabled()):
            if torch.compiler.is_compiling():     # an op dynamo can trace (kernels.onednn_linear)
                return kernels.onednn_linear(x, self.packed, self.bias, self.out_features)
            return kernels.onednn_linear_impl(x, self.packed, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)


def _available_memory() -> int | None:
    """Bytes of physical memory free now (Linux), or None where that cannot be read."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def pack_for_cpu_(module: nn.Module) -> int:
    """Give every Linear of a float32 CPU module a packed oneDNN copy of its weight (or refresh a copy whose
    weight was replaced or changed in place since). Nothing on other devices or dtypes, with
    kernels.ONEDNN_LINEAR off, or when the copies would take more than half of the memory free now (a big
    float32 model on a CPU keeps MKL rather than run out of memory). -> bytes of copies made now.
    dflash.Engine calls it at the start of every generation, so a copy never serves a weight it was not
    made from."""
    todo = []
    for m in module.modules():
        if not isinstance(m, Linear):
            continue
        w = m.weight
        if not (kernels.ONEDNN_LINEAR and w.device.type == "cpu" and w.dtype == torch.float32):
            m.packed = m.packed_from = None
            continue
        try:
            stamp = (w.data_ptr(), w._version)
        except RuntimeError:            # an inference-mode tensor keeps no version counter: pack it every time
            stamp = None
        if m.packed is None or stamp is None or m.packed_from != stamp:
            todo.append((m, stamp))
    need = sum(m.weight.numel() * 4 for m, _ in todo)
    free = _available_memory()
    if free is not None and need > free // 2:
        for m in module.modules():
            if isinstance(m, Linear):
                m.packed = m.packed_from = None
        return 0
    for m, stamp in todo:
        m.packed, m.packed_from = kernels.onednn_pack(m.weight), stamp
    return need


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x):
    """NeoX rotation: [a, b] -> [-b, a] over the last dim."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x, cos, sin):
    """x [B, heads, T, D]; cos, sin [T, R] with R <= D: rotate the first R dims, pass the rest (partial RoPE)."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)


def inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta^(-2i/R) for i < R/2, computed in float32 as HF does (so the angles round the same)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def mrope_columns(mrope_section: list, n_freq: int) -> torch.Tensor:
    """Stream (0=T, 1=H, 2=W) that each frequency column takes its angle from, interleaved layout
    THWTHW... (spec 3.5): H where i % 3 == 1 and i < 3*sec[1], W where i % 3 == 2 and i < 3*sec[2]."""
    cols = torch.zeros(n_freq, dtype=torch.long)
    for stream in (1, 2):
        end = min(3 * mrope_section[stream], n_freq)
        if end > stream:
            cols[torch.arange(stream, end, 3)] = stream
    return cols


def attention(q, k, v, mask):
    """q [B,Hq,Tq,D]; k, v [B,Hkv,Tk,D]; mask: bool [Tq,Tk] or [B,1,Tq,Tk] (True = visible), or a FlexAttention
    BlockMask (training on GPU; inference with `attention="flex"`) -> [B,Tq,Hq*D]. Query head h reads kv head
    h // (Hq // Hkv). Scale D**-0.5."""
    gqa = k.shape[1] != q.shape[1]
    if type(mask).__name__ == "BlockMask":
        from torch.nn.attention.flex_attention import flex_attention
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


# FlexAttention block masks for inference (`attention="flex"`). Each is built ONCE per Engine over the static
# cache, then sliced per step: a step keeps the rows (query tiles) it needs and gets an exact `mask_mod` that
# reads the step's start position from a device tensor, so nothing is rebuilt and nothing recompiles.
#
# The masks are built with rows indexed by ABSOLUTE position: row r stands for positions r*FLEX_BLOCK ..
# r*FLEX_BLOCK + FLEX_BLOCK-1 and lists every key tile that any of those positions may see. All listed tiles
# are "partial" (the exact mask_mod is evaluated in every one): a step whose queries straddle a tile border
# uses the row of its LAST query, whose list covers every earlier query too (the masks grow with position),
# and the extra keys that row lists are removed by the mask_mod. So correctness rests on two simple facts
# (the row is a superset; the mask_mod is exact), never on tile arithmetic. The cost is one compare per
# score in the listed tiles, nothing next to the memory traffic of a decode step.
FLEX_BLOCK = 128        # FlexAttention's default tile (rows and columns of a BlockMask)


def _all_partial(bm):
    """A BlockMask listing, per row, every tile that is partial OR full in `bm`, all as partial."""
    from torch.nn.attention.flex_attention import BlockMask
    dense = bm.to_dense().bool()                                                   # [1, 1, rows, tiles]
    num = dense.sum(-1, dtype=torch.int32)
    order = dense.to(torch.uint8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)   # listed first, ascending
    return BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod,
                                    seq_lengths=bm.seq_lengths, compute_q_blocks=False)


def causal_block_mask(capacity: int, device):
    """Target attention over a static cache of `capacity` positions (prefill, decode, verify): row r lists the
    key tiles 0..r. Built once per Engine (O(capacity^2) mask evaluations, once)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return _all_partial(create_block_mask(causal, None, None, capacity, capacity, device=device, BLOCK_SIZE=FLEX_BLOCK))


def causal_rows(bm, pos):
    """The mask of one cached target call from `causal_block_mask`: queries at the contiguous positions
    pos [T] (start .. start+T-1) over the whole cache; a query at p sees keys <= p (the SDPA path's rule)."""
    T = pos.shape[0]
    last = torch.clamp(torch.arange(0, T, FLEX_BLOCK, device=pos.device) + FLEX_BLOCK - 1, max=T - 1)
    step = bm[:, :, pos[last] // FLEX_BLOCK]             # per local query tile: the row of its last query
    start = pos[0]

    def causal_from(b, h, q_idx, kv_idx):              # q_idx counts from the call's first query
        return kv_idx <= q_idx + start
    step.mask_mod = causal_from
    step.seq_lengths = (T, bm.seq_lengths[1])
    return step


def _draft_visible(capacity: int, window: int | None):
    """mask_mod factory for the drafter's keys [cache (capacity) ; block]: with the block starting at position
    `start`, context positions [start - window, start) and every block key are visible (block both ways)."""
    def visible(start, kv_idx):
        ctx = kv_idx < start
        if window is not None:
            ctx = ctx & (kv_idx >= start - window)
        return ctx | (kv_idx >= capacity)
    return visible


def draft_block_mask(capacity: int, block: int, window: int | None, device):
    """The drafter's cached attention: keys are [cache (capacity) ; block (block tokens)]. The mask does not
    depend on the query, only on the block's start, so rows are indexed by start: row r lists the tiles that a
    block starting anywhere in r*FLEX_BLOCK .. r*FLEX_BLOCK + FLEX_BLOCK-1 may see. Built once per Engine."""
    from torch.nn.attention.flex_attention import create_block_mask
    visible = _draft_visible(capacity, window)

    def by_start(b, h, q_idx, kv_idx):                 # q_idx plays the block's start position here
        return visible(q_idx, kv_idx)
    return _all_partial(create_block_mask(by_start, None, None, capacity, capacity + block, device=device,
                                          BLOCK_SIZE=FLEX_BLOCK))


def draft_rows(bm, start, n_query: int, window: int | None):
    """The mask of one draft step from `draft_block_mask`: n_query block tokens starting at start (0-d tensor)
    over [cache ; block]."""
    capacity = bm.seq_lengths[0]
    if n_query != bm.seq_lengths[1] - capacity or n_query > FLEX_BLOCK:
        raise ValueError(f"a draft block of {n_query} tokens, but the mask was built for {bm.seq_lengths[1] - capacity} "
                         f"(and at most one FlexAttention tile, {FLEX_BLOCK})")
    step = bm[:, :, (start // FLEX_BLOCK).view(1)]
    visible = _draft_visible(capacity, window)

    def draft(b, h, q_idx, kv_idx):
        return visible(start, kv_idx)
    step.mask_mod = draft
    step.seq_lengths = (n_query, capacity + n_query)
    return step


# ==================================================================================================
# Target: Qwen3.5 hybrid
# ==================================================================================================

class GatedAttention(nn.Module):
    """Full-attention layer (spec 3): q_proj gives query and output gate interleaved per head,
    q/k zero-centred norm before partial RoPE, causal GQA, output * sigmoid(gate), o_proj."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.hd * 2, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, pos, cache):
        """x [B,T,H]; cos, sin [T,R]; pos [T]; cache: AttnCache or None (then causal over x alone)."""
        bsz, T, _ = x.shape
        qg = self.q_proj(x).view(bsz, T, self.nh, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(bsz, T, self.nh * self.hd)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)                         # [B,nh,T,hd]
        k = apply_rope(self.k_norm(self.k_proj(x).view(bsz, T, self.nkv, self.hd)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(bsz, T, self.nkv, self.hd).transpose(1, 2)
        if cache is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        else:
            # Write at the absolute positions; a query at position p sees keys at positions <= p. Entries
            # beyond the committed length (a rejected draft's K/V) are hidden by the same rule and
            # overwritten before anyone can see them: rollback of attention is free.
            cache.k.index_copy_(2, pos, k.to(cache.k.dtype))
            cache.v.index_copy_(2, pos, v.to(cache.v.dtype))
            k, v = cache.k, cache.v
            if cache.block_mask is not None:           # FlexAttention: the once-built mask, sliced for this call
                mask = causal_rows(cache.block_mask, pos)
            else:
                mask = torch.arange(k.shape[2], device=x.device)[None, :] <= pos[:, None]
        o = attention(q, k, v, mask)
        return self.o_proj(o * torch.sigmoid(gate))


class GatedDeltaNet(nn.Module):
    """Linear-attention layer (spec 4): depthwise causal conv + SiLU on [q|k|v], L2-normed q/k, the gated
    delta rule with an fp32 state, gated RMSNorm by z, out_proj."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.in_proj_qkv = Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, self.hv, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, self.kernel))   # checkpoint: conv1d.weight [C,1,K]
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cache, gdn: str):
        """x [B,T,H]; cache: GDNCache or None (then from a zero state, chunked, nothing kept)."""
        bsz, T, _ = x.shape
        sd = torch.float64 if x.dtype == torch.float64 else torch.float32
        c = self.in_proj_qkv(x)                                                          # [B,T,conv_dim]
        z = self.in_proj_z(x).view(bsz, T, self.hv, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x)).to(sd)                                   # [B,T,Hv]
        g = -self.A_log.to(sd).exp() * F.softplus(self.in_proj_a(x).to(sd) + self.dt_bias.to(sd))
        conv_state = cache.conv if cache is not None else x.new_zeros(bsz, self.kernel - 1, self.conv_dim)
        u, window = kernels.causal_conv1d(c, self.conv_weight, conv_state)
        q, k, v = u.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.view(bsz, T, self.hk, self.dk).to(sd)) * self.dk ** -0.5
        k = _l2norm(k.view(bsz, T, self.hk, self.dk).to(sd))
        v = v.reshape(bsz, T, self.hv, self.dv)
        state = cache.rec if cache is not None else torch.zeros(bsz, self.hv, self.dk, self.dv, dtype=sd, device=x.device)
        if gdn in ("chunked", "decode"):                    # every token of the call is committed at once
            if gdn == "chunked":
                o, final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, state)
            else:
                o, _, final = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, state)
            if cache is not None:
                cache.rec.copy_(final)
                cache.conv.copy_(window[:, window.shape[1] - (self.kernel - 1):])
        elif gdn in ("recurrent", "block"):
            rule = kernels.recurrent_gated_delta_rule if gdn == "recurrent" or T == 1 else kernels.block_gated_delta_rule
            o, writes = rule(q, k, v, g, beta, state)[:2]
            if cache is not None:
                if T > cache.writes.shape[1]:
                    raise ValueError(f"a {T}-token recurrent call exceeds the cache's max_block {cache.writes.shape[1]}")
                cache.keys[:, :T].copy_(k)                  # the state is built only by TargetCache.commit(n)
                cache.writes[:, :T].copy_(writes)
                cache.decay[:, :T].copy_(g)
                cache.window[:, :window.shape[1]].copy_(window)
        else:
            raise ValueError(f"gdn must be 'chunked', 'decode', 'recurrent' or 'block', not {gdn!r}")
        y = self.norm(o.to(x.dtype), z)
        return self.out_proj(y.reshape(bsz, T, self.value_dim))


def _l2norm(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last dim (eps inside the sum, as FLA and HF do)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class DecoderLayer(nn.Module):
    """Pre-norm block: x += mixer(norm(x)); x += mlp(norm(x)). The mixer is GDN or gated attention."""

    def __init__(self, cfg: TargetConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, pos, cache, gdn):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            x = x + self.linear_attn(h, cache, gdn)
        else:
            x = x + self.self_attn(h, cos, sin, pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class AttnCache:
    k: torch.Tensor          # [B, Hkv, capacity, hd], post-norm, post-RoPE
    v: torch.Tensor          # [B, Hkv, capacity, hd]
    block_mask: object = None   # a FlexAttention BlockMask built once over the cache (attention="flex"), else SDPA


@dataclass
class GDNCache:
    conv: torch.Tensor       # [B, K-1, conv_dim]: the last K-1 pre-conv inputs, oldest first
    rec: torch.Tensor        # [B, Hv, dk, dv] float32 (float64 in float64 runs): S after the last committed token
    keys: torch.Tensor       # [B, max_block, Hk, dk]  the last recurrent call's L2-normed keys,
    writes: torch.Tensor     # [B, max_block, Hv, dv]  its per-token state writes (kernels) and
    decay: torch.Tensor      # [B, max_block, Hv]      its log decays g: with rec, the state after any prefix
    window: torch.Tensor     # [B, K-1+max_block, conv_dim]: conv state + that call's pre-conv inputs


class TargetCache:
    """Static caches for one sequence, allocated once for `capacity` positions and written in place."""

    def __init__(self, cfg: TargetConfig, capacity: int, dtype, device, batch: int = 1, max_block: int = 16):
        """max_block: the widest recurrent (decode/verify) call; its keys, writes and decays are kept (a few
        vectors per token: at 9B and max_block 16, 9.5 MB in all where per-token states would take 768 MiB)."""
        sd = torch.float64 if dtype == torch.float64 else torch.float32
        self.capacity = capacity
        self.layers = []
        for t in cfg.layer_types:
            if t == "full_attention":
                shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
                self.layers.append(AttnCache(torch.zeros(shape, dtype=dtype, device=device),
                                             torch.zeros(shape, dtype=dtype, device=device)))
            else:
                conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
                hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
                dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
                k1 = cfg.linear_conv_kernel_dim - 1
                self.layers.append(GDNCache(
                    conv=torch.zeros(batch, k1, conv_dim, dtype=dtype, device=device),
                    rec=torch.zeros(batch, hv, dk, dv, dtype=sd, device=device),
                    keys=torch.zeros(batch, max_block, hk, dk, dtype=sd, device=device),
                    writes=torch.zeros(batch, max_block, hv, dv, dtype=sd, device=device),
                    decay=torch.zeros(batch, max_block, hv, dtype=sd, device=device),
                    window=torch.zeros(batch, k1 + max_block, conv_dim, dtype=dtype, device=device)))

    def commit(self, n) -> None:
        """After a recurrent forward over T tokens, keep the first n (1 <= n <= T) of them: each GDN state
        becomes the state after token n-1, built from the state before the call and the writes of tokens
        0..n-1 (kernels.state_after), and the conv state becomes window rows n .. n+K-2. `n` may be an int
        or a 0-d device tensor (no host sync). Attention needs nothing: its stale entries are masked."""
        for layer in self.layers:
            if isinstance(layer, GDNCache):
                idx = torch.as_tensor(n, device=layer.rec.device).reshape(1)
                layer.rec.copy_(kernels.state_after(layer.keys, layer.writes, layer.decay, layer.rec, idx))
                k1 = layer.conv.shape[1]
                layer.conv.copy_(layer.window.index_select(1, idx + torch.arange(k1, device=layer.window.device)))


class Qwen35(nn.Module):
    """The Qwen3.5 text model with its lm_head. `forward` also returns the drafter's context features."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, t) for t in cfg.layer_types])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq(cfg.rotary_dim, cfg.rope_theta), persistent=False)
        self.register_buffer("mrope_cols", mrope_columns(cfg.mrope_section, cfg.rotary_dim // 2), persistent=False)

    def rope(self, pos, dtype):
        """pos [T] (text) or [3,T] (t,h,w streams) -> cos, sin [T, rotary_dim] in `dtype`.
        Angles are computed in float32 (as HF does); with equal streams this is plain partial RoPE."""
        pos3 = pos.expand(3, -1) if pos.dim() == 1 else pos
        ang = pos3.float()[:, :, None] * self.inv_freq                             # [3,T,R/2]
        ang = ang.gather(0, self.mrope_cols.view(1, 1, -1).expand(1, ang.shape[1], -1)).squeeze(0)
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, ids, pos, cache: TargetCache | None = None, gdn: str = "chunked",
                feature_layers=(), last_logits_only: bool = False, rope_pos=None, image_embeds=None):
        """ids [B,T] token ids at sequence positions pos [T] (the cache slots they occupy).
        cache None: a plain causal forward over ids alone (training, reference); else the caches are used
        and updated as `gdn` says (see the module docstring).
        rope_pos: the RoPE positions when they differ from pos: [3,T] (t,h,w) for a prompt with images, or
        [T] = pos + rope_delta for later tokens (vision.py); image_embeds [n,H] replace, in order, the
        embeddings of the n image pad tokens in ids (B = 1).
        -> logits [B,T,V] (or [B,1,V] with last_logits_only), feats [B,T,len(feature_layers)*H] or None."""
        x = self.embed_tokens(ids)
        if image_embeds is not None:
            x = x.masked_scatter((ids == self.cfg.image_token_id)[..., None], image_embeds.to(x.dtype))
        return self.forward_embeds(x, pos, cache, gdn, feature_layers, last_logits_only, rope_pos)

    def forward_embeds(self, x, pos, cache=None, gdn="chunked", feature_layers=(), last_logits_only=False, rope_pos=None):
        cos, sin = self.rope(pos if rope_pos is None else rope_pos, x.dtype)
        feats = [None] * len(feature_layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pos, None if cache is None else cache.layers[i], gdn)
            for j, l in enumerate(feature_layers):    # (a layer may be listed twice: default spacing on small targets)
                if l == i:
                    feats[j] = x                     # the OUTPUT of layer i (HF hidden_states[i + 1]; notes 1)
        h = self.norm(x[:, -1:] if last_logits_only else x)
        return self.lm_head(h), (torch.cat(feats, dim=-1) if feats else None)


# ==================================================================================================
# Drafter: DFlash block diffusion
# ==================================================================================================

class DraftAttention(nn.Module):
    """Qwen3 attention with KV injection (notes 1): Q from the block only; K, V from [context ; block];
    k_norm on both; ordinary 1-D RoPE over the full head dim; NON-causal."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def kv(self, x, cos, sin):
        """x [B,T,H] -> k, v [B,Hkv,T,hd] (k normed and rotated)."""
        bsz, T, _ = x.shape
        k = apply_rope(self.k_norm(self.k_proj(x).view(bsz, T, self.nkv, self.hd)).transpose(1, 2), cos, sin)
        return k, self.v_proj(x).view(bsz, T, self.nkv, self.hd).transpose(1, 2)

    def append(self, ctx, cos, sin, pos, cache: AttnCache) -> None:
        """Write the context's K/V at positions pos [Tc] of the cache."""
        kc, vc = self.kv(ctx, cos, sin)
        cache.k.index_copy_(2, pos, kc.to(cache.k.dtype))
        cache.v.index_copy_(2, pos, vc.to(cache.v.dtype))

    def forward(self, x, ctx, cos_q, sin_q, cos_c, sin_c, mask, cache: AttnCache | None, ctx_pos, block_start,
                window: int | None = None):
        """x [B,Tq,H] block hidden; ctx [B,Tc,H] new context (after fc + hidden_norm); cos_q/sin_q [Tq,hd],
        cos_c/sin_c [Tc,hd]. Without a cache, keys are [ctx ; x] and `mask` [Tq, Tc+Tq] says who sees what
        (training). With a cache, the ctx K/V are written at ctx_pos, and the block sees cached positions
        < block_start plus the whole block both ways."""
        bsz, Tq, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(bsz, Tq, self.nh, self.hd)).transpose(1, 2), cos_q, sin_q)
        kb, vb = self.kv(x, cos_q, sin_q)
        if cache is None:
            kc, vc = self.kv(ctx, cos_c, sin_c)
        else:
            if ctx is not None:
                self.append(ctx, cos_c, sin_c, ctx_pos, cache)
            kc, vc = cache.k, cache.v
            # Only positions < block_start hold committed context. Entries at >= block_start (features of
            # rejected tokens appended with a whole verify block) are hidden and overwritten next step.
            if cache.block_mask is not None:    # FlexAttention: the once-built mask, sliced for this block
                mask = draft_rows(cache.block_mask, block_start, Tq, window)
            else:                               # the same rule as a boolean mask over [cache ; block]
                kpos = torch.arange(kc.shape[2] + Tq, device=x.device)
                mask = _draft_visible(kc.shape[2], window)(block_start, kpos)[None, :].expand(Tq, -1)
        o = attention(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask)
        return self.o_proj(o)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope, mask, cache, ctx_pos, block_start, window=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, *rope, mask, cache, ctx_pos, block_start, window)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the concatenated target features, Qwen3 layers, final norm. It has no
    embedding or lm_head: the target's are passed in (shared and frozen; notes 1)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def rope(self, pos, dtype):
        """pos [T] -> cos, sin [T, hd]; pos [B, T] (training, anchors differ per row) -> [B, 1, T, hd]."""
        ang = pos.float()[..., None] * self.inv_freq
        ang = torch.cat([ang, ang], dim=-1)
        if pos.dim() == 2:
            ang = ang[:, None]
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, block_embeds, feats, block_pos, ctx_pos, cache: "DraftCache | None" = None, mask=None,
                window: int | None = None, block_start=None):
        """block_embeds [B,Tq,H] (target embedding of the block, times input_embedding_scale);
        feats [B,Tc,n_feat*H] target features at positions ctx_pos [Tc]; block_pos [Tq].
        With a cache: the context is appended to it (positions ctx_pos must continue it) and the block
        attends to all cached context before block_pos[0]. Without (training): keys are [context ; blocks],
        `mask` says who sees what ([B,1,Tq,Tc+Tq] bool or a BlockMask), block_pos may be [B, Tq].
        window (with a cache): the block sees only the last `window` context positions (SGLang's draft window,
        for long prompts; z-lab issue #66).
        block_start: block_pos[0] as a 0-d tensor that is an input of the compiled step (a FlexAttention mask_mod
        may capture only graph inputs under torch.compile on CPU); default block_pos[0].
        -> hidden [B,Tq,H] after the final norm; logits come from the target's lm_head (`draft_logits`)."""
        if feats is None:                       # context already appended (append_context)
            ctx, rope_c = None, (None, None)
        else:
            ctx, rope_c = self.hidden_norm(self.fc(feats)), self.rope(ctx_pos, block_embeds.dtype)
        rope = (*self.rope(block_pos, block_embeds.dtype), *rope_c)
        x = block_embeds
        if block_start is None:
            block_start = block_pos.view(-1)[0]
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope, mask, None if cache is None else cache.layers[i], ctx_pos, block_start, window)
        return self.norm(x)

    def append_context(self, feats, ctx_pos, cache: "DraftCache") -> None:
        """feats [B,Tc,n_feat*H] at positions ctx_pos [Tc] -> every layer's context K/V in the cache.
        The context K/V do not depend on the block, so they can be written ahead of (or apart from) a draft."""
        ctx = self.hidden_norm(self.fc(feats))
        cos, sin = self.rope(ctx_pos, ctx.dtype)
        for layer, lc in zip(self.layers, cache.layers):
            layer.self_attn.append(ctx, cos, sin, ctx_pos, lc)

    def draft_logits(self, hidden, lm_head: nn.Linear):
        """Logits of the drafter through the target's lm_head, with the optional z-lab output scaling."""
        logits = lm_head(hidden)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


class DraftCache:
    """The drafter's context K/V per layer, for `capacity` positions. Only context K/V are kept: the block's
    K/V are recomputed every step and thrown away (notes 1, z-lab issue #15)."""

    def __init__(self, cfg: DraftConfig, capacity: int, dtype, device, batch: int = 1):
        shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.layers = [AttnCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(cfg.num_hidden_layers)]



