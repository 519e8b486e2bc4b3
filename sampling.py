"""How tokens are drawn when sampling, and how sampled rounds accept proposals (docs/method.md#sampling).

    Sampling           one request's settings: temperature (0 = greedy), top-p, top-k, the rule for sampled drafts
    row_probs          logits [N,T,V] -> the distributions tokens are drawn from, each row by its own settings
    choose             the token at each position: a greedy row's argmax, a sampled row's draw with its noise
    draw               one token per row by the exponential race, argmax(p / E), with E the position's noise (noise.py)
    speculative_accept the ratio rule, min(1, p/q), for a drafter that samples its block (--draft-rule ratio)
    sampling_probs     row_probs for one request's settings (check.py)

The coupled rule needs no function of its own: the accepted proposals are the leading ones equal to the target's
tokens (choose) at their rows, which commits plain decoding's own text for the seed.

Every random number comes from noise.py, keyed by the seed and the position it serves, so none of these functions
holds state: the verify step (engine.Engine._verify) and a plain step (Engine._decode) draw the same token at the
same position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import noise
from model import GenerationError

DRAFT_RULES = ("coupled", "ratio")    # how a sampled draft is verified (docs/method.md#sampled-drafts-coupled-or-ratio)
MIN_TEMPERATURE = 1e-30               # the smallest sampling temperature: logits / it stay finite in float32


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
        # The settings become float32 / int64 tensors: a value those cannot hold is refused here, not met as an
        # overflow (a traceback) or a silent 0 (an empty nucleus, or logits / temperature overflowing to inf).
        f32 = torch.finfo(torch.float32)
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if not self.temperature <= f32.max:
            raise GenerationError(f"temperature must be finite and at most {f32.max:.4g} (float32's largest), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise GenerationError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (logits / a smaller one "
                                  f"overflow float32), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < f32.tiny:
            raise GenerationError(f"top_p must be > 0 in float32, got {self.top_p}, which is below float32's smallest normal "
                                  f"number {f32.tiny:.3g}; use a value >= 1e-30 (the most likely token alone)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise GenerationError(f"top_k must be an integer, got {self.top_k!r}")
        if not 0 <= self.top_k <= torch.iinfo(torch.int64).max:
            raise GenerationError(f"top_k must be >= 0 (0 = no limit) and below 2^63, got {self.top_k}")
        if self.draft_rule not in DRAFT_RULES:
            raise GenerationError(f"draft rule must be one of {', '.join(DRAFT_RULES)}, got {self.draft_rule!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_probs(logits, temperature, top_p, top_k, cuts=(True, True)):
    """logits [N,T,V] -> the distributions tokens are drawn from, float32 [N,T,V], each row N by its own request's
    settings: temperature [N] (> 0), top_p [N] float32 (1: no cut), top_k [N] long (0: no cut). cuts: whether any
    row cuts by top-k, and by top-p (False skips that cut's sort of the vocabulary, a tenth of a sampled step on
    a CPU)."""
    x = logits.float() / temperature.view(-1, 1, 1)
    V = x.shape[-1]
    if cuts[0]:
        k = torch.where((top_k > 0) & (top_k < V), top_k, V).view(-1, 1, 1).expand(*x.shape[:-1], 1)
        kth = x.sort(-1, descending=True).values.gather(-1, k - 1)           # the k-th largest (k = V: no cut)
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if not cuts[1]:
        return p
    ps, order = p.sort(dim=-1, descending=True, stable=True)
    drop = (ps.cumsum(-1) - ps) >= top_p.view(-1, 1, 1)       # keep up to and including the token that reaches top_p
    nucleus = torch.zeros_like(p).scatter(-1, order, ps.masked_fill(drop, 0.0))
    nucleus = nucleus / nucleus.sum(-1, keepdim=True)
    return torch.where((top_p < 1).view(-1, 1, 1), nucleus, p)


def sampling_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """row_probs for one request's settings: logits [..., V] -> float32 [..., V] (check.py's judge reads it)."""
    shape, dev = logits.shape, logits.device
    p = row_probs(logits.reshape(1, -1, shape[-1]), torch.tensor([s.temperature], device=dev),
                  torch.tensor([s.top_p], dtype=torch.float32, device=dev), torch.tensor([s.top_k], device=dev),
                  (s.top_k > 0, s.top_p < 1))
    return p.reshape(shape)


def choose(logits, at, keys, vocab, temperature, top_p, top_k, cuts=(True, True), with_draw=False):
    """The tokens that fill positions at [N,T] from logits [N,T,V]: a greedy row's argmax (temperature 0), a sampled
    row's draw at its settings with the noise of its seed's key (keys [N]) at those positions (noise.py; vocab:
    noise.vocab_keys(V)) -> [N,T].
    The same position of the same seed draws the same token whatever step fills it (a plain step, a round's
    verify row, a prefill). cuts: as row_probs. with_draw: also return what the draw read, (tokens, probs [N,T,V],
    noise [N,T,V]) (the ratio rule reads them)."""
    greedy = temperature == 0
    probs = row_probs(logits, torch.where(greedy, 1.0, temperature), top_p, top_k, cuts)
    expo = noise.vocab_noise(keys[:, None], at, vocab)
    tokens = torch.where(greedy[:, None], logits.argmax(-1), draw(probs, expo))
    return (tokens, probs, expo) if with_draw else tokens


def draw(probs: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [..., V] given Exp(1) noise of the same shape: argmax(p / E) is distributed
    as Categorical(p / sum(p)) (the exponential race; gpt-fast's sync-free sampling). Zero-probability tokens
    can never win."""
    return (probs / expo.clamp_min(1e-30)).argmax(-1)


def speculative_accept(probs: torch.Tensor, proposals: torch.Tensor, u: torch.Tensor, expo: torch.Tensor, q=None):
    """Speculative rejection sampling for a verify block, on the device, no host sync.

    probs [B, V] target distributions at block positions 0..B-1 (row i judges proposals[i]);
    proposals [B-1], drawn from the draft distributions q [B-1, V] (None: a greedy draft, q one-hot at the
    proposal); u [B-1] uniform(0,1) draws; expo [B, V] Exp(1) noise -> (accepted [], tokens [B]): the committed
    tokens are proposals[:accepted] + [tokens[accepted]]. A batch of blocks (engine.Engine) adds a leading
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
