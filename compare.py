"""
Compare GRPO, DAPO and SC-GRPO with the same budget over several seeds: a Markdown table of
mean +- std over seeds (final greedy accuracy, Avg@8, Pass@8, steps to a target accuracy, the
median kl_p75 of SC-GRPO) and, with --plot, a PNG of held-out greedy accuracy against step.

    python compare.py                               # tiny / arith, 5 seeds: 8-12 minutes
    python compare.py --study smollm2 --plot runs/compare-smollm2/curve.png   # real model, 3 seeds: 49 min
    python compare.py --seeds 0 1 --jobs 1 -- --steps 500     # flags after -- go to scgrpo.py

Each run is scgrpo.py in its own process with one thread, `--jobs` at a time, so the numbers
repeat for the same seeds on the same machine. Runs land in <out>/<algo>-s<seed>; a finished
run is read back instead of re-run, but only if scgrpo.py and the flags are unchanged since it
ran (a fingerprint of both is saved with it).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))

# Each study: the scgrpo.py flags every run shares, the seeds, and when a run has "got there":
# `reach` is an absolute greedy accuracy, `gain` a rise over the run's own step-0 accuracy.
STUDIES = {
    "tiny": dict(flags=["--model", "tiny", "--task", "arith", "--eval-every", "100", "--eval-k", "8"],
                 seeds=[0, 1, 2, 3, 4], reach=0.5, gain=None),
    # The SmolLM2 CPU preset (12 steps), shortened to 8 so 9 runs fit in an hour on 2 cores.
    # Greedy accuracy every 2 steps on the preset's 100 held-out questions; Avg@8 and Pass@8 of the
    # final model only (k samples of 64-token answers at every evaluation would double the hour).
    "smollm2": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--steps", "8", "--eval-every", "2",
                           "--eval-k", "0"],
                    seeds=[0, 1, 2], reach=None, gain=0.10),
    # Why SC-GRPO trails GRPO on SmolLM2 (docs/ablation.md): the preset run to 20 steps, greedy
    # accuracy every 4, and arms that each remove one suspected cause (ARMS below).
    "smollm2-ablation": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--steps", "20",
                                    "--eval-every", "4", "--eval-k", "0"],
                             seeds=[0, 1, 2], reach=None, gain=0.10,
                             arms=["grpo", "scgrpo", "scgrpo-nodiv", "scgrpo-lr"]),
}

# An arm is an algorithm plus the scgrpo.py flags that change it; each algorithm is an arm of its own.
ARMS = {
    "grpo": ("grpo", []), "dapo": ("dapo", []), "scgrpo": ("scgrpo", []),
    # no solve-none route: Eq. (5)'s advantages are 0, so those groups give no gradient, as in GRPO
    "scgrpo-nodiv": ("scgrpo", ["--alpha-div", "0"]),
    # the learning rate x 1 / (mean f(D)), so that a partial group's mean per-token gradient
    # coefficient w * A matches GRPO's A: the factor is measured in docs/ablation.md
    "scgrpo-lr": ("scgrpo", ["--lr", "LR_SCALED"]),
}


def run_one(arm, seed, out_root, flags):
    algo, arm_flags = ARMS[arm]
    flags = flags + arm_flags
    out = os.path.join(out_root, f"{arm}-s{seed}")
    metrics, stamp = os.path.join(out, "metrics.jsonl"), os.path.join(out, "fingerprint.txt")
    with open(os.path.join(HERE, "scgrpo.py"), "rb") as f:
        fingerprint = hashlib.sha256(f.read() + repr(flags).encode()).hexdigest()
    saved = ""
    if os.path.isfile(os.path.join(out, "final", "config.json")) and os.path.isfile(stamp):
        with open(stamp) as f:
            saved = f.read()
    if saved != fingerprint:  # not run yet, unfinished, or run by other code or flags
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, os.path.join(HERE, "scgrpo.py"), "--algo", algo, "--seed", str(seed), "--out", out,
               *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        with open(stamp, "w") as f:
            f.write(fingerprint)
    with open(metrics) as f:
        lines = [json.loads(line) for line in f]
    evals = [m for m in lines if "eval_greedy_acc" in m]
    if "eval_avg_at_k" not in evals[-1]:
        evals[-1].update(final_avg_and_pass(out, fingerprint))
    kl_p75 = [m["kl_p75"] for m in lines if "kl_p75" in m]
    print(f"{arm:12s} seed {seed}: greedy {evals[0]['eval_greedy_acc']:.3f} -> {evals[-1]['eval_greedy_acc']:.3f}",
          file=sys.stderr)
    return dict(arm=arm, seed=seed, curve=[(m["step"], m["eval_greedy_acc"]) for m in evals],
                avg=evals[-1]["eval_avg_at_k"], passk=evals[-1]["eval_pass_at_k"],
                kl_p75=statistics.median(kl_p75) if kl_p75 else None,
                seconds=sum(m["seconds"] for m in lines if "seconds" in m))


def final_avg_and_pass(out, fingerprint, k=8):
    """Avg@k and Pass@k of a run's final model on its evaluation questions, in a subprocess with
    one thread (cached in final_eval.json beside the fingerprint it belongs to)."""
    path = os.path.join(out, "final_eval.json")
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.pop("fingerprint") == fingerprint:
            return saved
    code = f"import json, compare; print(json.dumps(compare.evaluate_final({os.path.join(out, 'final')!r}, {k})))"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=HERE)
    if r.returncode != 0:
        sys.exit(f"error: evaluating {out}/final failed:\n{r.stderr[-2000:]}")
    res = json.loads(r.stdout.splitlines()[-1])
    with open(path, "w") as f:
        json.dump({**res, "fingerprint": fingerprint}, f)
    return res


# Second wordings of the addition task's held-out sums, never seen in training: does what a run
# learned carry over to another phrasing of the same question?
WORDINGS = {"add": "Add {a} and {b}.",
            "story": "Sam has {a} marbles and finds {b} more. How many marbles does Sam have now?"}


def reworded(rows, template):
    """The same sums, asked another way (rows of the addition task: 'What is a + b?')."""
    out = []
    for r in rows:
        a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", r["question"]).groups()
        out.append({**r, "question": template.format(a=a, b=b)})
    return out


def evaluate_final(folder, k):
    """scgrpo.evaluate on a saved final model, with the run's own config and questions; on the
    addition task also the greedy accuracy on each of WORDINGS."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import plumbing as P
    import scgrpo as S
    with open(os.path.join(folder, "run_config.json")) as f:
        cfg = S.Config(**{**json.load(f), "eval_k": k})
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    test_rows, eos = P.load_task(cfg)[1][:cfg.eval_n], P.stop_ids(model, tok)
    res, _ = S.evaluate(model, tok, test_rows, cfg, eos)
    for name, template in (WORDINGS.items() if cfg.task == "addition" else ()):
        greedy = dataclasses.replace(cfg, eval_k=0)
        res[f"greedy_{name}"] = S.evaluate(model, tok, reworded(test_rows, template), greedy, eos)[0][
            "eval_greedy_acc"]
    return res


