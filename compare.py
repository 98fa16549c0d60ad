"""
Compare GRPO, DAPO, SC-GRPO and variants of it ("arms": an algorithm plus scgrpo.py flags) with
the same budget over several seeds: Markdown tables of mean +- std over seeds (final greedy
accuracy, Avg@8, Pass@8, steps to a target accuracy; the share of groups per route, mean f(D),
median kl_p75, how far the weights moved) and, with --plot, a picture of training reward and
held-out greedy accuracy against step (tools/plot.py, which draws any run's curves too).

    python compare.py                               # tiny / arith, 5 seeds: 8-12 minutes
    python compare.py --study smollm2 --plot runs/compare-smollm2/curve.png   # real model, 3 seeds: 49 min
    python compare.py --study smollm2-ablation --plot docs/ablation/curve.png --report docs/ablation
    python compare.py --seeds 0 1 --jobs 1 -- --steps 500     # flags after -- go to scgrpo.py

Each run is scgrpo.py in its own process with one thread, `--jobs` at a time, so the numbers
repeat for the same seeds on the same machine. Runs land in <out>/<arm>-s<seed>; a finished
run is read back instead of re-run, but only if scgrpo.py and the flags are unchanged since it
ran (a fingerprint of both is saved with it); a run the study started and was stopped in (Ctrl-C,
a killed process) resumes from its last checkpoint. A folder holding anything else is never deleted:
it is named in one line and the run goes to <arm>-s<seed>-v2 (-v3, ...) beside it, unless
--rerun-stale asks to replace it. --report copies each run's small files (logs, final
evaluation) and the tables into a folder, for docs/; those files read back as the finished run
(the model is not needed), so a study cut short on one machine goes on elsewhere from its report:

    mkdir -p runs/compare-smollm2-paper && cp -r docs/paper_regime/run_logs/* runs/compare-smollm2-paper/
"""
import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
# every process a study starts runs on one thread, so --jobs runs share the cores evenly
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

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
    # The paper's regime (docs/paper_regime.md): 8 questions x 8 answers a step as the paper
    # updates on, five paired seeds (seed s gives every arm the same first batch), 12 steps (about
    # 2 minutes a step here: more seeds beat more steps), greedy accuracy every 4, the update size
    # logged; the last two arms are the labelled options (skip Eq. (5)-only steps; one window).
    # scgrpo.py's SmolLM2 preset keeps 4 questions a step: beside a second one-thread job an
    # SC-GRPO step took 115-155 s at 8 (docs/paper_regime.md) against a median 31 s at 4 (the
    # ablation's 60 steps), and the preset is the 8-minute CPU demo; this study sets 8.
    "smollm2-paper": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--prompts-per-step", "8",
                                 "--steps", "12", "--eval-every", "4", "--eval-k", "0", "--log-update-size"],
                          seeds=[0, 1, 2, 3, 4], reach=None, gain=0.10,
                          arms=["grpo", "scgrpo", "scgrpo-skip", "scgrpo-window"]),
}

# An arm is an algorithm plus the scgrpo.py flags that change it; each algorithm is an arm of its own.
ARMS = {
    "grpo": ("grpo", []), "dapo": ("dapo", []), "scgrpo": ("scgrpo", []),
    # solve-none groups get advantage 0 (Eq. 5 scaled by 0): still routed and scored by the
    # teacher, they give no gradient, as GRPO's skipped groups
    "scgrpo-nodiv": ("scgrpo", ["--alpha-div", "0"]),
    # the learning rate x 1 / (mean f(D) of the scgrpo arm): measured from that arm's runs, so this
    # arm runs after the others (a function name in place of flags)
    "scgrpo-lr": ("scgrpo", "lr_matched"),
    # not the paper's: a step whose only gradient is Eq. (5)'s applies no update
    "scgrpo-skip": ("scgrpo", ["--eq5-only-step", "skip"]),
    # not the paper's: Eq. (5) scores every answer of a group over the group's shortest answer
    "scgrpo-window": ("scgrpo", ["--eq5-window", "group"]),
}


