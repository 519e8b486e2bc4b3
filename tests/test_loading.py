"""Loading real checkpoint layouts (single file, shards, multimodal names, bf16, Hub repo ids), and a
one-line CheckpointError / GenerationError for every bad input."""
import fnmatch
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash
import engine
import checkpoint as ckpt
import model as M
from helpers import edit_json, save_hf_causal_lm, save_hf_conditional, save_zlab_drafter

IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


# --------------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_thread")      # conftest.py


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Tiny checkpoints written once per module: a causal LM, the multimodal layout, a fitting drafter
    (distinct target layers), and the HF models that wrote them."""
    root = tmp_path_factory.mktemp("ckpt")
    s = {"root": root}
    s["hf"] = save_hf_causal_lm(root / "causal", seed=1)
    s["causal"] = str(root / "causal")
    s["hf_cond"] = save_hf_conditional(root / "cond", seed=2)
    s["cond"] = str(root / "cond")
    save_zlab_drafter(root / "draft", target_layers=4, vocab=97, hidden=64, layer_ids=[0, 2], seed=3)
    s["draft"] = str(root / "draft")
    return s


def copy_ckpt(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def shard_checkpoint(src: str, dst, n_shards: int, extra: dict | None = None) -> str:
    """Rewrite src's model.safetensors as n_shards shard files plus model.safetensors.index.json (the layout
    of every large Hugging Face checkpoint); `extra` tensors go into the last shard and the index."""
    dst = str(dst)
    os.makedirs(dst)
    for f in os.listdir(src):
        if f.endswith(".json"):
            shutil.copy(os.path.join(src, f), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    groups = [names[i::n_shards] for i in range(n_shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        shard = {k: tensors[k] for k in group}
        if i == n_shards - 1 and extra:
            shard.update(extra)
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(shard, os.path.join(dst, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    return dst


def our_logits(target, ids=IDS):
    with torch.no_grad():
        logits, _ = target(torch.tensor([ids]), torch.arange(len(ids)))
    return logits[0]


def hf_logits(hf, ids=IDS):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def one_line_error(excinfo, *words):
    """The error is one line and names the problem (every word in `words`, case-insensitive)."""
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in {msg!r}"
    return msg


# --------------------------------------------------------------------------------------------------
# layouts that must load
# --------------------------------------------------------------------------------------------------

def test_single_file_matches_transformers(store):
    target = ckpt.load_target(store["causal"])
    torch.testing.assert_close(our_logits(target), hf_logits(store["hf"]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n_shards", [2, 3])
def test_sharded_checkpoint_equals_single_file(store, tmp_path, n_shards):
    single = ckpt.load_target(store["causal"])
    path = shard_checkpoint(store["causal"], tmp_path / "sharded", n_shards)
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    sharded = ckpt.load_target(path)
    # every tensor came from some shard: the weights and the logits are bit-identical
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(our_logits(sharded), our_logits(single))


@pytest.mark.parametrize("tied", [True, False])
def test_a_target_written_in_parts_loads_as_written(tmp_path, tied):
    """checkpoint.save_target_in_parts (how tools/realsize.py writes a 9B target it cannot hold): one shard per part,
    indexed; loading it gives every part's values (bfloat16, as written), the tied lm_head the embedding."""
    from dataclasses import replace
    from helpers import random_target, tiny_target_config
    cfg = replace(tiny_target_config(), tie_word_embeddings=tied)
    whole = random_target(cfg, 3, torch.bfloat16)
    outer = torch.nn.Module()
    outer.embed_tokens, outer.norm = whole.embed_tokens, whole.norm
    if not tied:
        outer.lm_head = whole.lm_head
    parts = [("", outer)] + [(f"layers.{i}.", layer) for i, layer in enumerate(whole.layers)]
    ckpt.save_target_in_parts(cfg, iter(parts), str(tmp_path), torch.bfloat16)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) == cfg.num_hidden_layers + 1
    loaded = ckpt.load_target(str(tmp_path), torch.bfloat16)
    for (name, a), (_, b) in zip(whole.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
    os.mkdir(tmp_path / "short")
    with pytest.raises(ValueError, match="parts written"):
        ckpt.save_target_in_parts(cfg, iter(parts[:-1]), str(tmp_path / "short"), torch.bfloat16)


def test_multimodal_layout_sharded_with_mtp(store, tmp_path):
    """model.language_model.* is the text model, model.visual.* is ignored, mtp.* is skipped."""
    with open(os.path.join(store["cond"], "config.json")) as fh:
        raw = json.load(fh)
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    names = load_file(os.path.join(store["cond"], "model.safetensors")).keys()
    assert any(k.startswith("model.visual.") for k in names)
    assert any(k.startswith("model.language_model.") for k in names)
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.zeros(64),
           "mtp.layers.0.self_attn.q_proj.weight": torch.randn(128, 64), "model.mtp.norm.weight": torch.zeros(64)}
    path = shard_checkpoint(store["cond"], tmp_path / "cond_sharded", 3, extra=mtp)
    target = ckpt.load_target(path)
    torch.testing.assert_close(our_logits(target), hf_logits(store["hf_cond"]), atol=1e-4, rtol=1e-4)
    assert not any("visual" in n or "mtp" in n for n, _ in target.named_parameters())


