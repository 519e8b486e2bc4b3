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


# ==================================================================================================
# Configs
# ==================================================================================================

SUPPORTED_TARGET_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise CheckpointError(f"{where} is missing the field '{key}'; re-export the checkpoint with its full config.json")
    return d[key]


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

    @classmethod
    def from_dict(cls, raw: dict) -> "TargetConfig":
        mt = raw.get("model_type")
        if mt in MOE_TYPES or "num_experts" in raw.get("text_config", raw):
            raise CheckpointError(f"model_type '{mt}' is a mixture-of-experts model; dflash-fast supports the dense Qwen3.5 models only")
        if mt == "qwen3_5":
            tc = dict(_need(raw, "text_config", "config.json of a qwen3_5 model"))
        elif mt == "qwen3_5_text":
            tc = dict(raw)
        else:
            raise CheckpointError(f"unsupported target model_type '{mt}'; expected one of {SUPPORTED_TARGET_TYPES} (a Qwen3.5 checkpoint)")
        where = "the target's text config"
        n_layers = _need(tc, "num_hidden_layers", where)
        layer_types = tc.get("layer_types")
        if layer_types is None:  # HF default: full attention every `full_attention_interval` layers
            every = tc.get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
        rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))   # legacy rope_scaling spells it "type"
        if rope_type != "default":
            raise CheckpointError(f"rope_type '{rope_type}' is not supported; only default (unscaled) RoPE is implemented")
        theta = rope.get("rope_theta", tc.get("rope_theta"))
        if theta is None:
            raise CheckpointError(f"{where} has no rope_theta (in rope_parameters or at top level)")
        eos = raw.get("eos_token_id")
        if eos is None:  # a composite config may write a null top-level eos next to the text config's real one
            eos = tc.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=_need(tc, "vocab_size", where),
            hidden_size=_need(tc, "hidden_size", where),
            intermediate_size=_need(tc, "intermediate_size", where),
            num_hidden_layers=n_layers,
            num_attention_heads=_need(tc, "num_attention_heads", where),
            num_key_value_heads=_need(tc, "num_key_value_heads", where),
            head_dim=tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"],
            linear_num_key_heads=_need(tc, "linear_num_key_heads", where),
            linear_num_value_heads=_need(tc, "linear_num_value_heads", where),
            linear_key_head_dim=_need(tc, "linear_key_head_dim", where),
            linear_value_head_dim=_need(tc, "linear_value_head_dim", where),
            linear_conv_kernel_dim=_need(tc, "linear_conv_kernel_dim", where),
            layer_types=list(layer_types),
            rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            partial_rotary_factor=rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25)),
            mrope_section=list(rope.get("mrope_section", [11, 11, 10])),
            max_position_embeddings=tc.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
            eos_token_id=eos,
            image_token_id=int(raw.get("image_token_id", 248056)),
        )


# Keys a z-lab drafter may carry in `dflash_config` (or at top level). Anything else in `dflash_config`
# changes the architecture (e.g. DFlash2's dynamic convolutions) and is refused instead of ignored.
DRAFT_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "input_embedding_scale",
              "output_multiplier", "final_logit_softcapping", "num_target_layers")


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

    @classmethod
    def from_dict(cls, raw: dict) -> "DraftConfig":
        arch = raw.get("architectures") or []
        if any("DFlash2" in a for a in arch):
            raise CheckpointError(f"architecture {arch} (DFlash2) is not supported; dflash-fast serves DFlashDraftModel checkpoints")
        if raw.get("model_type") not in ("qwen3", None):
            raise CheckpointError(f"unsupported drafter model_type '{raw.get('model_type')}'; a z-lab DFlash drafter has model_type qwen3")
        kinds = set(raw.get("layer_types") or ["full_attention"])
        if kinds != {"full_attention"} or raw.get("use_sliding_window"):
            raise CheckpointError(f"drafter layer types {sorted(kinds)} (sliding window) are not supported; DFlash drafters use full non-causal attention")
        dc = raw.get("dflash_config") or {}
        unknown = sorted(set(dc) - set(DRAFT_KEYS))
        if unknown:
            raise CheckpointError(f"unknown dflash_config keys {unknown}; this drafter variant is not supported (known: {', '.join(DRAFT_KEYS)})")

        def draft_value(key, default=None):
            return dc.get(key, raw.get(key, default))

        where = "the drafter's config.json"
        n_layers = _need(raw, "num_hidden_layers", where)
        n_target = draft_value("num_target_layers")
        layer_ids = draft_value("target_layer_ids")
        if layer_ids is None:
            if n_target is None:
                raise CheckpointError("the drafter config has neither target_layer_ids nor num_target_layers; add one of them")
            layer_ids = default_target_layer_ids(n_target, n_layers)
        mask = draft_value("mask_token_id")
        if mask is None:
            raise CheckpointError("the drafter config has no mask_token_id (in dflash_config or at top level)")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"drafter rope_type '{rope_type}' is not supported; only default RoPE")
        softcap = draft_value("final_logit_softcapping")
        return cls(
            hidden_size=_need(raw, "hidden_size", where),
            intermediate_size=_need(raw, "intermediate_size", where),
            num_hidden_layers=n_layers,
            num_attention_heads=_need(raw, "num_attention_heads", where),
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            vocab_size=_need(raw, "vocab_size", where),
            target_layer_ids=[int(i) for i in layer_ids],
            mask_token_id=int(mask),
            block_size=int(draft_value("block_size", 16)),
            num_target_layers=n_target,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1000000.0))),
            attention_bias=bool(raw.get("attention_bias", False)),
            input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
            output_multiplier=float(draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap in (None, 0) else float(softcap),
        )

    def check_fits(self, target: TargetConfig) -> None:
        """A drafter built for another target fails here, before it can propose nonsense."""
        fix = "use the drafter trained for this target"
        if self.hidden_size != target.hidden_size:
            raise CheckpointError(f"drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}; {fix}")
        if self.vocab_size != target.vocab_size:
            raise CheckpointError(f"drafter vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}; {fix}")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            raise CheckpointError(f"drafter was built for a {self.num_target_layers}-layer target, this one has {target.num_hidden_layers}; {fix}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise CheckpointError(f"drafter target_layer_ids {bad} do not exist in a {target.num_hidden_layers}-layer target; {fix}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise CheckpointError(f"drafter mask_token_id {self.mask_token_id} is outside the target vocab (0..{target.vocab_size - 1}); {fix}")


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


# ==================================================================================================
# Loading checkpoints
# ==================================================================================================

HUB_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "preprocessor_config.json", "*.safetensors", "model.safetensors.index.json"]


