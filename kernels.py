"""Kernels of the Gated DeltaNet layer. Each is tested against a naive twin written as the maths reads
(tests/test_kernels.py).

Glossary (code name -> symbol in the Gated DeltaNet paper, Yang et al. 2024; docs/qwen35.md#gated-deltanet):
    q, k        q̂_t, k̂_t  L2-normalised query and key (q already scaled by dk**-0.5)
    v           v_t        value
    g           g_t        log decay, g <= 0; the state is multiplied by alpha_t = exp(g_t)
    beta        β_t        write strength in (0, 1)
    state       S          [dk, dv] per value head, always float32 (or float64 in float64 runs)
    Hk, Hv      key heads and value heads; value head h reads key head h // (Hv // Hk)

Shapes at every boundary:
    q, k   [B, T, Hk, dk]      v [B, T, Hv, dv]      g, beta [B, T, Hv]
    state  [B, Hv, dk, dv]     o [B, T, Hv, dv]      writes  [B, T, Hv, dv]      states [B, T, Hv, dk, dv]

The delta rule per token: S' = alpha S; e = beta (v - S'^T k); S = S' + k e^T; o = S^T q.
The output reads the UPDATED state, so the current token sees itself. `e` is the token's WRITE: unrolled,
    S_t = e^gamma_t S_0 + sum_{j <= t} e^(gamma_t - gamma_j) k_j e_j^T,      gamma_t = g_1 + ... + g_t
so the state after ANY prefix of a call follows from (k, writes, g) and the state before the call.

Why these forms: the chunked form (many tokens, few sequential steps) runs prefill; the recurrent form (one
token at a time) and the block form (one chunk in closed form) run decode and verify and return the writes
instead of a state. Nothing is final until the commit: `state_after(k, writes, g, S_0, n)` builds the state
after the n-th token, which is what makes rollback after a partial acceptance exact and cheap (one small
matmul per layer, and no [T, dk, dv] per-token state is ever stored; see model.TargetCache.commit).
The block form's unit-lower-triangular solve, traced by torch.compile, is forward substitution in elementwise ops
(unit_lower_solve), which inductor fuses; eager it is one torch.linalg.solve_triangular call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


SHORT_CALL = 64      # calls of at most this many tokens (decode, verify) take the small-call conv path


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The one precision rule: recurrent states (and norms, and the GDN decay parameters) are computed in
    float32, or in float64 when the whole model runs in float64 (the exact mode)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_value_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[B,T,Hk,d] -> [B,T,Hv,d]: key heads shared by groups of value heads, value head h uses key head
    h // group (repeat_interleave, not tile)."""
    group = hv // x.shape[2]
    return x.repeat_interleave(group, dim=2) if group > 1 else x


# --------------------------------------------------------------------------------------------------
# Recurrent form: one token at a time; the commit rebuilds the state from the writes.
# --------------------------------------------------------------------------------------------------