def test_unknown_tensor_is_still_refused(store, tmp_path):
    """Skipping mtp./visual. is a whitelist: any other tensor the architecture lacks is an error."""
    path = shard_checkpoint(store["causal"], tmp_path / "extra", 2, extra={"model.layers.0.mlp.extra.weight": torch.zeros(3)})
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "layers.0.mlp.extra.weight", "does not use")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_file_loads_as_rounded_weights(store, tmp_path, dtype):
    path = copy_ckpt(store["causal"], tmp_path / "bf16")
    f = os.path.join(path, "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    from_bf16 = ckpt.load_target(path, dtype)
    rounded = ckpt.load_target(store["causal"], dtype)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(dtype))
    sd_a, sd_b = from_bf16.state_dict(), rounded.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for name in sd_a:
        assert sd_a[name].dtype == dtype, name
        assert torch.equal(sd_a[name], sd_b[name]), name
    assert torch.equal(our_logits(from_bf16), our_logits(rounded))
    # and rounding did happen: the fp32 file gives other weights
    assert not torch.equal(ckpt.load_target(store["causal"], dtype).lm_head.weight, from_bf16.lm_head.weight)


def test_bf16_model_keeps_gdn_decay_in_fp32(store):
    """With dtype bfloat16 every weight is bf16 except A_log and dt_bias, which keep the file's fp32 values."""
    full = load_file(os.path.join(store["causal"], "model.safetensors"))
    target = ckpt.load_target(store["causal"], torch.bfloat16)
    kept = 0
    for name, p in target.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            kept += 1
            assert p.dtype == torch.float32, name
            assert torch.equal(p, full["model." + name]), name
        else:
            assert p.dtype == torch.bfloat16, name
    assert kept == 2 * sum(t == "linear_attention" for t in target.cfg.layer_types)


