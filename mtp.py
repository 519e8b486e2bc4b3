"""Qwen3.5's own multi-token-prediction (MTP) head as a proposer: the baseline DFlash is compared with.

The published Qwen3.5 checkpoints carry, beside the decoder, a one-layer head under `mtp.*` that transformers
drops on load. One MTP step (docs/method.md#the-mtp-baseline):

    x = fc(cat([pre_fc_norm_embedding(embed(token[t+1])), pre_fc_norm_hidden(hidden[t])]))   embedding first
    x = layers[0](x) at position t          the main model's gated full-attention decoder layer, own KV cache
    h = norm(x);  logits = lm_head(h)        shared embedding and lm_head; predicts token[t+2]

`hidden[t]` is the target's final hidden state after its final norm (the lm_head's input) at position t. The head
runs over every committed position (the prompt at prefill, then each round's verified rows), so its KV cache holds
one entry per position, as SGLang's and vLLM's MTP workers keep it. A draft of K tokens is K chained steps: the
first pairs the target's hidden state at the last committed position's predecessor with the last committed token;
step k+1 pairs step k's normed output with step k's proposal, one position further. So MTP drafts sequentially (K
calls of one layer) where DFlash drafts a whole block in one call of several layers.

Sources: vLLM `vllm/model_executor/models/qwen3_5_mtp.py` and `qwen3_next_mtp.py` (the layer, the names, the
concatenation order), `vllm/v1/spec_decode/llm_base_proposer.py` (the input ids shifted by one, the positions
left as the target's); SGLang `python/sglang/srt/models/qwen3_5_mtp.py` and `speculative/eagle_worker.py` (the
post-norm hidden states captured in full for the draft's prefill, the draft's KV re-written after each verify).

    MTPHead        the mtp.* module (checkpoint names minus the `mtp.` prefix)
    MTPProposer    the Engine's proposer: K chained steps -> K proposals; one-hot drafts (greedy), so sampling
                   stays exact through the same speculative rule as DFlash's
    load_mtp       the head from a target checkpoint folder (the published names; per-expert or fused MoE MLPs)
    save_mtp       a head into a target checkpoint folder under the same names (tools/train.py mtp)
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

import checkpoint as ckpt
from engine import Draft
from model import AttnCache, CheckpointError, DecoderLayer, GenerationError, DenseMasks, Linear, Qwen35, TargetConfig, ZeroCenteredRMSNorm

MTP_MAX_STEPS = 15      # a verify of K + 1 <= 16 tokens: the GDN caches keep at most 16 writes per call


class MTPHead(nn.Module):
    """mtp.fc [H, 2H]; mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm [H] (zero-centred RMSNorms);
    mtp.layers.0: one full-attention DecoderLayer of the target's shapes (SwiGLU MLP, or the sparse MoE block in the
    mixture-of-experts models)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention")])
        self.norm = ZeroCenteredRMSNorm(H, cfg.rms_norm_eps)

    def forward(self, emb, hidden, cos, sin, pos, mask, cache: AttnCache | None = None):
        """emb [B,T,H] the embeddings of the tokens after the rows' positions; hidden [B,T,H] the post-norm hidden
        states at positions pos [T] (the target's, or a previous step's output); cos, sin the target's RoPE at pos;
        mask over the keys (causal [T,T] without a cache, else the cache's). -> the normed output [B,T,H]: the
        lm_head's input, and the next chained step's hidden."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[0](x, cos, sin, pos, mask, cache, False))


class _MTPCache:
    """The head's KV cache: one attention layer (`layers`, as Engine's static-address marking expects), with a row
    per slot of a batch."""

    def __init__(self, cfg: TargetConfig, capacity: int, dtype, device, batch: int = 1):
        shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.capacity = capacity
        self.layers = [AttnCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))]


def check_steps(steps: int) -> None:
    if not 1 <= steps <= MTP_MAX_STEPS:
        raise GenerationError(f"--mtp-steps must be between 1 and {MTP_MAX_STEPS}, got {steps}")


def head_rows(head: MTPHead, target: Qwen35, ids, hidden, pos, masks, cache: AttnCache):
    """The head over rows at positions pos ([T], or [N,T]: each row of a batch its own), writing their K/V into
    `cache`: ids [N,T] the token after each row's position, hidden [N,T,H] -> the normed outputs [N,T,H]."""
    emb = target.embed_tokens(ids)
    rope_pos = pos if pos.dim() == 1 else pos[:, None].expand(-1, 3, -1)     # per-row positions: [N,3,T] streams
    cos, sin = target.rope(rope_pos, emb.dtype)
    return head(emb, hidden.to(emb.dtype), cos, sin, pos, masks.target(pos), cache)


