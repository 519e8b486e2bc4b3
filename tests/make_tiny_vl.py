"""Builds a tiny multimodal pair (a random vision tower) from a text pair, to run --image on a CPU.

The image path (vision.py, --image) then runs end to end on a CPU in seconds. A test fixture, and a way to try --image without downloading a real checkpoint:

    python tests/make_tiny_vl.py --target checkpoints/tiny-qwen35 --draft checkpoints/tiny-qwen35-dflash --out /tmp/tiny-vl

It writes <out>/target (model_type qwen3_5: the text weights under model.language_model.*, a small RANDOMLY
initialised vision tower under model.visual.*, the tokenizer with <|vision_start|> <|vision_end|> <|image_pad|>
added, a preprocessor_config.json) and <out>/draft (the same drafter, its vocab_size grown to match). The
tower is untrained: the text after an image is the text model's, not a description of the image.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the project's flat modules
import checkpoint as ckpt  # noqa: E402


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def make_tiny_vl(args):
    import shutil

    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    import vision
    target = ckpt.load_target(args.target, torch.float32)
    cfg = target.cfg
    tok = Tokenizer.from_file(os.path.join(target.path, "tokenizer.json"))
    tok.add_special_tokens(VISION_TOKENS)
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    V = tok.get_vocab_size()
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():                 # new embedding rows like the old ones; lm_head rows 0 (never preferred)
        emb = target.embed_tokens.weight
        extra = torch.randn(V - cfg.vocab_size, cfg.hidden_size, generator=g) * emb.std()
        embed = torch.cat([emb, extra])
        head = torch.cat([target.lm_head.weight, torch.zeros(V - cfg.vocab_size, cfg.hidden_size)])
    vcfg = vision.VisionConfig(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=cfg.hidden_size,
                               num_position_embeddings=64, image_token_id=ids["<|image_pad|>"],
                               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    tower = vision.VisionTower(vcfg)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))

    out_t, out_d = os.path.join(args.out, "target"), os.path.join(args.out, "draft")
    os.makedirs(out_t, exist_ok=True)
    tensors = {}
    for name, p in target.state_dict().items():
        if name.endswith("conv_weight"):
            name, p = name.replace("conv_weight", "conv1d.weight"), p[:, None, :]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            p = embed if name == "embed_tokens.weight" else head
        tensors[name if name == "lm_head.weight" else "model.language_model." + name] = p.to(torch.bfloat16).contiguous()
    for name, p in tower.state_dict().items():
        if name == "patch_embed.proj.weight":          # stored as the checkpoint's Conv3d kernel [D, C, Tp, p, p]
            p = p.view(vcfg.hidden_size, vcfg.in_channels, vcfg.temporal_patch_size, vcfg.patch_size, vcfg.patch_size)
        tensors["model.visual." + name] = p.to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(out_t, "model.safetensors"), metadata={"format": "pt"})
    text = ckpt.read_config(target.path)
    text.update(model_type="qwen3_5_text", vocab_size=V)
    text.pop("architectures", None)
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": {"model_type": "qwen3_5_vision", "hidden_act": "gelu_pytorch_tanh",
                                **{k: getattr(vcfg, k) for k in vision.VisionConfig.KEYS}},
              "image_token_id": vcfg.image_token_id, "vision_start_token_id": vcfg.vision_start_token_id,
              "vision_end_token_id": vcfg.vision_end_token_id, "tie_word_embeddings": cfg.tie_word_embeddings}
    with open(os.path.join(out_t, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    with open(os.path.join(out_t, "preprocessor_config.json"), "w") as fh:   # small images: at most 64 tokens each
        json.dump({"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                   "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}}, fh, indent=2)
    tok.save(os.path.join(out_t, "tokenizer.json"))
    if args.draft:
        os.makedirs(out_d, exist_ok=True)
        shutil.copy(os.path.join(args.draft, "model.safetensors"), out_d)
        dcfg = ckpt.read_config(args.draft)
        dcfg["vocab_size"] = V          # the drafter has no embedding or lm_head of its own: only the number changes
        with open(os.path.join(out_d, "config.json"), "w") as fh:
            json.dump(dcfg, fh, indent=2)
    print(f"wrote {out_t}" + (f" and {out_d}" if args.draft else "") + f"; image prompt: "
          f"{''.join(VISION_TOKENS[:1] + VISION_TOKENS[2:] + VISION_TOKENS[1:2])} (image_pad id {vcfg.image_token_id})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    make_tiny_vl(args)


if __name__ == "__main__":
    main()
