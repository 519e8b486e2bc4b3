"""Kernels against their naive twins, split runs against whole runs, and exact rollback of the GDN state."""
import random

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import kernels
import model as M
from helpers import random_target, tiny_target_config, verify_kernel


# The naive twins: loops written as the maths reads, the spec the fast kernels are checked against.

def naive_gated_delta_rule(q, k, v, g, beta, state):
    """Twin of `recurrent_gated_delta_rule`: loops over batch, head and token, written in the
    matrix form S_t = alpha_t (I - beta_t k k^T) S_{t-1} + beta_t k v^T. Same signature and result."""
    sd = kernels.state_dtype(v.dtype)
    B, T, Hv, dv = v.shape
    dk = q.shape[-1]
    group = Hv // q.shape[2]
    o = torch.zeros(B, T, Hv, dv, dtype=sd, device=v.device)
    states = torch.zeros(B, T, Hv, dk, dv, dtype=sd, device=v.device)
    eye = torch.eye(dk, dtype=sd, device=v.device)
    for b in range(B):
        for h in range(Hv):
            s = state[b, h].to(sd)
            for t in range(T):
                kt = k[b, t, h // group].to(sd)
                qt = q[b, t, h // group].to(sd)
                vt = v[b, t, h].to(sd)
                alpha = torch.exp(g[b, t, h].to(sd))
                bt = beta[b, t, h].to(sd)
                s = alpha * (eye - bt * torch.outer(kt, kt)) @ s + bt * torch.outer(kt, vt)
                o[b, t, h] = s.T @ qt
                states[b, t, h] = s
    return o, states


def naive_causal_conv1d(x, weight, conv_state):
    """Twin of `causal_conv1d`: an explicit sum over the K taps."""
    T, K = x.shape[1], weight.shape[1]
    window = torch.cat([conv_state.to(x.dtype), x], dim=1)
    y = torch.zeros_like(x)
    for i in range(K):
        y = y + window[:, i:i + T] * weight[:, i].to(x.dtype)
    return F.silu(y), window


def gdn_inputs(seed, B, T, Hk, Hv, dk, dv, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, Hk, dk, generator=g, dtype=dtype), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(B, T, Hk, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, Hv, dv, generator=g, dtype=dtype)
    decay = -torch.rand(B, T, Hv, generator=g, dtype=dtype) * 2
    beta = torch.rand(B, T, Hv, generator=g, dtype=dtype)
    s0 = torch.randn(B, Hv, dk, dv, generator=g, dtype=dtype)
    return q, k, v, decay, beta, s0


def all_states(k, writes, g, s0):
    """The state after each token of a recurrent/block call, rebuilt from its writes: [B,T,Hv,dk,dv]."""
    return torch.stack([kernels.state_after(k, writes, g, s0, n) for n in range(1, writes.shape[1] + 1)], 1)


shapes = st.tuples(st.integers(1, 2), st.integers(1, 150), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]),
                   st.sampled_from([4, 8, 16]), st.sampled_from([4, 8, 12]))


@settings(max_examples=30)
@given(shape=shapes, seed=st.integers(0, 1000), chunk=st.sampled_from([8, 16, 64]))
def test_chunked_equals_block_equals_recurrent_equals_naive(shape, seed, chunk):
    B, T, Hk, grp, dk, dv = shape
    T = min(T, 40) if B * Hk * grp > 4 else T          # the naive twin loops in Python: keep it small
    q, k, v, g, beta, s0 = gdn_inputs(seed, B, T, Hk, Hk * grp, dk, dv)
    o_r, writes, last = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    states = all_states(k, writes, g, s0)
    torch.testing.assert_close(last, states[:, -1], rtol=0, atol=1e-12)
    o_n, states_n = naive_gated_delta_rule(q, k, v, g, beta, s0)
    o_c, final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk)
    o_b, writes_b = kernels.block_gated_delta_rule(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], s0)
    torch.testing.assert_close(o_b, o_r[:, :64], rtol=0, atol=1e-10)
    torch.testing.assert_close(writes_b, writes[:, :64], rtol=0, atol=1e-10)
    torch.testing.assert_close(o_r, o_n, rtol=0, atol=1e-12)
    torch.testing.assert_close(states, states_n, rtol=0, atol=1e-12)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, states[:, -1], rtol=0, atol=1e-10)


def test_chunked_equals_recurrent_float32():
    """The float32 noise level of the chunked form (about 1e-6 on outputs of order 1)."""
    q, k, v, g, beta, s0 = gdn_inputs(1, 2, 200, 2, 6, 16, 24, torch.float32)
    o_r, writes, last = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_c, final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert (o_c - o_r).abs().max() < 1e-5 and (final - last).abs().max() < 1e-5