def lr_matched(results, flags):
    """scgrpo.py flags for the scgrpo-lr arm, from the scgrpo arm's finished runs. A token of an
    answer with advantage A gets the gradient coefficient A from GRPO and f(D) * A from SC-GRPO
    (Eq. 3), so SC-GRPO's mean per-token coefficient is mean f(D) times GRPO's: the arm runs at
    lr / mean f(D), the mean of `weight_mean` over the steps of the scgrpo runs that logged one
    (a step whose groups all fall back or skip logs none), the factor rounded to one decimal.
    (`weight_mean` is f(D) over a step's active tokens of partial and solve-none answers
    together; metrics.jsonl keeps no partial-only mean.) The lr it scales is the last --lr in
    `flags`, else the model's preset."""
    import scgrpo as S
    w = [x for r in results if r["arm"] == "scgrpo" for x in r["weight_means"]]
    if not w:
        sys.exit("error: the scgrpo arm's runs logged no weight_mean, which the scgrpo-lr arm needs")
    lr = float(last_flag(flags, "--lr") or S.PRESETS.get(last_flag(flags, "--model"), S.PRESETS["hub"])["lr"])
    factor = round(1 / statistics.mean(w), 1)
    print(f"scgrpo-lr: mean f(D) {statistics.mean(w):.4f} over {len(w)} steps -> lr {lr:g} x {factor}",
          file=sys.stderr)
    return ["--lr", f"{lr * factor:.3g}"]


def code_bytes():
    """The code a run executes: scgrpo.py and every file of machinery/, in a fixed order (the
    method moved part of its machinery there, which changes what a run computes just as well)."""
    names = ["scgrpo.py"] + sorted(os.path.join("machinery", n) for n in
                                   os.listdir(os.path.join(HERE, "machinery")) if n.endswith(".py"))
    out = b""
    for name in names:
        with open(os.path.join(HERE, name), "rb") as f:
            out += name.encode() + b"\0" + f.read()
    return out


def last_flag(flags, name):
    """The value of the last `name` in a scgrpo.py flag list (the one that wins), or None."""
    at = [i for i, f in enumerate(flags) if f == name]
    return flags[at[-1] + 1] if at else None


ROUTES = ["grpo", "partial", "fallback", "none", "skipped"]


def route_counts(steps, G, algo):
    """Groups per route over a run's logged steps. metrics.jsonl counts SC-GRPO's routes and the
    skipped groups; GRPO's and DAPO's updated groups are their answers_updated / G (DAPO's
    dropped groups never reach a route)."""
    groups = {route: sum(m[f"groups_{route}"] for m in steps) for route in ROUTES[1:]}
    return {"grpo": 0 if algo == "scgrpo" else sum(m["answers_updated"] for m in steps) // G, **groups}


def die(msg):
    """Bad input: one line and exit code 2."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def read_text(path):
    """A small file's text, or None if there is no such file."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def machine():
    """One line naming the CPU and torch a run ran on. The same run re-done on another CPU of the
    same kind can take another path from its second step (its sums differ in the last digits,
    then the sampled answers), so a study kept across machines says which run ran where."""
    first_cpu = (read_text("/proc/cpuinfo") or "").split("\n\n")[0]  # Linux; elsewhere: empty
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in info.get("flags", "").split()]  # the bf16 kernels
    name = info.get("model name", platform.processor() or platform.machine())
    return (f"{name} ({' '.join(bf16) or 'no bf16 flags'}), {os.cpu_count()} cores, "
            f"torch {importlib.metadata.version('torch')}\n")


# What a report keeps of each run (run_logs/<run>), enough for a later study to read the run back:
# the resolved Config, the logs, the fingerprint (the first three: every finished run has them), the
# cached evaluations and weight change, and where it ran (a line per scgrpo.py process)
SMALL_FILES = ("config.json", "metrics.jsonl", "fingerprint.txt", "final_eval.json", "moved.json", "base_eval.json",
               "machine.txt")


