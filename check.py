"""The oracle as a tool: check another engine's output against this implementation, token by token.

    python check.py --target DIR_OR_REPO TRACE.json [--draft ...] [--dtype float32|float64] [--tolerance T]
                    [--engine-dtype bfloat16|float16|float32|float64] [--device cpu|cuda] [--json]
    python check.py --dump-layers DIR --target DIR_OR_REPO --prompt-ids 1,2,3
    python check.py --export DIR [--target ... --draft ...]
    python check.py --server URL --api llama.cpp|openai|sglang [--concurrency 1,8,32] [--prompts-file F.jsonl]

A TRACE is a JSON object, a JSON list of objects, or JSON lines. Each object has `prompt_ids` and `output_ids`
(the generated ids), optionally `draft_ids` (each verify step's proposals) with `acceptance_lengths` (tokens
committed per verify step, bonus included), and `temperature`, `top_p`, `top_k` (absent: greedy), `seed` and
`draft_rule` (sampled runs of this implementation) and `dtype` (the engine's, which sets the default tolerance).
`generate.py --json` output is a trace as it is. vLLM's and
SGLang's completion responses with token ids are read too (`read_cases`; the requests:
docs/usage.md#traces-from-vllm-and-sglang).

What it does (docs/method.md#checking-another-engine): prompt + output go through our target in one teacher-forced
forward, in the engine's own prefix, so every token is judged, also after a first difference. A greedy token is
a `match` (our argmax), a `tie` (not our argmax, but within the tolerance of our top logit: a legitimate flip of
a near-tie in the engine's precision) or a `divergence`. With drafts, each verify step's acceptance length must be
the longest prefix of its drafts that the target accepts (ties allowed), plus the bonus; otherwise the step is a
`wrong_acceptance`; a step whose accepted drafts are not the output tokens at their places is a `contradiction`
(the trace disagrees with itself). A sampled trace with a `seed` (generate.py's noise keyed by position, noise.py)
is judged token by token like a greedy one, over the noised scores `logit - T * ln E(seed, t, token)`: its tokens
are exactly determined. Without a seed, a sampled token outside the support of the target's distribution under
the trace's temperature / top-k / top-p is `impossible`. Exit code 0: every case clean; 1: something found; 2: bad
input. --server sends greedy requests to a running engine, N in flight, and judges every reply so (servers.py).
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
import model as M
import noise
import servers
from sampling import DRAFT_RULES

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ---- Tolerance --------------------------------------------------------------------------------------------
# Two runs of one model in a low precision take different tokens only where their roundings move the top-2
# margin across zero, so at such a place the reference's margin is at most what rounding can move it by. That is
# measured in rounding steps of the engine's dtype at the top logit's magnitude (rounding_step), since logits
# are rounded relative to their size. Calibration (`--calibrate`; docs/measurements.md#calibrating-the-tie-tolerance):
# a whole bf16 forward moved the margin by at most 1.65 bf16 steps on the embedded pair and 5.5 on a random
# 8-layer target, a float32 forward by up to 21 float32 steps. The defaults sit above both, for deeper models and
# kernels that sum in other orders: 8 bf16 / fp16 steps (0.5 logits at a top logit in [8, 16)), 64 float32 steps.
TOLERANCE_STEPS = {torch.bfloat16: 8.0, torch.float16: 8.0, torch.float32: 64.0, torch.float64: 64.0}
# Our own bf16 runs (DFlash against AR, one CPU) must part within NEAR_TIE_STEPS: bench.py --parting measures it,
# tests/test_near_ties.py requires it. Why 2: two runs choose differently only where their roundings move the
# top-2 margin m across 0, so |m| <= the larger of the two moves, measured at most 1.64 steps.
NEAR_TIE_STEPS = 2.0


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


def rounding_step(z: float, dtype) -> float:
    """The spacing of `dtype` numbers at magnitude |z|: eps * 2^floor(log2 |z|). bfloat16 keeps 8 significant
    bits, so a step is 2^-7 of |z| at a power of two and about 2^-8 of |z| just below the next one."""
    z = abs(z)
    if z < torch.finfo(dtype).tiny:
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(z))


@torch.inference_mode()
def teacher_forced_logits(ref: M.Qwen35, ids: list) -> torch.Tensor:
    """One plain causal forward of `ref` over ids (no cache) -> float64 logits [T, V]; row t predicts token t + 1.
    Logits that are not finite raise CheckError naming the checkpoint (finite_or_fail): no verdict can rest on them."""
    device = ref.embed_tokens.weight.device
    logits, _ = ref(torch.tensor([ids], device=device), torch.arange(len(ids), device=device))
    finite_or_fail(ref, logits[0])
    return logits[0].double()


def finite_or_fail(ref: M.Qwen35, logits: torch.Tensor) -> None:
    """Our own logits [T, V] hold a NaN or an infinity: one line that says so, with the checkpoint at fault and its
    first non-finite weight, or, where every weight is finite, that the forward overflowed in its dtype."""
    if bool(torch.isfinite(logits).all()):
        return
    row = int((~torch.isfinite(logits)).any(-1).nonzero()[0, 0])
    bad = next((n for n, p in ref.named_parameters() if not bool(torch.isfinite(p).all())), None)
    dtype = str(ref.embed_tokens.weight.dtype).replace("torch.", "")
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
    draft_rule: str = "coupled"                # how sampled drafts were verified (dflash.Sampling.draft_rule)

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
        cases.append(Case(_ids(prompt, "prompt_token_ids", where), _ids(out, "token_ids", where), name=f"{where} choice {i}"))
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
    return [Case(_ids(prompt, "prompt_ids", where), _ids(obj["output_ids"], "output_ids", where), drafts, accepted,
                 **sampling, name=where, block_size=block if isinstance(block, int) and block > 1 else None,
                 step_kinds=obj.get("step_kinds") if isinstance(obj.get("step_kinds"), list) else None, seed=seed)]


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
    return [c for i, o in enumerate(objs) for c in to_cases(o, f"{os.path.basename(path)}[{i}]")]


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


# ---- Judging ----------------------------------------------------------------------------------------------

@dataclass
class Report:
    """What check_case found in one case (the --json object, less `name`)."""
    name: str
    tokens: int
    sampled: bool
    matches: int = 0
    ties: int = 0
    divergences: list = field(default_factory=list)        # {index, engine_token, oracle_token, margin, steps}
    first_divergence: int | None = None
    steps_after_partial: int | None = None                 # steps from the last partial acceptance to it
    plain_after_partial: int | None = None                 # how many of those were plain steps (no drafts)
    rollback_signature: bool = False                       # it is the first token after a partial round (right_after_partial)
    wrong_acceptances: list = field(default_factory=list)  # {step, accepted, expected, at_least}
    contradictions: list = field(default_factory=list)     # {step, index, draft_token, output_token}
    impossible: list = field(default_factory=list)          # output indices
    log_prob: float | None = None

    @property
    def ok(self) -> bool:
        return not (self.divergences or self.wrong_acceptances or self.impossible or self.contradictions)


class Judge:
    """The teacher-forced logits of one case and how far each token is from our choice: z [n, V] float64, row t
    for output token t. Our choice is the argmax of the scores: the logits (greedy), or with a seed the noised
    scores `z - T * ln E(seed, position, token)` over the tokens top-k / top-p keep, whose argmax is exactly the
    draw dflash.draw makes. margin(t, tok) = top score - score of tok (0 for our choice), in logits;
    tolerance(t) in logits, from the rounding step at the row's top logit."""

    def __init__(self, z: torch.Tensor, tolerance, engine_dtype, scores: torch.Tensor | None = None):
        self.z, self.s = z, z if scores is None else scores
        self.top, self.top_logit = self.s.max(-1), z.max(-1).values
        self.engine_dtype, self.fixed = engine_dtype, tolerance

    def margin(self, t: int, tok: int) -> float:
        return float(self.top.values[t] - self.s[t, tok])

    def tolerance(self, t: int) -> float:
        if self.fixed is not None:
            return self.fixed
        return TOLERANCE_STEPS[self.engine_dtype] * rounding_step(float(self.top_logit[t]), self.engine_dtype)

    def steps(self, t: int, margin: float) -> float:
        return margin / rounding_step(float(self.top_logit[t]), self.engine_dtype)

    def greedy_ok(self, t: int, tok: int) -> bool:
        return self.margin(t, tok) <= self.tolerance(t)


