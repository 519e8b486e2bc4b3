"""The mixture-of-experts Qwen3.5 targets (qwen3_5_moe, qwen3_5_moe_text): our logits == transformers' from both
expert layouts (per expert, as save_pretrained writes them, and fused) and from the multimodal composite;
greedy == transformers' generate; DFlash == AR (hypothesis); the compiled steps run whole (fullgraph); refused
variants are one line; save_target writes what transformers loads."""
import json
import math
import os
import random
import shutil

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

import checkpoint as ckpt
import engine
import model as M
from helpers import Early, edit_json, random_target, randomize_hf_norms_, tiny_target_config
from test_spec_equals_ar import check_spec_equals_ar

TOL = 1e-4
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, num_position_embeddings=36)
IMG, VS, VE = 90, 88, 89           # <|image_pad|>, <|vision_start|>, <|vision_end|> in the tiny vocab


pytestmark = pytest.mark.usefixtures("one_thread")      # conftest.py


def hf_moe_text_config(**kw):
    from transformers import Qwen3_5MoeTextConfig
    base = dict(vocab_size=97, hidden_size=64, num_hidden_layers=len(LAYERS), layer_types=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1]}, **MOE)
    base.update(kw)
    return Qwen3_5MoeTextConfig(**base)


def randomize_hf_(hf, seed):
    """Norms as helpers.randomize_hf_norms_; every MoE weight (router, experts, shared expert and its gate), the
    lm_head and the vision tower at unit-variance outputs: with transformers' 0.02 init the routing is nearly
    uniform (experts close to ties) and the experts add little, so a routing slip might not show."""
    randomize_hf_norms_(hf, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" in name:
                p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g)
                        if p.dim() == 1 else torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            elif ".mlp." in name or name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return hf


def save_hf_moe(path, seed=0, **kw):
    """A tiny transformers Qwen3_5MoeForCausalLM, random, saved with save_pretrained in fp32."""
    from transformers import Qwen3_5MoeForCausalLM
    torch.manual_seed(seed)
    hf = randomize_hf_(Qwen3_5MoeForCausalLM(hf_moe_text_config(**kw)).float().eval(), seed)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_causal")
    return path, save_hf_moe(path, seed=1)