def run_folder(arm, seed, out_root, fingerprint, rerun_stale):
    """-> (the folder for one run, what to do there: "read" it back, "run" it, or "resume" it). A
    finished run with this fingerprint is read back. A folder holding anything else (a run of other
    code or flags, an unfinished run, a user's files) is never deleted unless --rerun-stale asks: it
    is named in one line and the run goes to the next free <arm>-s<seed>-vN beside it (which a later
    study of the same code and flags reads back). This study's own unfinished attempt at the same
    run (started.txt holds this fingerprint) is resumed from its last checkpoint (one thread: the
    same numbers as a run never stopped), or removed and re-run when it saved none."""
    base, stale = os.path.join(out_root, f"{arm}-s{seed}"), None
    for n in range(1, 1000):
        out = base if n == 1 else f"{base}-v{n}"
        done, started = read_text(os.path.join(out, "fingerprint.txt")), read_text(os.path.join(out, "started.txt"))
        # scgrpo.py returned 0 (fingerprint.txt is written only then) and left its small files: a
        # report's run_logs/<run> copied here reads back the same (the model itself is not needed)
        finished = done is not None and all(os.path.isfile(os.path.join(out, f)) for f in SMALL_FILES[:3])
        if finished and done == fingerprint:
            return out, "read"
        if os.path.exists(out) and not finished and started == fingerprint:  # our own interrupted attempt
            from machinery.runs import find_checkpoint  # what --resume reads (torch: only on this path)
            if find_checkpoint(out):
                print(f"note: {out} holds this study's interrupted run; resuming it from its last checkpoint",
                      file=sys.stderr)
                return out, "resume"
            shutil.rmtree(out)
        if not os.path.exists(out):
            if stale:
                print(f"note: {base} holds {stale}; kept, and this run goes to {out} (--rerun-stale would "
                      f"replace {base} instead)", file=sys.stderr)
            return out, "run"
        what = ("a finished run of other code or flags (its fingerprint differs)" if finished else
                "no finished run of this code and flags")
        if rerun_stale and n == 1:
            print(f"note: {out} holds {what}; replacing it (--rerun-stale)", file=sys.stderr)
            shutil.rmtree(out)
            return out, "run"
        stale = stale or what
    die(f"{base} and the 998 -vN folders beside it are all taken; pass another --out")


def run_one(arm, seed, out_root, flags, rerun_stale=False):
    """One run of scgrpo.py (or its saved results) -> a dict of what the tables need. flags: the
    study's and the arm's scgrpo.py flags."""
    algo = ARMS[arm][0]
    fingerprint = hashlib.sha256(code_bytes() + repr(flags).encode()).hexdigest()
    out, how = run_folder(arm, seed, out_root, fingerprint, rerun_stale)
    metrics = os.path.join(out, "metrics.jsonl")
    if how == "run":
        os.makedirs(out)
        with open(os.path.join(out, "started.txt"), "w") as f:
            f.write(fingerprint)
    if how != "read":  # a resumed run keeps the flags its checkpoint saved
        cmd = [sys.executable, os.path.join(HERE, "scgrpo.py"),
               *(["--resume", out] if how == "resume" else ["--algo", algo, "--seed", str(seed), "--out", out, *flags])]
        with open(os.path.join(out, "machine.txt"), "a") as f:  # a resumed run adds a line
            f.write(machine())
        r = subprocess.run(cmd, capture_output=True, text=True, env=ONE_THREAD)
        if r.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        with open(os.path.join(out, "fingerprint.txt"), "w") as f:
            f.write(fingerprint)
    with open(metrics) as f:
        lines = [json.loads(line) for line in f]
    evals = [m for m in lines if "eval_greedy_acc" in m]
    wanted = ["eval_avg_at_k"] + [f"greedy_{w}" for w in WORDINGS if last_flag(flags, "--task") == "addition"]
    if any(k not in evals[-1] for k in wanted):  # evaluated once more, on the final model
        extra = final_eval(out, fingerprint)
        evals[-1].update({k: v for k, v in extra.items() if k not in evals[-1]})
    kl_p75 = [m["kl_p75"] for m in lines if "kl_p75" in m]
    print(f"{arm:12s} seed {seed}: greedy {evals[0]['eval_greedy_acc']:.3f} -> {evals[-1]['eval_greedy_acc']:.3f}"
          + ("" if os.path.basename(out) == f"{arm}-s{seed}" else f" ({out})"), file=sys.stderr)
    steps = [m for m in lines if "reward_mean" in m]
    with open(os.path.join(out, "config.json")) as f:  # the run's resolved Config
        groups = route_counts(steps, json.load(f)["group_size"], algo)
    return dict(arm=arm, seed=seed, out=out, flags=flags, fingerprint=fingerprint,
                curve=[(m["step"], m["eval_greedy_acc"]) for m in evals],
                avg=evals[-1]["eval_avg_at_k"], passk=evals[-1]["eval_pass_at_k"],
                wordings={w: evals[-1][f"greedy_{w}"] for w in WORDINGS if f"greedy_{w}" in evals[-1]},
                kl_p75=statistics.median(kl_p75) if kl_p75 else None, groups=groups,
                weight_means=[m["weight_mean"] for m in steps if "weight_mean" in m],
                # steps whose only routed groups were solve-none ones (SC-GRPO: Eq. 5 alone gave
                # the gradient; with --alpha-div 0 there was none)
                eq5_only=sum(m["groups_none"] > 0 and m["groups_partial"] + m["groups_fallback"] == 0
                             for m in steps),
                n_steps=len(steps), last_len=steps[-1]["len_mean"], steps=steps,
                seconds=sum(m["seconds"] for m in lines if "seconds" in m))


