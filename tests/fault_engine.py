"""A stand-in engine for check.py's own test: this project's engine (engine.Engine) with one of the faults engines
on hybrid targets have shipped injected, and the engine's top logprobs recorded, as a serving engine returns them.

    FAULTS                     the faults by name, each with what it does
    StandIn(target, proposer, block, slots, capacity, fault, policy, logprobs)   an Engine with `fault`
    traces(engine, prompts, max_new, ...)       -> one trace per prompt, as check.py reads them

Everything that reaches into the engine's internals is here, in StandIn: the cache's commit (a GDNCache's kept
verify call: keys, writes, decay, window; rec and conv), the verify step, a round and a plain step, and the greedy
choice (to record logits). A fault changes only what its name says; with fault None the stand-in is the engine.
"""
from __future__ import annotations

import torch

import engine
import kernels
from model import GDNCache

FAULTS = {
    "no_state_rollback": "after a partial acceptance the GDN recurrent state keeps the whole verified block "
                         "(the conv window is rolled back)",
    "no_conv_rollback": "after a partial acceptance the GDN conv window keeps the whole verified block (the "
                        "recurrent state is rolled back)",
    "stale_state_slot": "a zero-draft (plain) step after a round that accepted drafts reads the state slot of the "
                        "round's first token, not of its accepted ones",
    "block_rollback_undone": "a round that accepted no draft rolls its whole block back in name only: the "
                             "recurrent state keeps every verified token",
    "row_state_leak": "row 0's GDN recurrent state takes in a little of row 1's at every commit",
    "drafter_context_leak": "row 0's drafter context is overwritten by row 1's after every round (drafts only: "
                            "the output stays the target's)",
    "verify_positions": "the verify step's RoPE positions are one past the tokens' own",
    "overaccept": "a round that rejects a draft accepts it all the same (one draft past the first mismatch)",
}