def test_tied_embeddings(tmp_path):
    hf = save_hf_causal_lm(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    target = ckpt.load_target(str(tmp_path / "tied"))
    assert target.lm_head.weight is target.embed_tokens.weight
    torch.testing.assert_close(our_logits(target), hf_logits(hf), atol=1e-4, rtol=1e-4)


def test_drafter_loads_and_generation_is_lossless(store):
    target = ckpt.load_target(store["causal"])
    drafter = ckpt.load_drafter(store["draft"], target.cfg)
    assert drafter.cfg.target_layer_ids == [0, 2] and drafter.cfg.block_size == 8
    ar = engine.run(target, IDS, 12)
    sp = engine.run(target, IDS, 12, proposer=engine.DrafterProposer(drafter, target), block_size=8)
    assert sp.output_ids == ar.output_ids


def test_drafter_with_repeated_target_layer(tmp_path, store):
    """z-lab's default spacing gives [1, 1] for a 2-layer drafter on a 4-layer target: both slots get layer 1."""
    save_zlab_drafter(tmp_path / "d", target_layers=4, vocab=97, hidden=64)
    target = ckpt.load_target(store["causal"])
    drafter = ckpt.load_drafter(str(tmp_path / "d"), target.cfg)
    assert drafter.cfg.target_layer_ids == [1, 1]
    sp = engine.run(target, IDS, 6, proposer=engine.DrafterProposer(drafter, target), block_size=4)
    assert sp.output_ids == engine.run(target, IDS, 6).output_ids


# --------------------------------------------------------------------------------------------------
# Hugging Face repo ids
# --------------------------------------------------------------------------------------------------

def test_repo_id_fetches_only_what_we_read(store, monkeypatch):
    import huggingface_hub
    calls = []
    local = {"org/tiny-target": store["causal"], "org/tiny-draft": store["draft"]}

    def fake_snapshot_download(repo_id, *args, allow_patterns=None, **kw):
        calls.append(repo_id)
        assert not args and allow_patterns == ckpt.HUB_PATTERNS
        return local[repo_id]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    target = ckpt.load_target("org/tiny-target")
    drafter = ckpt.load_drafter("org/tiny-draft", target.cfg)
    assert calls == ["org/tiny-target", "org/tiny-draft"]
    assert target.path == store["causal"] and drafter.path == store["draft"]
    torch.testing.assert_close(our_logits(target), hf_logits(store["hf"]), atol=1e-4, rtol=1e-4)

    def wanted(f):
        return any(fnmatch.fnmatch(f, p) for p in ckpt.HUB_PATTERNS)
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors", "model-00001-of-00004.safetensors", "model.safetensors.index.json"]:
        assert wanted(f), f
    for f in ["pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "original/consolidated.00.pth",
              "model.gguf", "README.md", "onnx/model.onnx", "flax_model.msgpack", "vocab.json", "merges.txt"]:
        assert not wanted(f), f


@pytest.mark.parametrize("exc", [OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection\n"),
                                 RuntimeError(""), KeyError("gated")])
def test_repo_id_fetch_failure_is_one_line(monkeypatch, exc):
    import huggingface_hub

    def fail(*a, **kw):
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target("org/unreachable")
    one_line_error(e, "org/unreachable", type(exc).__name__)


@pytest.mark.parametrize("name", ["/no/such/folder", "no-such-folder", "a/b/c"])
def test_missing_folder_that_is_not_a_repo_id(monkeypatch, name):
    import huggingface_hub

    def never(*a, **kw):
        raise AssertionError("not a repo id: the Hub must not be asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", never)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(name)
    one_line_error(e, f"there is no folder {name}", "not a hugging face repo id")


# --------------------------------------------------------------------------------------------------
# stop tokens
# --------------------------------------------------------------------------------------------------

def test_stop_token_ids(store, tmp_path):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    gen = os.path.join(path, "generation_config.json")

    def stops():
        return ckpt.stop_token_ids(path, ckpt.target_config(ckpt.read_config(path)))

    assert stops() == []                                            # tiny config: eos None everywhere
    edit_json(os.path.join(path, "config.json"), lambda c: c.update(eos_token_id=9))
    assert stops() == [9]                                           # generation_config.json has no eos: config.json's
    edit_json(gen, lambda c: c.update(eos_token_id=[46, 44]))
    assert stops() == [46, 44]                                      # the generation_config list wins
    edit_json(gen, lambda c: c.update(eos_token_id=44))
    assert stops() == [44]
    edit_json(gen, lambda c: c.update(eos_token_id=None))
    assert stops() == [9]
    os.remove(gen)
    assert stops() == [9]
    with open(gen, "w") as fh:
        fh.write("{not json")
    with pytest.raises(M.CheckpointError) as e:
        stops()
    one_line_error(e, "generation_config.json", "not valid JSON")


def test_stop_ids_of_the_multimodal_config(store, tmp_path):
    """The composite config keeps eos in text_config; a null top-level eos must not hide it."""
    path = copy_ckpt(store["cond"], tmp_path / "c")
    os.remove(os.path.join(path, "generation_config.json"))

    def set_eos(c):
        c["eos_token_id"] = None
        c["text_config"]["eos_token_id"] = [5, 6]
    edit_json(os.path.join(path, "config.json"), set_eos)
    cfg = ckpt.target_config(ckpt.read_config(path))
    assert ckpt.stop_token_ids(path, cfg) == [5, 6]


def test_stop_ids_end_generation(store, tmp_path):
    target = ckpt.load_target(store["causal"])
    ref = engine.run(target, IDS, 12).output_ids
    stop = ref[5]
    path = copy_ckpt(store["causal"], tmp_path / "t")
    edit_json(os.path.join(path, "generation_config.json"), lambda c: c.update(eos_token_id=[stop]))
    target = ckpt.load_target(path)
    out = engine.run(target, IDS, 12, ckpt.stop_token_ids(path, target.cfg)).output_ids
    assert out == ref[:ref.index(stop) + 1]


# --------------------------------------------------------------------------------------------------
# bad checkpoints: one line each
# --------------------------------------------------------------------------------------------------

def test_missing_model_safetensors(store, tmp_path):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "model.safetensors")


