"""EAGLE-3 drafters (eagle3.py): the published layout read and written, its errors in one line, the dynamic tree's
shape, and tree rounds equal to AR on random hybrid targets whatever the drafter proposes."""
import json
import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import engine
import eagle3 as E
import model as M
import tree as TR
from helpers import randomize_, random_target, tiny_target_config

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20)


def eagle_config(target_cfg: M.TargetConfig, draft_vocab: int = 40, aux=None, **kw) -> E.Eagle3Config:
    base = dict(hidden_size=target_cfg.hidden_size, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=target_cfg.vocab_size, draft_vocab_size=draft_vocab,
                target_hidden_size=target_cfg.hidden_size, aux_layer_ids=aux)
    base.update(kw)
    return E.Eagle3Config(**base)


def random_eagle(target_cfg, seed=0, draft_vocab=40, own_embedding=False, dtype=torch.float64, **kw) -> E.Eagle3Drafter:
    d = randomize_(E.Eagle3Drafter(eagle_config(target_cfg, draft_vocab, **kw), own_embedding), seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target_cfg.vocab_size, generator=g)[:draft_vocab].sort().values   # a reduced vocabulary
    d.d2t.copy_(ids - torch.arange(draft_vocab))
    return d.to(dtype).eval()


def recorded(prop: E.Eagle3Tree) -> list:
    """Wrap prop.propose_tree so that each call's ((tokens, parents), the nodes' scores) is appended to the list
    returned."""
    seen, orig = [], prop.propose_tree

    def propose_tree(*a, **k):
        seen.append((orig(*a, **k), list(prop.scores)))
        return seen[-1][0]
    prop.propose_tree = propose_tree
    return seen


