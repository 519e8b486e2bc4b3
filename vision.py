"""Image input for the Qwen3.5 target: preprocessing, the vision tower, and 3-D (multimodal) RoPE positions.

The drafter never sees pixels: images reach it only through the target's hidden states (its context
features), and it keeps plain 1-D positions. Everything here runs once, before prefill.

Glossary (docs/qwen35.md#vision-tower-and-multimodal-positions):
    p       patch side in pixels (16)              m      spatial merge size (2): m x m patches -> one token
    Tp      temporal patch size (2): a still image is repeated to 2 frames, so each patch is C*Tp*p*p values
    gh, gw  the image's patch grid (pixels / p)    grid   (t, gh, gw) with t = 1 for images
    N       patches of all images, sum(gh * gw)    tokens per image = gh * gw / m**2 (<|image_pad|> copies)
    D       vision width (1152 on 9B)              H      text hidden size (the merger's output width)
    rope_pos [3, T] (t, h, w) positions for the target; rope_delta = max(rope_pos) + 1 - T, added to the
            1-D position of every later token (decode and verify), where all three streams are equal.

Patches are laid out in 2 x 2-block order (block_row, block_col, in_row, in_col), so that the merger can
concatenate 4 consecutive patches into one token; the learned position table and the rotary angles are
read in that same order.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import checkpoint as ckpt
import model as M


class ImageError(ValueError):
    """An image that cannot be used as given (unreadable, out of the pixel limits, miscounted pads)."""


# ==================================================================================================
# Configs
# ==================================================================================================

@dataclass
class VisionConfig:
    """The vision tower (`vision_config` of a qwen3_5 config.json) and the ids of its special tokens."""
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 4096
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    KEYS = ("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings")
    IGNORED = ("model_type", "hidden_act", "initializer_range", "rope_parameters", "deepstack_visual_indexes",
               "dtype", "torch_dtype", "transformers_version", "num_attention_heads", "num_hidden_layers")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, raw: dict) -> "VisionConfig":
        """The full config.json of a qwen3_5 (multimodal) checkpoint -> VisionConfig; a text-only or
        unsupported vision config is a one-line CheckpointError."""
        vc = raw.get("vision_config")
        if not isinstance(vc, dict):
            raise M.CheckpointError("this checkpoint has no vision_config (a text-only model); drop --image or use the "
                                    "multimodal checkpoint, e.g. Qwen/Qwen3.5-9B")
        unknown = sorted(set(vc) - set(cls.KEYS) - set(cls.IGNORED))
        if unknown:
            raise M.CheckpointError(f"vision_config has keys dflash-fast does not know: {', '.join(unknown)}")
        if vc.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise M.CheckpointError(f"vision_config hidden_act {vc['hidden_act']!r} is not supported (expected gelu_pytorch_tanh)")
        if vc.get("deepstack_visual_indexes"):
            raise M.CheckpointError("vision_config uses deepstack injection (Qwen3-VL), which Qwen3.5 does not; not supported")
        rope = vc.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise M.CheckpointError(f"vision rope_type {rope['rope_type']!r} is not supported (expected axial)")
        cfg = cls(**{k: vc[k] for k in cls.KEYS if k in vc}, rope_theta=float(rope.get("rope_theta", 10000.0)))
        for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if k in raw:
                setattr(cfg, k, int(raw[k]))
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise M.CheckpointError(f"vision hidden_size {cfg.hidden_size} / num_heads {cfg.num_heads} must give a head_dim divisible by 4")
        if math.isqrt(cfg.num_position_embeddings) ** 2 != cfg.num_position_embeddings:
            raise M.CheckpointError(f"vision num_position_embeddings {cfg.num_position_embeddings} is not a square grid")
        return cfg


@dataclass
class ImageProcessorConfig:
    """Qwen2-VL image processor settings (preprocessor_config.json when the checkpoint has one)."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536            # size.shortest_edge
    max_pixels: int = 16777216         # size.longest_edge
    image_mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])

    @classmethod
    def from_dir(cls, path: str) -> "ImageProcessorConfig":
        f = os.path.join(path, "preprocessor_config.json")
        if not os.path.exists(f):
            return cls()
        raw = ckpt.read_json(f)
        size = raw.get("size") or {}
        cfg = cls()
        for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
            if k in raw:
                setattr(cfg, k, raw[k])
        cfg.min_pixels = int(size.get("shortest_edge", raw.get("min_pixels", cfg.min_pixels)))
        cfg.max_pixels = int(size.get("longest_edge", raw.get("max_pixels", cfg.max_pixels)))
        return cfg


