"""Our target == transformers' Qwen3.5 on the same random weights saved with save_pretrained (fp32)."""
import pytest
import torch

import engine
import checkpoint as ckpt
import model as M
from helpers import save_hf_causal_lm, save_hf_conditional

TOL = 1e-4


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_causal")
    return path, save_hf_causal_lm(path, seed=1)


@pytest.fixture(scope="module")
def conditional(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_cond")
    return path, save_hf_conditional(path, seed=2)


def prompt(n, vocab, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def cached_logits(ours, ids, split):
    """Prefill `split` tokens (chunked), then one token at a time through the static caches, alternating the
    AR decode (the cache advances) and a one-token verify + commit (both paths a generation takes)."""
    T = ids.shape[1]
    cache = M.TargetCache(ours.cfg, T, torch.float32, "cpu")
    out, _ = ours(ids[:, :split], torch.arange(split), cache)
    outs = [out]
    for t in range(split, T):
        if t % 2:
            l, _ = ours(ids[:, t:t + 1], torch.arange(t, t + 1), cache)
        else:
            l, _ = ours(ids[:, t:t + 1], torch.arange(t, t + 1), cache, verify=True)
            cache.commit(torch.tensor(1))
        outs.append(l)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("which", ["causal", "conditional"])
def test_logits_match_transformers(which, request):
    path, hf = request.getfixturevalue(which)
    ours = ckpt.load_target(str(path), torch.float32)
    ids = prompt(150, ours.cfg.vocab_size)          # crosses the 64-token chunk boundary twice
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        full, _ = ours(ids, torch.arange(150))
        cached = cached_logits(ours, ids, 100)
    assert (full - ref).abs().max() < TOL
    assert (cached - ref).abs().max() < TOL
    assert ref.abs().max() > 0.1                    # the comparison is not between two near-zero tensors


def test_features_are_layer_outputs(causal):
    """feats of layer l == HF hidden_states[l + 1] for EVERY layer (vllm-project/vllm#40727): the output of decoder
    layer l, and for the last layer the output after the final norm, which is what transformers puts at index L."""
    path, hf = causal
    ours = ckpt.load_target(str(path), torch.float32)
    ids = prompt(40, ours.cfg.vocab_size, 3)
    L, H = ours.cfg.num_hidden_layers, ours.cfg.hidden_size
    with torch.no_grad():
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
        _, feats = ours(ids, torch.arange(40), feature_layers=tuple(range(L)))
        _, raw_last = ours(ids, torch.arange(40), feature_layers=(L - 2,))
    assert len(hs) == L + 1
    for l in range(L):
        assert (feats[..., l * H:(l + 1) * H] - hs[l + 1]).abs().max() < TOL, l
    # the last layer's features are normed: far from the raw residual stream (so a missing norm would show)
    assert (feats[..., -H:] - hs[L]).abs().max() < TOL and (feats[..., -H:] - raw_last).abs().max() > 0.1


def test_forward_keeps_only_the_feature_layers_outputs(causal):
    """While the target runs, the outputs of layers no proposer reads are freed as soon as the next layer has
    them: when the last layer starts, of the earlier layers' outputs only the feature layers' are alive (at 9B
    shapes and a 32k-token prefill, keeping all of them would hold about 8.6 GB in bfloat16)."""
    import gc
    import weakref
    path, _ = causal
    ours = ckpt.load_target(str(path), torch.float32)
    L = ours.cfg.num_hidden_layers
    keep = (0, L - 2)
    refs, alive = {}, {}

    def record(i):
        def hook(module, args, out):
            refs[i] = weakref.ref(out)
        return hook

    def at_last_layer(module, args):
        gc.collect()
        alive.update({i: r() is not None for i, r in refs.items()})

    handles = [layer.register_forward_hook(record(i)) for i, layer in enumerate(ours.layers[:-1])]
    handles.append(ours.layers[-1].register_forward_pre_hook(at_last_layer))
    with torch.no_grad():
        ours(prompt(24, ours.cfg.vocab_size), torch.arange(24), feature_layers=keep)
    for h in handles:
        h.remove()
    # layer L - 2's output is also the last layer's input; the others are dead unless a proposer reads them
    assert alive == {i: i in keep or i == L - 2 for i in range(L - 1)}, alive


def test_a_norm_slip_would_show(causal):
    """Sanity of the comparison itself: treating zero-centred norm weights as plain weights moves the logits."""
    path, hf = causal
    ours = ckpt.load_target(str(path), torch.float32)
    ids = prompt(20, ours.cfg.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        ours.norm.weight.sub_(1.0)          # (1 + w) -> w
        wrong, _ = ours(ids, torch.arange(20))
    assert (wrong - ref).abs().max() > 1e-2


@pytest.mark.parametrize("which", ["causal", "conditional"])
def test_greedy_equals_transformers_generate(which, request):
    path, hf = request.getfixturevalue(which)
    ours = ckpt.load_target(str(path), torch.float32)
    ids = prompt(70, ours.cfg.vocab_size, 5)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    ref = out[0, 70:].tolist()
    res = engine.run(ours, ids[0].tolist(), 30)
    assert res.output_ids == ref


@pytest.fixture(scope="module")
def bf16_checkpoint(causal, tmp_path_factory):
    """The random model stored in bf16, as released checkpoints are, so both sides start from the same values
    (from a float32 file, transformers rounds A_log and dt_bias to bf16 where we keep them in float32)."""
    from transformers import AutoModelForCausalLM
    path = tmp_path_factory.mktemp("hf_bf16")
    AutoModelForCausalLM.from_pretrained(str(causal[0]), dtype=torch.bfloat16).save_pretrained(str(path))
    return path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("T", [40, 150])
def test_bf16_logits_match_transformers_bit_for_bit(bf16_checkpoint, T):
    """bf16, uncached: the same roundings as transformers' torch path, so the same logits bit for bit. T=40 takes
    the short-call conv (kernels.causal_conv1d), which must accumulate in float32 as F.conv1d does; T=150 F.conv1d."""
    path, hf = bf16_checkpoint
    ours = ckpt.load_target(str(path), torch.bfloat16)
    ids = prompt(T, ours.cfg.vocab_size, 5)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        full, _ = ours(ids, torch.arange(T))
    assert full.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(full, ref), (full.float() - ref.float()).abs().max()
