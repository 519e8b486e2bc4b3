"""generate.py and tools/bench.py under `torchrun --nproc-per-node 2` (gloo, CPU) print what one process prints: on the
embedded pair (adaptive speculation: the ranks share rank 0's step times), on a mixture-of-experts checkpoint with
its experts and drafter cut, and for a file of requests; the JSON records the degree."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import checkpoint as ckpt
from helpers import HAS_EMBEDDED_PAIR, ROOT, Early, random_drafter, random_target, tiny_draft_config, tiny_target_config

pytestmark = pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="the embedded pair is not checked out")


def one_process(args: list, capsys) -> list:
    """generate.py's stdout lines parsed as JSON (the non-JSON lines skipped), run in this process; it must exit 0."""
    import generate
    assert generate.cli(args[1:]) == 0
    return [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]


def torchrun(args: list, procs: int = 2) -> list:
    """The command under torchrun with `procs` ranks: its stdout lines parsed as JSON; it must exit 0."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    p = subprocess.run(launch + args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]      # (a rank's abort at teardown fails it here: tp.exit_process)
    return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]


def make_files() -> dict:
    """A mixture-of-experts checkpoint and a drafter for it, and a file of requests, in a directory kept to the end
    of the session -> their paths."""
    root = tempfile.mkdtemp(prefix="torchrun")
    atexit.register(shutil.rmtree, root, True)
    cfg = tiny_target_config(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=24, intermediate_size=0, vocab_size=64)
    t, d, reqs = os.path.join(root, "t"), os.path.join(root, "d"), os.path.join(root, "r.jsonl")
    os.makedirs(t), os.makedirs(d)
    ckpt.save_target(random_target(cfg, 1, torch.float32), t, dtype=torch.float32)
    ckpt.save_drafter(random_drafter(tiny_draft_config(cfg, block_size=8), 2, torch.float32), d, dtype=torch.float32)
    with open(reqs, "w") as f:
        f.write('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5, 6, 7], "temperature": 0.7, "seed": 3}\n'
                '{"prompt_ids": [9, 10], "max_new_tokens": 10}\n')
    return {"target": t, "draft": d, "requests": reqs}


SAME = ("output_ids", "seed")                          # what adaptive speculation's timing never changes
ROUNDS = SAME + ("acceptance_lengths", "step_kinds", "draft_ids")     # and with --no-adaptive, every round
EMBEDDED = ["generate.py", "--prompt-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "48", "--json"]


def moe_flags(f: dict) -> list:
    return ["generate.py", "--target", f["target"], "--draft", f["draft"], "--prompt-ids", "1,2,3,4,5",
            "--max-new-tokens", "24", "--json", "--temperature", "0.8", "--seed", "4", "--dtype", "float64",
            "--no-adaptive"]


def file_flags(f: dict) -> list:
    return ["generate.py", "--prompts-file", f["requests"], "--concurrency", "2", "--max-new-tokens", "32",
            "--json"]


def run_all() -> dict:
    """Every torchrun command of this module, one after another; "files": what they read (make_files), for the
    tests' one-process runs."""
    if not HAS_EMBEDDED_PAIR:
        return {}
    f = make_files()
    return {"files": f, "embedded": torchrun(EMBEDDED + ["--threads", "1"]),
            "moe": torchrun(moe_flags(f) + ["--expert-parallel", "--tp-drafter", "sharded", "--threads", "1"]),
            "file": torchrun(file_flags(f) + ["--threads", "1"]),
            "bench": torchrun(["tools/bench.py", "--heldout", "2", "--max-new-tokens", "24", "--threads", "1"])}


RUNS = Early(run_all)              # started with the suite, on the core its one-thread tests leave idle


def test_generate_on_the_embedded_pair(capsys):
    one, two = one_process(EMBEDDED, capsys)[-1], RUNS.result()["embedded"]
    assert len(two) == 1, "only rank 0 prints"
    two = two[0]
    assert {k: two[k] for k in SAME} == {k: one[k] for k in SAME}
    assert one["step_kinds"].count("verify") > 2                   # rounds ran, with real acceptance
    assert (one["tensor_parallel"], two["tensor_parallel"], two["tp_drafter"]) == (1, 2, "replicated")


def test_generate_on_a_moe_target(capsys):
    """Experts whole per rank and the drafter cut by head, sampled, pure rounds: every round as in one process."""
    runs = RUNS.result()
    one, two = one_process(moe_flags(runs["files"]), capsys)[-1], runs["moe"][-1]
    assert {k: two[k] for k in ROUNDS} == {k: one[k] for k in ROUNDS}
    assert (two["tensor_parallel"], two["expert_parallel"], two["tp_drafter"]) == (2, True, "sharded")


def test_a_file_of_requests(capsys):
    """--prompts-file --concurrency 2: the batch's policy shares rank 0's times, and a request without a seed gets
    rank 0's random one (so both ranks draw the same tokens)."""
    runs = RUNS.result()
    one, two = one_process(file_flags(runs["files"]), capsys), runs["file"]
    assert [r["index"] for r in two] == [0, 1, 2]
    assert [[r[k] for k in SAME] for r in two] == [[r[k] for k in SAME] for r in one]
    assert {r["tensor_parallel"] for r in two} == {2}


def test_bench_side_by_side():
    out = RUNS.result()["bench"][-1]
    assert out["tensor_parallel"] == 2 and out["identical_outputs"] == 2
    H, L = 256, 6                                            # the embedded target's width and layers, float32
    assert out["allreduce_bytes_per_decode"] == 2 * L * H * 4
    assert out["allreduce_bytes_per_round"] == 2 * L * out["block_size"] * H * 4
