"""torch.compile of the step functions: one graph per step kind, no recompiles after warm-up, same tokens."""
import os

import pytest
import torch

import dflash
import model as M

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(HERE, "checkpoints", "tiny-qwen35")
DRAFT = os.path.join(HERE, "checkpoints", "tiny-qwen35-dflash")


@pytest.mark.skipif(not os.path.exists(os.path.join(DRAFT, "model.safetensors")), reason="embedded pair not present")
def test_no_recompiles_after_warmup_and_same_tokens():
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    target = M.load_target(TARGET, torch.float32)
    drafter = M.load_drafter(DRAFT, target.cfg, torch.float32)
    tok = M.load_tokenizer(TARGET)
    p1 = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(").ids
    p2 = tok.encode("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def").ids
    eng = dflash.Engine(target, dflash.DrafterProposer(drafter, target), 16, 256, compile_mode="default")
    eng.run(p1, 40)                                                       # warm-up: compiles each step once
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        res = eng.run(p2, 120)                                            # another prompt length, many acceptance lengths
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(set(res.acceptance_lengths)) >= 3
    eager = dflash.run(target, p2, 120)
    assert res.output_ids == eager.output_ids
