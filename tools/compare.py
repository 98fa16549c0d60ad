"""
Compare GRPO, DAPO, SC-GRPO and variants of it ("arms": a program and its flags) with
the same budget over several seeds: Markdown tables of mean +- std over seeds (final greedy
accuracy, Avg@8, Pass@8, steps to a target accuracy; the share of groups per route, mean f(D),
median kl_p75, how far the weights moved) and, with --plot, a picture of training reward and
held-out greedy accuracy against step (tools/plot.py, which draws any run's curves too).

    python tools/compare.py                               # tiny / arith, 5 seeds: 8-12 minutes
    python tools/compare.py --study smollm2 --plot runs/compare-smollm2/curve.png   # real model, 3 seeds: 49 min
    python tools/compare.py --study smollm2-ablation --plot docs/ablation/curve.png --report docs/ablation
    python tools/compare.py --seeds 0 1 --jobs 1 -- --steps 500     # flags after -- go to scgrpo.py

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
import importlib.util
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))  # tools/
ROOT = os.path.dirname(HERE)  # the repository: scgrpo.py and machinery/
sys.path.insert(0, ROOT)
from machinery import at_least, machine  # noqa: E402 (no torch: compare.py starts without it)

# every process a study starts runs on one thread, so --jobs runs share the cores evenly; the
# evaluations it starts import this file (tools/) and machinery/ (the repository)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYTHONPATH": os.pathsep.join([HERE, ROOT])}

# Each study: the scgrpo.py flags every run shares, the seeds, and when a run has "got there":
# `reach` is an absolute greedy accuracy, `gain` a rise over the run's own step-0 accuracy.
# The SmolLM2 studies name --dtype fp32, the precision their committed runs ran in: auto was fp32
# on every CPU then, and now picks bf16 on a CPU with bf16 instructions (models.resolve_dtype).
STUDIES = {
    "tiny": dict(flags=["--model", "tiny", "--task", "arith", "--eval-every", "100", "--eval-k", "8"],
                 seeds=[0, 1, 2, 3, 4], reach=0.5, gain=None),
    # The SmolLM2 CPU preset (12 steps), shortened to 8 so 9 runs fit in an hour on 2 cores.
    # Greedy accuracy every 2 steps on the preset's 100 held-out questions; Avg@8 and Pass@8 of the
    # final model only (k samples of 64-token answers at every evaluation would double the hour).
    "smollm2": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--steps", "8", "--eval-every", "2",
                           "--eval-k", "0", "--dtype", "fp32"],
                    seeds=[0, 1, 2], reach=None, gain=0.10),
    # Why SC-GRPO trails GRPO on SmolLM2 (docs/ablation.md): the preset run to 20 steps, greedy
    # accuracy every 4, and arms that each remove one suspected cause (ARMS below).
    "smollm2-ablation": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--steps", "20",
                                    "--eval-every", "4", "--eval-k", "0", "--dtype", "fp32"],
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
                                 "--steps", "12", "--eval-every", "4", "--eval-k", "0", "--log-update-size",
                                 "--dtype", "fp32"],
                          seeds=[0, 1, 2, 3, 4], reach=None, gain=0.10,
                          arms=["grpo", "scgrpo", "scgrpo-skip", "scgrpo-window"]),
    # The confirmatory study, fixed in advance by docs/confirm/PLAN.md: the exploratory study's config
    # with fp32 named, 12 new seeds, three arms (the paper's SC-GRPO; its token weights without Eq. (5);
    # GRPO), and each final model also evaluated greedily on 1,000 further held-out sums (`confirm`).
    "smollm2-confirm": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--prompts-per-step", "8",
                                   "--steps", "12", "--eval-every", "4", "--eval-k", "0", "--log-update-size",
                                   "--dtype", "fp32"],
                            seeds=list(range(100, 112)), reach=None, gain=0.10, confirm=True,
                            arms=["grpo", "scgrpo", "scgrpo-nodiv"]),
    # The paper's comparators, one exploratory run each (docs/variants.md): the confirmatory study's
    # configuration and its first seed, whose GRPO and SC-GRPO runs are read from docs/confirm.
    "smollm2-variants": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--prompts-per-step", "8",
                                    "--steps", "12", "--eval-every", "4", "--eval-k", "0", "--log-update-size",
                                    "--dtype", "fp32"],
                             seeds=[100], reach=None, gain=0.10, confirm_set=True,
                             arms=["grpo", "scgrpo", "distill", "opsd", "opsd-current", "rlsd", "rlsd-self"]),
    # Whether --dtype auto may pick bf16 on a CPU, its learning half (docs/speed.md, fixed before the
    # runs): the SmolLM2 preset's SC-GRPO in fp32 and in bf16 on 3 new paired seeds, each final model
    # scored greedily on the 1,000 confirmatory sums (`confirm_set`); bf16_check reads them.
    "smollm2-bf16": dict(flags=["--model", "SmolLM2-135M", "--task", "addition", "--eval-k", "0"],
                         seeds=[200, 201, 202], reach=None, gain=0.10, confirm_set=True,
                         base="scgrpo-fp32", check="bf16", arms=["scgrpo-fp32", "scgrpo-bf16"]),
}

# An arm is an algorithm plus the flags that change it; each algorithm is an arm of its own. It runs
# scgrpo.py, or the variant file PROGRAMS names (DAPO and the Eq. (5) options are forks: variants/).
ARMS = {
    "grpo": ("grpo", []), "dapo": ("dapo", []), "scgrpo": ("scgrpo", []),
    # solve-none groups get advantage 0 (Eq. 5 scaled by 0): still routed and scored by the
    # teacher, they give no gradient, as GRPO's skipped groups
    "scgrpo-nodiv": ("scgrpo", ["--alpha-div", "0"]),
    # the learning rate x 1 / (mean f(D) of the scgrpo arm): measured from that arm's runs, so this
    # arm runs after the others (a function name in place of flags)
    "scgrpo-lr": ("scgrpo", "lr_matched"),
    # not the paper's (variants/eq5_options.py): a step whose only gradient is Eq. (5)'s applies no update
    "scgrpo-skip": ("scgrpo", ["--eq5-only-step", "skip"]),
    # not the paper's (variants/eq5_options.py): Eq. (5) scores every answer over the group's shortest
    "scgrpo-window": ("scgrpo", ["--eq5-window", "group"]),
    # the bf16 check's two precisions, named (auto depends on the CPU: models.resolve_dtype)
    "scgrpo-fp32": ("scgrpo", ["--dtype", "fp32"]), "scgrpo-bf16": ("scgrpo", ["--dtype", "bf16"]),
    # the paper's comparators (variants/): the KL as a loss (RQ1), OPSD with the gold solution, and
    # RLSD's weight with the gold teacher or with SC-GRPO's own
    "distill": ("distill", []), "opsd": ("opsd", []), "rlsd": ("rlsd", []),
    "rlsd-self": ("rlsd", ["--teacher", "self"]),
    # OPSD's teacher the policy being trained, not the initial one (the first exploratory run's)
    "opsd-current": ("opsd", ["--opsd-teacher", "current"]),
}


PROGRAMS = {"dapo": "variants/dapo.py", "scgrpo-skip": "variants/eq5_options.py",
            "scgrpo-window": "variants/eq5_options.py", "distill": "variants/distill.py",
            "opsd": "variants/opsd.py", "opsd-current": "variants/opsd.py", "rlsd": "variants/rlsd.py",
            "rlsd-self": "variants/rlsd.py"}  # every other arm runs scgrpo.py


def program(arm):
    """The file an arm runs, relative to the repository."""
    return PROGRAMS.get(arm, "scgrpo.py")


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


def code_bytes(arm="scgrpo"):
    """The code a run of `arm` executes: scgrpo.py, every file of machinery/ (the method moved part of
    its machinery there, which changes what a run computes just as well) and the arm's variant file,
    if it has one, in a fixed order."""
    names = ["scgrpo.py"] + sorted(os.path.join("machinery", n) for n in
                                   os.listdir(os.path.join(ROOT, "machinery")) if n.endswith(".py"))
    names += [program(arm)] if program(arm) != "scgrpo.py" else []
    out = b""
    for name in names:
        with open(os.path.join(ROOT, name), "rb") as f:
            out += name.encode() + b"\0" + f.read()
    return out


def last_flag(flags, name):
    """The value of the last `name` in a scgrpo.py flag list (the one that wins), or None."""
    at = [i for i, f in enumerate(flags) if f == name]
    return flags[at[-1] + 1] if at else None


ROUTES = ["grpo", "partial", "fallback", "none", "skipped"]


def route_counts(steps, G, algo):
    """Groups per route over a run's logged steps. metrics.jsonl counts SC-GRPO's routes and the
    skipped groups; the groups updated on GRPO's route are the answers updated beyond those
    routes' (G a partial or fallback group, G - 1 a solve-none one), over G: all of GRPO's and
    DAPO's (whose dropped groups never reach a route), none of SC-GRPO's, and the rest of a
    variant that mixes the two."""
    groups = {route: sum(m[f"groups_{route}"] for m in steps) for route in ROUTES[1:]}
    beyond = [m["answers_updated"] - G * (m["groups_partial"] + m["groups_fallback"])
              - (G - 1) * m["groups_none"] for m in steps]  # < 0 in a step that trained none
    return {"grpo": sum(max(0, n) for n in beyond) // G, **groups}


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


def started_line():
    """When and from which commit a scgrpo.py process of a study started, then where (machine()):
    a pre-registered study shows that every run started after its plan was committed."""
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    commit = (git.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")
    return f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} commit {commit}: {machine()}"


# What a report keeps of each run (run_logs/<run>), enough for a later study to read the run back:
# the resolved Config, the logs, the fingerprint (the first three: every finished run has them), the
# cached evaluations and weight change, and where it ran (a line per scgrpo.py process)
SMALL_FILES = ("config.json", "metrics.jsonl", "fingerprint.txt", "final_eval.json", "moved.json", "base_eval.json",
               "machine.txt", "questions.jsonl", "final_eval_questions.jsonl", "base_eval_questions.jsonl")


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


def run_one(arm, seed, out_root, flags, rerun_stale=False, confirm=False, from_logs=False):
    """One run of scgrpo.py (or its saved results) -> a dict of what the tables need. flags: the
    study's and the arm's scgrpo.py flags; confirm: the final model is also evaluated on the
    confirmatory set; from_logs: out_root holds a report's run_logs, read as they are, whatever
    code made them (--from-logs), and nothing runs."""
    algo = ARMS[arm][0]
    fingerprint = hashlib.sha256(code_bytes(arm) + repr(flags).encode()).hexdigest()
    if from_logs:
        out, how = os.path.join(out_root, f"{arm}-s{seed}"), "read"
        fingerprint = read_text(os.path.join(out, "fingerprint.txt"))
        if fingerprint is None:
            die(f"--from-logs: {out} holds no finished run (no fingerprint.txt)")
    else:
        out, how = run_folder(arm, seed, out_root, fingerprint, rerun_stale)
    metrics = os.path.join(out, "metrics.jsonl")
    if how == "run":
        os.makedirs(out)
        with open(os.path.join(out, "started.txt"), "w") as f:
            f.write(fingerprint)
    if how != "read":  # a resumed run keeps the flags its checkpoint saved
        cmd = [sys.executable, os.path.join(ROOT, program(arm)),
               *(["--resume", out] if how == "resume" else ["--algo", algo, "--seed", str(seed), "--out", out, *flags])]
        with open(os.path.join(out, "machine.txt"), "a") as f:  # a resumed run adds a line
            f.write(started_line())
        r = subprocess.run(cmd, capture_output=True, text=True, env=ONE_THREAD)
        if r.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        with open(os.path.join(out, "fingerprint.txt"), "w") as f:
            f.write(fingerprint)
    with open(metrics) as f:
        lines = [json.loads(line) for line in f]
    evals = [m for m in lines if "eval_greedy_acc" in m]
    addition = last_flag(flags, "--task") == "addition"
    wanted = ["eval_avg_at_k"] + [f"greedy_{w}" for w in WORDINGS if addition] + ["greedy_confirm"] * confirm
    if any(k not in evals[-1] for k in wanted):  # evaluated once more, on the final model
        if from_logs and not os.path.isfile(os.path.join(out, "final_eval.json")):
            die(f"--from-logs: {out} lacks final_eval.json, which its final evaluation writes")
        extra = final_eval(out, fingerprint, confirm=confirm)
        evals[-1].update({k: v for k, v in extra.items() if k not in evals[-1]})
    kl_p75 = [m["kl_p75"] for m in lines if "kl_p75" in m]
    print(f"{arm:12s} seed {seed}: greedy {evals[0]['eval_greedy_acc']:.3f} -> {evals[-1]['eval_greedy_acc']:.3f}"
          + ("" if os.path.basename(out) == f"{arm}-s{seed}" else f" ({out})"), file=sys.stderr)
    steps = [m for m in lines if "reward_mean" in m]
    with open(os.path.join(out, "config.json")) as f:  # the run's resolved Config
        groups = route_counts(steps, json.load(f)["group_size"], algo)
    confirm_set = read_questions(os.path.join(out, "final_eval_questions.jsonl")).get("confirm")
    return dict(arm=arm, seed=seed, out=out, flags=flags, fingerprint=fingerprint,
                confirm=evals[-1].get("greedy_confirm"), confirm_correct=confirm_set and confirm_set["correct"],
                curve=[(m["step"], m["eval_greedy_acc"]) for m in evals],
                avg=evals[-1]["eval_avg_at_k"], passk=evals[-1]["eval_pass_at_k"],
                wordings={w: evals[-1][f"greedy_{w}"] for w in WORDINGS if f"greedy_{w}" in evals[-1]},
                kl_p75=statistics.median(kl_p75) if kl_p75 else None, groups=groups,
                weight_means=[m["weight_mean"] for m in steps  # mean f(D): SC-GRPO's arms alone
                              if m.get("weight_mean") is not None and algo == "scgrpo"],
                # steps whose only routed groups were solve-none ones (SC-GRPO: Eq. 5 alone gave
                # the gradient; with --alpha-div 0 there was none)
                eq5_only=sum(m["groups_none"] > 0 and m["groups_partial"] + m["groups_fallback"] == 0
                             for m in steps),
                n_steps=len(steps), last_len=steps[-1]["len_mean"], steps=steps,
                seconds=sum(m["seconds"] for m in lines if "seconds" in m))


def final_eval(out, fingerprint, k=8, confirm=False):
    """The final model's Avg@k, Pass@k and (addition) greedy accuracy on each of WORDINGS and, with
    confirm, on the confirmatory set, with its weight change (moved.json), in one process that loads
    the model once (cached in final_eval.json beside its fingerprint)."""
    return evaluations(out, "final_eval", fingerprint, ["--model", os.path.join(out, "final")], k, confirm)


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


def read_questions(path):
    """A run's per-question results (runs.write_questions) -> {set or step: its line}; {} if none."""
    lines = [json.loads(line) for line in (read_text(path) or "").splitlines()]
    return {line.get("set", line.get("step")): line for line in lines}


