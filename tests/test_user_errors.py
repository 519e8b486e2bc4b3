"""What a user sees when something is wrong or interrupted: every checkpoint or request problem is one
'error:' line on stderr with exit code 2 (a hypothesis property over corrupted configs, and the messages that
used to mislead), Ctrl-C stops cleanly with what was generated (exit code 130), and nothing is a traceback.

generate.cli is the command line's entry point (main plus the one-line error handling), called in-process."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import checkpoint as ckpt_mod
import generate
from helpers import edit_json, save_hf_causal_lm, save_zlab_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["--prompt-ids", "5,17,42,8", "--max-new-tokens", "4", "--json"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    save_hf_causal_lm(root / "target", seed=31)
    save_zlab_drafter(root / "draft", target_layers=4, vocab=97, hidden=64, seed=32, layer_ids=[0, 2], block_size=4)
    return root


def run_cli(capsys, *args) -> tuple:
    capsys.readouterr()
    rc = generate.cli([str(a) for a in args])
    got = capsys.readouterr()
    return rc, got.out, got.err


def one_error_line(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    return lines[0]


# --------------------------------------------------------------------------------------------------
# corrupted configs: a hypothesis property
# --------------------------------------------------------------------------------------------------

def _keys(config: dict) -> list:
    """(path, value) for every scalar or list entry of a config, nested objects followed ('a.b')."""
    out = []
    for k, v in config.items():
        if isinstance(v, dict):
            out += [(f"{k}.{kk}", vv) for kk, vv in _keys(v)]
        else:
            out.append((k, v))
    return out


def _corrupt(config: dict, path: str, how: str, other):
    *outer, key = path.split(".")
    d = config
    for k in outer:
        d = d[k]
    if how == "delete":
        del d[key]
    elif how == "string":
        d[key] = str(d[key])
    elif how == "negative":
        d[key] = -abs(d[key]) if isinstance(d[key], (int, float)) and not isinstance(d[key], bool) else -1
    elif how == "fraction":
        d[key] = (d[key] if isinstance(d[key], (int, float)) and not isinstance(d[key], bool) else 1) + 0.5
    else:                                                 # "other": another value of any JSON type
        d[key] = other


def _config_paths(folder) -> list:
    with open(os.path.join(folder, "config.json")) as fh:
        return [p for p, _ in _keys(json.load(fh))]


@pytest.fixture(scope="module")
def paths(pair):
    return {"target": _config_paths(pair / "target"), "draft": _config_paths(pair / "draft")}


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])   # capsys: read per call
@given(data=st.data())
def test_corrupted_config_is_one_error_line_or_runs(pair, paths, capsys, data):
    """A config.json with one entry deleted, turned into a string, made negative or fractional, or replaced by
    another JSON value: generate.py either runs (the entry was optional or harmless) or exits 2 with one
    'error:' line; never a traceback. A numeric or flag entry that we read, given the wrong type or a negative
    value, is always refused."""
    which = data.draw(st.sampled_from(["target", "draft"]))
    path = data.draw(st.sampled_from(paths[which]))
    how = data.draw(st.sampled_from(["delete", "string", "negative", "fraction", "other"]))
    other = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(-2, 2), st.text(max_size=3),
                                st.lists(st.integers(0, 5), max_size=3), st.just({})))
    with tempfile.TemporaryDirectory() as tmp:
        folder = shutil.copytree(pair / which, os.path.join(tmp, which))
        with open(os.path.join(folder, "config.json")) as fh:
            config = json.load(fh)
        if how != "delete" and not isinstance(_lookup(config, path), (int, float, bool)) and how != "other":
            how = "other"
        before = _lookup(config, path)
        _corrupt(config, path, how, other)
        with open(os.path.join(folder, "config.json"), "w") as fh:
            json.dump(config, fh)
        target = folder if which == "target" else pair / "target"
        draft = folder if which == "draft" else pair / "draft"
        rc, out, err = run_cli(capsys, "--target", target, "--draft", draft, *ARGS)
    if rc == 0:
        assert json.loads(out.strip().splitlines()[-1])["output_ids"], out
    else:
        one_error_line(rc, err)
    key = path.split(".")[-1]
    rules = ckpt_mod.TARGET_FIELDS if which == "target" else ckpt_mod.DRAFT_FIELDS
    read = key in rules and before is not None and rules[key][0](before)
    if read and how in ("string", "negative") and not (how == "negative" and before == 0):
        assert rc == 2 and f"'{key}' must be" in err, (path, how, err)


def _lookup(config: dict, path: str):
    for k in path.split("."):
        config = config[k]
    return config


def test_wrong_type_is_named(pair, tmp_path, capsys):
    """The case from a user: "hidden_size": "256" (a string) used to be a TypeError from torch.empty."""
    target = shutil.copytree(pair / "target", tmp_path / "t")
    edit_json(target / "config.json", lambda c: c.update(hidden_size="64"))
    line = one_error_line(*run_cli(capsys, "--target", target, "--draft", "none", *ARGS)[::2])
    assert "'hidden_size' must be an integer >= 1, got \"64\"" in line


# --------------------------------------------------------------------------------------------------
# messages that used to mislead
# --------------------------------------------------------------------------------------------------

def test_mistyped_local_path_names_the_missing_folder(capsys, monkeypatch):
    """A relative path shaped like a repo id: said to be a missing folder, with what its parent holds, and
    only then that the Hub had no such repo either."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = one_error_line(*run_cli(capsys, "--target", "checkpoints/tiny-qwen3", "--prompt-ids", "1")[::2])
    assert line.startswith("error: there is no folder checkpoints/tiny-qwen3 (checkpoints/ holds: ") and "tiny-qwen35," in line
    assert "Hugging Face repo id failed" in line


