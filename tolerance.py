"""The noise check.py's verdicts allow: how far a correct engine's logits may sit from ours, measured, never assumed
(docs/method.md#the-noise-a-correct-engine-shows).

Two correct engines take different tokens only where their roundings move the margin between two tokens across
zero, so a departure from our choice is a tie-break when our margin there is within what rounding moves margins
by, and a divergence when it is past it. What rounding moves margins by is measured, in one of two ways:

    reference   (the engine returns token ids only) our own target evaluated as engines evaluate it, in the
                engine's dtype: one causal forward (chunked prefill), verify blocks of 16, decode one token at a
                time alone (batch 1) and among other sequences (batch 8), each against our oracle's logits. The
                tolerance is FACTOR times the largest move seen (reference_noise).
    logprobs    (the engine returns its top log-probabilities: llama.cpp's n_probs, the logprobs of vLLM's and
                SGLang's APIs) the engine's own discrepancy from our logits at every position where it reports
                them, a direct measurement of its noise: the reference tolerance scaled by the ratio of its
                median discrepancy to our median move (engine_noise; robust to a fault that corrupts fewer than
                half of the positions), capped (NOISIER) where it is far noisier than a correct engine. Where its
                discrepancy at a position is past the tolerance, no departure there is a tie-break.

Moves are measured as in the judgement: at each position, the change of every top-TOP token's logit difference to
the top one (`moves`), in rounding steps of the engine's dtype at the top logit (rounding is relative to a logit's
size), so that one number describes a run. `--tolerance T` replaces both by T logits.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

import model as M

FACTOR = 2.0          # the tolerance over the largest move of our own evaluations (docs/method.md)
TOP = 8               # the tokens per position whose logit differences to the top one are compared
P_QUANTILE = 0.99     # a high quantile of moves and discrepancies, reported beside the median and the largest
# How much noisier than our own evaluations (the ratio of medians) an engine's logits may be and still be
# taken for a correct engine of its dtype: float32 engines sum in other orders and use other formulas for the same
# functions (a float32 llama.cpp flips near-ties 40x further than our own float32 evaluations move); a 16-bit
# engine's noise is its rounding, which no formula difference of a correct engine comes near.
NOISIER = {torch.float64: 64.0, torch.float32: 64.0, torch.bfloat16: 4.0, torch.float16: 4.0}
POSITIONS = 256       # output positions the reference noise is measured on (the first sequences of a run)
BLOCK = 16            # the verify width of the reference's verify evaluation
BATCH = 8             # the rows of the reference's batched decode
DECODE_SHARE = 4      # the decode evaluations (a forward per token) run on the first 1/DECODE_SHARE of the positions


def rounding_step(z: float, dtype) -> float:
    """The spacing of `dtype` numbers at magnitude |z|: eps * 2^floor(log2 |z|). bfloat16 keeps 8 significant
    bits, so a step is 2^-7 of |z| at a power of two and about 2^-8 of |z| just below the next one."""
    z = abs(z)
    if z < torch.finfo(dtype).tiny:
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(z))


def steps_of(top: torch.Tensor, dtype) -> torch.Tensor:
    """rounding_step at each of top [n] -> [n] float64."""
    return torch.tensor([rounding_step(float(v), dtype) for v in top], dtype=torch.float64)


def moves(z: torch.Tensor, ref: torch.Tensor, k: int = TOP) -> torch.Tensor:
    """How far logits z [n, V] sit from ref [n, V] where it matters for a choice: at each row, the largest change
    of a top-k token's logit difference to the top token (both of ref's ranking) -> [n] logits."""
    top = ref.topk(min(k, ref.shape[-1]), dim=-1).indices
    a, b = z.gather(1, top).double(), ref.gather(1, top).double()
    return ((a - a[:, :1]) - (b - b[:, :1])).abs().max(-1).values


@dataclass
class Noise:
    """The noise a run is judged with: `steps` rounding steps of `dtype` at each position's top logit (or `fixed`
    logits, --tolerance), from `basis` ("reference", "logprobs" or "fixed"); `detail` holds what was measured."""
    basis: str
    dtype: torch.dtype
    steps: float = 0.0
    fixed: float | None = None
    detail: dict = field(default_factory=dict)

    def tol(self, top_logit: float) -> float:
        """The tolerance in logits at a position whose top logit is top_logit."""
        return self.fixed if self.fixed is not None else self.steps * rounding_step(top_logit, self.dtype)

    def describe(self) -> str:
        name = str(self.dtype).replace("torch.", "")
        if self.fixed is not None:
            return f"{self.fixed:g} logits (--tolerance)"
        d = self.detail
        if self.basis == "logprobs":
            used = min(max(d["ratio"], 1.0), NOISIER[self.dtype])
            return (f"{self.steps:.3g} {name} steps at the top logit = our own evaluations' {d['reference_steps']:.3g} x "
                    f"{used:.3g}: the engine's own logprobs depart from our logits {d['ratio']:.3g}x as far as our own "
                    f"evaluations move (medians, {d['positions']} positions)"
                    + (f"; CAPPED at {NOISIER[self.dtype]:g}x: its logits are farther from ours than a correct {name} "
                       "engine's" if d["capped"] else ""))
        return (f"{self.steps:.3g} {name} steps at the top logit = {FACTOR:g} x the largest move of our own {name} "
                f"evaluations ({', '.join(f'{k} {v:.3g}' for k, v in d['max_by_kind'].items())} steps, over "
                f"{d['positions']} positions)")

    def json(self) -> dict:
        return {"basis": self.basis, "dtype": str(self.dtype).replace("torch.", ""), "steps": self.steps,
                "fixed": self.fixed} | self.detail


# ---- Our own evaluations in the engine's dtype --------------------------------------------------------------

@torch.inference_mode()
def prefill_logits(model: M.Qwen35, prompt: list, out: list) -> torch.Tensor:
    """One causal forward over prompt + out[:-1] (the chunked GDN kernel) -> [n, V] at the output positions."""
    dev = model.embed_tokens.weight.device
    ids = prompt + out[:-1]
    z, _ = model(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev), logits_from=len(prompt) - 1)
    return z[0].double()


@torch.inference_mode()
def cached_logits(model: M.Qwen35, seqs: list, width: int, rows: int = 1) -> list:
    """Each (prompt, out) of seqs prefilled, then its output fed through the cache `width` tokens per call (1: the
    recurrent decode kernel; more: verify calls of the block kernel, each committed whole), `rows` sequences at a
    time side by side in one batch (each in its own row at its own positions; a row past its end repeats its last
    token and is thrown away; a padding row's cache is never filled) -> [n_i, V] per sequence at its output positions."""
    dev, dt = model.embed_tokens.weight.device, model.dtype
    got = []
    for g in range(0, len(seqs), rows):
        group = seqs[g:g + rows]
        group = group + [group[-1]] * (rows - len(group))          # a batch of `rows` always: its kernels' shapes
        cap = max(len(p) for p, _ in group) + max(len(o) for _, o in group) + width
        cache = M.TargetCache(model.cfg, cap, dt, dev, batch=rows, max_block=width)
        out, real = [], len(seqs[g:g + rows])
        for b, (p, o) in enumerate(group):
            if b >= real:           # a padding row, thrown away: no row's numbers depend on another row's, so it
                out.append([])      # runs from the empty cache, unfilled (one prefill per real sequence only)
                continue
            pos = torch.arange(len(p), device=dev)
            view = cache.row(b)
            z, _ = model(torch.tensor([p], device=dev), pos, view, last_logits_only=True, mask=M.DenseMasks(cap).target(pos))
            out.append([z[0, -1].double()])
        n = max(len(o) for _, o in group) - 1
        for j in range(0, n, width):
            k = min(width, n - j)
            toks = torch.tensor([[o[min(i, len(o) - 2)] for i in range(j, j + k)] if len(o) > 1 else [0] * k
                                 for _, o in group], device=dev)
            pos = torch.stack([len(p) + j + torch.arange(k, device=dev) for p, _ in group])
            z, _ = model(toks, pos, cache, verify=width > 1)
            if width > 1:
                cache.commit(k)
            for b in range(rows):
                out[b] += list(z[b].double())
        got += [torch.stack(rows_[:len(o)]) for rows_, (_, o) in zip(out, group)][:len(seqs[g:g + rows])]
    return got


def reference_noise(model_d: M.Qwen35, oracle: list, seqs: list, positions: int = POSITIONS) -> Noise:
    """The noise of our own target in the engine's dtype (model_d) against our oracle's logits (oracle: [n_i, V] per
    sequence of seqs, (prompt, out) each), over the first sequences up to `positions` output positions (decoding:
    the first quarter of them): the largest move (`moves`, in rounding steps) of each way of evaluating them, and
    FACTOR times the largest of all."""
    dtype = model_d.dtype
    take, n = [], 0
    for s, z in zip(seqs, oracle):
        if n >= positions:
            break
        take.append((s, z))
        n += len(s[1])
    use = [s for s, _ in take]
    # decoding one token at a time costs a forward per position: on the first positions // DECODE_SHARE of them
    short, left = [], max(1, positions // DECODE_SHARE)
    for (p, o), ref in take:
        if left <= 0:
            break
        short.append(((p, o[:left]), ref[:left]))
        left -= len(o)
    kinds = {"prefill": ([prefill_logits(model_d, p, o) for p, o in use], take),
             "verify": (cached_logits(model_d, use, BLOCK), take),
             "decode": (cached_logits(model_d, [s for s, _ in short], 1), short),
             f"decode batch {BATCH}": (cached_logits(model_d, [s for s, _ in short], 1, BATCH), short)}
    most, every = {}, []
    for kind, (zs, refs) in kinds.items():
        m = torch.cat([moves(z, ref) / steps_of(ref.max(-1).values, dtype) for z, (_, ref) in zip(zs, refs)])
        most[kind] = float(m.max())
        every.append(m)
    every = torch.cat(every)
    return Noise("reference", dtype, FACTOR * max(most.values()),
                 detail={"positions": n, "max_by_kind": most, "quantile": float(torch.quantile(every, P_QUANTILE)),
                         "median": float(every.median())})


@functools.lru_cache(maxsize=4)
def model_in(path: str, dtype, device) -> M.Qwen35:
    """The target of `path` loaded in `dtype` (kept for the run: the reference evaluations of many cases)."""
    import checkpoint as ckpt
    return ckpt.load_target(path, dtype, device)


# ---- The engine's own logprobs ----------------------------------------------------------------------------

def discrepancies(z: torch.Tensor, logprobs: list, chosen: list) -> torch.Tensor:
    """The engine's discrepancy from our logits z [n, V] at each output position where it reported top logprobs
    (logprobs[t]: [[token id, logprob], ...] or None): the largest change, over the tokens it reported, of a logit
    difference to its chosen token -> [n] logits, NaN where it reported none."""
    out = torch.full((z.shape[0],), float("nan"), dtype=torch.float64)
    for t, lp in enumerate(logprobs[:z.shape[0]]):
        if not lp:
            continue
        ids = torch.tensor([int(i) for i, _ in lp])
        eng = torch.tensor([float(v) for _, v in lp], dtype=torch.float64)
        c = chosen[t]
        ref_c = float(z[t, c])
        eng_c = next((float(v) for i, v in lp if int(i) == c), None)
        if eng_c is None:           # its token is not among those it reported: measure against its top one
            eng_c, ref_c = float(eng.max()), float(z[t, int(ids[eng.argmax()])])
        out[t] = float(((eng - eng_c) - (z[t, ids].cpu() - ref_c)).abs().max())
    return out


def engine_noise(disc: list, tops: list, reference: Noise) -> Noise | None:
    """The logprobs basis from every case's discrepancies (disc: [n] per case, NaN where none) and top logits (tops:
    [n] per case): the reference tolerance scaled by how much noisier the engine is than our own evaluations, the
    ratio of the medians of its discrepancies and of our moves (a noisier engine moves every margin further; a fault
    that corrupts fewer than half of the positions leaves the median alone), at least 1 (an engine is never held to
    less noise than our own evaluations show) and at most NOISIER[dtype] (past it the engine's logits are not a
    correct engine's of that dtype: said in the report, `capped`). None without any logprobs."""
    d, t = torch.cat(disc), torch.cat(tops)
    keep = ~torch.isnan(d)
    if not bool(keep.any()):
        return None
    s = d[keep] / steps_of(t[keep], reference.dtype)
    med = float(s.median())
    ratio = med / max(reference.detail["median"], 1e-12)
    cap = NOISIER[reference.dtype]
    return Noise("logprobs", reference.dtype, reference.steps * min(max(ratio, 1.0), cap),
                 detail={"positions": int(keep.sum()), "median": med, "quantile": float(torch.quantile(s, P_QUANTILE)),
                         "max": float(s.max()), "ratio": ratio, "capped": ratio > cap, "reference_steps": reference.steps})


def kl_and_agreement(z: torch.Tensor, logprobs: list) -> tuple:
    """Per case, over the positions with logprobs: the mean KL divergence from the engine's distribution to ours,
    restricted to the tokens it reported (both renormalised over them), and the share of positions where its top
    token is our argmax -> (kl or None, agreement or None, positions)."""
    kls, agree = [], []
    for t, lp in enumerate(logprobs[:z.shape[0]]):
        if not lp:
            continue
        ids = torch.tensor([int(i) for i, _ in lp])
        p = torch.tensor([float(v) for _, v in lp], dtype=torch.float64).log_softmax(0)
        q = z[t, ids].cpu().double().log_softmax(0)
        kls.append(float((p.exp() * (p - q)).sum()))
        agree.append(int(ids[p.argmax()]) == int(z[t].argmax()))
    if not kls:
        return None, None, 0
    return sum(kls) / len(kls), sum(agree) / len(agree), len(kls)
