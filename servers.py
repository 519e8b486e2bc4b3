"""Serving engines over HTTP, for `check.py --server`: the request each engine documents for greedy token ids, its
response read back as a trace check.py reads, and many requests sent with N in flight. Standard library only.

    APIS                    the request shapes by --api name: llama.cpp's /completion, the OpenAI-compatible
                            /v1/completions with token ids (vLLM, SGLang), SGLang's native /generate
    send_all(url, api, prompts, n, timeout, model)   -> [Reply], in prompt order, n requests in flight at a time
    level_summary(outcomes, reference)               -> one run's counts, worst request, batch invariance
    reachable(url), llama_cpp_dtype(url)             something listens there; what llama-server says of its dtype
    free_port(), wait_healthy(proc, url, log_path)   a port for a local server; wait until its /health answers

Every request asks for greedy decoding (temperature 0; top_k 1 where the API has it), the prompt as token ids,
max_new_tokens tokens with the end-of-sequence token ignored, the generated ids back, and (unless asked for none)
each token's top log-probabilities: llama.cpp's `n_probs`, vLLM's `logprobs` with `return_tokens_as_token_ids`,
SGLang's `return_logprob` with `top_logprobs_num`. Field names are the
servers' own documentation's (llama.cpp's tools/server/README.md; vLLM's and SGLang's OpenAI protocol, where
`return_token_ids` adds `prompt_token_ids` and `token_ids` to each choice; SGLang's GenerateReqInput and the
`output_ids` its /generate returns). A request that fails (an HTTP error, a timeout, a body that is not JSON, a
response without token ids) becomes a Reply with a one-line `error`; the others go on.
"""
from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local server to listen on."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, log_path: str, seconds: float = 120) -> None:
    """Wait until the server started as `proc` (a subprocess.Popen) answers 200 on url/health (llama-server's
    readiness endpoint); raises RuntimeError naming its log if it exits or is not ready in `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server did not become healthy in {seconds:.0f} s; see {log_path}")


class ReplyError(Exception):
    """A request that got no usable answer; the message is one line."""


# ---- The request shapes -----------------------------------------------------------------------------------

def _llama_cpp_body(prompt: list, max_new: int, model, logprobs: int = 0) -> dict:
    # cache_prompt off: the docs warn that reusing a cached prefix may change the logits (another batch size).
    # n_probs: each token's top log-probabilities, of the raw logits (post_sampling_probs off, the default)
    return {"prompt": prompt, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False, "seed": 0} | ({"n_probs": logprobs} if logprobs else {})


def _llama_cpp_trace(obj: dict, prompt: list) -> tuple:
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or (not tokens and (obj.get("content") or obj.get("tokens_predicted"))):
        raise ReplyError('no token ids in "tokens" (llama-server fills it when asked with "return_tokens": true)')
    timings = obj.get("timings") if isinstance(obj.get("timings"), dict) else {}
    stats = {k: timings[k] for k in ("draft_n", "draft_n_accepted") if isinstance(timings.get(k), int)}
    trace = {"prompt_ids": prompt, "output_ids": tokens}
    if isinstance(obj.get("completion_probabilities"), list):
        trace["completion_probabilities"] = obj["completion_probabilities"]
    return trace, obj.get("stop_type"), stats


def _openai_body(prompt: list, max_new: int, model, logprobs: int = 0) -> dict:
    body = {"prompt": prompt, "max_tokens": max_new, "temperature": 0.0, "top_p": 1.0, "n": 1, "stream": False,
            "ignore_eos": True, "return_token_ids": True}
    if logprobs:       # vLLM: the top logprobs keyed "token_id:N" with return_tokens_as_token_ids
        body |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
    return body | ({"model": model} if model else {})


def _openai_trace(obj: dict, prompt: list) -> tuple:
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ReplyError(f"expected one choice in \"choices\", got {json.dumps(choices)[:80]}")
    # a server that does not echo the prompt ids ran the ones sent (vLLM and SGLang echo them per choice)
    echo = choices[0].get("prompt_token_ids") or obj.get("prompt_token_ids") or prompt
    return obj | {"choices": [choices[0] | {"prompt_token_ids": echo}]}, choices[0].get("finish_reason"), {}


def _sglang_body(prompt: list, max_new: int, model, logprobs: int = 0) -> dict:
    return {"input_ids": prompt, "return_prompt_token_ids": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "top_k": 1, "ignore_eos": True}} | \
        ({"return_logprob": True, "top_logprobs_num": logprobs} if logprobs else {})


def _sglang_trace(obj: dict, prompt: list) -> tuple:
    if "output_ids" not in obj:
        raise ReplyError("no output_ids in the response (SGLang's /generate returns them; is this server SGLang?)")
    meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
    finish = meta.get("finish_reason")
    stats = {k: meta[k] for k in ("spec_verify_ct",) if isinstance(meta.get(k), int)}
    trace = obj | {"prompt_token_ids": obj.get("prompt_token_ids") or prompt}
    return trace, finish.get("type") if isinstance(finish, dict) else finish, stats


@dataclass(frozen=True)
class Api:
    """One engine's request shape: where to POST, the body for (prompt ids, max new tokens, model name, top
    logprobs asked for: 0 none), and how a response becomes (a trace object check.to_cases reads, the server's
    reason for stopping, counters)."""
    path: str
    body: Callable
    trace: Callable


APIS = {"llama.cpp": Api("/completion", _llama_cpp_body, _llama_cpp_trace),
        "openai": Api("/v1/completions", _openai_body, _openai_trace),
        "sglang": Api("/generate", _sglang_body, _sglang_trace)}


def endpoint(url: str, api: Api) -> str:
    """The URL to POST to: the server's base URL (a trailing /v1 taken as the OpenAI base) + the API's path.
    A URL that is not http(s)://host[:port][/path] raises ValueError."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--server {url!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8080)")
    base = url.rstrip("/")
    if base.endswith("/v1") and api.path.startswith("/v1/"):
        base = base[:-3]
    return base + api.path