def judge_greedy(j: Judge, case: Case, rep: Report) -> None:
    for t, tok in enumerate(case.output_ids):
        top = int(j.top.indices[t])
        m = j.margin(t, tok)
        if tok == top:
            rep.matches += 1
        elif m <= j.tolerance(t):
            rep.ties += 1
        else:
            rep.divergences.append({"index": t, "engine_token": tok, "oracle_token": top, "margin": m,
                                    "steps": j.steps(t, m)})
    rep.first_divergence = rep.divergences[0]["index"] if rep.divergences else None


def judge_drafts(j: Judge, case: Case, rep: Report) -> None:
    """Each verify step s commits output[c : c + a]; its drafts d propose positions c, c+1, ... The target accepts
    the longest prefix of d it would choose itself (ties allowed), then adds its own token: expected a. The engine's
    own prefix is the context throughout, so a draft at i < a - 1 is judged as the output token it became, and the
    first rejected draft d[a - 1] at the row where the engine's bonus went. The last step may stop early (max new
    tokens, a stop token): only accepting too much counts there."""
    c = 1
    for s, (d, a) in enumerate(zip(case.draft_ids, case.acceptance_lengths)):
        bad = next((i for i in range(a - 1) if d[i] != case.output_ids[c + i]), None)
        if bad is not None:          # the engine committed other tokens than the drafts it says it accepted
            rep.contradictions.append({"step": s, "accepted": a, "index": c + bad, "draft_token": d[bad],
                                       "output_token": case.output_ids[c + bad]})
            c += a
            continue
        ok = [j.greedy_ok(c + i, d[i]) for i in range(min(a, len(d)))]
        expected = next((i + 1 for i, g in enumerate(ok) if not g), len(ok) + 1)
        if expected < a or (expected > a and s < len(case.draft_ids) - 1):
            rep.wrong_acceptances.append({"step": s, "accepted": a, "expected": expected, "at_least": expected > a and a <= len(d)})
        c += a