@pytest.fixture(scope="module")
def fused(tmp_path_factory, causal):
    """The same weights in the fused layout, written here under transformers' own parameter names
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I])."""
    src, hf = causal
    path = tmp_path_factory.mktemp("moe_fused")
    shutil.copy(src / "config.json", path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, hf


@pytest.fixture(scope="module")
def cond(tmp_path_factory):
    """The multimodal layout: Qwen3_5MoeForConditionalGeneration (model.language_model.*, model.visual.*)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    torch.manual_seed(2)
    cfg = Qwen3_5MoeConfig(text_config=hf_moe_text_config().to_dict(), vision_config=VISION, image_token_id=IMG,
                           vision_start_token_id=VS, vision_end_token_id=VE, video_token_id=91)
    hf = randomize_hf_(Qwen3_5MoeForConditionalGeneration(cfg).float().eval(), 2)
    path = tmp_path_factory.mktemp("moe_cond")
    hf.save_pretrained(path)
    with open(path / "preprocessor_config.json", "w") as fh:     # small pixel limits: fast tests
        json.dump({"size": {"shortest_edge": 32 * 32, "longest_edge": 160 * 160}, "patch_size": 16, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, fh)
    return path, hf


def prompt(n, seed=0):
    """Text ids below the vision specials of the tiny vocab."""
    return torch.randint(0, 80, (1, n), generator=torch.Generator().manual_seed(seed))


def cached_logits(ours, ids, split, widths=(1, 3, 1, 4, 6, 1, 16)):
    """Prefill `split` tokens, then the rest through the static caches in calls of the given widths: width 1
    alternates AR decode (the cache advances) and a one-token verify; wider calls are verify + commit of all."""
    T = ids.shape[1]
    cache = M.TargetCache(ours.cfg, T, torch.float32, "cpu", max_block=16)
    outs, t, i = [ours(ids[:, :split], torch.arange(split), cache)[0]], split, 0
    while t < T:
        n = min(widths[i % len(widths)], T - t)
        verify = n > 1 or i % 2 == 1
        outs.append(ours(ids[:, t:t + n], torch.arange(t, t + n), cache, verify=verify)[0])
        if verify:
            cache.commit(torch.tensor(n))
        t, i = t + n, i + 1
    return torch.cat(outs, 1)


# --------------------------------------------------------------------------------------------------
# parity with transformers
# --------------------------------------------------------------------------------------------------

def test_save_pretrained_writes_one_tensor_per_expert(causal, fused):
    """What transformers 5 writes (its conversion mapping reversed on save) is the per-expert layout of the
    published files; transformers loads the fused file too, to the same model."""
    from transformers import Qwen3_5MoeForCausalLM
    names = load_file(str(causal[0] / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names and "model.layers.4.mlp.experts.0.down_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    again = Qwen3_5MoeForCausalLM.from_pretrained(str(fused[0])).float().eval()
    want = causal[1].state_dict()
    assert all(torch.equal(t, want[name]) for name, t in again.state_dict().items()) and len(want) == len(again.state_dict())


@pytest.mark.parametrize("which", ["causal", "fused", "cond"])
def test_logits_match_transformers(which, request, monkeypatch):
    """Full forward (150 tokens: the looped experts) and prefill + cached calls of widths 1..16 (gathered for
    T * top_k <= E, looped above): both expert paths against transformers."""
    path, hf = request.getfixturevalue(which)
    ours = ckpt.load_target(str(path), torch.float32)
    assert ours.cfg.num_experts == 8 and isinstance(ours.layers[0].mlp, M.SparseMoE)
    calls = {"gathered": 0, "looped": 0}
    for name in calls:
        def counted(self, *a, _f=getattr(M.Experts, name), _n=name):
            calls[_n] += 1
            return _f(self, *a)
        monkeypatch.setattr(M.Experts, name, counted)
    ids = prompt(150)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        full, _ = ours(ids, torch.arange(150))
        cached = cached_logits(ours, ids, 100)
    print(f"{which}: max |ours - transformers| full {(full - ref).abs().max():.2e}, cached {(cached - ref).abs().max():.2e}, "
          f"max |logit| {ref.abs().max():.2f}")
    assert (full - ref).abs().max() < TOL and (cached - ref).abs().max() < TOL
    assert ref.abs().max() > 1.0 and calls["gathered"] > 0 and calls["looped"] > 0


def test_a_routing_slip_would_show(causal):
    """Sanity of the comparison: top-k weights not renormalised, or the shared expert's gate dropped, move the logits."""
    path, hf = causal
    ours = ckpt.load_target(str(path), torch.float32)
    ids = prompt(30, 4)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        for layer in ours.layers:
            layer.mlp.shared_expert_gate.weight.zero_()          # sigmoid(0) = 1/2 instead of the gate
        wrong, _ = ours(ids, torch.arange(30))
    assert (wrong - ref).abs().max() > 1e-2


def test_expert_paths_agree():
    """gathered (static shapes) == looped (per expert, routed rows only), float64, with repeated and unused experts."""
    torch.manual_seed(0)
    ex = M.Experts(6, 16, 8).double()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_()
    h = torch.randn(9, 16, dtype=torch.float64)
    idx = torch.tensor([[0, 5, 2], [5, 0, 1], [2, 1, 0]] * 3)
    assert (ex.gathered(h, idx) - ex.looped(h, idx)).abs().max() < 1e-12


@pytest.mark.parametrize("which", ["causal", "cond"])
def test_greedy_equals_transformers_generate(which, request):
    path, hf = request.getfixturevalue(which)
    ours = ckpt.load_target(str(path), torch.float32)
    ids = prompt(70, 5)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert engine.run(ours, ids[0].tolist(), 30).output_ids == out[0, 70:].tolist()


def test_tied_embeddings_written_by_transformers(tmp_path):
    hf = save_hf_moe(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    ours = ckpt.load_target(str(tmp_path / "tied"))
    assert ours.lm_head.weight is ours.embed_tokens.weight
    ids = prompt(40, 6)
    with torch.no_grad():
        assert (ours(ids, torch.arange(40))[0] - hf(input_ids=ids).logits).abs().max() < TOL


def test_save_target_round_trip(causal, tmp_path):
    """save_target writes the per-expert layout and a qwen3_5_moe_text config; transformers loads it to the same logits."""
    from transformers import Qwen3_5MoeForCausalLM
    path, hf = causal
    ours = ckpt.load_target(str(path), torch.float32)
    ckpt.save_target(ours, str(tmp_path), dtype=torch.float32)
    with open(tmp_path / "config.json") as fh:
        assert json.load(fh)["model_type"] == "qwen3_5_moe_text"
    assert load_file(str(tmp_path / "model.safetensors")).keys() == load_file(str(path / "model.safetensors")).keys()
    back = Qwen3_5MoeForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    ids = prompt(40, 7)
    with torch.no_grad():
        assert (back(input_ids=ids).logits - hf(input_ids=ids).logits).abs().max() < TOL
    again = ckpt.load_target(str(tmp_path), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


def test_images_with_the_moe_composite(cond):
    """vision.py reads the MoE composite's vision tower like the dense one's: logits with images == transformers."""
    pytest.importorskip("PIL")
    import vision as V
    from test_vision import hf_processor, random_image
    path, hf = cond
    tower, pc = V.load_vision(str(path))
    ours = ckpt.load_target(str(path))
    imgs = [random_image(100, 70, 4), random_image(130, 100, 5)]
    ids = prompt(3).tolist()[0] + [VS, IMG, VE] + prompt(4, 1).tolist()[0] + [VS, IMG, VE] + [7, 8]
    ip = V.encode_images(tower, pc, ids, imgs)
    ref = hf_processor(32 * 32, 160 * 160)(images=imgs, return_tensors="pt")
    full = torch.tensor([ip.ids])
    with torch.no_grad():
        want = hf(input_ids=full, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                  mm_token_type_ids=(full == IMG).int()).logits
        got, _ = ours(full, torch.arange(full.shape[1]), image_embeds=ip.embeds, rope_pos=ip.rope_pos)
    assert (got - want).abs().max() < TOL


# --------------------------------------------------------------------------------------------------
# DFlash == AR on MoE targets
# --------------------------------------------------------------------------------------------------

@st.composite
def moe_configs(draw):
    n_layers = draw(st.integers(1, 4))
    layer_types = draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=n_layers, max_size=n_layers))
    experts = draw(st.integers(1, 8))
    return tiny_target_config(
        vocab_size=draw(st.integers(20, 90)), hidden_size=draw(st.sampled_from([16, 32])), num_hidden_layers=n_layers,
        layer_types=layer_types, num_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)),
        moe_intermediate_size=draw(st.sampled_from([8, 12])), shared_expert_intermediate_size=draw(st.sampled_from([8, 16])))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=30)
