"""generate.py end to end, as a user runs it: its output equals transformers' own greedy generate, the
--json line is the oracle interface, text streams through the checkpoint's tokenizer, and every bad
input exits with code 2 and one 'error:' line.

Every `python generate.py` process is started at once by the `runs` fixture (they are independent, and
most of each one's time is importing torch), then each test checks its own run. Variants that need no
process of their own call generate.main (or generate.cli, for the bad inputs) in-process."""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import dflash
import generate
import options
import model as M
from helpers import HAS_EMBEDDED_PAIR, Early, edit_json, save_hf_causal_lm, save_zlab_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 17, 42, 8, 91, 23, 60, 3]
MAX_NEW = 20
BLOCK = 8                                       # the drafter's block_size
JSON_KEYS = {"prompt_ids", "output_ids", "acceptance_lengths", "draft_ids", "decode_seconds"}
# One thread per process: the models are tiny, and OpenMP threads fighting other work for 2 cores turn a
# 3-second run into a 30-second one.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@dataclass
class Done:
    rc: int
    out: str
    err: str

    def __str__(self):
        return f"rc {self.rc}\nstdout:\n{self.out}\nstderr:\n{self.err}"


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def hf_greedy(hf, prompt, max_new):
    """transformers' own greedy decoding; the tiny config has no eos, so it runs the full length."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


pytestmark = pytest.mark.usefixtures("one_thread")      # in-process work on one thread too (conftest.py)


# --------------------------------------------------------------------------------------------------
# checkpoints and the runs
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 6-layer transformers Qwen3.5 target and a z-lab drafter for it (default layer ids [1, 3]), the
    transformers greedy reference, and a drafter built for another (4-layer) target."""
    root = tmp_path_factory.mktemp("cli")
    hf = save_hf_causal_lm(root / "target", seed=11, num_hidden_layers=6)
    save_zlab_drafter(root / "draft", target_layers=6, vocab=97, hidden=64, seed=12, block_size=BLOCK)
    save_zlab_drafter(root / "other_draft", target_layers=4, vocab=97, hidden=64, layer_ids=[0, 2])
    ref = hf_greedy(hf, PROMPT, MAX_NEW)
    assert len(ref) == MAX_NEW
    return {"target": str(root / "target"), "draft": str(root / "draft"), "other_draft": str(root / "other_draft"),
            "root": str(root), "ref": ref}