def test_missing_config(store, tmp_path):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "config.json")


def test_missing_shard(store, tmp_path):
    path = shard_checkpoint(store["causal"], tmp_path / "s", 3)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "model-00002-of-00003.safetensors", "missing")


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"metadata": {}}'])
def test_bad_index(store, tmp_path, content):
    path = shard_checkpoint(store["causal"], tmp_path / "s", 2)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        fh.write(content)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "model.safetensors.index.json")


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("keep", [0.5, 0.0, 5])
def test_truncated_safetensors(store, tmp_path, sharded, keep):
    """Cut a file (in half, to nothing, inside the header): one line naming the file, no crash."""
    path = shard_checkpoint(store["causal"], tmp_path / "s", 2) if sharded else copy_ckpt(store["causal"], tmp_path / "t")
    name = "model-00002-of-00002.safetensors" if sharded else "model.safetensors"
    f = os.path.join(path, name)
    with open(f, "rb") as fh:
        data = fh.read()
    with open(f, "wb") as fh:
        fh.write(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, name, "truncated")


def test_missing_and_misshapen_tensors(store, tmp_path):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "layers.1.linear_attn.A_log", "lacks")

    path = copy_ckpt(store["causal"], tmp_path / "u")
    edit_json(os.path.join(path, "config.json"), lambda c: c.update(intermediate_size=80))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "shape", "mlp")


@pytest.mark.parametrize("content", ["{not json", "", "\xff\xfe garbage", "[]"])
def test_config_not_json(store, tmp_path, content):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    with open(os.path.join(path, "config.json"), "w", encoding="latin-1") as fh:
        fh.write(content)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "config.json")


@pytest.mark.parametrize("model_type, words", [
    ("llama", ["unsupported", "llama"]), ("qwen3", ["unsupported", "qwen3"]), (None, ["has no model_type", "qwen3_5_text"]),
    ("qwen3_5_moe_text", ["num_experts"]), ("qwen3_next", ["mixture-of-experts", "another architecture"])])
def test_unsupported_target_model_type(store, tmp_path, model_type, words):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    edit_json(os.path.join(path, "config.json"), lambda c: c.update(model_type=model_type))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, *words)