@given(cfg=moe_configs(), seed=st.integers(0, 10**6), prompt_len=st.integers(1, 100),
       max_new=st.integers(1, 40), block=st.integers(1, 16), stop=st.one_of(st.none(), st.integers(0, 100)),
       slots=st.sampled_from([1, 3]))
def test_dflash_equals_ar(dtype, cfg, seed, prompt_len, max_new, block, stop, slots):
    """tests/test_spec_equals_ar.py's property on MoE targets: the oracle forcing every acceptance length, the
    recurrent verify kernel, a random drafter, alone or beside two other requests in an Engine of 3 slots (each
    token routed to its own experts whatever the other rows hold); exact in float64, near-ties only in float32."""
    target = random_target(cfg, seed, dtype)
    rng = random.Random(seed)
    check_spec_equals_ar(target, [rng.randrange(cfg.vocab_size) for _ in range(prompt_len)], max_new, block, seed, stop,
                         dtype, slots=slots)


@pytest.mark.parametrize("block", [4, 8])
def test_every_acceptance_length_occurs(block):
    target = random_target(tiny_target_config(vocab_size=50, **MOE), 3)
    sp = check_spec_equals_ar(target, [i % 50 for i in range(1, 60)], 3 * block * block, block, 7, None, torch.float64)
    assert {s.accepted for s in sp.steps if s.kind == "verify" and not s.stop} == set(range(block))


