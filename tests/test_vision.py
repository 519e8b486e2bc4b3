"""Image input against transformers: preprocessing == Qwen2VLImageProcessorPil, the vision tower ==
Qwen3_5ForConditionalGeneration's `model.visual`, 3-D positions == its get_rope_index, logits with images ==
its forward with pixel_values; and bad image input is one clear error."""
import json
import math
import os
import re

import pytest
import torch

import checkpoint as ckpt
import options
import model as M
import vision as V
from helpers import hf_text_config, randomize_hf_norms_

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

TEXT = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4)
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, num_position_embeddings=36)
IMG, VS, VE = 90, 88, 89           # <|image_pad|>, <|vision_start|>, <|vision_end|> in the tiny vocab
SMALL = dict(min_pixels=32 * 32, max_pixels=160 * 160)     # pixel limits that keep the tests fast


def random_image(w, h, seed, mode="RGB"):
    g = torch.Generator().manual_seed(seed)
    ch = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = torch.randint(0, 256, (h, w, ch), generator=g, dtype=torch.uint8)
    if mode == "L":
        return Image.frombytes("L", (w, h), a.numpy().tobytes())
    return Image.frombytes(mode, (w, h), a.numpy().tobytes())


def hf_processor(min_pixels, max_pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """A tiny Qwen3_5ForConditionalGeneration with every weight random (vision LayerNorms and biases too),
    saved and loaded back by our loaders."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    torch.manual_seed(0)
    cfg = Qwen3_5Config(text_config=hf_text_config(**TEXT).to_dict(), vision_config=VISION,
                        image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE, video_token_id=91)
    hf = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    randomize_hf_norms_(hf, 1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in hf.model.visual.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g)
                    if p.dim() == 1 else torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
    d = tmp_path_factory.mktemp("mm") / "target"
    hf.save_pretrained(d)
    with open(d / "preprocessor_config.json", "w") as fh:     # the pixel limits a checkpoint's processor sets
        json.dump({"size": {"shortest_edge": SMALL["min_pixels"], "longest_edge": SMALL["max_pixels"]}, "patch_size": 16,
                   "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, fh)
    tower, pc = V.load_vision(str(d))
    assert (pc.min_pixels, pc.max_pixels) == (SMALL["min_pixels"], SMALL["max_pixels"])
    return {"hf": hf, "path": str(d), "tower": tower, "pc": pc, "target": ckpt.load_target(str(d))}


# --------------------------------------------------------------------------------------------------
# preprocessing
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("w,h,mode", [(37, 53, "RGB"), (200, 45, "RGB"), (129, 130, "RGBA"), (61, 17, "L"),
                                      (300, 301, "RGB"), (16, 700, "RGB")])
def test_preprocess_equals_transformers(w, h, mode):
    img = random_image(w, h, seed=w * h, mode=mode)
    ref = hf_processor(**SMALL)(images=[img], return_tensors="pt")
    x, grid = V.preprocess(V.to_rgb(img), V.ImageProcessorConfig(**SMALL))
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert x.shape == ref["pixel_values"].shape
    assert torch.allclose(x, ref["pixel_values"].float(), atol=1e-6, rtol=0)


def test_preprocess_default_limits_equal_transformers():
    img = random_image(70, 40, seed=3)                    # below min_pixels 65536: scaled up, as HF does
    ref = hf_processor(65536, 16777216)(images=[img], return_tensors="pt")
    x, grid = V.preprocess(img, V.ImageProcessorConfig())
    assert list(grid) == ref["image_grid_thw"][0].tolist() and torch.allclose(x, ref["pixel_values"].float(), atol=1e-6)


@pytest.mark.parametrize("h,w", [(1, 1), (37, 53), (1000, 7), (4000, 3000), (33, 6000), (255, 256)])
def test_smart_resize_limits(h, w):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    assert V.smart_resize(h, w, 32, 4096, 1 << 20) == smart_resize(h, w, 32, 4096, 1 << 20)


# --------------------------------------------------------------------------------------------------
# vision tower and 3-D positions
# --------------------------------------------------------------------------------------------------

def test_tower_equals_transformers(mm):
    imgs = [random_image(70, 45, 1), random_image(33, 120, 2), random_image(96, 96, 3)]
    ref = hf_processor(**SMALL)(images=imgs, return_tensors="pt")
    with torch.no_grad():
        want = mm["hf"].model.visual(ref["pixel_values"], grid_thw=ref["image_grid_thw"]).pooler_output
    pre = [V.preprocess(i, mm["pc"]) for i in imgs]
    with torch.no_grad():
        got = mm["tower"](torch.cat([x for x, _ in pre]), [g for _, g in pre])
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max())


def mm_prompt(pieces):
    """['text', n] pieces -> ids with one image pad per image (n = text tokens, 'img' = an image)."""
    ids, g = [], torch.Generator().manual_seed(len(pieces))
    for p in pieces:
        ids += [VS, IMG, VE] if p == "img" else torch.randint(0, 80, (p,), generator=g).tolist()
    return ids


@pytest.mark.parametrize("pieces,sizes", [
    ([5, "img", 3], [(70, 45)]),
    (["img", 4, "img", 2, "img"], [(33, 120), (96, 96), (130, 40)]),
    ([1, "img", "img", 6], [(64, 64), (50, 150)]),
])
def test_rope_positions_equal_get_rope_index(mm, pieces, sizes):
    imgs = [random_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    ip = V.encode_images(mm["tower"], mm["pc"], mm_prompt(pieces), imgs)
    ids = torch.tensor([ip.ids])
    grids = torch.tensor([list(V.preprocess(i, mm["pc"])[1]) for i in imgs])
    want, delta = mm["hf"].model.get_rope_index(ids, (ids == IMG).int(), image_grid_thw=grids)
    assert torch.equal(ip.rope_pos, want[:, 0]) and ip.rope_delta == int(delta)


def test_rope_positions_documented_example():
    """docs/qwen35.md#vision-tower-and-multimodal-positions: [a b c <vs> img x6 (grid 1x4x6) <ve> d e]."""
    ids = [1, 2, 3, VS] + [IMG] * 6 + [VE, 4, 5]
    pos, delta = V.rope_positions(ids, IMG, [(1, 4, 6)], 2)
    assert pos.tolist() == [[0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9],
                            [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8, 9],
                            [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9]] and delta == -3


def test_logits_with_images_equal_transformers(mm):
    imgs = [random_image(100, 70, 4), random_image(130, 100, 5)]      # merged grids 2x3 and 3x4: rope_delta < 0
    ids = mm_prompt([3, "img", 5, "img", 2])
    ip = V.encode_images(mm["tower"], mm["pc"], ids, imgs)
    ref = hf_processor(**SMALL)(images=imgs, return_tensors="pt")
    full = torch.tensor([ip.ids])
    with torch.no_grad():
        want = mm["hf"](input_ids=full, pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"],
                        mm_token_type_ids=(full == IMG).int()).logits
        got, _ = mm["target"](full, torch.arange(full.shape[1]), image_embeds=ip.embeds, rope_pos=ip.rope_pos)
    assert ip.rope_delta < 0 and (got - want).abs().max() < 1e-4


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------

def test_bad_image_input(tmp_path, mm):
    (tmp_path / "not.png").write_bytes(b"this is not an image")
    with pytest.raises(V.ImageError, match="cannot read image"):
        V.load_image(str(tmp_path / "not.png"))
    with pytest.raises(V.ImageError, match="cannot read image"):
        V.load_image(str(tmp_path / "missing.png"))
    random_image(40, 40, 0).save(tmp_path / "cut.png")
    data = (tmp_path / "cut.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[:len(data) // 2])
    with pytest.raises(V.ImageError, match="cannot read image"):
        V.load_image(str(tmp_path / "cut.png"))
    with pytest.raises(V.ImageError, match="outside the limits"):     # 32 x 6000: no multiple-of-32 size fits
        V.preprocess(random_image(6000, 32, 0), V.ImageProcessorConfig(min_pixels=1024, max_pixels=64 * 64))
    with pytest.raises(V.ImageError, match="aspect ratio above 200"):
        V.preprocess(random_image(4000, 16, 0), V.ImageProcessorConfig())
    with pytest.raises(V.ImageError, match=r"2 <\|image_pad\|> id\(s\)"):
        V.encode_images(mm["tower"], mm["pc"], mm_prompt(["img", 2, "img"]), [random_image(40, 40, 0)])


def test_text_only_checkpoint_has_no_vision(tmp_path):
    from helpers import save_hf_causal_lm
    save_hf_causal_lm(tmp_path / "t")
    with pytest.raises(M.CheckpointError, match="no vision_config"):
        V.load_vision(str(tmp_path / "t"))


# --------------------------------------------------------------------------------------------------
# generation with images: AR == transformers' greedy generate; DFlash == AR
# --------------------------------------------------------------------------------------------------

def test_ar_with_images_equals_transformers_generate(mm):
    import engine
    imgs = [random_image(100, 70, 6), random_image(130, 100, 7)]
    ip = V.encode_images(mm["tower"], mm["pc"], mm_prompt([4, "img", 3, "img", 2]), imgs)
    ref = hf_processor(**SMALL)(images=imgs, return_tensors="pt")
    full = torch.tensor([ip.ids])
    with torch.no_grad():
        out = mm["hf"].generate(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=ref["pixel_values"],
                                image_grid_thw=ref["image_grid_thw"], mm_token_type_ids=(full == IMG).int(),
                                max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    want = out[0, full.shape[1]:].tolist()
    got = engine.Engine(mm["target"], None, 1, 1, len(ip.ids) + 16).generate(ip.ids, 16, images=ip).output_ids
    assert got == want
    # the comparison can fail: with text positions instead (rope_delta 0) the logits of the same tokens move
    seq = torch.tensor([ip.ids + want])
    with torch.no_grad():
        a, _ = mm["target"](seq, torch.arange(seq.shape[1]), image_embeds=ip.embeds,
                            rope_pos=torch.cat([ip.rope_pos, torch.arange(len(ip.ids), seq.shape[1]).expand(3, -1) + ip.rope_delta], 1))
        b, _ = mm["target"](seq, torch.arange(seq.shape[1]), image_embeds=ip.embeds)
    assert ip.rope_delta < 0 and (a - b)[0, len(ip.ids):].abs().max() > 1e-3


@pytest.fixture(scope="module")
def mm64(mm):
    """The same checkpoint in float64 (exact DFlash == AR comparisons) with a random drafter for it."""
    from helpers import random_drafter, tiny_draft_config
    target = ckpt.load_target(mm["path"], torch.float64)
    tower, pc = V.load_vision(mm["path"], torch.float64)
    pc.min_pixels, pc.max_pixels = SMALL["min_pixels"], SMALL["max_pixels"]
    drafter = random_drafter(tiny_draft_config(target.cfg, hidden_size=64, head_dim=16, mask_token_id=96), seed=5)
    return {"target": target, "tower": tower, "pc": pc, "drafter": drafter}


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(20, 140), st.integers(20, 140)), min_size=1, max_size=3),
       texts=st.lists(st.integers(0, 6), min_size=4, max_size=4), block=st.integers(1, 16), seed=st.integers(0, 99),
       oracle=st.booleans())