def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Vectorised over batch and heads, sequential over T.

    q, k [B,T,Hk,dk]; v [B,T,Hv,dv]; g, beta [B,T,Hv]; state [B,Hv,dk,dv]
    -> o [B,T,Hv,dv], writes [B,T,Hv,dv] (e_t of each token), final [B,Hv,dk,dv] (the state after the last
    token: what an AR decode step keeps at once); all in the state dtype."""
    sd = state_dtype(v.dtype)
    q, k = _to_value_heads(q, v.shape[2]), _to_value_heads(k, v.shape[2])
    q, k, v, g, beta = (x.to(sd) for x in (q, k, v, g, beta))
    s = state.to(sd)
    outs, writes = [], []
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[..., None, None]                        # S' = alpha S
        kv = torch.einsum("bhkv,bhk->bhv", s, k[:, t])                # S'^T k
        e = (v[:, t] - kv) * beta[:, t, :, None]                      # e = beta (v - S'^T k)
        s = s + k[:, t, :, :, None] * e[:, :, None, :]                # S = S' + k e^T
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))        # o = S^T q
        writes.append(e)
    return torch.stack(outs, 1), torch.stack(writes, 1), s


def state_after(k, writes, g, state, n):
    """The state after the first n tokens of a recurrent or block call (1 <= n <= T), from its writes:
        S_n = e^gamma_n S_0 + sum_{j <= n} e^(gamma_n - gamma_j) k_j e_j^T      (1-based token index)
    k [B,T,Hk,dk]; writes [B,T,Hv,dv]; g [B,T,Hv]; state [B,Hv,dk,dv] (S_0, the state before the call);
    n an int or a 0-d LongTensor (on the device: no host sync), or [B] (each row its own) -> [B,Hv,dk,dv] in the
    state dtype.
    Rows past T may hold anything (a stale, longer call): only rows j < n are read."""
    sd = state_dtype(writes.dtype)
    k = _to_value_heads(k, writes.shape[2])
    T = writes.shape[1]
    gamma = g.to(sd).cumsum(1)                                        # [B,T,Hv]
    n = torch.as_tensor(n, device=gamma.device).reshape(-1)          # [1] (every row) or [B] (each row its own)
    gamma_n = gamma.gather(1, (n - 1).view(-1, 1, 1).expand(gamma.shape[0], 1, gamma.shape[2]))   # [B,1,Hv]
    keep = (torch.arange(T, device=gamma.device) < n[:, None])[..., None]                           # [1 or B,T,1]
    # e^(gamma_n - gamma_j) for j < n; rows j >= n get exp(-inf) = 0 (their exponent could overflow)
    w = torch.where(keep, gamma_n - gamma, float("-inf")).exp()       # [B,T,Hv]
    return (gamma_n[:, 0].exp()[..., None, None] * state.to(sd)
            + torch.einsum("bth,bthk,bthv->bhkv", w, k.to(sd), writes))


# --------------------------------------------------------------------------------------------------
# Chunked form: the same maths, C tokens per sequential step (docs/qwen35.md#gated-deltanet).
# --------------------------------------------------------------------------------------------------

def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """q, k [B,T,Hk,dk]; v [B,T,Hv,dv]; g, beta [B,T,Hv]; state [B,Hv,dk,dv]
    -> o [B,T,Hv,dv] (state dtype), final state [B,Hv,dk,dv].

    Per chunk, with gamma = cumsum(g) and D_ij = exp(gamma_i - gamma_j) for j <= i:
        A  = strict_lower((beta K K^T) * D)          T = (I + A)^-1 (unit lower-triangular solve)
        U  = T (beta V)                              W = T (beta e^gamma K)
        V' = U - W S                                 O = (e^gamma Q) S + ((Q K^T) * D) V'
        S <- e^gamma_last S + (e^(gamma_last - gamma) K)^T V'
    The tail is padded with g = 0, beta = 0, k = v = 0: such a token neither decays nor writes."""
    sd = state_dtype(v.dtype)
    B, T, Hv, dv = v.shape
    q, k = _to_value_heads(q, Hv), _to_value_heads(k, Hv)
    C = chunk_size
    pad = (-T) % C
    # [B, H, T, d] in the state dtype, padded to a multiple of C, then split into N chunks of C.
    q, k, v = (F.pad(x.to(sd).transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.to(sd).transpose(1, 2), (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    q, k, v = (x.reshape(B, Hv, N, C, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, Hv, N, C) for x in (g, beta))

    gamma = g.cumsum(-1)                                             # [B,H,N,C]
    lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    diff = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf"))
    D = diff.exp()                                                   # [B,H,N,C,C], 0 above the diagonal
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * D                               # diagonal ignored by the unit solve
    U = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * D
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]             # [B,H,N,1,1]

    s = state.to(sd)
    outs = []
    for n in range(N):
        v_new = U[:, :, n] - W[:, :, n] @ s                          # V' = U - W S
        outs.append(q_decayed[:, :, n] @ s + QK[:, :, n] @ v_new)
        s = chunk_decay[:, :, n] * s + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(B, Hv, N * C, dv)[:, :, :T].transpose(1, 2)
    return o, s


def unit_lower_solve(A, B):
    """X = (I + L)^-1 B, L the strictly lower triangle of A (A's diagonal and upper triangle are not read, as
    torch.linalg.solve_triangular(A, B, upper=False, unitriangular=True) does not read them).
    A [..., T, T]; B [..., T, d] -> X [..., T, d].

    (I + L)^-1 by forward substitution by columns on the identity: once row j of the result is final, L[i, j] times
    it is taken from every row i (a zero for rows i <= j, L being strictly lower), which makes row j + 1 final.
    Then one batched matmul with B. The T - 1 steps are elementwise ops on [..., T, T], no solver call, so inductor
    fuses them; substituting on B itself would be the same steps on [..., T, d], d / T times the work."""
    T = A.shape[-1]
    L = A.tril(-1)
    inv = torch.eye(T, dtype=A.dtype, device=A.device).expand_as(A)
    for j in range(T - 1):
        inv = inv - L[..., :, j:j + 1] * inv[..., j:j + 1, :]          # rows > j lose L[i, j] times row j
    return inv @ B


def block_gated_delta_rule(q, k, v, g, beta, state):
    """The verify kernel: the chunked maths for ONE chunk of T tokens (T = the verify block, <= 64), with the
    signature of `recurrent_gated_delta_rule` and its first two results (o and the writes V' = U - W S_0).
    A handful of batched matmuls instead of T sequential steps: on a GPU or a CPU running small models,
    the sequential loop is what makes a verify step cost more than a decode step."""
    sd = state_dtype(v.dtype)
    B, T, Hv, dv = v.shape
    q, k = _to_value_heads(q, Hv), _to_value_heads(k, Hv)
    q, k, v = (x.to(sd).transpose(1, 2) for x in (q, k, v))          # [B,H,T,d]
    g, beta = (x.to(sd).transpose(1, 2) for x in (g, beta))          # [B,H,T]
    s0 = state.to(sd)
    gamma = g.cumsum(-1)
    lower = torch.ones(T, T, dtype=torch.bool, device=v.device).tril()
    D = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()   # [B,H,T,T]
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * D
    # U = T (beta V) and W = T (beta e^gamma K), one triangular solve over both right-hand sides: traced by torch.compile
    # as elementwise steps inductor fuses; eager as one solver call, which costs less than those steps one by one
    rhs = torch.cat([v * beta[..., None], kb * gamma.exp()[..., None]], -1)
    UW = (unit_lower_solve(A, rhs) if torch.compiler.is_compiling()
          else torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True))
    U, W = UW.split([dv, k.shape[-1]], dim=-1)
    v_new = U - W @ s0                                               # V' [B,H,T,dv]: the writes
    o = (q * gamma.exp()[..., None]) @ s0 + ((q @ k.transpose(-1, -2)) * D) @ v_new
    return o.transpose(1, 2), v_new.transpose(1, 2)


# --------------------------------------------------------------------------------------------------
# Causal depthwise convolution with a carried window.
# --------------------------------------------------------------------------------------------------

def causal_conv1d(x, weight, conv_state):
    """u_t = silu(sum_i weight[:, i] * c_{t-K+1+i}); tap K-1 multiplies the current token.

    x [B,T,C] pre-conv inputs c; weight [C,K]; conv_state [B,K-1,C] the K-1 previous inputs, oldest first
    -> u [B,T,C], window [B,K-1+T,C] = cat(conv_state, x). Rows n..n+K-2 of the window are the conv
    state after the first n tokens of x, which is how a partial acceptance is committed.
    Decode and verify (a few tokens) take the K taps as one multiply-sum over a sliding view of the window,
    which avoids F.conv1d's per-call overhead on such small inputs; prefill keeps F.conv1d, whose memory stays
    O(T C) where the sliding view's product would be O(T C K). The multiply-sum runs in float32 (float64 in a
    float64 run) and rounds once, as F.conv1d accumulates: in bfloat16 every tap would round."""
    T, K = x.shape[1], weight.shape[1]
    window = torch.cat([conv_state.to(x.dtype), x], dim=1)
    if T <= SHORT_CALL:
        acc = state_dtype(x.dtype)
        y = (window.unfold(1, K, 1).to(acc) * weight.to(acc)).sum(-1).to(x.dtype)   # [B,T,C,K] -> [B,T,C]
    else:
        y = F.conv1d(window.transpose(1, 2), weight[:, None, :].to(x.dtype), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y), window
