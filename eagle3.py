"""EAGLE-3 drafters (Li et al., 2025) in their published layout, drafting dynamic trees (EAGLE-2) for tree.TreeEngine.

The checkpoint (the EAGLE authors' layout, which vLLM and SGLang load as `LlamaForCausalLMEagle3`):
    config.json   architectures ["LlamaForCausalLMEagle3"], hidden_size, intermediate_size, num_attention_heads,
                  num_key_value_heads, head_dim (optional), rms_norm_eps, rope_theta, vocab_size (the target's),
                  draft_vocab_size, target_hidden_size (optional: the target's width when it differs),
                  eagle_config.eagle_aux_hidden_state_layer_ids (optional), norm_before_residual (optional)
    tensors       fc.weight [H, 3 Ht]: three target layers' hidden states to H
                  midlayer.*: one Llama decoder layer whose attention reads [input_layernorm(embedding) ;
                      hidden_norm(hidden)] (2H wide), with post_attention_layernorm and a SwiGLU mlp
                  norm.weight, lm_head.weight [Vd, H] over the draft vocabulary
                  d2t [Vd]: target id = draft id + d2t[draft id]; t2d [V]: which target ids the draft vocabulary holds
                  embed_tokens.weight [V, H] (optional: else the target's embedding)

How it drafts. Entry t of the drafter's context reads (the token at t + 1, a hidden state for position t): the
target's three tapped layers through fc for committed positions, the drafter's own output for drafted ones (its
"training-time test"). Entry t's output h_t gives, through norm and lm_head, the distribution of the token at
t + 2. The tapped layers are the `eagle_aux_hidden_state_layer_ids`, counted as vLLM counts them: layer i's INPUT,
which is our feature layer i - 1 (Qwen35.forward's features are layer outputs); without them vLLM's default
(2, L // 2, L - 3). A round (Eagle3Tree.propose_tree) appends the new committed entries, runs the last one, and
grows the tree depth by depth: at each depth the top_k best nodes (by the sum of their path's log probabilities)
are expanded, each by its top_k tokens; the tree keeps the tree_size best nodes (prefix-closed: a node scores no
more than its parent).

    Eagle3Config / eagle3_config(raw)   the config, checked
    Eagle3Drafter                       the module: fc, midlayer, norm, lm_head, d2t
    load_eagle3 / save_eagle3 / is_eagle3
    Eagle3Tree                          the tree proposer (tree.TreeEngine's propose_tree)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

import checkpoint as ckpt
from model import MLP, CheckpointError, Embedding, GenerationError, Qwen35, RMSNorm, apply_rope, attention, inv_freq

ARCH = "LlamaForCausalLMEagle3"


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple | None          # vLLM's count (a layer's input); None: the engines' default
    norm_before_residual: bool = False


def is_eagle3(raw: dict) -> bool:
    return ARCH in (raw.get("architectures") or [])


def eagle3_config(raw: dict) -> Eagle3Config:
    """config.json -> Eagle3Config; a missing key or a rope scaling this module does not run is one error line."""
    where = "EAGLE-3 config.json"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise CheckpointError(f"{where} needs a positive integer {key}")
    if raw.get("rope_scaling"):
        raise CheckpointError(f"{where} asks for rope_scaling {raw['rope_scaling']}, which this project does not run")
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and (not isinstance(aux, list) or len(aux) != 3 or not all(isinstance(i, int) and i >= 1 for i in aux)):
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids must be three layer numbers >= 1, got {aux}")
    H = raw["hidden_size"]
    return Eagle3Config(H, raw["intermediate_size"], raw["num_attention_heads"], raw["num_key_value_heads"],
                        raw.get("head_dim") or H // raw["num_attention_heads"], float(raw.get("rms_norm_eps", 1e-6)),
                        float(raw.get("rope_theta", 10000.0)), raw["vocab_size"], raw.get("draft_vocab_size") or raw["vocab_size"],
                        raw.get("target_hidden_size") or H, tuple(aux) if aux else None,
                        bool(raw.get("norm_before_residual", False)))


class Eagle3Layer(nn.Module):
    """The midlayer: attention over [input_layernorm(embedding) ; hidden_norm(hidden)], then a SwiGLU mlp."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd, self.norm_first = cfg.num_attention_heads, cfg.num_key_value_heads, hd, cfg.norm_before_residual
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, self.nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * H, self.nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * H, self.nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(self.nh * hd, H, bias=False)
        self.mlp = MLP(H, cfg.intermediate_size)

    def inputs(self, emb, hid):
        """emb, hid [B,T,H] -> the attention's input [B,T,2H] and the residual [B,T,H]."""
        normed = self.hidden_norm(hid)
        return torch.cat([self.input_layernorm(emb), normed], -1), (normed if self.norm_first else hid)

    def kv(self, x, cos, sin):
        """x [B,T,2H] -> k, v [B,Hkv,T,hd] (k rotated)."""
        B, T, _ = x.shape
        k = self.self_attn.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.self_attn.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, residual, cos, sin, keys, values, mask):
        """x [B,T,2H] (its own k, v already among keys / values [B,Hkv,S,hd]); mask [T,S] -> hidden [B,T,H]."""
        B, T, _ = x.shape
        q = apply_rope(self.self_attn.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2), cos, sin)
        h = residual + self.self_attn.o_proj(attention(q, keys, values, mask))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config, own_embedding: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def feature_layers(self, n_target_layers: int) -> tuple:
        """The target layers whose OUTPUTS it reads (Qwen35.forward's feature_layers): aux id i -> layer i - 1."""
        aux = self.cfg.aux_layer_ids or (2, n_target_layers // 2, n_target_layers - 3)
        if not all(1 <= i < n_target_layers for i in aux):       # (layer L has no input to tap: there is none)
            raise CheckpointError(f"EAGLE-3 tap layers {list(aux)} do not fit a {n_target_layers}-layer target")
        return tuple(i - 1 for i in aux)

    def rope(self, pos, dtype):
        ang = pos.float()[:, None] * self.inv_freq
        ang = torch.cat([ang, ang], -1)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def logprobs(self, h):
        """Output hidden [..., H] -> log probabilities over the draft vocabulary [..., Vd] (float64)."""
        return torch.log_softmax(self.lm_head(self.norm(h)).double(), -1)

    def to_target(self, ids):
        """Draft vocabulary ids -> target ids."""
        return ids + self.d2t[ids]


def load_eagle3(path: str, target: Qwen35, dtype=torch.float32, device="cpu") -> Eagle3Drafter:
    """An EAGLE-3 checkpoint folder -> Eagle3Drafter, checked against the target."""
    path = ckpt.resolve_dir(path)
    cfg = eagle3_config(ckpt.read_config(path))
    if cfg.vocab_size != target.cfg.vocab_size or cfg.target_hidden_size != target.cfg.hidden_size:
        raise CheckpointError(f"this EAGLE-3 drafter was built for a target with vocabulary {cfg.vocab_size} and width "
                              f"{cfg.target_hidden_size}, not {target.cfg.vocab_size} and {target.cfg.hidden_size}")
    tensors = ckpt.read_safetensors(path, lazy=True)      # Stored handles, each read into its parameter
    tensors.pop("t2d", None)                       # implied by d2t
    d2t = tensors.pop("d2t", None)
    own = "embed_tokens.weight" in tensors
    if not own and cfg.hidden_size != target.cfg.hidden_size:
        raise CheckpointError(f"this EAGLE-3 drafter has no embedding of its own and width {cfg.hidden_size}, so it needs "
                              f"a target of width {cfg.hidden_size}, not {target.cfg.hidden_size}")
    model = Eagle3Drafter(cfg, own_embedding=own)
    ckpt.load_into(model, tensors, dtype, "EAGLE-3 drafter")
    if d2t is not None:
        if tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise CheckpointError(f"EAGLE-3 d2t has shape {tuple(d2t.shape)}, not ({cfg.draft_vocab_size},)")
        model.d2t.copy_(d2t.read().long())
    elif cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError("EAGLE-3 checkpoint has a reduced draft vocabulary but no d2t map")
    if int((model.d2t + torch.arange(cfg.draft_vocab_size)).max()) >= cfg.vocab_size:
        raise CheckpointError("EAGLE-3 d2t maps draft ids outside the target's vocabulary; the checkpoint is corrupt")
    model.path = path
    return model.to(device).eval()


def save_eagle3(model: Eagle3Drafter, out: str, dtype=torch.bfloat16) -> None:
    """The published layout (config.json, model.safetensors with d2t and t2d)."""
    import json
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    c = model.cfg
    raw = {"architectures": [ARCH], "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab_size,
           "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
           "norm_before_residual": c.norm_before_residual}
    if c.aux_layer_ids:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)}
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(raw, fh, indent=1)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k != "d2t"}
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[model.to_target(torch.arange(c.draft_vocab_size))] = True
    save_file({**tensors, "d2t": model.d2t.clone(), "t2d": t2d}, os.path.join(out, "model.safetensors"))