def test_dflash_with_images_equals_ar(mm64, sizes, texts, block, seed, oracle):
    import engine
    from helpers import OracleProposer
    pieces = [texts[0]]
    for i in range(len(sizes)):
        pieces += ["img", texts[i + 1]]
    imgs = [random_image(w, h, seed + i) for i, (w, h) in enumerate(sizes)]
    t = mm64["target"]
    ip = V.encode_images(mm64["tower"], mm64["pc"], mm_prompt([p for p in pieces if p != 0]), imgs)
    max_new = 24
    ar = engine.Engine(t, None, 1, 1, len(ip.ids) + max_new).generate(ip.ids, max_new, images=ip)
    prop = (OracleProposer({tuple(ip.ids): ar.output_ids}, 97, seed) if oracle
            else engine.DrafterProposer(mm64["drafter"], t))
    sp = engine.Engine(t, prop, block, 1, len(ip.ids) + max_new + block).generate(ip.ids, max_new, images=ip)
    assert sp.output_ids == ar.output_ids


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), slots=st.integers(1, 3), block=st.integers(1, 16))
def test_batch_rows_with_images_equal_their_runs_alone(mm64, seed, slots, block):
    """Requests with images (each row's own RoPE offset after its images) beside text requests in one batch, greedy
    and sampled, each through a random drafter and through AR: every row == the same request run alone on
    engine.Engine, at float64 exactly."""
    import random

    import engine
    rng, t = random.Random(seed), mm64["target"]
    reqs = []
    for i in range(4):
        pieces = [rng.randint(1, 5)] + (["img", rng.randint(0, 4)] * rng.randint(i == 0, 2))    # the first has images
        n_img = pieces.count("img")
        imgs = [random_image(rng.randint(20, 120), rng.randint(20, 120), seed + 10 * i + j) for j in range(n_img)]
        ip = V.encode_images(mm64["tower"], mm64["pc"], mm_prompt([p for p in pieces if p != 0]), imgs) if n_img else None
        ids = ip.ids if ip is not None else mm_prompt(pieces)
        sampling = engine.Sampling(0.9, top_k=20) if rng.random() < 0.4 else engine.Sampling()
        reqs.append(engine.Request(ids, rng.randint(1, 20), (), sampling, seed + i, images=ip))
    capacity = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) + block
    alone = [engine.Engine(t, None, 1, 1, capacity).generate(r.prompt_ids, r.max_new_tokens, sampling=r.sampling,
                                                             seed=r.seed, images=r.images).output_ids for r in reqs]
    drafts = engine.DrafterProposer(mm64["drafter"], t)
    for proposer in (None, drafts):
        got = engine.Engine(t, proposer, block, slots, capacity).run(reqs)
        assert [r.output_ids for r in got] == alone, proposer