def steps_after_partial(case: Case, index: int) -> tuple | None:
    """(steps, plain): how many steps after the last partial acceptance (a round that rejected a draft) the step
    holding output token `index` came, and how many of those were plain steps (adaptive speculation's: no drafts,
    nothing rejected); None without step information or without an earlier partial round. A divergence a step or
    two after a partial acceptance, in a run that was exact until then, points at state that was not rolled back
    (a hybrid target's linear-attention layers): right_after_partial says whether it is the first token there."""
    if case.acceptance_lengths is None or (case.draft_ids is None and case.block_size is None):
        return None
    c, last_partial, plain_since = 1, None, 0
    for s, a in enumerate(case.acceptance_lengths):
        if c <= index < c + a:
            return None if last_partial is None else (s - last_partial, plain_since)
        plain = case.step_kinds is not None and s < len(case.step_kinds) and case.step_kinds[s] == "plain"
        drafts = len(case.draft_ids[s]) if case.draft_ids is not None else case.block_size - 1
        if plain:
            plain_since += 1
        elif a < drafts + 1:
            last_partial, plain_since = s, 0
        c += a
    return None


def right_after_partial(case: Case, index: int) -> bool:
    """Whether output token `index` is the first one after a round that rejected a draft (a partial acceptance):
    the first token computed on the state that round left behind, where a linear-attention state that was not
    rolled back shows. A divergence later on, or inside a round, is no sign of it (a wrong token in the trace, a
    near-tie, another fault), so the hint says nothing there."""
    if case.acceptance_lengths is None or (case.draft_ids is None and case.block_size is None):
        return False
    c = 1
    for s, a in enumerate(case.acceptance_lengths):
        c += a                                                  # step s committed output[c - a : c]
        if c >= index:
            plain = case.step_kinds is not None and s < len(case.step_kinds) and case.step_kinds[s] == "plain"
            drafts = len(case.draft_ids[s]) if case.draft_ids is not None else case.block_size - 1
            return c == index and not plain and a < drafts + 1
    return False


def judge_sampled(j: Judge, case: Case, rep: Report) -> None:
    """Sampled tokens: the trace's log-probability under our distribution, and tokens no sampling with these
    settings could give. A token is outside the support only by more than the tolerance (rounding may move a
    token across the top-k or top-p edge)."""
    s = dflash.Sampling(case.temperature, case.top_p, case.top_k)
    p = dflash.sampling_probs(j.z, s).double()
    out = torch.tensor(case.output_ids, device=j.z.device)
    rep.log_prob = float(p.gather(1, out[:, None]).clamp_min(1e-300).log().sum())
    for t, tok in enumerate(case.output_ids):
        if outside_support(j.z[t], tok, s, j.tolerance(t)):
            rep.impossible.append(t)


