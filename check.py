"""The oracle as a tool: check another engine's output against this implementation, token by token.

    python check.py --target DIR_OR_REPO TRACE.json [--dtype float32|float64] [--tolerance T] [--only I]
                    [--engine-dtype bfloat16|float16|float32|float64] [--weight-dtype auto|float32] [--device cpu|cuda]
                    [--json]
    python check.py --dump-layers DIR --target DIR_OR_REPO --prompt-ids 1,2,3
    python check.py --export DIR [--target ... --draft ...]
    python check.py --server URL --api llama.cpp|openai|sglang [--concurrency 1,8,32] [--repeat R] [--logprobs N]
                    [--prompts-file F.jsonl] [--save-traces DIR] [--json]

A TRACE is a JSON object, a JSON list of objects, or JSON lines. Each object has `prompt_ids` and `output_ids`
(the generated ids), optionally `draft_ids` (each verify step's proposals) with `acceptance_lengths` (tokens
committed per verify step, bonus included), `temperature`, `top_p`, `top_k` (absent: greedy), `seed` and
`draft_rule` (sampled runs of this implementation), `dtype` (the engine's: the noise basis) and `top_logprobs`
(the engine's top log-probabilities per output token: its own noise). `generate.py --json` output is a trace as it
is. vLLM's, SGLang's and llama.cpp's responses with token ids (and logprobs) are read too (`read_cases`; the
requests: docs/usage.md#traces-from-vllm-and-sglang).

What it does (docs/method.md#checking-another-engine): prompt + output go through our target in one teacher-forced
forward, in the engine's own prefix, so every token is judged, also after a first difference. A greedy token is
a `match` (our choice; an exact tie is a set), a `tie-break` (within the noise of our top logit: a legitimate flip
of a near-tie in the engine's precision) or a `divergence`. The noise is measured (tolerance.py): our own target
evaluated in the engine's dtype as engines evaluate it, or the engine's own logprobs. With drafts, each verify
step must accept between the drafts every correct engine accepts and those the noise allows; otherwise it is a
`wrong_acceptance`; a step whose accepted drafts are not the output tokens at their places is a `contradiction`
(the trace disagrees with itself). A sampled trace with a `seed` (generate.py's noise keyed by position, noise.py)
is judged token by token like a greedy one, over the noised scores `logit - T * ln E(seed, t, token)`: its tokens
are exactly determined. Without a seed, a sampled token outside the support of the target's distribution under
the trace's temperature / top-k / top-p is `impossible`, and nothing else can be checked. Each case's verdict is
identical, tie-break, diverged or unchecked. Exit code 0: nothing diverged; 1: something did; 2: bad input.
--server sends greedy requests to a running engine, N in flight, R times, and judges every reply so (servers.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

import checkpoint as ckpt
import dflash
import engine
import model as M
import noise
import options
import sampling
import servers
import tolerance as TL
from sampling import DRAFT_RULES

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---- Tolerance --------------------------------------------------------------------------------------------
# A departure from our choice is a tie-break when it lies within the noise a correct engine shows, measured
# (tolerance.py: our own evaluations in the engine's dtype, or the engine's own logprobs; docs/method.md).
# Our own bf16 runs (DFlash against AR, one CPU) must part within NEAR_TIE_STEPS: tools/bench.py --parting measures it,
# tests/test_near_ties.py requires it. Why 2: two runs choose differently only where their roundings move the
# top-2 margin m across 0, so |m| <= the larger of the two moves, measured at most 1.64 steps.
NEAR_TIE_STEPS = 2.0
VERDICTS = ("identical", "tie-break", "diverged", "unchecked")


class CheckError(ValueError):
    """A trace or request that cannot be checked; the message says what is wrong."""


def zlab_module(name: str = "model"):
    """A module of the z-lab `dflash` package (an oracle: its model.py, its benchmark.py), loaded from its file under
    another name, since this repository's dflash.py shadows the package."""
    import importlib.metadata
    import importlib.util
    f = importlib.metadata.distribution("dflash").locate_file(f"dflash/{name}.py")
    spec = importlib.util.spec_from_file_location(f"zlab_dflash_{name}", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rounding_step = TL.rounding_step


@torch.inference_mode()
def teacher_forced_logits(ref: M.Qwen35, ids: list, start: int = 0) -> torch.Tensor:
    """One plain causal forward of `ref` over ids (no cache) -> float64 logits [T - start, V] of positions start on;
    row i predicts token start + i + 1 (only those rows are computed: a 1,000-token trace's logits at a 248,320-token
    vocabulary would be 2 GB in float64). Logits that are not finite raise CheckError naming the checkpoint
    (finite_or_fail): no verdict can rest on them."""
    device = ref.embed_tokens.weight.device
    logits, _ = ref(torch.tensor([ids], device=device), torch.arange(len(ids), device=device), logits_from=start)
    finite_or_fail(ref, logits[0])
    return logits[0].double()


def finite_or_fail(ref: M.Qwen35, logits: torch.Tensor) -> None:
    """Our own logits [T, V] hold a NaN or an infinity: one line that says so, with the checkpoint at fault and its
    first non-finite weight, or, where every weight is finite, that the forward overflowed in its dtype."""
    if bool(torch.isfinite(logits).all()):
        return
    row = int((~torch.isfinite(logits)).any(-1).nonzero()[0, 0])
    bad = next((n for n, p in ref.named_parameters() if not ckpt.all_finite(p)), None)
    dtype = str(ref.dtype).replace("torch.", "")
    where = getattr(ref, "path", "the target")
    raise CheckError(f"our own logits are not finite (NaN or inf) from position {row} of the sequence: "
                     + (f"the checkpoint {where} holds non-finite weights (the first: {bad}); nothing can be judged against it"
                        if bad is not None else
                        f"the weights of {where} are finite, so the forward overflowed in {dtype}; try --dtype float64"))


# ---- Traces -----------------------------------------------------------------------------------------------

@dataclass
class Case:
    """One generation to check."""
    prompt_ids: list
    output_ids: list
    draft_ids: list | None = None              # [steps][proposals]
    acceptance_lengths: list | None = None     # [steps]: tokens committed, bonus included
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    dtype: str | None = None                   # the engine's, when the trace says
    name: str = ""
    block_size: int | None = None              # without draft_ids: a step that commits fewer was a partial acceptance
    step_kinds: list | None = None             # "verify" or "plain" per step (generate.py's adaptive speculation)
    seed: int | None = None                    # sampled with this seed's position-keyed noise (noise.py)
    draft_rule: str = "coupled"                # how sampled drafts were verified (engine.Sampling.draft_rule)
    logprobs: list | None = None               # [n]: the engine's top [[token id, logprob], ...] per output token, or None
    source: str | None = None                  # the trace file it came from, and its place there (the reproducer)
    index: int = 0

    @property
    def seeded(self) -> bool:
        """A sampled case whose every token the seed determines: the coupled rule (a ratio-rule run of a DFlash2
        drafter commits residual draws, which depend on the step pattern and the drafts)."""
        return self.temperature > 0 and self.seed is not None and self.draft_rule == "coupled"


def _ids(v, what: str, where: str) -> list:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise CheckError(f"{where}: {what} must be a list of integer token ids")
    return v


def openai_case(obj: dict, where: str) -> list:
    """An OpenAI-compatible completion response with token ids (vLLM with `return_token_ids`: `prompt_token_ids`
    and each choice's `token_ids`; SGLang likewise) -> one Case per choice."""
    cases = []
    for i, ch in enumerate(obj["choices"]):
        prompt = ch.get("prompt_token_ids", obj.get("prompt_token_ids"))
        out = ch.get("token_ids", ch.get("output_ids"))
        if prompt is None or out is None:
            raise CheckError(f"{where}: choice {i} has no prompt_token_ids / token_ids; ask the server for token ids "
                             "(vLLM and SGLang: \"return_token_ids\": true) or give prompt_ids and output_ids")
        out = _ids(out, "token_ids", where)
        cases.append(Case(_ids(prompt, "prompt_token_ids", where), out, name=f"{where} choice {i}",
                          logprobs=read_logprobs(ch, len(out), where)))
    return cases


def to_cases(obj, where: str) -> list:
    """One trace object -> Cases (generate.py --json with --num-samples: one per sample; an OpenAI response: one
    per choice)."""
    if not isinstance(obj, dict):
        raise CheckError(f"{where}: a trace is a JSON object, got {type(obj).__name__}")
    if "choices" in obj:
        return openai_case(obj, where)
    # ours and a generic trace: prompt_ids; SGLang's /generate: prompt_token_ids (with return_prompt_token_ids)
    prompt = next((obj[k] for k in ("prompt_ids", "prompt_token_ids", "input_ids") if obj.get(k) is not None), None)
    if prompt is None or "output_ids" not in obj:
        raise CheckError(f"{where}: a trace needs prompt_ids (or prompt_token_ids) and output_ids")
    seed = obj.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise CheckError(f"{where}: seed must be an integer, got {seed!r}")
    if seed is not None and not 0 <= seed <= 2 ** 63 - 1:     # (noise.py keys the low 64 bits: 2^64 reads as seed 0)
        raise CheckError(f"{where}: seed must be in 0 .. 2^63-1, as generate.py's are, got {seed}")
    sampling = dict(temperature=float(obj.get("temperature") or 0.0), top_p=float(obj.get("top_p") or 1.0),
                    top_k=int(obj.get("top_k") or 0), dtype=obj.get("dtype"), draft_rule=obj.get("draft_rule") or "coupled")
    if obj.get("samples"):
        return [Case(_ids(prompt, "prompt_ids", where), _ids(s["output_ids"], "output_ids", where), None, None,
                     **sampling, name=f"{where} sample {i + 1}", seed=s.get("seed", seed if i == 0 else None))
                for i, s in enumerate(obj["samples"])]
    drafts, accepted = obj.get("draft_ids") or None, obj.get("acceptance_lengths") or None
    if drafts is not None and accepted is None:
        raise CheckError(f"{where}: draft_ids need acceptance_lengths (tokens committed per verify step)")
    if accepted is not None:
        accepted = _ids(accepted, "acceptance_lengths", where)
    if drafts is not None:
        if not isinstance(drafts, list) or len(drafts) != len(accepted):
            raise CheckError(f"{where}: draft_ids and acceptance_lengths must be lists of the same length (one per verify step)")
        drafts = [_ids(d, "each draft_ids entry", where) for d in drafts]
    block = obj.get("block_size")
    out = _ids(obj["output_ids"], "output_ids", where)
    name = f"{where} ({obj['name']})" if isinstance(obj.get("name"), str) else where
    return [Case(_ids(prompt, "prompt_ids", where), out, drafts, accepted,
                 **sampling, name=name, block_size=block if isinstance(block, int) and block > 1 else None,
                 step_kinds=obj.get("step_kinds") if isinstance(obj.get("step_kinds"), list) else None, seed=seed,
                 logprobs=read_logprobs(obj, len(out), where))]


def _pairs(entries, where: str) -> list | None:
    """One position's reported alternatives as [[token id, logprob], ...] (None where there are none)."""
    if not entries:
        return None
    try:
        return [[int(i), float(v)] for i, v in entries]
    except (TypeError, ValueError):
        raise CheckError(f"{where}: top_logprobs must hold [token id, logprob] pairs per output token") from None


def read_logprobs(obj: dict, n: int, where: str) -> list | None:
    """The engine's top log-probabilities per output token, from a trace's `top_logprobs` ([[id, logprob], ...] or
    null per token), llama.cpp's `completion_probabilities` (each token's `top_logprobs`, with `n_probs`), SGLang's
    `meta_info.output_top_logprobs` ([logprob, id, text] triples, with `top_logprobs_num`) or an OpenAI-style
    choice's `logprobs.top_logprobs` whose keys are "token_id:N" (vLLM's `return_tokens_as_token_ids`) -> a list of
    n entries (None where a position has none), or None where the trace has none."""
    rows = None
    if isinstance(obj.get("top_logprobs"), list):
        rows = [_pairs(r, where) for r in obj["top_logprobs"]]
    elif isinstance(obj.get("completion_probabilities"), list):
        rows = []
        for e in obj["completion_probabilities"]:
            tops = e.get("top_logprobs") if isinstance(e, dict) else None
            if not isinstance(tops, list) or not all(isinstance(x, dict) and "id" in x and "logprob" in x for x in tops):
                rows.append(None)
                continue
            pairs = [[x["id"], x["logprob"]] for x in tops]
            if "id" in e and "logprob" in e and all(x["id"] != e["id"] for x in tops):
                pairs.append([e["id"], e["logprob"]])
            rows.append(_pairs(pairs, where))
    elif isinstance(obj.get("meta_info"), dict) and isinstance(obj["meta_info"].get("output_top_logprobs"), list):
        rows = [_pairs([(e[1], e[0]) for e in r if e[0] is not None], where) if r else None
                for r in obj["meta_info"]["output_top_logprobs"]]
    elif isinstance(obj.get("logprobs"), dict) and isinstance(obj["logprobs"].get("top_logprobs"), list):
        rows = []
        for r in obj["logprobs"]["top_logprobs"]:
            keys = list(r) if isinstance(r, dict) else []
            ok = keys and all(isinstance(k, str) and k.startswith("token_id:") for k in keys)
            rows.append(_pairs([(int(k[9:]), r[k]) for k in keys], where) if ok else None)
    if rows is None:
        return None
    rows = [r if r is not None and len(r) >= 2 else None for r in rows]      # one token alone tells nothing (and
    if not any(rows):                               # llama-server sends a drafted token with its own logprob only)
        return None
    return (rows + [None] * n)[:n]


def read_cases(path: str) -> list:
    """A trace file: a JSON object, a JSON list, or JSON lines (generate.py's --json output, whose earlier
    lines are not JSON, reads as its last line) -> Cases."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise CheckError(f"cannot read {path} ({e.strerror})") from None
    try:
        objs = json.loads(text)
        objs = objs if isinstance(objs, list) else [objs]
    except json.JSONDecodeError:
        objs = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith(("{", "[")):
                try:
                    objs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CheckError(f"{path} line {n} is not valid JSON ({e.msg})") from None
    if not objs:
        raise CheckError(f"{path} holds no trace (a JSON object with prompt_ids and output_ids)")
    cases = [c for i, o in enumerate(objs) for c in to_cases(o, f"{os.path.basename(path)}[{i}]")]
    for i, c in enumerate(cases):
        c.source, c.index = path, i
    return cases


def validate(case: Case, cfg: M.TargetConfig) -> None:
    """What the model cannot check at all, refused with one line."""
    if not case.prompt_ids or not case.output_ids:
        raise CheckError(f"{case.name}: empty prompt_ids or output_ids")
    bad = [t for t in case.prompt_ids + case.output_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise CheckError(f"{case.name}: token ids {bad[:5]} are outside the target's vocabulary 0..{cfg.vocab_size - 1}; "
                         "is this trace from another model?")
    n = len(case.prompt_ids) + len(case.output_ids)
    if n > cfg.max_position_embeddings:
        raise CheckError(f"{case.name}: prompt + output = {n} tokens exceed the target's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if case.acceptance_lengths is not None:
        if 1 + sum(case.acceptance_lengths) != len(case.output_ids) or min(case.acceptance_lengths, default=1) < 1:
            raise CheckError(f"{case.name}: 1 + sum(acceptance_lengths) = {1 + sum(case.acceptance_lengths)} != "
                             f"{len(case.output_ids)} output tokens (the first comes from prefill; each step commits >= 1)")
        for j, (d, a) in enumerate(zip(case.draft_ids or [], case.acceptance_lengths)):
            if a > len(d) + 1:
                raise CheckError(f"{case.name}: step {j} commits {a} tokens from {len(d)} drafts (at most drafts + 1)")
    if not (case.temperature >= 0 and 0 < case.top_p <= 1 and case.top_k >= 0):
        raise CheckError(f"{case.name}: temperature must be >= 0, top_p in (0, 1], top_k >= 0")
    if case.draft_rule not in DRAFT_RULES:
        raise CheckError(f"{case.name}: draft_rule must be one of {', '.join(DRAFT_RULES)}, got {case.draft_rule!r}")
    bad = [i for row in case.logprobs or [] for i, _ in row or [] if not 0 <= i < cfg.vocab_size]
    if bad:
        raise CheckError(f"{case.name}: top_logprobs name token ids {bad[:3]} outside the target's vocabulary")


# ---- Judging ----------------------------------------------------------------------------------------------

@dataclass
class Report:
    """What check_case found in one case (the --json object, less `name`). verdict: "identical" (every token our
    choice; an exact tie of our top logits is a set, either token ours), "tie-break" (every departure within the
    noise, every step consistent), "diverged" (a token past the noise, a wrong acceptance, a contradiction, an
    impossible sampled token)."""
    name: str
    tokens: int
    sampled: bool
    matches: int = 0
    ties: int = 0                                          # departures within the noise (tie-breaks)
    divergences: list = field(default_factory=list)        # {index, engine_token, oracle_token, margin, steps, tolerance, discrepancy}
    tie_breaks: list = field(default_factory=list)         # the same, for departures within the noise
    first_divergence: int | None = None
    first_departure: int | None = None                     # the first token that is not our choice (a tie-break or not)
    step: dict | None = None                               # the step that produced the first divergence (step_at)
    diagnosis: str | None = None                           # a cause, only where the evidence supports it (diagnose)
    wrong_acceptances: list = field(default_factory=list)  # {step, accepted, expected, at_least, why}
    contradictions: list = field(default_factory=list)     # {step, index, draft_token, output_token}
    impossible: list = field(default_factory=list)          # output indices
    log_prob: float | None = None
    unchecked: str | None = None                           # what the trace does not let us check
    noise: dict | None = None                              # the noise judged with (tolerance.Noise.json)
    logprobs: dict | None = None                           # with the engine's logprobs: kl, top1_agreement, beyond_noise
    reproducer: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.divergences or self.wrong_acceptances or self.impossible or self.contradictions)

    @property
    def verdict(self) -> str:
        """diverged, tie-break or identical; "unchecked" for a sampled case whose tokens the trace does not determine
        (no seed, or the ratio rule) where nothing impossible was found."""
        if not self.ok:
            return "diverged"
        return "unchecked" if self.unchecked else "tie-break" if self.ties else "identical"


class Judge:
    """The teacher-forced logits of one case and how far each token is from our choice: z [n, V] float64, row t
    for output token t. Our choice is the argmax of the scores: the logits (greedy), or with a seed the noised
    scores `z - T * ln E(seed, position, token)` over the tokens top-k / top-p keep, whose argmax is exactly the
    draw sampling.draw makes. margin(t, tok) = top score - score of tok (0 for our choice, and for a token tied with
    it exactly), in logits; tolerance(t) in logits, the noise at the row's top logit (tolerance.Noise). disc [n]:
    the engine's own discrepancy from our logits per row (tolerance.discrepancies; NaN where it reported none):
    where it is past the tolerance the engine's logits there are not ours, and no departure there is a tie-break."""

    def __init__(self, z: torch.Tensor, noise: TL.Noise, scores: torch.Tensor | None = None, disc=None):
        self.z, self.s = z, z if scores is None else scores
        self.top, self.top_logit = self.s.max(-1), z.max(-1).values
        self.noise, self.disc = noise, disc

    def margin(self, t: int, tok: int) -> float:
        return float(self.top.values[t] - self.s[t, tok])

    def tolerance(self, t: int) -> float:
        return self.noise.tol(float(self.top_logit[t]))

    def steps(self, t: int, margin: float) -> float:
        return margin / rounding_step(float(self.top_logit[t]), self.noise.dtype)

    def discrepancy(self, t: int) -> float | None:
        if self.disc is None or math.isnan(float(self.disc[t])):
            return None
        return float(self.disc[t])

    def beyond(self, t: int) -> bool:
        """The engine's own logits at row t depart from ours past the noise (known only from its logprobs)."""
        d = self.discrepancy(t)
        return d is not None and d > self.tolerance(t)

    def within(self, t: int, tok: int) -> bool:
        """Token tok at row t is a choice a correct engine could make: our choice, or within the noise of it."""
        m = self.margin(t, tok)
        return m == 0 or (m <= self.tolerance(t) and not self.beyond(t))

    def second_margin(self, t: int) -> float:
        """Our top-2 margin at row t (how far the runner-up is)."""
        v = self.s[t].topk(2).values
        return float(v[0] - v[1])

    def departure(self, t: int, tok: int) -> dict:
        m = self.margin(t, tok)
        return {"index": t, "engine_token": tok, "oracle_token": int(self.top.indices[t]), "margin": m,
                "steps": self.steps(t, m), "tolerance": self.tolerance(t), "discrepancy": self.discrepancy(t)}


def judge_greedy(j: Judge, case: Case, rep: Report) -> None:
    for t, tok in enumerate(case.output_ids):
        if j.margin(t, tok) == 0:
            rep.matches += 1
            continue
        rep.first_departure = t if rep.first_departure is None else rep.first_departure
        if j.within(t, tok):
            rep.ties += 1
            rep.tie_breaks.append(j.departure(t, tok))
        else:
            rep.divergences.append(j.departure(t, tok))
    rep.first_divergence = rep.divergences[0]["index"] if rep.divergences else None


def judge_drafts(j: Judge, case: Case, rep: Report) -> None:
    """Each verify step s commits output[c : c + a]; its drafts d propose positions c, c+1, ... A correct engine
    accepts a leading run of its drafts, each its own choice, then adds its own token. Against our logits in the
    engine's own prefix (a draft at i < a - 1 is the output token it became; the first rejected one d[a - 1] is
    judged at the row where the engine's bonus went), with the noise: it must accept at least every leading draft
    that is our choice with no other token within the noise (a_min), and at most the leading drafts within the
    noise of our choice (a_max); and its bonus is never the draft it rejected (its own choice, rejected). The last
    step may stop early (max new tokens, a stop token): only accepting too much counts there."""
    c = 1
    last = len(case.draft_ids) - 1
    for s, (d, a) in enumerate(zip(case.draft_ids, case.acceptance_lengths)):
        bad = next((i for i in range(a - 1) if d[i] != case.output_ids[c + i]), None)
        if bad is not None:          # the engine committed other tokens than the drafts it says it accepted
            rep.contradictions.append({"step": s, "accepted": a, "index": c + bad, "draft_token": d[bad],
                                       "output_token": case.output_ids[c + bad]})
            c += a
            continue
        n = min(a, len(d))                    # the drafts judged: those accepted and the first rejected one
        a_max = next((i + 1 for i in range(n) if not j.within(c + i, d[i])), n + 1)
        a_min = next((i + 1 for i in range(n) if not (j.margin(c + i, d[i]) == 0 and j.second_margin(c + i) > j.tolerance(c + i))), n + 1)
        if a > a_max:
            rep.wrong_acceptances.append({"step": s, "accepted": a, "expected": a_max, "at_least": False,
                                          "why": "accepted a draft past the noise of our choice"})
        elif s < last and a - 1 < len(d) and d[a - 1] == case.output_ids[c + a - 1]:
            rep.wrong_acceptances.append({"step": s, "accepted": a, "expected": a + 1, "at_least": True,
                                          "why": "rejected a draft and then committed that very token as its own"})
        elif a < a_min and s < last:
            rep.wrong_acceptances.append({"step": s, "accepted": a, "expected": a_min, "at_least": True,
                                          "why": "rejected a draft that is our choice with no other token within the noise"})
        c += a


# ---- The steps of a trace, and what its divergences say ------------------------------------------------------

def steps_of(case: Case) -> list | None:
    """The trace's steps after prefill -> [{step, kind ("verify" or "plain"), first (its first output index),
    committed, drafts, acceptance ("full", "partial", "zero" or None for a plain step)}], or None where the trace
    does not say (no acceptance_lengths, or neither draft_ids nor block_size)."""
    if case.acceptance_lengths is None or (case.draft_ids is None and case.block_size is None):
        return None
    out, c = [], 1
    for s, a in enumerate(case.acceptance_lengths):
        kind = case.step_kinds[s] if case.step_kinds is not None and s < len(case.step_kinds) else "verify"
        n = len(case.draft_ids[s]) if case.draft_ids is not None else case.block_size - 1
        if kind == "plain" or (case.draft_ids is not None and n == 0):
            kind, acc = "plain", None
        else:
            acc = "full" if a >= n + 1 else "zero" if a == 1 else "partial"
        out.append({"step": s, "kind": kind, "first": c, "committed": a, "drafts": n, "acceptance": acc})
        c += a
    return out


def step_at(case: Case, index: int, steps: list | None = None) -> dict | None:
    """The step that committed output token `index` and the one before it -> {step, kind, offset (its place in
    the step), previous: the step before (None after prefill)}; prefill for index 0; None without step information."""
    if index == 0:
        return {"step": None, "kind": "prefill", "offset": 0, "previous": None}
    steps = steps_of(case) if steps is None else steps
    if steps is None:
        return None
    for i, st in enumerate(steps):
        if st["first"] <= index < st["first"] + st["committed"]:
            return {"step": st["step"], "kind": st["kind"], "offset": index - st["first"],
                    "previous": steps[i - 1] if i else {"step": None, "kind": "prefill"}}
    return None


def describe_step(where: dict | None) -> str:
    """A step_at dict as words: which step produced the token, and what the step before it did."""
    if where is None:
        return "the trace does not say which step produced it"
    if where["kind"] == "prefill":
        return "it came from prefill"
    text = f"it is token {where['offset'] + 1} of {where['kind']} step {where['step']}"
    p = where["previous"]
    if p["kind"] == "prefill":
        return text + ", the first step after prefill"
    if p["kind"] == "plain":
        return text + f", after plain step {p['step']}"
    return text + f", after verify step {p['step']}, which accepted {p['committed'] - 1} of {p['drafts']} drafts ({p['acceptance']})"


def after_rejection(where: dict | None) -> bool:
    """The first token computed after a round that rejected drafts (a partial or zero acceptance): where state
    kept for the rejected drafts shows first."""
    return (where is not None and where["kind"] != "prefill" and where["offset"] == 0
            and where["previous"].get("acceptance") in ("partial", "zero"))


def diagnose(j: Judge, case: Case, rep: Report) -> str | None:
    """A cause for a diverged case, named only where the evidence supports it; None otherwise (the report still
    says which step produced the divergence). The evidence is the engine's own logprobs with the trace's steps:
    where its logits first leave ours past the noise, matching ours within it before. When that is the first token
    computed after a round that rejected drafts, the state that round left behind is wrong: the signature of
    linear-attention state kept for the rejected drafts (not rolled back), or corrupted at that commit; a full
    acceptance before it that left the state right strengthens it. With ids only no cause is named: a divergence
    lands on the first token after a rejecting round by chance for 21% of a DFlash trace's tokens (measured:
    docs/method.md), and in the fault suite the divergences of un-rolled-back state did not concentrate there."""
    steps = steps_of(case)
    if steps is None or j.disc is None:
        return None
    first = next((t for t in range(len(case.output_ids)) if j.beyond(t)), None)
    if first is None:
        return None
    where = step_at(case, first, steps)
    if not after_rejection(where):
        return (f"the engine's logits first leave ours past the noise at output token {first} "
                f"({describe_step(where)}); no rollback signature")
    p = where["previous"]
    full = [s for s in steps if s["acceptance"] == "full" and s["first"] + s["committed"] <= first]
    return (f"the engine's logits first leave ours past the noise at output token {first}, the first token computed "
            f"after verify step {p['step']} rejected {p['drafts'] - p['committed'] + 1} of its {p['drafts']} drafts, "
            "and match ours within the noise before it: the state that round left behind is wrong, the signature of "
            "linear-attention (GDN) state, recurrent or conv, kept for the rejected drafts (not rolled back) or "
            "corrupted at that commit"
            + (f"; {len(full)} full acceptance{'s' if len(full) > 1 else ''} before it left the state right" if full else ""))


# ---- Sampled tokens -------------------------------------------------------------------------------------------

def judge_sampled(j: Judge, case: Case, rep: Report) -> None:
    """Sampled tokens: the trace's log-probability under our distribution, and tokens no sampling with these
    settings could give. A token is outside the support only by more than the tolerance (rounding may move a
    token across the top-k or top-p edge)."""
    s = engine.Sampling(case.temperature, case.top_p, case.top_k)
    p = sampling.sampling_probs(j.z, s).double()
    out = torch.tensor(case.output_ids, device=j.z.device)
    rep.log_prob = float(p.gather(1, out[:, None]).clamp_min(1e-300).log().sum())
    for t, tok in enumerate(case.output_ids):
        if outside_support(j.z[t], tok, s, j.tolerance(t)):
            rep.impossible.append(t)


def seeded_scores(z: torch.Tensor, case: Case) -> torch.Tensor:
    """The noised scores of a seeded sampled case: z [n, V] -> z - T ln E(seed, position, token) where the
    trace's top-k / top-p keep the token, -inf elsewhere. Output token t sits at position len(prompt) + t, and
    its draw in the engine is argmax p / E = argmax of these scores (p = softmax(z / T) restricted)."""
    s = engine.Sampling(case.temperature, case.top_p, case.top_k)
    pos = len(case.prompt_ids) + torch.arange(z.shape[0], device=z.device)
    e = noise.vocab_noise(torch.tensor(noise.seed_key(case.seed), device=z.device), pos,
                          noise.vocab_keys(z.shape[-1], z.device)).double()
    kept = sampling.sampling_probs(z, s) > 0
    return torch.where(kept, z - case.temperature * e.log(), float("-inf"))


def outside_support(z: torch.Tensor, tok: int, s: engine.Sampling, tol: float) -> bool:
    """Whether token tok could not be drawn from logits z [V] under s, even with its logit raised by tol: below
    the k-th largest logit, or after the smallest set of higher tokens that already reaches top_p."""
    lifted = z[tok] + tol
    if 0 < s.top_k < z.shape[0] and lifted < z.topk(s.top_k).values[-1]:
        return True
    if s.top_p < 1:
        p = sampling.sampling_probs(z, engine.Sampling(s.temperature, 1.0, s.top_k)).double()
        return float(p[z > lifted].sum()) >= s.top_p
    return False


UNSEEDED = ("sampled without a seed: its tokens are not determined by the trace, so neither they nor its verify "
            "steps were judged one by one; only that each token lies in the support of the stated temperature / "
            "top-k / top-p was checked. A wrong temperature or a wrong draw cannot be told from a right one")
RATIO = ("sampled under the ratio rule: its text is not determined by the seed alone (residual draws follow the "
         "drafts), so only the support of each token was checked")


# ---- The noise of a run, and judging its cases ---------------------------------------------------------------

@dataclass
class RunNoise:
    """The noise one run's cases of one dtype are judged with: the reference (our own evaluations in that dtype),
    and where cases carry the engine's logprobs the engine's own (tolerance.engine_noise); `fixed`: --tolerance."""
    reference: TL.Noise
    logprobs: TL.Noise | None = None

    def of(self, case: Case) -> TL.Noise:
        return self.logprobs if case.logprobs is not None and self.logprobs is not None else self.reference


def case_dtype(case: Case, engine_dtype):
    """The dtype a case is judged in: the trace's, else engine_dtype, else bfloat16."""
    return DTYPES[case.dtype] if case.dtype in DTYPES else engine_dtype or torch.bfloat16


def run_noise(target: M.Qwen35, cases: list, zs: list, dtype, fixed: float | None, positions: int = TL.POSITIONS,
              reference: TL.Noise | None = None) -> RunNoise:
    """The noise of the cases (all of one engine dtype) with our logits zs: fixed (--tolerance), else measured
    (tolerance.reference_noise over their first `positions` output positions, unless `reference` is given;
    tolerance.engine_noise from those with the engine's logprobs)."""
    if fixed is not None:
        return RunNoise(TL.Noise("fixed", dtype, fixed=fixed))
    ref = reference
    if ref is None:
        model_d = target if target.dtype == dtype else \
            TL.model_in(target.path, dtype, str(target.embed_tokens.weight.device))
        ref = TL.reference_noise(model_d, zs, [(c.prompt_ids, c.output_ids) for c in cases], positions)
    with_lp = [(c, z) for c, z in zip(cases, zs) if c.logprobs is not None]
    eng = None
    if with_lp:
        eng = TL.engine_noise([TL.discrepancies(z, c.logprobs, c.output_ids) for c, z in with_lp],
                              [z.max(-1).values.cpu() for _, z in with_lp], ref)
    return RunNoise(ref, eng)


def oracle_logits(target: M.Qwen35, case: Case) -> torch.Tensor:
    """Our logits for each output token of the case: one teacher-forced pass -> [n, V] float64."""
    validate(case, target.cfg)
    return teacher_forced_logits(target, case.prompt_ids + case.output_ids[:-1], len(case.prompt_ids) - 1)


def judge_case(case: Case, z: torch.Tensor, noise_: TL.Noise) -> Report:
    """One case against our logits z, with the noise of its run -> its Report."""
    disc = TL.discrepancies(z, case.logprobs, case.output_ids) if case.logprobs is not None else None
    j = Judge(z, noise_, seeded_scores(z, case) if case.seeded else None, disc)
    rep = Report(case.name, len(case.output_ids), case.temperature > 0, noise=noise_.json())
    if rep.sampled:
        judge_sampled(j, case, rep)
        if not case.seeded:
            rep.unchecked = RATIO if case.seed is not None else UNSEEDED
    if not rep.sampled or case.seeded:             # every token determined: judged one by one
        judge_greedy(j, case, rep)
        if case.draft_ids is not None:
            judge_drafts(j, case, rep)
        if rep.first_divergence is not None:
            rep.step = step_at(case, rep.first_divergence)
        if not rep.ok:
            rep.diagnosis = diagnose(j, case, rep)
    if disc is not None:
        kl, agree, n = TL.kl_and_agreement(z, case.logprobs)
        beyond = [t for t in range(len(case.output_ids)) if j.beyond(t)]
        rep.logprobs = {"positions": n, "kl": kl, "top1_agreement": agree, "beyond_noise": len(beyond),
                        "first_beyond_noise": beyond[0] if beyond else None,
                        "max_discrepancy": float(torch.nan_to_num(disc, nan=0.0).max())}
    rep.judge = j                                   # for the readable report; not part of the JSON
    return rep


def judge_cases(target: M.Qwen35, cases: list, engine_dtype, fixed: float | None = None,
                positions: int = TL.POSITIONS, reference: TL.Noise | None = None) -> list:
    """Every case judged, each dtype's cases with the noise measured over them (reference: our own evaluations'
    noise measured before, for cases of its dtype) -> [Report] in order."""
    zs = [oracle_logits(target, c) for c in cases]
    reports = [None] * len(cases)
    by_dtype = {}
    for i, c in enumerate(cases):
        by_dtype.setdefault(case_dtype(c, engine_dtype), []).append(i)
    for dtype, idx in by_dtype.items():
        rn = run_noise(target, [cases[i] for i in idx], [zs[i] for i in idx], dtype, fixed, positions,
                       reference if reference is not None and reference.dtype == dtype else None)
        for i in idx:
            reports[i] = judge_case(cases[i], zs[i], rn.of(cases[i]))
            reports[i].noise_text, reports[i].reference = rn.of(cases[i]).describe(), rn.reference
    return reports


REFERENCE_NOISE = {}      # (target, oracle dtype, engine dtype) -> the reference noise check_case measured first


def check_case(target: M.Qwen35, case: Case, tolerance: float | None = None, engine_dtype=torch.bfloat16,
               noise_: TL.Noise | None = None) -> Report:
    """One case judged: teacher-forced through the target once, every output token (and step) judged with the
    noise `noise_`; where none is given, the reference noise of this target and dtype measured on the first case
    check_case judges in this process (a property of the model and dtype, kept: REFERENCE_NOISE) and the logprobs
    noise of this case, or --tolerance."""
    z = oracle_logits(target, case)
    dtype = case_dtype(case, engine_dtype)
    if noise_ is None and tolerance is None:
        key = (getattr(target, "path", id(target)), target.dtype, dtype)
        if key not in REFERENCE_NOISE:
            REFERENCE_NOISE[key] = run_noise(target, [case], [z], dtype, None).reference
        rn = RunNoise(REFERENCE_NOISE[key])
        if case.logprobs is not None:
            rn.logprobs = TL.engine_noise([TL.discrepancies(z, case.logprobs, case.output_ids)],
                                          [z.max(-1).values.cpu()], rn.reference)
        noise_ = rn.of(case)
    elif noise_ is None:
        noise_ = TL.Noise("fixed", dtype, fixed=tolerance)
    return judge_case(case, z, noise_)


# ---- Output -----------------------------------------------------------------------------------------------

def report_json(rep: Report) -> dict:
    keys = ("name", "verdict", "tokens", "sampled", "matches", "ties", "divergences", "tie_breaks", "first_divergence",
            "first_departure", "step", "diagnosis", "wrong_acceptances", "contradictions", "impossible", "log_prob",
            "unchecked", "noise", "logprobs", "reproducer")
    return {k: getattr(rep, k) for k in keys} | {"ok": rep.ok}


def show(tok, ids: list) -> str:
    return repr(tok.decode(ids, skip_special_tokens=False)) if tok is not None else str(ids)


def departure_text(j: Judge, d: dict, tok, seeded: bool = False) -> str:
    """A departure as words: the tokens, our margin in logits and against the noise."""
    x, ours = d["engine_token"], d["oracle_token"]
    text = (f"engine {x} {show(tok, [x])}, ours {ours} {show(tok, [ours])}{' (our draw)' if seeded else ''}, margin "
            f"{d['margin']:.5f} logits = {d['steps']:.1f} steps = {d['margin'] / d['tolerance'] if d['tolerance'] else math.inf:.2g}x "
            f"the noise ({d['tolerance']:.5f})")
    if d["discrepancy"] is not None:
        past = d["discrepancy"] > d["tolerance"]
        text += (f"; the engine's own logits there depart from ours by {d['discrepancy']:.5f}, "
                 + ("past the noise: no tie-break" if past else "within the noise"))
    return text


def report_text(rep: Report, case: Case, tok) -> str:
    """The readable report of one case: counts and verdict, then the first divergence with its margin against the
    noise, the step that produced it, the text before it, our top-5, a diagnosis where the evidence supports one,
    and a one-line reproducer."""
    counts = f"{rep.matches} match, {rep.ties} tie-break, {len(rep.divergences)} divergence"
    if not rep.sampled:
        head = f"{rep.name}: {rep.tokens} tokens, {counts}"
    else:
        settings = f"T={case.temperature}, top_p={case.top_p}, top_k={case.top_k}"
        head = f"{rep.name}: {rep.tokens} tokens, sampled ({settings}{f', seed {case.seed}' if case.seeded else ''}), "
        head += (counts + ", " if case.seeded else "") + f"log-prob {rep.log_prob:.3f}, {len(rep.impossible)} impossible"
    if case.draft_ids is not None:
        rounds = case.step_kinds.count("verify") if case.step_kinds else sum(1 for d in case.draft_ids if d)
        head += f", {len(rep.wrong_acceptances)} wrong acceptance of {rounds} verify step{'s' if rounds != 1 else ''}"
        if rep.contradictions:
            head += f", {len(rep.contradictions)} self-contradicting"
    lines = [head + f" -> {rep.verdict.upper()}"]
    if rep.unchecked:
        lines.append(f"  ({rep.unchecked})")
    j = rep.judge
    if rep.logprobs is not None:
        lp = rep.logprobs
        lines.append(f"  with the engine's logprobs ({lp['positions']} positions): top-1 agreement {lp['top1_agreement']:.1%}, "
                     f"KL {lp['kl']:.2e} nats (over its reported tokens), logits past the noise at {lp['beyond_noise']} positions"
                     + (f" (first: output token {lp['first_beyond_noise']})" if lp['first_beyond_noise'] is not None else ""))
    if rep.divergences:
        d = rep.divergences[0]
        t = d["index"]
        lines.append(f"  first divergence at output token {t}: {departure_text(j, d, tok, case.seeded)}")
        lines.append(f"  {describe_step(rep.step)}")
        lines.append(f"  text before it: ...{show(tok, (case.prompt_ids + case.output_ids)[max(0, len(case.prompt_ids) + t - 12):len(case.prompt_ids) + t])}")
        vals, idx = j.z[t].topk(5)
        lines.append("  our top-5 logits: " + ", ".join(f"{int(i)} {show(tok, [int(i)])} {float(v):.4f}" for v, i in zip(vals, idx)))
    elif rep.impossible:
        t = rep.impossible[0]
        lines.append(f"  first impossible token at output token {t}: engine {case.output_ids[t]} {show(tok, [case.output_ids[t]])}, "
                     f"outside the support of T={case.temperature}, top_p={case.top_p}, top_k={case.top_k}")
    if rep.tie_breaks and not rep.divergences:
        lines.append(f"  first tie-break at output token {rep.tie_breaks[0]['index']}: {departure_text(j, rep.tie_breaks[0], tok, case.seeded)}")
    if rep.diagnosis:
        lines.append(f"  diagnosis: {rep.diagnosis}")
    for w in rep.wrong_acceptances[:3]:
        lines.append(f"  step {w['step']}: committed {w['accepted']} tokens, the target accepts "
                     f"{'at least ' if w['at_least'] else 'at most '}{w['expected']}: it {w['why']}")
    for c in rep.contradictions[:3]:
        lines.append(f"  step {c['step']}: commits {c['accepted']} tokens, so its drafts up to output token {c['index']} "
                     f"were accepted, but draft {c['draft_token']} {show(tok, [c['draft_token']])} is not the output token "
                     f"there, {c['output_token']} {show(tok, [c['output_token']])}: the engine committed other tokens than it "
                     "accepted (if every step says so, its draft_ids may be recorded for other positions)")
    if not rep.ok and rep.reproducer:
        lines.append(f"  replay: {rep.reproducer}")
    return "\n".join(lines)


# ---- Layer dump and conformance pack ------------------------------------------------------------------------

DUMP_README = """# Layer dump of {target}

`layers.safetensors` (float32 unless stated), for prompt ids {ids}:

- `hidden_states.0` [T, H]: the token embeddings; `hidden_states.{{l+1}}` [T, H]: the output of decoder layer l
  (transformers' `output_hidden_states` indexing). The last one, `hidden_states.{L}`, is taken after the final
  norm, as transformers returns it.
- `logits` [T, V]: the final logits (row t predicts token t + 1).
- `gdn.{{l}}.recurrent` [Hv, dk, dv] (float32): layer l's Gated DeltaNet state after the whole prompt (transformers'
  `recurrent_states[l][0]`); `gdn.{{l}}.conv` [K-1, conv_dim]: the last K-1 inputs of its causal conv, oldest first
  (transformers keeps them transposed, [conv_dim, K], with one more column).
- Layer kinds: {kinds}.

Written by `python check.py --dump-layers` (dflash-fast), dtype {dtype}.
"""


@torch.inference_mode()
def dump_layers(target: M.Qwen35, ids: list, out_dir: str) -> list:
    """Every layer's output, the logits and the GDN states after the prompt, as safetensors -> the tensor names."""
    from safetensors.torch import save_file
    device = target.embed_tokens.weight.device
    L = target.cfg.num_hidden_layers
    x = torch.tensor([ids], device=device)
    pos = torch.arange(len(ids), device=device)
    cache = M.TargetCache(target.cfg, len(ids), target.dtype, device, max_block=1)
    logits, feats = target(x, pos, cache, feature_layers=tuple(range(L)))
    tensors = {"hidden_states.0": target.embed_tokens(x)[0], "logits": logits[0]}
    for l, h in enumerate(feats[0].split(target.cfg.hidden_size, dim=-1)):
        tensors[f"hidden_states.{l + 1}"] = h
    for l, layer in enumerate(cache.layers):
        if isinstance(layer, M.GDNCache):
            tensors[f"gdn.{l}.recurrent"], tensors[f"gdn.{l}.conv"] = layer.rec[0], layer.conv[0]
    tensors = {k: v.float().contiguous().cpu() for k, v in tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "layers.safetensors"))
    with open(os.path.join(out_dir, "README.md"), "w") as fh:
        fh.write(DUMP_README.format(target=getattr(target, "path", "the target"), ids=ids, L=L,
                                    kinds=", ".join(f"{i}: {t}" for i, t in enumerate(target.cfg.layer_types)),
                                    dtype=str(target.dtype).replace("torch.", "")))
    return sorted(tensors)


