"""Checkpoints in the real Hugging Face formats: config.json parsing, safetensors (one file or shards), Hub ids,
the tensor-name layouts of Qwen3.5 and of z-lab drafters, tokenizer and stop ids; loading and saving.

    load_target(path)            Qwen3.5 (`qwen3_5` composite or `qwen3_5_text`; the mixture-of-experts
                                 `qwen3_5_moe` and `qwen3_5_moe_text` alike) -> model.Qwen35
    load_drafter(path, cfg)      z-lab DFlashDraftModel -> model.DFlashDrafter, checked against the target
    save_target / save_drafter   the same formats back (transformers and the z-lab package load them)
    save_target_in_parts         a target too large to hold, written a layer at a time into shards
    Stored                       one tensor of a file, read when asked: whole (fill) or only some rows and
                                 columns (read_part: tp.py's ranks read their slices)
    target_bytes, cache_bytes,   the memory a run needs, from the configs alone, against what the device has
    check_memory

Tensor names: docs/qwen35.md#checkpoint-tensor-names.
"""
from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re

import torch
import torch.nn as nn

from kernels import state_dtype
from model import CheckpointError, DFlashDrafter, DraftConfig, GenerationError, Qwen35, TargetConfig

SUPPORTED_TARGET_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
MOE_TYPES = ("qwen3_next",)      # mixture-of-experts models of another architecture
# Keys of other MoE families that transformers' Qwen3.5-MoE does not read, with the only value it matches: a sparse
# block in every layer, top-k weights always renormalised. Any other value is refused rather than ignored.
MOE_FIXED = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
MOE_SIZES = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def _need(d: dict, key: str, where: str):
    if d.get(key) is None:
        raise CheckpointError(f"{where} is missing the field '{key}'; re-export the checkpoint with its full config.json")
    return d[key]


# What each config key that is read as a number, list or flag must hold. A value of the wrong JSON type (the
# string "256", the float 256.5, a negative size) is refused here with one line naming the key, before torch
# can fail on it with a traceback, and is never coerced. Null counts as absent (a default, or "missing").
def _int(lo):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo), f"an integer >= {lo}"