def test_published_layout_round_trip(tmp_path):
    cfg = tiny_target_config()
    target = random_target(cfg, 1)
    d = random_eagle(cfg, 2, own_embedding=True, aux=(1, 2, 3))
    E.save_eagle3(d, str(tmp_path), dtype=torch.float64)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and E.is_eagle3(raw)
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        t2d = fh.get_tensor("t2d")
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "midlayer.mlp.down_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} <= names
    assert int(t2d.sum()) == 40 and bool(t2d[d.to_target(torch.arange(40))].all())
    back = E.load_eagle3(str(tmp_path), target, torch.float64)
    for (n, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    assert back.feature_layers(4) == (0, 1, 2)             # aux ids count layer inputs: layer i - 1's output
    assert random_eagle(cfg).feature_layers(4) == (1, 1, 0)    # vLLM's default (2, L // 2, L - 3) at L = 4


def test_bad_checkpoints_are_one_line(tmp_path):
    cfg = tiny_target_config()
    target = random_target(cfg, 1)
    E.save_eagle3(random_eagle(cfg, 3), str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    cases = [({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope_scaling"),
             ({"hidden_size": None}, "positive integer hidden_size"),
             ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "three layer numbers"),
             ({"vocab_size": 99}, "built for a target with vocabulary 99")]
    for change, words in cases:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(M.CheckpointError, match=words) as e:
            E.load_eagle3(str(tmp_path), target)
        assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(M.CheckpointError, match="do not fit a 4-layer target"):
        random_eagle(cfg, aux=(1, 2, 9)).feature_layers(4)


def test_the_tree_shape(tmp_path):
    """The proposals form a tree of at most tree_size nodes, parents first, no deeper than tree_depth; with top_k 1
    it is a chain of the drafter's greedy tokens."""
    cfg = tiny_target_config()
    target = random_target(cfg, 4)
    prompt = list(range(5, 25))
    for top_k, depth, size in ((1, 5, 16), (3, 4, 10), (4, 6, 40)):
        prop = E.Eagle3Tree(random_eagle(cfg, 5), target, depth, top_k)
        eng = TR.TreeEngine(target, prop, size, 96)
        seen = recorded(prop)
        eng.generate(prompt, 12)
        for (tokens, parents), _ in seen:
            t = TR.Tree([0] + tokens, [-1] + parents)            # (Tree checks the order)
            assert len(tokens) <= size and max(t.depth) <= depth
            if top_k == 1:
                assert parents == list(range(len(tokens))) and len(tokens) == min(size, depth)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), moe=st.booleans(), size=st.integers(1, 24), depth=st.integers(1, 7),
       top_k=st.integers(1, 5), plen=st.integers(1, 30), own=st.booleans())
def test_eagle3_tree_rounds_equal_ar(seed, moe, size, depth, top_k, plen, own):
    """float64: EAGLE-3 trees verified by TreeEngine give AR's greedy output, for random targets (dense and MoE)."""
    rng = random.Random(seed)
    cfg = tiny_target_config(**(MOE if moe else {}))
    target = random_target(cfg, seed % 1000)
    prompt = [rng.randrange(cfg.vocab_size) for _ in range(plen)]
    ar = engine.run(target, prompt, 30).output_ids
    prop = E.Eagle3Tree(random_eagle(cfg, seed % 991, own_embedding=own), target, depth, top_k)
    assert TR.TreeEngine(target, prop, size, plen + 30 + size + 1).generate(prompt, 30).output_ids == ar


def test_a_one_token_draft_vocabulary():
    """A drafter whose draft vocabulary holds one token (d2t maps it into the target's) proposes only that token,
    mapped; the output is AR's and every accepted proposal is that token."""
    cfg = tiny_target_config()
    target = random_target(cfg, 7)
    d = random_eagle(cfg, 8, draft_vocab=1)
    prompt = [3, 4, 5]
    ar = engine.run(target, prompt, 20).output_ids
    res = TR.TreeEngine(target, E.Eagle3Tree(d, target, 4, 1), 4, 40).generate(prompt, 20)
    assert res.output_ids == ar
    tok = int(d.to_target(torch.tensor([0])))
    for s in res.steps:
        if s.kind == "verify":
            assert s.draft_ids[:s.accepted] == [tok] * s.accepted


def test_cli_reads_an_eagle3_checkpoint(tmp_path, capsys):
    """generate.py --draft DIR with an EAGLE-3 checkpoint drafts trees (16 nodes by default) and prints AR's output;
    --tree-depth is refused for a DFlash drafter."""
    import generate
    tdir = tmp_path / "target"
    target = random_target(tiny_target_config(), 2)
    tdir.mkdir()
    generate.ckpt.save_target(target, str(tdir), torch.float64)
    E.save_eagle3(random_eagle(target.cfg, 9), str(tmp_path / "eagle"), dtype=torch.float64)
    base = ["--target", str(tdir), "--prompt-ids", "1,2,3,4", "--max-new-tokens", "16", "--json", "--dtype", "float64"]
    assert generate.main(base + ["--draft", str(tmp_path / "eagle"), "--tree-depth", "3"]) == 0
    tree_out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generate.main(base + ["--draft", "none"]) == 0
    ar_out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tree_out["output_ids"] == ar_out["output_ids"] and tree_out["tree_size"] == 16
    assert generate.cli(["--prompt-ids", "1,2", "--tree-depth", "3"]) == 2
    assert "--tree-depth applies to EAGLE-3 drafters" in capsys.readouterr().err


@torch.inference_mode()
def test_first_chain_equals_the_unrolled_drafter():
    """With top_k 1 the first round's proposals are the drafter unrolled from scratch (training-time test's view):
    entries (embedding of the token at t + 1, fc(target features at t)) for the prompt, then (embedding of each
    proposal, the previous entry's output), every entry attending causally to all before it, each next proposal the
    argmax of the last entry's output, mapped to the target's vocabulary."""
    cfg = tiny_target_config()
    target = random_target(cfg, 11)
    d = random_eagle(cfg, 12)
    prop = E.Eagle3Tree(d, target, 5, 1)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 10, 11]
    seen = recorded(prop)
    TR.TreeEngine(target, prop, 5, 64).generate(prompt, 2)
    logits, feats = target(torch.tensor([prompt]), torch.arange(len(prompt)), feature_layers=prop.feature_layers)
    first = int(logits[0, -1].argmax())
    mid = d.midlayer
    emb = target.embed_tokens(torch.tensor([prompt[1:] + [first]]))
    hid = d.fc(feats)
    want, scores, total = [], [], 0.0
    for _ in range(5):
        T = emb.shape[1]
        x, residual = mid.inputs(emb, hid)
        cos, sin = d.rope(torch.arange(T), x.dtype)
        k, v = mid.kv(x, cos, sin)
        h = mid(x, residual, cos, sin, k, v, torch.ones(T, T, dtype=torch.bool).tril())
        lp = d.logprobs(h[0, -1])
        nxt = int(d.to_target(lp.argmax()))
        total += float(lp.max())
        want.append(nxt), scores.append(total)
        emb = torch.cat([emb, target.embed_tokens(torch.tensor([[nxt]]))], 1)
        hid = torch.cat([hid, h[:, -1:]], 1)
    (tokens, parents), got = seen[0]
    assert (tokens, parents) == (want, list(range(5)))
    assert got == pytest.approx(scores, abs=1e-10)          # the hidden states themselves, through their log probs


