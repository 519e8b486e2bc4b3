"""tools/train.py: the training mask, that training lowers the loss, and that the saved formats load elsewhere."""
import os

import pytest
import torch

import checkpoint as ckpt
import model as M
from tools import train
from helpers import random_target, tiny_target_config, tiny_draft_config, zlab_module


def reference_mask(anchors, B, S):
    """Built by hand, one block at a time: block i of row b sees context j < anchors[b, i] and its own block."""
    N, nA = anchors.shape
    m = torch.zeros(N, 1, nA * B, S + nA * B, dtype=torch.bool)
    for b in range(N):
        for i in range(nA):
            rows = slice(i * B, (i + 1) * B)
            m[b, 0, rows, :int(anchors[b, i])] = True
            m[b, 0, rows, S + i * B:S + (i + 1) * B] = True
    return m


def test_block_mask_equals_hand_built():
    anchors = torch.tensor([[40, 7, 63], [12, 50, 30]])
    B, S = 4, 70
    ref = reference_mask(anchors, B, S)
    assert torch.equal(train.training_mask(anchors, B, S, "cpu"), ref)
    # FlexAttention's own materialisation of the same mask_mod, and its BlockMask in a forward pass
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
    mm = train.dflash_mask_mod(anchors, B, S)
    assert torch.equal(create_mask(mm, 2, None, 12, S + 12, device="cpu"), ref)
    bm = create_block_mask(mm, 2, None, 12, S + 12, device="cpu", BLOCK_SIZE=16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (12, S + 12, S + 12))
    out = flex_attention(q, k, v, block_mask=bm)
    ref_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ref)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