def test_moe_by_its_fields(store, tmp_path):
    """A MoE text config under the dense model_type is caught by num_experts (MoE checkpoints: tests/test_moe.py)."""
    path = copy_ckpt(store["cond"], tmp_path / "c")
    edit_json(os.path.join(path, "config.json"), lambda c: c["text_config"].update(num_experts=8, num_experts_per_tok=2))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "dense", "num_experts", "qwen3_5_moe")


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                                   "linear_num_value_heads", "linear_conv_kernel_dim", "rope_theta"])
def test_missing_target_config_field(store, tmp_path, field):
    path = copy_ckpt(store["causal"], tmp_path / "t")

    def drop(c):
        c.pop(field, None)
        c["rope_parameters"].pop(field, None)
    edit_json(os.path.join(path, "config.json"), drop)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, field)


def test_missing_text_config(store, tmp_path):
    path = copy_ckpt(store["cond"], tmp_path / "c")
    edit_json(os.path.join(path, "config.json"), lambda c: c.pop("text_config"))
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "text_config")


@pytest.mark.parametrize("rope_key, rope", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    ("rope_scaling", {"type": "linear", "factor": 2.0})])        # the legacy spelling
def test_non_default_rope_type(store, tmp_path, rope_key, rope):
    path = copy_ckpt(store["causal"], tmp_path / "t")

    def set_rope(c):
        c.pop("rope_parameters")
        c.update({rope_key: rope, "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    edit_json(os.path.join(path, "config.json"), set_rope)
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(path)
    one_line_error(e, "rope_type", rope.get("rope_type", rope.get("type")))


def test_corrupt_tokenizer(store, tmp_path):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    with open(os.path.join(path, "tokenizer.json"), "w") as fh:
        fh.write("{not a tokenizer")
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_tokenizer(path)
    one_line_error(e, "tokenizer.json")
    assert ckpt.load_tokenizer(store["causal"]) is None


# --------------------------------------------------------------------------------------------------
# drafters that do not fit the target
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(hidden=32), ["hidden_size 32", "64"]),
    (dict(vocab=50), ["vocab_size 50", "97"]),
    (dict(target_layers=6), ["6-layer", "4"]),
    (dict(layer_ids=[1, 4]), ["target_layer_ids [4]", "4-layer"]),
    (dict(layer_ids=[-1, 2]), ["'target_layer_ids' must be a list of integers >= 0, got [-1, 2]"]),
    (dict(mask_token_id=97), ["mask_token_id 97", "vocab"]),
    (dict(mask_token_id=-1), ["'mask_token_id' must be an integer >= 0, got -1"])])
def test_drafter_that_does_not_fit(store, tmp_path, kw, words):
    args = dict(target_layers=4, vocab=97, hidden=64, layer_ids=[0, 2])
    args.update(kw)
    save_zlab_drafter(tmp_path / "d", **args)
    target = ckpt.load_target(store["causal"])
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_drafter(str(tmp_path / "d"), target.cfg)
    one_line_error(e, *words)


@pytest.mark.parametrize("edit, words", [
    (lambda c: c["dflash_config"].update(conv_kernel_size=3), ["unknown dflash_config", "conv_kernel_size"]),
    (lambda c: c["dflash_config"].update(block_size=0), ["'block_size' must be an integer >= 1, got 0"]),
    (lambda c: c.update(model_type="llama"), ["unsupported", "llama"]),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), ["DFlash2", "missing the field 'conv_kernel_size'"]),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]) or c["dflash_config"].update(
        conv_kernel_size=2, conv_group_size=48, selector_rank=4, selector_top_k=8), ["DFlash2", "conv_group_size"]),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]) or c["dflash_config"].update(
        conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=8, selector_vocab_size=50),
     ["selector_vocab_size 50", "vocab_size 97"]),
    (lambda c: c.update(architectures=["EagleDraftModel"]), ["not a z-lab drafter", "EagleDraftModel"]),
    (lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"], sliding_window=64), ["chunked_attention", "not supported"]),
    (lambda c: c.update(layer_types=["sliding_attention"], sliding_window=64), ["1 layer_types for 2 layers"]),
    (lambda c: c.update(layer_types=["sliding_attention"] * 2, sliding_window=None), ["sliding_attention", "no sliding_window"]),
    (lambda c: c["dflash_config"].pop("mask_token_id"), ["mask_token_id"]),
    (lambda c: (c["dflash_config"].pop("target_layer_ids"), c.pop("num_target_layers")), ["target_layer_ids", "num_target_layers"]),
    (lambda c: c.pop("hidden_size"), ["hidden_size"]),
    (lambda c: c.pop("num_hidden_layers"), ["num_hidden_layers"]),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), ["rope_type", "yarn"]),
    (lambda c: (c.pop("rope_parameters"), c.update(rope_scaling={"type": "linear", "factor": 2.0})), ["rope_type", "linear"])])