def seeded_scores(z: torch.Tensor, case: Case) -> torch.Tensor:
    """The noised scores of a seeded sampled case: z [n, V] -> z - T ln E(seed, position, token) where the
    trace's top-k / top-p keep the token, -inf elsewhere. Output token t sits at position len(prompt) + t, and
    its draw in the engine is argmax p / E = argmax of these scores (p = softmax(z / T) restricted)."""
    s = dflash.Sampling(case.temperature, case.top_p, case.top_k)
    pos = len(case.prompt_ids) + torch.arange(z.shape[0], device=z.device)
    e = noise.vocab_noise(torch.tensor(noise.seed_key(case.seed), device=z.device), pos,
                          noise.vocab_keys(z.shape[-1], z.device)).double()
    kept = dflash.sampling_probs(z, s) > 0
    return torch.where(kept, z - case.temperature * e.log(), float("-inf"))


def outside_support(z: torch.Tensor, tok: int, s: dflash.Sampling, tol: float) -> bool:
    """Whether token tok could not be drawn from logits z [V] under s, even with its logit raised by tol: below
    the k-th largest logit, or after the smallest set of higher tokens that already reaches top_p."""
    lifted = z[tok] + tol
    if 0 < s.top_k < z.shape[0] and lifted < z.topk(s.top_k).values[-1]:
        return True
    if s.top_p < 1:
        p = dflash.sampling_probs(z, dflash.Sampling(s.temperature, 1.0, s.top_k)).double()
        return float(p[z > lifted].sum()) >= s.top_p
    return False


def check_case(target: M.Qwen35, case: Case, tolerance: float | None, engine_dtype) -> Report:
    """Teacher-force prompt + output through the target once and judge every output token (and step)."""
    validate(case, target.cfg)
    ids = case.prompt_ids + case.output_ids[:-1]
    z = teacher_forced_logits(target, ids)[len(case.prompt_ids) - 1:]
    dtype = DTYPES[case.dtype] if case.dtype in DTYPES else engine_dtype
    j = Judge(z, tolerance, dtype, seeded_scores(z, case) if case.seeded else None)
    rep = Report(case.name, len(case.output_ids), case.temperature > 0)
    if rep.sampled:
        judge_sampled(j, case, rep)
    if not rep.sampled or case.seeded:             # every token determined: judged one by one
        judge_greedy(j, case, rep)
        if case.draft_ids is not None:
            judge_drafts(j, case, rep)
        if rep.first_divergence is not None:
            rep.steps_after_partial, rep.plain_after_partial = steps_after_partial(case, rep.first_divergence) or (None, None)
            rep.rollback_signature = right_after_partial(case, rep.first_divergence)
    rep.judge = j                                   # for the readable report; not part of the JSON
    return rep


# ---- Output -----------------------------------------------------------------------------------------------

def report_json(rep: Report) -> dict:
    keys = ("name", "tokens", "sampled", "matches", "ties", "divergences", "first_divergence", "steps_after_partial",
            "plain_after_partial", "rollback_signature", "wrong_acceptances", "contradictions", "impossible", "log_prob")
    return {k: getattr(rep, k) for k in keys} | {"ok": rep.ok}


def show(tok, ids: list) -> str:
    return repr(tok.decode(ids, skip_special_tokens=False)) if tok is not None else str(ids)