def final_eval(out, fingerprint, k=8):
    """The final model's Avg@k, Pass@k and (addition) greedy accuracy on each of WORDINGS, by
    scgrpo.py --eval-only on out/final (cached in final_eval.json beside its fingerprint)."""
    return evaluations(out, "final_eval", fingerprint, ["--model", os.path.join(out, "final")], k)


# Second wordings of the addition task's held-out sums, never seen in training: does what a run
# learned carry over to another phrasing of the same question?
WORDINGS = {"add": "Add {a} and {b}.",
            "story": "Sam has {a} marbles and finds {b} more. How many marbles does Sam have now?"}
WORDING_LABELS = {"add": "'Add a and b.'", "story": "'Sam has a marbles...'"}


def wordings_in(results):
    """The WORDINGS that some run was evaluated on (the addition task's studies only)."""
    return [w for w in WORDINGS if any(w in r["wordings"] for r in results)]


def reworded(rows, template):
    """The same sums, asked another way (rows of the addition task: 'What is a + b?')."""
    out = []
    for r in rows:
        a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", r["question"]).groups()
        out.append({**r, "question": template.format(a=a, b=b)})
    return out


def eval_only(flags, out):
    """python scgrpo.py --eval-only FLAGS --out OUT in a subprocess with one thread -> its eval.json."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, os.path.join(HERE, "scgrpo.py"), "--eval-only", *flags, "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ONE_THREAD, cwd=HERE)
    if r.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "eval.json")) as f:
        return json.load(f)


def evaluations(folder, name, fingerprint, flags, k):
    """A model's held-out evaluation with eval_k = k, and on the addition task its greedy
    accuracy on each of WORDINGS (the same questions, reworded, as a --data folder), each one
    scgrpo.py --eval-only with `flags`; kept in folder/name.json with the fingerprint."""
    path, work = os.path.join(folder, name + ".json"), os.path.join(folder, name)
    saved = json.loads(read_text(path) or "{}")
    if saved.pop("fingerprint", None) == fingerprint:
        return saved
    held_out = eval_only([*flags, "--eval-k", str(k)], os.path.join(work, "held-out"))
    res = {key: held_out[key] for key in ("eval_greedy_acc", "eval_avg_at_k", "eval_pass_at_k")
           if key in held_out}
    for w in (WORDINGS if held_out["task"] == "addition" else ()):
        data = os.path.join(work, f"{w}-data")
        os.makedirs(data, exist_ok=True)
        from machinery.tasks import make_addition  # the held-out sums, then asked another way
        for split, rows in zip(("train", "test"), make_addition()):
            with open(os.path.join(data, f"{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in reworded(rows, WORDINGS[w]))
        res[f"greedy_{w}"] = eval_only([*flags, "--eval-k", "0", "--data", data],
                                       os.path.join(work, w))["eval_greedy_acc"]
    with open(path, "w") as f:
        json.dump({**res, "fingerprint": fingerprint}, f)
    shutil.rmtree(work)
    return res


def steps_to(curve, reach, gain):
    """First evaluated step whose greedy accuracy reaches `reach`, or step 0's accuracy + `gain`."""
    target = reach if reach is not None else curve[0][1] + gain - 1e-9
    return next((step for step, acc in curve if acc >= target), None)