def _number(lo, hi=None, at_least=False):
    def ok(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and (v >= lo if at_least else v > lo) and (hi is None or v <= hi)
    return ok, f"a number {'>=' if at_least else '>'} {lo}" + (f" and <= {hi}" if hi is not None else "")


def _list_of(ok, what):
    return (lambda v: isinstance(v, list) and all(ok(x) for x in v)), f"a list of {what}"


SIZE, INDEX = _int(1), _int(0)
BOOL = (lambda v: isinstance(v, bool)), "true or false"
STRINGS = _list_of(lambda x: isinstance(x, str), "strings")
INDICES = _list_of(INDEX[0], "integers >= 0")
EOS = (lambda v: INDEX[0](v) or INDICES[0](v)), "an integer >= 0 or a list of them"
OBJECT = (lambda v: isinstance(v, dict)), "an object"
COMMON_FIELDS = {"vocab_size": SIZE, "hidden_size": SIZE, "intermediate_size": SIZE, "num_hidden_layers": SIZE,
                 "num_attention_heads": SIZE, "num_key_value_heads": SIZE, "head_dim": SIZE, "layer_types": STRINGS,
                 "rms_norm_eps": _number(0), "rope_theta": _number(0), "max_position_embeddings": SIZE,
                 "tie_word_embeddings": BOOL, "eos_token_id": EOS, "rope_parameters": OBJECT, "rope_scaling": OBJECT}
TARGET_FIELDS = {**COMMON_FIELDS, "linear_num_key_heads": SIZE, "linear_num_value_heads": SIZE, "linear_key_head_dim": SIZE,
                 "linear_value_head_dim": SIZE, "linear_conv_kernel_dim": SIZE, "full_attention_interval": SIZE,
                 "partial_rotary_factor": _number(0, 1), "mrope_section": INDICES, "image_token_id": INDEX,
                 **{k: SIZE for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}}
DRAFT_FIELDS = {**COMMON_FIELDS, "sliding_window": SIZE, "max_window_layers": INDEX, "use_sliding_window": BOOL,
                "is_causal": BOOL, "attention_bias": BOOL, "target_layer_ids": INDICES, "mask_token_id": INDEX,
                "block_size": SIZE, "num_target_layers": SIZE, "train_context_length": SIZE, "input_embedding_scale": _number(0),
                "output_multiplier": _number(0), "final_logit_softcapping": _number(0, at_least=True),
                **{k: SIZE for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_vocab_size")}}


def check_fields(d: dict, rules: dict, where: str) -> None:
    """Every key of `d` named in `rules` holds what its rule says, or is null; else one CheckpointError line."""
    for key, (ok, what) in rules.items():
        v = d.get(key)
        if v is not None and not ok(v):
            raise CheckpointError(f"{where}: '{key}' must be {what}, got {json.dumps(v)}; fix config.json")


def target_config(raw: dict) -> TargetConfig:
    """config.json of a Qwen3.5 checkpoint (composite qwen3_5 / qwen3_5_moe, or text-only qwen3_5_text /
    qwen3_5_moe_text) -> TargetConfig, read by explicit keys (docs/qwen35.md#config)."""
    mt = raw.get("model_type")
    if mt is None:
        raise CheckpointError(f"config.json has no model_type; a Qwen3.5 target says one of {', '.join(SUPPORTED_TARGET_TYPES)}")
    if set(raw.get("architectures") or ()) & set(DRAFT_ARCHITECTURES):
        raise CheckpointError(f"this checkpoint is a DFlash drafter ({', '.join(raw['architectures'])}), not a target; pass it as "
                              "the drafter (--draft) and its Qwen3.5 model as the target (--target)")
    if mt in MOE_TYPES:
        raise CheckpointError(f"model_type '{mt}' is a mixture-of-experts model of another architecture; dflash-fast supports Qwen3.5 and Qwen3.5-MoE only")
    if mt in ("qwen3_5", "qwen3_5_moe"):
        check_fields(raw, {"text_config": OBJECT}, "config.json")
        tc = dict(_need(raw, "text_config", f"config.json of a {mt} model"))
    elif mt in ("qwen3_5_text", "qwen3_5_moe_text"):
        tc = dict(raw)
    else:
        raise CheckpointError(f"unsupported target model_type '{mt}'; expected one of {SUPPORTED_TARGET_TYPES} (a Qwen3.5 checkpoint)")
    where = "the target's text config"
    check_fields(tc, TARGET_FIELDS, where)
    check_fields({k: raw.get(k) for k in ("eos_token_id", "image_token_id", "tie_word_embeddings")}, TARGET_FIELDS, "config.json")
    moe = mt.startswith("qwen3_5_moe")
    if not moe and "num_experts" in tc:
        raise CheckpointError(f"model_type '{mt}' is dense but its config has num_experts; a mixture-of-experts checkpoint has model_type qwen3_5_moe(_text)")
    for key, value in MOE_FIXED.items() if moe else ():
        if tc.get(key, value) != value:
            raise CheckpointError(f"{key} = {tc[key]!r} is not supported: Qwen3.5-MoE (as transformers runs it) has {key} = {value!r}")
    n_layers = _need(tc, "num_hidden_layers", where)
    layer_types = tc.get("layer_types")
    if layer_types is None:  # HF default: full attention every `full_attention_interval` layers
        every = tc.get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    rope = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))   # legacy rope_scaling spells it "type"
    if rope_type != "default":
        raise CheckpointError(f"rope_type '{rope_type}' is not supported; only default (unscaled) RoPE is implemented")
    check_fields(rope, TARGET_FIELDS, f"{where}'s rope_parameters")
    theta = rope.get("rope_theta", tc.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{where} has no rope_theta (in rope_parameters or at top level)")
    eos = raw.get("eos_token_id")
    if eos is None:  # a composite config may write a null top-level eos next to the text config's real one
        eos = tc.get("eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return TargetConfig(
        vocab_size=_need(tc, "vocab_size", where),
        hidden_size=_need(tc, "hidden_size", where),
        intermediate_size=0 if moe else _need(tc, "intermediate_size", where),      # MoE layers have no dense MLP
        num_hidden_layers=n_layers,
        num_attention_heads=_need(tc, "num_attention_heads", where),
        num_key_value_heads=_need(tc, "num_key_value_heads", where),
        head_dim=tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"],
        linear_num_key_heads=_need(tc, "linear_num_key_heads", where),
        linear_num_value_heads=_need(tc, "linear_num_value_heads", where),
        linear_key_head_dim=_need(tc, "linear_key_head_dim", where),
        linear_value_head_dim=_need(tc, "linear_value_head_dim", where),
        linear_conv_kernel_dim=_need(tc, "linear_conv_kernel_dim", where),
        layer_types=list(layer_types),
        rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        partial_rotary_factor=rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25)),
        mrope_section=list(rope.get("mrope_section", [11, 11, 10])),
        max_position_embeddings=tc.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
        eos_token_id=eos,
        image_token_id=int(raw.get("image_token_id", 248056)),
        **({k: int(_need(tc, k, where)) for k in MOE_SIZES} if moe else {}),
    )


# Keys a z-lab drafter may carry in `dflash_config` (or at top level). Anything else in `dflash_config` may
# change the architecture and is refused instead of ignored.
DRAFT_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "input_embedding_scale",
              "output_multiplier", "final_logit_softcapping", "num_target_layers", "train_context_length")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_vocab_size")
