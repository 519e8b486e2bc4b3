"""The engine: DFlash for N requests at once, each row exactly its batch-1 self, with the fast paths (fixed-shape
steps, compiled or eager; adaptive speculation; proposers other than a DFlash drafter). It computes what
dflash.generate, the reference loop, computes for one request, and the tests hold it to that loop token for token
(tests/test_reference.py). A single request is a batch of one slot; many requests are admitted into N slots as
slots free (continuous batching). docs/method.md#what-the-engine-adds.

Engine.round is one round for every live row: DRAFT (the proposer's k - 1 tokens after each row's `last`, its last
committed token), VERIFY (the target over [last, proposals]; GDN layers keep each token's state write), ACCEPT
(the leading proposals equal to the target's own tokens, plus one token of the target's: the bonus) and COMMIT
(TargetCache.commit(n): each row's GDN states rolled back to its n accepted tokens), the last three in one call;
then the host cuts each row's tokens at a stop token or max_new_tokens, which ends the row.
A plain step (Engine.plain) is one AR step for every row: without a proposer it is plain decoding, the baseline
DFlash must equal; with one, the adaptive policy (policy.py) takes it while rounds lose.

Why a row equals its batch-1 self: everything a row computes reads its own row of the caches at its own positions
(per-row masks, RoPE and cache writes: model.py); a sampled token's noise is keyed by the request's seed and the
position it fills (noise.py); each row's proposals are judged against that row's own target tokens. What remains
is rounding: a product over N rows may round differently from one over a single row (float32 and bfloat16:
near-ties only; float64: the same tokens in every test).

    Request          one generation asked for: prompt, max_new_tokens, stops, sampling settings, seed, images
    Step, Result     what each step committed for a request; a request's whole generation
    Proposer         what drafts for every row at once (typing.Protocol): DrafterProposer (DFlash, DFlash2),
                     mtp.MTPProposer (Qwen3.5's MTP head); trees plug in through tree.TreeEngine's round
    Pending          the target features the drafter's context has not taken yet, per row
    Shadows          drafts taken while plain steps run, judged by the tokens those steps commit (policy.py)
    Slots            the N slots' caches and fixed-shape step functions (decode, plain, draft, verify)
    Engine           the loop: admit requests into free slots, then rounds or plain steps until each ends
    Observer         what a benchmark hooks in: the clock requests are timed on, and a call after each step
    run              one request on an Engine of one slot

Shapes: N slots, B the block (verify width), k <= B a round's verify width, P = B + back pending columns, F the
feature width (len(feature_layers) x hidden), V the vocabulary.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import json
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import torch

import compiling
import noise
from dflash import check_block_size, check_inputs, cut
from model import AttnCache, DenseMasks, DFlashDrafter, DraftCache, GenerationError, Qwen35, TargetCache
from policy import Alternate, load_costs, shadow_verdict, store_costs
from sampling import Sampling, choose, speculative_accept


# ---- Requests and results -----------------------------------------------------------------------

@dataclass
class Request:
    """One generation: greedy (temperature 0) or sampled with its own seed (None: a random one, recorded in its
    Result). images: a vision.ImagePrompt whose expanded ids are prompt_ids (vision.encode_images); the drafter
    sees the images only through the target's features."""
    prompt_ids: list
    max_new_tokens: int
    stop_ids: tuple = ()
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None
    images: object = None


@dataclass
class Step:
    """One event of a request's generation, in order. kind: "prefill" (its admission: commits the first token),
    "verify" (a draft-verify round), "decode" (an AR step, no proposer) or "plain" (an AR step of an engine with a
    proposer, taken while rounds lose; it also keeps the token's features for the drafter's context)."""
    kind: str
    start: int                                  # position of the last committed token before this step
    tokens: list                                # tokens committed by this step
    draft_ids: list = field(default_factory=list)   # proposals offered (verify only)
    accepted: int = 0                           # leading proposals the target agreed with (verify only)
    stop: bool = False                          # generation ends after this step
    draft_seconds: float = 0.0                  # wall time of the draft (verify steps)
    verify_seconds: float = 0.0                 # wall time of the verify, accept and commit


@dataclass
class Result:
    prompt_ids: list
    output_ids: list                            # generated ids, the first (from prefill) included
    acceptance_lengths: list                    # tokens committed per step after prefill, bonus included
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



# ---- Proposers ----------------------------------------------------------------------------------

class Draft(NamedTuple):
    """A proposer's block for every row: tokens [N,n], and their draft distributions q [N,n,V] when the draft was
    sampled (a DFlash2 drafter's sampled requests, read by the ratio rule), else None (greedy: a one-hot q)."""
    tokens: torch.Tensor
    q: torch.Tensor | None = None


