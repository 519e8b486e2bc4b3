"""The checker's own test: a stand-in engine built from this project's engine (tests/fault_engine.py) with each of
the faults engines on hybrid targets have shipped injected one at a time, and clean runs of the same stand-in and of
transformers' greedy generate. Every faulty request whose output changed is diverged in float32 (token ids only),
and in bfloat16 wherever the engine's logprobs show its logits past the noise; no clean request is diverged
(float32, bfloat16, float16; batch 1 and 8, with drafts; with and without logprobs); the rollback diagnosis is
given for un-rolled-back state and never for faults of another kind."""
import pytest
import torch

import check
import checkpoint as ckpt
import engine
import policy
import prompts as P
from helpers import HAS_EMBEDDED_PAIR, embedded_pair
import fault_engine as FE

pytestmark = pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
NEW = 32                 # tokens per request: short, the suite runs on a loaded 2-core CPU
PROMPTS = 4
POSITIONS = 128          # output positions our own evaluations' noise is measured on (check.py's default: 256)
ROLLBACK = ("no_state_rollback", "no_conv_rollback", "block_rollback_undone")


@pytest.fixture(scope="module")
def setup(one_thread):
    target, drafter, _, _ = embedded_pair()
    prompts = P.heldout_prompts(ckpt.load_tokenizer(target.path), PROMPTS)
    pairs = {"float32": (target, drafter)}
    for name in ("bfloat16", "float16"):
        t = ckpt.load_target(target.path, check.DTYPES[name])
        pairs[name] = (t, ckpt.load_drafter(drafter.path, t.cfg, check.DTYPES[name]))
    return target, pairs, prompts


RUNS, REFERENCE = {}, {}         # runs and our own evaluations' noise per dtype, shared by the tests of the module


def run(pairs, prompts, dtype, fault=None, slots=4, logprobs=0, alternate=False, **kw) -> list:
    key = (dtype, fault, slots, logprobs, alternate, len(prompts), repr(sorted(kw.items())))
    if key not in RUNS:
        t, d = pairs[dtype]
        alternate = alternate or fault == "stale_state_slot"               # plain steps after rounds
        pol = policy.Alternate((16,)) if alternate else None
        eng = FE.StandIn(t, engine.DrafterProposer(d, t), 16, slots, 512, fault, pol, logprobs)
        RUNS[key] = FE.traces(eng, prompts, NEW, **kw)
    return RUNS[key]


def judge(target, traces: list, dtype: str) -> list:
    """The traces judged as one run, with our own evaluations' noise in dtype measured once for the module."""
    reps = check.judge_cases(target, cases(traces), None, positions=POSITIONS, reference=REFERENCE.get(dtype))
    REFERENCE.setdefault(dtype, reps[0].reference)
    return reps


def cases(traces: list) -> list:
    return [c for t in traces for c in check.to_cases(t, t["name"])]


def test_clean_runs_never_diverge(setup):
    """The stand-in without a fault, in float32, bfloat16 and float16, alone and 8 in flight, with drafts: some
    requests take near-ties the other way (bfloat16, float16), none is diverged, with or without its logprobs; and
    every verify step is consistent (a near-tie rejected is no wrong acceptance)."""
    target, pairs, prompts = setup
    for dtype in ("float32", "bfloat16", "float16"):
        traces = run(pairs, prompts[:3], dtype, slots=1, logprobs=8) + run(pairs, prompts, dtype, slots=8, logprobs=8)
        assert all(t["draft_ids"] and any(t["draft_ids"]) for t in traces)
        with_lp = judge(target, traces, dtype)
        ids_only = []                          # the same cases with token ids only: our logits computed once
        for rep, case in zip(with_lp, cases(traces)):
            case.logprobs = None
            ids_only.append(check.judge_case(case, rep.judge.z, REFERENCE[dtype]))
        for reps in (with_lp, ids_only):
            got = [r.verdict for r in reps]
            assert "diverged" not in got, (dtype, [(r.name, r.divergences[:1], r.wrong_acceptances[:1]) for r in reps if not r.ok])
        assert all(r.logprobs["beyond_noise"] == 0 for r in with_lp), dtype
        print(f"clean {dtype}: {sum(v == 'tie-break' for v in got)} of {len(got)} requests tie-break, the rest identical")


def changed(faulty: list, clean: list) -> list:
    return [f["output_ids"] != c["output_ids"] for f, c in zip(faulty, clean)]


