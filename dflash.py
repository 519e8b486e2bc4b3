"""The DFlash draft-verify loop, exactly lossless, and plain autoregressive decoding through the same caches:
the baseline it must equal token for token. The method, step by step: docs/method.md#one-round.

Engine.round is one round: DRAFT (the proposer's block_size - 1 tokens after `last`, the last committed
token), VERIFY (the target over [last, proposals]; GDN layers keep each token's state write), ACCEPT (the
leading proposals equal to the target's choices, plus one token of the target's: the bonus; cut at a stop
token or at max_new_tokens) and COMMIT (TargetCache.commit(n): the rollback of the GDN states).

A proposer has `max_block_size`, `feature_layers` (the target layers whose outputs it reads), `reset(capacity,
masks)`, `prefill(feats, pos)` and `propose(last, start, feats, feat_pos, n)` -> proposals [n], or (proposals,
q) with their draft distributions q [n, V] (None: one-hot); one that samples its draft when the target samples
has `samples_drafts` True and takes the noise row keys of its positions and the temperature as two more
arguments. One with `wants_next_ids` (mtp.MTPProposer) also gets `next_ids=`, the committed token after each
feature row's position, in prefill and propose, and its first feature rows include the position before `start`.
`compilable`: propose is one static-shape graph.
DrafterProposer wraps the DFlash and DFlash2 drafters; the tests use stand-ins that force every acceptance length.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

import compiling
import noise
from model import DenseMasks, DFlashDrafter, DraftCache, GenerationError, Qwen35, TargetCache
# The sampling rules live in sampling.py; dflash.Sampling, dflash.draw, ... are these names.
from sampling import Sampling, draw, matched, sampling_probs, speculative_accept


@dataclass
class Step:
    """One event of a generation, in order. kind: "prefill" (commits the first token), "verify" (one
    draft-verify round), "decode" (one AR step) or "plain" (one AR step of a DFlash engine that also feeds the
    drafter's context: adaptive speculation, while speculating would lose)."""
    kind: str
    start: int                                  # position of the last committed token before this step
    tokens: list                                # tokens committed by this step
    draft_ids: list = field(default_factory=list)   # proposals offered (verify only)
    accepted: int = 0                           # leading proposals the target agreed with (verify only)
    stop: bool = False                          # generation ends after this step
    draft_seconds: float = 0.0                  # wall time of the draft forward (verify steps)
    verify_seconds: float = 0.0                 # wall time of the target forward + accept + commit
    look: list | None = None                    # "plain" after a look: the proposals of a draft made first and never
                                                # verified (adaptive speculation's probe); not part of the trace


@dataclass
class Result:
    prompt_ids: list
    output_ids: list                            # generated ids, the first (from prefill) included
    acceptance_lengths: list                    # tokens committed per step after prefill, bonus included (DFlash)
    draft_ids: list                             # each step's proposals ([] for a "plain" step)
    steps: list
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0                 # everything after the first token
    step_kinds: list = field(default_factory=list)   # "verify" or "plain", per acceptance_lengths entry
    seed: int | None = None                     # the sampling seed (None: greedy); it reproduces the text

    @property
    def verify_lengths(self) -> list:
        """acceptance_lengths of the draft-verify rounds only (a plain step commits 1 and drafted nothing)."""
        return [a for a, k in zip(self.acceptance_lengths, self.step_kinds) if k == "verify"]

    @property
    def mean_acceptance_length(self) -> float:
        a = self.verify_lengths
        return sum(a) / len(a) if a else 0.0

    def histogram(self, block_size: int) -> list:
        """counts[k-1] = verify rounds that committed k tokens, k = 1..block_size."""
        counts = [0] * block_size
        for a in self.verify_lengths:
            counts[a - 1] += 1
        return counts


# ---- The proposer --------------------------------------------------------------------------------

class DrafterProposer:
    """The real proposer: the DFlash drafter with its context cache, sharing the target's embedding and lm_head."""

    compilable = True

    def __init__(self, drafter: DFlashDrafter, target: Qwen35, window: int | None = None):
        """window: each draft sees only the last `window` committed positions (None = all; long prompts)."""
        if window is not None and window < 1:
            raise GenerationError(f"--draft-window must be >= 1, got {window}")
        self.drafter, self.target, self.window = drafter, target, window
        self.cache, self.masks = None, None

    @property
    def max_block_size(self) -> int:
        return self.drafter.cfg.block_size

    @property
    def feature_layers(self) -> tuple:
        return tuple(self.drafter.cfg.target_layer_ids)

    def reset(self, capacity: int, masks) -> None:
        """A new sequence (the cache is kept when it fits: its stale entries are masked)."""
        if self.cache is None or self.cache.capacity != capacity:
            w = self.drafter.fc.weight
            self.cache = DraftCache(self.drafter.cfg, capacity, w.dtype, w.device)
        self.masks = masks

    def prefill(self, feats: torch.Tensor, pos: torch.Tensor) -> None:
        """The prompt's features [1,T0,F] at positions pos [T0] into the context cache (once per generation)."""
        self.drafter.append_context(feats, pos, self.cache)

    @property
    def samples_drafts(self) -> bool:
        """Whether its block is sampled when the target samples (DFlash2's candidate selector); a DFlash drafter
        drafts greedily at any temperature (a one-hot q)."""
        return self.drafter.cfg.dflash2

    def propose(self, last: torch.Tensor, start: torch.Tensor, feats: torch.Tensor, feat_pos: torch.Tensor, n: int,
                rows: torch.Tensor | None = None, temperature: float = 1.0) -> tuple:
        """last [1] token at position start [1]; feats [1,Tc,F] target features at feat_pos [Tc] not seen yet
        (rows at positions >= start are hidden) -> proposals [n] for positions start+1 .. start+n and their draft
        distributions q [n,V] (None: greedy, one-hot). rows [n]: the noise row keys of those positions (row_keys;
        samples_drafts only): sample at `temperature`. All shapes are fixed for a given block size, so this
        compiles to one graph."""
        self.drafter.append_context(feats, feat_pos, self.cache)
        hidden = self.drafter.draft_block(last.view(1), start, n, self.target.embed_tokens, self.cache, self.masks)
        return self.drafter.propose(hidden[0], last.view(1), self.target.lm_head, rows, temperature)


def check_block_size(block_size: int, proposer=None) -> None:
    if block_size < 1:
        raise GenerationError(f"block size must be >= 1, got {block_size}")
    if proposer is not None and block_size > proposer.max_block_size:
        raise GenerationError(f"block size {block_size} exceeds the drafter's block_size {proposer.max_block_size}; "
                              f"use --block-size {proposer.max_block_size} or less")


MIN_CAPACITY = 256


def default_capacity(need: int, most: int) -> int:
    """The cache length when none is asked for: `need` rounded up to a power of two, at least MIN_CAPACITY and
    at most `most` (what max_position_embeddings allows), but never below `need`. Every step's shapes follow
    the capacity, so with --compile nearby prompt lengths share one set of compiled steps (inductor's cache)
    instead of compiling again. The cost is attention over up to twice the slots a request needs (measurable
    on the tiny embedded pair: README, Measured numbers), so eager runs are sized exactly."""
    return max(need, min(max(MIN_CAPACITY, 1 << (need - 1).bit_length()), most))


def check_inputs(target: Qwen35, prompt_ids: list, max_new_tokens: int, block_size: int, capacity: int | None,
                 proposer=None, round_up: bool = False) -> int:
    """Validate a request; return the cache capacity to allocate: `capacity`, or when None what the request
    needs, rounded up by default_capacity with round_up (compiled steps: their shapes follow the capacity)."""
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
        capacity = default_capacity(need, target.cfg.max_position_embeddings + block_size - 1) if round_up else need
    if need > capacity:
        raise GenerationError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + block slack ({block_size - 1}) "
                              f"= {need} exceeds the cache length {capacity}; raise --cache-len or shorten the request")
    if len(prompt_ids) + max_new_tokens > target.cfg.max_position_embeddings:
        raise GenerationError(f"prompt + max_new_tokens = {len(prompt_ids) + max_new_tokens} exceeds the model's "
                              f"max_position_embeddings {target.cfg.max_position_embeddings}; shorten the request")
    return capacity


