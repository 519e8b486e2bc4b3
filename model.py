"""Qwen3.5 (the hybrid of Gated DeltaNet and gated attention) and the DFlash block-diffusion drafter, in plain
PyTorch with static caches. Loading and saving the real checkpoints lives in checkpoint.py.

The architecture with shapes: docs/qwen35.md. The drafter and the rollback: docs/method.md.

Glossary (code name: meaning; the DFlash paper's symbol in brackets)
    H               hidden size                                                      (d)
    L               target decoder layers
    T               tokens in this forward call; B (`bsz`) the batch, 1 when decoding
    pos             absolute positions of the T tokens, LongTensor [T]: also the cache slots they occupy
    feature_layers  target layers whose OUTPUT the drafter reads (its `target_layer_ids`)
    feats           those outputs concatenated, [B, T, n_feat * H]                        (target context features)
    ctx             hidden_norm(fc(feats)), the drafter's injected context, [B, T, H]
    block           [last committed token, MASK x (block_size - 1)]                       (the noised block)
    block_size      tokens per draft-verify round                                         (16 in the paper)
    GDN             Gated DeltaNet, the linear-attention layer; its state is (conv window, recurrent S)
    capacity        positions the static caches hold (prompt + new tokens + one block of slack)
    masks           who sees whom in a cached call: DenseMasks (boolean, for SDPA) or flex.FlexMasks
    SHARED_INPUT    a layer's linears that read one input (q/k/v, gate/up, the GDN input projections); the forward
                    runs them through `linears`, one product per group where speed/packed.py joined their weights

How a GDN layer's cache moves (the rollback of docs/method.md#rollback-on-a-hybrid-target):
    verify=False    prefill (chunked rule) and decode (recurrent step): every token is committed, the cache
                    ADVANCEs past them.
    verify=True     the block's outputs and each token's state WRITE; the cache KEEPs the block's writes and its
                    state stays where it was until TargetCache.commit(n) builds the state after token n.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import noise
from kernels import state_dtype


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be used; the message says what is wrong and what to do."""


class GenerationError(ValueError):
    """Bad generation input (dflash.GenerationError); the message names the problem and the fix."""


