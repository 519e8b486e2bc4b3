"""FlexAttention block masks for the cached steps: an optional attention backend, selected by `--attention flex`
(generate.py, bench.py), which passes `FlexMasks` to dflash.Engine in place of model.DenseMasks. Deleting this
file and that flag leaves a working project on SDPA, the default.

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


def causal_rows(bm: BlockMask, pos) -> BlockMask:
    """The mask of one cached target call from `causal_block_mask`: queries at the contiguous positions pos [T]
    over the whole cache; a query at p sees the keys <= p (DenseMasks.target's rule)."""
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
        self.capacity, self.window = capacity, window
        self.causal = causal_block_mask(capacity, device)
        self.drafts = draft_block_mask(capacity, block, window, device) if block > 1 else None   # AR: no drafts

    def target(self, pos) -> BlockMask:
        return causal_rows(self.causal, pos)

    def draft_slots(self, start):
        """None: a draft reads the whole cache (the block mask skips the key tiles it cannot see)."""
        return None

    def draft(self, start, n: int, causal: bool = False, sliding: int | None = None) -> BlockMask:
        if start.numel() != 1:
            raise ValueError("FlexAttention masks serve one sequence; a batch of requests uses DenseMasks")
        return draft_rows(self.drafts, start.reshape(()), n, self.window, causal, sliding)
