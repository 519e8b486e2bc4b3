"""The adaptive policy (policy.Policy) without timing a model: at given step costs, on drawn acceptance or replayed
on real acceptance maps, against pure rounds of the whole block and AR, so a setting of the policy is judged in
seconds (docs/method.md#adaptive-speculation).

    python tools/policy_sim.py                                  # drawn acceptance; a round of 16: 3 plain steps
    python tools/policy_sim.py --costs "{0: 1, 16: 5, 8: 3.5, 4: 2.7, 2: 2.2}"     # rounds dear (many rows, a slow CPU)
    python tools/policy_sim.py maps MAPS.json --heldout 16      # the embedded pair's acceptance maps, every prompt set
    python tools/policy_sim.py replay MAPS.json --costs "{...}" [--budget 0.15 --keep 0.9 --prior-weight 0.5 --prior-floor 0.5]
    python tools/policy_sim.py replay MAPS.json --costs "{..., 'shadow': 0.9}" --shadow-every 0   # no shadow drafts
    python tools/policy_sim.py memory MAPS.json                 # how well a row's past rounds foretell its next

Drawn: a round commits its whole block one time in `p`, else 1-3 tokens (uniformly), one request of 128 tokens at a
time, 200 requests per p; printed per p: the policy's tokens per second over pure rounds' and over AR's.

Maps: for each prompt of each set (prompts.py: the held-out prompts and prompts.OUTSIDE), the greedy output of
--max-new-tokens tokens and, at every output position j and for every verify block k the policy chooses among
(policy.verify_blocks), A[k][j]: the tokens a round of k drafting there commits (the drafter run on a block of k,
its k - 1 proposals matched against the output, plus the target's own token). A round's proposals depend only on
the context's features, which plain steps and rounds feed alike, so A[k][j] is what any step sequence meets at j.
A shorter block's proposals are not the whole block's first k - 1: the drafter attends across its block, and on the
embedded pair a round of 8 commits 5-19% fewer tokens than the first 8 of a round of 16 would
(docs/measurements.md#adaptive-speculation-against-pure-rounds). A map whose A is one list (written by hand, or by
an older version) stands for the whole block, and a round of k is read as committing min(A[j], k).
Replay: the policy of an Engine of one slot (one_slot_policy) decides on each map as the engine would, at the given costs (a plain step costs the key 0, AR's
decode step `ar`, default equal to a plain step, what a shadow draft adds to its plain step `shadow`, default a
plain step), every decision's seconds reported to it, shadow drafts judged as the engine judges them (run); per set, the medians over
prompts of policy / pure rounds and policy / AR. Tune on some sets and judge on prompts.UNTUNED.
Memory: per set, the rounds pure rounds of the whole block take on each map (each where the last one's tokens end):
the correlation of consecutive rounds' tokens, and for each MEMORY_KEEPS the mean absolute error of a row's
estimate (policy.Rows: a decayed average of its past rounds, weight `keep` per round; here without the prior) as the
forecast of its next round's tokens.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import policy as policy_module   # noqa: E402
from policy import GenerationError, Policy   # noqa: E402

DRAWN_COSTS = "{0: 1.0, 16: 3.0, 8: 2.1, 4: 1.8, 2: 1.6}"
MEMORY_KEEPS = (0.0, 0.3, 0.5, 0.7, 0.9)       # the decays `memory` compares


def run(commits, costs: dict, policy: Policy | None, tokens: int, block: int = 16) -> float:
    """One request of `tokens` tokens (the first from the prefill) -> its seconds: pure rounds of `block` (policy
    None) or the policy's steps; commits(j, k): the tokens a round of k commits with j tokens committed. As in the
    engine, plain steps hand their features over to the drafter's context at the first plain step after a round and
    then every `block` plain steps; a hand-over the policy makes a shadow draft (Policy.shadow) costs costs["shadow"]
    more, and its verdict (what a round there would commit) reaches the policy when the plain steps after it have
    judged it far enough (policy.shadow_verdict, as in the engine)."""
    if policy is not None:
        policy.reset()
        policy.admit(0)
    t, got = 0.0, 1
    since, judging = 0, None        # plain steps since the last hand-over (None: a round came last); the shadow draft
    while got < tokens:             # being judged
        k = block if policy is None else policy.speculate()
        if k:
            c = min(commits(got - 1, k), k, tokens - got)
            got, t = got + c, t + costs[k]
            since, judging = None, None
            if policy is not None:
                policy.observe_round([c], k, costs[k])
            continue
        if policy is not None and (since is None or since == block):
            since, shadow = 0, policy.shadow()
            if shadow:          # [K, the proposals a round of K there accepts, how many plain steps confirmed]
                judging, t = [shadow, min(commits(got - 1, shadow), shadow) - 1, 0], t + costs["shadow"]
        got, t = got + 1, t + costs[0]
        if policy is not None:
            since += 1
            if judging:
                refused = judging[2] == judging[1]
                judging[2] += not refused
                verdict = policy_module.shadow_verdict(judging[0], judging[2], refused)
                if verdict:
                    policy.observe_shadow(0, *verdict)
                    judging = None
            policy.observe_plain(costs[0])
    return t


def one_slot_policy(block: int, calibration: dict, params: dict) -> Policy:
    """The policy an Engine of one slot runs (its blocks: policy.engine_blocks), calibrated with the given step
    costs; params: Policy's other settings (and `blocks`, to try others)."""
    return policy_module.engine_policy(block, 1, calibration, **params)


