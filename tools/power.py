"""
The power of the confirmatory study's primary test (docs/confirm/PLAN.md, "Power"): the share of
simulated studies of n paired seeds, each difference drawn from a normal of the given mean and std
with random.Random(seed), in which the exact sign-flip test (compare.sign_flip_p) gives p < alpha.
The test is computed over all 2^n sign patterns at once (numpy), and checked against
compare.sign_flip_p on the first studies.

    python tools/power.py                                   # the plan's settings, 400 and 50,000 studies
    python tools/power.py --means 0.086 --studies 400 50000 > docs/confirm/power.txt
"""
import argparse
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402


def power(mean, std, n, studies, seed=0, alpha=0.05, checked=200):
    """The share of `studies` simulated studies whose sign-flip p is below alpha."""
    signs = np.array([[1.0 if p >> i & 1 else -1.0 for i in range(n)] for p in range(2 ** n)])
    rng, hits = random.Random(seed), 0
    for k in range(studies):
        d = [rng.gauss(mean, std) for _ in range(n)]
        p = float(np.mean(np.abs(signs @ np.array(d)) >= abs(sum(d)) - n * 2.0 ** -22))
        if k < checked:
            assert abs(p - compare.sign_flip_p(d)) < 1e-12, (p, compare.sign_flip_p(d))
        hits += p < alpha
    return hits / studies


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--means", type=float, nargs="+", default=[0.086, 0.05, 0.04])
    ap.add_argument("--std", type=float, default=0.079, help="the exploratory study's std of the differences")
    ap.add_argument("--seeds", type=int, default=12, help="paired seeds a study (n)")
    ap.add_argument("--studies", type=int, nargs="+", default=[400, 50000])
    args = ap.parse_args()
    print(f"exact sign-flip test, alpha 0.05, {args.seeds} paired seeds, differences ~ N(mean, {args.std}), "
          "random.Random(0)")
    for mean in args.means:
        for studies in args.studies:
            print(f"mean {mean:+.3f}: power {power(mean, args.std, args.seeds, studies):.3f} over {studies} "
                  "simulated studies", flush=True)


if __name__ == "__main__":
    main()