def report_text(rep: Report, case: Case, tok) -> str:
    """The readable report of one case: counts, and the first problem with its context and our top-5."""
    counts = f"{rep.matches} match, {rep.ties} tie, {len(rep.divergences)} divergence"
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
    lines = [head + (" -> OK" if rep.ok else " -> NOT OK")]
    if rep.sampled and not case.seeded:
        lines.append("  (no token-by-token check: " + ("the ratio rule's text is not determined by the seed alone)"
                                                       if case.seed is not None else "the trace has no seed)"))
    j = rep.judge
    t = rep.first_divergence if rep.first_divergence is not None else (rep.impossible[0] if rep.impossible else None)
    if t is not None:
        out, ours = case.output_ids, int(j.top.indices[t])
        vals, idx = j.z[t].topk(5)
        lines.append(f"  first {'divergence' if rep.divergences else 'impossible token'} at output token {t}: "
                     f"engine {out[t]} {show(tok, [out[t]])}, ours {ours} {show(tok, [ours])}{' (our draw)' if case.seeded else ''}, "
                     f"margin {j.margin(t, out[t]):.5f} logits = {j.steps(t, j.margin(t, out[t])):.1f} steps (tolerance {j.tolerance(t):.5f})")
        lines.append(f"  text before it: ...{show(tok, (case.prompt_ids + out)[max(0, len(case.prompt_ids) + t - 12):len(case.prompt_ids) + t])}")
        lines.append("  our top-5 logits: " + ", ".join(f"{int(i)} {show(tok, [int(i)])} {float(v):.4f}" for v, i in zip(vals, idx)))
        if rep.rollback_signature:
            lines.append("  it is the first token after a round that rejected a draft: the signature of a linear-attention "
                         "state not rolled back after a rejected draft")
    for w in rep.wrong_acceptances[:3]:
        lines.append(f"  step {w['step']}: committed {w['accepted']} tokens, the target accepts "
                     f"{'at least ' if w['at_least'] else ''}{w['expected']}")
    for c in rep.contradictions[:3]:
        lines.append(f"  step {c['step']}: commits {c['accepted']} tokens, so its drafts up to output token {c['index']} "
                     f"were accepted, but draft {c['draft_token']} {show(tok, [c['draft_token']])} is not the output token "
                     f"there, {c['output_token']} {show(tok, [c['output_token']])}: the engine committed other tokens than it "
                     "accepted (if every step says so, its draft_ids may be recorded for other positions)")
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
    cache = M.TargetCache(target.cfg, len(ids), target.embed_tokens.weight.dtype, device, max_block=1)
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
                                    dtype=str(target.embed_tokens.weight.dtype).replace("torch.", "")))
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
            runs = [("ar", 1, dflash.run(target, ids, max_new))]
            runs += [("dflash", b, dflash.run(target, ids, max_new, (), proposer, b)) for b in EXPORT_BLOCKS if proposer]
            for mode, b, res in runs:
                fh.write(json.dumps({"prompt": text, "prompt_ids": ids, "output_ids": res.output_ids, "mode": mode,
                                     "block_size": b, "draft_ids": res.draft_ids if mode == "dflash" else None,
                                     "acceptance_lengths": res.acceptance_lengths if mode == "dflash" else None,
                                     "max_new_tokens": max_new, "temperature": 0.0,
                                     "dtype": str(target.embed_tokens.weight.dtype).replace("torch.", "")}) + "\n")
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
    zr, zm = teacher_forced_logits(ref, ids)[start:], teacher_forced_logits(run_model, ids)[start:]
    idx = zr.topk(2, dim=-1).indices
    mr, mm = zr.gather(1, idx), zm.gather(1, idx)
    return ((mm[:, 0] - mm[:, 1]) - (mr[:, 0] - mr[:, 1])).abs().cpu(), zr.max(-1).values.cpu()


