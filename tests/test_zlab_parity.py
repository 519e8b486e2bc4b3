"""Our drafter == the z-lab `dflash` package's DFlashDraftModel on the same weights and target features."""
import pytest
import torch

import checkpoint as ckpt
import model as M
import noise
from helpers import (EMBEDDED_DRAFT, EMBEDDED_TARGET, HAS_EMBEDDED_PAIR, edit_json, save_hf_causal_lm, save_zlab_drafter,
                     zlab_module)

TOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = save_hf_causal_lm(path, seed=3, num_hidden_layers=8)
    return ckpt.load_target(str(path), torch.float32), hf


def draft_like_zlab(ours_t, hf, ours, ref, steps, temperature=0.0, window=None):
    """Teacher-forced cached draft steps, ours and the package's side by side: for each (ctx_lo, start) the
    context positions ctx_lo..start-1 are appended to both caches and the block at `start` is drafted (ours
    through masks of draft window `window`). Returns the largest hidden-state difference; asserts equal proposals
    (and, when sampling, equal q and equal draws: the package's multinomial replaced by the race with our noise of
    the same positions over the same candidates, which does not depend on the candidates' order)."""
    zm = zlab_module()
    V, B = ours_t.cfg.vocab_size, ours.cfg.block_size
    package = type(ref.candidate_selector).select.__globals__ if hasattr(ref, "candidate_selector") else {}
    ids = torch.randint(0, V, (1, steps[-1][1] + 1), generator=torch.Generator().manual_seed(0))
    worst = 0.0
    with torch.no_grad():
        # target features: the package reads HF hidden_states with its own offset; ours come from our forward
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
        ref_feats = zm.extract_context_feature(hs, ref.target_layer_ids)
        _, feats = ours_t(ids, torch.arange(ids.shape[1]), feature_layers=tuple(ours.cfg.target_layer_ids))
        assert (feats - ref_feats).abs().max() < TOL
        cache = M.DraftCache(ours.cfg, 96, torch.float32, "cpu")
        ref_cache = zm._make_cache(ref.config)
        for ctx_lo, start in steps:
            block = torch.full((1, B), ours.cfg.mask_token_id)
            block[0, 0] = ids[0, start]
            emb = ours_t.embed_tokens(block)
            ours.append_context(feats[:, ctx_lo:start], torch.arange(ctx_lo, start), cache)
            h = ours.draft(emb, torch.tensor(start), cache, M.DenseMasks(96, B, window))
            ref_h = ref(target_hidden=ref_feats[:, ctx_lo:start], noise_embedding=emb,
                        position_ids=torch.arange(ctx_lo, start + B)[None], past_key_values=ref_cache, use_cache=True)
            zm._crop_to(ref_cache, start)        # as the package's own loop does
            worst = max(worst, (h - ref_h).abs().max().item())
            assert (h - ref_h).abs().max() < TOL
            rows = noise.row_keys(torch.tensor(noise.seed_key(start)), start + 1 + torch.arange(B - 1), noise.TARGET)
            tok, q = ours.propose(h[0, 1:], block[0, :1], ours_t.lm_head, rows if temperature else None, temperature or 1.0)
            if hasattr(ref, "candidate_selector"):
                if temperature:     # the package's draws, row by row, with our noise at its own candidates
                    k = ref.candidate_selector.top_k
                    cands = torch.topk(ref.compute_logits(ref_h[:, 1:], ours_t.lm_head), k, dim=-1, sorted=False)[1][0]
                    expo, row = noise.exponentials(rows, cands), iter(range(B - 1))
                    package["_sample_probs"] = lambda probs: (probs / expo[next(row)]).argmax(-1)
                ref_tok, cand, ref_q = ref.propose(ref_h[:, 1:], block[:, 0], ours_t.lm_head, temperature)
                if temperature:        # the package's q over its candidates, as a distribution over the vocabulary
                    dense = torch.zeros(1, B - 1, V).scatter(-1, cand, ref_q)
                    assert (q - dense[0]).abs().max() < 1e-5
            else:
                ref_tok = ref.compute_logits(ref_h[0, 1:], ours_t.lm_head).argmax(-1)
            assert torch.equal(tok, ref_tok.view(-1))
    return worst


STEPS = ((0, 37), (37, 42), (42, 50))          # a 37-token prompt, then two verify rounds' worth of context


