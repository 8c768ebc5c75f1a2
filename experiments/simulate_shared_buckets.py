"""Executed tokens of the log-prob/update passes with response buckets and shared prompts,
as a share of the plain forced pass, by simulation of the bucket choice.

    python experiments/simulate_shared_buckets.py

Response lengths as `bench_rl_step.py --natural_stops --stop_prob 0.004` draws them
(geometric, capped at R); rows in groups of k that share a prompt, groups sorted by
their longest row, cut into micro-batches of 64 rows, each run on the smallest bucket
(64, 128, 192, 256) that holds its longest row: `G P + rows x bucket` tokens.
"""

import numpy as np


def executed_share(k: int, *, p=128, r=256, rows=512, micro=64, stop_prob=0.004,
                   trials=200, seed=0) -> float:
    rng = np.random.default_rng(seed)
    buckets = np.array([64, 128, 192, 256])
    total = 0.0
    for _ in range(trials):
        lengths = np.minimum(rng.geometric(stop_prob, rows), r)
        order = np.argsort(lengths.reshape(-1, k).max(axis=1), kind="stable")
        rows_sorted = lengths[(order[:, None] * k + np.arange(k)).reshape(-1)]
        for mb in rows_sorted.reshape(-1, micro):
            width = buckets[np.searchsorted(buckets, mb.max())]
            total += micro // k * p + micro * width
    return total / trials / (rows * (p + r))


if __name__ == "__main__":
    for k in (1, 2, 4, 8):
        print(f"samples per shared prompt {k}: {100 * executed_share(k):.1f}% of the plain "
              "forced pass's tokens")
