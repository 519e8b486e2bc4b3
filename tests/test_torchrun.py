"""generate.py and bench.py under `torchrun --nproc-per-node 2` (gloo, CPU) print what one process prints: on the
embedded pair (adaptive speculation: the ranks share rank 0's step times), on a mixture-of-experts checkpoint with
its experts and drafter cut, and for a file of requests; the JSON records the degree."""
import json
import os
import subprocess
import sys

import pytest
import torch

import checkpoint as ckpt
from helpers import HAS_EMBEDDED_PAIR, ROOT, random_drafter, random_target, tiny_draft_config, tiny_target_config

pytestmark = pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="the embedded pair is not checked out")


def run(args: list, procs: int = 1, capsys=None) -> list:
    """The command's stdout lines parsed as JSON (the non-JSON lines skipped); it must exit 0. One process runs
    in this one (generate.cli, output from capsys); several under torchrun."""
    if procs == 1:
        import generate
        assert generate.cli(args[1:]) == 0
        out = capsys.readouterr().out
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        for attempt in range(2):
            p = subprocess.run(launch + args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            # A known intermittent abort of a rank at process exit, after its output is complete ("terminate called
            # without an active exception": a C++ thread still joinable when the process's statics are destroyed,
            # after the process group is destroyed). Seen in about one suite run in several, each time in another
            # of these tests; one retry, so a failure that repeats still fails.
            if p.returncode == 0 or "terminate called without an active exception" not in p.stderr:
                break
        assert p.returncode == 0, p.stderr[-3000:]
        out = p.stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


SAME = ("output_ids", "seed")                          # what adaptive speculation's timing never changes
ROUNDS = SAME + ("acceptance_lengths", "step_kinds", "draft_ids")     # and with --no-adaptive, every round


def test_generate_on_the_embedded_pair(capsys):
    flags = ["generate.py", "--prompt-ids", "1,2,3,4,5,6,7", "--max-new-tokens", "48", "--json"]
    one, two = run(flags, 1, capsys)[-1], run(flags + ["--threads", "1"], 2)
    assert len(two) == 1, "only rank 0 prints"
    two = two[0]
    assert {k: two[k] for k in SAME} == {k: one[k] for k in SAME}
    assert one["step_kinds"].count("verify") > 2                   # rounds ran, with real acceptance
    assert (one["tensor_parallel"], two["tensor_parallel"], two["tp_drafter"]) == (1, 2, "replicated")


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    cfg = tiny_target_config(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=24, intermediate_size=0, vocab_size=64)
    os.makedirs(root / "t"), os.makedirs(root / "d")
    ckpt.save_target(random_target(cfg, 1, torch.float32), str(root / "t"), dtype=torch.float32)
    ckpt.save_drafter(random_drafter(tiny_draft_config(cfg, block_size=8), 2, torch.float32), str(root / "d"),
                      dtype=torch.float32)
    return str(root / "t"), str(root / "d")


def test_generate_on_a_moe_target(moe_pair, capsys):
    """Experts whole per rank and the drafter cut by head, sampled, pure rounds: every round as in one process."""
    target, draft = moe_pair
    flags = ["generate.py", "--target", target, "--draft", draft, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "24",
             "--json", "--temperature", "0.8", "--seed", "4", "--dtype", "float64", "--no-adaptive"]
    one = run(flags, 1, capsys)[-1]
    two = run(flags + ["--expert-parallel", "--tp-drafter", "sharded", "--threads", "1"], 2)[-1]
    assert {k: two[k] for k in ROUNDS} == {k: one[k] for k in ROUNDS}
    assert (two["tensor_parallel"], two["expert_parallel"], two["tp_drafter"]) == (2, True, "sharded")


def test_a_file_of_requests(tmp_path, capsys):
    """--prompts-file --concurrency 2: the batch's policy shares rank 0's times, and a request without a seed gets
    rank 0's random one (so both ranks draw the same tokens)."""
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5, 6, 7], "temperature": 0.7, "seed": 3}\n'
                    '{"prompt_ids": [9, 10], "max_new_tokens": 10}\n')
    flags = ["generate.py", "--prompts-file", str(reqs), "--concurrency", "2", "--max-new-tokens", "32", "--json"]
    one, two = run(flags, 1, capsys), run(flags + ["--threads", "1"], 2)
    assert [r["index"] for r in two] == [0, 1, 2]
    assert [[r[k] for k in SAME] for r in two] == [[r[k] for k in SAME] for r in one]
    assert {r["tensor_parallel"] for r in two} == {2}


def test_bench_side_by_side():
    out = run(["bench.py", "--heldout", "2", "--max-new-tokens", "24", "--threads", "1"], 2)[-1]
    assert out["tensor_parallel"] == 2 and out["identical_outputs"] == 2
    H, L = 256, 6                                            # the embedded target's width and layers, float32
    assert out["allreduce_bytes_per_decode"] == 2 * L * H * 4
    assert out["allreduce_bytes_per_round"] == 2 * L * out["block_size"] * H * 4
