"""The adaptive policy (policy.Policy) on drawn acceptance at given step costs, against pure rounds of the whole block
and AR: no model runs, so a setting of the policy can be judged in seconds (docs/method.md#adaptive-speculation).

    python tools/policy_sim.py                                          # a round of 16: 3 plain steps
    python tools/policy_sim.py "{0: 1, 16: 5, 8: 3.5, 4: 2.7, 2: 2.2}"   # rounds dear (many rows, or a slow CPU)
    python tools/policy_sim.py "{0: 1, 16: 2, 8: 1.6, 4: 1.4, 2: 1.3}"   # rounds cheap (a GPU's memory-bound verify)

A round's acceptance is heavy-tailed: here a round commits its whole block one time in `p`, else 1-3 tokens
(uniformly), one request of 128 tokens at a time, 200 requests per p. Printed per p: the policy's tokens per
second over pure rounds' and over AR's (a plain step costs 1, AR's decode as much: the drafter's context kept by a
plain step is not charged here).
"""
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from policy import Policy   # noqa: E402


def tokens_per_second(costs: dict, p_long: float, seed: int, pure: bool, tokens: int = 128, **params) -> float:
    rng = random.Random(seed)
    policy = Policy(block=16, calibration=costs, **params)
    policy.admit(0)
    t, got = 0.0, 1
    while got < tokens:
        k = 16 if pure else policy.speculate()
        if k:
            c = min(16 if rng.random() < p_long else rng.randint(1, 3), k)
            got, t = got + c, t + costs[k]
            policy.observe_round([c], k, costs[k])
        else:
            got, t = got + 1, t + costs[0]
            policy.observe_plain(costs[0])
    return got / t


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    costs = {int(k): float(v) for k, v in eval(argv[0]).items()} if argv else {0: 1.0, 16: 3.0, 8: 2.1, 4: 1.8, 2: 1.6}
    cells = []
    for p_long in (0.0, 0.05, 0.1, 0.17, 0.25, 0.35):
        pol = statistics.mean(tokens_per_second(costs, p_long, s, False) for s in range(200))
        pure = statistics.mean(tokens_per_second(costs, p_long, s, True) for s in range(200))
        cells.append(f"p {p_long}: policy / pure rounds {pol / pure:.2f}, policy / AR {pol / costs[0]:.2f}")
    print("\n".join(cells))


if __name__ == "__main__":
    main()