def mean_std(xs, fmt=".3f"):
    return f"{statistics.mean(xs):{fmt}} +- {statistics.pstdev(xs):{fmt}}"


def table(results, arms, reach, gain):
    """Outcome per arm, mean +- std over seeds: accuracy at the end, how soon it rose, and the
    greedy accuracy on the unseen wordings (when the task has them)."""
    target = f"{reach:.0%} greedy" if reach is not None else f"+{gain * 100:.0f} points"
    words = wordings_in(results)
    rows = [f"| arm | final greedy acc | Avg@8 | Pass@8 | steps to {target} (runs that got there) | "
            + "".join(f"greedy on {WORDING_LABELS[w]} | " for w in words) + "train s/run |",
            "|---|---|---|---|---|" + "---|" * len(words) + "---|"]
    for a in arms:
        rs = [r for r in results if r["arm"] == a]
        hit = [s for s in (steps_to(r["curve"], reach, gain) for r in rs) if s is not None]
        steps = f"{mean_std(hit, '.1f')} ({len(hit)}/{len(rs)})" if hit else f"never (0/{len(rs)})"
        rows.append(f"| {a} | {mean_std([r['curve'][-1][1] for r in rs])} | {mean_std([r['avg'] for r in rs])} | "
                    f"{mean_std([r['passk'] for r in rs])} | {steps} | "
                    + "".join(f"{mean_std([r['wordings'][w] for r in rs if w in r['wordings']])} | "
                              for w in words)
                    + f"{statistics.mean(r['seconds'] for r in rs):.0f} |")
    return "\n".join(rows)


def mechanics(results, arms):
    """How each arm trained: the share of groups per route over all steps and seeds, the mean
    f(D) and median kl_p75 (SC-GRPO), and how far the weights moved from the start."""
    rows = ["| arm | groups: " + " / ".join(ROUTES) + " | mean f(D) | median kl_p75 (nats) | "
            "steps with only solve-none groups | lr | weight change ‖θ−θ₀‖/‖θ₀‖ |",
            "|---|---|---|---|---|---|---|"]
    for a in arms:
        rs = [r for r in results if r["arm"] == a]
        total = sum(sum(r["groups"].values()) for r in rs)
        share = " / ".join(f"{sum(r['groups'][k] for r in rs) / total:.0%}" for k in ROUTES)
        w = [statistics.mean(r["weight_means"]) for r in rs if r["weight_means"]]
        kl = [r["kl_p75"] for r in rs if r["kl_p75"] is not None]
        moved = [r["moved"] for r in rs if r.get("moved") is not None]
        lr = last_flag(rs[0]["flags"], "--lr") or "preset"
        # GRPO and DAPO route no group 'none' (their all-wrong groups are skipped): no such steps
        eq5 = f"{sum(r['eq5_only'] for r in rs)} of {sum(r['n_steps'] for r in rs)}" if ARMS[a][0] == "scgrpo" else "-"
        rows.append(f"| {a} | {share} | {mean_std(w) if w else '-'} | {mean_std(kl) if kl else '-'} | {eq5} | {lr} | "
                    f"{mean_std(moved, '.2e') if moved else '-'} |")
    return "\n".join(rows)


def collapsed(r):
    """A run that ended answering with (almost) nothing or solving no held-out question."""
    return r["last_len"] < 3 or r["curve"][-1][1] == 0


def bootstrap_interval(diffs, level=0.90, n=10000, seed=0):
    """Percentile bootstrap interval for the mean of paired differences (the seeds resampled)."""
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(diffs, k=len(diffs))) for _ in range(n))
    return means[int(n * (1 - level) / 2)], means[int(n * (1 + level) / 2) - 1]


