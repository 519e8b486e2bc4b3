"""The DFlash draft-verify loop (greedy, exactly lossless) and plain autoregressive decoding through the
same caches, which is the baseline it must equal token for token.

One round (notes 2), with `start` = position of the last committed token `last`:
    draft    the drafter reads the target features of the tokens committed since its last call, then
             proposes block_size - 1 tokens for the block [last, MASK, ...] at positions start .. start+B-1
    verify   the target runs [last, proposals] at those positions (GDN keeps each token's state write)
    accept   posterior = argmax(logits); accepted = leading proposals equal to posterior[:-1];
             bonus = posterior[accepted]; committed = proposals[:accepted] + [bonus], cut at a stop token
             or at max_new_tokens
    commit   TargetCache.commit(len(committed)): the GDN states are built from the state before the verify
             and the writes of the committed tokens only (exact rollback); stale attention K/V are masked and
             later overwritten
    features the verify pass's features at the committed positions feed the next draft

A proposer is anything with `max_block_size`, `feature_layers` (target layers whose outputs it reads),
`reset(capacity)` (a new sequence begins), `prefill(feats, pos)` (the prompt's features) and
`propose(last, start, feats, feat_pos, n)`; the real one
wraps the DFlash drafter, and tests use stand-ins that offer known continuations with corruptions.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

import kernels
import model as M
from model import AttnCache, DFlashDrafter, DraftCache, GDNCache, Qwen35, TargetCache


class GenerationError(ValueError):
    """Bad generation input; the message names the problem and the fix."""


# Attention backends of the cached steps. "sdpa": F.scaled_dot_product_attention with a boolean mask built
# per call (cheap elementwise ops). "flex": FlexAttention with BlockMasks built once per Engine and sliced per
# step (model.causal_block_mask / draft_block_mask); compiled on CUDA it skips the key tiles a step cannot see.
# SDPA is the default everywhere: on CPU, eager flex_attention runs an unfused reference path that
# materialises the scores (measured here: ~4 ms against ~0.06 ms for SDPA per tiny call), and on CUDA flex
# has not been measured against SDPA yet (bench_gpu.sh times both); switch the default when it wins there.
ATTENTION = ("sdpa", "flex")


@dataclass
class Step:
    """One event of a generation, in order. kind: "prefill" (commits the first token), "verify" (one
    draft-verify round) or "decode" (one AR step)."""
    kind: str
    start: int                                  # position of the last committed token before this step
    tokens: list                                # tokens committed by this step
    draft_ids: list = field(default_factory=list)   # proposals offered (verify only)
    accepted: int = 0                           # leading proposals the target agreed with (verify only)
    stop: bool = False                          # generation ends after this step
    draft_seconds: float = 0.0                  # wall time of the draft forward (verify steps)
    verify_seconds: float = 0.0                 # wall time of the target forward + accept + commit


@dataclass
class Result:
    prompt_ids: list
    output_ids: list                            # generated ids, the first (from prefill) included
    acceptance_lengths: list                    # tokens committed per verify step, bonus included
    draft_ids: list                             # each verify step's proposals
    steps: list
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0                 # everything after the first token

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def histogram(self, block_size: int) -> list:
        """counts[k-1] = verify steps that committed k tokens, k = 1..block_size."""
        counts = [0] * block_size
        for a in self.acceptance_lengths:
            counts[a - 1] += 1
        return counts


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (the exact path above). Otherwise tokens are drawn from the target's
    distribution at `temperature`, restricted to the top_k most likely tokens (0 = all) and to the smallest
    set whose probability reaches top_p (1 = all)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 = no limit), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are drawn from, float32 [..., V] (temperature, top-k, top-p)."""
    x = logits.float() / s.temperature
    V = x.shape[-1]
    if 0 < s.top_k < V:
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.top_p < 1:
        ps, order = p.sort(dim=-1, descending=True)
        drop = (ps.cumsum(-1) - ps) >= s.top_p          # keep up to and including the token that reaches top_p
        ps = ps.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, ps)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(probs: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [..., V] given Exp(1) noise of the same shape: argmax(p / E) is distributed
    as Categorical(p / sum(p)) (the exponential race; gpt-fast's sync-free sampling). Zero-probability tokens
    can never win."""
    return (probs / expo.clamp_min(1e-30)).argmax(-1)


def speculative_accept(probs: torch.Tensor, proposals: torch.Tensor, u: torch.Tensor, expo: torch.Tensor):
    """Speculative rejection sampling for a verify block, on the device, no host sync.

    probs [B, V] target distributions at block positions 0..B-1 (row i judges proposals[i]);
    proposals [B-1]; u [B-1] uniform(0,1) draws; expo [B, V] Exp(1) noise -> (accepted [], tokens [B]):
    the committed tokens are proposals[:accepted] + [tokens[accepted]].

    The greedy draft is treated as a one-hot proposal q (notes 4): proposal x is accepted with probability
    min(1, p(x) / q(x)) = p(x); on rejection the token comes from normalize(max(p - q, 0)), which is p with x
    removed; after a full acceptance the bonus comes from p at the last row. The output distribution equals
    the target's exactly, the drafter needs no probabilities of its own, and acceptance is higher than with
    independently sampled draft tokens (z-lab PR #169). `u < p(x)` is strict, so a zero-probability
    proposal is never accepted, even when u is exactly 0 (an SGLang bug)."""
    p_prop = probs[:-1].gather(1, proposals[:, None]).squeeze(1)                 # [B-1]
    accepted = (u < p_prop).int().cumprod(0).sum()
    resid = torch.cat([probs[:-1].scatter(1, proposals[:, None], 0.0), probs[-1:]])
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, probs)          # p one-hot at x: never rejected
    return accepted, draw(resid, expo)


class DrafterProposer:
    """The real proposer: the DFlash drafter with its context cache, sharing the target's embedding and lm_head."""

    def __init__(self, drafter: DFlashDrafter, target: Qwen35, window: int | None = None):
        """window: let each draft see only the last `window` committed positions (None = all)."""
        if window is not None and window < 1:
            raise GenerationError(f"--draft-window must be >= 1, got {window}")
        self.drafter, self.target, self.window = drafter, target, window
        self.cache = None
        self.attention, self.block = "sdpa", None     # set by the Engine that uses this proposer
        self._mask_key = None            # (capacity, attention, block) the cache's draft BlockMask was built for

    @property
    def max_block_size(self) -> int:
        return self.drafter.cfg.block_size

    @property
    def feature_layers(self) -> tuple:
        return tuple(self.drafter.cfg.target_layer_ids)

    def reset(self, capacity: int) -> None:
        if self.cache is None or self.cache.layers[0].k.shape[2] != capacity:
            w = self.drafter.fc.weight
            self.cache = DraftCache(self.drafter.cfg, capacity, w.dtype, w.device)
        key = (capacity, self.attention, self.block or self.max_block_size)
        if self._mask_key != key:        # built once per cache, backend and block size, not per generation
            bm = None
            if self.attention == "flex":
                bm = M.draft_block_mask(capacity, key[2], self.window, self.drafter.fc.weight.device)
            for layer in self.cache.layers:
                layer.block_mask = bm
            self._mask_key = key

    def prefill(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """The prompt's features [1,T0,F] at positions pos [T0] into the context cache (once per generation)."""
        self.drafter.append_context(feats, pos, self.cache)

    def propose(self, last: torch.Tensor, start: torch.Tensor, feats: torch.Tensor, feat_pos: torch.Tensor, n: int) -> torch.Tensor:
        """last [1] token at position start [1]; feats [1,Tc,F] target features at feat_pos [Tc] not seen yet
        (rows at positions >= start are ignored) -> [n] greedy proposals for positions start+1 .. start+n.
        All shapes are fixed for a given block size, so this compiles to one graph."""
        cfg = self.drafter.cfg
        block = torch.cat([last.view(1), torch.full((n,), cfg.mask_token_id, dtype=torch.long, device=last.device)])[None]
        emb = self.target.embed_tokens(block)
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        pos = start.view(1) + torch.arange(n + 1, device=last.device)
        hidden = self.drafter(emb, feats, pos, feat_pos, self.cache, window=self.window, block_start=start.view(-1)[0])
        return self.drafter.draft_logits(hidden[0, 1:], self.target.lm_head).argmax(-1)


def check_block_size(block_size: int, proposer=None) -> None:
    if block_size < 1:
        raise GenerationError(f"block size must be >= 1, got {block_size}")
    if proposer is not None and block_size > proposer.max_block_size:
        raise GenerationError(f"block size {block_size} exceeds the drafter's block_size {proposer.max_block_size}; "
                              f"use --block-size {proposer.max_block_size} or less")


def check_inputs(target: Qwen35, prompt_ids: list, max_new_tokens: int, block_size: int, capacity: int | None,
                 proposer=None) -> int:
    """Validate a request; return the cache capacity to allocate."""
    V = target.cfg.vocab_size
    if not prompt_ids:
        raise GenerationError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < V]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{V - 1}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_block_size(block_size, proposer)
    # The last verify block starts at most at position len(prompt) + max_new_tokens - 2 and spans block_size.
    need = len(prompt_ids) + max_new_tokens + block_size - 1
    if capacity is None:
        capacity = need
    if need > capacity:
        raise GenerationError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + block slack ({block_size - 1}) "
                              f"= {need} exceeds the cache length {capacity}; raise --cache-len or shorten the request")
    if len(prompt_ids) + max_new_tokens > target.cfg.max_position_embeddings:
        raise GenerationError(f"prompt + max_new_tokens = {len(prompt_ids) + max_new_tokens} exceeds the model's "
                              f"max_position_embeddings {target.cfg.max_position_embeddings}; shorten the request")
    return capacity


def _no_c_shim_note(record: logging.LogRecord) -> bool:
    """Drops inductor's note that an op (here linalg_solve_triangular) has no C shim in the C++ wrapper and
    runs through its proxy executor: expected and harmless, but printed on every CPU compilation."""
    return "missing a c-shim implementation" not in record.getMessage()


def mark_static_(cache) -> None:
    """Mark every tensor of a TargetCache / DraftCache as a static address for torch.compile. On CUDA the
    compiled steps replay as CUDA graphs (cudagraph trees), which run a graph that writes one of its inputs in
    place only when that input is static; otherwise they skip the graph and launch kernel by kernel. Every
    step writes the caches in place, so they are marked; unguarded, since cudagraph trees re-record a graph
    whose static input moved (a cache reallocated for another capacity)."""
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t, guard=False)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _clock(device, profile: bool) -> float:
    """Wall clock for per-step timings; on CUDA it syncs only when profiling (a sync per step costs speed)."""
    if profile:
        _sync(device)
    return time.perf_counter()


class Engine:
    """One target (and optionally a proposer) with caches allocated once for `capacity` positions and the
    fixed-shape step functions, eager or compiled with torch.compile(fullgraph=True, dynamic=False):
        decode_step  (tok [1,1], pos [1])              -> logits [V]               AR; commits its token
        verify_step  (block [1,B], pos [B])            -> posterior [B], accepted [], feats [1,B,F]
        draft_step   (last [1], start [1], feats [1,B,F], feat_pos [B]) -> proposals [B-1]
        commit       (n [])                            -> GDN states after the n-th block token
    Everything that varies per step is a device tensor, so after warm-up nothing recompiles. Prefill (one
    call per prompt, any length) stays eager."""

    def __init__(self, target: Qwen35, proposer=None, block_size: int = 16, capacity: int = 2048,
                 compile_mode: str | None = None, verify_gdn: str = "block", attention: str = "sdpa"):
        """attention: "sdpa" or "flex" (see ATTENTION); with "flex" the target's causal BlockMask and the
        drafter's are built here, once, over the static caches."""
        if attention not in ATTENTION:
            raise GenerationError(f"attention must be one of {ATTENTION}, not {attention!r}")
        if proposer is None:
            block_size = 1
        check_block_size(block_size, proposer)
        self.target, self.proposer, self.block, self.capacity = target, proposer, block_size, capacity
        self.verify_gdn, self.compiled = verify_gdn, compile_mode is not None
        self.device = target.embed_tokens.weight.device
        self._graphs = self.compiled and self.device.type == "cuda"          # compiled steps may replay CUDA graphs
        dtype = target.embed_tokens.weight.dtype
        self.cache = TargetCache(target.cfg, capacity, dtype, self.device, max_block=block_size)
        self.attention = attention
        if attention == "flex":             # one mask shared by every attention layer (they see the same positions)
            bm = M.causal_block_mask(capacity, self.device)
            for layer in self.cache.layers:
                if isinstance(layer, AttnCache):
                    layer.block_mask = bm
        self.feature_layers = tuple(proposer.feature_layers) if proposer is not None else ()
        if isinstance(proposer, DrafterProposer):
            proposer.attention, proposer.block = attention, block_size
        if proposer is not None:
            proposer.reset(capacity)
        if self._graphs:                     # CUDA graphs may write the cache in place (mark_static_); the
            mark_static_(self.cache)         # drafter's is marked in generate, after its reset
        self.sampling = Sampling()
        # RoPE position = cache position + rope_delta for every token after a prompt with images (vision.py);
        # 0 for text. A device tensor set per generation, so compiled steps read it instead of recompiling.
        self.rope_delta = torch.zeros((), dtype=torch.long, device=self.device)
        self._host = None                    # pinned host buffer of _upload (CUDA)
        self.decode_step, self.verify_step, self.commit = self._decode, self._verify, self.cache.commit
        self.verify_sample_step = self._verify_sample
        self.draft_step = proposer.propose if proposer is not None else None
        if compile_mode is not None:
            # The mode's inductor options, plus on a CPU a C++ wrapper around each compiled step instead of
            # inductor's Python one: these steps are small graphs, and the wrapper's per-kernel Python calls
            # were a third of a compiled verify step here (3.1 -> 2.2 ms, draft 0.63 -> 0.49 ms).
            from torch._inductor import list_mode_options
            options = dict(list_mode_options(compile_mode, False))
            if self.device.type == "cpu":
                options["cpp_wrapper"] = True
                options.pop("triton.cudagraphs", None)      # max-autotune's CUDA graphs: nothing to capture on a CPU
                logging.getLogger("torch._inductor.ir").addFilter(_no_c_shim_note)
                kernels.lower_onednn_linear()                # oneDNN products called directly (kernels.py)
            opts = dict(options=options, fullgraph=True, dynamic=False)
            self.decode_step = torch.compile(self._decode, **opts)
            self.verify_step = torch.compile(self._verify, **opts)
            self.commit = torch.compile(self.cache.commit, **opts)
            self.verify_sample_step = torch.compile(self._verify_sample, **opts)
            if isinstance(proposer, DrafterProposer):
                self.draft_step = torch.compile(proposer.propose, **opts)

    def _decode(self, tok, pos):
        logits, _ = self.target(tok, pos, self.cache, "decode", rope_pos=pos + self.rope_delta)
        return logits[0, -1]

    def _verify(self, block, pos):
        logits, feats = self.target(block, pos, self.cache, self.verify_gdn, self.feature_layers, rope_pos=pos + self.rope_delta)
        posterior = logits[0].argmax(-1)                                               # [B]
        accepted = (block[0, 1:] == posterior[:-1]).int().cumprod(0).sum()            # leading matches
        return posterior, accepted, feats

    def _verify_sample(self, block, pos, u, expo):
        logits, feats = self.target(block, pos, self.cache, self.verify_gdn, self.feature_layers, rope_pos=pos + self.rope_delta)
        accepted, tokens = speculative_accept(sampling_probs(logits[0], self.sampling), block[0, 1:], u, expo)
        return tokens, accepted, feats

    def reset(self) -> None:
        """A new sequence: zero the GDN states (prefill starts from S = 0). Attention K/V and the drafter's
        context need nothing: entries past the new prompt are masked until overwritten."""
        for layer in self.cache.layers:
            if isinstance(layer, GDNCache):
                layer.conv.zero_()
                layer.rec.zero_()

    @torch.inference_mode()
    def generate(self, prompt_ids: list, max_new_tokens: int, stop_ids=(), profile: bool = False,
                 sampling: Sampling | None = None, generator: torch.Generator | None = None,
                 images=None) -> Iterator[Step]:
        """Generation as a stream of Steps ("prefill", then "verify" rounds or AR "decode" steps).
        sampling None or temperature 0: greedy. Otherwise random draws come from `generator` (a torch.Generator
        on the device; a fresh unseeded one if None).
        profile: synchronise the device around each phase so Step's timings are exact (CUDA).
        images: a vision.ImagePrompt for prompt_ids (already expanded: ImagePrompt.ids): prefill puts the image
        tokens in place of the <|image_pad|> embeddings and uses its 3-D positions; later tokens add its
        rope_delta. The drafter sees the images only through the target's features, at 1-D positions."""
        if images is not None and list(images.ids) != list(prompt_ids):
            raise GenerationError("prompt_ids must be the ImagePrompt's expanded ids (vision.encode_images)")
        check_inputs(self.target, prompt_ids, max_new_tokens, self.block, self.capacity, self.proposer)
        device, B, stops = self.device, self.block, set(stop_ids)
        s = sampling or Sampling()
        if not s.greedy:
            self.sampling = s                 # a constant of the compiled sampling step (a change recompiles)
            gen = generator or torch.Generator(device=device)
            V = self.target.cfg.vocab_size

            def pick(logits):                 # one token from logits [V], on the device
                return draw(sampling_probs(logits, s), torch.empty(V, device=device).exponential_(generator=gen))
        use_draft = self.proposer is not None        # block_size 1 with a drafter: verify steps without proposals
        M.pack_for_cpu_(self.target)                 # float32 CPU: oneDNN copies of the weights (kernels.py)
        if isinstance(self.proposer, DrafterProposer):
            M.pack_for_cpu_(self.proposer.drafter)
        self.reset()
        if use_draft:
            self.proposer.reset(self.capacity)       # a new sequence begins (cheap: caches are kept when they fit)
            if self._graphs and isinstance(self.proposer, DrafterProposer):
                mark_static_(self.proposer.cache)    # (re)allocated by reset when another Engine resized it

        # Prefill: the whole prompt, GDN chunked from a zero state; the first token is the argmax of the last logits.
        T0 = len(prompt_ids)
        pos = torch.arange(T0, device=device)
        self.rope_delta.fill_(0 if images is None else images.rope_delta)
        logits, feats = self.target(torch.tensor([prompt_ids], device=device), pos, self.cache, "chunked",
                                    self.feature_layers, last_logits_only=True,
                                    rope_pos=None if images is None else images.rope_pos,
                                    image_embeds=None if images is None else images.embeds)
        first = int(logits[0, -1].argmax() if s.greedy else pick(logits[0, -1]))
        n_out = 1
        stop = first in stops or n_out >= max_new_tokens
        yield Step("prefill", T0 - 1, [first], stop=stop)
        start = T0                                                  # position of `last`, the last committed token
        up = self._upload([first, start])
        last, start_t = up[0:1], up[1:2]                            # [1] each, on the device
        offsets = torch.arange(B, device=device)
        if use_draft:
            self.proposer.prefill(feats, pos)
            # placeholder context at positions >= start: never visible, overwritten by the first verify's features
            if feats is not None:
                feats = torch.zeros(1, B, feats.shape[-1], dtype=feats.dtype, device=device)
            feat_pos = start_t + offsets

        while not stop:
            remaining = max_new_tokens - n_out
            bpos = start_t + offsets
            t0 = _clock(device, profile)
            if not use_draft:
                logits = self.decode_step(last.view(1, 1), bpos)
                t1 = t0
                new = [int(logits.argmax() if s.greedy else pick(logits))]   # the one host sync per token
            else:
                if B > 1:
                    proposals = self.draft_step(last, start_t, feats, feat_pos, B - 1)       # [B-1]
                else:
                    proposals = torch.zeros(0, dtype=torch.long, device=device)
                t1 = _clock(device, profile)
                block = torch.cat([last, proposals])[None]
                if s.greedy:
                    posterior, accepted, vfeats = self.verify_step(block, bpos)
                else:
                    u = torch.rand(B - 1, device=device, generator=gen)
                    expo = torch.empty(B, V, device=device).exponential_(generator=gen)
                    posterior, accepted, vfeats = self.verify_sample_step(block, bpos, u, expo)
                vals = torch.cat([accepted.view(1), posterior, proposals]).tolist()    # the one host sync per round
                a, post, props = vals[0], vals[1:B + 1], vals[B + 1:]
                new = props[:a] + [post[a]]
            new = new[:remaining]
            for i, t in enumerate(new):
                if t in stops:
                    new = new[:i + 1]
                    break
            n = len(new)
            n_out += n
            stop = new[-1] in stops or n_out >= max_new_tokens
            up = self._upload([n, new[-1], start + n])              # what the host decided, back without a sync
            if use_draft:
                # The inputs of block[0 .. n-1] are committed; new[-1] is the last committed token, not yet processed.
                self.commit(up[0])
            t2 = _clock(device, profile)
            if use_draft:
                yield Step("verify", start, new, props, a, stop, t1 - t0, t2 - t1)
                # All B rows go to the drafter (static shape): rows >= n are rejected tokens' features at
                # positions >= the next start, hidden from the next block and overwritten by the next append.
                feats = vfeats.clone() if self._graphs and vfeats is not None else vfeats    # CUDA graphs reuse outputs
                feat_pos = bpos                                     # the positions of this verify block
            else:
                yield Step("decode", start, new, stop=stop, verify_seconds=t2 - t1)
            start += n
            last, start_t = up[1:2], up[2:3]

    def _upload(self, values: list) -> torch.Tensor:
        """Host ints -> a LongTensor on the device, without a host-device sync: on CUDA through a pinned buffer
        and a non-blocking copy (a plain torch.tensor(..., device="cuda") waits for the stream). The buffer is
        rewritten only after the next host read (the round's one sync) has waited for this copy."""
        if self.device.type != "cuda":
            return torch.tensor(values, device=self.device)
        if self._host is None:
            self._host = torch.empty(8, dtype=torch.long, pin_memory=True)
        host = self._host[:len(values)]
        host.copy_(torch.tensor(values))
        return host.to(self.device, non_blocking=True)

    def run(self, prompt_ids: list, max_new_tokens: int, stop_ids=(), on_step=None, profile: bool = False,
            sampling: Sampling | None = None, generator: torch.Generator | None = None, images=None) -> Result:
        steps = self.generate(prompt_ids, max_new_tokens, stop_ids, profile, sampling, generator, images)
        return collect(steps, prompt_ids, self.device, on_step)


def generate(target: Qwen35, prompt_ids: list, max_new_tokens: int, stop_ids=(), proposer=None,
             block_size: int = 16, capacity: int | None = None, profile: bool = False,
             verify_gdn: str = "block", sampling: Sampling | None = None, generator=None,
             attention: str = "sdpa") -> Iterator[Step]:
    """One generation with caches sized for this request (see Engine for reuse and compilation).
    proposer None = plain AR decoding. verify_gdn: "block" (closed-form per-token states, fast) or
    "recurrent" (token by token, the reference). attention: "sdpa" or "flex" (see ATTENTION)."""
    if proposer is None:
        block_size = 1
    capacity = check_inputs(target, prompt_ids, max_new_tokens, block_size, capacity, proposer)
    engine = Engine(target, proposer, block_size, capacity, verify_gdn=verify_gdn, attention=attention)
    return engine.generate(prompt_ids, max_new_tokens, stop_ids, profile, sampling, generator)


def collect(steps: Iterator[Step], prompt_ids: list, device, on_step=None) -> Result:
    """Drain a stream of Steps into a Result (ids, acceptance statistics, timings)."""
    res = Result(list(prompt_ids), [], [], [], [])
    _sync(device)
    t0 = time.perf_counter()
    t_first = None
    for step in steps:
        if step.kind == "prefill":
            _sync(device)
            t_first = time.perf_counter()
            res.prefill_seconds = t_first - t0
        elif step.kind == "verify":
            res.acceptance_lengths.append(len(step.tokens))
            res.draft_ids.append(step.draft_ids)
        res.output_ids += step.tokens
        res.steps.append(step)
        if on_step is not None:
            on_step(step)
    _sync(device)
    res.decode_seconds = time.perf_counter() - t_first
    return res


def run(target: Qwen35, prompt_ids: list, max_new_tokens: int, stop_ids=(), proposer=None, block_size: int = 16,
        capacity: int | None = None, on_step=None, profile: bool = False, verify_gdn: str = "block",
        sampling: Sampling | None = None, generator=None, attention: str = "sdpa") -> Result:
    """One generation to the end (caches sized for it), collected into a Result."""
    steps = generate(target, prompt_ids, max_new_tokens, stop_ids, proposer, block_size, capacity, profile, verify_gdn,
                     sampling, generator, attention)
    return collect(steps, prompt_ids, target.embed_tokens.weight.device, on_step)