@settings(max_examples=20)
@given(T=st.integers(2, 130), cut=st.integers(1, 129), seed=st.integers(0, 1000))
def test_split_run_equals_whole_run(T, cut, seed):
    cut = min(cut, T - 1)
    q, k, v, g, beta, s0 = gdn_inputs(seed, 1, T, 2, 4, 8, 8)
    o, final = kernels.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o1, s1 = kernels.chunk_gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], s0)
    o2, w2, s2 = kernels.recurrent_gated_delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o, rtol=0, atol=1e-10)
    torch.testing.assert_close(s2, final, rtol=0, atol=1e-10)
    s2_rebuilt = kernels.state_after(k[:, cut:], w2, g[:, cut:], s1, T - cut)
    torch.testing.assert_close(s2_rebuilt, final, rtol=0, atol=1e-10)


@settings(max_examples=20)
@given(T=st.integers(1, 16), extra=st.integers(0, 8), seed=st.integers(0, 1000), data=st.data())
def test_state_after_reads_only_the_committed_rows(T, extra, seed, data):
    """The commit's buffers hold the last call's rows followed by stale rows of an older, longer call (huge
    decays and values included): the state after n tokens (n a device tensor) ignores everything past n."""
    n = data.draw(st.integers(1, T))
    q, k, v, g, beta, s0 = gdn_inputs(seed, 1, T + extra, 2, 4, 8, 8)
    _, writes = kernels.block_gated_delta_rule(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], s0)
    stale_w = torch.cat([writes, 1e30 * torch.ones(1, extra, 4, 8, dtype=writes.dtype)], 1)
    stale_g = torch.cat([g[:, :T], -1e4 * torch.ones(1, extra, 4, dtype=g.dtype)], 1)
    got = kernels.state_after(k, stale_w, stale_g, s0, torch.tensor(n))
    _, states_n = naive_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0)
    torch.testing.assert_close(got, states_n[:, -1], rtol=0, atol=1e-10)


@settings(max_examples=20)
@given(T=st.integers(1, 90), C=st.integers(1, 12), K=st.integers(1, 4), seed=st.integers(0, 1000))   # both paths: T <= 64 and longer
def test_conv_equals_naive_and_splits(T, C, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    state = torch.randn(2, K - 1, C, generator=g, dtype=torch.float64)
    y, win = kernels.causal_conv1d(x, w, state)
    y_n, win_n = naive_causal_conv1d(x, w, state)
    torch.testing.assert_close(y, y_n)
    assert torch.equal(win, win_n)
    # the conv state after n tokens is window rows n .. n+K-2; continuing from it equals the whole run
    n = max(1, T // 2)
    if n == T:
        return
    y1, w1 = kernels.causal_conv1d(x[:, :n], w, state)
    y2, _ = kernels.causal_conv1d(x[:, n:], w, win[:, n:n + K - 1])
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    # zero state == zero left padding (the prefill convention)
    y0, _ = kernels.causal_conv1d(x, w, torch.zeros_like(state))
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), w[:, None], groups=C)).transpose(1, 2)
    torch.testing.assert_close(y0, ref)


def gdn_states(cache):
    return [(l.conv.clone(), l.rec.clone()) for l in cache.layers if isinstance(l, M.GDNCache)]


@settings(max_examples=15)
@given(seed=st.integers(0, 1000), prompt_len=st.integers(1, 90), T=st.integers(1, 16), data=st.data(),
       kernel=st.sampled_from(["block", "recurrent"]))
def test_rolled_back_state_equals_never_seen(seed, prompt_len, T, data, kernel):
    """Verify T tokens (block or recurrent kernel) then commit k == a cache that only ever saw the first k of
    them (one AR decode step at a time)."""
    k = data.draw(st.integers(1, T))
    target = random_target(tiny_target_config(), seed)
    rng = random.Random(seed)
    ids = torch.tensor([[rng.randrange(61) for _ in range(prompt_len + T)]])
    cap = prompt_len + T + 1
    a = M.TargetCache(target.cfg, cap, torch.float64, "cpu")
    b = M.TargetCache(target.cfg, cap, torch.float64, "cpu")
    with torch.no_grad():
        for c in (a, b):
            target(ids[:, :prompt_len], torch.arange(prompt_len), c)
        with verify_kernel(target, kernel):
            target(ids[:, prompt_len:], torch.arange(prompt_len, prompt_len + T), a, verify=True)
        a.commit(torch.tensor(k))
        for t in range(prompt_len, prompt_len + k):
            target(ids[:, t:t + 1], torch.arange(t, t + 1), b)
        for (ca, ra), (cb, rb) in zip(gdn_states(a), gdn_states(b)):
            torch.testing.assert_close(ca, cb, rtol=0, atol=1e-12)
            torch.testing.assert_close(ra, rb, rtol=0, atol=1e-12)
        # and the next token's logits agree (the attention cache's stale entries are invisible)
        nxt = ids[:, prompt_len + k - 1:prompt_len + k]
        la, _ = target(nxt * 0 + 5, torch.tensor([prompt_len + k]), a)
        lb, _ = target(nxt * 0 + 5, torch.tensor([prompt_len + k]), b)
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-10)