def paired(results, arms, base="grpo"):
    """Final greedy accuracy per arm (mean, median, range), its paired difference to `base`
    (the same seed, so the same first batch) with a 90% bootstrap interval, and the collapses."""
    by = {(r["arm"], r["seed"]): r for r in results}
    rows = [f"| arm | final greedy acc: mean / median / min..max | minus {base}, same seed: mean [90% "
            "bootstrap interval] (pairs) | collapsed (final len_mean < 3 or greedy 0) |", "|---|---|---|---|"]
    for a in arms:
        rs = [r for r in results if r["arm"] == a]
        acc = [r["curve"][-1][1] for r in rs]
        diffs = [r["curve"][-1][1] - by[base, r["seed"]]["curve"][-1][1] for r in rs if (base, r["seed"]) in by]
        diff = "-"
        if a != base and len(diffs) > 1:
            lo, hi = bootstrap_interval(diffs)
            diff = f"{statistics.mean(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}] ({len(diffs)})"
        down = [r["seed"] for r in rs if collapsed(r)]
        rows.append(f"| {a} | {statistics.mean(acc):.3f} / {statistics.median(acc):.3f} / {min(acc):.2f}..{max(acc):.2f} "
                    f"| {diff} | {len(down)} of {len(rs)}{f' (seeds {down})' if down else ''} |")
    return "\n".join(rows)


def diagnostics(results, arms):
    """How big Eq. (5)'s part of each step was, from the logged diagnostics: Eq. (5)-only steps,
    the median share grad_norm_none / grad_norm in steps that also had reward-carrying answers,
    and (with --log-update-size) the median update size in Eq. (5)-only steps and in the others."""
    rows = ["| arm | Eq. (5)-only steps | median grad_norm_none / grad_norm, mixed steps | median update "
            "size, Eq. (5)-only steps | median update size, other steps |", "|---|---|---|---|---|"]
    for a in arms:
        steps = [m for r in results if r["arm"] == a for m in r["steps"]]
        eq5 = [m for m in steps if m.get("eq5_only")]
        mixed = [m["grad_norm_none"] / m["grad_norm"] for m in steps if not m.get("eq5_only")
                 and m.get("grad_norm_none") and m["grad_norm"] > 0]
        size = [[m["update_size"] for m in part if m.get("update_size") is not None and m["answers_updated"]]
                for part in (eq5, [m for m in steps if not m.get("eq5_only")])]
        cells = [f"{statistics.median(x):.3g} ({len(x)})" if x else "-" for x in (mixed, *size)]
        rows.append(f"| {a} | {len(eq5)} of {len(steps)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def per_run(results):
    """Every run on its own line: greedy accuracy at each evaluation, then the final numbers."""
    steps = sorted({s for r in results for s, _ in r["curve"]})
    words = wordings_in(results)
    rows = ["| arm | seed | " + " | ".join(f"step {s}" for s in steps) + " | Avg@8 | Pass@8 | "
            + "".join(f"{WORDING_LABELS[w]} | " for w in words) + "weight change |",
            "|---|---|" + "---|" * (len(steps) + 3 + len(words))]
    for r in results:
        curve = dict(r["curve"])
        moved = f"{r['moved']:.2e}" if r.get("moved") is not None else "-"
        rows.append(f"| {r['arm']} | {r['seed']} | " + " | ".join(f"{curve[s]:.2f}" if s in curve else "-"
                                                                  for s in steps)
                    + f" | {r['avg']:.3f} | {r['passk']:.3f} | "
                    + "".join(f"{r['wordings'].get(w, float('nan')):.2f} | " for w in words)
                    + f"{moved} |")
    return "\n".join(rows)


def cached_run(code, path, fingerprint, what):
    """The JSON that `code` prints last, run in a subprocess with one thread, and kept at `path`
    with the fingerprint (run code and flags) it belongs to: read back while that still matches."""
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.pop("fingerprint", None) == fingerprint:
            return saved
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ONE_THREAD,
                       cwd=HERE)
    if r.returncode != 0:
        sys.exit(f"error: {what} failed:\n{r.stderr[-2000:]}")
    res = json.loads(r.stdout.splitlines()[-1])
    with open(path, "w") as f:
        json.dump({**res, "fingerprint": fingerprint}, f)
    return res


