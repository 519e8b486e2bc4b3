"""FlexAttention block masks for the cached steps: an optional attention backend, selected by `--attention flex`
(generate.py, tools/bench.py), which passes `FlexMasks` to engine.Engine in place of
model.DenseMasks. Deleting this file and that flag leaves a working project on SDPA, the default.

Why: compiled on a GPU, flex_attention skips the key tiles a step cannot see; SDPA with a boolean mask reads
the whole static cache every step. On a CPU, eager flex_attention runs an unfused reference path that
materialises the scores, so it is only for checking there.

How: each mask is built ONCE per Engine over the static cache, then sliced per step: the step keeps the rows
(query tiles) it needs and gets an exact `mask_mod` that reads the step's start position from a device tensor,
so nothing is rebuilt and nothing recompiles. Rows are indexed by ABSOLUTE position: row r stands for positions
r*TILE .. r*TILE + TILE-1 and lists every key tile that any of those positions may see, all as "partial" tiles
(the exact mask_mod is evaluated in every one). A step whose queries straddle a tile border uses the row of its
LAST query, whose list covers every earlier query too (the masks grow with position), and the mask_mod removes
the extra keys that row lists. So correctness rests on two simple facts (the row is a superset; the mask_mod is
exact), never on tile arithmetic.

A batch of requests (engine.Engine with N slots): every row at its own positions. The step's mask gets a batch dimension: row b
takes, per query tile, the row of the one-sequence mask its own positions need, and the mask_mod reads row b's
start. A draft block of n tokens needs a mask built for n (its key length is capacity + n); a batch whose policy
verifies shorter blocks asks for each one's mask (`prepare`) before its first compiled call.
"""
from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from model import draft_visible

TILE = 128        # FlexAttention's default tile (rows and columns of a BlockMask)


def _all_partial(bm: BlockMask) -> BlockMask:
    """A BlockMask listing, per row, every tile that is partial OR full in `bm`, all as partial."""
    dense = bm.to_dense().bool()                                                   # [1, 1, rows, tiles]
    num = dense.sum(-1, dtype=torch.int32)
    order = dense.to(torch.uint8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)   # listed first, ascending
    return BlockMask.from_kv_blocks(num, order, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod,
                                    seq_lengths=bm.seq_lengths, compute_q_blocks=False)


def causal_block_mask(capacity: int, device) -> BlockMask:
    """Target attention over a static cache of `capacity` positions: row r lists the key tiles 0..r.
    O(capacity^2) mask evaluations, once per Engine."""
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return _all_partial(create_block_mask(causal, None, None, capacity, capacity, device=device, BLOCK_SIZE=TILE))


def _by_row(bm: BlockMask, rows, mask_mod, seq_lengths) -> BlockMask:
    """A BlockMask with a batch dimension from the one-sequence `bm`: batch row b's query tile j lists what row
    rows[b, j] of `bm` lists (rows [B, query tiles])."""
    num, idx = bm.kv_num_blocks[0, 0][rows], bm.kv_indices[0, 0][rows]           # [B,Qt], [B,Qt,KVt]
    return BlockMask.from_kv_blocks(num[:, None], idx[:, None], BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths, compute_q_blocks=False)