@pytest.mark.parametrize("n_layers,layer_ids", [(3, None), (1, None), (2, [0, 5]), (2, [3, 7])])
def test_proposals_match_zlab(tmp_path, target, n_layers, layer_ids):
    """Plain drafters of 1-3 layers, default layer spacing or explicit layers (7: the target's last layer)."""
    ours_t, hf = target
    V, H = ours_t.cfg.vocab_size, ours_t.cfg.hidden_size
    zm = zlab_module()
    ref = save_zlab_drafter(tmp_path, target_layers=8, vocab=V, hidden=H, n_layers=n_layers, block_size=8,
                            layer_ids=layer_ids)
    ours = ckpt.load_drafter(str(tmp_path), ours_t.cfg, torch.float32)
    # default spacing (docs/method.md#the-drafter) is the same rule as the package's
    assert ours.cfg.target_layer_ids == list(ref.target_layer_ids)
    if layer_ids is None:
        assert ours.cfg.target_layer_ids == zm.build_target_layer_ids(8, n_layers)
    draft_like_zlab(ours_t, hf, ours, ref, STEPS)


VARIANTS = {   # Qwen3Config keys of each published drafter variant, with a window shorter than the prompt
    "sliding": dict(layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=6,
                    use_sliding_window=True),
    "sliding-noncausal": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              sliding_window=5, use_sliding_window=True, is_causal=False),
    "all-causal": dict(layer_types=["full_attention"] * 3, is_causal=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_sliding_window_drafters_match_zlab(tmp_path, target, variant):
    ours_t, hf = target
    ref = save_zlab_drafter(tmp_path, target_layers=8, vocab=ours_t.cfg.vocab_size, hidden=ours_t.cfg.hidden_size,
                            n_layers=3, block_size=8, seed=4, **VARIANTS[variant])
    ours = ckpt.load_drafter(str(tmp_path), ours_t.cfg, torch.float32)
    want = [(lay.self_attn.is_causal, lay.self_attn.sliding_window) for lay in ref.layers]
    assert ours.kinds == want                              # the package's reading of the same config.json
    # the drafts a run makes with no --draft-window (sliding layers in their window, full layers over the whole
    # 37-token prompt) are the package's
    window = ckpt.draft_window(ours.cfg, None)
    assert window is None
    draft_like_zlab(ours_t, hf, ours, ref, STEPS, window=window)


def test_draft_window_flag_windows_every_layer(tmp_path, target):
    """--draft-window N, asked for, still limits every layer's context, full layers included: the drafts differ
    from the package's (whose full layers see the whole prompt) and equal our drafter's from scratch over only the
    last N context positions."""
    ours_t, _ = target
    save_zlab_drafter(tmp_path, target_layers=8, vocab=ours_t.cfg.vocab_size, hidden=ours_t.cfg.hidden_size,
                      n_layers=3, block_size=8, seed=4, **VARIANTS["sliding"])
    ours = ckpt.load_drafter(str(tmp_path), ours_t.cfg, torch.float32)
    N, B, start = ckpt.draft_window(ours.cfg, 10), ours.cfg.block_size, 37
    assert N == 10
    ids = torch.randint(0, ours_t.cfg.vocab_size, (1, start + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, feats = ours_t(ids, torch.arange(start + 1), feature_layers=tuple(ours.cfg.target_layer_ids))
        block = torch.full((1, B), ours.cfg.mask_token_id)
        block[0, 0] = ids[0, start]
        emb = ours_t.embed_tokens(block)
        drafted = {}
        for window in (N, None):
            cache = M.DraftCache(ours.cfg, 96, torch.float32, "cpu")
            ours.append_context(feats[:, :start], torch.arange(start), cache)
            drafted[window] = ours.draft(emb, torch.tensor(start), cache, M.DenseMasks(96, B, window))
        # from scratch: only the last N positions as context, every layer with its own rule on top
        pos = torch.arange(start - N, start)
        masks = {kind: M.draft_visible(N, None, torch.tensor(N), torch.arange(B)[:, None], torch.arange(N + B)[None, :],
                                       *kind)[None, None] for kind in set(ours.kinds)}
        scratch = ours(emb, feats[:, start - N:start], torch.arange(start, start + B), pos, masks)
    assert (drafted[N] - scratch).abs().max() < TOL
    assert (drafted[N] - drafted[None]).abs().max() > 1e-3          # the window changed what the full layer saw


def test_sliding_layers_without_use_sliding_window(tmp_path, target):
    """The public 4B drafter's config names sliding layers and a window but not use_sliding_window. The package
    cannot draft with it under transformers 5.23 (its cache needs the window Qwen3Config dropped); its layers are
    written to use the window, and so is our reading: the same kinds as with the flag."""
    ours_t, _ = target
    kinds = VARIANTS["sliding"]
    save_zlab_drafter(tmp_path, target_layers=8, vocab=ours_t.cfg.vocab_size, hidden=ours_t.cfg.hidden_size,
                      n_layers=3, block_size=8, seed=4, **kinds)
    edit_json(str(tmp_path / "config.json"), lambda c: c.pop("use_sliding_window", None))
    ours = ckpt.load_drafter(str(tmp_path), ours_t.cfg, torch.float32)
    assert ours.kinds == [(True, 6), (True, 6), (False, None)]


DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_dflash2_matches_zlab(tmp_path, target, temperature):
    """DFlash2 (dynamic convolutions, candidate selector): hidden states and greedy paths; sampling: the same q."""
    ours_t, hf = target
    ref = save_zlab_drafter(tmp_path, target_layers=8, vocab=ours_t.cfg.vocab_size, hidden=ours_t.cfg.hidden_size,
                            n_layers=2, block_size=8, seed=5, dflash2=DFLASH2,
                            layer_types=["sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True)
    ours = ckpt.load_drafter(str(tmp_path), ours_t.cfg, torch.float32)
    assert ours.cfg.dflash2 and ours.candidate_selector is not None
    package = type(ref.candidate_selector).select.__globals__          # the module the package's draws come from
    real = package["_sample_probs"]
    try:
        draft_like_zlab(ours_t, hf, ours, ref, STEPS, temperature)
    finally:
        package["_sample_probs"] = real


def test_dflash2_published_codebook_names_load(tmp_path, target):
    """The published files name the codebooks without `.weight` (the package maps them on load): both load."""
    from safetensors.torch import load_file, save_file
    ours_t, _ = target
    save_zlab_drafter(tmp_path, target_layers=8, vocab=ours_t.cfg.vocab_size, hidden=ours_t.cfg.hidden_size,
                      n_layers=1, block_size=8, seed=6, dflash2=DFLASH2)
    a = ckpt.load_drafter(str(tmp_path), ours_t.cfg, torch.float32)
    f = str(tmp_path / "model.safetensors")
    tensors = load_file(f)
    save_file({k.removesuffix(".weight") if "_codebook" in k else k: v for k, v in tensors.items()}, f, metadata={"format": "pt"})
    assert not any(k.endswith("codebook.weight") for k in load_file(f))
    b = ckpt.load_drafter(str(tmp_path), ours_t.cfg, torch.float32)
    for (n, p), (_, r) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, r), n


def test_off_by_one_layer_would_show(tmp_path, target):
    """The features of layer l and l+1 differ, so the test above would catch an off-by-one (vllm-project/vllm#40727)."""
    ours_t, _ = target
    ids = torch.randint(0, ours_t.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, f = ours_t(ids, torch.arange(20), feature_layers=(2, 3))
    H = ours_t.cfg.hidden_size
    assert (f[..., :H] - f[..., H:]).abs().max() > 1e-2


@pytest.mark.skipif(not HAS_EMBEDDED_PAIR, reason="embedded pair not present")
def test_shipped_pair_proposals_match_zlab():
    """The embedded pair (checkpoints/), float32: our loaders and DrafterProposer against transformers'
    Qwen3_5ForCausalLM and the package's DFlashDraftModel loaded from the same folders. On a held-out prompt
    followed by the target's greedy continuation, teacher-forced (each block starts from the target's token and
    the drafter's context is the target's features), over several cached draft steps of varied advances fed the
    way each loop feeds its drafter: the target features are equal, and so are the 15 proposals of every step."""
    from transformers import Qwen3_5ForCausalLM

    import engine
    import prompts
    tdir, ddir = EMBEDDED_TARGET, EMBEDDED_DRAFT
    ours_t = ckpt.load_target(tdir, torch.float32)
    ours_d = ckpt.load_drafter(ddir, ours_t.cfg, torch.float32)
    zm = zlab_module()
    hf = Qwen3_5ForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    ref = zm.DFlashDraftModel.from_pretrained(ddir, dtype=torch.float32).eval()
    assert list(ref.target_layer_ids) == ours_d.cfg.target_layer_ids
    assert ours_t.cfg.num_hidden_layers - 1 not in ours_d.cfg.target_layer_ids   # published drafters never read the last layer
    B, mask_id = ours_d.cfg.block_size, ours_d.cfg.mask_token_id
    assert ref.block_size == B and ref.mask_token_id == mask_id

    prompt = prompts.heldout_prompts(ckpt.load_tokenizer(tdir), 2)[1]
    T0, steps = len(prompt), [1, 3, 16, 2, 7, 5, 11, 4]
    ids = torch.tensor([prompt + engine.run(ours_t, prompt, sum(steps) + B).output_ids])
    with torch.no_grad():
        ref_feats = zm.extract_context_feature(hf(input_ids=ids, output_hidden_states=True).hidden_states,
                                               ref.target_layer_ids)
        _, feats = ours_t(ids, torch.arange(ids.shape[1]), feature_layers=tuple(ours_d.cfg.target_layer_ids))
        assert (feats - ref_feats).abs().max() < TOL * max(1.0, float(ref_feats.abs().max()))

        cap = ids.shape[1] + B
        proposer = engine.DrafterProposer(ours_d, ours_t)
        proposer.reset(1, cap, M.DenseMasks(cap, B))
        proposer.admit(0, feats[:, :T0], torch.arange(T0), prompt, int(ids[0, T0]))
        ref_cache = zm._make_cache(ref.config)
        # ours, as engine.Engine feeds it (one slot): B rows of features from the last block's positions (rows at or
        # past the new start hidden), zeros before the first verify; the package's loop: exactly the new context rows
        blk_feats, blk_pos = torch.zeros(1, B, feats.shape[-1]), torch.arange(T0, T0 + B)[None]
        ctx_lo, start, hits = 0, T0, 0
        for adv in steps:
            last = ids[0, start:start + 1]
            draft = proposer.propose(last, torch.tensor([start]), blk_feats, blk_pos, B - 1, torch.zeros_like(blk_pos))
            assert isinstance(draft, engine.Draft) and draft.q is None   # a DFlash drafter's greedy draft
            got = draft.tokens[0]
            block = torch.full((1, B), mask_id)
            block[0, 0] = last[0]
            ref_h = ref(target_hidden=ref_feats[:, ctx_lo:start], noise_embedding=hf.get_input_embeddings()(block),
                        position_ids=torch.arange(ctx_lo, start + B)[None], past_key_values=ref_cache,
                        use_cache=True)[:, 1 - B:]
            zm._crop_to(ref_cache, start)
            want = ref.compute_logits(ref_h, hf.lm_head).argmax(-1)[0]
            assert torch.equal(got, want), (start, got.tolist(), want.tolist())
            hits += int(got[0] == ids[0, start + 1])
            blk_feats, blk_pos = feats[:, start:start + B], torch.arange(start, start + B)[None]
            ctx_lo, start = start, start + adv
    assert hits >= len(steps) // 2        # a trained drafter: its first proposal is mostly the target's token


@pytest.mark.parametrize("heads,per_row", [((4, 2), False), ((4, 4), True), ((8, 2), True)])
def test_attention_two_equals_attention_over_the_concatenated_keys(heads, per_row):
    """The drafter's block attends to [context cache ; its own keys] without concatenating them (M.attention_two):
    the same as attention() over the concatenation (float64), grouped query heads or not, with a mask shared by
    the rows [Tq, C+Tq] or one per row [B,1,Tq,C+Tq] (hidden cache slots included)."""
    (hq, hkv), B, C, Tq, D = heads, 2, 24, 5, 8
    g = torch.Generator().manual_seed(hq + hkv)
    q = torch.randn(B, hq, Tq, D, dtype=torch.float64, generator=g)
    kc, vc = (torch.randn(B, hkv, C, D, dtype=torch.float64, generator=g) for _ in range(2))
    kb, vb = (torch.randn(B, hkv, Tq, D, dtype=torch.float64, generator=g) for _ in range(2))
    mask = torch.rand(B if per_row else 1, 1, Tq, C + Tq, generator=g) < 0.6
    mask[..., C:] = True                                           # a block row always sees the block
    mask = mask if per_row else mask[0, 0]
    want = M.attention(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask)
    torch.testing.assert_close(M.attention_two(q, kc, vc, kb, vb, mask), want, rtol=0, atol=1e-12)
