"""docs/llama-cpp/side_by_side.py without llama.cpp: llama-bench's JSON read (a real one, trimmed, from the recipe's
tiny f32 GGUF at 1 and 2 threads), tools/bench.py's last JSON line read, the tables, the run wired end to end with a
stand-in llama-bench that prints that JSON, and a WORKDIR without the recipe's outputs as one line, exit 2."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "docs", "llama-cpp", "side_by_side.py")
CANNED = os.path.join(ROOT, "tests", "data", "llama_bench_tiny_f32.json")


@pytest.fixture(scope="module")
def sbs():
    spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_llama_bench(sbs):
    with open(CANNED) as fh:
        entries = json.load(fh)
    got = sbs.parse_llama_bench(entries)
    assert sorted(got) == [1, 2]
    by = {(e["n_threads"], e["n_prompt"], e["n_gen"]): e for e in entries}
    for t in (1, 2):
        tg, pp = by[t, 0, 32], by[t, 16, 0]
        assert got[t]["tg_ms"] == pytest.approx(1000 / tg["avg_ts"])
        assert got[t]["pp16_ms"] == pytest.approx(16 * 1000 / pp["avg_ts"])
        assert got[t]["tg_sd_ms"] == pytest.approx(tg["stddev_ns"] / 1e6 / 32)
        assert got[t]["tg_median_ms"] == pytest.approx(sorted(tg["samples_ns"])[1] / 1e6 / 32)      # 3 samples
        assert got[t]["pp16_median_ms"] == pytest.approx(sorted(pp["samples_ns"])[1] / 1e6)
        assert (got[t]["n_gen"], got[t]["n_prompt"]) == (32, 16)
    # ms per token from tokens per second agrees with llama-bench's own mean time (to its sample spread)
    assert got[1]["tg_ms"] == pytest.approx(by[1, 0, 32]["avg_ns"] / 1e6 / 32, rel=0.05)


def test_parse_bench_takes_the_last_json_line(sbs):
    out = "warm-up 3.1 s\n{\"decode_ms\": 99}\nms per step ...\n" + json.dumps(
        {"decode_ms": 1.5, "verify_ms": 4.0, "draft_ms": 0.5, "ar_tokens_per_s": 600.0, "dflash_tokens_per_s": 900.0})
    got = sbs.parse_bench(out)
    assert (got["decode_ms"], got["verify_ms"], got["draft_ms"]) == (1.5, 4.0, 0.5)
    assert (got["ar_tokens_per_s"], got["dflash_tokens_per_s"], got["mean_acceptance_length"]) == (600.0, 900.0, None)
    with pytest.raises(RuntimeError, match="no JSON line"):
        sbs.parse_bench("Traceback ...\n")


def test_tables(sbs):
    rows = [{"dtype": "float32", "threads": 1, "llama": {"tg_ms": 1.0555, "pp16_ms": 3.79, "ar_tokens_per_s": 871.4,
                                                          "dflash_tokens_per_s": 739.5},
             "ours": {"decode_ms": 1.62, "verify_ms": 12.345, "draft_ms": 0.81, "ar_tokens_per_s": 612.0,
                      "dflash_tokens_per_s": 1530.2}},
            {"dtype": "bfloat16", "threads": 2, "llama": {}, "ours": {"decode_ms": 250.4}}]
    lines = sbs.format_table("embedded", rows).splitlines()
    assert len(lines) == 4 and lines[1] == "|" + "---|" * 9
    assert lines[0].split(" | ")[2:4] == ["llama.cpp tg ms", "ours decode ms"]
    assert lines[2] == "| float32 | 1 | 1.06 | 1.62 | 3.79 | 12.3 | 0.81 | 871 / 740 | 612 / 1530 |"
    assert lines[3] == "| bfloat16 | 2 | - | 250 | - | - | - | - / - | - / - |"
    small = sbs.format_table("0.8b", rows).splitlines()          # no tok/s columns for the random model
    assert small[1] == "|" + "---|" * 7 and small[2] == "| float32 | 1 | 1.06 | 1.62 | 3.79 | 12.3 | 0.81 |"


def test_bench_commands(sbs):
    emb = sbs.bench_cmd("py", "embedded", "bf16", 2, 3)
    assert emb[:7] == ["py", "tools/bench.py", "--compile", "--threads", "2", "--dtype", "bfloat16"]
    assert [emb[i + 1] for i, a in enumerate(emb) if a == "--prompt"] == sbs.PROMPTS and "--repeat" in emb and "--no-adaptive" in emb
    small = sbs.bench_cmd("py", "0.8b", "f32", 1, 3)
    assert small[small.index("--preset") + 1] == "qwen3.5-0.8b" and "--random-weights" in small
    assert small[small.index("--weight-dtype") + 1] == "float32"            # widened: the checkpoint's bf16 is not kept
    kept = sbs.bench_cmd("py", "4b", "kept", 2, 3)
    assert kept[kept.index("--preset") + 1] == "qwen3.5-4b"
    assert (kept[kept.index("--dtype") + 1], kept[kept.index("--weight-dtype") + 1]) == ("float32", "bfloat16")


def test_kept_and_bf16_share_llamas_bf16_gguf(sbs, tmp_path, capsys):
    """Our kept and bf16 rows both stand beside llama.cpp's bf16 GGUF: llama-bench runs it once, both rows get its
    numbers; the 2b model's GGUFs are named by its size."""
    bench = tmp_path / "build" / "bin" / "llama-bench"
    bench.parent.mkdir(parents=True)
    calls = tmp_path / "calls"
    bench.write_text(f"#!/bin/sh\ncase \"$1\" in --version) echo 'version: test';; *) echo \"$2\" >> '{calls}'; "
                     f"cat '{CANNED}';; esac\n")
    bench.chmod(0o755)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "qwen35-2b-random-bf16.gguf").write_bytes(b"")
    rc = sbs.main([str(tmp_path), "--models", "2b", "--dtypes", "bf16,kept", "--threads", "1", "--only", "llama"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and calls.read_text().splitlines() == [str(tmp_path / "gguf" / "qwen35-2b-random-bf16.gguf")]
    rows = result["models"]["2b"]
    assert [r["dtype"] for r in rows] == ["bfloat16", "float32 over bfloat16 weights"]
    assert rows[0]["llama"] == rows[1]["llama"] and rows[0]["llama"]["tg_ms"] > 0


def test_run_with_a_stand_in_llama_bench(sbs, tmp_path, capsys):
    """--only llama on the 0.8b model whose GGUFs exist (so nothing converts): llama-bench's JSON lands in the
    rows of its thread counts, and the report ends with one JSON line."""
    bench = tmp_path / "build" / "bin" / "llama-bench"
    bench.parent.mkdir(parents=True)
    bench.write_text(f"#!/bin/sh\ncase \"$1\" in --version) echo 'version: test';; *) cat '{CANNED}';; esac\n")
    bench.chmod(0o755)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "qwen35-0.8b-random-f32.gguf").write_bytes(b"")
    rc = sbs.main([str(tmp_path), "--models", "0.8b", "--dtypes", "f32", "--threads", "1,2", "--only", "llama"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    result = json.loads(out[-1])
    assert "version: test" in result["llama_cpp"] and result["cpu"] and result["errors"] == []
    rows = result["models"]["0.8b"]
    assert [(r["threads"], round(r["llama"]["tg_ms"], 3)) for r in rows] == [(1, 1.067), (2, 2.748)]
    assert any(line.startswith("| float32 | 2 | 2.75 |") for line in out)


@pytest.mark.parametrize("make", ["none", "empty"])
def test_missing_workdir_is_one_line_and_exit_2(tmp_path, make):
    wd = tmp_path / "wd"
    if make == "empty":
        wd.mkdir()
    r = subprocess.run([sys.executable, SCRIPT, str(wd)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "recipe.sh" in lines[0] and "Traceback" not in r.stderr, r.stderr
    if make == "empty":
        assert "build/bin/llama-bench" in lines[0] and "gguf/tiny-qwen35-f32.gguf" in lines[0]
    else:
        assert "does not exist" in lines[0]