# ---- The engine ----------------------------------------------------------------------------------

def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cut(tokens: list, stops, room: int) -> list:
    """Tokens a step produced -> those it commits: at most `room` (what max_new_tokens leaves), and none after the
    first stop token."""
    tokens = tokens[:room]
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


class _Sequence:
    """What a generation carries from one step to the next. `last` and `start_t` are the last committed token
    and its position on the device (the steps read them there: no host sync); `start` is the host's copy."""

    def __init__(self, first: int, start: int, max_new_tokens: int, stops: set, upload):
        self.upload, self.stops, self.max_new = upload, stops, max_new_tokens
        self.n_out, self.start, self.feats, self.feat_pos, self.feat_next = 1, start, None, None, None
        self.plain_run = None    # plain steps whose features fill `feats` since it was last appended (None: a round's)
        self.done = first in stops or max_new_tokens <= 1
        self.last, self.start_t = self.upload([first, start]).split(1)

    def take(self, tokens: list) -> list:
        """Tokens a step produced -> those committed: cut at max_new_tokens and after a stop token."""
        tokens = cut(tokens, self.stops, self.max_new - self.n_out)
        self.n_out += len(tokens)
        self.done = tokens[-1] in self.stops or self.n_out >= self.max_new
        return tokens

    def advance(self, n: int, last: int) -> torch.Tensor:
        """Commit n tokens ending in `last` -> n on the device; `last` and `start_t` move there too."""
        self.start += n
        up = self.upload([n, last, self.start])
        self.last, self.start_t = up[1:2], up[2:3]
        return up[0]


