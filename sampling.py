"""How tokens are drawn when sampling, and how sampled rounds accept proposals (docs/method.md#sampling).

    Sampling           the settings: temperature (0 = greedy), top-p, top-k, and the rule for sampled drafts
    sampling_probs     logits -> the distribution tokens are drawn from
    draw               one token per row by the exponential race, argmax(p / E), with E the position's noise (noise.py)
    matched            the coupled rule: leading proposals equal to the target's own tokens (argmax or draws)
    speculative_accept the ratio rule, min(1, p/q), for a drafter that samples its block (--draft-rule ratio)

Every random number comes from noise.py, keyed by the seed and the position it serves, so none of these functions
holds state: the verify step (dflash.Engine._verify) and a plain step (Engine.pick) draw the same token at the same
position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model import GenerationError

DRAFT_RULES = ("coupled", "ratio")    # how a sampled draft is verified (docs/method.md#sampled-drafts-coupled-or-ratio)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (the exact path). Otherwise tokens are drawn from the target's distribution at
    `temperature`, restricted to the top_k most likely tokens (0 = all) and to the smallest set whose
    probability reaches top_p (1 = all), with the noise of their positions (noise.py).
    draft_rule: how a drafter that samples its own block (DFlash2) is verified. "coupled": the draft races with
    the target's noise and a proposal stands iff it equals the target's draw (the output is AR's for the seed);
    "ratio": the draft has noise of its own and min(1, p/q) decides (more accepted, the output is distributed as
    AR's but is not AR's text, and depends on the step pattern). A drafter that drafts greedily (DFlash, MTP) is
    always verified by the coupled rule, where both rules accept with probability p(x)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    draft_rule: str = "coupled"     # a sampled draft (DFlash2): "coupled" (output == AR's for the seed) or "ratio"

    def __post_init__(self):
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")
        if self.draft_rule not in DRAFT_RULES:
            raise GenerationError(f"draft rule must be one of {', '.join(DRAFT_RULES)}, got {self.draft_rule!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are drawn from, float32 [..., V] (temperature, top-k, top-p)."""
    x = logits.float() / s.temperature
    V = x.shape[-1]
    if 0 < s.top_k < V:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.top_p < 1:
        ps, order = p.sort(dim=-1, descending=True)
        drop = (ps.cumsum(-1) - ps) >= s.top_p          # keep up to and including the token that reaches top_p
        ps = ps.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, ps)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(probs: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [..., V] given Exp(1) noise of the same shape: argmax(p / E) is distributed
    as Categorical(p / sum(p)) (the exponential race; gpt-fast's sync-free sampling). Zero-probability tokens
    can never win."""
    return (probs / expo.clamp_min(1e-30)).argmax(-1)


def matched(proposals: torch.Tensor, posterior: torch.Tensor) -> torch.Tensor:
    """proposals [B-1]; posterior [B] the target's tokens at the block's rows (its argmax, or its draws with the
    positions' noise) -> accepted []: how many leading proposals equal the target's token at their row. With
    draws this is the coupled rule: the committed tokens are the target's own draws, so a proposal is accepted
    with probability p(x), as under min(1, p/q) with a one-hot q, and the output is plain decoding's."""
    return (proposals == posterior[:-1]).int().cumprod(0).sum()


def speculative_accept(probs: torch.Tensor, proposals: torch.Tensor, u: torch.Tensor, expo: torch.Tensor, q=None):
    """Speculative rejection sampling for a verify block, on the device, no host sync.

    probs [B, V] target distributions at block positions 0..B-1 (row i judges proposals[i]);
    proposals [B-1], drawn from the draft distributions q [B-1, V] (None: a greedy draft, q one-hot at the
    proposal); u [B-1] uniform(0,1) draws; expo [B, V] Exp(1) noise -> (accepted [], tokens [B]): the committed
    tokens are proposals[:accepted] + [tokens[accepted]]. A batch of blocks (batching.py) adds a leading
    dimension N to every argument and result: probs [N, B, V] -> (accepted [N], tokens [N, B]).

    Proposal x is accepted with probability min(1, p(x) / q(x)); on rejection the token comes from
    normalize(max(p - q, 0)); after a full acceptance the bonus comes from p at the last row. The output is
    distributed exactly as the target's. With a one-hot q the acceptance is p(x) and the residual is p with x
    removed: a greedy drafter needs no probabilities of its own. `u q(x) < p(x)` is strict, so a
    zero-probability proposal is never accepted, even when u is exactly 0."""
    head = probs[..., :-1, :]                                                    # the rows that judge proposals
    if q is None:
        q = torch.zeros_like(head).scatter(-1, proposals[..., None], 1.0)
    p_prop = head.gather(-1, proposals[..., None]).squeeze(-1)                   # [B-1]
    q_prop = q.gather(-1, proposals[..., None]).squeeze(-1)
    accepted = (u * q_prop < p_prop).int().cumprod(-1).sum(-1)
    resid = torch.cat([(head - q).clamp_min(0.0), probs[..., -1:, :]], -2)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, probs)          # p == q: never rejected
    return accepted, draw(resid, expo)
