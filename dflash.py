"""The DFlash draft-verify loop (greedy, exactly lossless) and plain autoregressive decoding through the
same caches, which is the baseline it must equal token for token.

One round (notes 2), with `start` = position of the last committed token `last`:
    draft    the drafter reads the target features of the tokens committed since its last call, then
             proposes block_size - 1 tokens for the block [last, MASK, ...] at positions start .. start+B-1
    verify   the target runs [last, proposals] at those positions (GDN in recurrent mode, every state kept)
    accept   posterior = argmax(logits); accepted = leading proposals equal to posterior[:-1];
             bonus = posterior[accepted]; committed = proposals[:accepted] + [bonus], cut at a stop token
             or at max_new_tokens
    commit   TargetCache.commit(len(committed)): the GDN states become those after the last token whose
             input was committed (exact rollback); stale attention K/V are masked and later overwritten
    features the verify pass's features at the committed positions feed the next draft

A proposer is anything with `max_block_size`, `feature_layers` (target layers whose outputs it reads),
`reset(capacity)` and `propose(last, start, feats, feat_pos, n)`; the real one
wraps the DFlash drafter, and tests use stand-ins that offer known continuations with corruptions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from model import DFlashDrafter, DraftCache, Qwen35, TargetCache


class GenerationError(ValueError):
    """Bad generation input; the message names the problem and the fix."""


@dataclass
class Step:
    """One event of a generation, in order. kind: "prefill" (commits the first token), "verify" (one
    draft-verify round) or "decode" (one AR step)."""
    kind: str
    start: int                                  # position of the last committed token before this step
    tokens: list                                # tokens committed by this step
    draft_ids: list = field(default_factory=list)   # proposals offered (verify only)
    accepted: int = 0                           # leading proposals the target agreed with (verify only)
    stop: bool = False                          # generation ends after this step
    draft_seconds: float = 0.0                  # wall time of the draft forward (verify steps)
    verify_seconds: float = 0.0                 # wall time of the target forward + accept + commit


@dataclass
class Result:
    prompt_ids: list
    output_ids: list                            # generated ids, the first (from prefill) included
    acceptance_lengths: list                    # tokens committed per verify step, bonus included
    draft_ids: list                             # each verify step's proposals
    steps: list
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0                 # everything after the first token

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def histogram(self, block_size: int) -> list:
        """counts[k-1] = verify steps that committed k tokens, k = 1..block_size."""
        counts = [0] * block_size
        for a in self.acceptance_lengths:
            counts[a - 1] += 1
        return counts


class DrafterProposer:
    """The real proposer: the DFlash drafter with its context cache, sharing the target's embedding and lm_head."""

    def __init__(self, drafter: DFlashDrafter, target: Qwen35):
        self.drafter, self.target = drafter, target
        self.cache = None

    @property
    def max_block_size(self) -> int:
        return self.drafter.cfg.block_size

    @property
    def feature_layers(self) -> tuple:
        return tuple(self.drafter.cfg.target_layer_ids)

    def reset(self, capacity: int) -> None:
        w = self.drafter.fc.weight
        self.cache = DraftCache(self.drafter.cfg, capacity, w.dtype, w.device)

    def propose(self, last: torch.Tensor, start: int, feats: torch.Tensor, feat_pos: torch.Tensor, n: int) -> torch.Tensor:
        """last [1] token at `start`; feats [1,Tc,F] target features at feat_pos [Tc] (the positions just before
        start not seen yet) -> [n] greedy proposals for positions start+1 .. start+n."""
        cfg = self.drafter.cfg
        block = torch.full((1, n + 1), cfg.mask_token_id, dtype=torch.long, device=last.device)
        block[0, 0] = last
        emb = self.target.embed_tokens(block)
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        pos = torch.arange(start, start + n + 1, device=last.device)
        hidden = self.drafter(emb, feats, pos, feat_pos, self.cache)
        return self.drafter.draft_logits(hidden[0, 1:], self.target.lm_head).argmax(-1)


def check_inputs(target: Qwen35, prompt_ids: list, max_new_tokens: int, block_size: int, capacity: int | None,
                 proposer=None) -> int:
    """Validate a request; return the cache capacity to allocate."""
    V = target.cfg.vocab_size
    if not prompt_ids:
        raise GenerationError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < V]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{V - 1}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if block_size < 1:
        raise GenerationError(f"block size must be >= 1, got {block_size}")
    if proposer is not None and block_size > proposer.max_block_size:
        raise GenerationError(f"block size {block_size} exceeds the drafter's block_size {proposer.max_block_size}; use --block-size {proposer.max_block_size} or less")
    # The last verify block starts at most at position len(prompt) + max_new_tokens - 2 and spans block_size.
    need = len(prompt_ids) + max_new_tokens + block_size - 1
    if capacity is None:
        capacity = need
    if need > capacity:
        raise GenerationError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + block slack ({block_size - 1}) "
                              f"= {need} exceeds the cache length {capacity}; raise --cache-len or shorten the request")
    if len(prompt_ids) + max_new_tokens > target.cfg.max_position_embeddings:
        raise GenerationError(f"prompt + max_new_tokens = {len(prompt_ids) + max_new_tokens} exceeds the model's "
                              f"max_position_embeddings {target.cfg.max_position_embeddings}; shorten the request")
    return capacity


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _clock(device, profile: bool) -> float:
    """Wall clock for per-step timings; on CUDA it syncs only when profiling (a sync per step costs speed)."""
    if profile:
        _sync(device)
    return time.perf_counter()