def drawn(costs: dict, params: dict) -> None:
    costs = {**{"shadow": costs[0]}, **costs}
    step_costs = {k: v for k, v in costs.items() if k != "shadow"}     # (the policy's calibration)
    for p_long in (0.0, 0.05, 0.1, 0.17, 0.25, 0.35):
        pol, pure = [], []
        for s in range(200):
            for out, policy in ((pol, one_slot_policy(16, step_costs, params)), (pure, None)):
                rng = random.Random(s)
                out.append(128 / run(lambda j, k: 16 if rng.random() < p_long else rng.randint(1, 3), costs, policy, 128))
        print(f"p {p_long}: policy / pure rounds {statistics.mean(pol) / statistics.mean(pure):.2f}, "
              f"policy / AR {statistics.mean(pol) * costs[0]:.2f}")


def replay(maps: dict, costs: dict, params: dict) -> dict:
    """maps: {set: [{"tokens", "block", "A"}]} (acceptance_maps; A as committer reads it); costs: {k: seconds}, AR's
    decode step under "ar" (default: a plain step's) -> {set: {"policy_over_pure", "policy_over_ar",
    "pure_over_ar"}}: medians over the set's prompts. A map of each block's own acceptance that lacks a block the
    policy chooses among: ValueError."""
    costs = dict(costs)
    ar = costs.pop("ar", costs[0])
    costs.setdefault("shadow", costs[0])
    step_costs = {k: v for k, v in costs.items() if k != "shadow"}     # (the policy's calibration)
    table = {}
    for name, prompts in maps.items():
        ratios = {"policy_over_pure": [], "policy_over_ar": [], "pure_over_ar": []}
        for m in prompts:
            n, block, commits = m["tokens"], m["block"], committer(m["A"])
            policy = one_slot_policy(block, step_costs, params)
            missing = sorted(set(policy.blocks) - {int(k) for k in m["A"]}) if isinstance(m["A"], dict) else []
            if missing:
                raise ValueError(f"the maps of set {name} have no acceptance for verify blocks {missing}; write them "
                                 "again: python tools/policy_sim.py maps MAPS.json")
            pure = run(commits, costs, None, n, block)
            pol = run(commits, costs, policy, n, block)
            ratios["policy_over_pure"].append(pure / pol)
            ratios["policy_over_ar"].append((n - 1) * ar / pol)
            ratios["pure_over_ar"].append((n - 1) * ar / pure)
        table[name] = {k: statistics.median(v) for k, v in ratios.items()}
        print(f"{name:12s} policy / pure rounds {table[name]['policy_over_pure']:.3f}  policy / AR "
              f"{table[name]['policy_over_ar']:.3f}  (pure rounds / AR {table[name]['pure_over_ar']:.3f})")
    return table