def test_training_lowers_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    tcfg = tiny_target_config(vocab_size=40)
    target = random_target(tcfg, 1, torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    drafter = M.DFlashDrafter(tiny_draft_config(tcfg, block_size=8))
    train.init_weights_(drafter, 0)
    seqs = torch.randint(0, 39, (2, 60), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for step in range(25):
        gen = torch.Generator().manual_seed(0)                   # the same anchors each step: a fixed batch
        loss, _ = train.draft_loss(drafter, target, seqs, 10, 6, 8, 4.0, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]

    model = M.Qwen35(tcfg)
    train.init_weights_(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = seqs[:, :40]
    losses = []
    for step in range(15):
        logits, _ = model(x[:, :-1], torch.arange(39))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_saved_formats_load_in_transformers_and_zlab(tmp_path):
    tcfg = tiny_target_config(vocab_size=40, hidden_size=32)
    target = random_target(tcfg, 2, torch.float32)
    tdir, ddir = tmp_path / "t", tmp_path / "d"
    os.makedirs(tdir), os.makedirs(ddir)
    ckpt.save_target(target, str(tdir), torch.float32)
    drafter = M.DFlashDrafter(tiny_draft_config(tcfg, block_size=8, head_dim=8))
    train.init_weights_(drafter, 3)
    ckpt.save_drafter(drafter, str(ddir), torch.float32)

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=torch.float32).eval()
    ids = torch.randint(0, 40, (1, 30), generator=torch.Generator().manual_seed(0))
    ours = ckpt.load_target(str(tdir), torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got, feats = ours(ids, torch.arange(30), feature_layers=tuple(drafter.cfg.target_layer_ids))
    assert (ref - got).abs().max() < 1e-4

    zm = zlab_module()
    zd = zm.DFlashDraftModel.from_pretrained(str(ddir), dtype=torch.float32).eval()
    assert list(zd.target_layer_ids) == drafter.cfg.target_layer_ids and zd.mask_token_id == drafter.cfg.mask_token_id
    ours_d = ckpt.load_drafter(str(ddir), ours.cfg, torch.float32)
    block = torch.full((1, 8), drafter.cfg.mask_token_id)
    block[0, 0] = 5
    emb = ours.embed_tokens(block)
    with torch.no_grad():
        ref_h = zd(target_hidden=feats[:, :22], noise_embedding=emb, position_ids=torch.arange(30)[None])
        cache = M.DraftCache(ours_d.cfg, 40, torch.float32, "cpu")
        ours_d.append_context(feats[:, :22], torch.arange(22), cache)
        h = ours_d.draft(emb, torch.tensor(22), cache, M.DenseMasks(40))
    assert (ref_h - h).abs().max() < 1e-4


def test_grown_drafter_starts_as_the_small_one_and_trains():
    """--init-from: a 3-layer drafter seeded from a 1-layer one gives the same loss and drafts at step 0, its
    new layers get gradients, and a drafter of other widths is refused."""
    torch.manual_seed(0)
    tcfg = tiny_target_config(vocab_size=40)
    target = random_target(tcfg, 1, torch.float32)
    layers = [0, 1]
    small = M.DFlashDrafter(tiny_draft_config(tcfg, num_hidden_layers=1, block_size=8, target_layer_ids=layers))
    big = M.DFlashDrafter(tiny_draft_config(tcfg, num_hidden_layers=3, block_size=8, target_layer_ids=layers))
    train.init_weights_(small, 0)
    train.init_weights_(big, 1)
    seqs = torch.randint(0, 39, (2, 60), generator=torch.Generator().manual_seed(0))
    train.grow_drafter_(big, small)
    l_small, acc_small = train.draft_loss(small, target, seqs, 10, 6, 8, 4.0, torch.Generator().manual_seed(3))
    l_big, acc_big = train.draft_loss(big, target, seqs, 10, 6, 8, 4.0, torch.Generator().manual_seed(3))
    torch.testing.assert_close(l_big, l_small, rtol=1e-6, atol=1e-6)
    assert acc_big == acc_small
    l_big.backward()
    assert big.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert big.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0
    wide = M.DFlashDrafter(tiny_draft_config(tcfg, num_hidden_layers=3, intermediate_size=48, target_layer_ids=layers))
    with pytest.raises(SystemExit, match="intermediate_size"):           # a drafter of another width
        train.grow_drafter_(wide, small)


def test_init_from_other_target_layers_copies_fc_slot_by_slot():
    """--init-from with other --target-layers (the same count): every tensor is copied, fc's slices in order (slot
    i keeps what the seed learnt for its i-th layer while reading the new i-th layer), the new config's layer ids
    are kept, and a seed that reads another number of layers is refused."""
    torch.manual_seed(0)
    tcfg = tiny_target_config(vocab_size=40)
    small = M.DFlashDrafter(tiny_draft_config(tcfg, num_hidden_layers=1, target_layer_ids=[0, 3]))
    moved = M.DFlashDrafter(tiny_draft_config(tcfg, num_hidden_layers=1, target_layer_ids=[0, 2]))
    train.init_weights_(small, 0)
    train.init_weights_(moved, 1)
    train.grow_drafter_(moved, small)
    assert moved.cfg.target_layer_ids == [0, 2]
    own = moved.state_dict()
    for name, p in small.state_dict().items():
        assert torch.equal(own[name], p), name
    H = tcfg.hidden_size
    torch.testing.assert_close(moved.fc.weight[:, H:], small.fc.weight[:, H:], rtol=0, atol=0)   # layer 3's slice reads layer 2
    three = M.DFlashDrafter(tiny_draft_config(tcfg, num_hidden_layers=1, target_layer_ids=[0, 1, 2]))
    with pytest.raises(SystemExit, match="number of target_layer_ids"):   # a seed reading another number of layers
        train.grow_drafter_(three, small)


@pytest.mark.parametrize("kind", ["sliding", "dflash2"])
def test_init_from_a_drafter_variant_is_refused(kind):
    """This trainer builds full-attention DFlash drafters: a sliding or DFlash2 seed is refused, not half-copied."""
    from helpers import kind_draft_config
    tcfg = tiny_target_config(vocab_size=40)
    plain = M.DFlashDrafter(tiny_draft_config(tcfg, target_layer_ids=[0, 2]))
    seed = M.DFlashDrafter(kind_draft_config(tcfg, kind, target_layer_ids=[0, 2]))
    with pytest.raises(SystemExit, match="differs in"):
        train.grow_drafter_(plain, seed)


class _Payload:
    """Stands for code a pickled file from elsewhere could run on load."""


def test_state_files_load_weights_only(tmp_path):
    """tools/train.py's state round-trips with weights_only=True, and a state file carrying a pickled object is refused."""
    tcfg = tiny_target_config(vocab_size=40)
    drafter = M.DFlashDrafter(tiny_draft_config(tcfg, target_layer_ids=[0, 2]))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95))
    drafter.fc.weight.sum().backward()
    opt.step()
    path = str(tmp_path / "state.pt")
    train.save_state(path, drafter, opt, 7)
    assert train.load_state(path, drafter, opt)[0] == 7
    torch.save({"model": drafter.state_dict(), "extra": _Payload()}, path)
    with pytest.raises(Exception, match="[Ww]eights only"):
        train.load_state(path, drafter, opt)


@pytest.mark.parametrize("window", [None, 7])
def test_long_prompt_crop_trains_what_inference_drafts(window):
    """The long-prompt path of training (features of a full forward, cropped to the last `window` context
    positions before the response, positions offset, the windowed mask) gives each block the hidden states the
    engine's drafter computes at that anchor on the whole sequence with --draft-window `window`."""
    torch.manual_seed(0)
    tcfg = tiny_target_config(vocab_size=40)
    target = random_target(tcfg, 1, torch.float32)
    drafter = M.DFlashDrafter(tiny_draft_config(tcfg, block_size=4))
    train.init_weights_(drafter, 1)
    S, P, B = 50, 30, 4
    seq = torch.randint(0, 39, (1, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, feats = target(seq, torch.arange(S), feature_layers=tuple(drafter.cfg.target_layer_ids))
        keep = 0 if window is None else P - window          # what build_long_data keeps
        anchors = torch.tensor([[P, 37, S - B]]) - keep
        h = train.draft_hidden(drafter, target, seq[:, keep:], anchors, feats[:, keep:], keep, window)
        for i, a in enumerate((anchors[0] + keep).tolist()):
            cache = M.DraftCache(drafter.cfg, S + B, torch.float32, "cpu")
            drafter.append_context(feats[:, :a], torch.arange(a), cache)
            block = torch.full((1, B), drafter.cfg.mask_token_id)
            block[0, 0] = seq[0, a]
            ref = drafter.draft(target.embed_tokens(block), torch.tensor(a), cache, M.DenseMasks(S + B, B, window))
            torch.testing.assert_close(h[0, i], ref[0], rtol=1e-5, atol=1e-5)