def test_bad_drafter_config(store, tmp_path, edit, words):
    path = copy_ckpt(store["draft"], tmp_path / "d")
    edit_json(os.path.join(path, "config.json"), edit)
    target = ckpt.load_target(store["causal"])
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_drafter(path, target.cfg)
    one_line_error(e, *words)


def test_target_and_drafter_swapped(store):
    target = ckpt.load_target(store["causal"])
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_drafter(store["causal"], target.cfg)
    one_line_error(e, "model_type qwen3_5_text", "not a drafter", "pass it as the target")
    with pytest.raises(M.CheckpointError) as e:
        ckpt.load_target(store["draft"])
    one_line_error(e, "DFlashDraftModel", "not a target", "pass it as the drafter")


# --------------------------------------------------------------------------------------------------
# bad requests: one line each
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(store):
    target = ckpt.load_target(store["causal"])
    return target, engine.DrafterProposer(ckpt.load_drafter(store["draft"], target.cfg), target)


def test_cache_too_short(pair):
    target, proposer = pair
    prompt = IDS[:6]
    # plain AR: the cache must hold prompt + max_new_tokens; exactly that much is enough
    with pytest.raises(dflash.GenerationError) as e:
        engine.run(target, prompt, 10, capacity=15)
    one_line_error(e, "cache length 15", "prompt (6 tokens)", "max_new_tokens (10)")
    assert len(engine.run(target, prompt, 10, capacity=16).output_ids) == 10
    # with a drafter one more block (block_size - 1 slack) must fit
    with pytest.raises(dflash.GenerationError) as e:
        engine.run(target, prompt, 10, proposer=proposer, block_size=8, capacity=22)
    one_line_error(e, "cache length 22")
    assert len(engine.run(target, prompt, 10, proposer=proposer, block_size=8, capacity=23).output_ids) == 10


def test_over_max_position_embeddings(store, tmp_path):
    path = copy_ckpt(store["causal"], tmp_path / "t")
    edit_json(os.path.join(path, "config.json"), lambda c: c.update(max_position_embeddings=16))
    target = ckpt.load_target(path)
    with pytest.raises(dflash.GenerationError) as e:
        engine.run(target, IDS, 7)
    one_line_error(e, "max_position_embeddings 16")
    assert len(engine.run(target, IDS, 6).output_ids) == 6


@pytest.mark.parametrize("block", [0, -1, 9])
def test_block_size_out_of_range(pair, block):
    target, proposer = pair
    with pytest.raises(dflash.GenerationError) as e:
        engine.run(target, IDS, 5, proposer=proposer, block_size=block)
    one_line_error(e, "block size", str(block))


@pytest.mark.parametrize("prompt, words", [([], ["empty"]), ([1, 97], ["[97]", "0..96"]), ([-1, 3], ["[-1]", "0..96"]),
                                           ([5, 200, 96, -3], ["[200, -3]", "outside"])])
def test_bad_prompt(pair, prompt, words):
    target, proposer = pair
    for p in (None, proposer):
        with pytest.raises(dflash.GenerationError) as e:
            engine.run(target, prompt, 5, proposer=p, block_size=4)
        one_line_error(e, *words)


def test_max_new_tokens_below_one(pair):
    target, _ = pair
    with pytest.raises(dflash.GenerationError) as e:
        engine.run(target, IDS, 0)
    one_line_error(e, "max_new_tokens", "0")