@pytest.fixture(scope="module")
def tok_ckpt(tmp_path_factory):
    """A byte-level BPE tokenizer trained on a few sentences, and a target + drafter with its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world", "hello there, how are you?", "the quick brown fox jumps over the lazy dog",
                             "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"], trainer)
    V = tok.get_vocab_size()
    root = tmp_path_factory.mktemp("tok")
    save_hf_causal_lm(root / "target", seed=21, vocab_size=V)
    save_zlab_drafter(root / "draft", target_layers=4, vocab=V, hidden=64, seed=22, layer_ids=[0, 2])
    tok.save(str(root / "target" / "tokenizer.json"))
    return {"target": str(root / "target"), "draft": str(root / "draft"), "tok": tok}


IDS_ARG = ",".join(map(str, PROMPT))

# name -> generate.py arguments ({...} filled from ckpt / tok_ckpt); --target T --draft D come first unless overridden
GOOD = {
    "json-dflash": ["--prompt-ids", IDS_ARG, "--max-new-tokens", MAX_NEW, "--json", "--dtype", "float32"],
    "json-ar": ["--draft", "none", "--prompt-ids", IDS_ARG, "--max-new-tokens", MAX_NEW, "--json", "--dtype", "float32"],
    "tok-text": ["--target", "{tok_target}", "--draft", "{tok_draft}", "--prompt", "hello", "--max-new-tokens", 12],
}
# name -> (arguments, what the error line must say)
BAD = {
    "empty-prompt-ids": (["--prompt-ids", ""], "the prompt is empty"),
    "block-size-0": (["--prompt-ids", "1,2", "--block-size", "0"], "--block-size must be >= 1"),
    "block-size-over-drafter": (["--prompt-ids", "1,2", "--block-size", BLOCK + 1], f"exceeds the drafter's block_size {BLOCK}"),
    "cache-len-too-small": (["--prompt-ids", "1,2,3", "--max-new-tokens", 10, "--cache-len", 19], "exceeds the cache length 19"),
    "missing-target": (["--prompt-ids", "1,2", "--target", "{root}/no-such-target"], "there is no folder {root}/no-such-target ("),
    "prompt-without-tokenizer": (["--prompt", "hello"], "has no tokenizer.json"),
}


@pytest.fixture(scope="module")
def runs(ckpt, tok_ckpt):
    fill = dict(ckpt, tok_target=tok_ckpt["target"], tok_draft=tok_ckpt["draft"])
    cmds = {**GOOD, "missing-target": BAD["missing-target"][0]}     # (the other bad inputs: in-process, below)
    procs = {}
    for name, args in cmds.items():
        argv = ["--target", ckpt["target"], "--draft", ckpt["draft"], *[str(a).format(**fill) for a in args]]
        procs[name] = subprocess.Popen([sys.executable, "generate.py", *argv], cwd=ROOT, env=ENV,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=300)
            done[name] = Done(p.returncode, out.decode("utf-8"), err.decode("utf-8"))
    finally:
        for p in procs.values():          # a hung run must not outlive the session
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def main_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert generate.main([str(a) for a in args]) == 0
    return last_json(capsys.readouterr().out)


# --------------------------------------------------------------------------------------------------
# the "done when" check: python generate.py == transformers greedy
# --------------------------------------------------------------------------------------------------

def test_dflash_json_equals_transformers_greedy(ckpt, runs):
    r = runs["json-dflash"]
    assert r.rc == 0, r
    res = last_json(r.out)
    assert JSON_KEYS <= set(res)
    assert res["prompt_ids"] == PROMPT
    assert res["output_ids"] == ckpt["ref"]
    assert res["mode"] == "dflash" and res["block_size"] == BLOCK and res["decode_seconds"] > 0
    assert sum(res["acceptance_lengths"]) + 1 == len(res["output_ids"])
    assert len(res["draft_ids"]) == len(res["acceptance_lengths"])
    assert len(res["step_kinds"]) == len(res["draft_ids"]) and set(res["step_kinds"]) <= {"verify", "plain"}
    for kind, d, a in zip(res["step_kinds"], res["draft_ids"], res["acceptance_lengths"]):    # adaptive speculation:
        if kind == "verify":                   # rounds verify the whole block or, where one pays more, a shorter one
            assert 1 <= len(d) <= BLOCK - 1 and 1 <= a <= len(d) + 1
        else:
            assert (d, a) == ([], 1)           # plain steps


def test_ar_json_equals_transformers_greedy(ckpt, runs):
    r = runs["json-ar"]
    assert r.rc == 0, r
    res = last_json(r.out)
    assert JSON_KEYS <= set(res)
    assert res["prompt_ids"] == PROMPT and res["output_ids"] == ckpt["ref"]
    assert res["mode"] == "ar" and res["acceptance_lengths"] == [] and res["draft_ids"] == []


def test_prompt_text_streams_through_the_tokenizer(tok_ckpt, runs, capsys):
    rt = runs["tok-text"]
    assert rt.rc == 0, rt
    res = main_json(capsys, "--target", tok_ckpt["target"], "--draft", tok_ckpt["draft"], "--prompt", "hello",
                    "--max-new-tokens", 12, "--json")
    assert res["prompt_ids"] == tok_ckpt["tok"].encode("hello").ids
    text = tok_ckpt["tok"].decode(res["output_ids"], skip_special_tokens=False)
    assert text and res["text"] == text
    # stdout: the prompt echoed, then the streamed pieces, which add up to the decoded text; nothing else
    assert rt.out == "hello" + text + "\n", (rt.out, text)
    stats = rt.err.splitlines()                       # the statistics go to stderr
    assert len(stats) == 1 and "tok/s" in stats[0], rt.err
    assert "mean acceptance length" in stats[0] or "no draft-verify round; 11 plain steps" in stats[0], rt.err
    assert stats[0].startswith(f"[{len(res['output_ids'])} tokens; load ") and "first token " in stats[0]
    # in-process, the text goes to the sys.stdout of the moment (here capsys's), not the one at import
    assert generate.main(["--target", tok_ckpt["target"], "--draft", tok_ckpt["draft"], "--prompt", "hello",
                          "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == "hello" + text + "\n"


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_error_line(ckpt, runs, capsys, name):
    """Each bad input: exit code 2 and one 'error:' line naming it, from generate.cli in-process and, for one of
    them, from the `python generate.py` process itself."""
    fill = dict(ckpt)
    args, words = BAD[name]
    capsys.readouterr()
    rc = generate.cli(["--target", ckpt["target"], "--draft", ckpt["draft"], *[str(a).format(**fill) for a in args]])
    results = [Done(rc, *capsys.readouterr())] + ([runs[name]] if name in runs else [])
    for r in results:
        assert r.rc == 2, r
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r
        assert words.format(root=ckpt["root"]) in lines[0], lines[0]


# --------------------------------------------------------------------------------------------------
# in-process variants of the same command line
# --------------------------------------------------------------------------------------------------



@pytest.mark.parametrize("block", [1, 3])
def test_smaller_block_size_same_output(ckpt, capsys, block):
    res = main_json(capsys, "--target", ckpt["target"], "--draft", ckpt["draft"], "--prompt-ids", IDS_ARG,
                    "--max-new-tokens", MAX_NEW, "--json", "--block-size", block)
    assert res["output_ids"] == ckpt["ref"] and res["block_size"] == block
    assert all(len(d) == block - 1 if k == "verify" else d == [] for d, k in zip(res["draft_ids"], res["step_kinds"]))
    assert sum(res["acceptance_lengths"]) + 1 == MAX_NEW


def test_stop_token_from_generation_config(ckpt, capsys, tmp_path):
    target = shutil.copytree(ckpt["target"], tmp_path / "t")
    ref = ckpt["ref"]
    stop = ref[6]
    edit_json(target / "generation_config.json", lambda c: c.update(eos_token_id=[stop, 96]))
    res = main_json(capsys, "--target", target, "--draft", ckpt["draft"], "--prompt-ids", IDS_ARG,
                    "--max-new-tokens", MAX_NEW, "--json")
    cut = min(i for i, t in enumerate(ref) if t in (stop, 96))
    assert res["output_ids"] == ref[:cut + 1]


def test_text_mode_without_tokenizer_prints_ids_and_stats(ckpt, capsys):
    assert generate.main(["--target", ckpt["target"], "--draft", ckpt["draft"], "--prompt-ids", " ".join(map(str, PROMPT)),
                          "--max-new-tokens", str(MAX_NEW), "--no-adaptive"]) == 0
    got = capsys.readouterr()
    lines = got.out.strip().splitlines()
    assert lines[0].startswith("(no tokenizer.json") and len(lines) == 2
    assert [int(t) for t in lines[1].split()] == ckpt["ref"]       # spaces separate --prompt-ids too
    stats = got.err.strip()
    assert "tok/s" in stats and "mean acceptance length" in stats and f"[{MAX_NEW} tokens" in stats
    assert "draft-verify rounds, mean acceptance length" in stats and "histogram" not in stats     # (--json has the lengths)


@pytest.mark.parametrize("text, ids", [("1,2,3", [1, 2, 3]), (" 1, 2 ,3 ", [1, 2, 3]), ("1 2", [1, 2]),
                                       ("7,", [7]), ("", []), (" , ", [])])
def test_parse_ids(text, ids):
    assert options.parse_ids(text) == ids


@pytest.mark.parametrize("args, exc, words", [
    (["--prompt-ids", "1,two"], dflash.GenerationError, "comma-separated integers"),
    (["--prompt-ids", " , "], dflash.GenerationError, "the prompt is empty"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], dflash.GenerationError, "max_new_tokens must be >= 1"),
    (["--prompt-ids", "1", "--draft", "none", "--block-size", "0"], dflash.GenerationError, "--block-size must be >= 1"),
    (["--prompt-ids", "1", "--draft", "{root}/no-such-draft"], M.CheckpointError, "there is no folder {root}/no-such-draft"),
    (["--prompt-ids", "1", "--draft", "{target}"], M.CheckpointError, "is a Qwen3.5 model (model_type qwen3_5_text), not a drafter; pass it as the target"),
    (["--prompt-ids", "1", "--target", "{draft}"], M.CheckpointError, "is a DFlash drafter (DFlashDraftModel), not a target; pass it as the drafter"),
    (["--prompt-ids", "1", "--device", "cuda"], dflash.GenerationError, "CUDA"),
    (["--prompt-ids=1,97"], dflash.GenerationError, "outside the vocabulary 0..96"),
    (["--prompt-ids", "1", "--draft", "{other_draft}"], M.CheckpointError, "built for a 4-layer target"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "10", "--cache-len", "19"], dflash.GenerationError, "+ block slack (7) = 20"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "10", "--cache-len", "12", "--draft", "none"], dflash.GenerationError,
     "= 13 exceeds the cache length 12"),
])
def test_more_bad_inputs(ckpt, args, exc, words):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = ["--target", ckpt["target"], "--draft", ckpt["draft"], *[a.format(**ckpt) for a in args]]
    with pytest.raises(exc) as e:
        generate.main(argv)
    assert words.format(**ckpt) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra", [["--attention", "flex"], ["--products", "onednn"], ["--products", "mkl"]])
def test_optional_speed_paths_same_output(ckpt, capsys, extra):
    """The optional modules behind their flags (speed/flex.py, speed/packed.py) change no token."""
    res = main_json(capsys, "--target", ckpt["target"], "--draft", ckpt["draft"], "--prompt-ids", IDS_ARG,
                    "--max-new-tokens", MAX_NEW, "--json", *extra)
    assert res["output_ids"] == ckpt["ref"]


def test_packed_products_are_chosen_once_by_measurement(ckpt, capsys, monkeypatch, tmp_path):
    """Without --products, generate.py times every kind of product on the rows of a verify block (packed.measure,
    stood in for here) the first time, swaps only where a packed kind is clearly faster, and later runs read that
    verdict from the cache beside inductor's (other rows are measured anew); the --json line and the statistics line
    say what was chosen. --products forces a kind without measuring, plain decoding has no few-row products to
    measure, and no choice changes a token."""
    from speed import packed
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fast = packed.KINDS[0]
    asked, timing = [], {}

    def measure(modules, rows):
        asked.append(rows)
        return {"plain": 1.0, **{k: timing.get(k, 1.0) for k in packed.KINDS}}

    monkeypatch.setattr(packed, "measure", measure)
    base = ["--target", ckpt["target"], "--draft", ckpt["draft"], "--prompt-ids", IDS_ARG, "--max-new-tokens", str(MAX_NEW)]
    cases = [({fast: 0.5}, [], fast, False, [BLOCK]),
             ({fast: 1.3}, [], fast, True, []),                      # the first verdict, read from the cache
             ({fast: 1.3}, ["--block-size", "4"], "plain", False, [4]),
             ({}, ["--products", "onednn"], "onednn" if packed.AVAILABLE["onednn"] else "plain", False, []),
             ({}, ["--products", "plain"], "plain", False, []),
             ({}, ["--draft", "none"], "plain", False, [])]
    for t, extra, kind, cached, rows in cases:
        timing.clear()
        timing.update(t)
        asked.clear()
        res = main_json(capsys, *base, "--json", *extra)
        assert (res["products"], res["products_cached"], asked) == (kind, cached, rows), extra
        assert res["output_ids"] == ckpt["ref"], extra
    assert generate.main(base) == 0
    assert f"; {fast} packed products]" in capsys.readouterr().err


def test_unknown_attention_backend_is_refused(ckpt, capsys):
    """Refused by the argument parser: exit 2, one usage error."""
    with pytest.raises(SystemExit) as e:
        generate.main(["--target", ckpt["target"], "--prompt-ids", "1", "--attention", "flash"])
    assert e.value.code == 2 and "invalid choice: 'flash'" in capsys.readouterr().err


def test_each_sample_has_its_labelled_stats_line(tok_ckpt, capsys):
    """--num-samples: stdout separates the samples' texts, stderr has one statistics line per sample saying
    which one it describes."""
    assert generate.main(["--target", tok_ckpt["target"], "--draft", tok_ckpt["draft"], "--prompt", "hello",
                          "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "1", "--num-samples", "2"]) == 0
    got = capsys.readouterr()
    assert got.out.startswith("--- sample 1/2\nhello") and "\n--- sample 2/2\nhello" in got.out
    stats = got.err.strip().splitlines()
    assert [s[:len("[sample 1/2: ")] for s in stats] == ["[sample 1/2: ", "[sample 2/2: "], got.err
    assert all("tok/s" in s and "first token " in s for s in stats)


def test_same_seed_same_text_whatever_the_step_pattern(tok_ckpt, capsys, monkeypatch):
    """One sampled command under adaptive speculation that decides differently (stand-in policies forcing two step
    patterns, as different timings would), with pure rounds and without a drafter: the same text for the seed."""
    from test_batching import Pattern
    argv = ["--target", tok_ckpt["target"], "--draft", tok_ckpt["draft"], "--prompt", "hello", "--max-new-tokens", "24",
            "--temperature", "0.9", "--top-p", "0.95", "--seed", "7"]
    texts, kinds = [], []
    for pattern in ([True], [False, 3, True, False], [False]):
        monkeypatch.setattr(generate, "engine_policy", lambda block, slots, pattern=pattern: Pattern(pattern, block))
        assert generate.main(argv) == 0
        got = capsys.readouterr()
        texts.append(got.out)
        kinds.append(got.err)
    # pure rounds; no drafter; and FlexAttention masks
    for extra in (["--no-adaptive"], ["--draft", "none"], ["--attention", "flex"]):
        assert generate.main(argv + extra) == 0
        texts.append(capsys.readouterr().out)
    assert len(set(texts)) == 1 and texts[0].startswith("hello"), texts
    assert "plain steps" not in kinds[0] and "23 plain steps" in kinds[2] and "no draft-verify round;" in kinds[2]
    assert all(k.rstrip().endswith("; seed 7]") for k in kinds)
    monkeypatch.undo()
    assert generate.main(argv[:-2] + ["--json"]) == 0              # no --seed: a random one, recorded in the trace
    seed = last_json(capsys.readouterr().out)["seed"]
    assert isinstance(seed, int)


def test_stats_line_says_what_ran(ckpt, capsys):
    """A generation that ended with its first token says so, instead of a mean acceptance of 0."""
    assert generate.main(["--target", ckpt["target"], "--draft", ckpt["draft"], "--prompt-ids", IDS_ARG,
                          "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "no draft-verify round: the generation ended with its first token" in err and "acceptance" not in err


def test_threads_flag(ckpt, capsys):
    before = torch.get_num_threads()
    try:
        res = main_json(capsys, "--target", ckpt["target"], "--draft", ckpt["draft"], "--prompt-ids", IDS_ARG,
                        "--max-new-tokens", MAX_NEW, "--json", "--threads", "2")     # (the suite runs at 1)
        assert res["output_ids"] == ckpt["ref"] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(dflash.GenerationError, match="--threads must be >= 1, got 0"):
        generate.main(["--target", ckpt["target"], "--prompt-ids", "1", "--threads", "0"])


def test_chat_offline_with_a_template_file(capsys):
    """--chat-template FILE: the embedded target ships no template, and Qwen3.5's own (checkpoints/) renders --prompt
    as a user turn, offline; the prompt ids are that rendering's; a missing file is one error line."""
    import chat
    import checkpoint as ckpt
    tpl = os.path.join(options.HERE, "checkpoints", "qwen35_chat_template.jinja")
    assert generate.main(["--chat-template", tpl, "--prompt", "Hi", "--max-new-tokens", "4", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tok = ckpt.load_tokenizer(options.DEFAULT_TARGET)
    text = chat.render_chat(open(tpl).read(), [{"role": "user", "content": "Hi"}], special_tokens={})
    assert res["chat"] is not False and res["prompt_ids"] == tok.encode(text, add_special_tokens=False).ids
    assert text.startswith("<|im_start|>user\nHi")
    assert generate.cli(["--chat-template", "missing.jinja", "--prompt", "Hi"]) == 2
    assert "--chat-template missing.jinja: no such file" in capsys.readouterr().err


def eager_run_imports() -> tuple | None:
    """The work of the test below, in a process of its own (helpers.Early): generate.py's command line, eager, on
    the embedded pair with plain few-row products over its bfloat16 weights (model.few_row_product) -> (its exit
    code, the compiler's modules it imported)."""
    import contextlib
    import io
    if not HAS_EMBEDDED_PAIR:
        return None
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = generate.cli(["--prompt", "def f():", "--max-new-tokens", "24", "--products", "plain", "--no-adaptive"])
    return rc, sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))


# started with the suite, in a process of its own
EAGER_IMPORTS = Early(eager_run_imports, process=True, used_by=["test_an_eager_run_never_imports_the_compiler"])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_an_eager_run_never_imports_the_compiler():
    """An eager run pays nothing for torch.compile: importing torch._dynamo costs 1.5 s and more per process (the
    meta-device build that counts the model's bytes, a custom op called eagerly and functional collectives would
    each import it). (With `--products auto`, the first run on a machine times plain products through their custom
    op once, as compiled steps call them: speed/packed.measure; later runs read its cached verdict.)"""
    assert EAGER_IMPORTS.result() == (0, [])