def memory(maps: dict, keeps=MEMORY_KEEPS) -> dict:
    """maps as replay reads them -> {set: {"correlation": of consecutive pure rounds' tokens, "error": {keep: mean
    absolute error of the decayed average's forecast of the next round}}} (module docstring), printed per set."""
    table = {}
    for name, prompts in maps.items():
        pairs, errors = [], {keep: [] for keep in keeps}
        for m in prompts:
            commits, n, block = committer(m["A"]), m["tokens"], m["block"]
            tokens, got = [], 1
            while got < n:                              # pure rounds of the whole block, as run() takes them
                tokens.append(min(commits(got - 1, block), block, n - got))
                got += tokens[-1]
            pairs += list(zip(tokens, tokens[1:]))
            for keep in keeps:               # the policy's own estimate of a row (policy.Rows), without its prior
                rows = policy_module.Rows((block,), keep, prior_p=1.0, prior_weight=0.0, prior_floor=0.0)
                rows.admit(0)
                for t in tokens:
                    if rows.weights[0][block]:
                        errors[keep].append(abs(rows.summed([0])[block] - t))
                    rows.add_round(0, block, t)
        xs, ys = zip(*pairs) if pairs else ((), ())
        try:
            r = statistics.correlation(xs, ys)
        except statistics.StatisticsError:                  # fewer than two pairs, or either member constant
            r = float("nan")
        table[name] = {"correlation": r, "error": {k: statistics.mean(e) if e else None for k, e in errors.items()}}
        print(f"{name:12s} consecutive rounds' tokens correlate {table[name]['correlation']:.2f}; forecast error by keep: "
              + ", ".join(f"{k} {e:.2f}" for k, e in table[name]["error"].items() if e is not None))
    return table


def committer(A):
    """A map's A -> commits(j, k): the tokens a round of k commits at output position j. A: {k: [..]} (each verify
    block's own acceptance, as acceptance_maps writes it; JSON keys as strings), or one list for the whole block,
    read as min(A[j], k)."""
    if isinstance(A, dict):
        own = {int(k): v for k, v in A.items()}
        return lambda j, k: own[k][j]
    return lambda j, k: min(A[j], k)