def test_missing_model_type_is_said(pair, tmp_path, capsys):
    target = shutil.copytree(pair / "target", tmp_path / "t")
    edit_json(target / "config.json", lambda c: c.pop("model_type"))
    line = one_error_line(*run_cli(capsys, "--target", target, "--draft", "none", *ARGS)[::2])
    assert "config.json has no model_type" in line and "None" not in line


def test_guessed_layer_types_are_named(tmp_path, capsys):
    """Weights of a non-default layer pattern, config without layer_types: the message says the kinds were
    guessed, not merely that weights are missing."""
    save_hf_causal_lm(tmp_path / "t", seed=3, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"])
    edit_json(tmp_path / "t" / "config.json", lambda c: c.pop("layer_types"))
    line = one_error_line(*run_cli(capsys, "--target", tmp_path / "t", "--draft", "none", *ARGS)[::2])
    assert "config.json has no layer_types" in line and "add the checkpoint's layer_types" in line


@pytest.mark.parametrize("extra, says, never", [
    ([], "ships no chat template", "--no-chat"),                      # chat mode off because there is no template
    (["--no-chat"], "drop --no-chat", "ships no chat"),               # off because the user said so
])
def test_chat_flags_without_chat_say_why(pair, capsys, extra, says, never):
    line = one_error_line(*run_cli(capsys, "--target", pair / "target", "--draft", "none", "--prompt", "hi",
                                   "--system", "Be brief.", *extra)[::2])
    assert "--system belongs to chat mode" in line and says in line and never not in line


def test_unknown_compile_mode_is_a_usage_error(capsys):
    """Refused by the parser (exit 2, one error line after the usage), before torch can raise on it."""
    with pytest.raises(SystemExit) as e:
        generate.cli(["--prompt-ids", "1", "--compile", "--compile-mode", "fast"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'fast'" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--no-adaptive"]])
