"""
Compare GRPO, DAPO and SC-GRPO with the same budget over several seeds, and print a Markdown
table: mean +- std over seeds of the final greedy accuracy, Avg@8, Pass@8, and the number of
steps to first reach 50% greedy accuracy.

    python compare.py                          # tiny / arith, 5 seeds, 2 runs at a time
    python compare.py --seeds 0 1 --jobs 1 -- --steps 500     # flags after -- go to scgrpo.py

Each run is `scgrpo.py --model tiny --task arith --algo A --seed S` in its own process with one
thread, so the numbers repeat for the same seeds on the same machine. Runs land in
runs/compare/<algo>-s<seed>; a finished run is read back instead of re-run, but only if
scgrpo.py and the flags are unchanged since it ran (a fingerprint of both is saved with it).
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(algo, seed, out_root, extra):
    out = os.path.join(out_root, f"{algo}-s{seed}")
    metrics, stamp = os.path.join(out, "metrics.jsonl"), os.path.join(out, "fingerprint.txt")
    with open(os.path.join(HERE, "scgrpo.py"), "rb") as f:
        fingerprint = hashlib.sha256(f.read() + repr(extra).encode()).hexdigest()
    saved = ""
    if os.path.isfile(os.path.join(out, "final", "config.json")) and os.path.isfile(stamp):
        with open(stamp) as f:
            saved = f.read()
    if saved != fingerprint:  # not run yet, unfinished, or run by other code or flags
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, os.path.join(HERE, "scgrpo.py"), "--model", "tiny", "--task", "arith", "--algo", algo,
               "--seed", str(seed), "--eval-every", "100", "--eval-k", "8", "--out", out, *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        with open(stamp, "w") as f:
            f.write(fingerprint)
    with open(metrics) as f:
        evals = [m for m in map(json.loads, f) if "eval_greedy_acc" in m]
    reached = [m["step"] for m in evals if m["eval_greedy_acc"] >= 0.5]
    print(f"{algo:7s} seed {seed}: greedy {evals[-1]['eval_greedy_acc']:.3f}", file=sys.stderr)
    return dict(algo=algo, seed=seed, greedy=evals[-1]["eval_greedy_acc"], avg=evals[-1]["eval_avg_at_k"],
                passk=evals[-1]["eval_pass_at_k"], first50=reached[0] if reached else None)


def mean_std(xs):
    return f"{statistics.mean(xs):.3f} +- {statistics.pstdev(xs):.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", nargs="+", default=["grpo", "dapo", "scgrpo"], help="algorithms to compare")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds, one run each")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--out", default=os.path.join("runs", "compare"), help="folder for the runs")
    ap.add_argument("extra", nargs="*", help="flags passed on to scgrpo.py (after --)")
    args = ap.parse_args()
    jobs = [(a, s) for a in args.algos for s in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run_one(*j, args.out, args.extra), jobs))
    print("| algorithm | final greedy acc | Avg@8 | Pass@8 | steps to 50% greedy (runs that reached it) |")
    print("|---|---|---|---|---|")
    for a in args.algos:
        rs = [r for r in results if r["algo"] == a]
        hit = [r["first50"] for r in rs if r["first50"] is not None]
        steps = f"{statistics.mean(hit):.0f} +- {statistics.pstdev(hit):.0f} ({len(hit)}/{len(rs)})" if hit else f"never (0/{len(rs)})"
        print(f"| {a} | {mean_std([r['greedy'] for r in rs])} | {mean_std([r['avg'] for r in rs])} | "
              f"{mean_std([r['passk'] for r in rs])} | {steps} |")


if __name__ == "__main__":
    main()
