"""Loading at the checkpoint's size: each tensor goes from its file straight into its parameter (checkpoint.Stored),
so the memory a load takes is the loaded model's bytes plus a small constant, never the file's bytes on top (the
issue with reading every tensor, then converting). Measured in a fresh interpreter (peak RSS: VmHWM of
/proc/self/status, reset before each load), for the layouts the loader reads: one file, shards, one tensor per
expert, tied embeddings, a DFlash drafter, an MTP head, each stored in bfloat16 and loaded in float32 (widened, the
CPU default), as stored, and kept as stored under float32 arithmetic."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint as ckpt
import mtp
from helpers import random_drafter, random_target, randomize_, tiny_draft_config, tiny_target_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLACK = 16 * 2 ** 20        # what a load may take besides 1.25x the model: a read chunk (checkpoint.CHUNK), headers, objects

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS is read from Linux's /proc")

# In the child: warm up (every load once: torch's lazy imports and first-call buffers are the interpreter's, not the
# load's), then per load: freed memory handed back (malloc_trim), the peak reset to the current RSS (clear_refs 5),
# the load, the peak read. -> [name, peak - RSS before, bytes of the loaded parameters] per load.
CHILD = r"""
import ctypes, gc, json, sys
import torch
torch.set_num_threads(1)
import checkpoint as ckpt, mtp
root = sys.argv[1]
libc = ctypes.CDLL(None)

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) * 1024 for l in fh if l.startswith(key + ":"))

def loads():
    target = ckpt.load_target(root + "/dense", torch.float32)
    yield "one file, widened", lambda: ckpt.load_target(root + "/dense", torch.float32)
    yield "one file, as stored", lambda: ckpt.load_target(root + "/dense", torch.bfloat16)
    yield "one file, kept as stored under float32", lambda: ckpt.load_target(root + "/dense", torch.float32, weights="auto")
    yield "shards, one tensor per expert, tied", lambda: ckpt.load_target(root + "/moe", torch.float32)
    yield "drafter", lambda: ckpt.load_drafter(root + "/draft", target.cfg, torch.float32)
    yield "MTP head", lambda: mtp.load_mtp(root + "/dense", target, torch.float32)

out = []
for warm in (True, False):
    for name, load in loads():
        gc.collect()
        libc.malloc_trim(0)
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        model = load()
        peak = status("VmHWM")
        if not warm:
            out.append([name, peak - before, sum(p.numel() * p.element_size() for p in model.parameters())])
        del model
print(json.dumps(out))
"""


def shard(folder, n: int) -> None:
    """model.safetensors -> n shard files and model.safetensors.index.json (the layout of large checkpoints)."""
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    names, weight_map = sorted(tensors), {}
    for i in range(n):
        f = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in names[i::n]}, os.path.join(folder, f), metadata={"format": "pt"})
        weight_map.update({k: f for k in names[i::n]})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def test_a_load_takes_the_models_bytes_not_the_files_on_top(tmp_path):
    """Each load's peak RSS increase is at most 1.25x the bytes of what it loaded plus SLACK. Reading every tensor
    and converting afterwards takes the file's bytes on top: 1.5x when widening bfloat16 to float32."""
    dense = random_target(tiny_target_config(vocab_size=65536, hidden_size=256, intermediate_size=512), 1, torch.float32)
    os.makedirs(tmp_path / "dense")
    ckpt.save_target(dense, str(tmp_path / "dense"), torch.bfloat16)
    mtp.save_mtp(randomize_(mtp.MTPHead(dense.cfg), 2).eval(), str(tmp_path / "dense"))
    moe = random_target(tiny_target_config(vocab_size=32768, hidden_size=256, intermediate_size=0, tie_word_embeddings=True,
                                           num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
                                           shared_expert_intermediate_size=128), 3, torch.float32)
    os.makedirs(tmp_path / "moe")
    ckpt.save_target(moe, str(tmp_path / "moe"), torch.bfloat16)
    shard(tmp_path / "moe", 3)
    os.makedirs(tmp_path / "draft")
    ckpt.save_drafter(random_drafter(tiny_draft_config(dense.cfg, hidden_size=256, intermediate_size=2048, head_dim=64),
                                     4, torch.float32), str(tmp_path / "draft"), torch.bfloat16)
    del dense, moe
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert [name for name, _, _ in measured] == ["one file, widened", "one file, as stored", "one file, kept as stored under float32",
                                                 "shards, one tensor per expert, tied", "drafter", "MTP head"]
    for name, taken, held in measured:
        assert taken <= 1.25 * held + SLACK, f"{name}: loading took {taken / 2 ** 20:.1f} MiB for {held / 2 ** 20:.1f} MiB of weights"
    assert measured[0][2] > 100 * 2 ** 20 and measured[3][2] > 40 * 2 ** 20         # sizes where 1.5x would show