DRAFT_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list:
    """Evenly spaced target layers between 1 and L-3 (z-lab's rule); [L // 2] for a one-layer drafter."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def draft_attention(raw: dict, n_layers: int) -> dict:
    """The drafter's layer kinds (docs/method.md#drafter-variants). With `layer_types`, a sliding layer sees
    `sliding_window` positions, as the z-lab package's layers are written, whether or not `use_sliding_window`
    is set (transformers' Qwen3Config drops the window without it, and the package then fails to build its
    cache). Without `layer_types`, Qwen3Config's rule: layers from `max_window_layers` on slide when
    `use_sliding_window` is true."""
    window = raw.get("sliding_window")
    kinds = raw.get("layer_types")
    if kinds is None:
        first, on = raw.get("max_window_layers", 28), raw.get("use_sliding_window") and window is not None
        kinds = ["sliding_attention" if on and i >= first else "full_attention" for i in range(n_layers)]
    if "sliding_attention" in kinds and window is None:
        raise CheckpointError("the drafter has sliding_attention layers but no sliding_window; add it to config.json")
    causal = raw.get("is_causal")
    return dict(layer_types=list(kinds), sliding_window=None if window is None else int(window),
                is_causal=None if causal is None else bool(causal))


def draft_config(raw: dict) -> DraftConfig:
    """config.json of a z-lab DFlash or DFlash2 drafter -> DraftConfig (docs/method.md#the-drafter)."""
    if raw.get("model_type") in SUPPORTED_TARGET_TYPES:
        raise CheckpointError(f"this checkpoint is a Qwen3.5 model (model_type {raw['model_type']}), not a drafter; pass it as the "
                              "target (--target) and a DFlash drafter as --draft")
    if raw.get("model_type") not in ("qwen3", None):
        raise CheckpointError(f"unsupported drafter model_type '{raw.get('model_type')}'; a z-lab DFlash drafter has model_type qwen3")
    arch = raw.get("architectures") or ["DFlashDraftModel"]
    if not set(arch) & set(DRAFT_ARCHITECTURES):
        raise CheckpointError(f"architecture {arch} is not a z-lab drafter; dflash-fast serves {' and '.join(DRAFT_ARCHITECTURES)}")
    dflash2 = "DFlash2DraftModel" in arch
    dc = raw.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise CheckpointError(f"the drafter's dflash_config must be an object, got {json.dumps(dc)}; fix config.json")
    check_fields(raw, DRAFT_FIELDS, "the drafter's config.json")
    check_fields(dc, DRAFT_FIELDS, "the drafter's dflash_config")
    unknown = sorted(set(dc) - set(DRAFT_KEYS) - set(DFLASH2_KEYS if dflash2 else ()))
    if unknown:
        raise CheckpointError(f"unknown dflash_config keys {unknown}; this drafter variant is not supported (known: {', '.join(DRAFT_KEYS)}"
                              f"{', and for DFlash2DraftModel ' + ', '.join(DFLASH2_KEYS) if not dflash2 else ''})")

    def draft_value(key, default=None):
        return dc.get(key, raw.get(key, default))

    where = "the drafter's config.json"
    n_layers = _need(raw, "num_hidden_layers", where)
    n_target = draft_value("num_target_layers")
    layer_ids = draft_value("target_layer_ids")
    if layer_ids is None:
        if n_target is None:
            raise CheckpointError("the drafter config has neither target_layer_ids nor num_target_layers; add one of them")
        layer_ids = default_target_layer_ids(n_target, n_layers)
    mask = draft_value("mask_token_id")
    if mask is None:
        raise CheckpointError("the drafter config has no mask_token_id (in dflash_config or at top level)")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"drafter rope_type '{rope_type}' is not supported; only default RoPE")
    check_fields(rope, DRAFT_FIELDS, "the drafter's rope_parameters")
    softcap = draft_value("final_logit_softcapping")
    vocab = _need(raw, "vocab_size", where)
    dflash2_kw = {}
    if dflash2:
        dflash2_kw = {k: int(_need(dc, k, "the DFlash2 drafter's dflash_config")) for k in DFLASH2_KEYS[:4]}
        if draft_value("selector_vocab_size", vocab) != vocab:
            raise CheckpointError(f"selector_vocab_size {draft_value('selector_vocab_size')} != vocab_size {vocab}: a candidate "
                                  "selector over part of the vocabulary is not supported")
    return DraftConfig(
        hidden_size=_need(raw, "hidden_size", where),
        intermediate_size=_need(raw, "intermediate_size", where),
        num_hidden_layers=n_layers,
        num_attention_heads=_need(raw, "num_attention_heads", where),
        num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        vocab_size=vocab,
        target_layer_ids=[int(i) for i in layer_ids],
        mask_token_id=int(mask),
        block_size=int(draft_value("block_size", 16)),
        num_target_layers=n_target,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1000000.0))),
        attention_bias=bool(raw.get("attention_bias", False)),
        input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
        output_multiplier=float(draft_value("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap in (None, 0) else float(softcap),
        train_context_length=draft_value("train_context_length"),
        **draft_attention(raw, n_layers), **dflash2_kw,
    )


def default_draft_window(cfg: DraftConfig) -> int | None:
    """The draft window to use when none is asked for: the context the drafter was trained on, read from
    `train_context_length` in dflash_config (tools/train.py records it: its --window, else --prompt-len + --resp-len).
    A drafter's acceptance collapses on contexts much longer than its training ones, and a window of that length
    restores most of it. None (no window: drafts see the whole context) when the config does not state it, and so
    for z-lab's sliding drafters: their sliding layers keep to their own `sliding_window` and their full layers
    read the whole context, as the z-lab package runs them."""
    return cfg.train_context_length


def draft_window(cfg: DraftConfig, flag: int | None) -> int | None:
    """The window a run uses: --draft-window `flag` when given (0 = none), else default_draft_window(cfg)."""
    return default_draft_window(cfg) if flag is None else (flag or None)


def check_fits(draft: DraftConfig, target: TargetConfig) -> None:
    """A drafter built for another target fails here, before it can propose nonsense."""
    fix = "use the drafter trained for this target"
    if draft.hidden_size != target.hidden_size:
        raise CheckpointError(f"drafter hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}; {fix}")
    if draft.vocab_size != target.vocab_size:
        raise CheckpointError(f"drafter vocab_size {draft.vocab_size} != target vocab_size {target.vocab_size}; {fix}")
    if draft.num_target_layers is not None and draft.num_target_layers != target.num_hidden_layers:
        raise CheckpointError(f"drafter was built for a {draft.num_target_layers}-layer target, this one has {target.num_hidden_layers}; {fix}")
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise CheckpointError(f"drafter target_layer_ids {bad} do not exist in a {target.num_hidden_layers}-layer target; {fix}")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise CheckpointError(f"drafter mask_token_id {draft.mask_token_id} is outside the target vocab (0..{target.vocab_size - 1}); {fix}")


HUB_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "preprocessor_config.json", "*.safetensors", "model.safetensors.index.json"]


def resolve_dir(name: str) -> str:
    """A local folder, or a Hugging Face repo id fetched with huggingface_hub (only the files we read)."""
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise CheckpointError(f"{name} is a file; pass the checkpoint folder that holds config.json")
    missing = f"there is no folder {name}{_near(name)}"
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise CheckpointError(f"{missing}, and it is not a Hugging Face repo id (org/name); check the path")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated repo: one line that says which
        raise CheckpointError(f"{missing}, and fetching it as a Hugging Face repo id failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); check the path, or download the repo first "
                              "and pass the local folder") from None


