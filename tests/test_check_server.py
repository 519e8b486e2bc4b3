"""check.py --server against a running engine: a small threaded HTTP server replays each API's documented response
shape (llama.cpp's /completion, the OpenAI-compatible /v1/completions with token ids, SGLang's /generate), built
from our own greedy outputs of the embedded target, with a planted wrong token, a planted near-tie, an HTTP 500, a
timeout, a truncated output and a response without token ids; every request is judged or reported, the run goes
on, and the counts, the worst request, the engine's batch invariance and the requests in flight are right. Bad
input is one error line. With LLAMA_SERVER naming a llama-server binary (and the recipe's GGUFs), the real engine."""
import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import check
import engine
import servers
from helpers import HAS_EMBEDDED_PAIR, embedded_pair

pytestmark = pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
NEW = 24            # tokens per request: short, the suite runs on a loaded 2-core CPU
TIMEOUT = 1.0       # the client's --timeout; the replayed "timeout" request answers after 3 s


# ---- Our greedy outputs, and the engine's answers built from them -------------------------------------------------

def near_tie_variant(target, prompt: list, out: list) -> tuple | None:
    """(t, the output with its token t replaced by the runner-up, continued greedily from there) at the first
    position where the runner-up is within half a bfloat16 rounding step of our top logit (a flip any bf16 engine
    may make: our own bf16 evaluations move margins by more than a step); None if none."""
    z = check.teacher_forced_logits(target, prompt + out[:-1])[len(prompt) - 1:]
    for t in range(len(out) - 2):
        (top, second), (a, b) = z[t].topk(2).indices.tolist(), z[t].topk(2).values.tolist()
        if 0 < a - b < check.rounding_step(a, torch.bfloat16) / 2 and top == out[t]:
            rest = engine.run(target, prompt + out[:t] + [second], len(out) - t - 1).output_ids
            return t, out[:t] + [second] + rest
    return None


