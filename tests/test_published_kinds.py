"""`python generate.py --target T --draft D` end to end for every kind of checkpoint people download, each
written in its published format on tiny shapes: sliding-window drafters (with the public 4B config's keys:
sliding layers and a window, no use_sliding_window), DFlash2 drafters (codebooks named as published), MoE
targets (one tensor per expert, and fused), tied targets and drafters. Greedy output == transformers' own
greedy generate of the target; a sampled DFlash2 run works. All processes start at once (most of each one's
time is importing torch)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import edit_json, save_hf_causal_lm, save_zlab_drafter
from test_moe import save_hf_moe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 17, 42, 8, 91, 23, 60, 3, 11, 70, 2]           # longer than the sliding window below
MAX_NEW = 20
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SLIDING = dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=4,
               tie_word_embeddings=True)
DFLASH2 = dict(dflash2={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6},
               layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True)


def published_codebook_names(path):
    """Rename DFlash2's codebooks as the published files have them (no `.weight`)."""
    f = str(path / "model.safetensors")
    tensors = load_file(f)
    save_file({k.removesuffix(".weight") if "_codebook" in k else k: v for k, v in tensors.items()}, f, metadata={"format": "pt"})


def fused_copy(src, dst, hf):
    """The MoE target's weights in the fused expert layout, under transformers' own parameter names."""
    os.makedirs(dst)
    shutil.copy(src / "config.json", dst)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})


def hf_greedy(hf, prompt, max_new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    dense = save_hf_causal_lm(root / "dense", seed=31, num_hidden_layers=6)
    tied = save_hf_causal_lm(root / "tied", seed=32, num_hidden_layers=6, tie_word_embeddings=True)
    moe = save_hf_moe(root / "moe", seed=33)
    fused_copy(root / "moe", root / "moe_fused", moe)
    L_moe = moe.config.num_hidden_layers
    save_zlab_drafter(root / "sliding", target_layers=6, vocab=97, hidden=64, seed=34, n_layers=3, **SLIDING)
    # as the public config: the window written, no use_sliding_window (Qwen3Config wrote null without the flag)
    edit_json(str(root / "sliding" / "config.json"), lambda c: c.pop("use_sliding_window", None) or c.update(sliding_window=4))
    save_zlab_drafter(root / "dflash2", target_layers=6, vocab=97, hidden=64, seed=35, **DFLASH2)
    published_codebook_names(root / "dflash2")
    save_zlab_drafter(root / "moe_draft", target_layers=L_moe, vocab=97, hidden=64, seed=36, n_layers=1)
    save_zlab_drafter(root / "moe_dflash2", target_layers=L_moe, vocab=97, hidden=64, seed=37, **DFLASH2)
    pairs = {   # name -> (target, drafter, extra arguments)
        "dense+sliding": ("dense", "sliding", []),
        "dense+dflash2": ("dense", "dflash2", []),
        "tied+sliding": ("tied", "sliding", []),
        "moe+dflash": ("moe", "moe_draft", []),
        "moe-fused+dflash2": ("moe_fused", "moe_dflash2", []),
        "dense+dflash2-sampled": ("dense", "dflash2", ["--temperature", "0.8", "--seed", "1"]),
    }
    procs = {}
    for name, (t, d, extra) in pairs.items():
        argv = ["--target", str(root / t), "--draft", str(root / d), "--prompt-ids", ",".join(map(str, PROMPT)),
                "--max-new-tokens", str(MAX_NEW), "--json", "--dtype", "float32", *extra]
        procs[name] = subprocess.Popen([sys.executable, "generate.py", *argv], cwd=ROOT, env=ENV,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    refs = {"dense": hf_greedy(dense, PROMPT, MAX_NEW), "tied": hf_greedy(tied, PROMPT, MAX_NEW),
            "moe": hf_greedy(moe, PROMPT, MAX_NEW)}
    refs["moe_fused"] = refs["moe"]
    done = {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"{name}: rc {p.returncode}\n{err.decode()}"
            done[name] = (json.loads(out.decode().strip().splitlines()[-1]), refs[pairs[name][0]])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.mark.parametrize("name", ["dense+sliding", "dense+dflash2", "tied+sliding", "moe+dflash", "moe-fused+dflash2"])
def test_greedy_equals_transformers(runs, name):
    res, ref = runs[name]
    assert res["mode"] == "dflash" and res["output_ids"] == ref
    assert sum(res["acceptance_lengths"]) + 1 == len(ref)


def test_sampled_dflash2_runs(runs):
    res, _ = runs["dense+dflash2-sampled"]
    assert len(res["output_ids"]) == MAX_NEW and all(0 <= t < 97 for t in res["output_ids"])
    assert sum(res["acceptance_lengths"]) + 1 == MAX_NEW
