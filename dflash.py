"""DFlash speculative decoding on a hybrid Qwen3.5 target, one request, greedy: the method on one page.

`generate` is the reference loop, eager and read top to bottom; it is the spec, as a naive kernel is. The tests
hold it to plain greedy decoding written without a cache, and the engine that users run (engine.py: many requests
at once, compiled steps, adaptive speculation, other proposers) to it, token for token (tests/test_reference.py).
Each step names its section in docs/method.md:

    prefill   the prompt through the target; its first token, and the features of the target layers the drafter
              reads (its context) (#one-round)
    draft     the block [last, MASK x (B-1)] through the drafter in ONE pass -> B-1 proposals (#the-drafter)
    verify    the target over [last, proposals] in ONE pass: its own token after every block position; GDN
              layers keep each token's state write (#one-round)
    accept    the leading proposals equal to the target's tokens, then the target's next token (the bonus)
    commit    each GDN layer's state and conv window rolled back to the accepted prefix (#rollback-on-a-hybrid-
              target); attention needs no rollback (slots past the prefix are masked, then overwritten)
    feed      the accepted positions' features into the drafter's context

Symbols: B the block size (the verify width), a the accepted proposals (0 .. B-1), `last` the last committed
token, `start` its position. The shared checks of a request (check_inputs, cut) live here too.
"""
from __future__ import annotations

import torch

from model import DenseMasks, DFlashDrafter, DraftCache, GenerationError, Qwen35, TargetCache


def generate(target: Qwen35, drafter: DFlashDrafter, prompt_ids: list, max_new_tokens: int,
             block_size: int | None = None, stop_ids=()) -> list:
    """Greedy DFlash for one request -> the generated ids (at most max_new_tokens, ending at the first stop id):
    plain greedy decoding's ids. target, drafter: as checkpoint.load_target / load_drafter return them; block_size
    None: the drafter's own."""
    B = block_size or drafter.cfg.block_size
    capacity = check_inputs(target, prompt_ids, max_new_tokens, B, None, drafter.cfg.block_size)
    dev, dtype = target.embed_tokens.weight.device, target.dtype
    cache = TargetCache(target.cfg, capacity, dtype, dev, max_block=B)       # the target's KV and GDN states
    context = DraftCache(drafter.cfg, capacity, drafter.dtype, dev)   # the drafter's context K/V
    masks, layers, stops = DenseMasks(capacity), tuple(drafter.cfg.target_layer_ids), set(stop_ids)
    with torch.inference_mode():
        # PREFILL (#one-round): the first token, and the drafter's context from the prompt's features
        pos = torch.arange(len(prompt_ids), device=dev)
        logits, feats = target(torch.tensor([prompt_ids], device=dev), pos, cache, feature_layers=layers)
        out = [int(logits[0, -1].argmax())]
        drafter.append_context(feats, pos, context)
        start = len(prompt_ids)                                 # the position of out[-1], the last committed token
        while out[-1] not in stops and len(out) < max_new_tokens:
            last = torch.tensor([out[-1]], device=dev)
            # DRAFT (#the-drafter): B-1 proposals for positions start+1 .. start+B-1
            proposals = last[:0]
            if B > 1:
                hidden = drafter.draft_block(last, torch.tensor([start], device=dev), B - 1, target.embed_tokens,
                                             context, masks)
                proposals, _ = drafter.propose(hidden[0], last, target.lm_head)
            # VERIFY (#one-round): the target's own token after each of the B block positions, in one pass
            pos = start + torch.arange(B, device=dev)
            logits, feats = target(torch.cat([last, proposals])[None], pos, cache, verify=True,
                                   feature_layers=layers)
            choice, drafts = logits[0].argmax(-1).tolist(), proposals.tolist()
            # ACCEPT: proposals up to the first the target disagrees with, then the target's token there (the bonus)
            a = 0
            while a < B - 1 and drafts[a] == choice[a]:
                a += 1
            # COMMIT (#rollback-on-a-hybrid-target): GDN states as if the block had been [last, drafts[:a]]
            cache.commit(a + 1)
            # FEED: the features of positions start .. start+a (those after the bonus come with the next verify)
            drafter.append_context(feats[:, :a + 1], pos[:a + 1], context)
            out += cut(drafts[:a] + [choice[a]], stops, max_new_tokens - len(out))
            start += a + 1
    return out


# ---- The checks a request passes (the engine's too) ---------------------------------------------

def cut(tokens: list, stops, room: int) -> list:
    """Tokens a step produced -> those it commits: at most `room` (what max_new_tokens leaves), and none after the
    first stop token."""
    tokens = tokens[:room]
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


def check_block_size(block_size: int, most: int | None = None) -> None:
    """most: the drafter's own block size (None: no drafter), which a block may not exceed."""
    if block_size < 1:
        raise GenerationError(f"block size must be >= 1, got {block_size}")
    if most is not None and block_size > most:
        raise GenerationError(f"block size {block_size} exceeds the drafter's block_size {most}; "
                              f"use --block-size {most} or less")


MIN_CAPACITY = 256


def default_capacity(need: int, most: int) -> int:
    """The cache length when none is asked for: `need` rounded up to a power of two, at least MIN_CAPACITY and
    at most `most` (what max_position_embeddings allows), but never below `need`. Every step's shapes follow
    the capacity, so with --compile nearby prompt lengths share one set of compiled steps."""
    return max(need, min(max(MIN_CAPACITY, 1 << (need - 1).bit_length()), most))


def check_inputs(target: Qwen35, prompt_ids: list, max_new_tokens: int, block_size: int, capacity: int | None,
                 most: int | None = None, round_up: bool = False) -> int:
    """Validate a request; return the cache capacity to allocate: `capacity`, or when None what the request
    needs, rounded up by default_capacity with round_up (compiled steps: their shapes follow the capacity).
    most: the drafter's own block size (None: no drafter)."""
    V = target.cfg.vocab_size
    if not prompt_ids:
        raise GenerationError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < V]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{V - 1}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if capacity is not None and capacity < 1:
        raise GenerationError(f"--cache-len must be >= 1, got {capacity}")
    check_block_size(block_size, most)
    # The last verify block starts at most at position len(prompt) + max_new_tokens - 2 and spans block_size.
    need = len(prompt_ids) + max_new_tokens + block_size - 1
    if capacity is None:
        capacity = default_capacity(need, target.cfg.max_position_embeddings + block_size - 1) if round_up else need
    if need > capacity:
        raise GenerationError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + block slack ({block_size - 1}) "
                              f"= {need} exceeds the cache length {capacity}; raise --cache-len or shorten the request")
    if len(prompt_ids) + max_new_tokens > target.cfg.max_position_embeddings:
        raise GenerationError(f"prompt + max_new_tokens = {len(prompt_ids) + max_new_tokens} exceeds the model's "
                              f"max_position_embeddings {target.cfg.max_position_embeddings}; shorten the request")
    return capacity