@torch.inference_mode()
def generate(target: Qwen35, prompt_ids: list, max_new_tokens: int, stop_ids=(), proposer=None,
             block_size: int = 16, capacity: int | None = None, profile: bool = False,
             verify_gdn: str = "block") -> Iterator[Step]:
    """Greedy generation as a stream of Steps. proposer None = plain AR decoding ("decode" steps).
    profile: synchronise the device around each phase so Step's timings are exact (CUDA).
    verify_gdn: "block" (closed-form per-token states, fast) or "recurrent" (token by token, the reference)."""
    if proposer is None:
        block_size = 1
    capacity = check_inputs(target, prompt_ids, max_new_tokens, block_size, capacity, proposer)
    device = target.embed_tokens.weight.device
    dtype = target.embed_tokens.weight.dtype
    stops = set(stop_ids)
    cache = TargetCache(target.cfg, capacity, dtype, device, max_block=block_size)
    use_draft = proposer is not None          # block_size 1 with a drafter: verify steps without proposals
    if use_draft:
        proposer.reset(capacity)
    feature_layers = tuple(proposer.feature_layers) if use_draft else ()

    # Prefill: the whole prompt, GDN chunked from a zero state; the first token is the argmax of the last logits.
    T0 = len(prompt_ids)
    ids = torch.tensor([prompt_ids], device=device)
    pos = torch.arange(T0, device=device)
    logits, feats = target(ids, pos, cache, "chunked", feature_layers if use_draft else (), last_logits_only=True)
    last = logits[0, -1].argmax()
    first = int(last)
    n_out = 1
    stop = first in stops or n_out >= max_new_tokens
    yield Step("prefill", T0 - 1, [first], stop=stop)
    feat_pos = pos
    start = T0                                                  # position of `last`

    while not stop:
        remaining = max_new_tokens - n_out
        t0 = _clock(device, profile)
        if use_draft and block_size > 1:
            proposals = proposer.propose(last.view(1), start, feats, feat_pos, block_size - 1).to(device)   # [B-1]
        else:
            proposals = torch.zeros(0, dtype=torch.long, device=device)
        t1 = _clock(device, profile)
        block = torch.cat([last.view(1), proposals])[None]                                        # [1,B]
        bpos = torch.arange(start, start + block.shape[1], device=device)
        logits, vfeats = target(block, bpos, cache, verify_gdn, feature_layers if use_draft else ())
        posterior = logits[0].argmax(-1)                                                          # [B]
        accepted = int((proposals == posterior[:-1]).int().cumprod(0).sum())       # the one host sync per round
        new = proposals[:accepted].tolist() + [int(posterior[accepted])]
        new = new[:remaining]
        for i, t in enumerate(new):
            if t in stops:
                new = new[:i + 1]
                break
        n = len(new)
        # The inputs of block[0 .. n-1] are committed; the last committed token is new[-1], not yet processed.
        cache.commit(n)
        n_out += n
        stop = new[-1] in stops or n_out >= max_new_tokens
        t2 = _clock(device, profile)
        if use_draft:
            yield Step("verify", start, new, proposals.tolist(), accepted, stop, t1 - t0, t2 - t1)
            # All B rows go to the drafter (static shape): rows >= n are rejected tokens' features at
            # positions >= the next start, hidden from the next block and overwritten by the next append.
            feats, feat_pos = vfeats, bpos
        else:
            yield Step("decode", start, new, stop=stop, verify_seconds=t2 - t1)
        start += n
        last = torch.tensor(new[-1], device=device)


def run(target: Qwen35, prompt_ids: list, max_new_tokens: int, stop_ids=(), proposer=None, block_size: int = 16,
        capacity: int | None = None, on_step=None, profile: bool = False, verify_gdn: str = "block") -> Result:
    """Run `generate` to the end and collect ids, acceptance statistics and timings."""
    device = target.embed_tokens.weight.device
    res = Result(list(prompt_ids), [], [], [], [])
    _sync(device)
    t0 = time.perf_counter()
    t_first = None
    for step in generate(target, prompt_ids, max_new_tokens, stop_ids, proposer, block_size, capacity, profile, verify_gdn):
        if step.kind == "prefill":
            _sync(device)
            t_first = time.perf_counter()
            res.prefill_seconds = t_first - t0
        elif step.kind == "verify":
            res.acceptance_lengths.append(len(step.tokens))
            res.draft_ids.append(step.draft_ids)
        res.output_ids += step.tokens
        res.steps.append(step)
        if on_step is not None:
            on_step(step)
    _sync(device)
    res.decode_seconds = time.perf_counter() - t_first
    return res