def weight_change(out, fingerprint):
    """||theta_final - theta_0|| / ||theta_0|| of a run, against the model it started from (in
    a subprocess with one thread, cached in moved.json)."""
    code = ("import json, torch\nfrom machinery.models import load_model\n"
            "from transformers import AutoModelForCausalLM\n"
            f"cfg = json.load(open({os.path.join(out, 'final', 'run_config.json')!r}))\n"
            "a = load_model(cfg['model'], cfg['seed'])[0].state_dict()\n"
            f"b = AutoModelForCausalLM.from_pretrained({os.path.join(out, 'final')!r}).state_dict()\n"
            "d = sum(float((b[k].float() - a[k].float()).pow(2).sum()) for k in a if k in b)\n"
            "n = sum(float(a[k].float().pow(2).sum()) for k in a if k in b)\n"
            "print(json.dumps({'moved': (d / n) ** 0.5}))")
    return cached_run(code, os.path.join(out, "moved.json"), fingerprint,
                      f"measuring the weight change of {out}")["moved"]


def plot(results, arms, path, title):
    """Training reward and held-out greedy accuracy against step, drawn by tools/plot.py: per arm
    the mean over its seeds, min..max shaded; the reward as a running mean of about 4% of the
    steps (odd; 1, the raw values, up to 49 steps)."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import plot as curve_tool  # tools/plot.py (this function is named plot too)
    runs = [r for a in arms for r in results if r["arm"] == a]
    n_seeds = {a: sum(r["arm"] == a for r in runs) for a in arms}
    labels = {r["out"]: f"{r['arm']} ({n_seeds[r['arm']]} seed{'s' * (n_seeds[r['arm']] > 1)})" for r in runs}
    smooth = max(1, max(r["n_steps"] for r in runs) // 25) | 1
    _, series = curve_tool.curves([r["out"] for r in runs], smooth=smooth, mean=True, labels=labels)
    curve_tool.draw(title, series, path, smooth)


def report(folder, results, arms, study, base, first):
    """The study's tables and each run's small output files under `folder` (docs/ keeps them)."""
    for r in results:
        dst = os.path.join(folder, "run_logs", f"{r['arm']}-s{r['seed']}")  # not -vN: the report's names
        os.makedirs(dst, exist_ok=True)
        for name in SMALL_FILES:
            if os.path.isfile(os.path.join(r["out"], name)):
                shutil.copy(os.path.join(r["out"], name), dst)
    with open(os.path.join(folder, "base_eval.json"), "w") as f:
        json.dump(base, f)
    cmd = " ".join(["python compare.py", *sys.argv[1:]])
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(f"Written by `{cmd}`; each run's logs are in run_logs/ beside this file.\n\n"
                f"{table(results, arms, study['reach'], study['gain'])}\n\n{paired(results, arms)}\n\n"
                f"{mechanics(results, arms)}\n\n{diagnostics(results, arms)}\n\n"
                f"Each run (greedy accuracy on the held-out questions at each evaluated step):\n\n"
                f"{per_run(results)}\n\n"
                f"Mean +- std over seeds (population std). The model {first['arm']} seed {first['seed']} started "
                "from, greedy: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()) + "\n")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not the usage text
        die(f"{message} (see --help)")


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default after its help (none where the help says)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, "") else super()._get_help_string(action)


def count(low):
    """An argparse type: an integer >= low (argparse names the flag and the value in the error)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; use {low} or more")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def parse_args(argv):
    """compare.py's own flags, and the scgrpo.py flags after `--` (kept apart here, so that a stray
    word before `--` is an error and not a flag for every run)."""
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = Parser(description=__doc__, formatter_class=Help, allow_abbrev=False,
                usage="%(prog)s [options] [-- scgrpo.py flags for every run]")
    ap.add_argument("--study", choices=sorted(STUDIES), default="tiny", help="model, task and seeds to compare")
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=None, metavar="ARM",
                    help=f"arms to compare, of {', '.join(sorted(ARMS))} (default: the study's, else grpo dapo "
                    "scgrpo)")
    ap.add_argument("--seeds", nargs="+", type=count(0), default=None, metavar="SEED",
                    help="seeds, one run each (default: the study's: " +
                    "; ".join(f"{k} {' '.join(map(str, v['seeds']))}" for k, v in STUDIES.items()) + ")")
    ap.add_argument("--jobs", type=count(1), default=2, metavar="N", help="runs at a time (one thread each)")
    ap.add_argument("--out", default="", help="folder for the runs (default: runs/compare-<study>)")
    ap.add_argument("--rerun-stale", action=argparse.BooleanOptionalAction, default=False,
                    help="replace a run folder of other code or flags instead of keeping it and running into a "
                    "new <arm>-s<seed>-vN folder")
    ap.add_argument("--plot", default="", help="also write the learning curves (tools/plot.py) to this .png, .pdf "
                    "or .svg (needs matplotlib)")
    ap.add_argument("--report", default="", help="write the tables and each run's small files to this folder")
    args = ap.parse_args(own)
    args.extra = extra
    for flag, values in (("--arms", args.arms), ("--seeds", args.seeds)):
        if values and len(set(values)) < len(values):
            die(f"{flag} {' '.join(map(str, values))} names one twice (two runs into one folder); name each once")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in (".png", ".pdf", ".svg"):
        die(f"--plot {args.plot}: name a .png, .pdf or .svg file")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # found before hours of runs, not after
        die("--plot needs matplotlib: pip install -r requirements-bench.txt")
    for flag, path in (("--out", args.out), ("--report", args.report)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            die(f"{flag} {path} is a file; name a folder")
    for name in ("--algo", "--seed", "--out"):
        if name in extra:
            die(f"{name} after -- would override what each run's arm, seed or folder sets; use --arms, "
                "--seeds or --out of compare.py")
    return args


def main():
    args = parse_args(sys.argv[1:])
    study = STUDIES[args.study]
    out = args.out or os.path.join("runs", f"compare-{args.study}")
    arms = args.arms or study.get("arms", ["grpo", "dapo", "scgrpo"])
    seeds = args.seeds or study["seeds"]
    # seed by seed, so a study stopped part way leaves whole paired seeds behind
    jobs = [(a, s) for s in seeds for a in arms]
    flags = study["flags"] + args.extra
    if "scgrpo-lr" in arms and "scgrpo" not in arms:
        die("the scgrpo-lr arm's learning rate is measured from the scgrpo arm's runs; add scgrpo to --arms")
    t0, results = time.time(), []
    # arms whose flags are measured from other arms' runs (scgrpo-lr) run after them
    for derived in (False, True):
        arm_flags = {a: globals()[ARMS[a][1]](results, flags) if derived else ARMS[a][1]
                     for a in arms if isinstance(ARMS[a][1], str) == derived}
        with ThreadPoolExecutor(args.jobs) as pool:
            results += list(pool.map(lambda j: run_one(*j, out, flags + arm_flags[j[0]], args.rerun_stale),
                                     [j for j in jobs if j[0] in arm_flags]))
    results.sort(key=lambda r: (arms.index(r["arm"]), seeds.index(r["seed"])))
    if args.report:
        for r in results:
            r["moved"] = weight_change(r["out"], r["fingerprint"])
        # the model the first run started from (with --model tiny, seed-dependent), evaluated greedily
        first = results[0]
        res = evaluations(first["out"], "base_eval", first["fingerprint"],
                          [*first["flags"], "--seed", str(first["seed"])], 0)
        base = {k: v for k, v in res.items() if k.startswith(("eval_greedy", "greedy_"))}
        report(args.report, results, arms, study, base, first)
    print(table(results, arms, study["reach"], study["gain"]))
    print(paired(results, arms))
    print(mechanics(results, arms))
    print(diagnostics(results, arms))
    print(f"{len(jobs)} runs, {args.jobs} at a time: {(time.time() - t0) / 60:.1f} minutes (runs read back cost none)",
          file=sys.stderr)
    if args.plot:
        plot(results, arms, args.plot, f"study {args.study}")
        print(f"learning curves: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