# --------------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------------

def test_cli_image_prompt_ids(mm, tmp_path, capsys):
    import generate
    files = []
    for i, (w, h) in enumerate([(100, 70), (130, 100)]):
        random_image(w, h, 20 + i).save(tmp_path / f"{i}.png")
        files += ["--image", str(tmp_path / f"{i}.png")]
    ids = mm_prompt([3, "img", 2, "img", 4])
    args = ["--target", mm["path"], "--draft", "none", "--prompt-ids", ",".join(map(str, ids)), "--json",
            "--max-new-tokens", "10", "--dtype", "float32", *files]
    capsys.readouterr()
    assert generate.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    imgs = [Image.open(tmp_path / f"{i}.png") for i in range(2)]
    ref = hf_processor(**SMALL)(images=imgs, return_tensors="pt")
    full = torch.tensor([out["prompt_ids"]])
    assert out["prompt_ids"] == V.expand_image_pads(ids, IMG, ref["image_grid_thw"].tolist(), 2)   # the expanded ids
    with torch.no_grad():
        want = mm["hf"].generate(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=ref["pixel_values"],
                                 image_grid_thw=ref["image_grid_thw"], mm_token_type_ids=(full == IMG).int(),
                                 max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out["output_ids"] == want[0, full.shape[1]:].tolist()
    with pytest.raises(V.ImageError, match=r"1 <\|image_pad\|> id\(s\)"):
        generate.main(args[:5] + ["5,88,90,89"] + args[6:])
    with pytest.raises(V.ImageError, match="cannot read image"):
        generate.main(args[:-1] + [str(tmp_path / "missing.png")])


def test_prompts_file_lines_with_images_equal_single_runs(mm, tmp_path, capsys):
    """--prompts-file lines with "images" (and one without) at concurrency 2: each output line == the same request
    run alone with --image; a line whose images do not match its pads, or a missing file, is an error naming it."""
    import generate
    files = []
    for i, (w, h) in enumerate([(100, 70), (130, 100), (40, 90)]):
        random_image(w, h, 30 + i).save(tmp_path / f"{i}.png")
        files.append(str(tmp_path / f"{i}.png"))
    lines = [{"prompt_ids": mm_prompt([3, "img", 2, "img", 4]), "images": files[:2], "max_new_tokens": 9},
             {"prompt_ids": mm_prompt([5]), "max_new_tokens": 6},
             {"prompt_ids": mm_prompt(["img", 3]), "images": files[2:], "max_new_tokens": 7, "temperature": 0.9, "seed": 4}]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    base = ["--target", mm["path"], "--draft", "none", "--json", "--dtype", "float32"]
    capsys.readouterr()
    assert generate.main(base + ["--prompts-file", str(path), "--concurrency", "2"]) == 0
    got = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    for line, out in zip(lines, got):
        argv = base + ["--prompt-ids", ",".join(map(str, line["prompt_ids"])), "--max-new-tokens", str(line["max_new_tokens"])]
        argv += [a for f in line.get("images", []) for a in ("--image", f)]
        argv += ["--temperature", str(line["temperature"]), "--seed", str(line["seed"])] if "temperature" in line else []
        assert generate.main(argv) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["prompt_ids"] == alone["prompt_ids"] and out["output_ids"] == alone["output_ids"], line
    assert len(got[0]["prompt_ids"]) > len(lines[0]["prompt_ids"])           # the pads were expanded
    for bad, message in (({**lines[0], "images": files[:1]}, r"line 1: .*1 image"),
                         ({**lines[1], "images": [str(tmp_path / "missing.png")]}, "line 1: cannot read image"),
                         ({**lines[1], "images": "0.png"}, "line 1: images has the wrong type")):
        path.write_text(json.dumps(bad))
        assert generate.cli(base + ["--prompts-file", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_chat_puts_images_before_the_text(tmp_path):
    import chat
    tpl = open(os.path.join(options.HERE, "tests", "fixtures", "qwen35_chat_template.jinja")).read()
    a = dict(prompt="What is shown?", n_images=2)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    assert chat.chat_prompt(tpl, {}, **a) == ("<|im_start|>user\n" + pad * 2 +
                                                "What is shown?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    # an earlier turn from --messages that holds an image takes the first file; the new turn opens with the rest
    f = os.path.join(str(tmp_path), "m.json")
    with open(f, "w") as fh:
        json.dump([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "A?"}]},
                   {"role": "assistant", "content": "B."}], fh)
    a["messages_file"] = f
    assert chat.chat_prompt(tpl, {}, **a) == (
        "<|im_start|>user\n" + pad + "A?<|im_end|>\n<|im_start|>assistant\nB.<|im_end|>\n<|im_start|>user\n" + pad +
        "What is shown?<|im_end|>\n<|im_start|>assistant\n<think>\n")


def test_add_vision_pair_runs_and_matches_transformers(tmp_path, capsys):
    """tests/make_tiny_vl.py: the embedded pair with a random tower. transformers loads the result, and
    --image generation (DFlash and AR) equals its greedy generate with pixel_values."""
    import generate
    import make_tiny_vl
    from transformers import Qwen3_5ForConditionalGeneration
    root = options.HERE + "/checkpoints/"
    make_tiny_vl.main(["--target", root + "tiny-qwen35", "--draft", root + "tiny-qwen35-dflash",
                "--out", str(tmp_path), "--threads", "1"])
    random_image(150, 110, 9).save(tmp_path / "pic.png")
    base = ["--target", str(tmp_path / "target"), "--image", str(tmp_path / "pic.png"), "--max-new-tokens", "24",
            "--prompt", "<|vision_start|><|image_pad|><|vision_end|>def show(image):", "--json"]
    runs = {}
    # pure rounds: the acceptance check is about the drafter reading image features, not the adaptive policy
    for name, extra in {"dflash": ["--draft", str(tmp_path / "draft"), "--no-adaptive"], "ar": ["--draft", "none"]}.items():
        capsys.readouterr()
        assert generate.main(base + extra) == 0
        runs[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["dflash"]["output_ids"] == runs["ar"]["output_ids"] and runs["dflash"]["mean_acceptance_length"] > 1
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "target"), dtype=torch.float32).eval()
    ref = hf_processor(64 * 64, 256 * 256)(images=[Image.open(tmp_path / "pic.png")], return_tensors="pt")
    full = torch.tensor([runs["ar"]["prompt_ids"]])
    img = hf.config.image_token_id
    assert int((full == img).sum()) == int(ref["image_grid_thw"].prod()) // 4
    with torch.no_grad():
        out = hf.generate(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=ref["pixel_values"],
                          image_grid_thw=ref["image_grid_thw"], mm_token_type_ids=(full == img).int(),
                          max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert runs["ar"]["output_ids"] == out[0, full.shape[1]:].tolist()