class StandIn(engine.Engine):
    """engine.Engine with `fault` (a FAULTS name, or None) and, with logprobs > 0, each committed token's top
    `logprobs` log-probabilities recorded per request (positions of the token's own: `lp[request][position]`)."""

    def __init__(self, target, proposer=None, block_size=16, slots=1, capacity=512, fault=None, policy=None,
                 logprobs=0):
        super().__init__(target, proposer, block_size, slots, capacity, policy=policy)
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        self.fault, self.logprobs = fault, logprobs
        self.lp, self.owner = {}, [None] * slots         # request index -> {position: [(id, logprob)]}; slot -> index
        self.k, self.n_used, self.before, self.stale = None, None, None, None
        self.cache.commit = self.commit                   # (an instance attribute: the verify step calls it)

    # ---- the engine's hooks ----------------------------------------------------------------------

    def admit(self, b, index, req, *clock):
        """(The first token, from prefill, gets no logprobs: as a token a server reports without them.)"""
        self.owner[b] = index
        self.lp[index] = {}
        return super().admit(b, index, req, *clock)

    def _choose(self, logits, at):
        if self.logprobs:
            self.record(logits, at)
        return super()._choose(logits, at)

    def round(self, rows, k):
        self.k = k
        if self.fault == "stale_state_slot":
            self.before = [(l.rec.clone(), l.conv.clone()) for l in self.gdn()]
        committed = super().round(rows, k)
        if self.fault == "stale_state_slot":
            self.stale = [b for b, c in enumerate(committed) if c is not None and c > 1]     # (None: a free slot)
        if self.fault == "drafter_context_leak" and self.slots > 1:
            for layer in self.proposer.cache.layers:
                layer.k[0].copy_(layer.k[1])
                layer.v[0].copy_(layer.v[1])
        return committed

    def plain(self, rows):
        if self.fault == "stale_state_slot" and self.stale:
            for layer, (rec0, _) in zip(self.gdn(), self.before):     # the state after the round's first token
                one = kernels.state_after(layer.keys, layer.writes, layer.decay, rec0, 1)
                for b in self.stale:
                    layer.rec[b].copy_(one[b])
                    layer.conv[b].copy_(layer.window[b, 1:1 + layer.conv.shape[1]])
        self.stale = None
        super().plain(rows)

    def _verify(self, last, proposals, pos, q=None):
        if self.fault == "verify_positions":
            self.rope_delta += 1
            try:
                out = super()._verify(last, proposals, pos, q)
            finally:
                self.rope_delta -= 1
            return out
        out = super()._verify(last, proposals, pos, q)
        if self.fault == "overaccept":
            out[:, 0] = self.n_used - 1
        return out

    def commit(self, n) -> None:
        """TargetCache.commit with the fault: each GDN layer's state after n[b] tokens of the kept verify call, or
        after more where the fault says."""
        k, f = self.k, self.fault
        n = torch.as_tensor(n, device=self.device).reshape(-1).expand(self.slots).clone()
        if f == "overaccept":
            n = torch.where(n < k, n + 1, n)
            self.n_used = n
        n_rec = n_conv = n
        if f == "no_state_rollback":
            n_rec = torch.full_like(n, k)
        elif f == "no_conv_rollback":
            n_conv = torch.full_like(n, k)
        elif f == "block_rollback_undone":
            n_rec = torch.where(n == 1, k, n)
        for layer in self.gdn():
            rec = kernels.state_after(layer.keys, layer.writes, layer.decay, layer.rec, n_rec)
            if f == "row_state_leak" and self.slots > 1:
                rec[0] = rec[0] + 0.25 * rec[1]
            layer.rec.copy_(rec)
            rows = n_conv[:, None] + torch.arange(layer.conv.shape[1], device=self.device)
            layer.conv.copy_(layer.window.gather(1, rows[..., None].expand(-1, -1, layer.window.shape[2])))

    # ---- helpers -------------------------------------------------------------------------------------

    def gdn(self) -> list:
        return [l for l in self.cache.layers if isinstance(l, GDNCache)]

    def record(self, logits, at) -> None:
        """Top log-probabilities of logits [N,k,V] at positions at [N,k] (the position of the token each row
        chooses), for the requests in the slots."""
        lp = logits.float().log_softmax(-1).topk(self.logprobs, dim=-1)
        vals, ids, at = lp.values.tolist(), lp.indices.tolist(), at.tolist()
        for i, b in enumerate(range(len(vals))):
            if self.owner[b] is None:
                continue
            for j, p in enumerate(at[i]):
                self.lp[self.owner[b]][p] = [[t, v] for t, v in zip(ids[i][j], vals[i][j])]


def traces(eng: StandIn, prompts: list, max_new: int, sampling=None, seed=None, claimed=None) -> list:
    """Every prompt through `eng` (its slots in flight) -> one trace each (check.py's format: draft_ids,
    acceptance_lengths, step_kinds, block_size, dtype, and top_logprobs where recorded). claimed: the sampling
    settings the trace says (a trace at the wrong temperature), default the run's."""
    reqs = [engine.Request(list(p), max_new, (), sampling or engine.Sampling(), None if seed is None else seed + i)
            for i, p in enumerate(prompts)]
    results = eng.run(reqs)
    s = claimed or sampling
    out = []
    for i, r in enumerate(results):
        t = {"name": f"request {i}", "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
             "dtype": str(eng.target.embed_tokens.weight.dtype).replace("torch.", "")}
        if eng.proposer is not None:
            t |= {"draft_ids": r.draft_ids, "acceptance_lengths": r.acceptance_lengths, "step_kinds": r.step_kinds,
                  "block_size": eng.block}
        if s is not None and not s.greedy:
            t |= {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": r.seed}
        if eng.logprobs:
            T0 = len(r.prompt_ids)
            t["top_logprobs"] = [eng.lp[i].get(T0 + j) for j in range(len(r.output_ids))]
        out.append(t)
    return out
