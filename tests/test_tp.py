"""tp.py's shard maths: each layer cut into `world` parts as the engines cut it, the parts' outputs summed (what an
all-reduce does) == the whole layer's, in float64, through prefill, a verify block, its rollback and decode steps,
with each part keeping its own heads' caches."""
import pytest
import torch

import model as M
import tp
from helpers import random_target, tiny_target_config



def gdn_cache(layer: M.GatedDeltaNet, max_block: int = 8) -> M.GDNCache:
    z = lambda *s: torch.zeros(1, *s, dtype=torch.float64)
    K1 = layer.kernel - 1
    return M.GDNCache(z(K1, layer.conv_dim), z(layer.hv, layer.dk, layer.dv), z(max_block, layer.hk, layer.dk),
                      z(max_block, layer.hv, layer.dv), z(max_block, layer.hv), z(K1 + max_block, layer.conv_dim))


def summed(parts, call):
    return sum(call(p, i) for i, p in enumerate(parts))


@pytest.mark.parametrize("cfg_kw", [{}, dict(linear_num_key_heads=4, linear_num_value_heads=8)])
def test_sharded_gdn_equals_the_layer(cfg_kw):
    """Prefill 11 tokens, verify a block of 6, keep 4 of it, then 3 decode steps: every output of the summed parts
    == the whole layer's, each part rolling back its own heads' states."""
    target = random_target(tiny_target_config(**cfg_kw), 3)
    layer = next(l.linear_attn for l in target.layers if l.layer_type == "linear_attention")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, t, target.cfg.hidden_size, generator=g, dtype=torch.float64) for t in (11, 6, 1, 1, 1)]
    for world in [w for w in (2, 4) if layer.hk % w == 0]:
        parts = [tp.shard_gdn(layer, r, world) for r in range(world)]
        assert all(p.hk == layer.hk // world and p.hv == layer.hv // world for p in parts)
        whole_cache, caches = gdn_cache(layer), [gdn_cache(p) for p in parts]
        with torch.no_grad():
            for step, x in enumerate(xs):
                verify = step == 1
                want = layer(x, whole_cache, verify)
                got = summed(parts, lambda p, i: p(x, caches[i], verify))
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
                if verify:
                    whole_cache.commit(4)
                    for c in caches:
                        c.commit(4)
            torch.testing.assert_close(torch.cat([c.rec for c in caches], 1), whole_cache.rec, rtol=0, atol=1e-12)
        assert layer(xs[0], None).shape == xs[0].shape               # the whole layer is untouched


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_attention_equals_the_layer(world):
    """4 query heads, 2 KV heads: at degree 2 the KV heads are split, at 4 each rank holds the one its heads read."""
    target = random_target(tiny_target_config(), 4)
    layer = next(l.self_attn for l in target.layers if l.layer_type == "full_attention")
    parts = [tp.shard_attention(layer, r, world) for r in range(world)]
    assert all(p.nh == layer.nh // world and p.nkv == max(1, layer.nkv // world) for p in parts)
    cap, H = 32, target.cfg.hidden_size
    caches = [M.AttnCache(*(torch.zeros(1, p.nkv, cap, layer.hd, dtype=torch.float64) for _ in range(2))) for p in parts]
    whole = M.AttnCache(*(torch.zeros(1, layer.nkv, cap, layer.hd, dtype=torch.float64) for _ in range(2)))
    g = torch.Generator().manual_seed(1)
    start = 0
    with torch.no_grad():
        for T in (9, 5, 1):
            pos = torch.arange(start, start + T)
            x = torch.randn(1, T, H, generator=g, dtype=torch.float64)
            cos, sin = target.rope(pos, x.dtype)
            mask = M.DenseMasks(cap).target(pos)
            want = layer(x, cos, sin, pos, mask, whole)
            got = summed(parts, lambda p, i: p(x, cos, sin, pos, mask, caches[i]))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            start += T


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_mlp_equals_the_mlp(world):
    target = random_target(tiny_target_config(), 5)
    mlp = target.layers[0].mlp
    x = torch.randn(1, 7, target.cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        got = summed([tp.shard_mlp(mlp, r, world) for r in range(world)], lambda p, i: p(x))
        torch.testing.assert_close(got, mlp(x), rtol=0, atol=1e-12)


def test_an_indivisible_head_count_is_one_line():
    target = random_target(tiny_target_config(), 6)
    gdn = next(l.linear_attn for l in target.layers if l.layer_type == "linear_attention")
    attn = next(l.self_attn for l in target.layers if l.layer_type == "full_attention")
    with pytest.raises(M.GenerationError, match="degree 3 does not divide the 2 GDN key heads") as e:
        tp.shard_gdn(gdn, 0, 3)
    assert "\n" not in str(e.value)
    with pytest.raises(M.GenerationError, match="degree 3 does not divide the 4 attention heads"):
        tp.shard_attention(attn, 0, 3)
    with pytest.raises(M.GenerationError, match="degree 5 does not divide the 48 MLP intermediate channels"):
        tp.shard_mlp(target.layers[0].mlp, 0, 5)