def causal_rows(bm: BlockMask, pos) -> BlockMask:
    """The mask of one cached target call from `causal_block_mask`: queries at the contiguous positions pos [T]
    over the whole cache; a query at p sees the keys <= p (DenseMasks.target's rule). pos [B,T]: a batch, each row
    at its own positions."""
    if pos.dim() == 2 and pos.shape[0] > 1:
        T = pos.shape[1]
        last = torch.clamp(torch.arange(0, T, TILE, device=pos.device) + TILE - 1, max=T - 1)

        def causal_in_row(b, h, q_idx, kv_idx):     # (reads pos itself: inductor's CPU kernel takes only inputs)
            return kv_idx <= q_idx + pos[b, 0]
        return _by_row(bm, pos[:, last] // TILE, causal_in_row, (T, bm.seq_lengths[1]))
    pos = pos.reshape(-1)
    T = pos.shape[0]
    last = torch.clamp(torch.arange(0, T, TILE, device=pos.device) + TILE - 1, max=T - 1)
    step = bm[:, :, pos[last] // TILE]                   # per local query tile: the row of its last query
    start = pos[0]

    def causal_from(b, h, q_idx, kv_idx):              # q_idx counts from the call's first query
        return kv_idx <= q_idx + start
    step.mask_mod = causal_from
    step.seq_lengths = (T, bm.seq_lengths[1])
    return step


def draft_block_mask(capacity: int, block: int, window: int | None, device) -> BlockMask:
    """The drafter's attention over [cache (capacity) ; block (block tokens)]. The mask depends on the block's
    start only, not on the query, so rows are indexed by start: row r lists the tiles that a block starting
    anywhere in r*TILE .. r*TILE + TILE-1 may see. Built once per Engine."""
    def by_start(b, h, q_idx, kv_idx):                 # q_idx plays the block's start position here
        return draft_visible(capacity, window, q_idx, 0, kv_idx)      # the widest kind: every other is a subset
    return _all_partial(create_block_mask(by_start, None, None, capacity, capacity + block, device=device, BLOCK_SIZE=TILE))


def draft_rows(bm: BlockMask, start, n_query: int, window: int | None, causal: bool = False,
               sliding: int | None = None) -> BlockMask:
    """The mask of one draft step from `draft_block_mask`: n_query block tokens starting at start (0-d tensor),
    for the drafter layers of one attention kind (causal, sliding): their keys are a subset of the row's."""
    capacity = bm.seq_lengths[0]
    if n_query != bm.seq_lengths[1] - capacity or n_query > TILE:
        raise ValueError(f"a draft block of {n_query} tokens, but the mask was built for {bm.seq_lengths[1] - capacity} "
                         f"(and at most one FlexAttention tile, {TILE})")
    if start.numel() > 1:                              # a batch [B]: row b's block starts at start[b]
        def draft_in_row(b, h, q_idx, kv_idx):
            return draft_visible(capacity, window, start[b], q_idx, kv_idx, causal, sliding)
        return _by_row(bm, (start // TILE)[:, None], draft_in_row, (n_query, capacity + n_query))
    start = start.reshape(())
    step = bm[:, :, (start // TILE).view(1)]

    def draft(b, h, q_idx, kv_idx):
        return draft_visible(capacity, window, start, q_idx, kv_idx, causal, sliding)
    step.mask_mod = draft
    step.seq_lengths = (n_query, capacity + n_query)
    return step


class FlexMasks:
    """model.DenseMasks' interface with FlexAttention block masks, built once for a cache of `capacity`
    positions, draft blocks of `block` tokens and a draft window (None = all context)."""

    def __init__(self, capacity: int, block: int, window: int | None, device):
        self.capacity, self.window, self.device = capacity, window, device
        self.causal = causal_block_mask(capacity, device)
        self.drafts = {}                                   # per draft block length n: its mask
        if block > 1:                                      # (AR: no drafts)
            self.prepare(block)

    def prepare(self, n: int) -> None:
        """Build the draft mask of blocks of n tokens, if not yet built (eager: never inside a compiled step)."""
        if n > 1 and n not in self.drafts:
            self.drafts[n] = draft_block_mask(self.capacity, n, self.window, self.device)

    def target(self, pos) -> BlockMask:
        return causal_rows(self.causal, pos)

    def draft_slots(self, start):
        """None: a draft reads the whole cache (the block mask skips the key tiles it cannot see)."""
        return None

    def draft(self, start, n: int, causal: bool = False, sliding: int | None = None) -> BlockMask:
        """Draft blocks of n tokens starting at start (one sequence: a 0-d or 1-element tensor; a batch: [B])."""
        if n not in self.drafts:
            raise ValueError(f"no FlexAttention mask for draft blocks of {n} tokens: call prepare({n}) first")
        return draft_rows(self.drafts[n], start, n, self.window, causal, sliding)