# ==================================================================================================
# Preprocessing: file -> RGB -> resize to multiples of p*m -> normalise -> patches in 2x2-block order
# ==================================================================================================

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple:
    """The size an image is resized to: both sides multiples of `factor` (= p * m), the area within
    [min_pixels, max_pixels] as far as rounding allows, the aspect ratio kept as nearly as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"an image of {width}x{height} has an aspect ratio above 200, which Qwen3.5 does not accept")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:                      # shrink, rounding down
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:                    # enlarge, rounding up
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def load_image(f: str):
    """An image file -> a PIL RGB image (transparency composited onto white, as the HF processor does)."""
    try:
        from PIL import Image
    except ImportError:
        raise ImageError("image input needs Pillow: pip install pillow") from None
    try:
        img = Image.open(f)
        img.load()
    except (OSError, SyntaxError, ValueError) as e:       # missing, not an image, truncated
        raise ImageError(f"cannot read image {f} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return to_rgb(img)


def to_rgb(img):
    from PIL import Image
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img).convert("RGB")
    return img.convert("RGB")


def preprocess(img, pc: ImageProcessorConfig) -> tuple:
    """A PIL RGB image -> (patches [gh*gw, C*Tp*p*p] float32, grid (1, gh, gw))."""
    from PIL import Image
    p, m, tp = pc.patch_size, pc.merge_size, pc.temporal_patch_size
    w0, h0 = img.size
    h, w = smart_resize(h0, w0, p * m, pc.min_pixels, pc.max_pixels)
    if not pc.min_pixels <= h * w <= pc.max_pixels:
        raise ImageError(f"an image of {w0}x{h0} resizes to {w}x{h} = {h * w} pixels, outside the limits "
                         f"[{pc.min_pixels}, {pc.max_pixels}]; crop or pad it to a less extreme shape")
    img = img.resize((w, h), resample=Image.BICUBIC)                       # bicubic on uint8, as the HF processor
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
    x = x.double() * (1 / 255)                                            # rescale in float64, then float32
    x = x.float()
    mean = torch.tensor(pc.image_mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(pc.image_std, dtype=torch.float32).view(3, 1, 1)
    x = (x - mean) / std                                                   # [C, h, w]
    gh, gw = h // p, w // p
    x = x.view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # [bh, bw, m, m, C, p, p]
    x = x[:, :, :, :, :, None].expand(-1, -1, -1, -1, -1, tp, -1, -1)    # the still image as Tp frames
    return x.reshape(gh * gw, 3 * tp * p * p).contiguous(), (1, gh, gw)


def block_order_rows_cols(gh: int, gw: int, m: int) -> tuple:
    """(row, col) of each patch of a gh x gw grid, in 2x2-block order -> two LongTensors [gh*gw]."""
    r = torch.arange(gh).view(gh // m, m, 1, 1).expand(-1, -1, gw // m, m).permute(0, 2, 1, 3).reshape(-1)
    c = torch.arange(gw).view(1, 1, gw // m, m).expand(gh // m, m, -1, -1).permute(0, 2, 1, 3).reshape(-1)
    return r, c


# ==================================================================================================
# The vision tower
# ==================================================================================================

class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.nh, self.hd = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x, cos, sin, lengths: list):
        """x [N, D]; cos, sin [N, hd] (float32); lengths: patches per image -> [N, D]. Bidirectional
        attention within each image only."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.nh, self.hd).unbind(1)                  # each [N, nh, hd]
        # the 2-D rotary in float32, over the whole head (no partial rotation)
        q = (q.float() * cos[:, None] + M.rotate_half(q.float()) * sin[:, None]).to(x.dtype)
        k = (k.float() * cos[:, None] + M.rotate_half(k.float()) * sin[:, None]).to(x.dtype)
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(out).reshape(N, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x):
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each m*m consecutive patches (one 2x2 block) -> one text-width token."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width, bias=True)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size, bias=True)

    def forward(self, x):
        """x [N, D] -> [N / m**2, H]"""
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.width))))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d(C -> D, kernel = stride = (Tp, p, p)) sees each patch exactly once, so it is a
    Linear map of the flattened patch (C, Tp, p, p); its weight is stored here flattened to [D, C*Tp*p*p]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True)

    def forward(self, patches):
        return self.proj(patches)


