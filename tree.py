"""Draft trees on the hybrid target: one verify forward over a tree of proposals, exact (docs/method.md#draft-trees).

A tree of T nodes: node 0 is the last committed token (the root, not yet run through the target, as the first
token of a chain's block), node i > 0 a proposal whose parent is parents[i] < i. Node i stands at position
start + depth[i]. One forward gives every node's logits, hence the target's own token after each node's path
(posterior[i]). The accepted path walks from the root, each time to the child that proposes the target's token
there; the round commits the path's tokens and the target's token after its last node (the bonus), as a chain's
round does.

How each kind of layer reads a tree:
- Gated attention: node i's query sees the committed context (slots < start) and the keys of its ancestors and
  itself, which the call writes at slots start + j (node j): the tree mask. RoPE at start + depth[i]. After
  acceptance the path's keys and values move to slots start, start + 1, ...: what a chain of the same tokens
  would have written there. The other nodes' slots lie past the committed length: hidden, overwritten later.
- GDN: a recurrent state per node, its parent's state advanced by the node's token (S_i = step(S_parent, x_i);
  the root's parent state is the committed one), and the causal conv over the node's own ancestry (its K-1
  nearest ancestors' pre-conv inputs, then the committed conv state). Each step is the AR decode step's maths,
  token for token. The commit takes the last accepted node's state and the K-1 inputs ending there. A state per
  node costs T x Hv x dk x dv per GDN layer for the round (a chain's rollback keeps only the writes).

    Tree                 tokens, parents, depth, the ancestor-or-self mask, each node's conv rows
    verify_tree(...)     -> logits [T,V], the per-node GDN states (TreeKept)
    accept(tree, post)   -> the accepted path: node indices from the root
    commit_path(...)     the caches as a chain of the path's tokens would leave them
    TreeEngine           the engine.Engine with a round that verifies a proposer's trees (greedy, one slot)
    DFlashTree           a DFlash drafter's block as a tree: the most probable paths through its per-position top-k
    (eagle3.Eagle3Tree   an EAGLE-3 drafter's dynamic trees)

This is the exact reference, written for reading: the per-node GDN steps run one node at a time, in Python.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import kernels
from dflash import GenerationError
from engine import Engine
from model import DenseMasks, GDNCache, Qwen35, TargetCache


class Tree:
    """tokens [T] (tokens[0]: the root, the last committed token); parents [T] with parents[0] = -1 and
    0 <= parents[i] < i for i > 0 (every node after its parent)."""

    def __init__(self, tokens: list, parents: list):
        if len(tokens) != len(parents) or not tokens or parents[0] != -1:
            raise GenerationError("a draft tree needs one parent per token and the root (parent -1) first")
        if any(not 0 <= p < i for i, p in enumerate(parents) if i > 0):
            raise GenerationError(f"a draft tree's nodes must follow their parents: parents {parents}")
        self.tokens, self.parents = list(tokens), list(parents)
        self.depth = [0] * len(tokens)
        for i in range(1, len(tokens)):
            self.depth[i] = self.depth[parents[i]] + 1

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, i: int) -> list:
        """Node indices from the root to node i."""
        out = [i]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def ancestors(self, device) -> torch.Tensor:
        """[T,T] bool: row i marks node i and its ancestors."""
        T = len(self)
        m = torch.zeros(T, T, dtype=torch.bool)
        for i in range(T):
            m[i, self.path(i)] = True
        return m.to(device)

    def conv_rows(self, K: int, device) -> torch.Tensor:
        """[T,K] rows of cat(conv state (K-1 rows), the nodes' pre-conv inputs) that node i's causal conv reads,
        oldest first: its K-1 nearest ancestors (past the root, the committed conv state's rows), then itself."""
        rows = []
        for i in range(len(self)):
            path = self.path(i)                                    # root .. i
            take = [K - 1 + j for j in path[-K:]]
            rows.append(list(range(len(take) - 1, K - 1)) + take)      # the conv state's newest K - len(take) rows
        return torch.tensor(rows, device=device)


@dataclass
class TreeKept:
    """What a tree verify leaves for the commit, per GDN layer (None for attention layers)."""
    states: list      # [T,Hv,dk,dv] per GDN layer: each node's recurrent state after its token
    windows: list     # [K-1+T, conv_dim] per GDN layer: the committed conv state, then the nodes' pre-conv inputs
    rows: torch.Tensor  # [T,K] Tree.conv_rows: each node's conv window, as rows of `windows`


def tree_gdn(mix, h, tree: Tree, rows: torch.Tensor, cache: GDNCache) -> tuple:
    """A GDN layer (model.GatedDeltaNet) over the tree's nodes h [1,T,H] -> (output [1,T,H], the nodes' states
    [T,Hv,dk,dv], the conv window [K-1+T, conv_dim])."""
    z, beta, g, pre = mix.project(h)
    window = torch.cat([cache.conv.to(pre.dtype), pre], 1)[0]                   # [K-1+T, C]
    # each node a one-token conv call whose conv state is its K-1 nearest ancestors' inputs: the decode step's kernel
    u, _ = kernels.causal_conv1d(pre[0][:, None], mix.conv_weight, window[rows[:, :-1]])     # [T,1,C]
    q, k, v = mix.heads(u.transpose(0, 1))
    outs, states = [], []
    for i, p in enumerate(tree.parents):
        s0 = cache.rec if p < 0 else states[p][None]
        o, _, s = kernels.recurrent_gated_delta_rule(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1],
                                                     beta[:, i:i + 1], s0)
        outs.append(o)
        states.append(s[0])
    return mix.finish(torch.cat(outs, 1), z, h.dtype), torch.stack(states), window


@torch.inference_mode()
def verify_tree(target: Qwen35, tree: Tree, start: int, cache: TargetCache, feature_layers=()) -> tuple:
    """The target over the tree's nodes at positions start + depth, the committed caches read, attention K/V written
    at slots start + node -> (logits [T,V], TreeKept, the nodes' features [1,T,F] for a drafter as Qwen35.forward
    gives them, or None). GDN layers keep their committed state (commit_path moves it)."""
    dev, T = target.embed_tokens.weight.device, len(tree)
    if start + T > cache.capacity:
        raise GenerationError(f"a {T}-node tree at position {start} does not fit the cache ({cache.capacity} positions)")
    x = target.embed_tokens(torch.tensor([tree.tokens], device=dev))
    cos, sin = target.rope(start + torch.tensor(tree.depth, device=dev), x.dtype)
    slots = start + torch.arange(T, device=dev)
    mask = torch.zeros(T, cache.capacity, dtype=torch.bool, device=dev)
    mask[:, :start] = True
    mask[:, start:start + T] = tree.ancestors(dev)
    rows = tree.conv_rows(target.cfg.linear_conv_kernel_dim, dev)
    states, windows, outputs, last = [], [], {}, len(target.layers) - 1
    for i, (layer, lc) in enumerate(zip(target.layers, cache.layers)):
        h = layer.input_layernorm(x)
        if isinstance(lc, GDNCache):
            out, s, w = tree_gdn(layer.linear_attn, h, tree, rows, lc)
            states.append(s), windows.append(w)
        else:
            out = layer.self_attn(h, cos, sin, slots, mask, lc)
            states.append(None), windows.append(None)
        x = x + out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in feature_layers:                 # layer i's output; the last layer's after the final norm
            outputs[i] = target.norm(x) if i == last else x
    feats = torch.cat([outputs[i] for i in feature_layers], -1) if feature_layers else None
    return target.lm_head(target.norm(x))[0], TreeKept(states, windows, rows), feats


def accept(tree: Tree, posterior: list) -> list:
    """The accepted path from the root: at each node, the first child whose token is the target's own there."""
    children = [[] for _ in tree.tokens]
    for i, p in enumerate(tree.parents[1:], 1):
        children[p].append(i)
    path = [0]
    while True:
        nxt = next((c for c in children[path[-1]] if tree.tokens[c] == posterior[path[-1]]), None)
        if nxt is None:
            return path
        path.append(nxt)


@torch.inference_mode()
def commit_path(cache: TargetCache, kept: TreeKept, path: list, start: int) -> None:
    """Keep the nodes of `path` (root first) as a chain at positions start, start + 1, ...: attention K/V moved
    from slots start + node to start + depth; each GDN layer's state becomes the last node's, its conv state the
    K-1 pre-conv inputs ending there."""
    dev = kept.rows.device
    src = start + torch.tensor(path, device=dev)
    dst = start + torch.arange(len(path), device=dev)
    last = path[-1]
    for lc, states, window in zip(cache.layers, kept.states, kept.windows):
        if isinstance(lc, GDNCache):
            lc.rec.copy_(states[last][None])
            lc.conv.copy_(window[kept.rows[last, 1:]][None])
        else:
            for t in (lc.k, lc.v):
                t[:, :, dst] = t[:, :, src].clone()


class TreeEngine(Engine):
    """The Engine whose rounds verify trees: the same admission, plain steps, pending features and commit bookkeeping,
    with its own round. proposer.propose_tree(last, start, n, feats, feat_pos, next_ids) -> (tokens, parents) of at
    most n nodes after the root (parents index the whole tree, 0 being the root; feats [1,P,F] at feat_pos [P]
    and next_ids [P]: the pending features, as Proposer.propose gets them for one row). One slot, greedy, eager:
    a tree's verify is one request's (the tree mask and per-node GDN states are the reference, not batched), and
    sampling with a tree would need the multi-draft rejection rule, which is not built."""

    def __init__(self, target: Qwen35, proposer, tree_size: int, capacity: int, masks=DenseMasks):
        if tree_size < 1:
            raise GenerationError(f"--tree-size must be >= 1, got {tree_size}")
        super().__init__(target, proposer, tree_size + 1, 1, capacity, masks=masks)
        self.tree_size = tree_size

    def check(self, requests: list) -> None:
        super().check(requests)
        if any(not r.sampling.greedy for r in requests):
            raise GenerationError("sampling with a draft tree is not supported (greedy only); drop --temperature or the tree")

    def round(self, rows: list, k: int) -> list:
        """Draft a tree, verify it in one forward, accept the path the target's tokens follow, commit it as a chain
        (the caches as a chain of the path's tokens would leave them)."""
        row, pending, t0 = rows[0], self.pending, time.perf_counter()
        start, last = row.start, row.result.output_ids[-1]
        tokens, parents = self.proposer.propose_tree(last, start, self.tree_size, pending.feats[:1], pending.feat_pos[0],
                                                     pending.feat_next[0])
        tree = Tree([last] + list(tokens), [-1] + list(parents))
        t1 = time.perf_counter()
        logits, kept, feats = verify_tree(self.target, tree, start, self.cache, self.feature_layers)
        posterior = logits.argmax(-1).tolist()
        path = accept(tree, posterior)
        drafts = [tree.tokens[i] for i in path[1:]]       # the accepted path, then the rejected first child, if any
        drafts += [tree.tokens[c] for c, p in enumerate(tree.parents) if p == path[-1]][:1]
        new = row.take("verify", [tree.tokens[i] for i in path[1:]] + [posterior[path[-1]]], drafts, len(path) - 1,
                       (t1 - t0, time.perf_counter() - t1))
        commit_path(self.cache, kept, path[:len(new)], start)
        # the committed nodes' features (and the token after each) pending for the next draft, at start, start + 1, ..
        dev = self.device
        pending.keep_round(None if feats is None else feats[:, path[:len(new)]], torch.tensor([new], device=dev))
        pending.after_round(torch.tensor([start], device=dev))
        return [len(new)]


class DFlashTree:
    """A tree from one DFlash block (docs/method.md#draft-trees). The block's rows are drafted in one pass from the
    same context, so row d's distribution p_d does not depend on the tokens chosen before it: a path t_1 .. t_d
    scores p_1(t_1) ... p_d(t_d). The tree holds the `n` best-scoring paths' nodes (best first, from the top_k
    tokens of each row), which is prefix-closed since a prefix scores at least its path. Each node's first child
    is its row's most probable token, so the first branch is a prefix of the chain's greedy block (all of it with
    top_k 1)."""

    wants_next_ids, samples_drafts = False, False

    def __init__(self, inner, top_k: int = 4):
        """inner: an engine.DrafterProposer (its context cache and masks are used as they are)."""
        if top_k < 1:
            raise GenerationError(f"--tree-top-k must be >= 1, got {top_k}")
        self.inner, self.top_k = inner, top_k
        self.window, self.feature_layers = inner.window, inner.feature_layers
        self.max_block_size = 1 << 10                 # any tree size (the tree's depth is the block's)

    def reset(self, slots: int, capacity: int, masks) -> None:
        self.inner.reset(slots, capacity, masks)

    def admit(self, row: int, feats, pos, prompt_ids: list, first: int) -> None:
        self.inner.admit(row, feats, pos, prompt_ids, first)

    def append(self, feats, pos, next_ids=None) -> None:
        self.inner.append(feats, pos)

    @torch.inference_mode()
    def propose_tree(self, last: int, start: int, n: int, feats, feat_pos, next_ids=None) -> tuple:
        p, d = self.inner, self.inner.drafter
        dev = d.fc.weight.device
        p.append(feats, feat_pos[None])
        rows = d.cfg.block_size - 1
        hidden = d.draft_block(torch.tensor([last], device=dev), torch.tensor([start], device=dev), rows,
                               p.target.embed_tokens, p.cache, p.masks)
        logp = torch.log_softmax(d.draft_logits(hidden[0], p.target.lm_head).double(), -1)    # [rows, V]
        top_lp, top_tok = (x.tolist() for x in logp.topk(min(self.top_k, logp.shape[-1]), -1))
        tokens, parents = [], []
        frontier = [(top_lp[0][j], 0, 0, j) for j in range(len(top_lp[0]))]   # (score, parent node, depth, rank)
        while frontier and len(tokens) < n:
            frontier.sort(key=lambda f: -f[0])
            score, parent, depth, j = frontier.pop(0)
            tokens.append(top_tok[depth][j]), parents.append(parent)
            if depth + 1 < rows:
                frontier += [(score + top_lp[depth + 1][c], len(tokens), depth + 1, c) for c in range(len(top_lp[0]))]
        return tokens, parents


def is_tree_proposer(proposer) -> bool:
    """Whether `proposer` drafts trees (a TreeEngine's): DFlashTree or an EAGLE-3 drafter's eagle3.Eagle3Tree."""
    import eagle3
    return isinstance(proposer, (DFlashTree, eagle3.Eagle3Tree))