@dataclass
class _Node:
    """A drafted node: its path's log probability, depth (1 under the root), parent node (-1: the root), target
    token, and once expanded its output hidden [1,H] and the scratch cache slot of its entry."""
    score: float
    depth: int
    parent: int
    token: int
    hidden: torch.Tensor | None = None
    slot: int | None = None


class Eagle3Tree:
    """EAGLE-3 drafting dynamic trees for tree.TreeEngine: tree_size nodes at most, depth at most tree_depth, top_k
    candidates per expanded node and top_k nodes expanded per depth (EAGLE-2's tree). Its context cache holds
    the committed entries at their positions and, past `capacity`, the entries of the nodes it expands."""

    wants_next_ids = True                         # it reads the token after each feature row (engine.Engine)
    samples_drafts = False

    def __init__(self, drafter: Eagle3Drafter, target: Qwen35, tree_depth: int = 6, top_k: int = 4):
        if tree_depth < 1 or top_k < 1:
            raise GenerationError(f"--tree-depth and --tree-top-k must be >= 1, got {tree_depth} and {top_k}")
        self.drafter, self.target, self.depth, self.top_k = drafter, target, tree_depth, top_k
        self.feature_layers = drafter.feature_layers(target.cfg.num_hidden_layers)
        self.max_block_size, self.window, self.k, self.scores = 1 << 10, None, None, []

    def reset(self, slots: int, capacity: int, masks) -> None:
        if slots != 1:
            raise GenerationError("an EAGLE-3 tree drafts for one request at a time (tree.TreeEngine has one slot)")
        c = self.drafter.cfg
        w = self.drafter.fc.weight
        slots = capacity + self.depth * self.top_k + 1
        self.capacity = capacity
        self.k = torch.zeros(1, c.num_key_value_heads, slots, c.head_dim, dtype=w.dtype, device=w.device)
        self.v = torch.zeros_like(self.k)

    def embed(self, ids):
        table = self.drafter.embed_tokens or self.target.embed_tokens
        return table(ids)

    def _write(self, x, cos, sin, slots) -> None:
        k, v = self.drafter.midlayer.kv(x, cos, sin)
        self.k[:, :, slots], self.v[:, :, slots] = k, v

    def _append(self, feats, pos, next_ids) -> None:
        """Committed entries into the context: the target's features [1,T,F] at positions pos [T], and the token
        after each (next_ids [T]). Only their keys and values are needed: no query reads from them."""
        x, _ = self.drafter.midlayer.inputs(self.embed(next_ids[None]), self.drafter.fc(feats))
        self._write(x, *self.drafter.rope(pos, x.dtype), pos)

    def admit(self, row: int, feats, pos, prompt_ids: list, first: int) -> None:
        """The prompt's features [1,T,F] at positions pos [T], each with the token after it (the prompt shifted by
        one, then the first generated token)."""
        self._append(feats, pos, torch.tensor(prompt_ids[1:] + [first], device=pos.device))

    def append(self, feats, pos, next_ids) -> None:
        """Pending rows [1,P,F] at positions pos [1,P] with their next tokens [1,P] (the rows at positions >= start
        are stale; they are rewritten before any query reads them)."""
        self._append(feats, pos[0], next_ids[0])

    def _run(self, emb, hid, pos, slots, mask):
        """Entries (emb, hid [1,T,H]) at positions pos [T], written at `slots`, attending by mask [T, all slots]
        -> output hidden [1,T,H]."""
        mid = self.drafter.midlayer
        x, residual = mid.inputs(emb, hid)
        cos, sin = self.drafter.rope(pos, x.dtype)
        self._write(x, cos, sin, slots)
        return mid(x, residual, cos, sin, self.k, self.v, mask)

    def _children(self, nodes: list, frontier: list, lp, parent: int, score: float, depth: int) -> None:
        """The top_k tokens of the log probabilities lp [Vd] as nodes under `parent` (-1: the root), into the frontier."""
        for s, t in zip(*lp.topk(min(self.top_k, lp.numel()))):
            nodes.append(_Node(score + float(s), depth, parent, int(self.drafter.to_target(t))))
            frontier.append(len(nodes) - 1)

    @torch.inference_mode()
    def propose_tree(self, last: int, start: int, n: int, feats, feat_pos, next_ids=None) -> tuple:
        dev, d = self.k.device, self.drafter
        rows = (feat_pos < start).nonzero()[:, 0]                  # rows at >= start are placeholders
        if rows.numel() > 1:                                       # the committed entries before the last one
            self._append(feats[:, rows[:-1]], feat_pos[rows[:-1]], next_ids[rows[:-1]])
        r = rows[-1:]                                              # the last committed entry, at start - 1
        ctx = torch.arange(self.k.shape[2], device=dev) < start
        root_h = self._run(self.embed(next_ids[r][None]), d.fc(feats[:, r]), feat_pos[r], feat_pos[r], ctx[None])
        nodes, frontier = [], []
        self._children(nodes, frontier, d.logprobs(root_h[0, -1]), -1, 0.0, 1)
        slot = self.capacity
        for depth in range(1, self.depth):
            expand = sorted(frontier, key=lambda i: -nodes[i].score)[:self.top_k]
            if not expand:
                break
            slots = torch.arange(slot, slot + len(expand), device=dev)
            for i, sl in zip(expand, slots.tolist()):
                nodes[i].slot = sl
            mask = ctx[None].repeat(len(expand), 1)
            for row, i in enumerate(expand):                       # each node sees its ancestors' entries and its own
                j = i
                while j >= 0:
                    mask[row, nodes[j].slot] = True
                    j = nodes[j].parent
            parents_h = torch.cat([root_h[0, -1:] if nodes[i].parent < 0 else nodes[nodes[i].parent].hidden for i in expand])
            toks = torch.tensor([nodes[i].token for i in expand], device=dev)
            pos = torch.full((len(expand),), start + depth - 1, device=dev)
            h = self._run(self.embed(toks[None]), parents_h[None], pos, slots, mask)[0]
            slot += len(expand)
            frontier = []
            for row, i in enumerate(expand):
                nodes[i].hidden = h[row:row + 1]
                self._children(nodes, frontier, d.logprobs(h[row]), i, nodes[i].score, depth + 1)
        tokens, parents, self.scores = self._select(nodes, n)   # scores: each node's path log probability
        return tokens, parents

    @staticmethod
    def _select(nodes: list, n: int) -> tuple:
        """The n best nodes, each after its parent (by depth), as (tokens, parents with 0 the root, scores)."""
        chosen, keep = set(), []
        for i in sorted(range(len(nodes)), key=lambda i: -nodes[i].score):
            if len(keep) == n:
                break
            if nodes[i].parent < 0 or nodes[i].parent in chosen:
                chosen.add(i)
                keep.append(i)
        keep.sort(key=lambda i: (nodes[i].depth, i))
        index = {i: k + 1 for k, i in enumerate(keep)}
        return ([nodes[i].token for i in keep], [index.get(nodes[i].parent, 0) for i in keep],
                [nodes[i].score for i in keep])