class Steps:
    """One target (and optionally a proposer) with caches allocated once for `capacity` positions and the
    fixed-shape step functions, eager or compiled with torch.compile(fullgraph=True, dynamic=False):
        decode_step  (tok [1,1], pos [1])                      -> logits [V]        AR; commits its token
        pick_step    (logits [V], at [1], key)                 -> the token drawn for position at [1] (sampling)
        verify_step  (block [1,B], pos [B], key, q)            -> posterior [B], accepted [], feats [1,B,F]
        draft_step   (last [1], start [1], feats [1,B,F], feat_pos [B], rows) -> proposals [B-1], q [B-1,V] or None
        commit       (n [], a 0-d tensor)                      -> the GDN states after the n-th block token
    Everything that varies per step is a device tensor, so after warm-up nothing recompiles. Prefill (one
    call per prompt, any length) stays eager. When sampling, `key` is the seed's noise key (a device tensor set
    per generation, noise.py) and every draw uses the noise of the position it fills; greedy steps get no key."""

    def __init__(self, target: Qwen35, proposer=None, block_size: int = 16, capacity: int = 2048,
                 compile_mode: str | None = None, masks=DenseMasks, compile_options: dict | None = None, policy=None):
        """masks: the class of the cached calls' masks, model.DenseMasks (SDPA) or flex.FlexMasks, built here once
        over the static caches. compile_options: inductor options added to the mode's (cppwrapper.py's).
        policy: adaptive speculation (adaptive.Adaptive; None = a round every step): before each step after
        prefill, policy.speculate() says round or plain step, and policy.observe(step) sees each step."""
        self.target, self.proposer, self.policy = target, proposer, policy
        self.block, self.capacity = block_size if proposer is not None else 1, capacity
        check_block_size(self.block, proposer)
        self.device = target.embed_tokens.weight.device
        self._graphs = compile_mode is not None and self.device.type == "cuda"   # compiled steps may replay CUDA graphs
        self.masks = masks(capacity, self.block, getattr(proposer, "window", None), self.device)
        self.cache = TargetCache(target.cfg, capacity, target.embed_tokens.weight.dtype, self.device,
                                 max_block=self.block, masks=self.masks)
        self.feature_layers = tuple(proposer.feature_layers) if proposer is not None else ()
        if proposer is not None:
            proposer.reset(capacity, self.masks)
        self.offsets = torch.arange(self.block, device=self.device)
        self.sampling = Sampling()
        self.noise_key = torch.zeros((), dtype=torch.long, device=self.device)   # noise.seed_key of the generation's seed
        self.seed, self.key = None, None     # a sampled generation's seed, and noise_key while it runs (None: greedy)
        # RoPE position = cache position + rope_delta for every token after a prompt with images (vision.py);
        # 0 for text. A device tensor set per generation, so compiled steps read it instead of recompiling.
        self.rope_delta = torch.zeros((), dtype=torch.long, device=self.device)
        self._host = None                    # pinned host buffer of _upload (CUDA)
        self.decode_step, self.verify_step, self.commit, self.plain_step = self._decode, self._verify, self.cache.commit, self._plain
        self.pick_step = self._pick
        self.draft_step = getattr(proposer, "propose", None)     # (tree.py: propose_tree instead)
        self._next_ids = getattr(proposer, "wants_next_ids", False)
        self._guard = None                             # with compiled steps: compiling.ModelGuard
        if compile_mode is not None:
            self._compile(compile_mode, compile_options or {})

    def _compile(self, mode: str, extra: dict) -> None:
        """Wrap the step functions in torch.compile(fullgraph=True, dynamic=False) with the mode's inductor options
        (compiling.py: the options, the checks dynamo skips and model_state, which stands in for them once per
        generation). Each distinct decoder layer is compiled once and called per layer (its compile region)."""
        options = compiling.inductor_options(mode, extra, self.device)
        if self._graphs:
            compiling.mark_static_(self.cache)        # the drafter's cache is marked in generate, after its reset
            torch._dynamo.mark_static_address(self.noise_key, guard=False)
        self.decode_step = compiling.compile_step(self._decode, options)
        self.verify_step = compiling.compile_step(self._verify, options)
        self.commit = compiling.compile_step(self.cache.commit, options)
        self.pick_step = compiling.compile_step(self._pick, options)
        if getattr(self.proposer, "compilable", False):
            self.draft_step = compiling.compile_step(self.proposer.propose, options)
            self.plain_step = compiling.compile_step(self._plain, options)
        self._guard = compiling.ModelGuard(self.target, self.proposer, "Engine")

    # ---- the steps -----------------------------------------------------------------------------

    def _decode(self, tok, pos):
        logits, _ = self.target(tok, pos, self.cache, rope_pos=pos + self.rope_delta)
        return logits[0, -1]

    def _plain(self, tok, pos, buf, slot):
        """_decode that also keeps the token's features: row `slot` [1] of buf [1,B,F], which the drafter's context
        takes in whole (B rows) when it fills up or drafting resumes, as it takes a round's verify features."""
        logits, feats = self.target(tok, pos, self.cache, feature_layers=self.feature_layers, rope_pos=pos + self.rope_delta)
        buf.index_copy_(1, slot, feats)
        return logits[0, -1]

    def _verify(self, block, pos, key=None, q=None):
        """The target over the block (GDN layers keep its writes), then the acceptance rule. Row i's token fills
        position pos[i] + 1: greedy (key None) its argmax; sampling, its draw with that position's noise, which is
        exactly plain decoding's draw there (noise.py). The accepted proposals are the leading ones equal to those
        tokens (matched), except for a sampled draft (its distributions q [B-1,V]) under the ratio rule:
        speculative_accept's min(1, p/q), with the uniforms and residual draws of the same positions."""
        logits, feats = self.target(block, pos, self.cache, verify=True, feature_layers=self.feature_layers,
                                    rope_pos=pos + self.rope_delta)
        if key is None:
            posterior = logits[0].argmax(-1)                                               # [B]
            return posterior, matched(block[0, 1:], posterior), feats
        probs, expo = sampling_probs(logits[0], self.sampling), noise.vocab_noise(key, pos + 1, logits.shape[-1])
        if q is not None and self.sampling.draft_rule == "ratio":
            accepted, posterior = speculative_accept(probs, block[0, 1:], noise.accept_uniforms(key, pos[1:]), expo, q)
            return posterior, accepted, feats
        posterior = draw(probs, expo)
        return posterior, matched(block[0, 1:], posterior), feats

    def _pick(self, logits, at, key):
        """The token at position at [1] from logits [V]: a draw at the generation's Sampling with that position's
        noise (noise.py)."""
        return draw(sampling_probs(logits, self.sampling), noise.vocab_noise(key, at, logits.shape[-1])[0])

    def pick(self, logits, at):
        """One token on the device from logits [V] for position at [1]: the argmax (one op, not worth a compiled
        call), or the generation's draw there (pick_step: the noise and the draw fused when compiled)."""
        return logits.argmax() if self.key is None else self.pick_step(logits, at, self.key)

    def _draft_noise(self, seq, n: int) -> tuple:
        """(row keys [n], temperature) for a proposer that samples its draft (samples_drafts) when sampling, else ():
        the keys of positions start+1 .. start+n, in the TARGET stream under the coupled rule (the draft races with
        the target's own noise) or the DRAFT stream under the ratio rule (noise of its own)."""
        if self.key is None or not getattr(self.proposer, "samples_drafts", False):
            return ()
        stream = noise.TARGET if self.sampling.draft_rule == "coupled" else noise.DRAFT
        return noise.row_keys(self.key, seq.start_t + 1 + self.offsets[:n], stream), self.sampling.temperature

    def _clock(self) -> float:
        """Wall clock for per-step timings; on CUDA it syncs only when profiling (a sync per step costs speed)."""
        if self.profile:
            _sync(self.device)
        return time.perf_counter()

    def _upload(self, values: list) -> torch.Tensor:
        """Host ints -> a LongTensor on the device without a sync: on CUDA a non-blocking copy from a pinned
        buffer, rewritten only after the next host read (the round's one sync) has waited for this copy."""
        if self.device.type != "cuda":
            return torch.tensor(values, device=self.device)
        if self._host is None:
            self._host = torch.empty(8, dtype=torch.long, pin_memory=True)
        host = self._host[:len(values)]
        host.copy_(torch.tensor(values))
        return host.to(self.device, non_blocking=True)


