"""Our drafter == the z-lab `dflash` package's DFlashDraftModel on the same weights and target features."""
import pytest
import torch

import checkpoint as ckpt
import model as M
from helpers import EMBEDDED_DRAFT, EMBEDDED_TARGET, HAS_EMBEDDED_PAIR, save_hf_causal_lm, save_zlab_drafter, zlab_module

TOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = save_hf_causal_lm(path, seed=3, num_hidden_layers=8)
    return ckpt.load_target(str(path), torch.float32), hf


@pytest.mark.parametrize("n_layers,layer_ids", [(3, None), (1, None), (2, [0, 5])])
def test_proposals_match_zlab(tmp_path, target, n_layers, layer_ids):
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

    T0, B = 37, 8
    ids = torch.randint(0, V, (1, T0 + 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # target features: the package reads HF hidden_states with its own offset; ours come from our forward
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
        ref_feats = zm.extract_context_feature(hs, ref.target_layer_ids)
        _, feats = ours_t(ids, torch.arange(ids.shape[1]), feature_layers=tuple(ours.cfg.target_layer_ids))
        assert (feats - ref_feats).abs().max() < TOL

        mask_id = ours.cfg.mask_token_id
        cache = M.DraftCache(ours.cfg, 64, torch.float32, "cpu")
        ref_cache = zm._make_cache(ref.config)
        # two consecutive draft steps, the second one appending 5 new context positions to both caches
        for ctx_lo, start in ((0, T0), (T0, T0 + 5)):
            block = torch.full((1, B), mask_id)
            block[0, 0] = ids[0, start] if start < ids.shape[1] else 1
            emb = ours_t.embed_tokens(block)
            ctx = feats[:, ctx_lo:start]
            ours.append_context(ctx, torch.arange(ctx_lo, start), cache)
            h = ours.draft(emb, torch.arange(start, start + B), cache, M.DenseMasks(64).draft(torch.tensor(start), B))
            ref_h = ref(target_hidden=ref_feats[:, ctx_lo:start], noise_embedding=emb,
                        position_ids=torch.arange(ctx_lo, start + B)[None], past_key_values=ref_cache, use_cache=True)
            zm._crop_to(ref_cache, start)        # as the package's own loop does
            assert (h - ref_h).abs().max() < TOL
            ours_tok = ours.draft_logits(h[0, 1:], ours_t.lm_head).argmax(-1)
            ref_tok = ref.compute_logits(ref_h[0, 1:], ours_t.lm_head).argmax(-1)
            assert torch.equal(ours_tok, ref_tok)


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

    import dflash
    import train
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

    prompt = train.heldout_prompts(ckpt.load_tokenizer(tdir), 2)[1]
    T0, steps = len(prompt), [1, 3, 16, 2, 7, 5, 11, 4]
    ids = torch.tensor([prompt + dflash.run(ours_t, prompt, sum(steps) + B).output_ids])
    with torch.no_grad():
        ref_feats = zm.extract_context_feature(hf(input_ids=ids, output_hidden_states=True).hidden_states,
                                               ref.target_layer_ids)
        _, feats = ours_t(ids, torch.arange(ids.shape[1]), feature_layers=tuple(ours_d.cfg.target_layer_ids))
        assert (feats - ref_feats).abs().max() < TOL * max(1.0, float(ref_feats.abs().max()))

        cap = ids.shape[1] + B
        proposer = dflash.DrafterProposer(ours_d, ours_t)
        proposer.reset(cap, M.DenseMasks(cap))
        proposer.prefill(feats[:, :T0], torch.arange(T0))
        ref_cache = zm._make_cache(ref.config)
        # ours, as dflash.Engine feeds it: B rows of features from the last block's positions (rows at or past
        # the new start hidden), zeros before the first verify; the package's loop: exactly the new context rows
        blk_feats, blk_pos, ctx_lo, start, hits = torch.zeros(1, B, feats.shape[-1]), torch.arange(T0, T0 + B), 0, T0, 0
        for adv in steps:
            last = ids[0, start:start + 1]
            got = proposer.propose(last, torch.tensor([start]), blk_feats, blk_pos, B - 1)
            block = torch.full((1, B), mask_id)
            block[0, 0] = last[0]
            ref_h = ref(target_hidden=ref_feats[:, ctx_lo:start], noise_embedding=hf.get_input_embeddings()(block),
                        position_ids=torch.arange(ctx_lo, start + B)[None], past_key_values=ref_cache,
                        use_cache=True)[:, 1 - B:]
            zm._crop_to(ref_cache, start)
            want = ref.compute_logits(ref_h, hf.lm_head).argmax(-1)[0]
            assert torch.equal(got, want), (start, got.tolist(), want.tolist())
            hits += int(got[0] == ids[0, start + 1])
            blk_feats, blk_pos = feats[:, start:start + B], torch.arange(start, start + B)
            ctx_lo, start = start, start + adv
    assert hits >= len(steps) // 2        # a trained drafter: its first proposal is mostly the target's token