def evaluations(folder, name, fingerprint, flags, k, confirm=False):
    """A model's held-out evaluation with eval_k = k and, on the addition task, its greedy accuracy on
    each of WORDINGS (the same questions, reworded) and, with confirm, on the confirmatory set
    (tasks.make_addition_confirm): all in one scgrpo.py process with one thread (evaluate_model),
    which loads the model once. Kept in folder/name.json with the fingerprint, and per question in
    folder/name_questions.jsonl (a line per set)."""
    path = os.path.join(folder, name + ".json")
    saved = json.loads(read_text(path) or "{}")
    if saved.pop("fingerprint", None) == fingerprint and ("greedy_confirm" in saved or not confirm):
        return saved
    code = f"import compare; compare.evaluate_model({folder!r}, {name!r}, {flags!r}, {k}, {confirm})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ONE_THREAD, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"error: evaluating {flags} failed:\n{r.stderr[-2000:]}")
    res = json.loads(r.stdout.splitlines()[-1])
    if "moved" in res:  # the weight change, measured in the same process (weight_change reads it)
        with open(os.path.join(folder, "moved.json"), "w") as f:
            json.dump({"moved": res.pop("moved"), "fingerprint": fingerprint}, f)
    with open(path, "w") as f:
        json.dump({**res, "fingerprint": fingerprint}, f)
    return res