class Engine(Steps):
    """A generation over the Steps: prefill, then, as the policy says, rounds (draft, verify, accept, commit) or plain
    AR steps, each yielded as a Step; `run` collects them into a Result. Per generation the state lives in a
    _Sequence; the engine keeps what the steps need (the sampling settings, the noise key) and the seed used."""

    @torch.inference_mode()
    def generate(self, prompt_ids: list, max_new_tokens: int, stop_ids=(), *, profile: bool = False,
                 sampling: Sampling | None = None, seed: int | None = None, images=None) -> Iterator[Step]:
        """Generation as a stream of Steps ("prefill", then "verify" rounds or AR "decode" steps).
        sampling None or temperature 0: greedy. Otherwise every draw uses the noise of `seed` at the position it
        fills (noise.py), so a seed gives one text whatever the step pattern; `self.seed` is the seed used (a
        random one when None).
        profile: synchronise the device around each phase so Step's timings are exact (CUDA).
        images: a vision.ImagePrompt for prompt_ids (already expanded: ImagePrompt.ids); the drafter sees the
        images only through the target's features."""
        if images is not None and list(images.ids) != list(prompt_ids):
            raise GenerationError("prompt_ids must be the ImagePrompt's expanded ids (vision.encode_images)")
        check_inputs(self.target, prompt_ids, max_new_tokens, self.block, self.capacity, self.proposer)
        if self._guard is not None:
            self._guard.check()
        self.profile, s = profile, sampling or Sampling()
        self.seed = None if s.greedy else (secrets.randbits(63) if seed is None else seed)
        self.key = None if s.greedy else self.noise_key.fill_(noise.seed_key(self.seed))    # None: greedy steps
        if not s.greedy:
            self.sampling = s                 # a constant of the compiled steps (a change recompiles)
        seq = yield from self.prefill(prompt_ids, max_new_tokens, set(stop_ids), images)
        if self.policy is not None:
            self.policy.reset()
        while not seq.done:
            if self.proposer is None:
                yield self.decode(seq)
                continue
            if self.policy is None or self.policy.speculate():
                step = self.round(seq)
            else:
                step = self.decode(seq, plain=True, look=getattr(self.policy, "look", lambda: False)())
            if self.policy is not None:
                self.policy.observe(step)
            yield step

    def prefill(self, prompt_ids, max_new_tokens, stops, images):
        """The whole prompt in one call (GDN chunked, from a zero state); its last logits give the first token and
        its features fill the drafter's context. Yields the "prefill" Step, returns the _Sequence."""
        T0, device = len(prompt_ids), self.device
        self.cache.reset()
        if self.proposer is not None:
            self.proposer.reset(self.capacity, self.masks)
            if self._graphs and getattr(self.proposer, "compilable", False):
                compiling.mark_static_(self.proposer.cache)    # (re)allocated by reset when another Engine resized it
        pos = torch.arange(T0, device=device)
        self.rope_delta.fill_(0 if images is None else images.rope_delta)
        # The prompt goes through SDPA with a dense mask whatever the cached steps use: prefill runs eager, and
        # eager flex_attention is an unfused reference path (it warns, and materialises [heads, T0, capacity] scores).
        logits, feats = self.target(torch.tensor([prompt_ids], device=device), pos, self.cache,
                                    feature_layers=self.feature_layers, last_logits_only=True,
                                    mask=DenseMasks(self.capacity).target(pos),
                                    rope_pos=None if images is None else images.rope_pos,
                                    image_embeds=None if images is None else images.embeds)
        first = int(self.pick(logits[0, -1], pos[-1:] + 1))
        seq = _Sequence(first, T0, max_new_tokens, stops, self._upload)
        if self.proposer is not None:
            B, back = self.block, 0
            if self._next_ids:      # the token after each row: the prompt shifted by one, then the first token
                nxt = torch.tensor(prompt_ids[1:] + [first], device=device)
                self.proposer.prefill(feats, pos, next_ids=nxt)
                back = min(T0, B)   # the first draft re-reads the prompt's last rows (it starts from the one before start)
                seq.feat_next = torch.cat([nxt[T0 - back:], nxt.new_zeros(B - back)])
            else:
                self.proposer.prefill(feats, pos)
            # The first draft gets the prompt's last `back` rows and placeholders at positions >= start: hidden,
            # overwritten by the first verify's.
            if feats is not None:
                seq.feats = torch.cat([feats[:, T0 - back:], feats.new_zeros(1, B - back, feats.shape[-1])], 1)
                if getattr(self, "_plain_buf", None) is None or self._plain_buf.shape != seq.feats.shape:
                    self._plain_buf = torch.zeros_like(seq.feats)    # plain steps' features (decode(plain=True)),
                    self._plain_next = torch.zeros(B, dtype=torch.long, device=device)   # and their next tokens
                    if self._graphs:                                 # written in place by the compiled plain step
                        torch._dynamo.mark_static_address(self._plain_buf, guard=False)
                        torch._dynamo.mark_static_address(self._plain_next, guard=False)
            seq.feat_pos = seq.start_t - back + self.offsets
        yield Step("prefill", T0 - 1, [first], stop=seq.done)
        return seq

    def round(self, seq: _Sequence) -> Step:
        """One DFlash round: draft, verify, accept, commit (docs/method.md#one-round)."""
        B, start, pos = self.block, seq.start, seq.start_t + self.offsets         # the block's positions [B]
        t0 = self._clock()
        proposals, q = torch.zeros(0, dtype=torch.long, device=self.device), None
        if B > 1:
            drafted = self.draft_step(seq.last, seq.start_t, seq.feats, seq.feat_pos, B - 1, *self._draft_noise(seq, B - 1),
                                      **self._next_kw(seq))
            proposals, q = drafted if isinstance(drafted, tuple) else (drafted, None)              # [B-1], [B-1,V]
        t1 = self._clock()
        block = torch.cat([seq.last, proposals])[None]
        posterior, accepted, feats = self.verify_step(block, pos, *(() if self.key is None else (self.key,)),
                                                      *(() if q is None else (q,)))
        if self._next_ids:   # row j's next token: proposal j while accepted, then the target's token (the bonus)
            seq.feat_next = torch.where(self.offsets < accepted, torch.cat([proposals, proposals[:1]]), posterior)
        a, *rest = torch.cat([accepted.view(1), posterior, proposals]).tolist()    # the round's one host sync
        posterior, proposals = rest[:B], rest[B:]
        new = seq.take(proposals[:a] + [posterior[a]])
        self.commit(seq.advance(len(new), new[-1]))        # the rollback: GDN states after the committed tokens
        t2 = self._clock()
        # The next draft reads this verify's features, all B rows (static shape): rows past the committed
        # tokens are at positions >= the next start, hidden from the next block and overwritten by its append.
        seq.feats = feats.clone() if self._graphs and feats is not None else feats     # CUDA graphs reuse outputs
        seq.feat_pos, seq.plain_run = pos, None
        return Step("verify", start, new, proposals, a, seq.done, t1 - t0, t2 - t1)

    def decode(self, seq: _Sequence, plain: bool = False, look: bool = False) -> Step:
        """One plain AR step: the baseline DFlash must equal. plain (a DFlash engine, adaptive speculation): the same
        step also keeps the token's features for the drafter's context, in a B-row buffer that is appended whole
        when full, or by the next round's draft like a verify's features (rows past the committed ones hidden).
        look: first draft as a round would (the same draft step, with the same noise) without verifying: the
        proposals come back in Step.look, and the plain steps that follow show how many of them a round would have
        accepted, at the cost of a draft alone (adaptive.Adaptive's probe)."""
        start, t0, proposals = seq.start, self._clock(), None
        if look and self.block > 1:
            drafted = self.draft_step(seq.last, seq.start_t, seq.feats, seq.feat_pos, self.block - 1,
                                      *self._draft_noise(seq, self.block - 1), **self._next_kw(seq))
            proposals = (drafted[0] if isinstance(drafted, tuple) else drafted).tolist()
        feeding = plain and seq.feats is not None
        if feeding and seq.plain_run in (None, self.block):    # pending rows (a round's, or a full buffer) into the
            self.proposer.prefill(seq.feats, seq.feat_pos, **self._next_kw(seq))   # context; rows at >= start are
            seq.feats, seq.feat_pos, seq.plain_run = self._plain_buf, seq.start_t + self.offsets, 0   # hidden, rewritten
            seq.feat_next = self._plain_next
        t1 = self._clock()                                     # (the look and the feeding are timed apart)
        if feeding:
            slot = seq.start_t - seq.feat_pos[:1]
            logits = self.plain_step(seq.last.view(1, 1), seq.start_t, seq.feats, slot)
            seq.plain_run += 1
        else:
            logits = self.decode_step(seq.last.view(1, 1), seq.start_t)
        tok = self.pick(logits, seq.start_t + 1)
        if feeding and self._next_ids:
            self._plain_next.index_copy_(0, slot, tok.view(1))                   # the token after the row just kept
        new = seq.take([int(tok)])                                               # the one host sync per token
        seq.advance(1, new[0])
        return Step("plain" if plain else "decode", start, new, stop=seq.done, draft_seconds=t1 - t0,
                    verify_seconds=self._clock() - t1, look=proposals)

    def _next_kw(self, seq) -> dict:
        """next_ids= for a proposer that reads the token after each feature row (wants_next_ids), else nothing."""
        return {"next_ids": seq.feat_next} if self._next_ids else {}

    def run(self, prompt_ids: list, max_new_tokens: int, stop_ids=(), on_step=None, **kw) -> Result:
        """generate(...) to the end, collected into a Result; on_step(step) sees every Step as it comes."""
        res = Result(list(prompt_ids), [], [], [], [])
        _sync(self.device)
        t0 = t_first = time.perf_counter()
        for step in self.generate(prompt_ids, max_new_tokens, stop_ids, **kw):
            if step.kind == "prefill":
                _sync(self.device)
                t_first = time.perf_counter()
                res.prefill_seconds = t_first - t0
            elif step.kind in ("verify", "plain"):
                res.acceptance_lengths.append(len(step.tokens))
                res.draft_ids.append(step.draft_ids)
                res.step_kinds.append(step.kind)
            res.output_ids += step.tokens
            res.steps.append(step)
            if on_step is not None:
                on_step(step)
        _sync(self.device)
        res.decode_seconds = time.perf_counter() - t_first
        res.seed = self.seed
        return res


def run(target: Qwen35, prompt_ids: list, max_new_tokens: int, stop_ids=(), proposer=None, block_size: int = 16,
        *, capacity: int | None = None, masks=DenseMasks, **run_kw) -> Result:
    """One generation with caches sized for it: Engine(...).run(...). proposer None = plain AR decoding."""
    block = block_size if proposer is not None else 1
    capacity = check_inputs(target, prompt_ids, max_new_tokens, block, capacity, proposer)
    return Engine(target, proposer, block, capacity, masks=masks).run(prompt_ids, max_new_tokens, stop_ids, **run_kw)