EXPORT_PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\nimport sys\n\n\ndef main(argv):",
                  "    def __init__(self, x, y):"]
EXPORT_BLOCKS = (4, 8, 16)


def export_pack(target: M.Qwen35, proposer, tok, out_dir: str, max_new: int = 64) -> int:
    """The conformance pack: per prompt, our greedy AR output and greedy DFlash traces at several block sizes
    (cases.jsonl, each line a trace check.py reads), and how to produce an engine's traces (README.md)."""
    if tok is None:
        raise CheckError(f"{target.path} has no tokenizer.json; the pack's prompts are text")
    os.makedirs(out_dir, exist_ok=True)
    n = 0
    with open(os.path.join(out_dir, "cases.jsonl"), "w") as fh:
        for text in EXPORT_PROMPTS:
            ids = tok.encode(text).ids
            runs = [("ar", 1, engine.run(target, ids, max_new))]
            runs += [("dflash", b, engine.run(target, ids, max_new, (), proposer, b)) for b in EXPORT_BLOCKS if proposer]
            for mode, b, res in runs:
                fh.write(json.dumps({"prompt": text, "prompt_ids": ids, "output_ids": res.output_ids, "mode": mode,
                                     "block_size": b, "draft_ids": res.draft_ids if mode == "dflash" else None,
                                     "acceptance_lengths": res.acceptance_lengths if mode == "dflash" else None,
                                     "max_new_tokens": max_new, "temperature": 0.0,
                                     "dtype": str(target.dtype).replace("torch.", "")}) + "\n")
                n += 1
    with open(os.path.join(out_dir, "README.md"), "w") as fh:
        fh.write(PACK_README.format(target=target.path, draft=proposer.drafter.path if proposer else "none", n=n,
                                    max_new=max_new, blocks=", ".join(map(str, EXPORT_BLOCKS))))
    return n


