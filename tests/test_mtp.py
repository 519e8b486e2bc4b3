"""Qwen3.5's MTP head as a proposer (mtp.py): output == AR whatever the head proposes, at every acceptance length,
through rounds of every verify block, plain steps and admissions, in one slot or several; the head's proposals made
incrementally by the Engine == the head run from scratch on full-forward target hidden states; loading the
published names."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dflash
import engine
import policy
import model as M
import mtp
from helpers import OracleProposer, randomize_, random_target, tiny_target_config
from test_spec_equals_ar import first_divergence_is_near_tie, target_configs


def random_head(target, seed, dtype=torch.float64):
    return randomize_(mtp.MTPHead(target.cfg), seed).to(dtype).eval()


@torch.no_grad()
def scratch_proposals(head, target, ids: list, start: int, n: int) -> list:
    """The head from scratch: the target's full forward over ids[:start + 1] (no cache), rows (hidden[p],
    ids[p + 1]) at positions 0 .. start - 1 in one causal call, then each chained step appended as a row and the
    whole call redone (no KV cache anywhere)."""
    L = target.cfg.num_hidden_layers
    seq = torch.tensor([ids[:start + 1]])
    _, hidden = target(seq, torch.arange(start + 1), feature_layers=(L - 1,))
    emb, hid = target.embed_tokens(seq[:, 1:]), hidden[:, :start]
    out = []
    for _ in range(n):
        T = emb.shape[1]
        cos, sin = target.rope(torch.arange(T), emb.dtype)
        h = head(emb, hid, cos, sin, torch.arange(T), torch.ones(T, T, dtype=torch.bool).tril())[:, -1:]
        tok = target.lm_head(h)[0, -1].argmax()
        out.append(int(tok))
        emb, hid = torch.cat([emb, target.embed_tokens(tok.view(1, 1))], 1), torch.cat([hid, h], 1)
    return out


class OracleMTP(OracleProposer):
    """The real head (mtp.MTPProposer, N slots) behind helpers.OracleProposer: the head drafts every round for every
    row (its KV cache sees every next-ids pattern the Engine makes) and each live row's real proposals are recorded
    in `real` as (prompt, start, proposals); the oracle's proposals (each row's true continuation corrupted at a
    planned index: every acceptance length on every row) are what the Engine verifies."""

    wants_next_ids = True

    def __init__(self, head: mtp.MTPProposer, continuations: dict, vocab: int, seed: int):
        super().__init__(continuations, vocab, seed, head.max_block_size)
        self.head, self.feature_layers, self.real = head, head.feature_layers, []

    def reset(self, slots, capacity, masks=None):
        super().reset(slots, capacity, masks)
        self.head.reset(slots, capacity, masks)

    def admit(self, row, feats, pos, prompt_ids, first):
        super().admit(row, feats, pos, prompt_ids, first)
        self.head.admit(row, feats, pos, prompt_ids, first)

    def append(self, feats, pos, next_ids):
        self.head.append(feats, pos, next_ids)

    def propose(self, last, start, feats, feat_pos, n, next_ids, rows=None, temperature=None):
        real = self.head.propose(last, start, feats, feat_pos, n, next_ids).tokens.tolist()
        for b, prompt in enumerate(self.rows):
            if prompt is not None and int(start[b]) >= len(prompt):      # a live row (a free one rides at 0)
                self.real.append((prompt, int(start[b]), real[b]))
        return super().propose(last, start, feats, feat_pos, n, next_ids, rows, temperature)


class Coin(policy.Scripted):
    """A policy stand-in: a round of a random verify block (1 .. block) or a plain step by a seeded coin, every plain
    step feeding the head's context."""

    def __init__(self, seed: int, block: int):
        self.rng, self.block, self.blocks = random.Random(seed), block, tuple(range(block, 0, -1))

    def speculate(self) -> int:
        return self.rng.randint(1, self.block) if self.rng.random() < 0.6 else 0


@pytest.mark.parametrize("slots", [1, 3])
@settings(max_examples=20, deadline=None)
@given(cfg=target_configs(), seed=st.integers(0, 10 ** 6), steps=st.integers(1, 15), n_req=st.integers(1, 6),
       coin=st.booleans())