def steps_to(curve, reach, gain):
    """First evaluated step whose greedy accuracy reaches `reach`, or step 0's accuracy + `gain`."""
    target = reach if reach is not None else curve[0][1] + gain - 1e-9
    return next((step for step, acc in curve if acc >= target), None)


def mean_std(xs, fmt=".3f"):
    return f"{statistics.mean(xs):{fmt}} +- {statistics.pstdev(xs):{fmt}}"


def table(results, algos, reach, gain):
    target = f"{reach:.0%} greedy" if reach is not None else f"+{gain * 100:.0f} points"
    rows = [f"| algorithm | final greedy acc | Avg@8 | Pass@8 | steps to {target} (runs that got there) | "
            "median kl_p75 (nats) | train s/run |", "|---|---|---|---|---|---|---|"]
    for a in algos:
        rs = [r for r in results if r["arm"] == a]
        hit = [s for s in (steps_to(r["curve"], reach, gain) for r in rs) if s is not None]
        steps = f"{mean_std(hit, '.1f')} ({len(hit)}/{len(rs)})" if hit else f"never (0/{len(rs)})"
        kl = [r["kl_p75"] for r in rs if r["kl_p75"] is not None]
        rows.append(f"| {a} | {mean_std([r['curve'][-1][1] for r in rs])} | {mean_std([r['avg'] for r in rs])} | "
                    f"{mean_std([r['passk'] for r in rs])} | {steps} | {mean_std(kl) if kl else '-'} | "
                    f"{statistics.mean(r['seconds'] for r in rs):.0f} |")
    return "\n".join(rows)


def plot(results, algos, path, title):
    """Held-out greedy accuracy against step: the mean over seeds as a line, min..max shaded."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for a in algos:
        curves = [dict(r["curve"]) for r in results if r["arm"] == a]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        accs = [[c[s] for c in curves] for s in steps]
        line, = ax.plot(steps, [statistics.mean(x) for x in accs], marker="o", label=f"{a} ({len(curves)} seeds)")
        ax.fill_between(steps, [min(x) for x in accs], [max(x) for x in accs], color=line.get_color(), alpha=0.15)
    ax.set(xlabel="training step", ylabel="held-out greedy accuracy", title=title, ylim=(0, 1))
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", choices=sorted(STUDIES), default="tiny", help="model, task and seeds to compare")
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=None,
                    help="arms to compare (default: the study's, else grpo dapo scgrpo)")
    ap.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds, one run each (default: the study's)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--out", default="", help="folder for the runs (default runs/compare-<study>)")
    ap.add_argument("--plot", default="", help="also write the learning curves to this PNG (needs matplotlib)")
    ap.add_argument("extra", nargs="*", help="flags passed on to scgrpo.py (after --)")
    args = ap.parse_args()
    study = STUDIES[args.study]
    out = args.out or os.path.join("runs", f"compare-{args.study}")
    arms = args.arms or study.get("arms", ["grpo", "dapo", "scgrpo"])
    jobs = [(a, s) for a in arms for s in (args.seeds or study["seeds"])]
    t0 = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run_one(*j, out, study["flags"] + args.extra), jobs))
    print(table(results, arms, study["reach"], study["gain"]))
    print(f"{len(jobs)} runs, {args.jobs} at a time: {(time.time() - t0) / 60:.1f} minutes (runs read back cost none)",
          file=sys.stderr)
    if args.plot:
        plot(results, arms, args.plot, f"{args.study}: held-out greedy accuracy, mean and min..max over seeds")
        print(f"learning curves: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