PACK_README = """# Conformance pack

{n} greedy traces of the target `{target}` (drafter `{draft}`): per prompt, plain AR decoding and DFlash at block
sizes {blocks}, {max_new} new tokens each, in `cases.jsonl` (one trace per line: `prompt`, `prompt_ids`,
`output_ids`, `mode`, `block_size`, `draft_ids`, `acceptance_lengths`). The embedded checkpoints are in the real
Hugging Face (target) and z-lab (drafter) formats, so an engine can load them as they are.

To check an engine: run it greedily on each `prompt_ids` for `max_new_tokens` tokens, save its responses (token
ids, and per verify step its drafts and committed counts if it can report them), and run

    python check.py --target {target} ENGINE_TRACES.jsonl

Every token should be a match or a tie; each verify step's acceptance should be what the target allows.

Serving this pair and asking for token ids (field names from the engines' sources; not run by dflash-fast):

    vllm serve {target} --speculative-config '{{"method": "dflash", "model": "{draft}", "num_speculative_tokens": 15}}'
    POST /v1/completions  {{"prompt": PROMPT_IDS, "max_tokens": {max_new}, "temperature": 0, "ignore_eos": true,
                            "return_token_ids": true}}            -> choices[0].prompt_token_ids, choices[0].token_ids

    python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH --speculative-draft-model-path {draft}
    POST /generate  {{"input_ids": PROMPT_IDS, "sampling_params": {{"max_new_tokens": {max_new}, "temperature": 0,
                      "ignore_eos": true}}, "return_prompt_token_ids": true}}      -> prompt_token_ids, output_ids

Save each response as one line of a JSON-lines file; check.py reads these responses as they are.
"""