def test_every_changed_faulty_request_is_diverged_in_float32(setup):
    """Each fault alone, 4 requests in flight, float32, token ids only: every request whose output the fault changed
    is diverged, and nothing else is; the drafter's context leaking between rows changes drafts only, so nothing."""
    target, pairs, prompts = setup
    clean = run(pairs, prompts, "float32")
    clean_alt = [t["output_ids"] for t in run(pairs, prompts, "float32", alternate=True)]
    assert clean_alt == [t["output_ids"] for t in clean]         # (a correct engine's output whatever its steps)
    found = {}
    all_cases, owners = [], []
    for fault in FE.FAULTS:
        traces = run(pairs, prompts, "float32", fault)
        all_cases += cases(traces)
        owners += [(fault, c) for c in changed(traces, clean)]
    reps = check.judge_cases(target, all_cases, None, positions=POSITIONS, reference=REFERENCE.get("float32"))
    for (fault, ch), rep in zip(owners, reps):
        n_changed, n_div = found.get(fault, (0, 0))
        found[fault] = (n_changed + ch, n_div + (rep.verdict == "diverged"))
        assert (rep.verdict == "diverged") == ch, (fault, rep.name, rep.verdict, rep.divergences[:1], rep.wrong_acceptances[:1])
    print("float32 faults (changed, diverged):", found)
    assert found["drafter_context_leak"] == (0, 0)
    assert all(found[f][0] >= 1 for f in FE.FAULTS if f != "drafter_context_leak")


def test_sampled_run_at_another_temperature_is_diverged_with_its_seed(setup):
    """A sampled run at temperature 1.0 whose trace says 0.7: with its seed every token is determined, and the
    first one the temperature changes is a divergence; without the seed the report says what could not be checked."""
    target, pairs, prompts = setup
    wrong = run(pairs, prompts[:3], "float32", sampling=engine.Sampling(1.0), seed=5, claimed=engine.Sampling(0.7))
    right = run(pairs, prompts[:3], "float32", sampling=engine.Sampling(0.7), seed=5)
    reps = judge(target, wrong + right, "float32")
    assert [r.verdict for r in reps[:3]] == ["diverged"] * 3 and all(r.ok for r in reps[3:])
    unseeded = judge(target, [dict(t, seed=None) for t in wrong], "float32")
    assert all(r.verdict == "unchecked" and "cannot be told from a right one" in r.unchecked for r in unseeded)


def test_bfloat16_faults_with_logprobs(setup):
    """Each fault in bfloat16 with the engine's top-8 logprobs: every changed request whose logits leave ours past the
    noise somewhere is diverged (the others are within bf16 rounding: undecidable, counted); the rollback diagnosis
    names every un-rolled-back state fault's diverged requests mostly, and no request of the faults that leave the
    state alone (positions off by one, over-acceptance)."""
    target, pairs, prompts = setup
    clean = run(pairs, prompts, "bfloat16")
    table = {}
    for fault in FE.FAULTS:
        traces = run(pairs, prompts, "bfloat16", fault, logprobs=8)
        reps = judge(target, traces, "bfloat16")
        ch = changed(traces, clean)
        decidable = [c and r.logprobs["beyond_noise"] > 0 for c, r in zip(ch, reps)]
        for d, r in zip(decidable, reps):
            assert not d or r.verdict == "diverged", (fault, r.name, r.tie_breaks[:1])
        rollback = [r.diagnosis is not None and "not rolled back" in r.diagnosis and "no rollback" not in r.diagnosis
                    for r in reps]
        table[fault] = (sum(ch), sum(decidable), sum(r.verdict == "diverged" for r in reps), sum(rollback))
        if fault in ("verify_positions", "overaccept", "drafter_context_leak"):
            assert not any(rollback), fault
        if fault in ROLLBACK:
            assert sum(rollback) >= sum(r.verdict == "diverged" for r in reps) // 2, (fault, table[fault])
    print("bfloat16 faults with logprobs (changed, decidable, diverged, rollback diagnosis):", table)


def test_transformers_greedy_never_diverges(setup):
    """transformers' own greedy generate on the embedded target, float32 and bfloat16: no request diverged."""
    transformers = pytest.importorskip("transformers")
    target, pairs, prompts = setup
    for name in ("float32", "bfloat16"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=check.DTYPES[name]).eval()
        traces = []
        for i, p in enumerate(prompts[:3]):
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            traces.append({"name": f"hf {i}", "prompt_ids": p, "output_ids": out, "dtype": name})
        reps = judge(target, traces, name)
        assert not any(r.verdict == "diverged" for r in reps), (name, [r.divergences[:1] for r in reps])