def _near(name: str) -> str:
    """' (checkpoints/ holds: a, b)' when the deepest existing folder of `name` is a real folder, to show the
    likely typo; '' otherwise."""
    parent = os.path.dirname(os.path.normpath(name))
    if not parent or not os.path.isdir(parent):
        return ""
    entries = sorted(e for e in os.listdir(parent) if os.path.isdir(os.path.join(parent, e)))
    shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "")
    return f" ({parent}/ holds: {shown or 'no folders'})"


def read_json(f: str) -> dict:
    """A JSON object from file f; anything else (bad JSON, bad encoding, a list) is a one-line CheckpointError."""
    try:
        with open(f, encoding="utf-8") as fh:
            d = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}); re-download the checkpoint") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{f} holds a JSON {type(d).__name__}, not an object; re-download the checkpoint")
    return d


def read_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.exists(f):
        raise CheckpointError(f"{path} has no config.json; point at a checkpoint folder")
    return read_json(f)


def read_safetensors(path: str, keep=None, lazy: bool = False) -> dict:
    """All tensors of a checkpoint folder (those whose name `keep(name)` accepts, when given): one
    model.safetensors, or the shards named by model.safetensors.index.json. Missing or truncated files
    fail with the file's name, a tensor holding NaN or infinity with its own. lazy: Stored handles instead of
    tensors, nothing read but the files' headers (load_into reads each into its parameter)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map naming the shards; re-download the checkpoint")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for name in files:
        f = os.path.join(path, name)
        if not os.path.exists(f):
            raise CheckpointError(f"shard {name} named in the index is missing from {path}; re-download the checkpoint")
        for key, stored in safetensors_contents(f).items():
            if keep is None or keep(key):            # unread tensors (the vision tower, MTP) cost no memory
                tensors[key] = stored if lazy else stored.read()
    return tensors


# safetensors' dtype names -> torch's
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CHUNK = 1 << 22          # bytes read at a time when a tensor is converted: what loading holds besides the model


def safetensors_contents(f: str) -> dict:
    """The header of safetensors file f -> {name: Stored}: 8 bytes (little-endian u64: the header's length), a JSON
    object {name: {dtype, shape, data_offsets [begin, end] after the header}} (and "__metadata__"), then the data.
    Every entry is checked against the file's size, so that a truncated file fails here, whole, with its name."""
    def bad(why: str):
        return CheckpointError(f"{f} is truncated or corrupt ({why}); re-download it")
    size = os.path.getsize(f)
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, no header")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise bad(f"a header of {n} bytes in a file of {size}")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
            fits = all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)) and \
                end - begin == math.prod(shape) * dtype.itemsize
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key}'s entry {json.dumps(entry)[:80]}") from None
        if not fits:
            raise bad(f"tensor {key}'s shape {list(shape)} does not match its {end - begin} bytes")
        if 8 + n + end > size:
            raise bad(f"tensor {key} ends at byte {8 + n + end} of {size}")
        out[key] = Stored(f, key, dtype, shape, 8 + n + begin)
    return out