class MTPProposer:
    """The MTP head as the Engine's proposer (engine.Proposer), with `steps` = K chained steps per draft (the
    Engine's block size is K + 1). Its KV cache has a row per slot, and each row drafts from its own row at
    start - 1: besides the target's features it reads, for each feature row at position p, the committed token at
    p + 1 (`wants_next_ids`: the Engine keeps them, and the row at start - 1, among the pending features)."""

    wants_next_ids = True
    samples_drafts = False      # greedy drafts (one-hot q) at any temperature
    window = None               # no draft window: the head sees the whole context, as published engines run it

    def __init__(self, head: MTPHead, target: Qwen35, steps: int = 3):
        check_steps(steps)
        self.head, self.target, self.steps = head, target, steps
        self.max_block_size = steps + 1
        self.feature_layers = (target.cfg.num_hidden_layers - 1,)
        self.cache = self.masks = None

    def reset(self, slots: int, capacity: int, masks=None) -> None:
        """(masks: the engine's; the head is one causal layer and keeps SDPA's dense mask whatever the target uses)"""
        self.cache = _MTPCache(self.target.cfg, capacity, self.target.dtype, self.head.fc.weight.device, batch=slots)
        self.masks = DenseMasks(capacity)

    def admit(self, row: int, feats, pos, prompt_ids: list, first: int) -> None:
        """The prompt's rows into row `row` of the KV cache, each with the token after it (the prompt shifted by one,
        then the first generated token)."""
        layer = self.cache.layers[0]
        view = AttnCache(layer.k[row:row + 1], layer.v[row:row + 1])
        nxt = torch.tensor([prompt_ids[1:] + [first]], device=feats.device)
        head_rows(self.head, self.target, nxt, feats, pos, self.masks, view)

    def append(self, feats, pos, next_ids) -> None:
        """Rows feats [N,R,H] at positions pos [N,R] with their next tokens next_ids [N,R] into the KV cache."""
        head_rows(self.head, self.target, next_ids, feats, pos, self.masks, self.cache.layers[0])

    def propose(self, last, start, feats, feat_pos, n: int, next_ids, rows=None, temperature=None):
        """engine.Proposer.propose: the pending rows' KV entries (re)written, then from each row's output at start - 1
        n chained one-row steps -> Draft(proposals [N,n]) (greedy: no q)."""
        out = head_rows(self.head, self.target, next_ids, feats, feat_pos, self.masks, self.cache.layers[0])
        at = (start - 1 - feat_pos[:, 0]).clamp(0, feats.shape[1] - 1)                  # (a free row: any row)
        h = out.gather(1, at[:, None, None].expand(-1, 1, out.shape[-1]))                # [N,1,H]
        tok = self.target.lm_head(h).argmax(-1)                                          # [N,1]
        proposals = [tok]
        for k in range(1, n):
            h = head_rows(self.head, self.target, tok, h, (start + k - 1)[:, None], self.masks, self.cache.layers[0])
            tok = self.target.lm_head(h).argmax(-1)
            proposals.append(tok)
        return Draft(torch.cat(proposals, 1))


MTP_PREFIXES = ("mtp.", "model.mtp.")


def load_mtp(path: str, target: Qwen35, dtype=None, weights=None) -> MTPHead:
    """The `mtp.*` tensors of the target checkpoint at `path` (the folder the target was loaded from) -> MTPHead
    on the target's device, in `dtype` (default: the target's arithmetic dtype), its weights kept as `weights` says
    (checkpoint.load_into). One clear error when the checkpoint has none."""
    raw = ckpt.read_config(path)
    tc = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    n = tc.get("mtp_num_hidden_layers")
    tensors = ckpt.read_safetensors(path, keep=lambda k: k.startswith(MTP_PREFIXES), lazy=True)
    if not tensors:
        raise CheckpointError(f"{path} has no MTP head (no mtp.* tensors); --draft mtp needs a Qwen3.5 checkpoint that "
                              f"ships one (the published ones do), or train one: python tools/train.py mtp --target {path}")
    if n is not None and n != 1:
        raise CheckpointError(f"mtp_num_hidden_layers = {n!r} in {path}/config.json; the published Qwen3.5 heads have "
                              "one layer, which is what this project runs")
    tensors = {k.split("mtp.", 1)[1]: t for k, t in tensors.items()}
    cfg = target.cfg
    if cfg.num_experts:
        ckpt.fuse_experts(tensors, cfg.num_experts)
    with torch.device("meta"):
        head = MTPHead(cfg)
    head.to_empty(device="cpu")
    ckpt.load_into(head, tensors, dtype or target.dtype, "MTP head", weights=weights)
    return head.to(target.embed_tokens.weight.device).eval()


def save_mtp(head: MTPHead, path: str) -> None:
    """Write `head` into the target checkpoint folder `path` (one model.safetensors) as mtp.* tensors in the file's
    own dtype, every other tensor kept byte for byte, and mark config.json (mtp_num_hidden_layers: 1)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    f = os.path.join(path, "model.safetensors")
    if not os.path.exists(f):
        raise CheckpointError(f"{path} has no single model.safetensors to add the MTP head to")
    with safe_open(f, framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if not k.startswith(MTP_PREFIXES)}
        metadata = fh.metadata() or {"format": "pt"}
    dtype = next(iter(tensors.values())).dtype
    tensors.update(ckpt.hf_tensors(head.state_dict(), dtype, lambda n: "mtp." + n))
    save_file(tensors, f, metadata=metadata)
    cfg_file = os.path.join(path, "config.json")
    raw = ckpt.read_config(path)
    (raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw).update(
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    with open(cfg_file, "w") as fh:
        json.dump(raw, fh, indent=2)