def evaluate_model(folder, name, flags, k, confirm):
    """Run inside the process that evaluations() starts: load the model of `flags` once (as
    scgrpo.py --eval-only does), evaluate it on each set with scgrpo.evaluate, append each set's
    per-question line to folder/name_questions.jsonl, and print the numbers as one JSON line,
    with the seconds each set took and, for a run's final model, its weight change."""
    import dataclasses
    import scgrpo as S
    from machinery import cli, models, runs, tasks
    work, questions = os.path.join(folder, name), os.path.join(folder, name + "_questions.jsonl")
    shutil.rmtree(work, ignore_errors=True)
    if os.path.exists(questions):
        os.remove(questions)
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--eval-only", *flags, "--eval-k", str(k), "--out", work])
    run = runs.Run(cfg)
    sets = [("held-out", run.eval_set, k)]
    if cfg.task == "addition":
        sets += [(w, reworded(run.eval_set, WORDINGS[w]), 0) for w in WORDINGS]
        sets += [("confirm", tasks.make_addition_confirm(), 0)] * confirm
    res = {}
    for set_name, rows, set_k in sets:
        t0 = time.time()
        got, per_question = S.evaluate(run.model, run.tok, rows, dataclasses.replace(cfg, eval_k=set_k), run.eos_ids)
        runs.write_questions(questions, {"set": set_name}, per_question)
        if set_name == "held-out":
            res.update(got)
        else:
            res[f"greedy_{set_name}"] = got["eval_greedy_acc"]
        res[f"seconds_{set_name}"] = time.time() - t0
    saved = json.loads(read_text(os.path.join(cfg.model, "run_config.json")) or "{}")
    if saved.get("algo"):  # a run's final model: how far it moved from the model it started from
        start = models.load_model(saved["model"], saved["seed"])[0].state_dict()
        end = run.model.state_dict()
        moved = sum(float((end[k].float() - start[k].float()).pow(2).sum()) for k in start if k in end)
        res["moved"] = (moved / sum(float(start[k].float().pow(2).sum()) for k in start if k in end)) ** 0.5
    shutil.rmtree(work)
    print(json.dumps(res))


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
    words, confirm = wordings_in(results), any(r.get("confirm") is not None for r in results)
    rows = [f"| arm | final greedy acc | Avg@8 | Pass@8 | steps to {target} (runs that got there) | "
            + "".join(f"greedy on {WORDING_LABELS[w]} | " for w in words) + "greedy on the 1,000 | " * confirm
            + "s/run in steps (evaluations and checkpoints between steps included) |",
            "|---|---|---|---|---|" + "---|" * (len(words) + confirm) + "---|"]
    for a in arms:
        rs = [r for r in results if r["arm"] == a]
        hit = [s for s in (steps_to(r["curve"], reach, gain) for r in rs) if s is not None]
        steps = f"{mean_std(hit, '.1f')} ({len(hit)}/{len(rs)})" if hit else f"never (0/{len(rs)})"
        rows.append(f"| {a} | {mean_std([r['curve'][-1][1] for r in rs])} | {mean_std([r['avg'] for r in rs])} | "
                    f"{mean_std([r['passk'] for r in rs])} | {steps} | "
                    + "".join(f"{mean_std([r['wordings'][w] for r in rs if w in r['wordings']])} | "
                              for w in words)
                    + (f"{mean_std([r['confirm'] for r in rs if r.get('confirm') is not None])} | " if confirm else "")
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


# The confirmatory study's analysis, as docs/confirm/PLAN.md fixes it before any of its runs ------------------

def sign_flip_p(diffs):
    """Exact two-sided sign-flip test that paired differences are centred on 0: the share of all 2^n
    sign patterns whose |sum| is at least the observed |sum| (under the null each sign is a coin flip).
    Ties are judged in the scores' own precision: each score is a float32 (a share of answers, off its
    exact fraction by at most 2^-24 of it), so n differences of scores in [0, 1] put at most n 2^-22
    into a sum, while two sums that truly differ do so by a whole answer's share (1/1000 here)."""
    observed, n = abs(sum(diffs)), len(diffs)
    tie = n * 2.0 ** -22
    hits = sum(abs(sum(d if pattern >> i & 1 else -d for i, d in enumerate(diffs))) >= observed - tie
               for pattern in range(2 ** n))
    return hits / 2 ** n


def incomplete_beta(a, b, x):
    """The regularised incomplete beta function I_x(a, b), from its continued fraction evaluated by
    the modified Lentz method (used where it converges fast; the symmetry I_x(a, b) = 1 - I_1-x(b, a)
    elsewhere)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - incomplete_beta(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


def t_quantile(p, df):
    """The p-quantile of Student's t with df degrees of freedom, by bisection on its CDF,
    P(T <= t) = 1 - I_{df / (df + t^2)}(df / 2, 1 / 2) / 2 for t >= 0."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if 1 - incomplete_beta(df / 2, 0.5, df / (df + mid * mid)) / 2 < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def t_interval(diffs, level=0.95):
    """The paired-t interval for the mean of paired differences (the sample std, n - 1 df)."""
    n, mean = len(diffs), statistics.mean(diffs)
    half = t_quantile((1 + level) / 2, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return mean - half, mean + half


def holm(pvalues):
    """Holm's step-down adjustment of a family of p-values {name: p} -> {name: adjusted p}."""
    order, out, running = sorted(pvalues, key=pvalues.get), {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[name]))
        out[name] = running
    return out


def mcnemar_p(b, c):
    """Exact two-sided McNemar test: b and c discordant pairs, each one's side a fair coin under the null."""
    n = b + c
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n) if n else 1.0


