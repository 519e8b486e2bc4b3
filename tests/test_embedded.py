"""The embedded default pair in checkpoints/: it loads through the real-checkpoint code path, DFlash output
equals AR output on held-out prompts, and the drafter earns its keep (mean acceptance length above 2)."""
import os
import subprocess
import sys

import pytest
import torch

import engine
import checkpoint as ckpt
import prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "checkpoints", "tiny-qwen35")
DRAFT = os.path.join(ROOT, "checkpoints", "tiny-qwen35-dflash")


@pytest.fixture(scope="module")
def pair():
    target = ckpt.load_target(TARGET, torch.float32)
    drafter = ckpt.load_drafter(DRAFT, target.cfg, torch.float32)
    return target, drafter, ckpt.load_tokenizer(TARGET)


def test_embedded_pair_is_lossless_and_accepts(pair):
    target, drafter, tok = pair
    assert {"linear_attention", "full_attention"} <= set(target.cfg.layer_types)
    proposer = engine.DrafterProposer(drafter, target)
    engine_ar = engine.Engine(target, None, 1, 1, 256)
    engine_sp = engine.Engine(target, proposer, 16, 1, 256)
    taus = []
    for p in prompts.heldout_prompts(tok, 4):
        assert 30 <= len(p) <= 60
        ar = engine_ar.generate(p, 64)
        sp = engine_sp.generate(p, 64)
        assert sp.output_ids == ar.output_ids
        taus += sp.acceptance_lengths
    assert sum(taus) / len(taus) > 2.0


def test_default_command_runs_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "generate.py", "--prompt", "def fibonacci(n):", "--max-new-tokens", "24"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def fibonacci(n):") and out.stdout.strip() != "def fibonacci(n):", out.stdout   # prompt, then text
    stats = out.stderr.strip().splitlines()           # statistics on stderr, so `> file` keeps the text only
    assert len(stats) == 1 and "tok/s" in stats[0], out.stderr
    # rounds with their acceptance, or (adaptive speculation on a loaded machine) plain steps said to be so
    assert "draft-verify rounds, mean acceptance length" in stats[0] or "plain steps with" in stats[0], out.stderr