def test_interrupt_keeps_what_was_generated(pair, capsys, monkeypatch, extra):
    """KeyboardInterrupt in the third step after prefill (a round or a plain step, whichever adaptive speculation
    takes; with --no-adaptive, a round): exit 130, the --json line holds the tokens generated so far (a prefix of the full greedy output), one
    stderr line says so."""
    full = json.loads(run_cli(capsys, "--target", pair / "target", "--draft", pair / "draft", "--prompt-ids", "5,17,42,8",
                              "--max-new-tokens", "30", "--json", *extra)[1].strip().splitlines()[-1])
    calls = {"n": 0}
    import engine
    real_round, real_plain = engine.Engine.round, engine.Engine.plain

    def third_interrupts(real):
        def step(self, seq, *a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return real(self, seq, *a, **kw)
        return step
    monkeypatch.setattr(engine.Engine, "round", third_interrupts(real_round))
    monkeypatch.setattr(engine.Engine, "plain", third_interrupts(real_plain))
    rc, out, err = run_cli(capsys, "--target", pair / "target", "--draft", pair / "draft", "--prompt-ids", "5,17,42,8",
                           "--max-new-tokens", "30", "--json", *extra)
    part = json.loads(out.strip().splitlines()[-1])
    assert rc == 130 and part["interrupted"] is True
    assert 1 < len(part["output_ids"]) < 30 and full["output_ids"][:len(part["output_ids"])] == part["output_ids"]
    assert err.strip() == f"interrupted after {len(part['output_ids'])} generated tokens"


def test_ctrl_c_stops_cleanly():
    """A real SIGINT to `python generate.py` while it streams: exit 130, the text so far on stdout, one line on
    stderr, no traceback."""
    # A shell running this suite in the background ignores SIGINT, and a child inherits that (Python then never
    # raises KeyboardInterrupt): the child gets the default disposition back, as a terminal's process has.
    p = subprocess.Popen([sys.executable, "generate.py", "--prompt", "def fibonacci(n):", "--max-new-tokens", "3000"],
                         cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = p.stdout.read(len("def fibonacci(n):") + 1)       # the echoed prompt and a first generated byte
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = err.decode()
    assert p.returncode == 130, err
    assert first.startswith(b"def fibonacci(n):") and len(first + out) > len(first), out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted after ") and "Traceback" not in err, err


# --------------------------------------------------------------------------------------------------
# flag and request values: refused in one line, before anything loads where the value alone says so
# --------------------------------------------------------------------------------------------------

def never_loads(monkeypatch):
    """generate.load made to fail the test: the refusal must come before any checkpoint is read."""
    def load(*a, **kw):
        raise AssertionError("the model was loaded before the bad input was refused")
    monkeypatch.setattr(generate, "load", load)


def requests_file(tmp_path, *lines) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("args, says", [
    (["--num-samples", "3"], "--num-samples 3 applies to sampling only: greedy decoding (--temperature 0) gives the same text"),
    (["--draft", "none", "--block-size", "4"], "--block-size applies to a drafter's draft-verify rounds, and --draft none"),
    (["--cache-len", "-5"], "--cache-len must be >= 1 (positions in the static caches), got -5"),
    (["--cache-len", "0"], "--cache-len must be >= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1 (--max-new-tokens), got 0"),
    (["--temperature", "1e308"], "temperature must be finite and at most 3.403e+38 (float32's largest), got 1e+308"),
    (["--temperature", "inf"], "temperature must be finite"),
    (["--temperature", "1e-40"], "temperature must be 0 (greedy) or at least 1e-30"),
    (["--temperature", "1", "--top-k", str(10 ** 20)], "top_k must be >= 0 (0 = no limit) and below 2^63, got 100000000000000000000"),
    (["--temperature", "1", "--top-p", "1e-50"], "top_p must be > 0 in float32, got 1e-50"),
    (["--temperature", "1", "--seed", str(2 ** 64)], f"--seed must be in 0 .. 2^63-1 (9223372036854775807), got {2 ** 64}"),
    (["--temperature", "1", "--seed", "-1"], "--seed must be in 0 .. 2^63-1"),
    (["--temperature", "1", "--seed", str(2 ** 63 - 1), "--num-samples", "2"],
     "--seed 9223372036854775807 + --num-samples 2 - 1 exceeds 2^63-1 (sample i uses seed + i); use a --seed of at most 9223372036854775806"),
    (["--tree-size", "4", "--block-size", "4"], "--block-size does not go with a draft tree"),
])
def test_bad_flag_values_are_refused_before_loading(capsys, monkeypatch, args, says):
    never_loads(monkeypatch)
    line = one_error_line(*run_cli(capsys, "--prompt-ids", "1,2,3", *args)[::2])
    assert says in line, line


def test_prompts_file_that_is_a_directory_is_said_to_be_one(tmp_path, capsys, monkeypatch):
    never_loads(monkeypatch)
    line = one_error_line(*run_cli(capsys, "--prompts-file", tmp_path)[::2])
    assert line == f"error: --prompts-file {tmp_path} is a directory; give a JSON-lines file (one request per line)"


@pytest.mark.parametrize("bad, says", [
    ({"prompt_ids": [1, 2], "temperature": 1e39}, "temperature must be finite and at most 3.403e+38"),
    ('{"prompt_ids": [1, 2], "temperature": NaN}', "temperature must be >= 0, got nan"),
    ({"prompt_ids": [1, 2], "temperature": 1, "top_k": 10 ** 20}, "top_k must be >= 0 (0 = no limit) and below 2^63"),
    ({"prompt_ids": [1, 2], "temperature": 1, "top_p": 1e-50}, "top_p must be > 0 in float32"),
    ({"prompt_ids": [1, 2], "temperature": 1, "seed": 2 ** 64}, f"seed must be in 0 .. 2^63-1 (9223372036854775807), got {2 ** 64}"),
    ({"prompt_ids": [1, 2], "temperature": 1, "seed": -3}, "seed must be in 0 .. 2^63-1"),
    ({"prompt_ids": [1, 2], "max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"prompt_ids": []}, "the prompt is empty"),
])
def test_a_bad_line_is_named_and_refused_before_loading(tmp_path, capsys, monkeypatch, bad, says):
    """Every line is checked (types, sampling values, seed range, max_new_tokens) before the model loads, so a bad
    line 3 loses nothing: the error names the file and the line."""
    never_loads(monkeypatch)
    path = requests_file(tmp_path, {"prompt_ids": [1, 2]}, "", bad)
    line = one_error_line(*run_cli(capsys, "--prompts-file", path)[::2])
    assert line.startswith(f"error: {path} line 3: ") and says in line, line


def test_seed_plus_index_past_the_range_names_the_line(tmp_path, capsys, monkeypatch):
    """A line without "seed" takes --seed + its index: the second line of --seed 2^63-1 is past the range."""
    never_loads(monkeypatch)
    path = requests_file(tmp_path, {"prompt_ids": [1, 2]}, {"prompt_ids": [3]})
    line = one_error_line(*run_cli(capsys, "--prompts-file", path, "--temperature", "1", "--seed", str(2 ** 63 - 1))[::2])
    assert line.startswith(f"error: {path} line 2: --seed 9223372036854775807 + the request's index 1 exceeds 2^63-1"), line


def test_images_on_a_text_only_target_name_the_line(pair, tmp_path, capsys):
    path = requests_file(tmp_path, {"prompt_ids": [1, 2]}, {"prompt_ids": [1, 2], "images": ["cat.png"]})
    line = one_error_line(*run_cli(capsys, "--target", pair / "target", "--draft", pair / "draft", "--prompts-file", path,
                                   "--max-new-tokens", "2")[::2])
    assert line.startswith(f"error: {path} line 2: this checkpoint has no vision_config (a text-only model)"), line
    assert "drop the line's \"images\"" in line and "--image" not in line


def test_tiny_top_p_keeps_the_greedy_token(pair, capsys):
    """top_p 1e-30 (representable in float32) keeps the most likely token alone: the sampled text is the greedy one."""
    base = ["--target", pair / "target", "--draft", pair / "draft", "--prompt-ids", "5,17,42,8", "--max-new-tokens", "12", "--json"]
    greedy = json.loads(run_cli(capsys, *base)[1].strip().splitlines()[-1])
    tiny = json.loads(run_cli(capsys, *base, "--temperature", "1", "--top-p", "1e-30", "--seed", "3")[1].strip().splitlines()[-1])
    assert tiny["output_ids"] == greedy["output_ids"] and tiny["top_p"] == 1e-30 and tiny["seed"] == 3


def test_loading_is_said_on_a_terminal(pair, capsys, monkeypatch):
    """On a terminal one line says what loads before the seconds of loading; in a pipe or a log (as under capsys) stderr
    holds errors and statistics only. stdout stays the --json line either way."""
    base = ["--target", pair / "target", "--draft", pair / "draft", *ARGS]
    rc, out, err = run_cli(capsys, *base)
    assert rc == 0 and "loading" not in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    rc, out, err = run_cli(capsys, *base)
    assert rc == 0 and err.splitlines()[0] == f"loading {pair / 'target'} and {pair / 'draft'} ..." and len(err.splitlines()) == 1
    assert json.loads(out.strip().splitlines()[-1])["output_ids"]
    rc, _, err = run_cli(capsys, "--target", pair / "target", "--draft", "none", "--prompt-ids", "1", "--max-new-tokens", "1")
    assert err.splitlines()[0] == f"loading {pair / 'target'} ..."


def test_stats_lines_are_short(pair, tmp_path, capsys):
    """The statistics: one line per generation (tokens, tok/s, rounds and their mean acceptance, plain steps, the
    policy's switches and why, seed; under 240 characters), no per-request explanation, with a single request and
    with every request of a prompts file."""
    base = ["--target", pair / "target", "--draft", pair / "draft", "--products", "plain", "--max-new-tokens", "24"]
    rc, _, err = run_cli(capsys, *base, "--prompt-ids", "5,17,42,8", "--temperature", "0.9", "--seed", str(2 ** 63 - 1))
    lines = err.strip().splitlines()
    assert rc == 0 and len(lines) == 1 and len(lines[0]) < 240 and lines[0].endswith(f"; seed {2 ** 63 - 1}]"), lines
    path = requests_file(tmp_path, {"prompt_ids": [5, 17, 42, 8]}, {"prompt_ids": [9, 9, 3]}, {"prompt_ids": [1, 2, 3, 4, 5]})
    rc, _, err = run_cli(capsys, *base, "--prompts-file", path, "--concurrency", "2")
    stats = [x for x in err.strip().splitlines() if x.startswith("[request ")]
    assert rc == 0 and len(stats) == 3 and all(len(x) < 240 for x in stats), err
    assert "adaptive speculation:" not in err and "histogram" not in err


@pytest.mark.parametrize("module", ["generate", "tools.bench", "check"])
def test_help_shows_defaults(capsys, module):
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).cli(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    wanted = {"generate": ["(default: 128)", "(default: 0.0)", "(default: 1.0)", "(default: 0)", "(default: True)"],
              "tools.bench": ["(default: 128)", "(default: 64)", "(default: 5.6)"],
              "check": ["(default: float32)", "(default: 256)", "default: bfloat16, said in the report"]}[module]
    assert all(w in text for w in wanted), text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("args, says", [
    (["--heldout", "0"], "error: --heldout must be >= 1 (held-out prompts to run), got 0"),
    (["--prompts", "missing.txt"], "error: --prompts missing.txt: no such file (a text file with one prompt per line)"),
    (["--prompts", "{tmp}"], "error: --prompts {tmp} is a directory; give a text file with one prompt per line"),
])
def test_bench_prompt_flags_are_one_error_line(tmp_path, capsys, monkeypatch, args, says):
    from tools import bench
    import checkpoint
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checkpoint, "load_target", lambda *a, **kw: pytest.fail("loaded before the flags were checked"))
    assert bench.cli([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [says.format(tmp=tmp_path)], err


def test_bench_empty_prompts_file_is_refused(tmp_path, capsys):
    """An empty --prompts file is refused, not replaced by the held-out prompts."""
    from tools import bench
    (tmp_path / "p.txt").write_text("\n  \n")
    assert bench.cli(["--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", "2", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --prompts {tmp_path / 'p.txt'} holds no prompt (one per line)"], err


@pytest.mark.parametrize("args, says", [
    (["--prompt-len", "-5"], "--prompt-len must be >= 1"),
    (["--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["--preset", "tiny-9b-shape", "--random-weights", "--tau", "-1"], "--tau must be >= 1"),
    (["--preset", "tiny-9b-shape", "--random-weights", "--tau", "0"], "--tau must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--threads", "-2"], "--threads must be >= 1, got -2"),
    (["--random-weights"], "--random-weights applies to --preset"),
    (["--products", "mkl", "--draft", "none"], "--draft none names none"),
    (["--draft", "mtp"], "--methods dflash,mtp3"),
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1 (--max-new-tokens), got 0"),
    (["--max-new-tokens", "-3"], "max_new_tokens must be >= 1 (--max-new-tokens), got -3"),
    (["--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["--draft-window", "-1"], "--draft-window must be >= 0"),
    (["--heldout", "-4"], "--heldout must be >= 1"),
    (["--concurrency", "0"], "--concurrency takes whole numbers >= 1"),
    (["--concurrency", "junk"], "--concurrency takes whole numbers >= 1"),
    (["--concurrency", "1.5"], "--concurrency takes whole numbers >= 1"),
    (["--dataset", "humaneval", "--limit", "0"], "--limit must be at least 1"),
    (["--draft-rules", "0.5", "--selector-top-k", "0"], "--selector-top-k must be >= 1"),
    (["--draft-rules", "0.5", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--draft-rules", "-1"], "--draft-rules takes temperatures > 0"),
    (["--threads", "two"], "argument --threads: invalid int value: 'two'"),
    (["--parting", "--weight-dtype", "float32"], "--weight-dtype does not apply to --parting"),
    (["--preset", "tiny-9b-shape", "--random-weights", "--dtype", "bfloat16", "--weight-dtype", "float16"],
     "would round the weights"),
])
def test_bench_bad_values_are_one_error_line(capsys, monkeypatch, args, says):
    """Every flag of tools/bench.py with a value no mode can run: one 'error:' line on stderr, exit code 2, before
    any model loads (neither checkpoints nor a preset's random weights)."""
    from tools import bench, presets
    import checkpoint
    monkeypatch.setattr(checkpoint, "load_target", lambda *a, **kw: pytest.fail("loaded before the flags were checked"))
    monkeypatch.setattr(presets, "random_models", lambda *a, **kw: pytest.fail("built before the flags were checked"))
    capsys.readouterr()
    try:
        rc = bench.cli(args)
    except SystemExit as e:             # the argument parser's own errors (OneLineParser)
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_generate_refuses_packed_products_without_a_drafter(capsys):
    """--products mkl / onednn with --draft none and one request: no few-row products to pack, refused before loading."""
    rc, _, err = run_cli(capsys, "--draft", "none", "--products", "mkl", "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--products mkl" in err, err


def test_prompts_file_says_the_requests_really_in_flight(pair, tmp_path, capsys):
    """--prompts-file's summary line counts the requests in flight at once: never more than the file holds."""
    path = requests_file(tmp_path, {"prompt_ids": [5, 17, 42, 8]}, {"prompt_ids": [9, 9, 3]})
    rc, _, err = run_cli(capsys, "--target", pair / "target", "--draft", "none", "--max-new-tokens", "3",
                         "--prompts-file", path, "--concurrency", "8")
    assert rc == 0 and "[2 requests, 2 in flight:" in err, err


# --------------------------------------------------------------------------------------------------
# weights that are not numbers, and runs larger than the model or the machine
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which, name, value", [
    ("target", "model.layers.1.mlp.down_proj.weight", float("nan")),
    ("target", "model.embed_tokens.weight", float("-inf")),
    ("draft", "layers.0.self_attn.q_proj.weight", float("inf"))])
def test_a_weight_that_is_not_finite_is_named_with_its_file(pair, tmp_path, capsys, which, name, value):
    """One NaN or infinity in a checkpoint used to print garbage with exit code 0: it is found while loading, and
    the line names the tensor and the file."""
    from safetensors.torch import load_file, save_file
    folder = shutil.copytree(pair / which, tmp_path / which)
    f = str(folder / "model.safetensors")
    tensors = load_file(f)
    tensors[name].view(-1)[tensors[name].numel() // 2] = value
    save_file(tensors, f, metadata={"format": "pt"})
    target, draft = (folder, pair / "draft") if which == "target" else (pair / "target", folder)
    line = one_error_line(*run_cli(capsys, "--target", target, "--draft", draft, *ARGS)[::2])
    assert f"tensor {name} in {f} holds NaN or infinite values" in line and "re-download" in line, line


@pytest.mark.parametrize("args, says", [
    (["--cache-len", "5000"], "--cache-len 5000 is more than the target can use: its max_position_embeddings is 4096, so a "
                              "cache holds at most 4111 positions (4096 + 15 for the last verify block); use --cache-len 4111"),
    (["--draft", "none", "--cache-len", "4097"], "a cache holds at most 4096 positions; use --cache-len 4096 or less"),
    (["--max-new-tokens", "4094"], "prompt + max_new_tokens = 4097 exceeds the model's max_position_embeddings 4096")])
def test_a_cache_past_max_position_embeddings_is_refused_before_loading(capsys, monkeypatch, args, says):
    never_loads(monkeypatch)
    line = one_error_line(*run_cli(capsys, "--prompt-ids", "1,2,3", *args)[::2])
    assert says in line, line


def test_the_longest_cache_the_model_allows_runs(capsys):
    rc, out, _ = run_cli(capsys, "--draft", "none", "--cache-len", "4096", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["cache_len"] == 4096


def test_a_run_larger_than_the_machine_is_refused_before_loading(pair, tmp_path, capsys, monkeypatch):
    """--cache-len 10^12 on a target that allows it: one line with the need, the memory available and what to change,
    instead of torch's failed allocation (or the kernel's OOM killer)."""
    target = shutil.copytree(pair / "target", tmp_path / "t")
    edit_json(target / "config.json", lambda c: c.update(max_position_embeddings=10 ** 13))
    never_loads(monkeypatch)
    line = one_error_line(*run_cli(capsys, "--target", target, "--draft", pair / "draft", "--prompt-ids", "1,2,3",
                                   "--cache-len", str(10 ** 12))[::2])
    assert line.startswith("error: this run needs about ") and " GB of caches) but this machine has " in line, line
    assert line.endswith("available; use --dtype bfloat16 (half the bytes), or a shorter --cache-len"), line


def test_the_memory_estimate_counts_what_loading_and_the_caches_take(pair, tmp_path, capsys, monkeypatch):
    """target_bytes / drafter_bytes / cache_bytes equal the bytes of the loaded models and of the caches an engine
    allocates; a run whose estimate exceeds what is available (made small here) is refused before loading, naming
    --concurrency when it has several slots."""
    import engine
    import torch
    target = ckpt_mod.load_target(str(pair / "target"), torch.bfloat16)
    drafter = ckpt_mod.load_drafter(str(pair / "draft"), target.cfg, torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in target.parameters())
    assert ckpt_mod.target_bytes(target.cfg, torch.bfloat16) == held
    assert ckpt_mod.drafter_bytes(drafter.cfg, torch.bfloat16) == sum(p.numel() * p.element_size() for p in drafter.parameters())
    eng = engine.Engine(target, engine.DrafterProposer(drafter, target), 4, 3, 40)
    allocated = sum(t.numel() * t.element_size() for c in (eng.cache, eng.proposer.cache) for layer in c.layers
                    for t in vars(layer).values())
    assert ckpt_mod.cache_bytes(target.cfg, torch.bfloat16, 40, 3, 4, drafter.cfg) == allocated
    monkeypatch.setattr(ckpt_mod, "available_memory", lambda device: held)
    never_loads(monkeypatch)
    line = one_error_line(*run_cli(capsys, "--target", pair / "target", "--draft", pair / "draft", "--dtype", "bfloat16",
                                   "--prompts-file", requests_file(tmp_path, {"prompt_ids": [1, 2]}), "--concurrency", "4")[::2])
    assert f"but this machine has {held / 1e6:.1f} MB available; use a smaller --max-new-tokens, or fewer --concurrency slots" in line, line