# --------------------------------------------------------------------------------------------------
# compiled steps
# --------------------------------------------------------------------------------------------------

def compiled_steps() -> list:
    """The work of the test below, in a process of its own (helpers.Early), with a fresh inductor cache: with no
    proposer, then with the oracle, an Engine compiled with fullgraph=True generates for one prompt, then with
    recompiles raising for another -> per proposer (that second run's tokens, AR's eager tokens for it)."""
    import torch._dynamo
    import compiling
    from helpers import OracleProposer, fresh_inductor_cache
    cfg = tiny_target_config(vocab_size=50, num_hidden_layers=1, layer_types=["full_attention"], **MOE)   # one layer: compiles fastest
    target = random_target(cfg, 11)
    prompts = [list(range(3, 40)), [7, 1, 30, 2, 9] * 5]
    ar = [engine.run(target, p, 40).output_ids for p in prompts]
    compile_step = compiling.compile_step          # (this process's own: the oracle's propose stays eager)
    compiling.compile_step = lambda f, options, **kw: f if isinstance(f.__self__, OracleProposer) else compile_step(f, options, **kw)
    runs = []
    with fresh_inductor_cache():
        for oracle in (None, OracleProposer({tuple(p): out for p, out in zip(prompts, ar)}, 50, 0, 8)):
            compiled = engine.Engine(target, oracle, 8, 1, 128, compile_mode="default")
            compiled.generate(prompts[0], 20)
            with torch._dynamo.config.patch(error_on_recompile=True):
                runs.append((compiled.generate(prompts[1], 40).output_ids, ar[1]))
    return runs


# started with the suite, in a process of its own
COMPILED_STEPS = Early(compiled_steps, process=True, used_by=["test_compiled_steps_run_whole"])


def test_compiled_steps_run_whole():
    """Decode and an 8-token verify with 8 experts, top-2 (T * top_k = 16 > E: eager would loop) compile with
    fullgraph=True (a graph break is an error), do not recompile for another prompt (a recompile raises), and give
    eager's tokens, with no proposer and with the oracle. The oracle proposer keeps the drafter out of the compile:
    its propose stays eager (tests/test_compile.py compiles drafters)."""
    runs = COMPILED_STEPS.result()
    assert len(runs) == 2
    for got, want in runs:
        assert got == want


# --------------------------------------------------------------------------------------------------
# configs and files that are refused
# --------------------------------------------------------------------------------------------------

def one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    assert all(w.lower() in msg.lower() for w in words), msg


@pytest.mark.parametrize("key,value", [("decoder_sparse_step", 2), ("mlp_only_layers", [1]), ("norm_topk_prob", False)])
def test_unsupported_moe_variant_is_refused(causal, tmp_path, key, value):
    path = shutil.copytree(causal[0], tmp_path / "t")
    edit_json(os.path.join(path, "config.json"), lambda c: c.update({key: value}))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(str(path))
    one_line(e, key, "not supported")


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.pop("num_experts"), ["num_experts", "missing"]),
    (lambda c: c.update(num_experts_per_tok=9), ["num_experts_per_tok"]),
    (lambda c: c.update(model_type="qwen3_5_text"), ["dense", "num_experts"]),
    (lambda c: c.update(model_type="qwen3_next"), ["mixture-of-experts", "another architecture"]),
])
def test_bad_moe_config(causal, tmp_path, edit, words):
    path = shutil.copytree(causal[0], tmp_path / "t")
    edit_json(os.path.join(path, "config.json"), edit)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(str(path))
    one_line(e, *words)


def test_missing_or_misshapen_expert(causal, tmp_path):
    path = shutil.copytree(causal[0], tmp_path / "t")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"}, f)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(str(path))
    one_line(e, "missing", "layers.2.mlp.experts.3.up_proj.weight")
    tensors["model.layers.1.mlp.experts.5.down_proj.weight"] = torch.zeros(64, 23)
    save_file(tensors, f)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(str(path))
    one_line(e, "layers.1.mlp.experts", "shape")