@pytest.fixture(scope="module")
def cases(one_thread):
    """Prompts (token ids) and what the replay server answers for each: name -> (prompt, output ids or None)."""
    import prompts as P
    import checkpoint as ckpt
    target, _, p1, p2 = embedded_pair()
    tok = ckpt.load_tokenizer(target.path)
    pool = [p1, p2] + P.heldout_prompts(tok, 12)
    outs = [engine.run(target, p, NEW).output_ids for p in pool]
    tie = next(((p, o, v) for p, o in zip(pool, outs) if (v := near_tie_variant(target, p, o))), None)
    assert tie is not None, "no near-tie within half a bf16 step in the held-out outputs"
    p_tie, _, (t_tie, o_tie) = tie
    rest = [(p, o) for p, o in zip(pool, outs) if p is not p_tie]
    k = 7
    worst = int(check.teacher_forced_logits(target, rest[2][0] + rest[2][1][:k])[-1].argmin())
    return {"ok0": rest[0], "ok1": rest[1], "wrong": (rest[2][0], rest[2][1][:k] + [worst] + rest[2][1][k + 1:]),
            "near_tie": (p_tie, o_tie), "http500": (rest[3][0], None), "timeout": rest[4],
            "truncated": (rest[5][0], rest[5][1][:NEW // 2]), "no_ids": rest[6], "_k": k, "_t": t_tie}


NAMES = ("ok0", "ok1", "wrong", "near_tie", "http500", "timeout", "truncated", "no_ids")


def answer(api: str, name: str, prompt: list, out) -> tuple:
    """(HTTP status, body) as the API documents it, for one scripted behaviour."""
    if name == "http500":
        body = {"llama.cpp": {"error": {"code": 500, "message": "slot crashed\nbadly", "type": "server_error"}},
                "openai": {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}},
                "sglang": {"object": "error", "message": "scheduler died", "type": "InternalServerError", "code": 500}}
        return 500, body[api]
    ids = [] if name == "no_ids" else out
    stop = name == "truncated"
    if api == "llama.cpp":
        return 200, {"content": "some text", "tokens": ids, "stop": True, "stop_type": "eos" if stop else "limit",
                     "tokens_predicted": len(out), "tokens_evaluated": len(prompt), "truncated": False,
                     "timings": {"predicted_n": len(out), "draft_n": 30, "draft_n_accepted": 20}}
    if api == "openai":
        choice = {"index": 0, "text": "some text", "logprobs": None, "finish_reason": "stop" if stop else "length"}
        if name != "no_ids":
            choice |= {"token_ids": ids, "prompt_token_ids": prompt}
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": [choice],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out)}}
    meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": 0} if stop else {"type": "length", "length": len(out)},
            "prompt_tokens": len(prompt), "completion_tokens": len(out), "spec_verify_ct": 5}
    return 200, {"text": "some text", "meta_info": meta} | ({} if name == "no_ids" else {"output_ids": ids, "prompt_token_ids": prompt})


class Replay:
    """A threaded HTTP server that answers each request from `script(api, prompt ids, call number)` -> (status,
    body, delay), after the delay; it records the requests it got and the most it held at once (of those answered
    within the client's timeout)."""

    def __init__(self, api: str, script, gets: dict | None = None):
        self.api, self.script, self.lock = api, script, threading.Lock()
        self.gets = {"/v1/models": {"object": "list", "data": [{"id": "tiny-qwen35", "object": "model"}]}} | (gets or {})
        self.now = self.most = 0
        self.bodies, self.calls = [], {}
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body.get("prompt", body.get("input_ids"))
                with replay.lock:
                    replay.bodies.append((self.path, body))
                    call = replay.calls[tuple(prompt)] = replay.calls.get(tuple(prompt), 0) + 1
                    status, obj, delay = replay.script(replay.api, prompt, call)
                    counted = delay < TIMEOUT            # (one the client gives up on stays here past its level)
                    replay.now += counted
                    replay.most = max(replay.most, replay.now)
                time.sleep(delay)
                with replay.lock:               # before the answer goes: its client's next request may come at once
                    replay.now -= counted
                try:
                    data = json.dumps(obj).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:                 # the client gave up (a timeout) and closed the socket
                    pass

            def do_GET(self):                   # /v1/models, as vLLM and SGLang list their models; llama.cpp's /props
                if self.path not in replay.gets:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = json.dumps(replay.gets[self.path]).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def prompts_file(tmp_path, prompts: list) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": NEW}) + "\n" for p in prompts))
    return str(path)


def run_check(capsys, url: str, api: str, path: str, *extra) -> tuple:
    rc = check.cli(["--server", url, "--api", api, "--prompts-file", path, "--timeout", str(TIMEOUT), "--json", *extra])
    out, err = capsys.readouterr()
    return rc, out, err, json.loads(out.strip().splitlines()[-1])


# ---- The tests ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["llama.cpp", "openai", "sglang"])
def test_each_api_replayed_every_request_judged_or_reported(api, cases, tmp_path, capsys):
    by_prompt = {tuple(cases[n][0]): n for n in NAMES}

    def script(api, prompt, call):
        name = by_prompt[tuple(prompt)]
        status, body = answer(api, name, prompt, cases[name][1])
        return status, body, 3 * TIMEOUT if name == "timeout" else 0.15
    with Replay(api, script) as server:
        rc, out, err, res = run_check(capsys, server.url, api, prompts_file(tmp_path, [cases[n][0] for n in NAMES]),
                                      "--concurrency", "1,4")
    assert rc == 1 and not res["ok"] and res["api"] == api and res["prompts"] == len(NAMES)
    path, body = server.bodies[0]
    assert path == servers.APIS[api].path and body == servers.APIS[api].body(cases["ok0"][0], NEW, "tiny-qwen35" if api == "openai" else None, 8)
    assert server.most == 4                            # at --concurrency 4 the server really held 4 at once
    for level, n in zip(res["concurrency"], (1, 4)):
        assert level["n"] == n and level["max_in_flight"] == n
        assert {k: level[k] for k in ("requests", "identical", "tie_break", "diverged", "errors", "truncated")} == \
            {"requests": 8, "identical": 3, "tie_break": 1, "diverged": 1, "errors": 3, "truncated": 1}
        got = {NAMES[r["index"]]: run for r in res["requests"] for run in r["runs"] if run["concurrency"] == n}
        assert [got[n]["verdict"] for n in NAMES] == ["identical", "identical", "diverged", "tie-break", "error", "error",
                                                      "identical", "error"]
        assert got["wrong"]["first_divergence"] == got["wrong"]["first_difference"] == cases["_k"]
        assert got["near_tie"]["first_difference"] == cases["_t"] and got["near_tie"]["first_divergence"] is None
        assert got["truncated"]["truncated"] and got["truncated"]["tokens"] == NEW // 2 and got["truncated"]["finish"] in ("eos", "stop")
        assert not any(got[n]["truncated"] for n in NAMES if n != "truncated")
        assert got["http500"]["error"].startswith("HTTP 500: ") and got["http500"]["error"].endswith(("died", "crashed badly"))
        assert got["timeout"]["error"] == f"no response within {TIMEOUT:g} s"
        assert "token" in got["no_ids"]["error"] or "output_ids" in got["no_ids"]["error"]
        assert level["worst"]["index"] == NAMES.index("wrong")
        if api == "llama.cpp":
            assert level["engine_stats"] == {"draft_n": 30 * 5, "draft_n_accepted": 20 * 5}   # the 5 replies with tokens
    assert res["concurrency"][0]["invariance"] is None
    assert res["concurrency"][1]["invariance"] == {"against": 1, "against_repeat": 1, "compared": 5, "same": 5, "differ": []}
    lines = out.splitlines()
    assert sum(line.startswith("concurrency ") for line in lines) == 2
    assert f"  request {NAMES.index('http500')}: failed: HTTP 500: " in out
    w = NAMES.index('wrong')                 # its full report once, with the runs that returned that output
    assert out.count(f"    request {w}: {NEW} tokens, ") == 1 and f"  request {w}, returned at concurrency/repeat 1/1, 4/1:" in out
    assert f"    send it alone: curl -s {server.url}{servers.APIS[api].path} " in out
    assert f"  request {NAMES.index('near_tie')}: tie-break at output token {cases['_t']}: " in out
    assert f"  request {NAMES.index('truncated')}: identical; truncated: {NEW // 2} of {NEW} tokens" in out
    # the bar counts what failed on the way (HTTP, timeout; a missing "tokens" or output_ids), before judging
    assert f"concurrency 4: [{'#' * 20}] 8/8 requests, {2 if api == 'openai' else 3} failed" in err


def test_batch_variance_is_the_engine_against_itself(cases, tmp_path, capsys):
    """An engine that answers a request differently at concurrency 3 than at 1 (a near-tie flipped, each answer
    correct): both judged, the request named with the token the answers part at; exit 0 (nothing wrong)."""
    p, ok = cases["ok1"]
    pt, tie = cases["near_tie"]
    base = engine.run(embedded_pair()[0], pt, NEW).output_ids

    def script(api, prompt, call):
        out = (base if call == 1 else tie) if prompt == pt else ok
        return (*answer(api, "ok0", prompt, out), 0.05)
    with Replay("openai", script) as server:
        rc, out, err, res = run_check(capsys, server.url, "openai", prompts_file(tmp_path, [p, pt, p]), "--concurrency", "1,3")
    assert rc == 0 and res["ok"] and res["model"] == "tiny-qwen35"
    one, three = res["concurrency"]
    assert (one["identical"], one["tie_break"], three["identical"], three["tie_break"]) == (3, 0, 2, 1)
    assert three["invariance"] == {"against": 1, "against_repeat": 1, "compared": 3, "same": 2, "differ": [{"request": 1, "from_token": cases["_t"]}]}
    assert f"against concurrency 1: 2 of 3 outputs the same, request 1 differs from token {cases['_t']}" in out


def test_nothing_listening_is_one_line_and_other_prompt_ids_are_reported_per_request(cases, tmp_path, capsys):
    """A server that is not there: one error line, exit 2 (bad input, not a wrong engine), before any model loads.
    A server that ran other prompt ids than were sent: not judged, said so."""
    port = servers.free_port()             # nothing listens there
    path = prompts_file(tmp_path, [cases["ok0"][0], cases["ok1"][0]])
    rc = check.cli(["--server", f"http://127.0.0.1:{port}", "--api", "sglang", "--prompts-file", path, "--concurrency", "2"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "cannot reach 127.0.0.1:" in err, err

    def script(api, prompt, call):
        return (*answer(api, "ok0", prompt[1:], cases["ok0"][1]), 0.0)
    with Replay("sglang", script) as server:
        rc, out, err, res = run_check(capsys, server.url, "sglang", path, "--concurrency", "1")
    assert rc == 1 and res["concurrency"][0]["errors"] == 2 and "other prompt ids than were sent" in out


def test_repeat_tells_faults_in_company_from_faults_alone(cases, tmp_path, capsys):
    """--repeat 2 at concurrency 1 and 3: a request wrong only when others are in flight (calls 2 and 4: the runs at
    3) is diverged in those runs only, with 2 distinct outputs, "only in company"; a request wrong at 1 in flight
    (calls 1 and 3) is "also alone"; each diverged output's full report is printed once, with the runs it came in."""
    p_ok, ok = cases["ok0"]
    p_c, good_c = cases["ok1"]
    p_a, good_a = cases["timeout"]
    bad_c = cases["wrong"][1]
    k = cases["_k"]
    bad_a = good_a[:k] + [(good_a[k] + 1) % 4096] + good_a[k + 1:]

    def script(api, prompt, call):
        out = {tuple(p_ok): ok, tuple(p_c): bad_c if call % 2 == 0 else good_c,
               tuple(p_a): bad_a if call % 2 == 1 else good_a}[tuple(prompt)]
        return (*answer(api, "ok0", prompt, out), 0.05)
    with Replay("sglang", script) as server:
        rc, out, err, res = run_check(capsys, server.url, "sglang", prompts_file(tmp_path, [p_ok, p_c, p_a]),
                                      "--concurrency", "1,3", "--repeat", "2")
    assert rc == 1 and [(s["n"], s["repeat"]) for s in res["concurrency"]] == [(1, 1), (3, 1), (1, 2), (3, 2)]
    assert [s["diverged"] for s in res["concurrency"]] == [1, 1, 1, 1]
    r_ok, r_c, r_a = res["requests"]
    assert r_ok["verdict"] == "identical" and r_ok["distinct_outputs"] == 1 and r_ok["only_in_company"] is None
    assert r_c["distinct_outputs"] == 2 and r_c["only_in_company"] is True
    assert r_c["diverged_runs"] == [{"concurrency": 3, "repeat": 1}, {"concurrency": 3, "repeat": 2}]
    assert r_a["only_in_company"] is False and r_a["diverged_runs"] == [{"concurrency": 1, "repeat": 1}, {"concurrency": 1, "repeat": 2}]
    assert "only in company (never alone: a batching fault)" in out and "; also alone" in out
    assert out.count("    request 1: ") == 1 and "  request 1, returned at concurrency/repeat 3/1, 3/2:" in out
    assert all("report" in run for run in r_c["runs"] if run["verdict"] == "diverged")


def test_llama_cpp_logprobs_measure_the_engine_and_decide(cases, tmp_path, capsys):
    """llama.cpp's n_probs answered with each token's top-8 log-probabilities: the engine's own discrepancy from our
    logits is the noise basis (reported with top-1 agreement and KL per request); a request whose logprobs are
    ours but whose token is our worst is diverged; one whose logits are ours to within rounding is identical."""
    target = embedded_pair()[0]

    def probs(prompt, out):
        z = check.teacher_forced_logits(target, prompt + out[:-1])[len(prompt) - 1:].float().log_softmax(-1)
        top = z.topk(8, dim=-1)
        return [{"id": t, "logprob": float(z[i, t]), "top_logprobs": [{"id": int(j), "logprob": float(v)}
                 for j, v in zip(top.indices[i], top.values[i])]} for i, t in enumerate(out)]
    answers = {}
    for name in ("ok0", "ok1", "wrong"):
        p, o = cases[name]
        status, body = answer("llama.cpp", name, p, o)
        answers[tuple(p)] = (status, body | {"completion_probabilities": probs(p, o)})

    def script(api, prompt, call):
        return (*answers[tuple(prompt)], 0.0)
    with Replay("llama.cpp", script, {"/props": {"model_path": "/m/tiny-f32.gguf"}}) as server:
        rc, out, err, res = run_check(capsys, server.url, "llama.cpp",
                                      prompts_file(tmp_path, [cases[n][0] for n in ("ok0", "ok1", "wrong")]), "--concurrency", "1")
    assert server.bodies[0][1]["n_probs"] == 8
    assert rc == 1 and res["engine_dtype"] == "float32" and "with the engine's logprobs" in res["noise"]
    assert [r["verdict"] for r in res["requests"]] == ["identical", "identical", "diverged"]
    report = res["requests"][2]["runs"][0]["report"]
    assert report["logprobs"]["positions"] == NEW and report["first_divergence"] == cases["_k"]
    assert report["logprobs"]["top1_agreement"] == 1.0 and report["logprobs"]["beyond_noise"] == 0   # its logits: ours
    assert "with the engine's logprobs (24 positions): top-1 agreement" in out


@pytest.mark.parametrize("gets, dtype, source", [
    ({"/props": {"model_path": "/w/gguf/tiny-qwen35-f32.gguf", "total_slots": 4}}, "float32", "model file tiny-qwen35-f32.gguf"),
    ({"/v1/models": {"data": [{"id": "m", "meta": {"n_params": 1000, "size": 2000}}]}}, "bfloat16", "2.00 bytes per parameter"),
    ({}, "bfloat16", "assumed"),
])
def test_engine_dtype_is_asked_of_llama_server(cases, tmp_path, capsys, gets, dtype, source):
    """Without --engine-dtype, llama-server is asked: its /props model file name, else its /v1/models bytes per
    parameter; where it says nothing the report says the basis was assumed. --engine-dtype overrides."""
    def script(api, prompt, call):
        return (*answer(api, "ok0", prompt, cases["ok0"][1]), 0.0)
    with Replay("llama.cpp", script, gets | ({} if "/v1/models" in gets else {"/v1/models": None})) as server:
        rc, out, err, res = run_check(capsys, server.url, "llama.cpp", prompts_file(tmp_path, [cases["ok0"][0]]), "--concurrency", "1")
        assert rc == 0 and res["engine_dtype"] == dtype and source in res["engine_dtype_from"]
        assert f"noise basis {dtype} (" in out.splitlines()[0]
        rc, out, err, res = run_check(capsys, server.url, "llama.cpp", prompts_file(tmp_path, [cases["ok0"][0]]),
                                      "--concurrency", "1", "--engine-dtype", "float16")
        assert res["engine_dtype"] == "float16" and res["engine_dtype_from"] == "--engine-dtype"


def test_json_holds_every_request_and_saved_traces_replay(cases, tmp_path, capsys):
    """--json: every request's prompt ids and, per run, its output ids and verdict; --save-traces DIR: every reply as a
    trace file, and each request that is not identical to ours alone in a file whose replay gives the same finding."""
    names = ("ok0", "wrong", "near_tie")

    def script(api, prompt, call):
        name = next(n for n in names if cases[n][0] == prompt)
        return (*answer(api, name, prompt, cases[name][1]), 0.0)
    with Replay("sglang", script) as server:
        rc, out, err, res = run_check(capsys, server.url, "sglang", prompts_file(tmp_path, [cases[n][0] for n in names]),
                                      "--concurrency", "1,2", "--save-traces", str(tmp_path / "traces"))
    assert rc == 1
    assert [r["prompt_ids"] for r in res["requests"]] == [cases[n][0] for n in names]
    for r, n in zip(res["requests"], names):
        assert [run["concurrency"] for run in r["runs"]] == [1, 2]
        assert all(run["output_ids"] == cases[n][1] for run in r["runs"])
    wrong = tmp_path / "traces" / "request-1-concurrency-2.json"
    assert wrong.exists() and not (tmp_path / "traces" / "request-0-concurrency-2.json").exists()
    assert len((tmp_path / "traces" / "concurrency-1.jsonl").read_text().splitlines()) == 3
    assert "replay: python check.py --target " in out and str(wrong) in out
    assert check.cli([str(wrong), "--json"]) == 1
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cases"][0]
    assert got["first_divergence"] == cases["_k"]


@pytest.mark.parametrize("flags", [["--pack"], ["--heldout", "3"], ["--dataset", "LOCAL", "--limit", "2"]])
def test_prompt_sets_are_sent_as_token_ids(flags, tmp_path, capsys):
    """--pack (the conformance pack's prompts), --heldout (tools/bench.py's held-out prompts) and --dataset (a local set's
    first turns) go out as the token ids our tokenizer gives, each asking --max-new-tokens; our greedy outputs
    back are all equal."""
    import checkpoint as ckpt
    import prompts as P
    target = embedded_pair()[0]
    tok = ckpt.load_tokenizer(target.path)
    (tmp_path / "set.jsonl").write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Queue:"}\n{"prompt": "import re"}\n')
    flags = [str(tmp_path / "set.jsonl") if f == "LOCAL" else f for f in flags]
    want = {"--pack": [tok.encode(t).ids for t in check.EXPORT_PROMPTS], "--heldout": P.heldout_prompts(tok, 3),
            "--dataset": [tok.encode(t).ids for t in ("def add(a, b):", "class Queue:")]}[flags[0]]
    outs = {tuple(p): engine.run(target, p, 4).output_ids for p in want}

    def script(api, prompt, call):
        return (*answer(api, "ok0", prompt, outs[tuple(prompt)]), 0.0)
    with Replay("sglang", script) as server:
        rc = check.cli(["--server", server.url, "--api", "sglang", "--concurrency", "2", "--max-new-tokens", "4", *flags])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(b["input_ids"] for _, b in server.bodies) == sorted(want)
    assert {b["sampling_params"]["max_new_tokens"] for _, b in server.bodies} == {4}
    assert rc == 0 and res["concurrency"][0]["identical"] == len(want) == res["prompts"]


@pytest.mark.parametrize("argv, says", [
    (["--server", "localhost:8080"], "is not an http:// or https:// URL"),
    (["--server", "http://127.0.0.1:9", "--concurrency", "1,x"], "--concurrency takes comma-separated"),
    (["--server", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency counts must be >= 1"),
    (["--server", "http://127.0.0.1:9", "--prompts-file", "LINES"], "line 2 is not JSON"),
    (["--server", "http://127.0.0.1:9", "--prompts-file", "SAMPLED"], "greedy requests only"),
    (["--server", "http://127.0.0.1:9", "--prompts-file", "NOFILE"], "no such file"),
])
def test_bad_server_input_is_one_error_line(tmp_path, capsys, argv, says):
    files = {"LINES": '{"prompt_ids": [1, 2]}\n{not json\n', "SAMPLED": '{"prompt_ids": [1, 2], "temperature": 0.7}\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path / a) if a in files or a == "NOFILE" else a for a in argv]
    assert check.cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


@pytest.mark.parametrize("argv", [["t.json", "--api", "openai"], ["--server", "http://x", "--heldout", "4", "--pack"],
                                  ["--server", "http://x", "--limit", "3"]])
def test_server_flags_without_server_or_together_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        check.parse_args(argv)
    assert e.value.code == 2


def test_error_bodies_read_as_one_line():
    assert servers.error_line(b'{"error": {"code": 500, "message": "a\\nb", "type": "server_error"}}') == "a b"
    assert servers.error_line(b'{"object": "error", "message": "bad model", "code": 404}') == "bad model"
    assert servers.error_line(b'{"detail": "Not Found"}') == "Not Found"
    assert servers.error_line(b"<html>\n oops</html>") == "<html> oops</html>"
    assert servers.endpoint("http://h:8000/v1/", servers.APIS["openai"]) == "http://h:8000/v1/completions"
    assert servers.endpoint("http://h:8080", servers.APIS["llama.cpp"]) == "http://h:8080/completion"


# ---- The real engine ----------------------------------------------------------------------------------------------

LLAMA_SERVER = os.environ.get("LLAMA_SERVER")


@pytest.mark.skipif(not LLAMA_SERVER, reason="LLAMA_SERVER (a llama-server binary, as docs/llama-cpp/recipe.sh builds) not set")
@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_real_llama_server_with_slots(mode, tmp_path, capsys):
    """llama-server with 4 slots on the embedded pair's f32 GGUFs (LLAMA_GGUF_DIR, default the recipe's WORKDIR/gguf
    beside WORKDIR/build/bin), plain or with its DFlash drafter: 8 held-out prompts at concurrency 1 and 4, every
    request back and none wrong."""
    gguf = os.environ.get("LLAMA_GGUF_DIR") or os.path.join(os.path.dirname(LLAMA_SERVER), "..", "..", "gguf")
    target = os.path.join(gguf, "tiny-qwen35-f32.gguf")
    if not os.path.exists(target):
        pytest.skip(f"{target} not found (set LLAMA_GGUF_DIR to the recipe's WORKDIR/gguf)")
    port = servers.free_port()
    cmd = [LLAMA_SERVER, "-m", target, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-tb", "1", "-c", "2048", "-np", "4"]
    if mode == "dflash":
        cmd += ["-md", os.path.join(gguf, "tiny-qwen35-dflash-f32.gguf"), "--spec-type", "draft-dflash",
                "--spec-draft-n-max", "15", "-td", "1", "-tbd", "1"]
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        servers.wait_healthy(proc, f"http://127.0.0.1:{port}", str(tmp_path / "server.log"), 60)
        rc = check.cli(["--server", f"http://127.0.0.1:{port}", "--api", "llama.cpp", "--concurrency", "1,4", "--heldout", "8",
                        "--max-new-tokens", "64", "--engine-dtype", "float32"])
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(10)
    for level in res["concurrency"]:
        assert level["errors"] == level["diverged"] == level["truncated"] == 0 and level["identical"] + level["tie_break"] == 8, level
        assert mode == "ar" or level["engine_stats"].get("draft_n", 0) > 0
    assert rc == 0