def resolve_dir(name: str) -> str:
    """A local folder, or a Hugging Face repo id fetched with huggingface_hub (only the files we read)."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise CheckpointError(f"{name} is a file; pass the checkpoint folder that holds config.json")
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise CheckpointError(f"{name} is not a folder here and not a Hugging Face repo id (org/name)")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated repo: one line that says which
        raise CheckpointError(f"could not fetch {name} from the Hugging Face Hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                              "download it first and pass the local folder") from None


def read_json(f: str) -> dict:
    """A JSON object from file f; anything else (bad JSON, bad encoding, a list) is a one-line CheckpointError."""
    try:
        with open(f, encoding="utf-8") as fh:
            d = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}); re-download the checkpoint") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{f} holds a JSON {type(d).__name__}, not an object; re-download the checkpoint")
    return d


def read_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.exists(f):
        raise CheckpointError(f"{path} has no config.json; point at a checkpoint folder")
    return read_json(f)


def read_safetensors(path: str, keep=None) -> dict:
    """All tensors of a checkpoint folder (those whose name `keep(name)` accepts, when given): one
    model.safetensors, or the shards named by model.safetensors.index.json. Missing or truncated files
    fail with the file's name."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map naming the shards; re-download the checkpoint")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for name in files:
        f = os.path.join(path, name)
        if not os.path.exists(f):
            raise CheckpointError(f"shard {name} named in the index is missing from {path}; re-download the checkpoint")
        try:
            with safe_open(f, framework="pt") as fh:
                for key in fh.keys():
                    if keep is None or keep(key):     # unread tensors (the vision tower, MTP) cost no memory
                        tensors[key] = fh.get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{f} is truncated or corrupt ({type(e).__name__}); re-download it") from None
    return tensors


def _target_key(name: str) -> str | None:
    """Checkpoint name -> our parameter name; None for tensors text-only decoding does not use."""
    if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name.replace("linear_attn.conv1d.weight", "linear_attn.conv_weight")


def load_into(module: nn.Module, tensors: dict, dtype, what: str, keep_fp32=()):
    """Copy checkpoint tensors into `module`, converting dtype; every parameter must be present with its shape."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{what} checkpoint lacks {', '.join(missing[:3])}{more}; it does not match its config.json")
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise CheckpointError(f"{what} checkpoint has tensors this architecture does not use: {', '.join(unexpected[:3])}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if name.endswith("conv_weight") and t.dim() == 3:
                t = t[:, 0, :]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{what} tensor {name} has shape {tuple(t.shape)}, config.json implies {tuple(p.shape)}")
            p.data = t.to(torch.float64 if dtype == torch.float64 else torch.float32) if name.endswith(keep_fp32) else t.to(dtype)


def load_target(path: str, dtype=torch.float32, device="cpu") -> Qwen35:
    path = resolve_dir(path)
    cfg = TargetConfig.from_dict(read_config(path))
    with torch.device("meta"):
        model = Qwen35(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:  # to_empty gives each module its own new Parameter: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    tensors = {_target_key(name): t for name, t in read_safetensors(path, keep=lambda n: _target_key(n) is not None).items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    # A_log and dt_bias are kept in float32: exp(A_log) in bf16 loses the decay's precision (spec 10).
    load_into(model, tensors, dtype, "target", keep_fp32=("A_log", "dt_bias"))
    model.inv_freq = inv_freq(cfg.rotary_dim, cfg.rope_theta)
    model.mrope_cols = mrope_columns(cfg.mrope_section, cfg.rotary_dim // 2)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.path = path
    return model.to(device).eval()


def load_drafter(path: str, target_cfg: TargetConfig, dtype=torch.float32, device="cpu") -> DFlashDrafter:
    path = resolve_dir(path)
    cfg = DraftConfig.from_dict(read_config(path))
    cfg.check_fits(target_cfg)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model.to_empty(device="cpu")
    tensors = {(k[len("model."):] if k.startswith("model.") else k): t for k, t in read_safetensors(path).items()}
    load_into(model, tensors, dtype, "drafter")
    model.inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta)
    model.path = path
    return model.to(device).eval()


def load_tokenizer(path: str):
    """The checkpoint's tokenizer.json via `tokenizers`, or None when the folder has none."""
    f = os.path.join(path, "tokenizer.json")
    if not os.path.exists(f):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(f)
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{f} cannot be read ({msg}); re-download it or pass --prompt-ids") from None


def stop_token_ids(path: str, cfg: TargetConfig) -> list:
    """Stop ids from generation_config.json when present, else config.json's eos_token_id (spec 9)."""
    f = os.path.join(path, "generation_config.json")
    if os.path.exists(f):
        eos = read_json(f).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return list(cfg.eos_token_id)