# the contrasts the plan fixes: the primary one, then the two secondary ones (Holm-corrected together)
PRIMARY, SECONDARY = ("scgrpo", "grpo"), [("scgrpo-nodiv", "grpo"), ("scgrpo", "scgrpo-nodiv")]


def bf16_check(results, base="scgrpo-fp32", arm="scgrpo-bf16", margin=-0.03):
    """The learning half of docs/speed.md's bf16 check, in Markdown: each seed's greedy accuracy on
    the 1,000 confirmatory sums in both precisions, the mean paired difference arm - base with its
    95% paired-t interval (reported, not tested: 3 seeds), and whether the mean is margin or better."""
    acc = {(r["arm"], r["seed"]): r["confirm"] for r in results if r["confirm"] is not None}
    seeds = sorted(s for (a, s) in acc if a == arm and (base, s) in acc)
    d = [acc[arm, s] - acc[base, s] for s in seeds]
    rows = [f"| seed | {base} | {arm} | {arm} - {base} |", "|---|---|---|---|"]
    rows += [f"| {s} | {acc[base, s]:.3f} | {acc[arm, s]:.3f} | {x:+.3f} |" for s, x in zip(seeds, d)]
    if len(d) < 2:
        return "\n".join(rows + ["", f"{len(d)} paired seeds: too few for the check."])
    (lo, hi), mean = t_interval(d), statistics.mean(d)
    return "\n".join(rows + ["", f"Mean paired difference {mean:+.4f}, paired-t 95% interval [{lo:+.4f}, "
                              f"{hi:+.4f}] over {len(d)} seeds: bf16 {'passes' if mean >= margin - 1e-9 else 'fails'} "
                              f"the learning check (a mean of {margin:+.2f} or better)."])