def acceptance_maps(args) -> dict:
    """{set: [{"tokens": n, "block": B, "A": {k: [..]}}]} for the pair of --target / --draft (the embedded pair by
    default): each prompt's output length, the drafter's block and each verify block's acceptance map."""
    import torch
    import checkpoint as ckpt
    import dflash
    import prompts as P
    from model import DenseMasks, DraftCache
    target = ckpt.load_target(args.target, torch.float32)
    drafter = ckpt.load_drafter(args.draft, target.cfg, torch.float32)
    block, layers = drafter.cfg.block_size, tuple(drafter.cfg.target_layer_ids)
    blocks = policy_module.verify_blocks(block)
    tok, stops = ckpt.load_tokenizer(target.path), ckpt.stop_token_ids(target.path, target.cfg)
    sets = {"heldout": P.heldout_prompts(tok, args.heldout)}
    sets.update({name: P.outside_prompts(name, tok, args.heldout) for name in P.OUTSIDE})
    maps = {}
    with torch.inference_mode():
        for name, prompts in sets.items():
            maps[name] = []
            for p in prompts:
                out = dflash.generate(target, drafter, p, args.max_new_tokens, block, stops)
                seq, T0 = p + out, len(p)
                pos = torch.arange(len(seq))
                _, feats = target(torch.tensor([seq]), pos, None, feature_layers=layers)
                context, masks = DraftCache(drafter.cfg, len(seq) + block, drafter.dtype, "cpu"), DenseMasks(len(seq) + block)
                drafter.append_context(feats[:, :T0], pos[:T0], context)
                A = {k: [] for k in blocks}
                for j in range(len(out) - 1):               # rounds drafting at out[j], position T0 + j
                    if j:
                        drafter.append_context(feats[:, T0 + j - 1:T0 + j], pos[T0 + j - 1:T0 + j], context)
                    last = torch.tensor([out[j]])
                    for k in blocks:                        # each block drafted as a round of k drafts it
                        hidden = drafter.draft_block(last, torch.tensor([T0 + j]), k - 1, target.embed_tokens, context,
                                                     masks)
                        proposals = drafter.propose(hidden[0], last, target.lm_head)[0].tolist()
                        a = 0
                        while a < k - 1 and j + 1 + a < len(out) and proposals[a] == out[j + 1 + a]:
                            a += 1
                        A[k].append(a + 1)
                maps[name].append({"tokens": len(out), "block": block, "A": A})
            means = ", ".join(f"{k} {statistics.mean(a for m in maps[name] for a in m['A'][k]):.2f}" for k in blocks)
            print(f"{name}: {len(prompts)} prompts, mean tokens per round of {means}", file=sys.stderr)
    return maps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=("drawn", "maps", "replay", "memory"), default="drawn")
    p.add_argument("file", nargs="?", help="maps: where to write the maps; replay, memory: the maps to read")
    p.add_argument("--costs", default=None, help="{k: seconds} (0: a plain step; 'ar': AR's decode step, replay only; "
                   "'shadow': what a shadow draft adds to its plain step, default a plain step's)")
    p.add_argument("--shadow-every", type=int, default=None, help="policy.SHADOW_EVERY (0: no shadow drafts)")
    p.add_argument("--keep", type=float, default=None)
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--prior-weight", type=float, default=None)
    p.add_argument("--prior-floor", type=float, default=None)
    p.add_argument("--target", default=None, help="maps: the target (default: the embedded one)")
    p.add_argument("--draft", default=None, help="maps: the drafter (default: the embedded one)")
    p.add_argument("--heldout", type=int, default=16, help="maps: prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    if args.mode != "drawn" and not args.file:
        p.error(f"{args.mode} needs a file: python tools/policy_sim.py {args.mode} MAPS.json")
    params = {k: v for k, v in (("keep", args.keep), ("budget", args.budget), ("prior_weight", args.prior_weight),
                                ("prior_floor", args.prior_floor)) if v is not None}
    if args.shadow_every is not None:
        if args.shadow_every < 0:
            p.error(f"--shadow-every must be >= 0, got {args.shadow_every}")
        policy_module.SHADOW_EVERY = args.shadow_every
    try:
        costs = {(k if k in ("ar", "shadow") else int(k)): float(v)
                 for k, v in ast.literal_eval(args.costs or DRAWN_COSTS).items()}
    except (ValueError, SyntaxError, AttributeError):
        p.error(f"--costs {args.costs!r} is not a dict such as {DRAWN_COSTS}")
    if args.mode == "drawn" and "ar" in costs:
        p.error("--costs: 'ar' applies to replay only (drawn acceptance's AR step costs a plain step, the key 0)")
    try:
        one_slot_policy(16, None, params)
    except GenerationError as e:
        p.error(str(e))
    if args.mode == "maps":
        import options
        args.target, args.draft = args.target or options.DEFAULT_TARGET, args.draft or options.DEFAULT_DRAFT
        with open(args.file, "w") as f:
            json.dump(acceptance_maps(args), f)
    elif args.mode in ("replay", "memory"):
        with open(args.file) as f:
            maps = json.load(f)
        try:
            print(json.dumps(replay(maps, costs, params) if args.mode == "replay" else memory(maps)))
        except ValueError as e:
            p.error(str(e))
    else:
        drawn(costs, params)


if __name__ == "__main__":
    main()