def test_head_rows_equal_their_runs_alone_and_draft_from_scratch(slots, cfg, seed, steps, n_req, coin):
    """float64, random target and head, K = 1..15 chained steps, N slots (1: a request at a time) admitting requests
    as slots free, pure rounds or a seeded mix of plain steps and rounds of every verify block 1..K + 1. Behind the
    oracle (every acceptance length on every row): each row's output == its AR run alone, and every proposal the
    head made == the head run from scratch on that row's committed prefix. The real head (no oracle) == AR too."""
    rng = random.Random(seed)
    target, block = random_target(cfg, seed % 101), steps + 1
    head = random_head(target, seed % 103)
    reqs = [engine.Request([rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, 40))], rng.randint(1, 40))
            for _ in range(min(n_req, 2 * slots))]
    alone = [engine.run(target, r.prompt_ids, r.max_new_tokens).output_ids for r in reqs]
    outputs = {}                            # each prompt's longest AR output (a prompt may come twice)
    for r, out in zip(reqs, alone):
        outputs[tuple(r.prompt_ids)] = max(out, outputs.get(tuple(r.prompt_ids), []), key=len)
    cap = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + block
    oracle = OracleMTP(mtp.MTPProposer(head, target, steps), outputs, cfg.vocab_size, seed)
    got = engine.Engine(target, oracle, block, slots, cap, policy=Coin(seed, block) if coin else None).run(reqs)
    assert [r.output_ids for r in got] == alone
    assert all(1 + sum(r.acceptance_lengths) == len(r.output_ids) for r in got)
    drafted = [d for r in got for d, kind in zip(r.draft_ids, r.step_kinds) if kind == "verify" and d]
    assert len(oracle.real) == len(drafted)         # every block verified had the head's own beside it, checked here
    for prompt, start, proposals in oracle.real:
        ids = list(prompt) + outputs[prompt]
        assert proposals == scratch_proposals(head, target, ids, start, len(proposals)), (prompt, start)
    real = engine.Engine(target, mtp.MTPProposer(head, target, steps), block, slots, cap,
                         policy=Coin(seed, block) if coin else None).run(reqs)
    assert [r.output_ids for r in real] == alone


def test_every_acceptance_length_and_float32():
    """K = 7 behind the oracle: all of 0..7 accepted at least once; float32 equals AR up to a near-tie."""
    cfg = tiny_target_config(vocab_size=60)
    target = random_target(cfg, 3)
    head = random_head(target, 4)
    prompt = list(range(5, 25))
    ar = engine.run(target, prompt, 120)
    oracle = OracleMTP(mtp.MTPProposer(head, target, 7), {tuple(prompt): ar.output_ids}, 60, 0)
    res = engine.run(target, prompt, 120, proposer=oracle, block_size=8)
    assert res.output_ids == ar.output_ids
    assert set(range(1, 9)) <= set(res.acceptance_lengths)
    t32, h32 = target.float(), head.float()
    ar32 = engine.run(t32, prompt, 60)
    sp32 = engine.run(t32, prompt, 60, proposer=mtp.MTPProposer(h32, t32, 3), block_size=4)
    if sp32.output_ids != ar32.output_ids:
        assert first_divergence_is_near_tie(t32, prompt, ar32.output_ids, sp32.output_ids, 1e-4)


def test_sampling_runs_and_keeps_the_trace():
    target = random_target(tiny_target_config(vocab_size=40), 5)
    head = random_head(target, 6)
    eng = engine.Engine(target, mtp.MTPProposer(head, target, 3), 4, capacity=80)
    res = eng.generate([1, 2, 3], 40, sampling=engine.Sampling(temperature=0.8), seed=0)
    assert 1 + sum(res.acceptance_lengths) == len(res.output_ids) == 40


def test_steps_out_of_range():
    target = random_target(tiny_target_config(vocab_size=40), 5)
    for k in (0, 16):
        with pytest.raises(dflash.GenerationError, match="--mtp-steps"):
            mtp.MTPProposer(random_head(target, 1), target, k)