def reachable(url: str, timeout: float = 10.0) -> None:
    """Whether anything listens at the server's host and port: ReplyError (one line) where nothing does, so that a
    run against a server that is not up stops at once instead of failing every request."""
    import socket
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            pass
    except OSError as e:
        raise ReplyError(f"cannot reach {parts.hostname}:{port} ({e.strerror or e}); is the server running there?") from None


DTYPE_NAMES = (("bfloat16", ("bf16", "bfloat16")), ("float16", ("f16", "fp16", "float16")),
               ("float32", ("f32", "fp32", "float32")))


def get_json(url: str, path: str, timeout: float = 10.0):
    """GET url + path -> its JSON, or None for anything else (no such endpoint, not JSON, nothing there)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None


def llama_cpp_dtype(url: str) -> tuple:
    """What a llama-server says of its weights' precision -> (dtype name or None, how it was found). Its /props names
    the model file (`model_path`): a GGUF's name carries its type by convention (-f32, -bf16, -f16); else its
    /v1/models `meta` gives the weights' bytes (`size`) and parameters (`n_params`): 4 bytes each is float32, 2 is a
    16-bit type (bfloat16 or float16: taken as bfloat16, the coarser)."""
    import re
    props = get_json(url, "/props")
    path = props.get("model_path") if isinstance(props, dict) else None
    if isinstance(path, str):
        name = path.replace("\\", "/").rsplit("/", 1)[-1].lower()
        words = set(re.split(r"[^a-z0-9]+", name))
        for dtype, spellings in DTYPE_NAMES:
            if words & set(spellings):
                return dtype, f"llama-server /props: model file {name}"
    models = get_json(url, "/v1/models")
    try:
        meta = models["data"][0]["meta"]
        per = meta["size"] / meta["n_params"]
    except (TypeError, KeyError, IndexError, ZeroDivisionError):
        return None, "the server does not say (llama-server /props and /v1/models name no type)"
    if 3.5 <= per <= 4.5:
        return "float32", f"llama-server /v1/models: {per:.2f} bytes per parameter"
    if 1.8 <= per <= 2.2:
        return "bfloat16", f"llama-server /v1/models: {per:.2f} bytes per parameter (16-bit: bfloat16 or float16, taken as bfloat16)"
    return None, f"llama-server /v1/models: {per:.2f} bytes per parameter, not a float type this checker models"


# ---- Sending ------------------------------------------------------------------------------------------------

def error_line(raw: bytes) -> str:
    """The message of an error body (llama.cpp and vLLM: {"error": {"message"}}; SGLang: {"message"}; FastAPI:
    {"detail"}), else its first text, as one line of at most 200 characters."""
    text = raw.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        msg = err.get("message") if isinstance(err, dict) else err or obj.get("message") or obj.get("detail")
        text = msg if isinstance(msg, str) else json.dumps(msg if msg is not None else obj)
    return " ".join(text.split())[:200] or "(empty body)"


def post(url: str, body: dict, timeout: float) -> dict:
    """POST body as JSON -> the response's JSON object; ReplyError (one line) for anything else."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise ReplyError(f"HTTP {e.code}: {error_line(e.read())}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise ReplyError(f"no response within {timeout:g} s") from None
        raise ReplyError(f"cannot reach {url} ({e.reason})") from None
    except TimeoutError:
        raise ReplyError(f"no response within {timeout:g} s") from None
    except (OSError, http.client.HTTPException) as e:
        raise ReplyError(f"the connection failed ({type(e).__name__}: {e})") from None
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ReplyError(f"the response is not JSON: {raw[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ReplyError(f"the response is not a JSON object: {json.dumps(obj)[:80]}")
    if obj.get("error") or obj.get("object") == "error":
        raise ReplyError(f"the server answered with an error: {error_line(raw)}")
    return obj


def served_model(url: str, timeout: float = 10.0) -> str | None:
    """The first model an OpenAI-compatible server lists at /v1/models (vLLM checks the request's "model"
    against it), or None where it lists none."""
    try:
        with urllib.request.urlopen(endpoint(url, Api("/v1/models", None, None)), timeout=timeout) as r:
            data = json.loads(r.read()).get("data")
        return data[0]["id"] if isinstance(data, list) and data and isinstance(data[0].get("id"), str) else None
    except (OSError, ValueError, AttributeError, KeyError, http.client.HTTPException):
        return None


@dataclass
class Reply:
    """One request's answer: the trace (None on an error), or the error's line; the server's reason for stopping,
    its counters (llama.cpp: draft_n, draft_n_accepted), and the wall time of the request."""
    index: int
    trace: dict | None = None
    error: str | None = None
    finish: str | None = None
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0


class Flight:
    """Requests in flight now, the most seen at once, and the progress bar on `out` (redrawn in place on a
    terminal; elsewhere one line when the level is done)."""

    def __init__(self, label: str, total: int, out):
        self.label, self.total, self.out = label, total, out
        self.lock, self.now, self.most, self.done, self.errors = threading.Lock(), 0, 0, 0, 0
        self.tty = hasattr(out, "isatty") and out.isatty()

    def start(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def end(self, failed: bool) -> None:
        with self.lock:
            self.now, self.done, self.errors = self.now - 1, self.done + 1, self.errors + failed
            if self.tty or self.done == self.total:
                bar = "#" * (20 * self.done // self.total)
                self.out.write(f"{chr(13) if self.tty else ''}{self.label}: [{bar:<20}] {self.done}/{self.total} requests"
                               f"{f', {self.errors} failed' if self.errors else ''}" + ("\n" if self.done == self.total else ""))
                self.out.flush()


def send_one(url: str, api: Api, index: int, prompt: list, max_new: int, timeout: float, model, flight: Flight,
             logprobs: int = 0) -> Reply:
    flight.start()
    t0 = time.perf_counter()
    reply = Reply(index)
    try:
        reply.trace, reply.finish, reply.stats = api.trace(post(url, api.body(prompt, max_new, model, logprobs), timeout), prompt)
    except ReplyError as e:
        reply.error = str(e)
    reply.seconds = time.perf_counter() - t0
    flight.end(reply.error is not None)
    return reply


def send_all(url: str, api: Api, prompts: list, n: int, timeout: float, model=None, out=None, logprobs: int = 0,
             label: str | None = None) -> tuple:
    """prompts [(prompt ids, max new tokens)] sent to the server with n requests in flight at a time (a pool of n
    threads, each sending its next request as soon as its last one is answered), asking for each token's top
    `logprobs` log-probabilities (0: none) -> ([Reply] in prompt order, the most requests seen in flight at once,
    the wall time)."""
    flight = Flight(label or f"concurrency {n}", len(prompts), out if out is not None else sys.stderr)
    target = endpoint(url, api)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(send_one, target, api, i, p, m, timeout, model, flight, logprobs) for i, (p, m) in enumerate(prompts)]
        replies = [f.result() for f in futures]
    return replies, flight.most, time.perf_counter() - t0


# ---- The report of one run (a concurrency, a repeat) ------------------------------------------------------------

@dataclass
class Outcome:
    """One request in one run, judged by check.py: verdict "identical" (every token our choice), "tie-break" (every
    token that is not lies within the noise), "diverged" (a token past the noise) or "error" (no tokens to judge:
    `error` says why)."""
    index: int
    verdict: str
    asked: int
    output_ids: list = field(default_factory=list)
    first_difference: int | None = None     # the first output token that is not our choice (a tie-break or not)
    first_divergence: int | None = None
    divergences: int = 0
    error: str | None = None
    finish: str | None = None

    @property
    def truncated(self) -> bool:
        """Fewer tokens than asked (a stop the request said to ignore, a context limit, an abort): the tokens that
        came are judged all the same, and the request is counted as truncated too."""
        return self.verdict != "error" and len(self.output_ids) < self.asked

    def json(self) -> dict:
        keys = ("index", "verdict", "asked", "first_difference", "first_divergence", "divergences", "error", "finish")
        return {k: getattr(self, k) for k in keys} | {"tokens": len(self.output_ids), "truncated": self.truncated}


VERDICTS = ("identical", "tie-break", "diverged", "error")
COUNTS = {"identical": "identical", "tie-break": "tie_break", "diverged": "diverged", "error": "errors"}


def worst(outcomes: list) -> Outcome | None:
    """The request that leaves our greedy output earliest: a diverged one by its first divergence (more divergences
    first at the same index), else a tie-break by its first difference; None when every request is identical."""
    wrong = [o for o in outcomes if o.verdict == "diverged"]
    if wrong:
        return min(wrong, key=lambda o: (o.first_divergence, -o.divergences, o.index))
    ties = [o for o in outcomes if o.verdict == "tie-break"]
    return min(ties, key=lambda o: (o.first_difference, o.index)) if ties else None


def invariance(outcomes: list, reference: list) -> dict:
    """The engine against itself: each request's output here against its output in `reference` (another
    run), where both came back -> compared, same, and the requests that differ with the first index."""
    ref = {o.index: o.output_ids for o in reference if o.verdict != "error"}
    pairs = [(o.index, o.output_ids, ref[o.index]) for o in outcomes if o.verdict != "error" and o.index in ref]
    differ = [{"request": i, "from_token": next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}
              for i, a, b in pairs if a != b]
    return {"compared": len(pairs), "same": len(pairs) - len(differ), "differ": differ}


def level_summary(n: int, outcomes: list, replies: list, most: int, seconds: float, reference: tuple | None,
                  repeat: int = 1) -> dict:
    """One run's entry of the final JSON line: the counts by verdict ("identical", "tie_break", "diverged",
    "errors"), truncated requests, the worst one, the most requests seen in flight, the wall time, the servers'
    counters summed, and against the reference run ((n, repeat), its outcomes) the engine's batch invariance."""
    counts = {COUNTS[v]: sum(o.verdict == v for o in outcomes) for v in VERDICTS}
    stats = {}
    for r in replies:
        for k, v in r.stats.items():
            stats[k] = stats.get(k, 0) + v
    w = worst(outcomes)
    return {"n": n, "repeat": repeat, "requests": len(outcomes), **counts,
            "truncated": sum(o.truncated for o in outcomes),
            "tokens": sum(len(o.output_ids) for o in outcomes), "seconds": seconds, "max_in_flight": most,
            "worst": None if w is None else w.json(), "engine_stats": stats,
            "invariance": None if reference is None else
            {"against": reference[0][0], "against_repeat": reference[0][1], **invariance(outcomes, reference[1])}}


def rep_of(s: dict) -> str:
    return f" (repeat {s['repeat']})" if s["repeat"] > 1 else ""


def level_text(s: dict) -> str:
    """The summary line of one run."""
    line = (f"concurrency {s['n']}{rep_of(s)}: "
            f"{s['requests']} requests: {s['identical']} identical, {s['tie_break']} tie-break, {s['diverged']} diverged, "
            f"{s['errors']} failed, {s['truncated']} truncated; {s['tokens']} tokens in "
            f"{s['seconds']:.1f} s, at most {s['max_in_flight']} in flight")
    inv = s["invariance"]
    if inv is not None:
        rep = f" (repeat {inv['against_repeat']})" if inv["against_repeat"] > 1 else ""
        line += f"; against concurrency {inv['against']}{rep}: {inv['same']} of {inv['compared']} outputs the same"
        if inv["differ"]:
            line += ", " + ", ".join(f"request {d['request']} differs from token {d['from_token']}" for d in inv["differ"][:5])
            line += ", ..." if len(inv["differ"]) > 5 else ""
    return line