def confirmatory(results, endpoint="confirm", alpha=0.05):
    """The pre-registered analysis (docs/confirm/PLAN.md) of a study's results, in Markdown: the primary
    test, the secondary tests with Holm's correction, the secondary endpoints (descriptive), the per-question
    pooled tests, and the per-seed table. endpoint: 'confirm' (greedy accuracy on the 1,000 confirmatory
    sums) or 'held-out' (final greedy accuracy on the 100, for the exploratory study's runs)."""
    def value(r, key):
        return {"confirm": r["confirm"], "held-out": r["curve"][-1][1], "Avg@8": r["avg"], "Pass@8": r["passk"],
                **{f"greedy on {WORDING_LABELS[w]}": r["wordings"].get(w) for w in WORDINGS}}[key]
    by = {(r["arm"], r["seed"]): r for r in results}
    present = [c for c in [PRIMARY, *SECONDARY] if all(any(r["arm"] == a for r in results) for a in c)]

    def contrast(a, b, key):
        seeds = sorted(s for (arm, s) in by if arm == a and (b, s) in by
                       and value(by[a, s], key) is not None and value(by[b, s], key) is not None)
        return seeds, [value(by[a, s], key) - value(by[b, s], key) for s in seeds]

    def line(a, b, key, adjusted=None):
        seeds, d = contrast(a, b, key)
        if len(d) < 2:
            return f"| {a} - {b} | {key} | {len(d)} pairs: too few |"
        lo, hi = t_interval(d)
        p = sign_flip_p(d)
        cells = f"| {a} - {b} | {key} | {statistics.mean(d):+.4f} | {sum(x > 0 for x in d)} / {sum(x < 0 for x in d)} " \
                f"of {len(d)} | [{lo:+.4f}, {hi:+.4f}] | {p:.4g} |"
        return cells + (f" {adjusted:.4g} |" if adjusted is not None else "")

    out = ["| contrast | endpoint | mean difference | ahead / behind | paired-t 95% interval | exact sign-flip p |"
           " Holm-adjusted p |", "|---|---|---|---|---|---|---|"]
    verdict = ""
    if PRIMARY in present:
        seeds, d = contrast(*PRIMARY, endpoint)
        out.append(line(*PRIMARY, endpoint) + " (primary: none) |")
        if len(d) >= 2:
            p, (lo, hi), mean = sign_flip_p(d), t_interval(d), statistics.mean(d)
            if p < alpha:
                verdict = (f"**{'Win' if mean > 0 else 'Loss'}**: SC-GRPO's {endpoint} accuracy is "
                           f"{'above' if mean > 0 else 'below'} GRPO's by {mean:+.4f} over {len(d)} paired seeds "
                           f"(exact sign-flip p = {p:.4g} < {alpha}; paired-t 95% interval [{lo:+.4f}, {hi:+.4f}]).")
            else:
                verdict = (f"**Null**: no difference between SC-GRPO and GRPO at alpha = {alpha} (mean {mean:+.4f} over "
                           f"{len(d)} paired seeds, exact sign-flip p = {p:.4g}); the paired-t 95% interval "
                           f"[{lo:+.4f}, {hi:+.4f}] bounds the effect.")
    secondary = [c for c in SECONDARY if c in present and len(contrast(*c, endpoint)[1]) >= 2]
    adjusted = holm({c: sign_flip_p(contrast(*c, endpoint)[1]) for c in secondary})
    out += [line(*c, endpoint, adjusted[c]) for c in secondary]
    described = ["held-out", "Avg@8", "Pass@8"] + [f"greedy on {WORDING_LABELS[w]}" for w in wordings_in(results)]
    out += [line(*c, key) + " (descriptive) |" for key in described if key != endpoint for c in present]
    pooled = ["| contrast | (seed, question) pairs | first right, second wrong | first wrong, second right | "
              "exact McNemar p |", "|---|---|---|---|---|"]
    for a, b in present:
        pairs = [(x, y) for (arm, s), r in sorted(by.items()) if arm == a and (b, s) in by
                 and r.get("confirm_correct") and by[b, s].get("confirm_correct")
                 for x, y in zip(r["confirm_correct"], by[b, s]["confirm_correct"])]
        if pairs:
            n10, n01 = sum(x > y for x, y in pairs), sum(x < y for x, y in pairs)
            pooled.append(f"| {a} - {b} | {len(pairs)} | {n10} | {n01} | {mcnemar_p(n10, n01):.4g} |")
    arms = [a for a in ("grpo", "scgrpo", "scgrpo-nodiv") if any(r["arm"] == a for r in results)]
    seeds = sorted({s for (_, s) in by})
    per_seed = ["| seed | " + " | ".join(arms) + " | " + " | ".join(f"{a} - {b}" for a, b in present) + " |",
                "|---|" + "---|" * (len(arms) + len(present))]
    for s in seeds:
        cell = {a: value(by[a, s], endpoint) if (a, s) in by else None for a in arms}
        per_seed.append(f"| {s} | " + " | ".join("-" if cell[a] is None else f"{cell[a]:.3f}" for a in arms) + " | "
                        + " | ".join("-" if cell[a] is None or cell[b] is None else f"{cell[a] - cell[b]:+.3f}"
                                     for a, b in present) + " |")
    return "\n".join([verdict or "No primary contrast: the study lacks one of its arms.", "", *out, "",
                      *(pooled if len(pooled) > 2 else []), "", f"Per seed, {endpoint} greedy accuracy:", "",
                      *per_seed])


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
                       cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"error: {what} failed:\n{r.stderr[-2000:]}")
    res = json.loads(r.stdout.splitlines()[-1])
    with open(path, "w") as f:
        json.dump({**res, "fingerprint": fingerprint}, f)
    return res