def test_training_forward_is_the_chained_head():
    """train.mtp_hidden (all chained steps in one masked forward per step) == the head run from scratch with the
    true tokens in place of its proposals: step k at row i sees the committed rows up to i and its own chain."""
    from tools import train
    target = random_target(tiny_target_config(vocab_size=40), 8)
    head = random_head(target, 9)
    S, K = 30, 3
    seq = torch.randint(0, 40, (1, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outs = train.mtp_hidden(head, target, seq, K)
        _, hidden = target(seq, torch.arange(S), feature_layers=(target.cfg.num_hidden_layers - 1,))
        for i in (0, 7, outs.shape[2] - 1):
            emb, hid = target.embed_tokens(seq[:, 1:i + 2]), hidden[:, :i + 1]
            for k in range(K):
                T = emb.shape[1]
                cos, sin = target.rope(torch.arange(T), emb.dtype)
                h = head(emb, hid, cos, sin, torch.arange(T), torch.ones(T, T, dtype=torch.bool).tril())[:, -1:]
                torch.testing.assert_close(outs[0, k, i], h[0, 0], rtol=1e-9, atol=1e-9)
                emb = torch.cat([emb, target.embed_tokens(seq[:, i + k + 2:i + k + 3])], 1)
                hid = torch.cat([hid, h], 1)


PUBLISHED_NAMES = ["fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"] + [
    f"layers.0.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def saved_target(tmp_path, **cfg_kw):
    import checkpoint as ckpt
    target = random_target(tiny_target_config(vocab_size=40, **cfg_kw), 2, torch.float32)
    ckpt.save_target(target, str(tmp_path), torch.float32)
    return ckpt.load_target(str(tmp_path), torch.float32)


def test_load_the_published_names(tmp_path):
    """A head written under the 15 published names (mtp. or model.mtp. prefix) loads into MTPHead equal; the file's
    other tensors and the target are untouched; a checkpoint without the head, or with a 2-layer one, is refused."""
    import json
    from safetensors import safe_open
    from safetensors.torch import save_file
    import checkpoint as ckpt
    target = saved_target(tmp_path)
    with pytest.raises(M.CheckpointError, match="no MTP head.*tools/train.py mtp"):
        mtp.load_mtp(str(tmp_path), target)
    before = ckpt.read_safetensors(str(tmp_path))
    head = random_head(target, 3, torch.float32)
    mtp.save_mtp(head, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        names = sorted(k[4:] for k in fh.keys() if k.startswith("mtp."))
        assert all(torch.equal(fh.get_tensor(k), t) for k, t in before.items())
    assert names == sorted(PUBLISHED_NAMES)
    got = mtp.load_mtp(str(tmp_path), target)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in head.state_dict().items())
    assert torch.equal(ckpt.load_target(str(tmp_path)).lm_head.weight, target.lm_head.weight)
    tensors = ckpt.read_safetensors(str(tmp_path))                      # the multimodal files' spelling
    save_file({("model." + k if k.startswith("mtp.") else k): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    assert torch.equal(mtp.load_mtp(str(tmp_path), target).fc.weight, head.fc.weight)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 2}))
    with pytest.raises(M.CheckpointError, match="mtp_num_hidden_layers = 2"):
        mtp.load_mtp(str(tmp_path), target)


def test_load_a_mixture_of_experts_head(tmp_path):
    """MoE target: the head's MLP is the sparse MoE block, written one tensor per expert (the published layout)
    and read back fused, or read from a fused file."""
    from safetensors.torch import save_file
    import checkpoint as ckpt
    target = saved_target(tmp_path, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                          shared_expert_intermediate_size=20)
    head = random_head(target, 5, torch.float32)
    assert isinstance(head.layers[0].mlp, M.SparseMoE)
    mtp.save_mtp(head, str(tmp_path))
    tensors = ckpt.read_safetensors(str(tmp_path))
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in tensors and "mtp.layers.0.mlp.gate.weight" in tensors
    got = mtp.load_mtp(str(tmp_path), target)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in head.state_dict().items())
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    fused.update({"mtp." + k: v for k, v in head.state_dict().items() if ".experts." in k})
    save_file(fused, str(tmp_path / "model.safetensors"))
    got = mtp.load_mtp(str(tmp_path), target)
    assert all(torch.equal(got.state_dict()[k], v) for k, v in head.state_dict().items())
    prompt = [1, 2, 3, 4]
    assert engine.run(target, prompt, 20, proposer=mtp.MTPProposer(got, target, 2), block_size=3).output_ids == \
        engine.run(target, prompt, 20).output_ids


from helpers import HAS_EMBEDDED_PAIR  # noqa: E402


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_embedded_head_from_the_command_line(capsys):
    """The shipped target carries a trained head: generate.py --draft mtp equals --draft none, and says mtp."""
    import json
    import generate
    ids = "510,292,11,91,301"
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "40", "--json", "--draft", "none"]) == 0
    ar = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate.main(["--prompt-ids", ids, "--max-new-tokens", "40", "--json", "--draft", "mtp", "--mtp-steps", "5"]) == 0
    sp = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sp["output_ids"] == ar["output_ids"] and sp["mode"] == "mtp" and sp["block_size"] == 6
    assert 1 + sum(sp["acceptance_lengths"]) == len(sp["output_ids"])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_embedded_head_through_a_prompts_file(tmp_path, capsys):
    """--draft mtp with --prompts-file at concurrency 2: every request's output == its single --draft mtp run (greedy
    and sampled), with the head's rounds in the batch."""
    import json
    import generate
    lines = [{"prompt_ids": [510, 292, 11, 91, 301], "max_new_tokens": 30},
             {"prompt": "def add(a, b):", "max_new_tokens": 20, "temperature": 0.7, "seed": 5},
             {"prompt": "import os\n", "max_new_tokens": 25}]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    capsys.readouterr()
    assert generate.main(["--prompts-file", str(path), "--concurrency", "2", "--draft", "mtp", "--json", "--no-adaptive"]) == 0
    got = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    for line, out in zip(lines, got):
        argv = ["--draft", "mtp", "--json", "--max-new-tokens", str(line["max_new_tokens"])]
        argv += ["--prompt", line["prompt"]] if "prompt" in line else ["--prompt-ids", ",".join(map(str, line["prompt_ids"]))]
        argv += ["--temperature", str(line["temperature"]), "--seed", str(line["seed"])] if "seed" in line else []
        assert generate.main(argv) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["output_ids"] == alone["output_ids"] and out["mode"] == "mtp" and out["block_size"] == 4, line
        assert out["step_kinds"].count("verify") > 0 and 1 + sum(out["acceptance_lengths"]) == len(out["output_ids"])


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_embedded_head_accepts_and_bench_compares(capsys):
    """tools/bench.py --methods on held-out prompts: the trained head's mean tokens per round is above 1.5 (it predicts
    the target's text), every output equals AR, and the table names each method."""
    import json
    from tools import bench
    bench.main(["--methods", "dflash,mtp3", "--heldout", "6", "--max-new-tokens", "48", "--no-adaptive"])
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert set(res["methods"]) == {"dflash", "mtp3"} and res["methods"]["mtp3"]["block_size"] == 4
    assert res["methods"]["mtp3"]["tau"] > 1.5 and res["methods"]["dflash"]["tau"] > 1.5
    assert any(line.startswith("| mtp3 (block 4) |") for line in lines) and "outputs identical to AR: all" in lines
    assert "products" in res and any(line.startswith("few-row products: ") for line in lines)    # chosen as generate.py does


def test_command_line_errors(tmp_path, capsys):
    """--draft mtp on a target without a head, and --mtp-steps without --draft mtp: one error line each."""
    import generate
    saved_target(tmp_path)
    assert generate.cli(["--target", str(tmp_path), "--draft", "mtp", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no MTP head" in err[0]
    assert generate.cli(["--target", str(tmp_path), "--draft", "none", "--mtp-steps", "3", "--prompt-ids", "1,2"]) == 2
    assert "--mtp-steps applies to --draft mtp" in capsys.readouterr().err
    assert generate.cli(["--target", str(tmp_path), "--draft", "mtp", "--mtp-steps", "0", "--prompt-ids", "1,2"]) == 2