@torch.inference_mode()
def test_training_unrolls_what_inference_drafts():
    """train.eagle3_hidden (all chained steps teacher-forced in one masked forward per step) == the drafter's chain
    at inference when the forced tokens are the chain's own: each step's output at the prompt's last row equals
    the hidden state Eagle3Tree computed for that node (through their log probabilities)."""
    from tools import train
    cfg = tiny_target_config()
    target = random_target(cfg, 13)
    d = random_eagle(cfg, 14)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8]
    prop = E.Eagle3Tree(d, target, 4, 1)
    seen = recorded(prop)
    res = TR.TreeEngine(target, prop, 4, 64).generate(prompt, 2)
    (tokens, _), scores = seen[0]
    seq = torch.tensor([prompt + [res.output_ids[0]] + tokens + [0]])          # (one more row: steps + 1 labels)
    outs = train.eagle3_hidden(d, target, seq, 4)                              # [1, steps, R, H]
    P = len(prompt)
    lp = [float(d.logprobs(outs[0, k, P - 1]).max()) for k in range(4)]
    assert [sum(lp[:k + 1]) for k in range(4)] == pytest.approx(scores, abs=1e-10)


EMBEDDED_EAGLE3 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny-qwen35-eagle3")


@pytest.mark.skipif(not os.path.exists(os.path.join(EMBEDDED_EAGLE3, "model.safetensors")), reason="embedded EAGLE-3 head absent")
def test_embedded_head_drafts_and_bench_compares(capsys):
    """The trained head for the embedded target: its trees are accepted (more than one token per round), every
    output is AR's, and tools/bench.py's table has its rows beside DFlash's."""
    from tools import bench
    res = bench.main(["--methods", "dflash,eagle3,eagle3-chain4", "--heldout", "4", "--max-new-tokens", "32",
                      "--no-adaptive", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    for name in ("eagle3", "eagle3-chain4"):
        cell = res["methods"][name]["sets"]["heldout"]
        assert cell["identical"] == cell["prompts"] == 4 and cell["tau"] > 1.5
    assert res["methods"]["eagle3"]["block_size"] == 17 and res["methods"]["eagle3-chain4"]["block_size"] == 5
    assert any(x.startswith("| eagle3 (tree of 16) | ") for x in lines)


@pytest.mark.parametrize("norm_first", [False, True])
@torch.inference_mode()
def test_drafts_equal_the_speculators_layer_unrolled(norm_first):
    """The oracle: vLLM's EAGLE-3 format as the `speculators` package implements it (LlamaDecoderEagle3FirstLayer,
    transformers' Llama attention, RoPE and norms) with our drafter's weights, unrolled as a chain from the same
    target features: its outputs equal our midlayer's over the same entries (to float32 rounding: transformers'
    Llama norms compute in float32 whatever the dtype), and its greedy chain is the first tree Eagle3Tree drafts
    with top_k 1, scores included."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from helpers import speculators_eagle3_layer
    cfg = tiny_target_config()
    target = random_target(cfg, 21)
    d = random_eagle(cfg, 22, norm_before_residual=norm_first)
    c = d.cfg
    lc = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_theta=c.rope_theta, attention_bias=False, vocab_size=c.vocab_size, max_position_embeddings=512)
    lc._attn_implementation = "eager"
    theirs = speculators_eagle3_layer()(lc, 0, norm_before_residual=norm_first).to(torch.float64).eval()
    missing = theirs.load_state_dict(d.midlayer.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    rotary = LlamaRotaryEmbedding(lc)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6]
    prop = E.Eagle3Tree(d, target, 5, 1)
    seen = recorded(prop)
    TR.TreeEngine(target, prop, 5, 64).generate(prompt, 2)
    logits, feats = target(torch.tensor([prompt]), torch.arange(len(prompt)), feature_layers=prop.feature_layers)
    emb = target.embed_tokens(torch.tensor([prompt[1:] + [int(logits[0, -1].argmax())]]))
    hid = d.fc(feats)
    want, scores, total = [], [], 0.0
    for _ in range(5):
        T = emb.shape[1]
        pos = torch.arange(T)[None]
        causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        h = theirs(torch.cat([emb, hid], -1), attention_mask=causal, position_ids=pos,
                   position_embeddings=rotary(hid, pos))
        ours = d.midlayer(*d.midlayer.inputs(emb, hid), *d.rope(torch.arange(T), hid.dtype),
                          *d.midlayer.kv(d.midlayer.inputs(emb, hid)[0], *d.rope(torch.arange(T), hid.dtype)),
                          torch.ones(T, T, dtype=torch.bool).tril())
        torch.testing.assert_close(ours, h, rtol=0, atol=1e-5)     # transformers' Llama norms compute in float32
        lp = d.logprobs(h[0, -1])
        nxt = int(d.to_target(lp.argmax()))
        total += float(lp.max())
        want.append(nxt), scores.append(total)
        emb = torch.cat([emb, target.embed_tokens(torch.tensor([[nxt]]))], 1)
        hid = torch.cat([hid, h[:, -1:]], 1)
    (tokens, parents), got = seen[0]
    assert (tokens, parents) == (want, list(range(5))) and got == pytest.approx(scores, abs=1e-4)


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(EMBEDDED_EAGLE3), "tiny-qwen35", "tokenizer.json")),
                    reason="embedded target absent")
def test_train_py_eagle3_writes_a_head_that_loads_and_drafts(tmp_path):
    """`tools/train.py eagle3` end to end (a few steps on the embedded target): the head it writes loads in the published
    layout, reads the layers asked for, and its trees give AR's output."""
    from tools import train
    tdir = os.path.join(os.path.dirname(EMBEDDED_EAGLE3), "tiny-qwen35")
    train.main(["eagle3", "--target", tdir, "--out", str(tmp_path), "--steps", "3", "--n-seq", "4", "--prompt-len", "16",
                "--resp-len", "16", "--batch", "2", "--threads", "1", "--aux-layers", "1,2,4"])
    target = E.ckpt.load_target(tdir, torch.float32)
    head = E.load_eagle3(str(tmp_path), target)
    assert json.loads((tmp_path / "training.json").read_text())["steps"] == 3
    prop = E.Eagle3Tree(head, target, 3, 2)
    assert prop.feature_layers == (0, 1, 3)
    prompt = list(range(10, 30))
    assert TR.TreeEngine(target, prop, 6, 64).generate(prompt, 16).output_ids == engine.run(target, prompt, 16).output_ids