class Proposer(Protocol):
    """Drafts for all N rows in one call. next_ids [N,P]: the committed token after each pending feature row's
    position (stale for rows at positions >= a row's start); only a proposer that reads it (`wants_next_ids`, the
    MTP head) gets it kept up to date, and its pending rows then always include each row's start - 1 (it drafts
    from there)."""
    max_block_size: int
    feature_layers: tuple           # the target layers whose outputs it reads
    wants_next_ids: bool
    samples_drafts: bool            # a sampled request's block is sampled (DFlash2), with its q
    window: int | None              # each draft sees the last `window` positions only (None: all)
    cache: object                   # its context cache (None: it keeps none); static under CUDA graphs

    def reset(self, slots: int, capacity: int, masks) -> None:
        """Allocate its per-row state for `slots` rows of `capacity` positions. masks: the engine's masks object
        (model.DenseMasks or flex.FlexMasks), for a proposer whose attention follows the target's backend."""

    def admit(self, row: int, feats: torch.Tensor, pos: torch.Tensor, prompt_ids: list, first: int) -> None:
        """A new request in `row`: its prompt's features [1,T,F] at positions pos [T]; first: the token its
        prefill committed (the one after the prompt's last)."""

    def append(self, feats: torch.Tensor, pos: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Features [N,P,F] of every row at positions pos [N,P] into its context."""

    def propose(self, last: torch.Tensor, start: torch.Tensor, feats: torch.Tensor, feat_pos: torch.Tensor, n: int,
                next_ids: torch.Tensor, rows: torch.Tensor | None = None,
                temperature: torch.Tensor | None = None) -> Draft:
        """last [N] tokens at positions start [N]; feats [N,P,F] features at feat_pos [N,P] not seen yet (rows at
        positions >= a row's start are stale: hidden) -> the Draft for positions start+1 .. start+n. rows [N,n],
        temperature [N]: the noise row keys of those positions and each row's temperature (0: greedy), given to a
        proposer that samples_drafts when some request samples."""


def max_block(proposer) -> int | None:
    """The widest block a proposer drafts for (dflash.check_inputs' `most`); None without one (plain AR)."""
    return None if proposer is None else proposer.max_block_size


class DrafterProposer:
    """A DFlash or DFlash2 drafter for N rows, sharing the target's embedding and lm_head; its context cache has a
    row per slot. DFlash2's candidate selector drafts each row as its request asks: its best path for a greedy
    request, for a sampled one a draw with the noise of the row's positions, with the draft distributions q."""

    wants_next_ids = False

    def __init__(self, drafter: DFlashDrafter, target: Qwen35, window: int | None = None):
        if window is not None and window < 1:
            raise GenerationError(f"--draft-window must be >= 1, got {window}")
        self.drafter, self.target, self.window = drafter, target, window
        self.max_block_size = drafter.cfg.block_size
        self.feature_layers = tuple(drafter.cfg.target_layer_ids)
        self.samples_drafts = drafter.cfg.dflash2      # a DFlash drafter drafts greedily at any temperature
        self.cache, self.masks = None, None

    def reset(self, slots: int, capacity: int, masks) -> None:
        w = self.drafter.fc.weight
        self.cache = DraftCache(self.drafter.cfg, capacity, self.drafter.dtype, w.device, batch=slots)
        self.masks = masks

    def admit(self, row: int, feats, pos, prompt_ids: list, first: int) -> None:
        view = object.__new__(DraftCache)            # row `row` of every layer's context, as views
        view.capacity = self.cache.capacity
        view.layers = [AttnCache(lc.k[row:row + 1], lc.v[row:row + 1]) for lc in self.cache.layers]
        self.drafter.append_context(feats, pos, view)

    def append(self, feats, pos, next_ids=None) -> None:
        self.drafter.append_context(feats, pos, self.cache)

    def propose(self, last, start, feats, feat_pos, n: int, next_ids=None, rows=None, temperature=None) -> Draft:
        self.append(feats, feat_pos)
        # the lm_head over the whole block, anchor row included: n + 1 rows per row, as many as the verify's (the
        # products packed for the verify block serve both); the anchor's logits are dropped
        whole = self.drafter.draft_block(last, start, n, self.target.embed_tokens, self.cache, self.masks, anchor=True)
        hidden, logits = whole[:, 1:], self.drafter.draft_logits(whole, self.target.lm_head)[:, 1:]    # [N,n,H], [N,n,V]
        if self.drafter.candidate_selector is None:
            return Draft(logits.argmax(-1))
        select = self.drafter.candidate_selector.select                 # row by row: its path is sequential
        best = torch.stack([select(hidden[b], logits[b], last[b:b + 1])[0] for b in range(last.shape[0])])
        if rows is None:
            return Draft(best)
        # Both paths for every row, and each row takes its own: whether a row samples is data of the step (a tensor),
        # so that requests coming and going never recompile it.
        warm = torch.where(temperature > 0, temperature, 1.0)
        drawn = [select(hidden[b], logits[b], last[b:b + 1], rows[b], warm[b]) for b in range(last.shape[0])]
        tokens = torch.where((temperature > 0)[:, None], torch.stack([t for t, _ in drawn]), best)
        return Draft(tokens, torch.stack([q for _, q in drawn]))


# ---- What a benchmark hooks in ------------------------------------------------------------------

class Observer:
    """Called by Engine.run: `clock()` is the time a request's decode seconds are read on (the wall clock here; a
    benchmark stepping two engines in turns gives each a clock of its own steps), `stepped(live)` comes after each
    step of the batch (with the admissions before it), live being the rows that step ran."""

    def clock(self) -> float:
        return time.perf_counter()

    def stepped(self, live: int) -> None:
        pass


# ---- The engine ----------------------------------------------------------------------------------

def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class _Row:
    """A request in a slot: what it has committed, and its Result as it grows."""

    def __init__(self, index: int, req: Request, seed, first: int, start: int, prefill_seconds: float, clock):
        self.index, self.req, self.stops, self.start, self.clock = index, req, set(req.stop_ids), start, clock
        self.result = Result(list(req.prompt_ids), [first], [], [], [Step("prefill", start - 1, [first])],
                             prefill_seconds=prefill_seconds, seed=seed)
        self.done = first in self.stops or req.max_new_tokens <= 1
        self.result.steps[0].stop = self.done
        self.t_first = clock()

    def take(self, kind: str, tokens: list, proposals=(), accepted: int = 0, times=(0.0, 0.0)) -> list:
        """Commit what a step produced for this row (cut at a stop token and max_new_tokens) -> the committed tokens."""
        res = self.result
        new = cut(tokens, self.stops, self.req.max_new_tokens - len(res.output_ids))
        self.done = new[-1] in self.stops or len(res.output_ids) + len(new) >= self.req.max_new_tokens
        res.steps.append(Step(kind, self.start, new, list(proposals), accepted, self.done, *times))
        res.output_ids += new
        if kind != "decode":
            res.acceptance_lengths.append(len(new))
            res.draft_ids.append(list(proposals))
            res.step_kinds.append(kind)
        self.start += len(new)
        if self.done:
            res.decode_seconds = self.clock() - self.t_first
        return new


class Pending:
    """The target features the drafter's context has not taken yet, per row: a round's verify features (round_buf),
    or plain steps' (plain_buf, plain_run columns of it so far; plain_run None: a round's), at positions feat_pos
    [N,P] (those at >= a row's start are stale: hidden from its draft, rewritten later), with the token after each
    (feat_next [N,P]; kept for a proposer that reads it). A round's draft takes them in first (its propose appends
    them); a run of plain steps fills plain_buf one column per step and hands it over whole when full. For a
    proposer that reads next ids (back = 1) the pending rows always include each row's start - 1, where its draft
    begins: plain steps fill plain_buf from column 1, column 0 holding that row carried over (take)."""

    def __init__(self, slots: int, block: int, width: int, back: int, dtype, device):
        self.block, self.back = block, back
        self.span = torch.arange(block + back, device=device)                  # the buffers' columns
        self.columns = [self.span[j:j + 1].clone() for j in range(len(self.span))]   # plain steps' column indices
        self.feats = torch.zeros(slots, len(self.span), width, dtype=dtype, device=device)
        self.plain_buf, self.round_buf = torch.zeros_like(self.feats), torch.zeros_like(self.feats)
        self.feat_pos = self.span.repeat(slots, 1)
        self.feat_next, self.plain_next, self.round_next = (torch.zeros_like(self.feat_pos) for _ in range(3))
        self.plain_run = None

    def buffers(self) -> tuple:
        """The tensors compiled steps write in place (their addresses are static under CUDA graphs)."""
        return self.plain_buf, self.round_buf, self.plain_next, self.round_next

    def take(self, append, start, last) -> None:
        """Everything pending into the drafter's context (append(feats, feat_pos, next_ids)); plain steps then fill
        plain_buf from column `back`, column j holding position start - back + j of each row (start, last [N]: each
        row's position and last committed token)."""
        append(self.feats, self.feat_pos, self.feat_next)
        if self.back:
            at = (start - 1 - self.feat_pos[:, 0]).clamp(0, self.block)           # (a free row: any column)
            row = self.feats.gather(1, at[:, None, None].expand(-1, 1, self.feats.shape[-1]))   # a copy: feats may
            self.plain_buf[:, :1] = row                                                     # be plain_buf itself
            self.plain_next[:, 0] = last
        self.feats, self.feat_next, self.plain_run = self.plain_buf, self.plain_next, 0
        self.feat_pos = (start[:, None] - self.back).clamp(min=0) + self.span           # (a free row: from 0)

    def plain_column(self, append, start, last) -> torch.Tensor:
        """The column [1] of plain_buf the next plain step writes (a full run, or a round's features, taken first)."""
        if self.plain_run is None or self.plain_run == self.block:
            self.take(append, start, last)
        column = self.columns[self.plain_run + self.back]
        self.plain_run += 1
        return column

    def join(self, b: int, feats, ids: list, append, start, last) -> None:
        """Row b's pending columns for the request just admitted into it, whose prompt's features feats [1,T0,F] are
        already in the drafter's context (ids: its prompt and first token). The other rows' columns stay pending:
        the next plain step writes column c = back + plain_run of every row, so row b's columns hold positions
        T0 - c .., the c before its first new position filled with the prompt's last features and next tokens
        (written into the context again later: the same values at the same positions). A prompt shorter than c:
        everything pending is taken first."""
        T0, c = len(ids) - 1, self.back + (self.plain_run or 0)
        if T0 < c:
            self.take(append, start, last)
            c = self.back
        self.feats[b].zero_()
        if feats is not None:                   # (a proposer that reads no features: columns of width 0)
            self.feats[b, :c] = feats[0, T0 - c:]
        if self.back:       # the token after each: the prompt's next, then (after its last) the first token
            self.feat_next[b, :c] = torch.tensor(ids[T0 - c + 1:], device=self.feat_next.device)
        self.feat_pos[b] = T0 - c + self.span

    def keep_round(self, feats, posterior) -> None:
        """Inside a verify step: its k rows' features feats [N,k,F] (None: a proposer that reads none) and the target's
        token after each (posterior [N,k]) written into round_buf and round_next, pending for the next draft.
        Columns past k keep older rows at positions >= start + k, past the next start: hidden and rewritten later,
        like the verify's own rows past the committed tokens."""
        k = posterior.shape[1]
        if feats is not None:
            self.round_buf[:, :k] = feats
        if self.back:
            self.round_next[:, :k] = posterior

    def after_round(self, start) -> None:
        """After a round whose verified rows sit at positions start [N] + 0, 1, .. (keep_round wrote them): they are
        what is pending."""
        self.feats = self.round_buf               # (a proposer that reads no features: all buffers have width 0)
        if self.back:
            self.feat_next = self.round_next
        self.feat_pos, self.plain_run = start[:, None] + self.span, None


class Shadows:
    """Drafts taken while plain steps run (shadow drafts: hand_over), each judged by the tokens the plain steps after
    it commit. For a greedy row, and a sampled one under the coupled rule, a round of K at that position would
    have accepted exactly the proposals those tokens confirm: a shadow draft's evidence is the round's own, for the
    cost of a draft. Per slot b: [K, its K-1 proposals, how many the plain steps confirmed so far]."""

    def __init__(self):
        self.rows = {}
        self.seconds = 0.0          # the time of the shadow drafts taken since the engine last reset it

    def hand_over(self, eng, feats, feat_pos, next_ids) -> None:
        """Engine eng's pending features into the drafter's context (Pending.take's `append`): appended, or, when the
        policy asks for a shadow draft of k (Policy.shadow), taken in by a draft of k from each row's last token, as
        a round's draft takes them, whose proposals the plain steps after it judge."""
        k = eng.policy.shadow() if eng.policy is not None and hasattr(eng.policy, "shadow") else 0
        if not k:
            eng.append_step(feats, feat_pos, next_ids)
            return
        t0 = time.perf_counter()
        draft_step, _ = eng.round_steps(k)
        draft = draft_step(eng.last, eng.start, feats, feat_pos, k - 1, next_ids, **eng._draft_noise(k - 1))
        self.start(k, draft.tokens.tolist())
        self.seconds += time.perf_counter() - t0

    def start(self, k: int, proposals: list) -> None:
        """A draft of k-1 proposals per slot (proposals [N][k-1]; a free slot's are never judged: admit drops them)."""
        self.rows = {b: [k, p, 0] for b, p in enumerate(proposals)}

    def judge(self, rows: list, tokens: list, policy) -> None:
        """A plain step committed tokens[b] in each live row (rows[b] an engine._Row, None: a free slot): each draft
        that is judged now goes to policy.observe_shadow; a finished row's is dropped."""
        for b, row in enumerate(rows):
            if row is not None and b in self.rows:
                verdict = self.verdict(b, tokens[b]) if not row.done else self.drop(b)
                if verdict:
                    policy.observe_shadow(b, *verdict)

    def verdict(self, b: int, token: int) -> tuple | None:
        """Slot b committed `token` at the next position -> its draft's verdict once it is reported
        (policy.shadow_verdict: (K, the tokens a round of K would have committed)), else None."""
        found = self.rows[b]
        k, proposals, confirmed = found
        refused = proposals[confirmed] != token
        found[2] = confirmed = confirmed + (not refused)
        verdict = shadow_verdict(k, confirmed, refused)
        if verdict:
            del self.rows[b]
        return verdict

    def drop(self, b: int | None = None) -> None:
        """Forget slot b's draft (its request ended, or another came), or every slot's (a round measures them)."""
        if b is None:
            self.rows = {}
        else:
            self.rows.pop(b, None)


class Slots:
    """N slots over one target (and optionally a Proposer), caches allocated once for `capacity` positions per row,
    and fixed-shape step functions, eager or compiled (torch.compile(fullgraph=True, dynamic=False), one set per N):
        decode_step  (tok [N,1], pos [N,1])                        -> tokens [N]      AR
        plain_step   (tok [N,1], pos [N,1], buf [N,P,F], nxt [N,P] | None, slot [1]) -> tokens [N]
                                                        AR, the features kept in buf (the tokens in nxt)
        draft_step   (last [N], start [N], feats [N,P,F], feat_pos [N,P], k-1, next_ids [N,P], ...) -> Draft
        verify_step  (last [N], proposals [N,k-1], pos [N,k], q)   -> [N,2k] accepted, posterior, proposals; each
                     row's GDN states committed to its accepted tokens, the features pending (Pending.keep_round)
        append_step  (feats [N,P,F], feat_pos [N,P], next_ids [N,P]) -> pending features into the drafter's context
    Per row on the device: last (the last committed token), start (its position), the request's sampling settings,
    noise key and RoPE offset. Everything that varies per step is a device tensor, so after warm-up nothing
    recompiles. Prefill (a request's admission) runs eager, one request at a time."""

    def __init__(self, target: Qwen35, proposer: Proposer | None = None, block_size: int = 16, slots: int = 1,
                 capacity: int = 2048, compile_mode: str | None = None, compile_options: dict | None = None,
                 masks=DenseMasks):
        """masks: the class of the cached calls' masks, model.DenseMasks (SDPA) or flex.FlexMasks, built here once
        for the target and the drafter. compile_options: inductor options added to the mode's (speed/cppwrapper.py's)."""
        if slots < 1:
            raise GenerationError(f"--concurrency must be >= 1, got {slots}")
        self.target, self.proposer, self.slots, self.capacity = target, proposer, slots, capacity
        self.block = block_size if proposer is not None else 1
        check_block_size(self.block, max_block(proposer))
        self.device = dev = target.embed_tokens.weight.device
        dtype = target.dtype
        self.masks = masks(capacity, self.block, None if proposer is None else proposer.window, dev)
        self.cache = TargetCache(target.cfg, capacity, dtype, dev, batch=slots, max_block=self.block, masks=self.masks)
        self.feature_layers = tuple(proposer.feature_layers) if proposer is not None else ()
        self.offsets = torch.arange(self.block, device=dev)
        self.last, self.start = (torch.zeros(slots, dtype=torch.long, device=dev) for _ in range(2))
        # each row's request's sampling: device tensors the steps read, so a request's settings never recompile
        self.keys, self.top_k = (torch.zeros(slots, dtype=torch.long, device=dev) for _ in range(2))
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.ratio = torch.zeros(slots, dtype=torch.bool, device=dev)     # a sampled row under the ratio rule
        self.vocab_keys = noise.vocab_keys(target.cfg.vocab_size, dev)    # [V]: the noise's per-token half
        # each row's RoPE position = its cache position + rope_delta: 0 for text, after a prompt with images the
        # offset its 3-D image positions leave (vision.py)
        self.rope_delta = torch.zeros(slots, dtype=torch.long, device=dev)
        self.sampled = False          # some request of the run samples: the steps draw (else argmax only)
        self.cuts = (False, False)    # some sampled request of the run cuts by top-k; by top-p (row_probs)
        self.pending = None
        if proposer is not None:
            proposer.reset(slots, capacity, self.masks)
            width = len(self.feature_layers) * target.cfg.hidden_size
            self.pending = Pending(slots, self.block, width, int(proposer.wants_next_ids), dtype, dev)
        self.decode_step, self.plain_step = self._decode, self._plain
        self.append_step = proposer.append if proposer is not None else None
        self._graphs, self._guard, self._options = False, None, None     # with compiled steps: compiling.ModelGuard
        self._host = None                                                # _upload's pinned buffer (CUDA)
        self._by_block = {}                                              # round_steps per verify block
        if compile_mode is not None:
            self._compile(compile_mode, compile_options or {})

    def round_steps(self, k: int) -> tuple:
        """(draft_step, verify_step) for a round that verifies k <= block tokens per row. Compiled steps are
        made per k, on first use (their shapes follow k; warm_up makes every k a policy may choose)."""
        if k not in self._by_block:
            self.masks.prepare(k)                    # (FlexAttention: the draft mask of blocks of k, built eagerly)
            steps = (self.proposer.propose, self._verify)
            if self._options is not None:           # the verify reads the draft's outputs: the same CUDA graph step
                steps = (compiling.compile_step(steps[0], self._options),
                         compiling.compile_step(steps[1], self._options, continues=True))
            self._by_block[k] = steps
        return self._by_block[k]

    def _compile(self, mode: str, extra: dict) -> None:
        """Wrap the step functions in torch.compile with the mode's inductor options (compiling.py: the options, the
        checks dynamo skips and ModelGuard, which stands in for them once per run). Each distinct decoder layer is
        compiled once and called per layer (its compile region)."""
        options = self._options = compiling.inductor_options(mode, extra, self.device)
        self._graphs = self.device.type == "cuda"
        if self._graphs:
            for c in (self.cache, None if self.proposer is None else self.proposer.cache):
                if c is not None:
                    compiling.mark_static_(c)
            buffers = self.pending.buffers() if self.pending is not None else ()
            for t in (self.last, self.start, self.keys, self.vocab_keys, self.top_k, self.temperature, self.top_p,
                      self.ratio, self.rope_delta, *buffers):
                torch._dynamo.mark_static_address(t, guard=False)
        self.decode_step = compiling.compile_step(self._decode, options)
        if self.proposer is not None:
            self.plain_step = compiling.compile_step(self._plain, options)
            self.append_step = compiling.compile_step(self.proposer.append, options)
        self._guard = compiling.ModelGuard(self.target, self.proposer, "Engine")

    # ---- the steps -----------------------------------------------------------------------------

    def _choose(self, logits, at):
        if not self.sampled:
            return logits.argmax(-1)
        return choose(logits, at, self.keys, self.vocab_keys, self.temperature, self.top_p, self.top_k, self.cuts)

    def _decode(self, tok, pos):
        """One AR step for every row."""
        logits, _ = self.target(tok, pos, self.cache, rope_pos=pos + self.rope_delta[:, None])
        return self._choose(logits, pos + 1)[:, 0]

    def _plain(self, tok, pos, buf, nxt, slot):
        """_decode that also keeps the tokens' features, as column `slot` [1] of buf [N,P,F] (Pending.plain_buf), so
        that rounds can resume at any step; and, for a proposer that reads next ids, the tokens it chose as that
        column of nxt [N,P] (Pending.plain_next; None for one that reads none)."""
        logits, own = self.target(tok, pos, self.cache, feature_layers=self.feature_layers,
                                  rope_pos=pos + self.rope_delta[:, None])
        if own is not None:
            buf.index_copy_(1, slot, own)
        out = self._choose(logits, pos + 1)[:, 0]
        if nxt is not None:
            nxt.index_copy_(1, slot, out[:, None])
        return out

    def _verify(self, last, proposals, pos, q=None):
        """The target over every row's block [last, proposals] at positions pos [N,k] (start .. start + k - 1; GDN
        layers keep its writes); row i of a block judges proposal i by the token the target puts at position pos[i] + 1:
        greedy its argmax, sampled its draw with that position's noise, which is exactly plain decoding's draw there
        (the coupled rule). q [N,k-1,V]: sampled drafts' distributions; the rows of requests with the ratio rule are
        judged by speculative_accept's min(1, p/q) instead, with the uniforms and residual draws of their positions.
        Then, in the same call, COMMIT: each row keeps its accepted proposals and the bonus (TargetCache.commit), and
        the block's features and the target's tokens become the drafter's pending context (Pending.keep_round).
        A row the host then cuts shorter (a stop token, max_new_tokens) has ended: its slot is reset when the next
        request is admitted into it, so what it kept does not matter.
        -> [N, 2k] per row: accepted count, the target's k tokens (posterior), the k-1 proposals (the round's host read)"""
        block = torch.cat([last[:, None], proposals], 1)
        logits, feats = self.target(block, pos, self.cache, verify=True, feature_layers=self.feature_layers,
                                    rope_pos=pos + self.rope_delta[:, None])
        if q is None:
            posterior = self._choose(logits, pos + 1)                                    # [N,k]
        else:                    # (sampled drafts: some row samples) the draw's probabilities and noise kept
            posterior, probs, expo = choose(logits, pos + 1, self.keys, self.vocab_keys, self.temperature, self.top_p,
                                            self.top_k, self.cuts, with_draw=True)
        accepted = (block[:, 1:] == posterior[:, :-1]).int().cumprod(1).sum(1)          # [N]
        if q is not None:
            u = noise.accept_uniforms(self.keys[:, None], pos[:, 1:])
            by_ratio, drawn = speculative_accept(probs, block[:, 1:], u, expo, q)
            accepted = torch.where(self.ratio, by_ratio, accepted)
            posterior = torch.where(self.ratio[:, None], drawn, posterior)
        self.cache.commit(accepted + 1)
        self.pending.keep_round(feats, posterior)
        return torch.cat([accepted[:, None], posterior, proposals], 1)

    def _upload(self, values: list, region: int) -> torch.Tensor:
        """Host ints [N] -> a LongTensor on the device without a sync: on CUDA a non-blocking copy from region
        `region` (0: last, 1: start) of a pinned buffer. Each region is rewritten once per step,
        after the step's one host read, which has waited for the previous step's copies."""
        if self.device.type != "cuda":
            return torch.tensor(values, device=self.device)
        if self._host is None:
            self._host = torch.empty(2, self.slots, dtype=torch.long, pin_memory=True)
        host = self._host[region]
        host.copy_(torch.tensor(values))
        return host.to(self.device, non_blocking=True)

    def _draft_noise(self, n: int) -> dict:
        """rows= (noise row keys [N,n]) and temperature= [N] for a proposer that samples a sampled request's draft
        (samples_drafts), else nothing: the keys of each row's positions start+1 .. start+n, in the TARGET stream
        under the coupled rule (the draft races with the target's own noise) or the DRAFT stream under the ratio rule."""
        if not (self.sampled and self.proposer.samples_drafts):
            return {}
        at, key = self.start[:, None] + 1 + self.offsets[:n], self.keys[:, None]
        rows = torch.where(self.ratio[:, None], noise.row_keys(key, at, noise.DRAFT), noise.row_keys(key, at, noise.TARGET))
        return {"rows": rows, "temperature": self.temperature}


class Engine(Slots):
    """Requests through the Slots: admitted into free slots as they come, then steps of every slot (a round, or a plain
    step, as the policy says) until each request ends. run(requests) -> one Result per request, in order;
    generate(prompt_ids, ...) -> the Result of one. policy: adaptive speculation (policy.Policy; None = a round
    of the whole block every step). A free slot rides along in every step at position 0 and its results are
    thrown away, so the shapes never change as requests come and go."""

    def __init__(self, target: Qwen35, proposer: Proposer | None = None, block_size: int = 16, slots: int = 1,
                 capacity: int = 2048, compile_mode: str | None = None, compile_options: dict | None = None,
                 policy=None, masks=DenseMasks):
        super().__init__(target, proposer, block_size, slots, capacity, compile_mode, compile_options, masks)
        self.policy = policy
        self.shadows = Shadows()          # shadow drafts being judged by plain steps (Policy.shadow)
        self.profile = False              # synchronise the device after each draft, so Step's timings are its own
        self.calibration = None           # each step kind's seconds as warm_up measured them (policy.Policy.calibrate)

    # ---- running requests ----------------------------------------------------------------------

    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=(), on_step=None, *, sampling: Sampling | None = None,
                 seed: int | None = None, images=None, profile: bool = False) -> Result:
        """One request -> its Result. on_step(step) sees each Step as it comes; profile: synchronise the device
        between a round's draft and verify, so that each Step's draft and verify seconds are its own (CUDA)."""
        self.profile = profile
        req = Request(list(prompt_ids), max_new_tokens, tuple(stop_ids), sampling or Sampling(), seed, images)
        return self.run([req], None if on_step is None else lambda index, step: on_step(step))[0]

    def run(self, requests: list, on_step=None, observer: Observer | None = None) -> list:
        """Every request to its end, N at a time, admitted in order as slots free -> [Result] in request order.
        on_step(index, step) sees each request's steps as they come; observer: a benchmark's clock and hook."""
        self.check(requests)
        observer = observer or Observer()
        self.sampled, *cuts = draws(requests)
        self.cuts = tuple(cuts)
        if self.policy is not None:
            self.policy.reset()
        waiting, rows, results = collections.deque(enumerate(requests)), [None] * self.slots, [None] * len(requests)

        def emit(row):
            if on_step is not None:
                on_step(row.index, row.result.steps[-1])
            if row.done:
                b = rows.index(row)
                results[row.index], rows[b] = row.result, None
                if self.policy is not None:
                    self.policy.leave(b)

        with torch.inference_mode(), gc_paused():
            while True:
                for b in range(self.slots):          # free slots take the next waiting requests
                    while rows[b] is None and waiting:
                        rows[b] = self.admit(b, *waiting.popleft(), observer.clock)
                        emit(rows[b])
                        if rows[b] is None:     # ended at its first token: the slot rides at position 0, as free
                            self.last[b], self.start[b] = 0, 0
                if not any(rows):
                    return results
                live = sum(row is not None for row in rows)
                self.step(rows)
                for row in [r for r in rows if r is not None]:
                    emit(row)
                observer.stepped(live)

    def check(self, requests: list) -> None:
        """Every request checked before any runs: one error names the first bad one."""
        for i, r in enumerate(requests):
            try:
                if r.images is not None and list(r.images.ids) != list(r.prompt_ids):
                    raise GenerationError("prompt_ids must be the ImagePrompt's expanded ids (vision.encode_images)")
                check_inputs(self.target, r.prompt_ids, r.max_new_tokens, self.block, self.capacity,
                             max_block(self.proposer))
            except GenerationError as e:
                raise GenerationError(f"request {i}: {e}" if len(requests) > 1 else str(e)) from None
        if self._guard is not None:
            self._guard.check()

    def warm_up(self, requests: list) -> None:
        """A throw-away run that compiles every step kind before timed runs: the first N requests, without stops, long
        enough for 3 blocks plus one round of each verify block the policy may choose (the first one sampled, with
        top-k and top-p cuts, where the requests' draws need it: draws), under policy.Alternate when the Engine
        has a policy (every kind a policy may take). The policy is kept, calibrated with each step kind's seconds:
        cached for this machine and shape (policy.load_costs: cost_key), else timed by a second such run and
        cached."""
        blocks = self.policy.blocks if self.policy is not None else (self.block,)
        warm = [replace(r, max_new_tokens=max(1, min(3 * self.block + sum(blocks), self.capacity - len(r.prompt_ids) - self.block + 1)),
                        stop_ids=(), seed=0) for r in requests[:self.slots]]
        sampled, top_k, top_p = draws(requests)
        if draws(warm) != (sampled, top_k, top_p):      # the run's steps draw (and cut) as the timed run's will
            warm[0] = replace(warm[0], sampling=Sampling(1.0, 0.9 if top_p else 1.0, 20 if top_k else 0))
        policy, self.policy = self.policy, (Alternate(blocks) if self.policy is not None else None)
        try:
            self.run(warm)
            if policy is not None and hasattr(policy, "calibrate"):
                self.calibration = step_costs(self, warm, blocks, sampled)
                policy.calibrate(self.calibration)
        finally:
            self.policy = policy

    # ---- one step of every slot ----------------------------------------------------------------

    def admit(self, b: int, index: int, req: Request, clock=time.perf_counter) -> _Row:
        """Prefill `req` alone into slot b (its GDN states zeroed; attention slots past the prompt are masked until
        overwritten) and set the row's sampling; its first token comes from the prompt's last logits."""
        t0 = time.perf_counter()
        T0, dev, s = len(req.prompt_ids), self.device, req.sampling
        seed = None if s.greedy else (secrets.randbits(63) if req.seed is None else req.seed)
        self.keys[b] = noise.seed_key(seed) if seed is not None else 0
        self.temperature[b], self.top_p[b], self.top_k[b] = s.temperature, s.top_p, s.top_k
        self.ratio[b] = s.draft_rule == "ratio" and not s.greedy
        img = req.images
        self.rope_delta[b] = 0 if img is None else img.rope_delta
        view, pos = self.cache.row(b), torch.arange(T0, device=dev)
        view.reset()
        # The prompt goes through SDPA with a dense mask whatever the cached steps use: prefill runs eager.
        logits, feats = self.target(torch.tensor([req.prompt_ids], device=dev), pos, view, last_logits_only=True,
                                    feature_layers=self.feature_layers if self.proposer is not None else (),
                                    mask=DenseMasks(self.capacity).target(pos),
                                    rope_pos=None if img is None else img.rope_pos,
                                    image_embeds=None if img is None else img.embeds)
        row = slice(b, b + 1)
        first = int(choose(logits[:, -1:], pos[-1:][None] + 1, self.keys[row], self.vocab_keys, self.temperature[row],
                           self.top_p[row], self.top_k[row], (s.top_k > 0, s.top_p < 1))[0, 0])
        if self.proposer is not None:
            self.proposer.admit(b, feats, pos, req.prompt_ids, first)
            self.pending.join(b, feats, req.prompt_ids + [first], self.append_step, self.start, self.last)
        if self.policy is not None:
            self.policy.admit(b)
        self.shadows.drop(b)
        self.last[b], self.start[b] = first, T0
        _sync(dev)
        return _Row(index, req, seed, first, T0, time.perf_counter() - t0, clock)

    def step(self, rows: list) -> None:
        """One step of every live row: a round of the policy's k (the whole block without a policy), or a plain step;
        then every row's last token and position to the device (a free or finished row: token 0 at position 0)."""
        t0 = time.perf_counter()                # a step's seconds: from the decision to the rows' next inputs
        k = 0 if self.proposer is None else self.block if self.policy is None else self.policy.speculate()
        if k:
            committed = self.round(rows, k)
        else:
            self.shadows.seconds = 0.0
            self.plain(rows)
        live = [r is not None and not r.done for r in rows]
        self.last.copy_(self._upload([r.result.output_ids[-1] if on else 0 for r, on in zip(rows, live)], 0))
        self.start.copy_(self._upload([r.start if on else 0 for r, on in zip(rows, live)], 1))
        if self.policy is not None:
            seconds = time.perf_counter() - t0
            if k:
                self.policy.observe_round(committed, k, seconds)
            else:                               # (a shadow draft is no part of a plain step's cost)
                self.policy.observe_plain(seconds - self.shadows.seconds)

    def round(self, rows: list, k: int) -> list:
        """Draft, verify, accept and commit for every row, verifying k <= block tokens per row -> the tokens each slot
        committed (None: a free slot) (docs/method.md#one-round)."""
        draft_step, verify_step = self.round_steps(k)
        pending, start = self.pending, self.start
        self.shadows.drop()
        t0 = time.perf_counter()
        draft = Draft(torch.zeros(self.slots, 0, dtype=torch.long, device=self.device))
        if k > 1:                                                                     # DRAFT
            draft = draft_step(self.last, start, pending.feats, pending.feat_pos, k - 1, pending.feat_next,
                               **self._draft_noise(k - 1))
        else:                                   # no draft to take the pending features: into the context now
            self.append_step(pending.feats, pending.feat_pos, pending.feat_next)
        if self.profile:                        # the draft's own time (else a device's queue runs on into the verify)
            _sync(self.device)
        t1 = time.perf_counter()
        pos = start[:, None] + self.offsets[:k]          # (an input: CPU FlexAttention takes no computed positions)
        host = verify_step(self.last, draft.tokens, pos, draft.q).tolist()           # VERIFY, COMMIT; one host sync
        committed, t2 = [None] * len(rows), time.perf_counter()
        for b, row in enumerate(rows):                                                # ACCEPT
            if row is not None:
                a, post, props = host[b][0], host[b][1:k + 1], host[b][k + 1:]
                committed[b] = len(row.take("verify", props[:a] + [post[a]], props, a, (t1 - t0, t2 - t1)))
        pending.after_round(start)
        return committed

    def plain(self, rows: list) -> None:
        """One AR step for every row ("decode" without a proposer). With a proposer ("plain") the same target call
        also keeps the tokens' features for the drafter's context (Pending), so that a round can follow; its tokens
        judge the rows' shadow drafts (Shadows)."""
        t0 = time.perf_counter()
        tok, pos = self.last[:, None], self.start[:, None]
        if self.proposer is not None:
            column = self.pending.plain_column(lambda *feats: self.shadows.hand_over(self, *feats), self.start, self.last)
            pending = self.pending
            out = self.plain_step(tok, pos, pending.plain_buf, pending.plain_next if pending.back else None, column)
        else:
            out = self.decode_step(tok, pos)
        host = out.tolist()
        kind = "plain" if self.proposer is not None else "decode"
        for b, row in enumerate(rows):
            if row is not None:
                row.take(kind, [host[b]], times=(0.0, time.perf_counter() - t0))
        self.shadows.judge(rows, host, self.policy)


def step_costs(eng: Engine, warm: list, blocks: tuple, sampled: bool) -> dict:
    """Each step kind's seconds {k: s} (0: a plain step) for a warmed-up Engine: cached for this machine and shape
    (policy.load_costs under cost_key), else the median of each kind in a run of `warm` under policy.Alternate,
    stored for the next process."""
    key = cost_key(eng, blocks, sampled)
    costs = load_costs(key)
    if costs is None:
        eng.policy = timer = Alternate(blocks)
        eng.run(warm)
        costs = timer.medians()
        store_costs(key, costs)
    return costs


def cost_key(eng: Engine, blocks: tuple, sampled: bool) -> str:
    """What an Engine's step seconds depend on (policy.load_costs' key): the machine, torch, threads, the models'
    shapes, N, the capacity, the blocks, whether rows sample, the masks, the compile options, and the few-row
    products each model runs (speed/packed.py's kind: a round's seconds differ by kind); "step" names what a timing
    spans (Engine.step: from the decision to the rows' next inputs), so that timings of another span are not read."""
    t, dev = eng.target.cfg, eng.device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else compiling.cpu_model()
    drafters = [] if eng.proposer is None else [m for m in vars(eng.proposer).values()
                                                if isinstance(m, torch.nn.Module) and m is not eng.target]
    proposer = None if eng.proposer is None else (type(eng.proposer).__name__,
                                                  sum(p.numel() for m in drafters for p in m.parameters()))
    products = [getattr(m, "few_row_products", "plain") for m in (eng.target, *drafters)]    # (packed.swap_linears_)
    return json.dumps(["costs", "step", where, torch.__version__, torch.get_num_threads(), t.hidden_size, t.num_hidden_layers,
                       t.vocab_size, str(eng.target.embed_tokens.weight.dtype), proposer, eng.slots, eng.capacity,
                       list(blocks), sampled, type(eng.masks).__name__,
                       sorted((k, str(v)) for k, v in (eng._options or {}).items()), products])


def draws(requests: list) -> tuple:
    """(whether any request samples, whether any sampled one cuts by top-k, by top-p): constants of the steps."""
    sampled = [r.sampling for r in requests if not r.sampling.greedy]
    return bool(sampled), any(s.top_k > 0 for s in sampled), any(s.top_p < 1 for s in sampled)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for a run. Every step allocates per-row records (Steps, lists), and
    the collections they trigger traverse every object of the process (the models, the compiled graphs' guards), a
    cost paid again and again in a long run of many requests. The records are acyclic and freed by reference
    counting while the collector is off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run(target: Qwen35, prompt_ids: list, max_new_tokens: int, stop_ids=(), proposer: Proposer | None = None,
        block_size: int = 16, *, capacity: int | None = None, masks=DenseMasks, policy=None, **generate_kw) -> Result:
    """One generation on an Engine of one slot with caches sized for it. proposer None = plain AR decoding."""
    block = block_size if proposer is not None else 1
    capacity = check_inputs(target, prompt_ids, max_new_tokens, block, capacity, max_block(proposer))
    engine = Engine(target, proposer, block, 1, capacity, masks=masks, policy=policy)
    return engine.generate(prompt_ids, max_new_tokens, stop_ids, **generate_kw)