class Stored:
    """One tensor of a safetensors file, not read yet: its file and name, dtype, shape and first byte. read() -> the
    tensor; fill(out) reads it straight into `out` (same number of elements, contiguous, any dtype): loading holds
    the model and one CHUNK of the file, never a second copy. Both refuse a tensor that holds NaN or infinity (in
    `out`'s dtype) with the tensor's and the file's names. shape, dim() and reshape() as a tensor's (reshape: the
    same elements, another shape)."""

    def __init__(self, file: str, name: str, dtype, shape: tuple, start: int):
        self.file, self.name, self.dtype, self.shape, self.start = file, name, dtype, torch.Size(shape), start

    def dim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> "Stored":
        return Stored(self.file, self.name, self.dtype, torch.empty(self.shape, device="meta").reshape(*shape).shape, self.start)

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.fill(out)
        return out

    def fill(self, out: torch.Tensor) -> None:
        """`out` <- this tensor, converted to out's dtype. The file is mapped (mmap) and copied from a CHUNK at a time,
        each chunk's pages unmapped from this process once copied (MADV_DONTNEED: they stay in the page cache), so the
        process holds `out` and at most one chunk of the file."""
        flat, size = out.view(-1), self.dtype.itemsize
        step = max(1, CHUNK // size)
        with self._mapped() as view:
            for i in range(0, flat.numel(), step):
                part = flat[i:i + step]
                view(i, part.numel(), lambda src: part.copy_(src))

    def read_part(self, rows: torch.Tensor | None, inner: tuple, dtype) -> torch.Tensor:
        """Only some elements, in `dtype`: the rows `rows` (a 1-D index tensor over dim 0; None: all of them) and
        within each the positions `inner` (one 1-D index tensor or None, all, per later dim) -> a tensor of the
        selected shape. Only the runs of consecutive rows asked for are copied out of the file, at most a CHUNK at a
        time (as fill): tp.py's ranks read their slices of a weight this way."""
        rows = torch.arange(self.shape[0]) if rows is None else rows
        row_shape = self.shape[1:]
        out = torch.empty((len(rows), *(n if ix is None else len(ix) for n, ix in zip(row_shape, inner))), dtype=dtype)
        per_row = math.prod(row_shape)
        step = max(1, CHUNK // max(1, per_row * self.dtype.itemsize))
        breaks = [0, *((rows[1:] != rows[:-1] + 1).nonzero().flatten() + 1).tolist(), len(rows)]
        with self._mapped() as view:
            for a, b in zip(breaks, breaks[1:]):              # a run of consecutive rows, a chunk at a time
                for i in range(a, b, step):
                    j = min(b, i + step)

                    def take(src, i=i, j=j):
                        out[i:j].copy_(_within_rows(src.view(j - i, *row_shape), inner))
                        return out[i:j]
                    view(int(rows[i]) * per_row, (j - i) * per_row, take)
        return out

    @contextlib.contextmanager
    def _mapped(self):
        """The file mapped, as view(first, n, use): use(the tensor's elements first .. first + n - 1, a view of the
        map) -> what it copied them into, which is refused with the tensor's and the file's names when it holds NaN
        or infinity (or a value beyond its dtype's range); their pages are then unmapped from this process."""
        size, page = self.dtype.itemsize, mmap.PAGESIZE
        with open(self.file, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
            def view(first, n, use):
                if n == 0:
                    return
                at = self.start + first * size
                src = torch.frombuffer(mapped, dtype=self.dtype, count=n, offset=at)
                got = use(src)
                problem = None if all_finite(got) else (
                    not_finite(self.name, self.file) if not all_finite(src) else
                    f"tensor {self.name} in {self.file} holds values beyond {str(got.dtype).replace('torch.', '')}'s "
                    "range; keep the weights in a wider dtype (--weight-dtype auto or float32)")
                del src, got                         # (the map cannot close while a tensor views it)
                if problem:
                    raise CheckpointError(problem)
                if hasattr(mmap, "MADV_DONTNEED"):
                    mapped.madvise(mmap.MADV_DONTNEED, at - at % page, at % page + n * size)
            yield view


def _within_rows(t: torch.Tensor, inner: tuple) -> torch.Tensor:
    """t [rows, ...] with the positions `inner` (one 1-D index tensor or None, all, per dim after the first) taken."""
    for d, ix in enumerate(inner):
        t = t if ix is None else t.index_select(d + 1, ix)
    return t


class Joined:
    """Stored tensors (or tensors) read one after another into consecutive elements of one parameter of `shape`:
    a mixture of experts' one-tensor-per-expert files into its fused parameters (fuse_experts). fill, read, shape
    and dim() as Stored's."""

    def __init__(self, parts: list, shape: tuple):
        self.parts, self.shape = parts, torch.Size(shape)

    def dim(self) -> int:
        return len(self.shape)

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.parts[0].dtype)
        self.fill(out)
        return out

    def fill(self, out: torch.Tensor) -> None:
        flat, i = out.view(-1), 0
        for part in self.parts:
            n = part.shape.numel()
            dst = flat[i:i + n].view(part.shape)
            if isinstance(part, torch.Tensor):
                dst.copy_(part)
            else:
                part.fill(dst)
            i += n

    def read_part(self, rows: torch.Tensor | None, inner: tuple, dtype) -> torch.Tensor:
        """Stored.read_part's selection for a parameter fused from per-expert tensors ([E, R, ...], each expert's
        R rows its parts' rows one after another): each selected expert's selected rows read from the parts that
        hold them, nothing else."""
        per = len(self.parts) // self.shape[0]
        experts = range(self.shape[0]) if rows is None else rows.tolist()
        sub, rest = inner[0], inner[1:]
        out = torch.empty((len(experts), *(n if ix is None else len(ix) for n, ix in zip(self.shape[1:], inner))), dtype=dtype)
        for i, e in enumerate(experts):
            got, where, first = [], [], 0
            for part in self.parts[e * per:(e + 1) * per]:
                n = part.shape[0]
                pick = torch.arange(n) + first if sub is None else ((sub >= first) & (sub < first + n)).nonzero().flatten()
                local = pick - first if sub is None else sub[pick] - first
                if isinstance(part, torch.Tensor):
                    got.append(_within_rows(part[local], rest).to(dtype))
                else:
                    got.append(part.read_part(local, rest, dtype))
                where.append(pick)
                first += n
            out[i] = torch.cat(got)[torch.cat(where).argsort()]       # back in the order asked for
        return out


def stored_dtype(t) -> torch.dtype:
    """The dtype a checkpoint tensor (a tensor, Stored or Joined) holds in its file."""
    return t.parts[0].dtype if isinstance(t, Joined) else t.dtype


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of t is finite (integer tensors always are). A sum first (fast, no copy: a NaN or an
    infinity makes it non-finite), then, only when the sum is not finite, the elements themselves in slices (a sum
    of huge finite values can overflow)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    flat, step = t.reshape(-1), 1 << 22
    if t.element_size() == 1:           # float8: no sum or isfinite of its own, checked widened a slice at a time
        return all(all_finite(flat[i:i + step].float()) for i in range(0, flat.numel(), step))
    if torch.isfinite(flat.sum()):
        return True
    return all(bool(torch.isfinite(flat[i:i + step]).all()) for i in range(0, flat.numel(), step))


def not_finite(name: str, f: str) -> str:
    """The message for a weight that holds NaN or infinite values."""
    return (f"tensor {name} in {f} holds NaN or infinite values, so the model would print garbage; the checkpoint is "
            "damaged or was saved from a diverged model: re-download or re-export it")


def _target_key(name: str) -> str | None:
    """Checkpoint name -> our parameter name; None for tensors text-only decoding does not use."""
    if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
        return None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name.replace("linear_attn.conv1d.weight", "linear_attn.conv_weight")


EXPERT_NAME = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def fuse_experts(tensors: dict, n_experts: int) -> dict:
    """The per-expert layout (`experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]: the
    published files, and what transformers' save_pretrained writes) -> our fused parameters `experts.gate_up_proj`
    [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I], in place, as Joined tensors (read into the
    parameter expert by expert by load_into). Fused files pass unchanged. Values: tensors or Stored ones."""
    layers = {}
    for name in [n for n in tensors if EXPERT_NAME.fullmatch(n)]:
        prefix, e, kind = EXPERT_NAME.fullmatch(name).groups()
        layers.setdefault(prefix, {})[int(e), kind] = tensors.pop(name)
    for prefix, parts in layers.items():
        want = {(e, k) for e in range(n_experts) for k in ("gate", "up", "down")}
        if set(parts) != want:
            bad = sorted(want ^ set(parts))[:3]
            raise CheckpointError(f"target checkpoint's {prefix} do not match num_experts {n_experts}: {'missing' if bad[0] in want else 'unexpected'} "
                                  f"{', '.join(f'{prefix}.{e}.{k}_proj.weight' for e, k in bad)}")
        # [gate; up] of each expert along rows, all alike (what torch.cat then torch.stack accept), and downs alike
        gate_up = set()
        for e in range(n_experts):
            g, u = tuple(parts[e, "gate"].shape), tuple(parts[e, "up"].shape)
            gate_up.add((g[0] + u[0], *g[1:]) if len(g) == len(u) >= 1 and g[1:] == u[1:] else None)
        down = {tuple(parts[e, "down"].shape) for e in range(n_experts)}
        if len(gate_up) != 1 or None in gate_up or len(down) != 1:
            raise CheckpointError(f"target checkpoint's {prefix}.*_proj.weight differ in shape from expert to expert")
        tensors[prefix + ".gate_up_proj"] = Joined([parts[e, k] for e in range(n_experts) for k in ("gate", "up")],
                                                   (n_experts, *gate_up.pop()))
        tensors[prefix + ".down_proj"] = Joined([parts[e, "down"] for e in range(n_experts)], (n_experts, *down.pop()))
    return tensors


# The narrower dtypes each arithmetic dtype holds exactly: weights stored in one of them are kept as stored under
# weights="auto", and widened as each product reads them (model.kept_product), which gives the widened model's results.
HELD_EXACTLY = {torch.float32: (torch.bfloat16, torch.float16), torch.float64: (torch.bfloat16, torch.float16, torch.float32)}


def kept_dtype(stored, dtype, weights=None):
    """The dtype a weight stored in `stored` is kept in, for arithmetic in `dtype`: `dtype` (weights None: every
    weight widened or rounded to the arithmetic's dtype), the dtype `weights`, or with weights "auto" the stored one
    when `dtype` holds it exactly (bfloat16 under float32), else `dtype`."""
    if weights is None:
        return dtype
    if weights == "auto":
        return stored if stored in HELD_EXACTLY.get(dtype, ()) else dtype
    return weights


def load_into(module: nn.Module, tensors: dict, dtype, what: str, keep_fp32=(), weights=None):
    """Copy checkpoint tensors (tensors, or Stored / Joined ones: each read straight into its parameter) into
    `module`, every parameter must be present with its shape. dtype: the arithmetic's; each weight is kept in
    kept_dtype(its stored dtype, dtype, weights), those named in keep_fp32 in state_dtype(dtype)."""
    with torch.no_grad():
        for name, p, t, kept in matched(module, tensors, dtype, what, keep_fp32, weights):
            if isinstance(t, torch.Tensor):
                p.data = t.to(kept)
            else:
                p.data = torch.empty(p.shape, dtype=kept, device=p.device)
                t.fill(p.data)


def matched(module: nn.Module, tensors: dict, dtype, what: str, keep_fp32=(), weights=None) -> list:
    """module's parameters paired with their checkpoint tensors: [(name, parameter, tensor, the dtype it is kept
    in)], a conv1d weight [C, 1, K] seen as [C, K]. A parameter missing from the checkpoint, a tensor the module
    has no parameter for, or a shape that differs from the config's is refused with its name (load_into's checks)."""
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(tensors))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{what} checkpoint lacks {', '.join(missing[:3])}{more}; it does not match its config.json")
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise CheckpointError(f"{what} checkpoint has tensors this architecture does not use: {', '.join(unexpected[:3])}")
    out = []
    for name, p in params.items():
        t = tensors[name]
        if name.endswith("conv_weight") and t.dim() == 3:         # conv1d's [C, 1, K] -> [C, K]
            t = t.reshape(t.shape[0], t.shape[2]) if t.shape[1] == 1 else (t if isinstance(t, torch.Tensor) else t.read())[:, 0, :]
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{what} tensor {name} has shape {tuple(t.shape)}, config.json implies {tuple(p.shape)}")
        kept = state_dtype(dtype) if name.endswith(keep_fp32) else kept_dtype(stored_dtype(t), dtype, weights)
        out.append((name, p, t, kept))
    return out


# Kept in float32 whatever the dtype: exp(A_log) in bf16 loses the decay's precision (docs/qwen35.md#gated-deltanet).
TARGET_FP32 = ("A_log", "dt_bias")


def target_tensors(path: str, cfg: TargetConfig, keep=lambda name: True) -> dict:
    """The target's tensors of a checkpoint under our parameter names (those `keep(name)` accepts: tp.py reads one
    layer at a time), experts fused, a tied lm_head left out: Stored / Joined handles, read by load_into."""
    tensors = {_target_key(n): t for n, t in read_safetensors(path, keep=lambda n: _target_key(n) is not None
                                                               and keep(_target_key(n)), lazy=True).items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if cfg.num_experts:
        fuse_experts(tensors, cfg.num_experts)
    return tensors


def load_target(path: str, dtype=torch.float32, device="cpu", weights=None) -> Qwen35:
    """The Qwen3.5 target of a checkpoint folder or Hub id, for arithmetic in `dtype`. weights: how its weights are
    kept (kept_dtype): None, every weight in `dtype`; "auto", as stored where `dtype` holds them exactly (a bfloat16
    file under float32 arithmetic: half the memory, the float32 model's results); or a dtype. Each tensor is read
    from its file into its parameter (Stored.fill)."""
    path = resolve_dir(path)
    raw = read_config(path)
    cfg = target_config(raw)
    with torch.device("meta"):
        model = Qwen35(cfg)
    model.to_empty(device="cpu")
    model.tie_weights_()             # to_empty gives every module a new Parameter of its own: tie them again
    tensors = target_tensors(path, cfg)
    try:
        load_into(model, tensors, dtype, "target", keep_fp32=TARGET_FP32, weights=weights)
    except CheckpointError as e:
        if "layer_types" in raw.get("text_config", raw):
            raise
        # the likeliest cause: the layer kinds were guessed (full attention every `full_attention_interval` layers)
        raise CheckpointError(f"config.json has no layer_types, and the layer kinds assumed without it ({cfg.layer_types.count('full_attention')} "
                              f"full attention layers of {cfg.num_hidden_layers}) do not match the weights: add the checkpoint's "
                              f"layer_types to config.json ({e})") from None
    model.dtype = dtype                  # (weights kept narrower: the arithmetic starts at the embedding)
    model.init_buffers_()
    model.path = path
    return model.to(device).eval()


def _draft_key(name: str) -> str:
    """Drafter checkpoint name -> ours: no `model.` prefix; DFlash2's codebooks are published without `.weight`
    (the z-lab package maps them on load) and saved by save_pretrained with it: both are read."""
    name = name[len("model."):] if name.startswith("model.") else name
    return name + ".weight" if name.endswith("_codebook") else name


def load_drafter(path: str, target_cfg: TargetConfig, dtype=torch.float32, device="cpu", weights=None) -> DFlashDrafter:
    """The z-lab drafter of a checkpoint folder or Hub id, checked against its target's config; dtype and weights as
    load_target's."""
    path = resolve_dir(path)
    cfg = draft_config(read_config(path))
    check_fits(cfg, target_cfg)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model.to_empty(device="cpu")
    tensors = {_draft_key(k): t for k, t in read_safetensors(path, lazy=True).items()}
    load_into(model, tensors, dtype, "drafter", weights=weights)
    model.dtype = dtype
    model.init_buffers_()
    model.path = path
    return model.to(device).eval()



# ---- the memory a run needs, known from the configs before any weight is read ------------------------------------

def weight_bytes(module: nn.Module, dtype, keep_fp32=(), kept=None) -> int:
    """Bytes of `module`'s parameters once loaded for arithmetic in `dtype`, kept in `kept` (default: dtype), those
    whose names end with one of keep_fp32 in state_dtype(dtype), as load_into keeps them; a meta-device module will
    do, so nothing is allocated."""
    size = (kept or dtype).itemsize
    wide = state_dtype(dtype).itemsize
    return sum(p.numel() * (wide if n.endswith(keep_fp32) else size) for n, p in module.named_parameters())


def target_bytes(cfg: TargetConfig, dtype, kept=None) -> int:
    """Bytes of a target of config `cfg` loaded for `dtype`, its weights kept in `kept` (default: dtype; load_target)."""
    with torch.device("meta"):
        return weight_bytes(Qwen35(cfg), dtype, TARGET_FP32, kept)


def drafter_bytes(cfg: DraftConfig, dtype, kept=None) -> int:
    """Bytes of a DFlash drafter of config `cfg` loaded for `dtype`, kept in `kept` (load_drafter)."""
    with torch.device("meta"):
        return weight_bytes(DFlashDrafter(cfg), dtype, kept=kept)


def file_dtype(path: str) -> torch.dtype:
    """The dtype that holds most of a checkpoint folder's bytes (from its files' headers: no data is read)."""
    held = {}
    for t in read_safetensors(path, lazy=True).values():
        held[t.dtype] = held.get(t.dtype, 0) + t.shape.numel() * t.dtype.itemsize
    return max(held, key=held.get)


def cache_bytes(cfg: TargetConfig, dtype, capacity: int, slots: int = 1, block: int = 1,
                draft: DraftConfig | None = None) -> int:
    """Bytes of the static caches of a run of `slots` sequences of `capacity` positions verifying `block` tokens at
    a time: the target's TargetCache and, with a DFlash drafter of config `draft`, its DraftCache. Both are built on
    the meta device, so the count follows what the engine allocates."""
    from model import DraftCache, TargetCache
    caches = [TargetCache(cfg, capacity, dtype, "meta", batch=slots, max_block=block)]
    if draft is not None:
        caches.append(DraftCache(draft, capacity, dtype, "meta", batch=slots))
    return sum(t.numel() * t.element_size() for c in caches for layer in c.layers for t in vars(layer).values())


def available_memory(device) -> int | None:
    """Bytes a run may still take on `device`: on a CPU MemAvailable of /proc/meminfo (None where there is no such
    file: the check is then skipped), on a GPU the free memory of the current CUDA device."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info()[0]
    return meminfo("MemAvailable")


def meminfo(field: str) -> int | None:
    """A field of /proc/meminfo in bytes ("MemAvailable", "MemTotal"), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_memory(weights: int, caches: int, available: int | None, where: str, fixes: list) -> None:
    """Refuse a run whose weights and caches (bytes) exceed `available` (bytes; None: unknown, no check) with one
    line naming the need, what `where` has, and `fixes` (the flags that would make it fit)."""
    need = weights + caches
    if available is None or need <= available:
        return
    parts = [f"{gb(n)} of {what}" for n, what in ((weights, "weights"), (caches, "caches")) if n]
    raise GenerationError(f"this run needs about {gb(need)} ({' and '.join(parts)}) but {where} has {gb(available)} "
                          f"available; use {', or '.join(fixes)}")

def load_tokenizer(path: str):
    """The checkpoint's tokenizer.json via `tokenizers`, or None when the folder has none."""
    f = os.path.join(path, "tokenizer.json")
    if not os.path.exists(f):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(f)
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{f} cannot be read ({msg}); re-download it or pass --prompt-ids") from None


def stop_token_ids(path: str, cfg: TargetConfig) -> list:
    """Stop ids from generation_config.json when present, else config.json's eos_token_id (docs/qwen35.md#tokenizer-chat-template-and-stop-tokens)."""
    f = os.path.join(path, "generation_config.json")
    if os.path.exists(f):
        eos = read_json(f).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return list(cfg.eos_token_id)


def hf_tensors(state: dict, dtype, rename) -> dict:
    """Our parameters -> the published layout in `dtype`, names through rename(our name): experts one tensor per
    expert (fuse_experts reversed), the GDN conv weight as conv1d [C, 1, K]."""
    tensors = {}
    for name, p in state.items():
        t = p.detach().to(dtype).contiguous()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            kinds = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            for e in range(t.shape[0]):
                for kind, part in zip(kinds, t[e].chunk(len(kinds))):
                    tensors[rename(f"{name.rsplit('.', 1)[0]}.{e}.{kind}_proj.weight")] = part.contiguous()
            continue
        if name.endswith("conv_weight"):
            name, t = name.replace("conv_weight", "conv1d.weight"), t[:, None, :].contiguous()
        tensors[rename(name)] = t
    return tensors


def target_config_json(cfg: TargetConfig, dtype, eos=None) -> dict:
    """The config.json of a target saved in `dtype`: Qwen3_5ForCausalLM (qwen3_5_text), or Qwen3_5MoeForCausalLM
    (qwen3_5_moe_text) for a mixture-of-experts model."""
    config = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "layer_types": cfg.layer_types,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor,
                            "mrope_section": cfg.mrope_section, "mrope_interleaved": True},
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "eos_token_id": eos, "dtype": str(dtype).replace("torch.", ""),
    }
    if cfg.num_experts:
        del config["intermediate_size"]
        config.update({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"},
                      **{k: getattr(cfg, k) for k in MOE_SIZES})
    return config


def _target_name(name: str) -> str:
    """Our parameter name -> the qwen3_5_text checkpoint's."""
    return name if name.startswith("lm_head") else "model." + name


def save_target(model: Qwen35, out: str, dtype=torch.bfloat16, eos=None) -> None:
    """HF Qwen3_5ForCausalLM names and config (model_type qwen3_5_text); a mixture-of-experts model as
    Qwen3_5MoeForCausalLM (qwen3_5_moe_text) with one tensor per expert, the layout of the published files."""
    from safetensors.torch import save_file
    cfg = model.cfg
    state = {n: p for n, p in model.state_dict().items() if not (n == "lm_head.weight" and cfg.tie_word_embeddings)}
    save_file(hf_tensors(state, dtype, _target_name), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(target_config_json(cfg, dtype, eos), fh, indent=2)


def save_target_in_parts(cfg: TargetConfig, parts, out: str, dtype=torch.bfloat16, eos=None) -> None:
    """A target written one part at a time, never held whole (a 9B model's 18 GB of bfloat16 need not fit in
    memory): `parts` yields (prefix, module) pairs, ("", a module holding embed_tokens, norm and lm_head where
    untied) and ("layers.i.", decoder layer i), each dropped once written. One shard per part, named and indexed
    as the published sharded checkpoints are (model-0000k-of-0000n.safetensors, model.safetensors.index.json)."""
    from safetensors.torch import save_file
    n = cfg.num_hidden_layers + 1
    weight_map, total, k = {}, 0, 0
    for k, (prefix, module) in enumerate(parts, 1):
        state = {prefix + name: p for name, p in module.state_dict().items()
                 if not (name == "lm_head.weight" and cfg.tie_word_embeddings)}
        tensors = hf_tensors(state, dtype, _target_name)
        shard = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del state, tensors, module
    if k != n:
        raise ValueError(f"save_target_in_parts: {k} parts written, the config needs {n} (the outer part and one per layer)")
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(target_config_json(cfg, dtype, eos), fh, indent=2)


def save_drafter(drafter: DFlashDrafter, out: str, dtype=torch.bfloat16) -> None:
    """The z-lab DFlashDraftModel (or DFlash2DraftModel) layout: a Qwen3 config plus dflash_config; tensor names
    without prefix, as the z-lab package's save_pretrained writes them."""
    from safetensors.torch import save_file
    cfg = drafter.cfg
    tensors = {n: p.detach().to(dtype).contiguous() for n, p in drafter.state_dict().items()}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DFlash2DraftModel" if cfg.dflash2 else "DFlashDraftModel"], "model_type": "qwen3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": cfg.attention_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"target_layer_ids": cfg.target_layer_ids, "mask_token_id": cfg.mask_token_id,
                          "block_size": cfg.block_size},
        "layer_types": cfg.layer_types, "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window, "dtype": str(dtype).replace("torch.", ""),
    }
    if cfg.is_causal is not None:
        config["is_causal"] = cfg.is_causal
    if cfg.train_context_length is not None:
        config["dflash_config"]["train_context_length"] = cfg.train_context_length
    if cfg.dflash2:
        config["dflash_config"].update({k: getattr(cfg, k) for k in DFLASH2_KEYS[:4]})
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
