"""Noise keyed by position: every random number of a sampled generation is a pure function of (seed, stream,
position, index), never of how many draws came before (docs/method.md#noise-keyed-by-position).

The token that lands at sequence position t is drawn with the Exp(1) noise E(seed, TARGET, t, v) over the
vocabulary v (sampling.draw: argmax over v of p(v) / E(t, v)), whichever step computes it: a plain decode step, a
verify row, prefill. So

- a seed gives one text whatever the step pattern (rounds, plain steps, looks, other requests beside it);
- a verify row draws exactly the token that plain decoding draws at its position, so accepting a proposal iff it
  equals that draw (the coupled rule, engine.Engine._verify) commits AR's own sampled text for the seed, token for token;
- the numbers are the same on a CPU and a GPU, and another engine can reproduce them from the definition below,
  which makes a sampled trace as checkable as a greedy one (check.py reads the trace's `seed`).

The function is a counter-based hash on 32-bit integers, with no generator state, written with int64 tensor ops
that never overflow, so it also runs inside compiled steps (fused with the draw):

    mix32(x)      Chris Wellons' "lowbias32" finalizer (github.com/skeeto/hash-prospector):
                  x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16   (all mod 2^32)
    seed_key(s)   mix32((s mod 2^32) ^ mix32((floor(s / 2^32) mod 2^32) ^ 0x9e3779b9))
    row key       mix32(seed_key ^ mix32(4 t + stream))                    t < 2^30, stream 0..3
    bits(t, v)    mix32(row key ^ mix32(v ^ 0x85ebca6b))                   v: a token id, or 0 for a single number
    U(t, v)       (bits + 0.5) / 2^32, in float64, in (0, 1);   E(t, v) = -ln U(t, v), rounded to float32

Streams: TARGET (0), the target's draw of the token at t; DRAFT (1), a sampled draft's own draw under the ratio
rule (its proposal at t, over the candidate token ids); ACCEPT (2), the ratio rule's uniform for the proposal at t.
A coupled sampled draft (the default) races with the TARGET noise of its position instead.
"""
from __future__ import annotations

import functools

import torch

TARGET, DRAFT, ACCEPT = 0, 1, 2
M32 = 0xFFFFFFFF


def mul32(x, c: int):
    """x * c mod 2^32 for x in [0, 2^32) (an int or an int64 tensor) and a 32-bit constant c, in two 16-bit halves
    of c, so that no product reaches 2^63 (where int64 tensors would wrap, or be undefined in C)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x):
    """lowbias32: a 32-bit integer hash with full avalanche; x an int or an int64 tensor in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """Any Python int seed (negative or wider than 32 bits too) -> its 32-bit key."""
    return mix32((seed & M32) ^ mix32(((seed >> 32) & M32) ^ 0x9E3779B9))


def row_keys(key: torch.Tensor, pos: torch.Tensor, stream: int) -> torch.Tensor:
    """key: a seed_key as a 0-d int64 tensor; pos [R] int64 positions -> their row keys [R] in `stream`."""
    return mix32(key ^ mix32(pos * 4 + stream))


def token_keys(ids: torch.Tensor) -> torch.Tensor:
    """The per-token half of the hash: mix32(v ^ 0x85ebca6b) for int64 token ids (or slots) of any shape."""
    return mix32(ids ^ 0x85EBCA6B)


@functools.lru_cache(maxsize=8)
def _vocab_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    return token_keys(torch.arange(vocab_size, device=device))


def vocab_keys(vocab_size: int, device) -> torch.Tensor:
    """token_keys of the whole vocabulary [V] int64, kept once per vocabulary size and device: half the work of a
    draw's noise. A compiled step reads them as an input (engine.Engine.vocab_keys) rather than hashing the
    vocabulary itself: the same numbers, one of the two hashes per (position, token) left to compile (its code
    generation took most of a sampled step's compile time)."""
    return _vocab_keys(vocab_size, torch.device(device))


def uniforms(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """rows [R] row keys; keys [R, C] or [C] (shared by every row) token_keys -> U(0, 1) float64 [R, C]. Rows of
    any shape [..., R] work alike (a batch of requests: [N, R] -> [N, R, C])."""
    bits = mix32(rows[..., None] ^ keys)
    return (bits.double() + 0.5) * 2.0 ** -32


def _exponentials(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """uniforms(rows, keys) as Exp(1) noise, float32."""
    return (-uniforms(rows, keys).log()).float()


def exponentials(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise float32 [R, C] for rows [R] over token ids [R, C] or [C]: the E of sampling.draw."""
    return _exponentials(rows, token_keys(ids))


def vocab_noise(key: torch.Tensor, pos: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """E(TARGET, t, v) for every token v at each position t of pos [R] -> float32 [R, V]: what draws the token
    that lands at t; vocab: vocab_keys(V, device). A batch of requests, each with its own seed: key [N, 1],
    pos [N, R] -> [N, R, V]."""
    return _exponentials(row_keys(key, pos, TARGET), vocab)


def accept_uniforms(key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """U(ACCEPT, t, 0) for the proposals at positions pos [R] -> float64 [R] (the ratio rule's test). A batch of
    requests: key [N, 1], pos [N, R] -> [N, R]."""
    return uniforms(row_keys(key, pos, ACCEPT), token_keys(torch.zeros(1, dtype=torch.long, device=pos.device)))[..., 0]