@dataclass
class TargetConfig:
    """The text model of a Qwen3.5 checkpoint, dense or mixture-of-experts (every size differs only in these numbers)."""
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
    num_experts: int = 0             # Qwen3.5-MoE: routed experts per layer (SparseMoE); 0 = a dense MLP
    num_experts_per_tok: int = 0     # top_k: experts per token
    moe_intermediate_size: int = 0   # each routed expert's SwiGLU width
    shared_expert_intermediate_size: int = 0

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
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts ({self.num_experts})")
        if sum(self.mrope_section) != self.rotary_dim // 2:
            # sections that do not cover the rotary dims do not matter for text: all-T rather than refuse
            self.mrope_section = [self.rotary_dim // 2, 0, 0]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass
class DraftConfig:
    """A z-lab DFlash drafter: Qwen3 decoder layers with the target's features injected as K/V (docs/method.md#the-drafter)."""
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
    layer_types: list | None = None     # per layer "full_attention" (default) or "sliding_attention"
    sliding_window: int | None = None   # a sliding layer's reach in positions (None: unlimited)
    is_causal: bool | None = None       # every layer causal or not; None: sliding layers causal, full ones not
    conv_kernel_size: int = 0           # DFlash2 (> 0): dynamic causal convolutions of this width around
    conv_group_size: int = 0            #   each sublayer, channels in groups of this size,
    selector_rank: int = 0              #   and a candidate selector: low-rank codebooks of this rank
    selector_top_k: int = 0             #   over the top-k tokens of each block row
    train_context_length: int | None = None   # the longest context it was trained on, where its config says

    def __post_init__(self):
        if self.block_size < 1:
            raise CheckpointError(f"drafter block_size {self.block_size} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError("drafter num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            raise CheckpointError("drafter target_layer_ids is empty")
        self.layer_types = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(f"drafter has {len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise CheckpointError(f"drafter layer types {sorted(bad)} are not supported (full_attention, sliding_attention)")
        if self.dflash2 and not (self.conv_group_size > 0 and self.hidden_size % self.conv_group_size == 0
                                 and 0 < self.selector_top_k <= self.vocab_size and self.selector_rank > 0):
            raise CheckpointError("a DFlash2 drafter needs conv_group_size dividing hidden_size, selector_rank > 0 and "
                                  "0 < selector_top_k <= vocab_size in its dflash_config")

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size > 0

    def attention_kind(self, i: int) -> tuple:
        """Layer i's attention rule as (causal, window) (docs/method.md#drafter-variants)."""
        sliding = self.layer_types[i] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, self.sliding_window if sliding else None


# ---- Building blocks -----------------------------------------------------------------------------

def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in float32 (float64 in a float64 run): the core of every
    norm here. The callers differ only in where they apply the weight and cast back (docs/qwen35.md#norms)."""
    xf = x.to(state_dtype(x.dtype))
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def kept_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, opaque: bool = False) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ b) -> [..., N] in x's dtype, w and b kept in x's dtype or narrower (a bfloat16
    checkpoint's weights as stored under float32 arithmetic: checkpoint.load_target's `weights`). Widening a
    bfloat16 or float16 weight to float32 is exact, so every way below is the widened model's product, in float32:
      a weight in x's dtype   F.linear as is; half precision on a CPU without its own kernels (SLOW_HALF), 2+ rows:
                              this product over x widened, rounded back once.
      one row (decode)        the product as a multiply-sum over the kept weight (fused_product), each weight
                              widened as it is read: compiled code gets it as one loop that reads 2 bytes a weight,
                              where F.linear over a widened weight writes and reads a float32 copy first. Eager calls
                              run a compiled form of it for weights of at least EAGER_FUSED elements (a compile once
                              per process, then served from inductor's on-disk cache), F.linear over the weight
                              widened at each call for smaller ones, where a compiled call's overhead costs more.
      2..FEW_ROWS rows (a     on a CPU, a weight over WIDEN_CHUNK elements is widened a chunk of output rows at a
      verify, a draft, N      time, each chunk's product taken while its float32 copy is in the cache
      rows in flight)         (few_row_product: one opaque op in compiled code), instead of a whole float32 copy
                              written to memory and read back; speed/packed.py gives these products packed
                              float32 copies instead where it measures them faster and the memory allows.
      more rows               F.linear over the weight widened at the call (its cost shared by many rows). Eager,
                              a weight over WIDEN_SLICE elements (a 9B's lm_head: 1G) is widened a slice of output
                              rows at a time, so the float32 copy alive at once stays near WIDEN_SLICE x 4 bytes,
                              not 4 GB (each output is the same K-term product).
    The multiply-sum adds the K terms in another order than F.linear's kernel, and a chunk's product may block them
    otherwise than a whole one: equal to float32 rounding. opaque: a few-row product goes through its custom op
    (few_row_product_op) outside compiled code too, as a compiled step calls it, dispatch and all (about 50 us a
    call on a CPU): speed/packed.measure times plain products so."""
    if w.dtype == x.dtype:
        if x.dtype in SLOW_HALF and x.numel() > x.shape[-1] and x.device.type == "cpu":
            return kept_product(x.float(), w, b).to(x.dtype)        # (SLOW_HALF: the same arithmetic, widened)
        return F.linear(x, w, b)
    rows = x.numel() // x.shape[-1]
    if rows == 1 and x.dtype in (torch.float32, torch.float64):
        if torch.compiler.is_compiling():
            y = fused_product(x, w)
        elif w.numel() >= EAGER_FUSED and not torch.is_grad_enabled() and x.device.type == "cpu" and _EAGER_FUSED is not False:
            y = _eager_fused_or_none(x, w)
            y = F.linear(x, w.to(x.dtype)) if y is None else y
        else:
            y = F.linear(x, w.to(x.dtype))
        return y if b is None else y + b.to(x.dtype)
    b = None if b is None else b.to(x.dtype)
    if rows <= FEW_ROWS and w.numel() > WIDEN_CHUNK and x.device.type == "cpu" and not torch.is_grad_enabled():
        product = few_row_product_op if opaque or torch.compiler.is_compiling() else few_row_product
        y = product(x.reshape(rows, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b
    if w.numel() > WIDEN_SLICE and not torch.compiler.is_compiling():
        n = max(1, WIDEN_SLICE // w.shape[1])
        return torch.cat([F.linear(x, w[i:i + n].to(x.dtype), None if b is None else b[i:i + n])
                          for i in range(0, w.shape[0], n)], -1)
    return F.linear(x, w.to(x.dtype), b)


# Half-precision products of 2+ rows on a CPU whose torch kernels stop short of AVX-512 (an AVX2-only x86: no
# bfloat16 or float16 products of its own; torch's fallback kernel runs 5-8x slower than float32's there): run
# widened, x and w to float32, the float32 product, rounded back once. The same arithmetic as a half-precision
# kernel's (each product of two such numbers is exact in float32, summed in float32, rounded once), the sum in
# another order. One-row products stay native.
SLOW_HALF = ((torch.bfloat16, torch.float16) if platform.machine().lower() in ("x86_64", "amd64")
             and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2") else ())
WIDEN_SLICE = 1 << 24       # kept weights widened for an eager many-row product at most this many elements at a time
WIDEN_CHUNK = 1 << 18       # a few-row product over a kept weight widens this many elements (1 MB of float32) at a time
FEW_ROWS = 64               # products of up to this many rows are few-row products


def few_row_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype for a few rows M, w kept narrower: w widened WIDEN_CHUNK elements
    (whole output rows) at a time into float32, each chunk multiplied while it is in the cache, so memory sees
    w's own bytes once instead of a float32 copy written and read back (2-3x faster at the 2B shapes on a CPU,
    docs/measurements.md). Compiled code calls it through few_row_product_op, as one op, not one node per chunk;
    eager code calls it directly (a custom op's first eager call imports torch._dynamo: 1.5 s and more)."""
    n = max(1, WIDEN_CHUNK // w.shape[1])
    y = x.new_empty(x.shape[0], w.shape[0])
    for i in range(0, w.shape[0], n):
        torch.mm(x, w[i:i + n].to(x.dtype).t(), out=y[:, i:i + n])
    return y


@torch.library.custom_op("dflash_fast::few_row_product", mutates_args=())
def few_row_product_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """few_row_product as one opaque op of a compiled graph."""
    return few_row_product(x, w)


@few_row_product_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def fused_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T as a multiply-sum with the widening of w inside it (kept_product's one-row way):
    inductor writes it as one vectorised reduction over w's stored bytes."""
    return (x.unsqueeze(-2) * w.to(x.dtype)).sum(-1)


EAGER_FUSED = 1 << 21      # eager one-row products over kept weights of at least this many elements run compiled
_EAGER_FUSED = None


def _eager_fused():
    """fused_product compiled once (dynamic shapes: one graph for every weight shape) for eager calls."""
    global _EAGER_FUSED
    if _EAGER_FUSED is None:
        _EAGER_FUSED = torch.compile(fused_product, fullgraph=True, dynamic=True)
    return _EAGER_FUSED


def _eager_fused_or_none(x, w):
    """_eager_fused()(x, w), or None where it cannot compile (no C++ compiler for inductor, say): then, for the rest
    of the process, eager one-row products widen at the call (_EAGER_FUSED False)."""
    global _EAGER_FUSED
    try:
        return _eager_fused()(x, w)
    except Exception:                   # (inductor's errors have no common class of their own)
        _EAGER_FUSED = False
        return None


class Linear(nn.Linear):
    """nn.Linear whose weight may be kept narrower than the arithmetic (a bfloat16 checkpoint's weights as stored,
    under float32 arithmetic: checkpoint.load_target's `weights`): kept_product, the widened model's product. Weights
    in the input's dtype: nn.Linear's call as is."""

    def forward(self, x):
        return kept_product(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose rows come out in `out_dtype` (None: the weight's): the arithmetic dtype of a model whose
    weights are kept narrower (Linear). Widening a row is exact."""

    out_dtype = None

    def reset_parameters(self):
        """nn.Embedding's random init, skipped on the meta device, where a model is built for its shapes only (a
        load fills it, checkpoint.target_bytes counts it): torch's normal_ there imports torch._dynamo (~2 s a process)."""
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, ids):
        x = super().forward(ids)
        return x if self.out_dtype is None else x.to(self.out_dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's norm: rms(x) * (1 + w) in float32, cast back at the end; the stored weight is an offset from 1."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        y = rms(x, self.eps)
        return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)


class RMSNorm(nn.Module):
    """Qwen3's norm (the drafter): w * cast(rms(x))."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * rms(x, self.eps).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """The GDN output norm: w * cast(rms(x)) per value head (one [dv] weight shared by all heads, used as is,
    no 1 +), then times silu(z) in float32, cast back."""

    def forward(self, x, z):
        return (super().forward(x) * F.silu(z.to(state_dtype(x.dtype)))).to(x.dtype)


def linears(x, *layers) -> tuple:
    """x [..., H] through linears that all read it -> their outputs, in order. A layer class names such groups in
    SHARED_INPUT; where speed/packed.py made one product of a group (packed.PackedGroup, kept as the first layer's `group`),
    the group runs as that one product, split; else each layer runs its own."""
    group = getattr(layers[0], "group", None)
    if group is not None and group.members == layers:
        return group(x)
    return tuple(layer(x) for layer in layers)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    SHARED_INPUT = (("gate_proj", "up_proj"),)

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = linears(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """E SwiGLU experts, fused as transformers holds them: gate_up_proj [E, 2I, H] (each expert's gate rows, then
    its up rows), down_proj [E, H, I]. Two exact ways to run the k experts each of N tokens chose (idx [N, k]),
    both -> [N, k, H], each chosen expert's output:
      gathered  static shapes: the N*k chosen experts' weights gathered ([N*k, 2I, H]) and applied as one batched
                product. What compiled decode and verify run (no graph break), but it copies N*k experts' weights.
      looped    every expert that got tokens runs once over those rows only: data-dependent shapes and a host
                sync, eager only; memory as for a dense MLP whatever N (long prefills)."""

    def __init__(self, n: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(n, hidden, inter))

    def gathered(self, h, idx):
        g, u = torch.einsum("nkih,nh->nki", self.gate_up_proj[idx].to(h.dtype), h).chunk(2, dim=-1)
        return torch.einsum("nkhi,nki->nkh", self.down_proj[idx].to(h.dtype), F.silu(g) * u)

    def looped(self, h, idx):
        flat = idx.flatten()
        order = flat.argsort(stable=True)              # slots grouped by expert
        y = h.new_empty(flat.numel(), h.shape[-1])
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=self.down_proj.shape[0]).tolist()):
            if n:
                slots = order[start:start + n]
                g, u = F.linear(h[slots // idx.shape[1]], self.gate_up_proj[e].to(h.dtype)).chunk(2, dim=-1)
                y[slots] = F.linear(F.silu(g) * u, self.down_proj[e].to(h.dtype))
                start += n
        return y.view(*idx.shape, -1)


class SparseMoE(nn.Module):
    """Qwen3.5-MoE's feed-forward block (docs/qwen35.md#mixture-of-experts): router `gate` [E, H], softmax over the
    E experts in float32, the top_k kept and renormalised to sum 1; the chosen experts' outputs weighted by them,
    plus a shared SwiGLU expert times sigmoid(shared_expert_gate(x)).

    Cost: a token reads top_k experts, a T-token call up to min(T * top_k, E) distinct ones. So unlike on a dense
    target, a verify reads far more weights than a decode step (35B-A3B: up to 128 of 256 experts per layer for
    16 tokens, against 8): verify costs more than decode, and the more the wider the block. Path: `gathered` when
    T * top_k <= E (it then copies at most one layer's expert weights: decode; verify at the real sizes) and always
    under torch.compile (decode and verify steps: static shapes); otherwise (long prompts, eager) `looped`."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])                                                   # [N, H]
        probs = F.softmax(self.gate(h), dim=-1, dtype=state_dtype(x.dtype))            # float32 (float64 runs: float64)
        w, idx = probs.topk(self.top_k, dim=-1)                                          # [N, k]
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        static = idx.numel() <= self.n_experts or torch.compiler.is_compiling()
        y = (self.experts.gathered if static else self.experts.looped)(h, idx)
        out = (y * w[..., None]).sum(1) + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out.view_as(x)


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
    """theta^(-2i/R) for i < R/2, in float32 as transformers computes it (so the angles round the same). On the meta
    device (a model built for its shapes, filled by a load) an empty tensor of that length: arithmetic there would
    import torch._dynamo (~2 s a process)."""
    if torch.empty(0, device=device).is_meta:
        return torch.empty((rotary_dim + 1) // 2, dtype=torch.float32, device=device)
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def mrope_columns(mrope_section: list, n_freq: int) -> torch.Tensor:
    """Stream (0=T, 1=H, 2=W) each frequency column takes its angle from, in the interleaved layout THWTHW...
    (docs/qwen35.md#gated-attention): H where i % 3 == 1 and i < 3*sec[1], W where i % 3 == 2 and i < 3*sec[2].
    Built on the CPU whatever the default device (the caller moves it)."""
    cols = torch.zeros(n_freq, dtype=torch.long, device="cpu")
    for stream in (1, 2):
        end = min(3 * mrope_section[stream], n_freq)
        if end > stream:
            cols[torch.arange(stream, end, 3, device="cpu")] = stream
    return cols


def attention(q, k, v, mask):
    """q [B,Hq,Tq,D]; k, v [B,Hkv,Tk,D]; mask: a boolean tensor [Tq,Tk] or [B,1,Tq,Tk] (True = visible) for SDPA,
    or a FlexAttention BlockMask (speed/flex.py; training on a GPU) -> [B,Tq,Hq*D]. Query head h reads kv head
    h // (Hq // Hkv). Scale D**-0.5. Grouped heads with a mask: folded (folded_attention) on a GPU; a CPU's SDPA
    kernel reads them where they lie."""
    gqa = k.shape[1] != q.shape[1]
    if not isinstance(mask, torch.Tensor):
        from torch.nn.attention.flex_attention import flex_attention
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    elif gqa and q.device.type != "cpu":
        return folded_attention(q, k, v, mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


def folded_attention(q, k, v, mask):
    """attention() with a boolean mask and Hq = G * Hkv, as one SDPA call over Hkv heads: the G query heads of a kv
    head become G blocks of its query rows (q [B,Hkv,G*Tq,D], the mask repeated along them), so K/V are read where
    they lie. On a GPU, SDPA given grouped heads and a mask takes its math path, which repeats K/V per query head
    (a copy of the layer's cache per call); folded it keeps a fused kernel. -> [B,Tq,Hq*D]"""
    B, Hq, Tq, D = q.shape
    G = Hq // k.shape[1]
    q = q.reshape(B, -1, G * Tq, D)                      # query head kv*G + g, row t -> kv head kv, row g*Tq + t
    mask = mask.repeat(G, 1) if mask.dim() == 2 else mask.repeat(1, 1, G, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                      # [B,Hkv,G*Tq,D]
    return out.reshape(B, Hq, Tq, D).transpose(1, 2).reshape(B, Tq, Hq * D)


def attention_two(q, kc, vc, kb, vb, mask):
    """attention(q, [kc ; kb], [vc ; vb], mask) without concatenating the keys: the drafter's block reads the
    context cache (kc, vc [B,Hkv,C,D]) and its own keys (kb, vb [B,Hkv,Tq,D]). With a boolean mask [Tq,C+Tq] or
    [B,1,Tq,C+Tq] the scores against each part are computed apart and go through one softmax over both (in float32
    at least), so the cache is read where it lies instead of copied beside the block at every draft. A BlockMask
    (flex) takes the concatenated keys. -> [B,Tq,Hq*D]."""
    if not isinstance(mask, torch.Tensor):
        return attention(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask)
    B, Hq, Tq, D = q.shape
    Hkv, C = kc.shape[1], kc.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv * Tq, D) * D ** -0.5        # query head h reads kv head h // (Hq // Hkv)
    scores = torch.cat([qg @ kc.transpose(-1, -2), qg @ kb.transpose(-1, -2)], -1)   # [B,Hkv,G*Tq,C+Tq]
    scores = scores.view(B, Hkv, Hq // Hkv, Tq, C + Tq).to(torch.promote_types(scores.dtype, torch.float32))
    visible = mask if mask.dim() == 2 else mask[:, :, None]                           # -> [.., 1, 1, Tq, C+Tq]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).to(vc.dtype).view(B, Hkv, -1, C + Tq)
    out = p[..., :C] @ vc + p[..., C:] @ vb                                           # [B,Hkv,G*Tq,D]
    return out.view(B, Hq, Tq, D).transpose(1, 2).reshape(B, Tq, Hq * D)


def draft_visible(capacity: int, window: int | None, start, q_idx, kv_idx, causal: bool = False, sliding: int | None = None):
    """Which keys of [context cache (capacity slots) ; block] block row q_idx of a draft block starting at position
    `start` sees: the committed context before `start` (only its last `window` positions, when a draft window is
    set) and the block. Context slots at >= start hold rejected tokens' features: hidden, overwritten next round.
    A causal layer also hides keys after the query; a sliding one keys `sliding` or more positions away (before
    the query only, when causal; on both sides when not), as the z-lab package's masks do."""
    ctx = kv_idx < start
    if window is not None:
        ctx = ctx & (kv_idx >= start - window)
    visible = ctx | (kv_idx >= capacity)
    if causal or sliding is not None:
        dist = start + q_idx - torch.where(kv_idx < capacity, kv_idx, start + kv_idx - capacity)   # query - key position
        if causal:
            visible = visible & (dist >= 0)
        if sliding is not None:
            visible = visible & (dist < sliding) & (causal or dist > -sliding)
    return visible


class DenseMasks:
    """The masks of cached calls as boolean tensors for SDPA, rebuilt every call from its positions (a few
    elementwise ops). flex.FlexMasks has the same interface with FlexAttention block masks built once.

    A draft with a window shorter than the cache reads only the window: `draft_slots` gives the `window` cache
    slots before the block's start, the drafter gathers their K/V (a static shape, so it compiles), and `draft`
    masks [those slots ; block] instead of [whole cache ; block]. On a 3,000-token prompt with the embedded
    drafter's 208-position window that is 224 keys per block row instead of about 3,200, a quarter to a third of a
    draft's time on a CPU; what the block sees is the same."""

    def __init__(self, capacity: int, block: int | None = None, window: int | None = None, device=None):
        self.capacity, self.window = capacity, window
        self.gathers = window is not None and window < capacity

    def prepare(self, n: int) -> None:
        """Nothing to build ahead for SDPA masks (flex.FlexMasks builds the draft mask of blocks of n here)."""

    def target(self, pos):
        """A target call at positions pos [T] -> [T, capacity], or per-row positions pos [B,T] (a batch of
        sequences of different lengths) -> [B,1,T,capacity]: a query at p sees the slots <= p. Slots past the
        committed length hold a rejected draft's K/V: hidden by the same rule and overwritten before they are
        seen, so attention needs no rollback."""
        visible = torch.arange(self.capacity, device=pos.device) <= pos[..., None]
        return visible if pos.dim() == 1 else visible[:, None]

    def _window(self, start):
        """The positions start - window .. start - 1 per row [B, window] (those < 0 are no slot)."""
        return start.view(-1, 1) - self.window + torch.arange(self.window, device=start.device)

    def draft_slots(self, start):
        """The cache slots each row's draft starting at start [B] reads: the window's, start - window .. start - 1
        ([B, window], those before slot 0 clamped to it and hidden by `draft`), or None: the whole cache."""
        return self._window(start).clamp(min=0) if self.gathers else None

    def draft(self, start, n: int, causal: bool = False, sliding: int | None = None):
        """Draft blocks of n tokens, row b's starting at start[b] (start [B]) -> [B, 1, n, keys + n] over
        [cache ; block] (keys: capacity, or the window's slots when draft_slots gives them), for the layers of
        one attention kind (DraftConfig.attention_kind)."""
        B, dev = start.numel(), start.device
        q_idx, at = torch.arange(n, device=dev)[:, None], start.view(-1, 1, 1)            # [n,1], [B,1,1]
        if not self.gathers:
            kv_idx = torch.arange(self.capacity + n, device=dev)
            visible = draft_visible(self.capacity, self.window, at, q_idx, kv_idx[None, None, :], causal, sliding)
            return visible.expand(B, n, -1)[:, None]
        # columns numbered as draft_visible numbers them: a context slot by its position, block token i as capacity + i
        slots = self._window(start)                                                      # unclamped: < 0 is no slot
        kv_idx = torch.cat([slots, (self.capacity + torch.arange(n, device=dev)).expand(B, n)], 1)      # [B, keys+n]
        real = torch.cat([slots >= 0, torch.ones(B, n, dtype=torch.bool, device=dev)], 1)
        visible = draft_visible(self.capacity, self.window, at, q_idx, kv_idx[:, None], causal, sliding) & real[:, None]
        return visible.expand(B, n, -1)[:, None]


# ---- Target: Qwen3.5 hybrid ----------------------------------------------------------------------

@dataclass
class AttnCache:
    k: torch.Tensor          # [B, Hkv, capacity, hd], post-norm, post-RoPE
    v: torch.Tensor          # [B, Hkv, capacity, hd]

    def tensors(self) -> tuple:
        """(k, v): the fields in order, as a compiled layer region takes them (DecoderLayer.forward)."""
        return self.k, self.v


def write_slots(cache: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    """x [B,heads,T,d] into cache [B,heads,capacity,d] at the slots pos: [T] (every row alike) or [B,T] (each
    row its own: a batch of sequences of different lengths)."""
    B, h, T, d = x.shape
    rows = torch.arange(B, device=cache.device)[:, None, None]
    heads = torch.arange(h, device=cache.device)[None, :, None]
    # An indexed assignment (index_put_), not scatter_: inductor writes it into the cache where it lies, where a
    # scatter_ into a step's input compiles to a copy of the whole cache, the scatter, and a copy back.
    cache[rows, heads, pos.expand(B, T)[:, None, :]] = x.to(cache.dtype)


@dataclass
class GDNCache:
    """One GDN layer's state, and what a verify call leaves for the commit (docs/method.md#rollback-on-a-hybrid-target)."""
    conv: torch.Tensor       # [B, K-1, conv_dim]: the last K-1 pre-conv inputs, oldest first
    rec: torch.Tensor        # [B, Hv, dk, dv] (state dtype): S after the last committed token
    keys: torch.Tensor       # [B, max_block, Hk, dk]  the last verify call's L2-normed keys,
    writes: torch.Tensor     # [B, max_block, Hv, dv]  each token's state write e_t,
    decay: torch.Tensor      # [B, max_block, Hv]      and log decay g_t: with rec, the state after any prefix
    window: torch.Tensor     # [B, K-1+max_block, conv_dim]: the conv state + that call's pre-conv inputs

    def tensors(self) -> tuple:
        """The fields in order, as a compiled layer region takes them (DecoderLayer.forward)."""
        return self.conv, self.rec, self.keys, self.writes, self.decay, self.window

    def advance(self, state, window) -> None:
        """Every token of the call is committed: S after its last token; the conv state is the window's last K-1 rows."""
        self.rec.copy_(state)
        self.conv.copy_(window[:, window.shape[1] - self.conv.shape[1]:])

    def keep_block(self, k, writes, g, window) -> None:
        """A verify call: keep what commit(n) needs to build the state after any prefix of it. S is untouched."""
        T = k.shape[1]
        if T > self.writes.shape[1]:
            raise ValueError(f"a {T}-token verify call exceeds the cache's max_block {self.writes.shape[1]}")
        self.keys[:, :T].copy_(k)
        self.writes[:, :T].copy_(writes)
        self.decay[:, :T].copy_(g)
        self.window[:, :window.shape[1]].copy_(window)

    def commit(self, n) -> None:
        """The rollback: keep the first n tokens (1 <= n <= T; an int, or a device tensor: no host sync; [B]: each
        row its own n) of the kept verify call. S becomes the state after token n (kernels.state_after: S before
        the call plus the writes of tokens < n only); the conv state becomes window rows n .. n+K-2."""
        n = torch.as_tensor(n, device=self.rec.device).reshape(-1)                       # [1] or [B]
        self.rec.copy_(kernels.state_after(self.keys, self.writes, self.decay, self.rec, n))
        rows = n[:, None] + torch.arange(self.conv.shape[1], device=n.device)            # [1 or B, K-1]
        self.conv.copy_(self.window.gather(1, rows[..., None].expand(self.window.shape[0], -1, self.window.shape[2])))


class GatedAttention(nn.Module):
    """Full-attention layer: q_proj gives the query and an output gate interleaved per head; zero-centred q/k
    norms before partial RoPE; causal GQA; output * sigmoid(gate); o_proj (docs/qwen35.md#gated-attention)."""

    SHARED_INPUT = (("q_proj", "k_proj", "v_proj"),)

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.hd * 2, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, pos, mask, cache: AttnCache | None):
        """x [B,T,H]; cos, sin [T,R] (or [B,1,T,R]); pos [T] (or [B,T]: each row's own); mask over the keys (the
        call's own without a cache, else the cache's)."""
        bsz, T, _ = x.shape
        qg, k, v = linears(x, self.q_proj, self.k_proj, self.v_proj)
        qg = qg.view(bsz, T, self.nh, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(bsz, T, self.nh * self.hd)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)                         # [B,nh,T,hd]
        k = apply_rope(self.k_norm(k.view(bsz, T, self.nkv, self.hd)).transpose(1, 2), cos, sin)
        v = v.view(bsz, T, self.nkv, self.hd).transpose(1, 2)
        if cache is not None:                          # written at the absolute positions; the mask hides the rest
            write_slots(cache.k, pos, k)
            write_slots(cache.v, pos, v)
            k, v = cache.k, cache.v
        return self.o_proj(attention(q, k, v, mask) * torch.sigmoid(gate))


def l2norm(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last dim (eps inside the sum, as FLA and transformers do)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Linear-attention layer: depthwise causal conv + SiLU on [q|k|v], L2-normed q/k, the gated delta rule on a
    float32 state, gated RMSNorm by z, out_proj (docs/qwen35.md#gated-deltanet)."""

    # The verify kernel (kernels.py): the closed form of one chunk. Tests swap in the step-by-step
    # kernels.recurrent_gated_delta_rule, the same maths token by token, as a reference.
    block_rule = staticmethod(kernels.block_gated_delta_rule)
    SHARED_INPUT = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),)

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

    def project(self, x):
        """x [B,T,H] -> z [B,T,Hv,dv], beta and g [B,T,Hv] (state dtype), the pre-conv inputs [B,T,conv_dim]."""
        sd = state_dtype(x.dtype)
        pre, z, b, a = linears(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        beta = torch.sigmoid(b).to(sd)
        g = -self.A_log.to(sd).exp() * F.softplus(a.to(sd) + self.dt_bias.to(sd))
        return z.unflatten(-1, (self.hv, self.dv)), beta, g, pre

    def heads(self, u):
        """Conv outputs u [B,T,conv_dim] -> q (scaled), k: L2-normed [B,T,Hk,dk] in the state dtype; v [B,T,Hv,dv]."""
        sd, (q, k, v) = state_dtype(u.dtype), u.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (l2norm(t.unflatten(-1, (self.hk, self.dk)).to(sd)) for t in (q, k))
        return q * self.dk ** -0.5, k, v.unflatten(-1, (self.hv, self.dv))

    def forward(self, x, cache: GDNCache | None, verify: bool = False):
        """x [B,T,H] -> ([B,T,H], kept). Without a cache: from a zero state, nothing kept (training, reference). With
        one, verify=False commits every token (the cache advances; kept None); verify=True leaves the cache alone and
        returns kept = (k, writes, g, window), what GDNCache.keep_block keeps for the commit: the caller keeps it
        (DecoderLayer.forward, outside the compile region, so that a commit in the same compiled step reads it).
        (tree.py runs the same pieces, project, heads and finish, over a tree of tokens.)"""
        bsz, T, _ = x.shape
        z, beta, g, pre = self.project(x)
        conv_state = cache.conv if cache is not None else x.new_zeros(bsz, self.kernel - 1, self.conv_dim)
        u, window = kernels.causal_conv1d(pre, self.conv_weight, conv_state)
        q, k, v = self.heads(u)
        state = cache.rec if cache is not None else x.new_zeros(bsz, self.hv, self.dk, self.dv, dtype=g.dtype)
        if verify:
            rule = self.block_rule if T > 1 else kernels.recurrent_gated_delta_rule
            o, writes = rule(q, k, v, g, beta, state)[:2]
            return self.finish(o, z, x.dtype), (k, writes, g, window)
        else:
            if T > 1:
                o, final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, state)
            else:
                o, _, final = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, state)
            if cache is not None:
                cache.advance(final, window)
        return self.finish(o, z, x.dtype), None

    def finish(self, o, z, dtype):
        """The rule's output o [B,T,Hv,dv] gated by z, normed and projected -> [B,T,H] in `dtype`."""
        return self.out_proj(self.norm(o.to(dtype), z).flatten(-2))


class DecoderLayer(nn.Module):
    """Pre-norm block: x += mixer(norm(x)); x += mlp(norm(x)). The mixer is GDN or gated attention; the mlp a
    SwiGLU MLP, or a SparseMoE in the mixture-of-experts models."""

    def __init__(self, cfg: TargetConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.num_experts else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, pos, mask, cache, verify: bool):
        """The cache goes to `step` as plain tensors, so torch.compile traces one layer of each kind and calls it for
        every layer of that kind instead of compiling all L of them (a nested compile region; eager: a plain call).
        Inductor (torch 2.13) does not track what a region writes: its output must be used, and nothing else in
        the same compiled step may read what it writes (true here: each layer alone touches its cache). So what a GDN
        verify keeps for the commit comes out of the region and is written here, where the commit that follows in
        the same compiled step (engine.Slots._verify) sees the write."""
        # FlexAttention block masks carry views of one another, which a region's inputs may not: inlined then.
        step = self.step if isinstance(mask, torch.Tensor) else self.layer
        x, kept = step(x, cos, sin, pos, mask, verify, *(cache.tensors() if cache is not None else ()))
        if kept is not None:
            cache.keep_block(*kept)
        return x

    def layer(self, x, cos, sin, pos, mask, verify: bool, *cache):
        """-> the layer's output [B,T,H], and a GDN verify's kept tensors (GatedDeltaNet.forward) or None."""
        cache = (GDNCache if self.layer_type == "linear_attention" else AttnCache)(*cache) if cache else None
        h = self.input_layernorm(x)
        kept = None
        if self.layer_type == "linear_attention":
            out, kept = self.linear_attn(h, cache, verify)
            x = x + out
        else:
            x = x + self.self_attn(h, cos, sin, pos, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x)), kept

    step = torch.compiler.nested_compile_region(layer)


class TargetCache:
    """Static caches for one sequence, allocated once for `capacity` positions and written in place."""

    def __init__(self, cfg: TargetConfig, capacity: int, dtype, device, batch: int = 1, max_block: int = 16,
                 masks=None):
        """max_block: the widest verify call, whose keys, writes and decays are kept (a few vectors per token).
        masks: DenseMasks(capacity) unless given (flex.FlexMasks)."""
        sd = state_dtype(dtype)
        self.capacity, self.masks = capacity, masks or DenseMasks(capacity)
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim, k1 = 2 * hk * dk + hv * dv, cfg.linear_conv_kernel_dim - 1

        def zeros(*shape, dt=dtype):
            return torch.zeros(batch, *shape, dtype=dt, device=device)
        self.layers = []
        for t in cfg.layer_types:
            if t == "full_attention":
                shape = (cfg.num_key_value_heads, capacity, cfg.head_dim)
                self.layers.append(AttnCache(zeros(*shape), zeros(*shape)))
            else:
                self.layers.append(GDNCache(conv=zeros(k1, conv_dim), rec=zeros(hv, dk, dv, dt=sd),
                                            keys=zeros(max_block, hk, dk, dt=sd), writes=zeros(max_block, hv, dv, dt=sd),
                                            decay=zeros(max_block, hv, dt=sd), window=zeros(k1 + max_block, conv_dim)))

    def commit(self, n) -> None:
        """After a verify call over T tokens, keep its first n (a 0-d device tensor: no host sync; [B]: per row):
        every GDN layer rolls back to the state after token n (GDNCache.commit). Attention needs nothing: stale
        slots are masked."""
        for layer in self.layers:
            if isinstance(layer, GDNCache):
                layer.commit(n)

    def reset(self) -> None:
        """A new sequence: GDN states to zero (prefill starts from S = 0). Attention slots past the new prompt are
        masked until overwritten."""
        for layer in self.layers:
            if isinstance(layer, GDNCache):
                layer.conv.zero_()
                layer.rec.zero_()

    def row(self, b: int) -> TargetCache:
        """Row b of a batch's caches as a cache of batch 1: views, so writing it writes row b (a request's prefill
        into its slot while the other rows keep theirs)."""
        view = object.__new__(TargetCache)
        view.capacity, view.masks = self.capacity, DenseMasks(self.capacity)
        view.layers = [type(layer)(*(t[b:b + 1] for t in vars(layer).values())) for layer in self.layers]
        return view


class Qwen35(nn.Module):
    """The Qwen3.5 text model with its lm_head. `forward` also returns the drafter's context features."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, t) for t in cfg.layer_types])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.empty(cfg.rotary_dim // 2), persistent=False)
        self.register_buffer("mrope_cols", torch.empty(cfg.rotary_dim // 2, dtype=torch.long), persistent=False)
        self.tie_weights_()
        self.init_buffers_()

    @property
    def dtype(self) -> torch.dtype:
        """The arithmetic dtype: activations, caches, logits. The weights' own, unless they are kept narrower
        (embed_tokens.out_dtype: checkpoint.load_target's `weights`)."""
        return self.embed_tokens.out_dtype or self.embed_tokens.weight.dtype

    @dtype.setter
    def dtype(self, dtype: torch.dtype) -> None:
        """Compute in `dtype` over the weights as they are kept: where they are narrower, the arithmetic starts at the
        embedding, whose rows come out in `dtype`."""
        self.embed_tokens.out_dtype = None if dtype == self.embed_tokens.weight.dtype else dtype

    def tie_weights_(self) -> None:
        """With tie_word_embeddings (the small sizes), lm_head shares the embedding's Parameter."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_buffers_(self) -> None:
        """The RoPE tables, computed (not stored in checkpoints): again after a meta-device build (which leaves
        inv_freq empty: inv_freq)."""
        self.inv_freq = inv_freq(self.cfg.rotary_dim, self.cfg.rope_theta, self.inv_freq.device)
        self.mrope_cols = mrope_columns(self.cfg.mrope_section, self.cfg.rotary_dim // 2).to(self.mrope_cols.device)

    def rope(self, pos, dtype):
        """pos [T] (text) or [3,T] (t,h,w streams) -> cos, sin [T, rotary_dim] in `dtype`; per-row streams
        [B,3,T] -> [B,1,T, rotary_dim] (broadcast over heads). Angles in float32 (as transformers computes them);
        with equal streams this is plain partial RoPE."""
        pos3 = pos.expand(3, -1) if pos.dim() == 1 else pos
        ang = pos3.float()[..., None] * self.inv_freq                              # [(B,)3,T,R/2]
        cols = self.mrope_cols.expand(*ang.shape[:-3], 1, ang.shape[-2], -1)
        ang = ang.gather(-3, cols).squeeze(-3)                                     # [(B,)T,R/2]
        ang = torch.cat([ang, ang], dim=-1)
        if ang.dim() == 3:
            ang = ang[:, None]
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, ids, pos, cache: TargetCache | None = None, *, verify: bool = False, feature_layers=(),
                last_logits_only: bool = False, logits_from: int = 0, rope_pos=None, image_embeds=None, mask=None):
        """ids [B,T] at positions pos [T], or [B,T] when rows are at different positions (a batch of requests).
        cache None: a plain causal forward over ids alone (training, reference); else the caches are read and
        written, and `verify` says how GDN states move (module doc).
        rope_pos: RoPE positions where they differ from pos: [3,T] for a prompt with images, pos + rope_delta
        after it (vision.py). image_embeds [n,H] replace, in order, the embeddings of the n image pad tokens.
        -> logits [B,T,V] ([B,1,V] with last_logits_only; [B,T - logits_from,V] from position logits_from on: a long
        teacher-forced pass needs only its last rows' logits, each V wide), feats [B,T,len(feature_layers)*H] or None."""
        x = self.embed_tokens(ids)
        if image_embeds is not None:
            x = x.masked_scatter((ids == self.cfg.image_token_id)[..., None], image_embeds.to(x.dtype))
        rope_pos = pos if rope_pos is None else rope_pos
        if pos.dim() == 2 and rope_pos.dim() == 2:     # per-row text positions: the three streams alike, per row
            rope_pos = rope_pos[:, None].expand(-1, 3, -1)
        cos, sin = self.rope(rope_pos, x.dtype)
        T = ids.shape[1]
        if mask is None:       # given: Engine.prefill's dense mask, whichever backend the cached steps use
            mask = cache.masks.target(pos) if cache is not None else torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        outputs, last = {}, len(self.layers) - 1      # only the outputs a proposer reads stay alive (a long prefill)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pos, mask, None if cache is None else cache.layers[i], verify)
            if i in feature_layers:          # the OUTPUT of layer i (transformers' hidden_states[i + 1]); the last
                outputs[i] = self.norm(x) if i == last else x        # one's is taken AFTER the final norm
        feats = torch.cat([outputs[i] for i in feature_layers], dim=-1) if feature_layers else None
        h = self.norm(x[:, -1:] if last_logits_only else x[:, logits_from:] if logits_from else x)
        return self.lm_head(h), feats


# ---- Drafter: DFlash block diffusion (docs/method.md#the-drafter) --------------------------------

class DraftAttention(nn.Module):
    """Qwen3 attention with KV injection: Q from the block only; K, V from [context ; block]; k_norm on both;
    1-D RoPE over the full head dim; NOT causal."""

    SHARED_INPUT = (("k_proj", "v_proj"),)        # (not q: the context's rows need only keys and values)

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
        k, v = linears(x, self.k_proj, self.v_proj)
        k = apply_rope(self.k_norm(k.view(bsz, T, self.nkv, self.hd)).transpose(1, 2), cos, sin)
        return k, v.view(bsz, T, self.nkv, self.hd).transpose(1, 2)

    def attend(self, x, rope, kc, vc, mask):
        """The block x [B,Tq,H] (RoPE cos, sin [Tq,hd]) reads the keys [kc ; its own]; mask over them."""
        bsz, Tq, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(bsz, Tq, self.nh, self.hd)).transpose(1, 2), *rope)
        kb, vb = self.kv(x, *rope)
        return self.o_proj(attention_two(q, kc, vc, kb, vb, mask))

    def forward(self, x, ctx, rope, rope_ctx, mask):
        """From scratch (training, reference): ctx [B,Tc,H] gives the context K/V; mask [.., Tq, Tc+Tq]."""
        return self.attend(x, rope, *self.kv(ctx, *rope_ctx), mask)

    def draft(self, x, rope, cache: AttnCache, mask):
        """Drafting: the context K/V come from the cache (DFlashDrafter.append_context); mask [Tq, capacity+Tq]."""
        return self.attend(x, rope, cache.k, cache.v, mask)


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution over the block's rows: row t becomes sum over o < K of
    (base[o] + taps[t, o]) * x[t - o], zero before the block; base is per channel, the taps per group of
    `group` channels, predicted from the row. One module wraps a sublayer: `prepare` predicts both sets of taps
    and convolves its input (base_kernel[0]); `finish` convolves its output with the second set (base_kernel[1])."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def mix(self, x, taps, base):
        """x [B,T,H]; taps [B,T,K,H/group]; base [K,H] -> [B,T,H]."""
        out = torch.zeros_like(x)
        for o in range(self.kernel):
            shifted = F.pad(x, (0, 0, o, 0))[:, :x.shape[1]]                       # row t holds x[t - o]
            out = out + (base[o].to(x.dtype) + taps[:, :, o].repeat_interleave(self.group, -1)) * shifted
        return out

    def prepare(self, x):
        taps = self.kernel_projection(x).unflatten(-1, (2, self.kernel, -1))        # [B,T,2,K,G]
        return self.mix(x, taps[:, :, 0], self.base_kernel[0]), taps[:, :, 1]

    def finish(self, x, taps):
        return self.mix(x, taps, self.base_kernel[1])


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.dflash2:
            self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def sublayers(self, x, attend):
        """x += attend(norm(x)); x += mlp(norm(x)); in DFlash2 each sublayer inside its dynamic convolution."""
        for norm, conv, fn in ((self.input_layernorm, self.attention_conv, attend),
                               (self.post_attention_layernorm, self.mlp_conv, self.mlp)):
            if conv is None:
                x = x + fn(norm(x))
            else:
                h, taps = conv.prepare(norm(x))
                x = x + conv.finish(fn(h), taps)
        return x

    def forward(self, x, ctx, rope, rope_ctx, mask):
        return self.sublayers(x, lambda h: self.self_attn(h, ctx, rope, rope_ctx, mask))

    def draft(self, x, rope, cache: AttnCache, mask):
        step = self.draft_step if isinstance(mask, torch.Tensor) else self.draft_layer     # (DecoderLayer.forward)
        return step(x, *rope, mask, cache.k, cache.v)

    def draft_layer(self, x, cos, sin, mask, k, v):
        return self.sublayers(x, lambda h: self.self_attn.draft(h, (cos, sin), AttnCache(k, v), mask))

    draft_step = torch.compiler.nested_compile_region(draft_layer)   # one compiled body for every layer


class CandidateSelector(nn.Module):
    """DFlash2's choice of the block's path: row i takes one of its top-k tokens, scored by its logit plus a
    low-rank bilinear term between the previous row's chosen token and the candidate, read through row i's
    hidden state: scores = logits_topk + successor(cand) . (predecessor(prev) * proj(hidden_i)). Greedy: the
    best score, row by row; sampling: a draw from q = softmax(scores / temperature) over the k candidates, by the
    exponential race with the noise of the row's position over the candidates' token ids (noise.py)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def select(self, hidden, logits, anchor, rows=None, temperature: float = 1.0):
        """hidden [n,H], logits [n,V] of block rows 1..n; anchor [1] the block's first token; rows None (greedy) or
        the noise row keys [n] of the rows' positions (noise.row_keys) -> tokens [n], and q [n,V] float32
        (sampling: each row's draft distribution) or None."""
        unary, cand = logits.topk(self.top_k, dim=-1)                                # [n,k]
        expo = None if rows is None else noise.exponentials(rows, cand)              # [n,k]: E at (row, candidate)
        h = self.hidden_projection(hidden)                                            # [n,r]
        succ = self.successor_codebook(cand).to(h.dtype)                              # [n,k,r]
        prev, path, qs = anchor.view(1), [], []
        for i in range(cand.shape[0]):                 # sequential: each row depends on the previous choice
            scores = unary[i] + succ[i] @ (self.predecessor_codebook(prev)[0].to(h.dtype) * h[i])  # [k]
            if expo is None:
                j = scores.argmax()
            else:
                q = torch.softmax(scores.float() / temperature, -1)
                j = (q / expo[i].clamp_min(1e-30)).argmax()            # a draw from q (sampling.draw's race)
                qs.append(q)
            prev = cand[i].gather(0, j.view(1))          # (a gather, not cand[i, j]: no host sync when compiled)
            path.append(prev)
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter(1, cand, torch.stack(qs)) if qs else None
        return torch.cat(path), q


class DraftCache:
    """The drafter's context K/V per layer for `capacity` positions. The block's K/V are recomputed every round
    and never stored (they change with every block)."""

    def __init__(self, cfg: DraftConfig, capacity: int, dtype, device, batch: int = 1):
        shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.capacity = capacity
        self.layers = [AttnCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(cfg.num_hidden_layers)]


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the concatenated target features, Qwen3 layers, final norm. No embedding or lm_head
    of its own: the target's are used (shared and frozen)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.dflash2 else None
        self.kinds = [cfg.attention_kind(i) for i in range(cfg.num_hidden_layers)]      # (causal, window) per layer
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.init_buffers_()

    compute_dtype = None      # the arithmetic dtype where the weights are kept narrower (checkpoint.load_drafter)

    @property
    def dtype(self) -> torch.dtype:
        """The arithmetic dtype (its context cache's): compute_dtype, else the weights'."""
        return self.compute_dtype or self.fc.weight.dtype

    @dtype.setter
    def dtype(self, dtype: torch.dtype) -> None:
        """Compute in `dtype` over the weights as they are kept (compute_dtype where they are narrower)."""
        self.compute_dtype = None if dtype == self.fc.weight.dtype else dtype

    def init_buffers_(self) -> None:
        self.inv_freq = inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.inv_freq.device)

    def rope(self, pos, dtype):
        """pos [T] -> cos, sin [T, hd]; pos [B, T] (training: anchors differ per row) -> [B, 1, T, hd]."""
        ang = pos.float()[..., None] * self.inv_freq
        ang = torch.cat([ang, ang], dim=-1)
        if pos.dim() == 2:
            ang = ang[:, None]
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, block_embeds, feats, block_pos, ctx_pos, mask):
        """From scratch (training, and the reference the cached path is tested against).
        block_embeds [B,Tq,H] (the target's embedding of the blocks, times input_embedding_scale) at block_pos
        [Tq] or [B,Tq]; feats [B,Tc,n_feat*H] at ctx_pos [Tc]; mask [B,1,Tq,Tc+Tq] bool or a BlockMask over the
        keys [context ; blocks], or a dict {attention kind: mask} for a drafter whose layers differ (self.kinds).
        DFlash2's convolutions run over the Tq rows as one block. -> hidden [B,Tq,H] after the final norm."""
        dt = block_embeds.dtype
        ctx, rope, rope_ctx = self.hidden_norm(self.fc(feats)), self.rope(block_pos, dt), self.rope(ctx_pos, dt)
        if not isinstance(mask, dict):
            if set(self.kinds) != {(False, None)}:
                raise ValueError(f"this drafter's layers are causal or windowed {sorted(set(self.kinds), key=str)}: pass one mask per kind")
            mask = {(False, None): mask}
        x = block_embeds
        for layer, kind in zip(self.layers, self.kinds):
            x = layer(x, ctx, rope, rope_ctx, mask[kind])
        return self.norm(x)

    def append_context(self, feats, ctx_pos, cache: DraftCache) -> None:
        """feats [B,Tc,n_feat*H] at positions ctx_pos [Tc] (or [B,Tc], per row) -> every layer's context K/V,
        written into the cache. They depend on the context only, not on the block, so they are written ahead of
        the draft."""
        ctx = self.hidden_norm(self.fc(feats))
        cos, sin = self.rope(ctx_pos, ctx.dtype)
        for layer, lc in zip(self.layers, cache.layers):
            kc, vc = layer.self_attn.kv(ctx, cos, sin)
            write_slots(lc.k, ctx_pos, kc)
            write_slots(lc.v, ctx_pos, vc)

    def draft(self, block_embeds, start, cache: DraftCache, masks):
        """Drafting: block_embeds [B,Tq,H], row b's at positions start[b] .. start[b]+Tq-1 (start [B]), read the
        cached context; masks: DenseMasks or flex.FlexMasks, asked once per attention kind. -> hidden [B,Tq,H]."""
        n, start = block_embeds.shape[1], start.view(-1)
        rope = self.rope(start[:, None] + torch.arange(n, device=start.device), block_embeds.dtype)   # [B,1,Tq,hd]
        by_kind = {kind: masks.draft(start, n, *kind) for kind in dict.fromkeys(self.kinds)}
        slots = masks.draft_slots(start)              # a window shorter than the cache: read only its slots
        x = block_embeds
        for layer, lc, kind in zip(self.layers, cache.layers, self.kinds):
            if slots is not None:                     # [B, window] per row
                at = slots[:, None, :, None].expand(-1, lc.k.shape[1], -1, lc.k.shape[3])
                lc = AttnCache(lc.k.gather(2, at), lc.v.gather(2, at))
            x = layer.draft(x, rope, lc, by_kind[kind])
        return self.norm(x)

    def draft_block(self, last, start, n: int, embed: nn.Embedding, cache: DraftCache, masks, anchor: bool = False):
        """One draft per row: the block [last, MASK x n] of row b at positions start[b] .. start[b]+n (last, start
        [B]) through the target's embedding (times input_embedding_scale) and `draft` -> hidden [B,n,H] of the
        block rows 1..n, the ones that propose ([B,n+1,H] with the anchor's row 0 too, when `anchor`)."""
        mask_ids = torch.full((last.shape[0], n), self.cfg.mask_token_id, dtype=torch.long, device=last.device)
        emb = embed(torch.cat([last[:, None], mask_ids], 1))
        if self.cfg.input_embedding_scale != 1.0:
            emb = emb * self.cfg.input_embedding_scale
        hidden = self.draft(emb, start, cache, masks)
        return hidden if anchor else hidden[:, 1:]

    def propose(self, hidden, anchor, lm_head: nn.Linear, rows=None, temperature: float = 1.0):
        """Block rows 1..n: hidden [n,H]; anchor [1] the block's first token -> tokens [n] and the draft
        distribution q [n,V] (None: a greedy pick, i.e. a one-hot q). DFlash: argmax of the logits; DFlash2: the
        candidate selector's path, greedy or, with the noise row keys rows [n] of the rows' positions, sampled at
        `temperature`."""
        logits = self.draft_logits(hidden, lm_head)
        if self.candidate_selector is None:
            return logits.argmax(-1), None
        return self.candidate_selector.select(hidden, logits, anchor, rows, temperature)

    def draft_logits(self, hidden, lm_head: nn.Linear):
        """Logits through the target's lm_head, with the optional z-lab output scaling and soft cap."""
        logits = lm_head(hidden)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