def test_prefill_then_decode_equals_full_forward():
    target = random_target(tiny_target_config(), 4)
    ids = torch.randint(0, 61, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = target(ids, torch.arange(100))
        cache = M.TargetCache(target.cfg, 100, torch.float64, "cpu")
        l1, _ = target(ids[:, :70], torch.arange(70), cache)
        outs = [l1]
        for t in range(70, 100):
            l, _ = target(ids[:, t:t + 1], torch.arange(t, t + 1), cache)
            outs.append(l)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-10)


def unit_lower_system(seed, T, batch=(2, 3), dtype=torch.float64):
    """A [*batch, T, T] whose strictly lower triangle is the system's (entries of a GDN block's size) and whose
    diagonal and upper triangle hold large values the solve must not read; B [*batch, T, 5]."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(*batch, T, T, generator=g, dtype=torch.float64) * 0.5
    A = A + torch.ones(T, T, dtype=torch.float64).triu() * 1e3
    return A.to(dtype), torch.randn(*batch, T, 5, generator=g, dtype=torch.float64).to(dtype)


def test_unit_lower_solve_equals_solve_triangular():
    """kernels.unit_lower_solve (the block rule's solve under torch.compile) == torch.linalg.solve_triangular on
    unit-lower-triangular systems of every verify size 1..16 and a whole 64-token block: float64 to rounding,
    float32 within float32's noise of the float64 solution."""
    for T in [*range(1, 17), 64]:
        A, B = unit_lower_system(T, T)
        want = torch.linalg.solve_triangular(A, B, upper=False, unitriangular=True)
        torch.testing.assert_close(kernels.unit_lower_solve(A, B), want, rtol=0, atol=1e-12 * want.abs().max().item())
        got32 = kernels.unit_lower_solve(A.float(), B.float())
        assert got32.dtype == torch.float32
        assert (got32.double() - want).abs().max() <= 1e-5 * want.abs().max(), T


def test_traced_block_rule_takes_the_fused_solve(monkeypatch):
    """Traced by torch.compile (dynamo, run without inductor) the block rule solves with unit_lower_solve, never
    the solver call, and still equals the recurrent rule (float64)."""
    def refuse(A, B):
        raise AssertionError("the traced block rule called torch.linalg.solve_triangular")
    monkeypatch.setattr(torch.linalg, "solve_triangular", refuse)
    torch._dynamo.reset()
    traced = torch.compile(kernels.block_gated_delta_rule, backend="eager", fullgraph=True, dynamic=False)
    for T in (2, 7, 16):
        q, k, v, g, beta, s0 = gdn_inputs(T, 2, T, 2, 4, 8, 8)
        o_r, writes, _ = kernels.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
        o_b, writes_b = traced(q, k, v, g, beta, s0)
        torch.testing.assert_close(o_b, o_r, rtol=0, atol=1e-10)
        torch.testing.assert_close(writes_b, writes, rtol=0, atol=1e-10)
    torch._dynamo.reset()


def naive_attention(q, k, v, mask):
    """Twin of model.attention with a boolean mask: K/V repeated per query head (head h reads kv head h // G), the
    softmax of the masked, scaled scores written out. q [B,Hq,Tq,D]; k, v [B,Hkv,Tk,D]; mask [Tq,Tk] or
    [B,1,Tq,Tk] -> [B,Tq,Hq*D]."""
    B, Hq, Tq, D = q.shape
    G = Hq // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scores = (q @ k.transpose(-1, -2)) * D ** -0.5
    p = scores.masked_fill(~mask, float("-inf")).exp()
    p = p / p.sum(-1, keepdim=True)
    return (p @ v).transpose(1, 2).reshape(B, Tq, Hq * D)


@settings(max_examples=40)
@given(B=st.integers(1, 3), hkv=st.integers(1, 3), G=st.integers(1, 4), Tq=st.integers(1, 9), extra=st.integers(0, 30),
       per_row=st.booleans(), seed=st.integers(0, 1000))
def test_attention_equals_naive_with_heads_folded_or_not(B, hkv, G, Tq, extra, per_row, seed):
    """model.folded_attention (the G query heads of a kv head as G blocks of its query rows: what attention() runs on
    a GPU) and attention() itself (on a CPU: SDPA reading the grouped heads) == the naive twin, float64, for masks
    shared by the rows [Tq,Tk] and one per row [B,1,Tq,Tk], causal over a cache plus random holes."""
    D, Tk = 8, Tq + extra
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, hkv * G, D, dtype=torch.float64, generator=g).transpose(1, 2)     # strided, as a layer's
    k, v = (torch.randn(B, hkv, Tk, D, dtype=torch.float64, generator=g) for _ in range(2))
    pos = extra + torch.arange(Tq) - torch.randint(0, extra + 1, (B if per_row else 1, 1), generator=g)
    mask = (torch.arange(Tk) <= pos[..., None]) & (torch.rand(pos.shape[0], Tq, Tk, generator=g) < 0.7)
    mask[..., 0] = True                                            # every query sees a key
    mask = mask[:, None] if per_row else mask[0]
    want = naive_attention(q, k, v, mask)
    torch.testing.assert_close(M.folded_attention(q, k, v, mask), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(M.attention(q, k, v, mask), want, rtol=0, atol=1e-12)