def margin_moves(target_lo: M.Qwen35, target_ref: M.Qwen35, case: Case) -> torch.Tensor:
    """margin_errors over a case's output rows, in rounding steps of target_lo's dtype at the top logit -> [n]."""
    moved, top = margin_errors(target_lo, target_ref, case.prompt_ids + case.output_ids[:-1], len(case.prompt_ids) - 1)
    dtype = target_lo.embed_tokens.weight.dtype
    return moved / torch.tensor([rounding_step(float(v), dtype) for v in top], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# --parting: where greedy DFlash and greedy AR part in a low precision, and how near a tie the target was there
# ---------------------------------------------------------------------------------------------------------------

# `python bench.py --parting` runs parting_main. A parting is a near-tie when both runs' tokens lie within
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
    z = teacher_forced_logits(ref, prompt + ar_out[:i])[-1]
    top, a, d = int(z.argmax()), ar_out[i], dflash_out[i]
    return Parting(i, d, a, top, float(z[top] - torch.minimum(z[a], z[d])), float(z[top]))


def near_tie(p: Parting, dtype, steps: float = NEAR_TIE_STEPS) -> bool:
    """Whether both runs' tokens lay within `steps` rounding steps of `dtype` of the reference's best logit: a
    choice either run could legitimately make in that precision."""
    return p.steps(dtype) <= steps


def position_margins(ref: M.Qwen35, prompt: list, out: list) -> tuple:
    """`ref` teacher-forced over prompt + out; at each output position -> (its top-2 logit margin [n], its top
    logit [n], its top logit minus the logit of out's token [n]: 0 where out took its argmax)."""
    z = teacher_forced_logits(ref, prompt + out[:-1])[len(prompt) - 1:]
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
    from generate import DTYPES, pick_dtype
    import prompts as P
    dtype = pick_dtype(args.dtype, device)
    target = ckpt.load_target(args.target, dtype, device)
    proposer = dflash.DrafterProposer(ckpt.load_drafter(args.draft, target.cfg, dtype, device), target)
    refs = {name: ckpt.load_target(args.target, DTYPES[name], device) for name in ("float32", "float64")}
    block = args.block_size or proposer.max_block_size
    prompts = P.from_args(args, ckpt.load_tokenizer(target.path), target.path)
    stops = ckpt.stop_token_ids(target.path, target.cfg)
    capacity = max(len(p) for p in prompts) + args.max_new_tokens + block
    import tables                  # generate.py's engine for single requests (eager)
    ar_engine = tables.single_engine(args, target, None, 1, capacity, False, eager=True)
    sp_engine = tables.single_engine(args, target, proposer, block, capacity, False, eager=True)
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
        import generate
        try:
            lines = generate.read_requests(args.prompts_file, prompt_line_args(args))
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
    --dataset's samples, else --heldout (default 32) held-out prompts (bench.py's)."""
    import generate
    import prompts as P
    if args.prompts_file is None and tok is None:
        raise CheckError(f"{target.path} has no tokenizer.json to make the prompts; give --prompts-file with prompt_ids")
    if args.prompts_file is not None:
        ns, out = prompt_line_args(args), []
        template, specials = generate.chat_template_of(ns, target.path)

        def no_images():
            raise dflash.GenerationError("check.py --server sends token ids only; drop the line's \"images\"")
        for i, (n, line) in enumerate(generate.read_requests(args.prompts_file, ns)):
            try:
                req, _ = generate.request_of(line, i, ns, tok, template, specials, None, [], no_images)
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


def judge_reply(target, reply, prompt: list, asked: int, args, cache: dict) -> tuple:
    """One reply -> (servers.Outcome, its Report and Case, or None on an error). Identical outputs of one prompt
    (the same request at several concurrencies) are judged once (cache)."""
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
    key = (tuple(prompt), tuple(case.output_ids))
    if key not in cache:
        cache[key] = check_case(target, case, args.tolerance, DTYPES[args.judge_dtype])
    rep = cache[key]
    out.output_ids, out.first_divergence, out.divergences = case.output_ids, rep.first_divergence, len(rep.divergences)
    out.first_difference = next((t for t, x in enumerate(case.output_ids) if x != int(rep.judge.top.indices[t])), None)
    out.verdict = "wrong" if rep.divergences else "near_tie" if out.first_difference is not None else "equal"
    return out, (rep, case)


def outcome_line(o, found, tok) -> str:
    """One line for a request that is not plainly equal: failed, wrong, a near-tie, or truncated."""
    if o.verdict == "error":
        return f"  request {o.index}: failed: {o.error}"
    line = f"  request {o.index}: {o.verdict.replace('_', '-')}"
    if o.verdict == "wrong":
        line += f" from output token {o.first_divergence} ({o.divergences} divergence{'s' if o.divergences != 1 else ''})"
    elif o.verdict == "near_tie":
        rep, case = found
        t = o.first_difference
        x, ours, m = case.output_ids[t], int(rep.judge.top.indices[t]), rep.judge.margin(t, case.output_ids[t])
        line += (f" at output token {t}: engine {x} {show(tok, [x])}, ours {ours} {show(tok, [ours])}, margin {m:.5f} "
                 f"logits = {rep.judge.steps(t, m):.2f} steps (tolerance {rep.judge.tolerance(t):.5f})")
    if o.truncated:
        line += f"; truncated: {len(o.output_ids)} of {o.asked} tokens (the server's reason for stopping: {o.finish})"
    return line


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
        for o, found in judged:
            if found is None:
                continue
            trace = {"name": f"request {o.index} ({label})", "prompt_ids": reqs[o.index][0], "output_ids": o.output_ids,
                     "dtype": dtype, "engine": args.server, "api": args.api}
            fh.write(json.dumps(trace) + "\n")
            if o.verdict != "equal":
                files[o.index] = os.path.join(out_dir, f"request-{o.index}-{label}.json")
                with open(files[o.index], "w") as one:
                    json.dump(trace, one)
    return files


def server_main(args, target, tok) -> int:
    """--server: every prompt sent at each --concurrency, every reply judged; per concurrency the counts, each wrong
    request's full report and the engine against itself at the first concurrency; the last line one JSON object
    (with --json every request's prompt and output ids)."""
    reqs = server_prompts(args, target, tok)
    for i, (p, m) in enumerate(reqs):
        bad = [t for t in p if not 0 <= t < target.cfg.vocab_size]
        if not p or bad or len(p) + m > target.cfg.max_position_embeddings:
            raise CheckError(f"prompt {i}: empty, ids outside the vocabulary ({bad[:3]}), or prompt + {m} new tokens "
                             f"past max_position_embeddings {target.cfg.max_position_embeddings}")
    api = servers.APIS[args.api]
    model = args.model or (servers.served_model(args.server) if args.api == "openai" else None)
    dtype, how = engine_dtype_of(args)
    args.judge_dtype = dtype
    tol = (f"{args.tolerance:g} logits (--tolerance)" if args.tolerance is not None else
           f"{TOLERANCE_STEPS[DTYPES[dtype]]:g} {dtype} rounding steps at the top logit")
    lo, hi = min(m for _, m in reqs), max(m for _, m in reqs)
    print(f"{args.server} ({args.api} API{f', model {model}' if model else ''}): {len(reqs)} prompts, greedy, "
          f"{lo if lo == hi else f'{lo}-{hi}'} new tokens each; noise basis {dtype} ({how}); tie tolerance {tol}", flush=True)
    sent = {n: servers.send_all(args.server, api, reqs, n, args.timeout, model) for n in args.levels}
    cache, levels, ok = {}, [], True
    runs = [[] for _ in reqs]
    print(f"judging {sum(len(r) for r, _, _ in sent.values())} replies ...", file=sys.stderr, flush=True)
    for n, (replies, most, seconds) in sent.items():
        judged = [judge_reply(target, r, *reqs[r.index], args, cache) for r in replies]
        outcomes = [o for o, _ in judged]
        ref = (levels[0]["n"], levels[0]["outcomes"]) if levels else None
        summary = servers.level_summary(n, outcomes, replies, most, seconds, ref)
        ok &= summary["wrong"] == summary["errors"] == summary["truncated"] == 0
        label = f"concurrency-{n}"
        files = save_traces(args.save_traces, label, judged, reqs, dtype, args) if args.save_traces else {}
        print(servers.level_text(summary))
        for o, found in judged:
            if o.verdict == "wrong":               # every wrong request's full report (a report judged once for an
                rep, case = found                  # identical output keeps its first name)
                text = f"request {o.index}" + report_text(rep, case, tok)[len(rep.name):]
                print("  " + text.replace("\n", "\n  "))
                if o.index in files:
                    print(f"    replay: python check.py --target {target.path} {files[o.index]}")
            elif o.verdict != "equal" or o.truncated:
                print(outcome_line(o, found, tok))
            runs[o.index].append({"concurrency": n} | o.json() | {"output_ids": o.output_ids})
        levels.append(summary | {"outcomes": outcomes})
    out = {"mode": "server", "server": args.server, "api": args.api, "model": model, "prompts": len(reqs),
           "max_new_tokens": hi, "engine_dtype": dtype, "engine_dtype_from": how, "oracle_dtype": args.dtype,
           "tolerance": args.tolerance, "ok": ok,
           "concurrency": [{k: v for k, v in s.items() if k != "outcomes"} for s in levels]}
    if args.json:
        out["requests"] = [{"index": i, "prompt_ids": p, "max_new_tokens": m, "runs": runs[i]} for i, (p, m) in enumerate(reqs)]
    print(json.dumps(out))
    return 0 if ok else 1


# ---- Command line ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    import generate
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=generate.HelpFormatter)
    p.add_argument("trace", nargs="*", help="trace files (JSON object, list, or JSON lines)")
    p.add_argument("--target", default=None, help="the Qwen3.5 checkpoint the engine ran (folder or Hugging Face repo id; "
                                                  "default: the embedded tiny target)")
    p.add_argument("--draft", default=None, help="--export only: the drafter for the DFlash traces (default: the embedded one "
                                                 "with the embedded target)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="our precision for the teacher-forced pass")
    p.add_argument("--engine-dtype", choices=sorted(DTYPES), default=None,
                   help="the engine's precision, which sets the noise the tolerance allows, where the trace has no `dtype` "
                        "(--server: where the engine does not say; llama-server's /props is asked); default: bfloat16, "
                        "said in the report")
    p.add_argument("--tolerance", type=float, default=None,
                   help="a fixed tie tolerance in logits (default: TOLERANCE_STEPS rounding steps of the engine's dtype at the top logit)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--json", action="store_true", help="the last stdout line: one JSON object with every case's findings")
    p.add_argument("--calibrate", action="store_true", help="instead of judging: how far our own forward in --engine-dtype "
                                                            "moves the top-2 margins of the traces' tokens against float64, in rounding steps")
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
    s.add_argument("--heldout", type=int, default=None, help="the prompts: this many held-out stdlib prompts (bench.py's; "
                                                             "the default set, 32)")
    s.add_argument("--dataset", default=None, metavar="NAMES", help="the prompts: the first turns of bench.py's sets (comma-separated)")
    s.add_argument("--limit", type=int, default=None, help="with --dataset: samples per set")
    s.add_argument("--pack", action="store_true", help="the prompts: the conformance pack's (--export)")
    s.add_argument("--max-new-tokens", type=int, default=None, help="tokens asked per request where the prompt line sets none "
                                                                    "(default 128)")
    s.add_argument("--model", default=None, help="the OpenAI API's \"model\" (default: the first the server lists at /v1/models)")
    s.add_argument("--timeout", type=float, default=None, help="seconds to wait for one reply (default 600)")
    s.add_argument("--save-traces", metavar="DIR", default=None, help="write every reply as a trace file check.py "
                   "replays (DIR/concurrency-N.jsonl, and one file per request that is not identical to ours)")
    args = p.parse_args(argv)
    modes = sum(bool(m) for m in (args.dump_layers, args.export, args.server)) + bool(args.trace)
    if modes != 1:
        p.error("give trace files to check, or --server URL, or --dump-layers DIR, or --export DIR (one of them)")
    server_only = {"--api": args.api, "--concurrency": args.concurrency, "--prompts-file": args.prompts_file,
                   "--heldout": args.heldout, "--dataset": args.dataset, "--limit": args.limit, "--pack": args.pack or None,
                   "--max-new-tokens": args.max_new_tokens, "--model": args.model, "--timeout": args.timeout,
                   "--save-traces": args.save_traces}
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
    if args.calibrate and not args.trace:
        p.error("--calibrate reads trace files")
    if args.calibrate:
        args.engine_dtype = args.engine_dtype or "bfloat16"
    if args.dump_layers and not args.prompt_ids:
        p.error("--dump-layers needs --prompt-ids")
    if args.tolerance is not None and not args.tolerance >= 0:
        p.error("--tolerance must be >= 0")
    return args


def check_main(args, target, tok) -> int:
    cases = [c for path in args.trace for c in read_cases(path)]
    for c in cases:
        validate(c, target.cfg)
    engine_dtype = DTYPES[args.engine_dtype or "bfloat16"]
    reports = [check_case(target, c, args.tolerance, engine_dtype) for c in cases]
    for rep, case in zip(reports, cases):
        print(report_text(rep, case, tok))
    ok = all(r.ok for r in reports)
    print(f"{sum(r.ok for r in reports)}/{len(reports)} cases clean")
    if args.json:
        print(json.dumps({"ok": ok, "oracle_dtype": args.dtype, "tolerance": args.tolerance,
                          "cases": [report_json(r) for r in reports]}))
    return 0 if ok else 1


def calibrate_main(args, target, device) -> int:
    lo = ckpt.load_target(args.target, DTYPES[args.engine_dtype], device)
    ref = ckpt.load_target(args.target, torch.float64, device)
    cases = [c for path in args.trace for c in read_cases(path)]
    for c in cases:
        validate(c, target.cfg)
    moved = torch.cat([margin_moves(lo, ref, c) for c in cases])
    q = torch.quantile(moved, torch.tensor([0.5, 0.9, 0.99, 1.0], dtype=torch.float64)).tolist()
    print(f"{args.engine_dtype} forward vs float64 over {len(moved)} positions: top-2 margin moved by (median, 90%, 99%, max) "
          f"{[round(v, 3) for v in q]} rounding steps; default tolerance {TOLERANCE_STEPS[DTYPES[args.engine_dtype]]:g} steps")
    print(json.dumps({"mode": "calibrate", "engine_dtype": args.engine_dtype, "positions": len(moved),
                      "moved_steps_quantiles": dict(zip(["median", "p90", "p99", "max"], q)),
                      "tolerance_steps": TOLERANCE_STEPS[DTYPES[args.engine_dtype]]}))
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
    target = ckpt.load_target(args.target, DTYPES[args.dtype], device)
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
                proposer = dflash.DrafterProposer(ckpt.load_drafter(draft, target.cfg, DTYPES[args.dtype], device), target)
            n = export_pack(target, proposer, tok, args.export)
            print(f"wrote {n} traces to {os.path.join(args.export, 'cases.jsonl')}; how to replay them: README.md there")
            return 0
        if args.calibrate:
            return calibrate_main(args, target, device)
        if args.server:
            return server_main(args, target, tok)
        return check_main(args, target, tok)
    except OSError as e:                 # a write that failed after the folder was checked (a full disk, a file removed)
        raise CheckError(f"cannot write {e.filename or 'a file'} ({e.strerror or e})") from None


def cli(argv=None) -> int:
    try:
        return main(argv)
    except (CheckError, M.CheckpointError, dflash.GenerationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