def vision_inv_freq(cfg: VisionConfig, device=None) -> torch.Tensor:
    """The 2-D rotary's frequencies: angles are [row * inv | col * inv], each hd/4 wide, then doubled to hd."""
    half = cfg.head_dim // 2
    return M.inv_freq(half, cfg.rope_theta, device)


class VisionTower(nn.Module):
    """`model.visual` of a Qwen3.5 checkpoint: patches of one or more images -> their text-width tokens."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = M.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.register_buffer("inv_freq", vision_inv_freq(cfg), persistent=False)

    def position_embedding(self, gh: int, gw: int, r, c):
        """The learned side x side table resampled bilinearly (align_corners) to gh x gw, read at the patches'
        (row r, col c) in block order -> [gh*gw, D]."""
        side = math.isqrt(self.cfg.num_position_embeddings)
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None].float()   # [1, D, side, side]
        grid = F.interpolate(table, size=(gh, gw), mode="bilinear", align_corners=True)[0]   # [D, gh, gw]
        return grid[:, r, c].t()

    def rotary(self, r, c):
        """cos, sin [n, hd] in float32 for patches at (row r, col c)."""
        inv = self.inv_freq
        ang = torch.cat([r.to(inv.device)[:, None] * inv, c.to(inv.device)[:, None] * inv], dim=-1)
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()

    def forward(self, patches, grids: list):
        """patches [N, C*Tp*p*p] of the images in order; grids [(1, gh, gw), ...] -> tokens [N / m**2, H]."""
        dt = self.patch_embed.proj.weight.dtype
        x = self.patch_embed(patches.to(dt))
        rows_cols = [block_order_rows_cols(gh, gw, self.cfg.spatial_merge_size) for _, gh, gw in grids]
        x = x + torch.cat([self.position_embedding(gh, gw, r, c) for (_, gh, gw), (r, c) in zip(grids, rows_cols)]).to(dt)
        rot = [self.rotary(r, c) for r, c in rows_cols]
        cos, sin = torch.cat([c for c, _ in rot]), torch.cat([s for _, s in rot])
        lengths = [t * gh * gw for t, gh, gw in grids]
        for blk in self.blocks:
            x = blk(x, cos, sin, lengths)
        return self.merger(x)


def load_vision(path: str, dtype=torch.float32, device="cpu") -> tuple:
    """The vision tower of a multimodal Qwen3.5 checkpoint (`model.visual.*`) and its image processor
    settings -> (VisionTower, ImageProcessorConfig)."""
    path = ckpt.resolve_dir(path)
    cfg = VisionConfig.from_dict(ckpt.read_config(path))
    with torch.device("meta"):
        tower = VisionTower(cfg)
    tower.to_empty(device="cpu")
    prefix = "model.visual."
    tensors = {k[len(prefix):]: t for k, t in ckpt.read_safetensors(path, keep=lambda k: k.startswith(prefix), lazy=True).items()}
    if not tensors:
        raise M.CheckpointError(f"{path} has a vision_config but no model.visual.* tensors; re-download the full checkpoint")
    w = tensors.get("patch_embed.proj.weight")
    if w is not None and w.dim() == 5:                     # the Conv3d kernel [D, C, Tp, p, p] -> Linear [D, C*Tp*p*p]
        tensors["patch_embed.proj.weight"] = w.reshape(w.shape[0], -1)
    ckpt.load_into(tower, tensors, dtype, "vision tower")
    tower.inv_freq = vision_inv_freq(cfg)          # a non-persistent buffer: to_empty left it uninitialised
    pc = ImageProcessorConfig.from_dir(path)
    if (pc.patch_size, pc.temporal_patch_size, pc.merge_size) != (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size):
        raise M.CheckpointError(f"{path}: preprocessor_config.json patches ({pc.patch_size}, {pc.temporal_patch_size}, "
                                f"{pc.merge_size}) disagree with vision_config ({cfg.patch_size}, {cfg.temporal_patch_size}, "
                                f"{cfg.spatial_merge_size})")
    return tower.to(device).eval(), pc


# ==================================================================================================
# Prompt ids with images: expansion and 3-D positions
# ==================================================================================================

def expand_image_pads(ids: list, image_token_id: int, grids: list, merge: int) -> list:
    """Each <|image_pad|> id in `ids` stands for the next image and becomes gh*gw/m**2 copies of itself."""
    n_pads = sum(1 for i in ids if i == image_token_id)
    if n_pads != len(grids):
        raise ImageError(f"the prompt has {n_pads} <|image_pad|> id(s) ({image_token_id}) but {len(grids)} image(s) "
                         "were given; put one <|image_pad|> where each image goes")
    out, it = [], iter(grids)
    for i in ids:
        if i == image_token_id:
            t, gh, gw = next(it)
            out += [i] * (t * gh * gw // merge ** 2)
        else:
            out.append(i)
    return out


def rope_positions(ids: list, image_token_id: int, grids: list, merge: int) -> tuple:
    """Expanded prompt ids -> (rope_pos [3, T] long, rope_delta int). A text run of n tokens takes
    p .. p+n-1 on all three streams and advances p by n; an image run (its merged grid gh/m x gw/m) takes
    t = p, h = p + row, w = p + col, and advances p by max(gh, gw) / m. A run of image pads is one image."""
    cols, p, it, i, T = [], 0, iter(grids), 0, len(ids)
    while i < T:
        j = i
        while j < T and (ids[j] == image_token_id) == (ids[i] == image_token_id):
            j += 1
        if ids[i] != image_token_id:
            cols.append(torch.arange(p, p + j - i).expand(3, -1))
            p += j - i
        else:
            grid = next(it, None)
            if grid is None or grid[0] * grid[1] * grid[2] // merge ** 2 != j - i:
                raise ImageError(f"a run of {j - i} <|image_pad|> tokens does not match the next image "
                                 f"({'none left' if grid is None else f'{grid[1] * grid[2] // merge ** 2} tokens'})")
            t, gh, gw = grid[0], grid[1] // merge, grid[2] // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            cols.append(torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + p)
            p += max(gh, gw)
        i = j
    if next(it, None) is not None:
        raise ImageError("more images were given than runs of <|image_pad|> tokens in the prompt")
    pos = torch.cat(cols, dim=1) if cols else torch.zeros(3, 0, dtype=torch.long)
    return pos, int(pos.max()) + 1 - T if T else 0


@dataclass
class ImagePrompt:
    """What prefill needs for a prompt with images: the expanded ids, the image tokens' embeddings (to put
    in place of the <|image_pad|> embeddings), the 3-D positions, and the delta for later tokens."""
    ids: list
    embeds: torch.Tensor          # [n_image_tokens, H]
    rope_pos: torch.Tensor        # [3, T]
    rope_delta: int


@torch.no_grad()
def encode_images(tower: VisionTower, pc: ImageProcessorConfig, ids: list, images: list) -> ImagePrompt:
    """Prompt ids with one <|image_pad|> per image, and the images (PIL RGB) -> ImagePrompt."""
    cfg = tower.cfg
    pre = [preprocess(img, pc) for img in images]
    grids = [g for _, g in pre]
    full = expand_image_pads(ids, cfg.image_token_id, grids, cfg.spatial_merge_size)
    dev = tower.patch_embed.proj.weight.device
    embeds = tower(torch.cat([x for x, _ in pre]).to(dev), grids)
    pos, delta = rope_positions(full, cfg.image_token_id, grids, cfg.spatial_merge_size)
    return ImagePrompt(full, embeds, pos.to(dev), delta)