# ---- Calibration --------------------------------------------------------------------------------------------

def margin_errors(run_model: M.Qwen35, ref: M.Qwen35, ids: list, start: int) -> tuple:
    """How much a run's precision moves a top-2 margin: both models teacher-forced over ids; for each row from
    `start`, |margin in run_model - margin in ref| between the reference's top two tokens, in logits [n], and the
    reference's top logit there [n] (both on the CPU)."""
    zr, zm = teacher_forced_logits(ref, ids, start), teacher_forced_logits(run_model, ids, start)
    idx = zr.topk(2, dim=-1).indices
    mr, mm = zr.gather(1, idx), zm.gather(1, idx)
    return ((mm[:, 0] - mm[:, 1]) - (mr[:, 0] - mr[:, 1])).abs().cpu(), zr.max(-1).values.cpu()


def margin_moves(target_lo: M.Qwen35, target_ref: M.Qwen35, case: Case) -> torch.Tensor:
    """margin_errors over a case's output rows, in rounding steps of target_lo's dtype at the top logit -> [n]."""
    moved, top = margin_errors(target_lo, target_ref, case.prompt_ids + case.output_ids[:-1], len(case.prompt_ids) - 1)
    dtype = target_lo.dtype
    return moved / torch.tensor([rounding_step(float(v), dtype) for v in top], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# --parting: where greedy DFlash and greedy AR part in a low precision, and how near a tie the target was there
# ---------------------------------------------------------------------------------------------------------------

# `python tools/bench.py --parting` runs parting_main. A parting is a near-tie when both runs' tokens lie within
# NEAR_TIE_STEPS rounding steps of the run's dtype of the reference's best logit, as the checker judges.


def first_difference(a: list, b: list) -> int | None:
    """The first index where token lists a and b differ, or None where one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@dataclass
class Parting:
    """The first output token where two greedy runs of one prompt part, judged by a reference: the same weights
    in a higher precision, teacher-forced over the prompt + the tokens both runs agreed on."""
    index: int            # output index of the first difference (0 = the token prefill chose)
    dflash: int           # the DFlash run's token there
    ar: int               # the AR run's token there
    top: int              # the reference's argmax there (usually one of the two)
    gap: float            # the reference's top logit minus the lower of the two tokens' logits (>= 0)
    top_logit: float      # the reference's top logit there

    @property
    def prefers(self) -> str:
        """Which run's token the reference chose: "dflash", "ar", or "neither" (a third token)."""
        return "dflash" if self.top == self.dflash else "ar" if self.top == self.ar else "neither"

    def steps(self, dtype) -> float:
        """The gap in rounding steps of `dtype` at the top logit's magnitude."""
        return self.gap / rounding_step(self.top_logit, dtype)


def parting(ref: M.Qwen35, prompt: list, ar_out: list, dflash_out: list) -> Parting | None:
    """Where `dflash_out` and `ar_out` (greedy outputs of `prompt`) first differ, judged by `ref` teacher-forced
    over prompt + the agreed tokens (one forward). None when neither output leaves the other."""
    i = first_difference(ar_out, dflash_out)
    if i is None:
        return None
    z = teacher_forced_logits(ref, prompt + ar_out[:i], len(prompt) + i - 1)[-1]
    top, a, d = int(z.argmax()), ar_out[i], dflash_out[i]
    return Parting(i, d, a, top, float(z[top] - torch.minimum(z[a], z[d])), float(z[top]))


def near_tie(p: Parting, dtype, steps: float = NEAR_TIE_STEPS) -> bool:
    """Whether both runs' tokens lay within `steps` rounding steps of `dtype` of the reference's best logit: a
    choice either run could legitimately make in that precision."""
    return p.steps(dtype) <= steps


def position_margins(ref: M.Qwen35, prompt: list, out: list) -> tuple:
    """`ref` teacher-forced over prompt + out; at each output position -> (its top-2 logit margin [n], its top
    logit [n], its top logit minus the logit of out's token [n]: 0 where out took its argmax)."""
    z = teacher_forced_logits(ref, prompt + out[:-1], len(prompt) - 1)
    top2 = z.topk(2, dim=-1).values
    taken = z.gather(1, torch.tensor(out, device=z.device)[:, None])[:, 0]
    return (top2[:, 0] - top2[:, 1]).cpu(), top2[:, 0].cpu(), (top2[:, 0] - taken).cpu()


def quantiles(x: torch.Tensor, qs=(0.0, 0.01, 0.05, 0.25, 0.5)) -> list:
    """The given quantiles of a 1-D tensor (0.0 = the minimum)."""
    return [float(v) for v in torch.quantile(x.double(), torch.tensor(qs, dtype=torch.float64))]


def parting_row(i: int, prompt: list, parts: dict, dtype) -> str:
    """One table line: the prompt, and where its runs part with the references' gaps there (or that they do not)."""
    p32 = parts["float32"]
    if p32 is None:
        return f"| {i} | {len(prompt)} | - | | | | | | | |"
    step = rounding_step(p32.top_logit, dtype)
    return (f"| {i} | {len(prompt)} | {p32.index} | {p32.dflash} / {p32.ar} | {p32.prefers} | {p32.gap:.5f} | "
            f"{parts['float64'].gap:.5f} | {p32.top_logit:.3f} | {step:.5f} | {p32.steps(dtype):.2f} |")


def parting_main(args, device) -> dict:
    """--parting: greedy DFlash and greedy AR in --dtype on every prompt; where they part, the float32 and float64
    teacher-forced gaps between the two tokens; the float32 margins at every AR position. A table, a summary, and
    one JSON line last."""
    t_start = time.perf_counter()
    from options import DTYPES, pick_dtype
    import prompts as P
    dtype = pick_dtype(args.dtype, device)
    target = ckpt.load_target(args.target, dtype, device)
    proposer = engine.DrafterProposer(ckpt.load_drafter(args.draft, target.cfg, dtype, device), target)
    refs = {name: ckpt.load_target(args.target, DTYPES[name], device) for name in ("float32", "float64")}
    block = args.block_size or proposer.max_block_size
    prompts = P.from_args(args, ckpt.load_tokenizer(target.path), target.path)
    stops = ckpt.stop_token_ids(target.path, target.cfg)
    capacity = max(len(p) for p in prompts) + args.max_new_tokens + block
    masks = options.ATTENTION[getattr(args, "attention", "sdpa")]          # eager engines, pure rounds
    ar_engine = engine.Engine(target, None, 1, 1, capacity, masks=masks)
    sp_engine = engine.Engine(target, proposer, block, 1, capacity, masks=masks)
    print(f"greedy DFlash vs AR in {str(dtype).replace('torch.', '')}, {len(prompts)} prompts, {args.max_new_tokens} new "
          f"tokens, block {block}; gaps from float32 / float64 teacher-forced re-runs, steps = rounding steps of the run's "
          f"dtype at the top logit", flush=True)
    print("| prompt | tokens | parts at | DFlash / AR token | float32 prefers | float32 gap | float64 gap | top logit | step | gap in steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    partings, margins, tops, ar_gaps, errors, compared = [], [], [], [], [], 0    # compared: token positions up to a parting
    for i, p in enumerate(prompts):
        ar = ar_engine.generate(p, args.max_new_tokens, stops).output_ids
        sp = sp_engine.generate(p, args.max_new_tokens, stops).output_ids
        parts = {name: parting(ref, p, ar, sp) for name, ref in refs.items()}
        if parts["float32"] is not None:
            partings.append((i, parts))
        compared += len(ar) if parts["float32"] is None else parts["float32"].index + 1
        m, t, g = position_margins(refs["float32"], p, ar)
        margins.append(m), tops.append(t), ar_gaps.append(g)
        errors.append(margin_errors(target, refs["float64"], p + ar[:-1], len(p) - 1)[0])
        print(parting_row(i, p, parts, dtype), flush=True)
    return parting_summary(args, dtype, block, prompts, partings, compared, torch.cat(margins), torch.cat(tops),
                           torch.cat(ar_gaps), torch.cat(errors), time.perf_counter() - t_start)


def parting_summary(args, dtype, block, prompts, partings, compared, margins, tops, ar_gaps, errors, seconds) -> dict:
    """Print what the --parting table adds up to and the JSON line; -> that JSON object."""
    steps = torch.tensor([rounding_step(float(t), dtype) for t in tops], dtype=torch.float64)
    p32 = [parts["float32"] for _, parts in partings]
    gaps = [p.gap for p in p32]
    gap_steps = [p.steps(dtype) for p in p32]
    f64_diff = max((abs(parts["float64"].gap - parts["float32"].gap) for _, parts in partings), default=0.0)
    off = ar_gaps > 0                                  # AR positions where the run's token is not float32's argmax
    bound = NEAR_TIE_STEPS * steps
    n = len(prompts)
    print(f"parted: {len(p32)}/{n} prompts ({len(p32) / n:.1%}), at output indices {[p.index for p in p32]} "
          f"(of {args.max_new_tokens}); {len(p32)} partings in {compared} token positions compared")
    if p32:
        print(f"float32 gap at the partings: max {max(gaps):.5f} ({max(gap_steps):.2f} steps), median "
              f"{statistics.median(gaps):.5f} ({statistics.median(gap_steps):.2f} steps); float32 prefers "
              + ", ".join(f"{w} {sum(p.prefers == w for p in p32)}" for w in ("dflash", "ar", "neither"))
              + f"; float64 gaps differ from float32's by at most {f64_diff:.2e}")
    all_near = all(near_tie(p, dtype) for p in p32)
    print(f"every parting a near-tie (gap <= {NEAR_TIE_STEPS:g} steps): {all_near}{'' if p32 else ' (none parted)'}")
    print(f"context, all {len(margins)} AR positions: float32 top-2 margin quantiles (min, 1%, 5%, 25%, median) "
          f"{[round(v, 4) for v in quantiles(margins)]}, in steps {[round(v, 2) for v in quantiles(margins / steps)]}; "
          f"{int((margins <= bound).sum())} positions ({float((margins <= bound).double().mean()):.2%}) within "
          f"{NEAR_TIE_STEPS:g} steps" + (f", {int((margins / steps <= max(gap_steps)).sum())} within the largest parting "
          f"gap ({max(gap_steps):.2f} steps)" if p32 else ""))
    print(f"the AR run's own token is not float32's argmax at {int(off.sum())} positions"
          + (f" (gap max {float(ar_gaps.max()):.5f} = {float((ar_gaps / steps).max()):.2f} steps)" if off.any() else ""))
    print(f"{str(dtype).replace('torch.', '')} teacher-forced vs float64: top-2 margin moved by max {float(errors.max()):.5f} "
          f"({float((errors / steps).max()):.2f} steps), median {float(errors.median()):.5f} "
          f"({float((errors / steps).median()):.2f} steps)")
    out = {"mode": "parting", "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
           "prompts": n, "max_new_tokens": args.max_new_tokens, "block_size": block, "parted": len(p32),
           "parting_rate": len(p32) / n, "positions_compared": compared, "near_tie_steps": NEAR_TIE_STEPS, "all_near_ties": all_near,
           "partings": [{"prompt": i, "index": parts["float32"].index, "dflash_token": parts["float32"].dflash,
                         "ar_token": parts["float32"].ar, "float32_prefers": parts["float32"].prefers,
                         "float32_gap": parts["float32"].gap, "float64_gap": parts["float64"].gap,
                         "top_logit": parts["float32"].top_logit, "step": rounding_step(parts["float32"].top_logit, dtype),
                         "gap_steps": parts["float32"].steps(dtype)} for i, parts in partings],
           "max_gap": max(gaps, default=None), "max_gap_steps": max(gap_steps, default=None),
           "positions": len(margins), "margin_quantiles": quantiles(margins),
           "margin_quantiles_steps": quantiles(margins / steps),
           "positions_within_bound": int((margins <= bound).sum()),
           "positions_within_max_gap": int((margins / steps <= max(gap_steps)).sum()) if p32 else None,
           "ar_not_float32_argmax": int(off.sum()), "margin_error_max": float(errors.max()),
           "margin_error_max_steps": float((errors / steps).max()), "seconds": seconds}
    print(json.dumps(out))
    return out


# ---- Against a running engine: --server --------------------------------------------------------------------
# servers.py sends the requests (the API shapes, N in flight); here each reply is read as a trace (to_cases),
# judged as a trace file's case is (check_case), and given its verdict.

def server_flags_check(args) -> None:
    """--server's flags, checked before anything loads: the URL, the concurrency list, the prompt set."""
    try:
        servers.endpoint(args.server, servers.APIS[args.api])
    except ValueError as e:
        raise CheckError(str(e)) from None
    try:
        args.levels = [int(v) for v in args.concurrency.split(",") if v.strip()]
    except ValueError:
        raise CheckError(f"--concurrency takes comma-separated request counts, e.g. 1,8,32; got {args.concurrency!r}") from None
    if not args.levels or min(args.levels) < 1:
        raise CheckError(f"--concurrency counts must be >= 1, got {args.concurrency!r}")
    if not args.max_new_tokens >= 1 or not args.timeout > 0 or (args.heldout is not None and args.heldout < 1):
        raise CheckError("--max-new-tokens and --heldout must be >= 1, --timeout > 0")
    if args.prompts_file is not None:
        try:
            lines = options.read_requests(args.prompts_file, prompt_line_args(args))
        except dflash.GenerationError as e:
            raise CheckError(str(e)) from None
        for n, line in lines:
            if (line.get("temperature") or 0) > 0:
                raise CheckError(f"{args.prompts_file} line {n}: check.py --server judges greedy requests only; drop its "
                                 "temperature (sampled runs: check their traces, with a seed, as files)")
    try:
        servers.reachable(args.server, min(args.timeout, 10.0))
    except servers.ReplyError as e:
        raise CheckError(f"--server: {e}") from None


def prompt_line_args(args):
    """The settings generate.py gives a --prompts-file line that does not set its own: greedy, --max-new-tokens,
    a "prompt" rendered by the checkpoint's chat template when it ships one (as generate.py does)."""
    return argparse.Namespace(max_new_tokens=args.max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                              draft_rule="coupled", chat=None, chat_template=None, system=None, no_think=False)


def server_prompts(args, target, tok) -> list:
    """--server's prompt set -> [(prompt ids, max new tokens)]: --prompts-file's lines (generate.py's format, read
    as generate.py reads them; greedy only), the conformance pack's prompts (--pack), the first turns of
    --dataset's samples, else --heldout (default 32) held-out prompts (tools/bench.py's)."""
    import prompts as P
    if args.prompts_file is None and tok is None:
        raise CheckError(f"{target.path} has no tokenizer.json to make the prompts; give --prompts-file with prompt_ids")
    if args.prompts_file is not None:
        ns, out = prompt_line_args(args), []
        template, specials = options.chat_template_of(ns, target.path)

        def no_images():
            raise dflash.GenerationError("check.py --server sends token ids only; drop the line's \"images\"")
        for i, (n, line) in enumerate(options.read_requests(args.prompts_file, ns)):
            try:
                req, _ = options.request_of(line, i, ns, tok, template, specials, None, [], no_images)
            except dflash.GenerationError as e:
                raise CheckError(f"{args.prompts_file} line {n}: {e}") from None
            if not req.sampling.greedy:
                raise CheckError(f"{args.prompts_file} line {n}: check.py --server judges greedy requests only; drop its "
                                 "temperature (sampled runs: check their traces, with a seed, as files)")
            out.append((req.prompt_ids, req.max_new_tokens))
        return out
    if args.pack:
        return [(tok.encode(t).ids, args.max_new_tokens) for t in EXPORT_PROMPTS]
    if args.dataset:
        return [(ids, args.max_new_tokens) for ids in P.first_turns(args.dataset.split(","), args.limit, tok, target.path, True)]
    return [(ids, args.max_new_tokens) for ids in P.heldout_prompts(tok, args.heldout or 32)]


def reply_case(target, reply, prompt: list, asked: int) -> tuple:
    """One reply -> (servers.Outcome, with verdict "error" where there is nothing to judge; its Case or None)."""
    out = servers.Outcome(reply.index, "error", asked, finish=reply.finish)
    if reply.error is not None:
        out.error = reply.error
        return out, None
    try:
        cases = to_cases(reply.trace, "the response")
        if len(cases) != 1:
            raise CheckError(f"{len(cases)} generations in one response, expected 1")
        case = cases[0]
        case.name = f"request {reply.index}"
        if case.prompt_ids != prompt:
            i = first_difference(case.prompt_ids, prompt)
            raise CheckError(f"the server ran other prompt ids than were sent ({len(case.prompt_ids)} ids for {len(prompt)}, "
                             f"first different at {min(len(prompt), len(case.prompt_ids)) if i is None else i})")
        if not case.output_ids:
            raise CheckError(f"no output tokens came back (the server's reason for stopping: {reply.finish})")
        validate(case, target.cfg)
    except CheckError as e:
        out.error = str(e)
        return out, None
    out.output_ids = case.output_ids
    return out, case


def outcome_line(o, rep) -> str:
    """One line for a request of one run that is not plainly identical: failed, diverged, a tie-break, truncated."""
    if o.verdict == "error":
        return f"  request {o.index}: failed: {o.error}"
    line = f"  request {o.index}: {o.verdict}"
    if o.verdict == "diverged":
        line += f" from output token {o.first_divergence} ({o.divergences} divergence{'s' if o.divergences != 1 else ''})"
    elif o.verdict == "tie-break":
        d = rep.tie_breaks[0]
        line += (f" at output token {d['index']}: engine {d['engine_token']}, ours {d['oracle_token']}, margin "
                 f"{d['margin']:.5f} logits = {d['margin'] / d['tolerance'] if d['tolerance'] else math.inf:.2g}x the noise")
    if o.truncated:
        line += f"; truncated: {len(o.output_ids)} of {o.asked} tokens (the server's reason for stopping: {o.finish})"
    return line


def request_summary(i: int, runs: list, levels: list) -> dict:
    """One request over every run (levels [(n, repeat)], runs [(Outcome, Report or None)] in the same order): how
    many distinct outputs came back, the runs where it diverged, and whether it diverged only in company (never in a
    run with 1 in flight, which was made) or also alone."""
    outs = [o for o, _ in runs]
    distinct = {tuple(o.output_ids) for o in outs if o.verdict != "error"}
    diverged = [{"concurrency": n, "repeat": r} for (n, r), o in zip(levels, outs) if o.verdict == "diverged"]
    alone = [o for (n, _), o in zip(levels, outs) if n == 1 and o.verdict != "error"]
    company = None
    if diverged and alone:
        company = not any(o.verdict == "diverged" for o in alone)
    order = ("diverged", "error", "tie-break", "identical")
    verdict = next(v for v in order if any(o.verdict == v for o in outs))
    return {"index": i, "verdict": verdict, "distinct_outputs": len(distinct), "diverged_runs": diverged,
            "only_in_company": company, "runs": len(outs)}


def request_line(s: dict) -> str:
    return (f"  request {s['index']}: {s['distinct_outputs']} distinct output{'s' if s['distinct_outputs'] != 1 else ''} "
            f"over {s['runs']} runs; diverged in {len(s['diverged_runs'])} ("
            + ", ".join(f"concurrency {d['concurrency']} repeat {d['repeat']}" for d in s["diverged_runs"][:8])
            + (", ..." if len(s["diverged_runs"]) > 8 else "") + ")"
            + ("" if s["only_in_company"] is None else
               "; only in company (never alone: a batching fault)" if s["only_in_company"] else "; also alone"))


def engine_dtype_of(args) -> tuple:
    """--server: the engine's precision, the basis of the noise its tokens are judged with -> (dtype name, how it was
    found): --engine-dtype, else what llama-server says of its model (servers.llama_cpp_dtype), else bfloat16,
    assumed, and the report says so."""
    if args.engine_dtype is not None:
        return args.engine_dtype, "--engine-dtype"
    if args.api == "llama.cpp":
        dtype, how = servers.llama_cpp_dtype(args.server)
        if dtype is not None:
            return dtype, how
    else:
        how = f"the {args.api} API does not say"
    return "bfloat16", f"assumed: {how}; give --engine-dtype"


def save_traces(out_dir: str, label: str, judged: list, reqs: list, dtype: str, args) -> dict:
    """--save-traces: every reply of one run as a trace file check.py reads (out_dir/LABEL.jsonl, one trace a line),
    and each reply that is not identical to our greedy output alone in out_dir/request-I-LABEL.json -> {request
    index: that file}, for the reports' reproducers."""
    files = {}
    with open(os.path.join(out_dir, f"{label}.jsonl"), "w") as fh:
        for o, case in judged:
            if case is None:
                continue
            trace = {"name": f"request {o.index} ({label})", "prompt_ids": reqs[o.index][0], "output_ids": o.output_ids,
                     "dtype": dtype, "engine": args.server, "api": args.api}
            if case.logprobs is not None:
                trace["top_logprobs"] = case.logprobs
            fh.write(json.dumps(trace) + "\n")
            if o.verdict != "identical":
                files[o.index] = os.path.join(out_dir, f"request-{o.index}-{label}.json")
                with open(files[o.index], "w") as one:
                    json.dump(trace, one)
    return files


def curl_line(args, prompt: list, asked: int, model) -> str:
    """The one command that sends this request alone to the engine again."""
    api = servers.APIS[args.api]
    body = json.dumps(api.body(prompt, asked, model, args.logprobs), separators=(",", ":"))
    return f"curl -s {servers.endpoint(args.server, api)} -H 'Content-Type: application/json' -d '{body}'"


def server_main(args, target, tok) -> int:
    """--server: every prompt sent at each --concurrency, --repeat times; every reply judged with the run's noise;
    per run the counts and the engine against itself; per request over the runs its distinct outputs and where it
    diverged (alone or only in company); every diverged output's full report; the last line one JSON object (with
    --json every request's prompt and output ids)."""
    reqs = server_prompts(args, target, tok)
    for i, (p, m) in enumerate(reqs):
        bad = [t for t in p if not 0 <= t < target.cfg.vocab_size]
        if not p or bad or len(p) + m > target.cfg.max_position_embeddings:
            raise CheckError(f"prompt {i}: empty, ids outside the vocabulary ({bad[:3]}), or prompt + {m} new tokens "
                             f"past max_position_embeddings {target.cfg.max_position_embeddings}")
    api = servers.APIS[args.api]
    model = args.model or (servers.served_model(args.server) if args.api == "openai" else None)
    dtype, how = engine_dtype_of(args)
    lo, hi = min(m for _, m in reqs), max(m for _, m in reqs)
    print(f"{args.server} ({args.api} API{f', model {model}' if model else ''}): {len(reqs)} prompts, greedy, "
          f"{lo if lo == hi else f'{lo}-{hi}'} new tokens each, concurrency {args.concurrency}"
          f"{f', {args.repeat} repeats' if args.repeat > 1 else ''}; noise basis {dtype} ({how})", flush=True)
    levels, sent = [], []
    for r in range(1, args.repeat + 1):
        for n in args.levels:
            label = f"concurrency {n}" + (f" repeat {r}" if args.repeat > 1 else "")
            levels.append((n, r))
            sent.append(servers.send_all(args.server, api, reqs, n, args.timeout, model, logprobs=args.logprobs, label=label))
    print(f"judging {sum(len(s[0]) for s in sent)} replies ...", file=sys.stderr, flush=True)
    parsed = [[reply_case(target, rep, *reqs[rep.index]) for rep in replies] for replies, _, _ in sent]
    reports, texts, noise_text = judge_replies(target, parsed, DTYPES[dtype], args, tok)
    ok, summaries, runs = True, [], [[] for _ in reqs]
    for k, ((n, r), (replies, most, seconds)) in enumerate(zip(levels, sent)):
        outcomes = [o for o, _ in parsed[k]]
        for o, rep in zip(outcomes, reports[k]):
            if rep is not None:
                o.verdict, o.first_difference = rep.verdict, rep.first_departure
                o.first_divergence, o.divergences = rep.first_divergence, len(rep.divergences)
            runs[o.index].append((o, rep))
        ref = (levels[0], [o for o, _ in parsed[0]]) if k else None
        summary = servers.level_summary(n, outcomes, replies, most, seconds, ref, r)
        ok &= summary["diverged"] == summary["errors"] == summary["truncated"] == 0
        if k == 0:
            print(f"noise: {noise_text}")
        label = f"concurrency-{n}" + (f"-repeat-{r}" if args.repeat > 1 else "")
        files = save_traces(args.save_traces, label, parsed[k], reqs, dtype, args) if args.save_traces else {}
        print(servers.level_text(summary))
        for o, rep in zip(outcomes, reports[k]):
            if o.verdict != "identical" or o.truncated:
                print(outcome_line(o, rep))
            if o.verdict == "diverged" and o.index in files:
                print(f"    replay: {replay_line(target.path, files[o.index], None, dtype, args.tolerance)}")
        summaries.append(summary)
    per_request = [request_summary(i, runs[i], levels) for i in range(len(reqs))]
    shown = set()
    for i, s in enumerate(per_request):
        if s["verdict"] != "diverged":
            continue
        if len(levels) > 1:
            print(request_line(s))
        for (n, r), (o, rep) in zip(levels, runs[i]):
            key = (i, tuple(o.output_ids))
            if o.verdict == "diverged" and key not in shown:      # every diverged output's full report, once
                shown.add(key)
                at = [f"{c}/{q}" for (c, q), (o2, _) in zip(levels, runs[i]) if tuple(o2.output_ids) == key[1]]
                print(f"  request {i}, returned at concurrency/repeat {', '.join(at)}:")
                print("    " + texts[(i, key[1])].replace("\n", "\n    "))
                print(f"    send it alone: {curl_line(args, reqs[i][0], reqs[i][1], model)}")
    verdict_totals = {servers.COUNTS[v]: sum(s[servers.COUNTS[v]] for s in summaries) for v in servers.VERDICTS}
    print(f"{len(reqs)} requests x {len(levels)} runs: " + ", ".join(f"{v} {c}" for v, c in verdict_totals.items())
          + f"; {sum(s['verdict'] == 'diverged' for s in per_request)} requests diverged at least once")
    out = {"mode": "server", "server": args.server, "api": args.api, "model": model, "prompts": len(reqs),
           "max_new_tokens": hi, "engine_dtype": dtype, "engine_dtype_from": how, "oracle_dtype": args.dtype,
           "tolerance": args.tolerance, "noise": noise_text, "repeat": args.repeat, "ok": ok,
           "concurrency": summaries}
    if args.json:
        out["requests"] = [s | {"prompt_ids": p, "max_new_tokens": m,
                                "runs": [{"concurrency": n, "repeat": r} | o.json() | {"output_ids": o.output_ids}
                                         | ({"report": report_json(rep)} if rep is not None and o.verdict == "diverged" else {})
                                         for (n, r), (o, rep) in zip(levels, runs[i])]}
                           for i, ((p, m), s) in enumerate(zip(reqs, per_request))]
    print(json.dumps(out))
    return 0 if ok else 1


def judge_replies(target, parsed: list, dtype, args, tok) -> tuple:
    """Every reply of every run judged with one noise (measured over the run's distinct outputs, and the logprobs of
    every reply that has them) -> (reports [run][request] (None on an error), the readable report per (request,
    output), the noise's description). Our logits are computed per distinct output and not kept (a large vocabulary)."""
    keys = {}
    for run in parsed:
        for o, case in run:
            if case is not None:
                keys.setdefault((o.index, tuple(case.output_ids)), []).append(case)
    firsts = [cs[0] for cs in keys.values()]
    if not firsts:
        return [[None] * len(run) for run in parsed], {}, "none measured (no reply to judge)"
    if args.tolerance is not None:
        rn = RunNoise(TL.Noise("fixed", dtype, fixed=args.tolerance))
    else:
        take, n = [], 0
        for c in firsts:
            if n >= args.noise_positions:
                break
            take.append(c)
            n += len(c.output_ids)
        rn = run_noise(target, take, [oracle_logits(target, c) for c in take], dtype, None, args.noise_positions)
        with_lp = [(key, c) for key, cs in keys.items() for c in cs if c.logprobs is not None]
        if with_lp:
            disc, tops, z_of = [], [], {}
            for key, c in with_lp:
                if key not in z_of:
                    z_of = {key: oracle_logits(target, c)}        # one distinct output's logits at a time
                disc.append(TL.discrepancies(z_of[key], c.logprobs, c.output_ids))
                tops.append(z_of[key].max(-1).values.cpu())
            rn.logprobs = TL.engine_noise(disc, tops, rn.reference)
    texts, by_case = {}, {}
    for key, cs in keys.items():
        z = oracle_logits(target, cs[0])
        for c in cs:
            rep = judge_case(c, z, rn.of(c))
            by_case[id(c)] = rep
            texts.setdefault(key, report_text(rep, c, tok))
            del rep.judge
    reports = [[by_case[id(case)] if case is not None else None for _, case in run] for run in parsed]
    noise_text = rn.reference.describe() + (f"; with the engine's logprobs: {rn.logprobs.describe()}" if rn.logprobs else "")
    return reports, texts, noise_text


# ---- Command line ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=options.HelpFormatter)
    p.add_argument("trace", nargs="*", help="trace files (JSON object, list, or JSON lines)")
    p.add_argument("--target", default=None, help="the Qwen3.5 checkpoint the engine ran (folder or Hugging Face repo id; "
                                                  "default: the embedded tiny target)")
    p.add_argument("--draft", default=None, help="--export only: the drafter for the DFlash traces (default: the embedded one "
                                                 "with the embedded target)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="our precision for the teacher-forced pass")
    p.add_argument("--weight-dtype", choices=list(options.WEIGHT_DTYPES), default="auto",
                   help="how our target's weights are kept (options.pick_weights): auto (default), a bfloat16 or float16 "
                        "checkpoint's weights as stored, widened exactly as each product reads them (the verdicts of "
                        "--weight-dtype float32, which widens every weight at load, at half the memory)")
    p.add_argument("--engine-dtype", choices=sorted(DTYPES), default=None,
                   help="the engine's precision, which sets the noise the tolerance allows, where the trace has no `dtype` "
                        "(--server: where the engine does not say; llama-server's /props is asked); default: bfloat16, "
                        "said in the report")
    p.add_argument("--tolerance", type=float, default=None,
                   help="a fixed tolerance in logits, instead of the noise measured (our own evaluations in the engine's "
                        "dtype, or the engine's logprobs: tolerance.py)")
    p.add_argument("--noise-positions", type=int, default=TL.POSITIONS, metavar="N",
                   help="output positions our own evaluations in the engine's dtype are measured on (the reference noise)")
    p.add_argument("--only", type=int, default=None, metavar="I", help="judge only case I (0-based) of the trace files")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--json", action="store_true", help="the last stdout line: one JSON object with every case's findings")
    p.add_argument("--calibrate", action="store_true", help="instead of judging: the noise of our own evaluations in "
                                                            "--engine-dtype over the traces' sequences (the reference noise)")
    p.add_argument("--dump-layers", metavar="DIR", help="write every layer's hidden states, the logits and the GDN states "
                                                        "after --prompt-ids as safetensors, with a README of the names")
    p.add_argument("--prompt-ids", help="with --dump-layers: comma-separated token ids")
    p.add_argument("--export", metavar="DIR", help="write the conformance pack: prompts, our greedy outputs and DFlash traces "
                                                   "at several block sizes, and how to produce an engine's traces")
    s = p.add_argument_group("against a running engine (--server; docs/usage.md#against-a-running-server)")
    s.add_argument("--server", metavar="URL", help="send greedy requests to this server, judge every reply token by token")
    s.add_argument("--api", choices=sorted(servers.APIS), default=None,
                   help="the request shape: llama.cpp's /completion, the OpenAI-compatible /v1/completions with token ids "
                        "(vLLM, SGLang), SGLang's /generate (default: openai)")
    s.add_argument("--concurrency", default=None, help="requests in flight, one run per count, comma-separated (default: 1,8,32)")
    s.add_argument("--prompts-file", metavar="FILE.jsonl", help="the prompts: generate.py's format, one JSON object a line "
                                                                "with prompt or prompt_ids (or messages), optionally max_new_tokens")
    s.add_argument("--heldout", type=int, default=None, help="the prompts: this many held-out stdlib prompts (tools/bench.py's; "
                                                             "the default set, 32)")
    s.add_argument("--dataset", default=None, metavar="NAMES", help="the prompts: the first turns of tools/bench.py's sets (comma-separated)")
    s.add_argument("--limit", type=int, default=None, help="with --dataset: samples per set")
    s.add_argument("--pack", action="store_true", help="the prompts: the conformance pack's (--export)")
    s.add_argument("--max-new-tokens", type=int, default=None, help="tokens asked per request where the prompt line sets none "
                                                                    "(default 128)")
    s.add_argument("--model", default=None, help="the OpenAI API's \"model\" (default: the first the server lists at /v1/models)")
    s.add_argument("--timeout", type=float, default=None, help="seconds to wait for one reply (default 600)")
    s.add_argument("--save-traces", metavar="DIR", default=None, help="write every reply as a trace file check.py "
                   "replays (DIR/concurrency-N.jsonl, and one file per request that is not identical to ours)")
    s.add_argument("--repeat", type=int, default=None, metavar="R", help="send the requests R times at each concurrency "
                   "(default 1): per request, its distinct outputs and whether it diverges only in company")
    s.add_argument("--logprobs", type=int, default=None, metavar="N", help="ask for each token's top N log-probabilities, "
                   "the engine's own noise (default 8; 0: ids only)")
    args = p.parse_args(argv)
    modes = sum(bool(m) for m in (args.dump_layers, args.export, args.server)) + bool(args.trace)
    if modes != 1:
        p.error("give trace files to check, or --server URL, or --dump-layers DIR, or --export DIR (one of them)")
    server_only = {"--api": args.api, "--concurrency": args.concurrency, "--prompts-file": args.prompts_file,
                   "--heldout": args.heldout, "--dataset": args.dataset, "--limit": args.limit, "--pack": args.pack or None,
                   "--max-new-tokens": args.max_new_tokens, "--model": args.model, "--timeout": args.timeout,
                   "--save-traces": args.save_traces, "--repeat": args.repeat, "--logprobs": args.logprobs}
    given = [f for f, v in server_only.items() if v is not None]
    if given and not args.server:
        p.error(f"{given[0]} goes with --server URL")
    if sum(v is not None for v in (args.prompts_file, args.heldout, args.dataset, args.pack or None)) > 1:
        p.error("give one prompt set: --prompts-file, --heldout, --dataset or --pack")
    if args.limit is not None and not args.dataset:
        p.error("--limit goes with --dataset")
    if args.calibrate and args.server:
        p.error("--calibrate reads trace files")
    args.api, args.concurrency = args.api or "openai", args.concurrency or "1,8,32"
    args.max_new_tokens = 128 if args.max_new_tokens is None else args.max_new_tokens
    args.timeout = 600.0 if args.timeout is None else args.timeout
    args.repeat = 1 if args.repeat is None else args.repeat
    args.logprobs = 8 if args.logprobs is None else args.logprobs
    if args.repeat < 1 or args.logprobs < 0:
        p.error("--repeat must be >= 1, --logprobs >= 0")
    if args.calibrate and not args.trace:
        p.error("--calibrate reads trace files")
    if args.calibrate:
        args.engine_dtype = args.engine_dtype or "bfloat16"
    if args.dump_layers and not args.prompt_ids:
        p.error("--dump-layers needs --prompt-ids")
    if args.tolerance is not None and not args.tolerance >= 0:
        p.error("--tolerance must be >= 0")
    if args.noise_positions < 1:
        p.error("--noise-positions must be >= 1")
    if args.only is not None and not args.trace:
        p.error("--only goes with trace files")
    return args


def verdict_counts(reports: list) -> dict:
    return {v: sum(r.verdict == v for r in reports) for v in VERDICTS}


def replay_line(target_path: str, source: str, index: int | None, engine_dtype: str | None, tolerance) -> str:
    """The one command that judges one case again."""
    import shlex
    line = f"python check.py --target {shlex.quote(target_path)} {shlex.quote(source)}"
    if index is not None:
        line += f" --only {index}"
    if engine_dtype:
        line += f" --engine-dtype {engine_dtype}"
    return line + (f" --tolerance {tolerance:g}" if tolerance is not None else "")


def check_main(args, target, tok) -> int:
    cases = [c for path in args.trace for c in read_cases(path)]
    if args.only is not None:
        if not 0 <= args.only < len(cases):
            raise CheckError(f"--only {args.only}: the trace files hold {len(cases)} cases (0 .. {len(cases) - 1})")
        cases = [cases[args.only]]
    for c in cases:
        validate(c, target.cfg)
    engine_dtype = DTYPES[args.engine_dtype or "bfloat16"]
    reports = judge_cases(target, cases, engine_dtype, args.tolerance, args.noise_positions)
    seen = set()
    for rep, case in zip(reports, cases):
        dtype = case.dtype if case.dtype in DTYPES else args.engine_dtype or "bfloat16"
        if (dtype, rep.noise["basis"]) not in seen:
            seen.add((dtype, rep.noise["basis"]))
            how = ("the trace's dtype" if case.dtype in DTYPES else "--engine-dtype" if args.engine_dtype else
                   "assumed: the trace names no dtype; give --engine-dtype")
            print(f"noise basis {dtype} ({how}): {rep.noise_text}")
        single = len(args.trace) == 1 and args.only is None and len(cases) == 1
        rep.reproducer = replay_line(target.path, case.source, None if single else case.index,
                                     None if case.dtype in DTYPES else args.engine_dtype, args.tolerance)
    for rep, case in zip(reports, cases):
        print(report_text(rep, case, tok))
    ok = all(r.ok for r in reports)
    counts = verdict_counts(reports)
    print(f"{sum(r.ok for r in reports)}/{len(reports)} cases clean: " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if args.json:
        print(json.dumps({"ok": ok, "oracle_dtype": args.dtype, "tolerance": args.tolerance,
                          "verdicts": {k.replace("-", "_"): v for k, v in counts.items()},
                          "cases": [report_json(r) for r in reports]}))
    return 0 if ok else 1


def calibrate_main(args, target, device) -> int:
    """--calibrate: the reference noise of --engine-dtype measured over the traces' sequences (what a run of these
    traces would be judged with, without the engine's logprobs), per way of evaluating them."""
    cases = [c for path in args.trace for c in read_cases(path)]
    for c in cases:
        validate(c, target.cfg)
    dtype = DTYPES[args.engine_dtype]
    zs = [oracle_logits(target, c) for c in cases]
    n = run_noise(target, cases, zs, dtype, None, args.noise_positions).reference
    print(f"{args.engine_dtype}: {n.describe()}")
    print(json.dumps({"mode": "calibrate", "engine_dtype": args.engine_dtype} | n.json()))
    return 0


HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TARGET = os.path.join(HERE, "checkpoints", "tiny-qwen35")        # (generate.py's defaults: the embedded pair)
DEFAULT_DRAFT = os.path.join(HERE, "checkpoints", "tiny-qwen35-dflash")


def parse_id_list(text: str, flag: str) -> list:
    """'1,2,3' (commas or spaces) -> [1, 2, 3]; anything else one CheckError line."""
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise CheckError(f"{flag} takes comma-separated integer token ids, got {text!r}") from None
    if not ids:
        raise CheckError(f"{flag} is empty; give comma-separated token ids, e.g. 1,2,3")
    return ids


def writable_dir(path: str, flag: str) -> None:
    """The folder an option writes into: created if missing; an existing file, or a place where no folder can be
    made, is one CheckError line (before anything loads)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckError(f"{flag} {path} is an existing file; give a folder (created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckError(f"{flag} {path}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckError(f"{flag} {path}: the folder is not writable")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.server:
        server_flags_check(args)
    ids = parse_id_list(args.prompt_ids, "--prompt-ids") if args.dump_layers else None
    for flag, path in (("--dump-layers", args.dump_layers), ("--export", args.export),
                       ("--save-traces", args.save_traces)):
        if path:
            writable_dir(path, flag)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CheckError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    args.target = args.target or DEFAULT_TARGET
    target = ckpt.load_target(args.target, DTYPES[args.dtype], device, options.pick_weights(args.weight_dtype, DTYPES[args.dtype]))
    tok = ckpt.load_tokenizer(target.path)
    try:
        if args.dump_layers:
            bad = [t for t in ids if not 0 <= t < target.cfg.vocab_size]
            if bad or len(ids) > target.cfg.max_position_embeddings:
                raise CheckError(f"--prompt-ids: {f'ids {bad[:5]} are outside the vocabulary 0..{target.cfg.vocab_size - 1}' if bad else f'{len(ids)} ids exceed max_position_embeddings {target.cfg.max_position_embeddings}'}")
            names = dump_layers(target, ids, args.dump_layers)
            print(f"wrote {len(names)} tensors to {os.path.join(args.dump_layers, 'layers.safetensors')} (names: README.md there)")
            return 0
        if args.export:
            draft = args.draft or (DEFAULT_DRAFT if args.target == DEFAULT_TARGET else None)
            proposer = None
            if draft and draft.lower() != "none":
                proposer = engine.DrafterProposer(ckpt.load_drafter(draft, target.cfg, DTYPES[args.dtype], device), target)
            n = export_pack(target, proposer, tok, args.export)
            print(f"wrote {n} traces to {os.path.join(args.export, 'cases.jsonl')}; how to replay them: README.md there")
            return 0
        if args.calibrate:
            return calibrate_main(args, target, device)
        if args.server:
            return server_main(args, target, tok)
        return check_main(args, target, tok)
    except BrokenPipeError:
        raise
    except OSError as e:                 # a write that failed after the folder was checked (a full disk, a file removed)
        raise CheckError(f"cannot write {e.filename or 'a file'} ({e.strerror or e})") from None


def cli(argv=None) -> int:
    try:
        return main(argv)
    except (CheckError, M.CheckpointError, dflash.GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:              # the reader of stdout went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(cli())