def weight_change(out, fingerprint, from_logs=False):
    """||theta_final - theta_0|| / ||theta_0|| of a run, against the model it started from (in
    a subprocess with one thread, cached in moved.json; its final evaluation measures it too).
    from_logs: only what moved.json holds, or None."""
    if from_logs:
        return json.loads(read_text(os.path.join(out, "moved.json")) or "{}").get("moved")
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
    sys.path.insert(0, HERE)
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
            src = os.path.join(r["out"], name)
            if os.path.isfile(src) and not os.path.samefile(os.path.dirname(src), dst):
                shutil.copy(src, dst)
    with open(os.path.join(folder, "base_eval.json"), "w") as f:
        json.dump(base, f)
    cmd = " ".join(["python tools/compare.py", *sys.argv[1:]])
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(f"Written by `{cmd}`; each run's logs are in run_logs/ beside this file.\n\n"
                f"{table(results, arms, study['reach'], study['gain'])}\n\n"
                f"{paired(results, arms, study.get('base', 'grpo'))}\n\n"
                f"{mechanics(results, arms)}\n\n{diagnostics(results, arms)}\n\n"
                f"Each run (greedy accuracy on the held-out questions at each evaluated step):\n\n"
                f"{per_run(results)}\n\n"
                + (f"## The pre-registered analysis (docs/confirm/PLAN.md)\n\n{confirmatory(results)}\n\n"
                   if study.get("confirm") else "") +
                (f"## The bf16 check (docs/speed.md)\n\n{bf16_check(results)}\n\n"
                 if study.get("check") == "bf16" else "") +
                f"Mean +- std over seeds (population std). The model {first['arm']} seed {first['seed']} started "
                "from, greedy: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()) + "\n")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not the usage text
        die(f"{message} (see --help)")


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default after its help (none where the help says)."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, "") else super()._get_help_string(action)


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
    ap.add_argument("--seeds", nargs="+", type=at_least(0), default=None, metavar="SEED",
                    help="seeds, one run each (default: the study's: " +
                    "; ".join(f"{k} {' '.join(map(str, v['seeds']))}" for k, v in STUDIES.items()) + ")")
    ap.add_argument("--jobs", type=at_least(1), default=2, metavar="N", help="runs at a time (one thread each)")
    ap.add_argument("--out", default="", help="folder for the runs (default: runs/compare-<study>)")
    ap.add_argument("--rerun-stale", action=argparse.BooleanOptionalAction, default=False,
                    help="replace a run folder of other code or flags instead of keeping it and running into a "
                    "new <arm>-s<seed>-vN folder")
    ap.add_argument("--plot", default="", help="also write the learning curves (tools/plot.py) to this .png, .pdf "
                    "or .svg (needs matplotlib)")
    ap.add_argument("--report", default="", help="write the tables and each run's small files to this folder")
    ap.add_argument("--from-logs", default="", metavar="REPORT",
                    help="run nothing: read the study's runs from REPORT/run_logs as they are, whatever code made them "
                    "(a committed report stays reproducible after the code changes), and print the tables (and with "
                    "--report write them)")
    args = ap.parse_args(own)
    args.extra = extra
    for flag, values in (("--arms", args.arms), ("--seeds", args.seeds)):
        if values and len(set(values)) < len(values):
            die(f"{flag} {' '.join(map(str, values))} names one twice (two runs into one folder); name each once")
    if args.plot and os.path.splitext(args.plot)[1].lower() not in (".png", ".pdf", ".svg"):
        die(f"--plot {args.plot}: name a .png, .pdf or .svg file")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # found before hours of runs, not after
        die("--plot needs matplotlib: pip install -r requirements/bench.txt")
    for flag, path in (("--out", args.out), ("--report", args.report)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            die(f"{flag} {path} is a file; name a folder")
    if args.from_logs and not os.path.isdir(os.path.join(args.from_logs, "run_logs")):
        die(f"--from-logs {args.from_logs}: no run_logs folder there; name a report folder that holds one")
    if args.from_logs and (args.out or args.rerun_stale or extra):
        die("--from-logs runs nothing, so --out, --rerun-stale and scgrpo.py flags after -- do not apply; drop them")
    for name in ("--algo", "--seed", "--out"):
        if name in extra:
            die(f"{name} after -- would override what each run's arm, seed or folder sets; use --arms, "
                "--seeds or --out of compare.py")
    return args


def main():
    args = parse_args(sys.argv[1:])
    study = STUDIES[args.study]
    out = os.path.join(args.from_logs, "run_logs") if args.from_logs else \
        args.out or os.path.join("runs", f"compare-{args.study}")
    arms = args.arms or study.get("arms", ["grpo", "dapo", "scgrpo"])
    seeds = args.seeds or study["seeds"]
    # seed by seed, so a study stopped part way leaves whole paired seeds behind
    jobs = [(a, s) for s in seeds for a in arms]
    flags = study["flags"] + args.extra
    confirm_set = study.get("confirm", False) or study.get("confirm_set", False)  # the 1,000 sums
    if "scgrpo-lr" in arms and "scgrpo" not in arms:
        die("the scgrpo-lr arm's learning rate is measured from the scgrpo arm's runs; add scgrpo to --arms")
    t0, results = time.time(), []
    # arms whose flags are measured from other arms' runs (scgrpo-lr) run after them
    for derived in (False, True):
        arm_flags = {a: globals()[ARMS[a][1]](results, flags) if derived else ARMS[a][1]
                     for a in arms if isinstance(ARMS[a][1], str) == derived}
        with ThreadPoolExecutor(args.jobs) as pool:
            results += list(pool.map(lambda j: run_one(*j, out, flags + arm_flags[j[0]], args.rerun_stale,
                                                       confirm_set, bool(args.from_logs)),
                                     [j for j in jobs if j[0] in arm_flags]))
    results.sort(key=lambda r: (arms.index(r["arm"]), seeds.index(r["seed"])))
    if args.report:
        for r in results:
            r["moved"] = weight_change(r["out"], r["fingerprint"], args.from_logs)
        # the model the first run started from (with --model tiny, seed-dependent), evaluated greedily
        first = results[0]
        if args.from_logs and not os.path.isfile(os.path.join(first["out"], "base_eval.json")):
            die(f"--from-logs: {first['out']} lacks base_eval.json, the evaluation of the model the study started from")
        res = evaluations(first["out"], "base_eval", first["fingerprint"],
                          [*first["flags"], "--seed", str(first["seed"])], 0, confirm_set)
        base = {k: v for k, v in res.items() if k.startswith(("eval_greedy", "greedy_"))}
        report(args.report, results, arms, study, base, first)
    print(table(results, arms, study["reach"], study["gain"]))
    print(paired(results, arms, study.get("base", "grpo")))
    print(mechanics(results, arms))
    print(diagnostics(results, arms))
    if study.get("confirm"):
        print(confirmatory(results))
    if study.get("check") == "bf16":
        print(bf16_check(results))
    print(f"{len(jobs)} runs, {args.jobs} at a time: {(time.time() - t0) / 60:.1f} minutes (runs read back cost none)",
          file=sys.stderr)
    if args.plot:
        plot(results, arms, args.plot, f"study {args.study}")
        print(f"learning curves: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
