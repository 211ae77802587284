"""The per-step cost of the draft-length schedules, in microseconds (CPU, no model).

Feeds each schedule the steps of a synthetic drafter (acceptance 0.7 per position, seconds that grow with the
tokens drafted and scored) and times what the speculative loop calls per step: reading `draft_length` and
`update(...)`. The goodput schedule's cost grows with its bound (a loop over draft positions).

    python examples/schedule_overhead.py [--steps 20000] [--bounds 4,6,8]
"""

import argparse
import random
import time

from hf_speculators.schedules import SCHEDULES, make_schedule
from hf_speculators.step import RowOutcome


def synthetic_steps(num_steps: int, bound: int, seed: int = 0) -> list[tuple]:
    """`update` arguments of `num_steps` steps, drafted at lengths up to `bound` (precomputed, not timed)."""
    rng, steps = random.Random(seed), []
    for _ in range(num_steps):
        k = rng.randint(0, bound)
        accepted = 0
        while accepted < k and rng.random() < 0.7:
            accepted += 1
        outcome = RowOutcome(0, k, k, k, list(range(accepted)), accepted + 1, False)  # one row
        steps.append(([outcome], 0.003 * k * rng.uniform(0.9, 1.1), (0.010 + 0.001 * (k + 1)) * rng.uniform(0.9, 1.1)))
    return steps


def microseconds_per_step(name: str, bound: int, steps: list[tuple]) -> float:
    schedule = make_schedule(name, bound)
    start = time.perf_counter()
    for outcomes, draft_seconds, verify_seconds in steps:
        schedule.draft_length  # what the loop reads before a step
        schedule.update(outcomes, draft_seconds, verify_seconds)
    return (time.perf_counter() - start) / len(steps) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--bounds", default="4,6,8", help="comma-separated num_draft_tokens (the goodput bound)")
    args = parser.parse_args()
    print(f"{'schedule':<10} {'bound':>5} {'us/step':>8}")
    for bound in (int(b) for b in args.bounds.split(",")):
        steps = synthetic_steps(args.steps, bound)
        for name in SCHEDULES:
            cost = min(microseconds_per_step(name, bound, steps) for _ in range(3))  # the least disturbed of 3 runs
            print(f"{name:<10} {bound:>5} {cost:>8.2f}")


if __name__ == "__main__":
    main()
