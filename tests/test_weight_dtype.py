"""Weights kept narrower than the arithmetic (checkpoint.load_target's `weights`, --weight-dtype): a bfloat16
checkpoint kept as stored under float32 (or float64) arithmetic gives the widened model's results, bit for bit where
the same kernels run (products of several rows widen the weight at the call: model.kept_product), to float32 rounding
of the sum's order in one-row products (a multiply-sum that widens as it reads), at the bfloat16 model's weight
memory. Checked on the target (dense, tied, mixture of experts in both of its expert paths), DFlash and DFlash2
drafters, the MTP head, and through generate.py, whose default (--weight-dtype auto) keeps them."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

import checkpoint as ckpt
import engine
import generate
import model as M
import mtp
from helpers import kind_draft_config, random_drafter, random_target, randomize_, tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")      # conftest.py
IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]

TARGETS = {"dense": {}, "tied": dict(tie_word_embeddings=True),
           "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                       intermediate_size=0)}


def saved(tmp_path, kind: str, drafter: str = "dflash"):
    """A random target of TARGETS[kind] (vocabulary 97) with an MTP head and a drafter of helpers.DRAFTER_KINDS, all
    written in bfloat16 -> (target folder, drafter folder)."""
    cfg = tiny_target_config(vocab_size=97, **TARGETS[kind])
    target = random_target(cfg, 5, torch.float32)
    os.makedirs(tmp_path / "t")
    ckpt.save_target(target, str(tmp_path / "t"), torch.bfloat16)
    mtp.save_mtp(randomize_(mtp.MTPHead(cfg), 6).eval(), str(tmp_path / "t"))
    os.makedirs(tmp_path / "d")
    ckpt.save_drafter(random_drafter(kind_draft_config(cfg, drafter), 7, torch.float32), str(tmp_path / "d"), torch.bfloat16)
    return str(tmp_path / "t"), str(tmp_path / "d")


def logits_of(target, ids=IDS):
    with torch.no_grad():
        return target(torch.tensor([ids]), torch.arange(len(ids)))[0][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_kept_weights_give_the_widened_models_logits_bit_for_bit(tmp_path, kind, dtype):
    """weights="auto" keeps the bfloat16 file's weights (A_log and dt_bias in the state dtype, as always), the
    arithmetic in `dtype`: logits of a prefill (the MoE's looped expert path: 10 tokens x top-2 > 4 experts) equal
    the widened model's exactly, and so do the greedy tokens of a DFlash run (decode and verify: the gathered path)
    and every draft."""
    tdir, ddir = saved(tmp_path, kind)
    kept, wide = ckpt.load_target(tdir, dtype, weights="auto"), ckpt.load_target(tdir, dtype)
    for name, p in kept.named_parameters():
        assert p.dtype == (M.state_dtype(dtype) if name.endswith(ckpt.TARGET_FP32) else torch.bfloat16), name
    assert kept.dtype == wide.dtype == dtype and (kept.lm_head.weight is kept.embed_tokens.weight) == (kind == "tied")
    got, want = logits_of(kept), logits_of(wide)
    assert got.dtype == dtype and torch.equal(got, want)
    held = sum(p.numel() * p.element_size() for p in kept.parameters())
    assert held == ckpt.target_bytes(kept.cfg, dtype, torch.bfloat16) < 0.6 * sum(p.numel() * p.element_size() for p in wide.parameters())
    runs = []
    for target, weights in ((kept, "auto"), (wide, None)):
        drafter = ckpt.load_drafter(ddir, target.cfg, dtype, weights=weights)
        assert drafter.dtype == dtype
        runs.append(engine.run(target, IDS[:4], 24, proposer=engine.DrafterProposer(drafter, target), block_size=4))
    assert runs[0].output_ids == runs[1].output_ids and runs[0].draft_ids == runs[1].draft_ids
    assert runs[0].output_ids == engine.run(wide, IDS[:4], 24).output_ids


def test_large_kept_weights_are_widened_a_slice_at_a_time(tmp_path, monkeypatch):
    """An eager many-row product over a kept weight larger than model.WIDEN_SLICE (a 9B's lm_head: 4 GB widened)
    widens it a slice of output rows at a time: no float32 copy of the whole weight, and the logits (a prefill's,
    every linear sliced here, down to 2 rows a slice) equal the widened model's to float32 rounding (a product of a
    few rows may run another kernel, which sums in another order)."""
    tdir, _ = saved(tmp_path, "dense")
    kept, wide = ckpt.load_target(tdir, torch.float32, weights="auto"), ckpt.load_target(tdir, torch.float32)
    whole = logits_of(kept)
    monkeypatch.setattr(M, "WIDEN_SLICE", 64)
    widened, linear = [], M.F.linear

    def spy(x, w, b=None):              # every product of the kept model gets its weight widened at the call
        widened.append(w.numel())
        return linear(x, w, b)
    monkeypatch.setattr(M.F, "linear", spy)
    got = logits_of(kept)
    monkeypatch.undo()
    assert torch.equal(whole, logits_of(wide))
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    biggest = max(p.numel() for p in kept.parameters())
    assert widened and max(widened) <= max(64, max(p.shape[1] for p in kept.parameters() if p.dim() == 2)) < biggest


@pytest.mark.parametrize("compiled", [False, True])
def test_few_row_products_widen_the_kept_weight_a_chunk_at_a_time(tmp_path, monkeypatch, compiled):
    """Products of 2..FEW_ROWS rows (a verify, a draft, rows in flight) over a kept weight larger than WIDEN_CHUNK
    widen it a chunk of output rows at a time (model.few_row_product, one op in compiled code): chunks of 5 rows
    here and a last one of 1, the result equal to the product over the widened weight to float32 rounding; 65 rows
    widen the whole weight at the call; a whole model's verify-sized prefill (10 rows, every product chunked) gives
    the widened model's logits to float32 rounding."""
    monkeypatch.setattr(M, "WIDEN_CHUNK", 5 * 48)
    w, b = torch.randn(101, 48).to(torch.bfloat16), torch.randn(101).to(torch.bfloat16)
    product = torch.compile(M.kept_product, fullgraph=True, dynamic=False) if compiled else M.kept_product
    chunks, mm = [], torch.mm

    def spy(x, w, out=None):
        chunks.append(w.shape[1])
        return mm(x, w, out=out)
    monkeypatch.setattr(torch, "mm", spy)
    for rows in (2, 16, 64, 65):
        x = torch.randn(rows, 48)
        chunks.clear()
        with torch.no_grad():
            got = product(x, w, b)
        torch.testing.assert_close(got, F.linear(x, w.float(), b.float()), rtol=1e-6, atol=1e-5)
        if rows <= M.FEW_ROWS:
            assert chunks == [5] * 20 + [1], (rows, chunks)
        else:                           # (compiled code calls torch.mm for the whole product itself)
            assert set(chunks) <= {101}, chunks
    monkeypatch.setattr(torch, "mm", mm)
    tdir, _ = saved(tmp_path, "dense")
    kept, wide = ckpt.load_target(tdir, torch.float32, weights="auto"), ckpt.load_target(tdir, torch.float32)
    monkeypatch.setattr(M, "WIDEN_CHUNK", 64)
    torch.testing.assert_close(logits_of(kept), logits_of(wide), rtol=1e-5, atol=1e-5)


def test_one_row_products_read_the_kept_weights_to_float32_rounding(tmp_path, monkeypatch):
    """One-row products over kept weights (decode: model.kept_product's multiply-sum, which widens as it reads) give
    the widened model's logits to float32 rounding of the sum's order, and its top token. The multiply-sum runs
    uncompiled here (the same expression compiled code and the eager compiled kernel run: tests/test_compile.py
    checks their tokens), on every weight (EAGER_FUSED 0)."""
    tdir, _ = saved(tmp_path, "dense")
    kept, wide = ckpt.load_target(tdir, torch.float32, weights="auto"), ckpt.load_target(tdir, torch.float32)
    calls = []
    monkeypatch.setattr(M, "EAGER_FUSED", 0)
    monkeypatch.setattr(M, "_eager_fused", lambda: lambda x, w: calls.append(w.shape) or M.fused_product(x, w))
    for t in IDS[:3]:
        got, want = logits_of(kept, [t]), logits_of(wide, [t])
        assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (kept.lm_head.out_features, kept.lm_head.in_features) in calls


@pytest.mark.parametrize("proposer", ["dflash2", "mtp"])
def test_kept_weights_draft_as_the_widened_drafter(tmp_path, proposer):
    """A DFlash2 drafter (the candidate selector's codebooks) and the MTP head kept in bfloat16 under float32
    arithmetic draft what their widened forms draft, sampled (DFlash2) or greedy (MTP)."""
    tdir, ddir = saved(tmp_path, "dense", "dflash2")
    runs = []
    for weights in ("auto", None):
        target = ckpt.load_target(tdir, torch.float32, weights=weights)
        if proposer == "mtp":
            head = mtp.load_mtp(tdir, target, weights=weights)
            assert head.fc.weight.dtype == (torch.bfloat16 if weights else torch.float32)
            p = mtp.MTPProposer(head, target, 3)
        else:
            p = engine.DrafterProposer(ckpt.load_drafter(ddir, target.cfg, torch.float32, weights=weights), target)
        sampling = engine.Sampling(0.9) if proposer == "dflash2" else None
        runs.append(engine.Engine(target, p, 4, 1, 64).generate(IDS[:4], 20, sampling=sampling, seed=11))
    assert runs[0].output_ids == runs[1].output_ids and runs[0].draft_ids == runs[1].draft_ids


def test_a_weight_beyond_the_kept_dtypes_range_is_named(tmp_path):
    """A float32 weight past float16's largest value, kept in float16: one line naming the tensor, its file and the
    fix, not a model of infinities."""
    cfg = tiny_target_config(vocab_size=97)
    target = random_target(cfg, 5, torch.float32)
    with torch.no_grad():
        target.layers[0].mlp.up_proj.weight[0, 0] = 1e6
    ckpt.save_target(target, str(tmp_path), torch.float32)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(str(tmp_path), torch.float32, weights=torch.float16)
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.0.mlp.up_proj.weight" in msg and "model.safetensors" in msg
    assert "beyond float16's range" in msg and "--weight-dtype" in msg


def test_the_command_line_keeps_the_checkpoints_weights_with_the_same_tokens(capsys):
    """The embedded pair is stored in bfloat16: by default (--weight-dtype auto) it is kept so under float32
    arithmetic, with --weight-dtype float32's tokens and drafts (pure rounds: which steps the adaptive policy takes
    follows measured times); --json names both dtypes."""
    outs = []
    for extra in ([], ["--weight-dtype", "float32"]):
        capsys.readouterr()
        assert generate.cli(["--prompt-ids", "5,17,42,8", "--max-new-tokens", "24", "--json", "--no-adaptive", *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert [o["weight_dtype"] for o in outs] == ["bfloat16", "float32"] and all(o["dtype"] == "float32" for o in outs)
    assert outs[0]["output_ids"] == outs[1]["output_ids"] and outs[0]["draft_ids"] == outs[1]["draft_ids"]


@pytest.mark.parametrize("args, says", [
    (["--dtype", "bfloat16", "--weight-dtype", "float32"],
     "--weight-dtype float32 under bfloat16 arithmetic (--dtype) would round the weights at every product; use "
     "--weight-dtype auto, or bfloat16"),
    (["--weight-dtype", "float16", "--dtype", "bfloat16"], "--weight-dtype float16 under bfloat16 arithmetic")])
def test_weights_the_arithmetic_would_round_are_refused_before_loading(capsys, monkeypatch, args, says):
    monkeypatch.setattr(generate, "load", lambda *a, **kw: pytest.fail("loaded before the flags were checked"))
    capsys.readouterr()
    assert generate.cli(["--prompt-ids", "1,2", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_narrower_weights_under_torchrun_are_refused():
    from options import pick_weights
    assert pick_weights(None, torch.float32) == "auto" and pick_weights("float32", torch.float32) is None
    assert pick_weights("auto", torch.float32) == "auto" and pick_weights("bfloat16", torch.float64) == torch.bfloat16
    assert pick_weights("auto", torch.float32, parallel=object()) is None      # the default: widened, as tp.py cuts them
    with pytest.raises(M.GenerationError, match="does not go with torchrun"):
        pick_weights("bfloat16", torch.float32, parallel=object())


def test_a_presets_random_weights_are_kept_as_a_loaded_checkpoints(tmp_path):
    """tools/bench.py --preset with --weight-dtype bfloat16 (presets.random_models' `weights`): the random target is
    kept as load_target keeps the same weights read from a bfloat16 file under float32 arithmetic (each parameter's
    dtype, the arithmetic dtype, equal logits), and its drafter computes in float32 over bfloat16 weights."""
    from tools import presets
    torch.manual_seed(0)
    target, drafter = presets.random_models("tiny-9b-shape", "cpu", torch.float32, torch.bfloat16)
    ckpt.save_target(target, str(tmp_path), torch.bfloat16)
    loaded = ckpt.load_target(str(tmp_path), torch.float32, weights="auto")
    got, want = dict(target.named_parameters()), dict(loaded.named_parameters())
    assert {n: p.dtype for n, p in got.items()} == {n: p.dtype for n, p in want.items()}
    assert any(p.dtype == torch.bfloat16 for p in got.values()) and target.dtype == loaded.dtype == torch.float32
    assert torch.equal(logits_of(target), logits_of(loaded))
    assert drafter.dtype == torch.float32 and drafter.fc.weight.dtype == torch.bfloat16
