"""
Learning curves of scgrpo.py runs: training reward (`reward_mean` of each step) and held-out greedy
accuracy (`eval_greedy_acc` of each evaluation) against the step, for one run folder or several.

    python tools/plot.py runs/scgrpo-tiny-0 -o curve.png              # one run
    python tools/plot.py runs/compare-tiny/*-s? -o curves.png         # a study: a colour per arm
    python tools/plot.py runs/compare-tiny/*-s? --mean -o mean.png    # mean over seeds, min..max shaded
    python tools/plot.py docs/ablation/run_logs/* --mean -o ablation.png   # the committed study logs

Each run folder holds metrics.jsonl (docs/metrics.md) and config.json. Labels come from the
configs: what all runs share (model, task, and the algorithm if it is one) goes in the title; each
legend entry names the algorithm and the settings in which its runs differ from the others. Runs
that differ only in their seed are one setting, drawn in one colour and named once with their seeds.
A folder without config.json (compare.py --report keeps only metrics.jsonl) is named by its folder,
compare.py's `<arm>-s<seed>` read as arm and seed.

The per-step reward is a mean over one step's few answers and jumps; --smooth N draws the mean of
the N logged steps centred on each step over the raw values (faint). Needs matplotlib
(requirements/bench.txt).
"""
import argparse
import json
import os
import re
import sys

MATPLOTLIB = "matplotlib==3.11.2"   # as requirements/bench.txt pins it
# config fields that never make two runs different settings
IGNORED = ("out", "seed", "report_to", "log_every", "save_every", "eval_only")


def die(msg):
    """Bad input costs one line and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not the usage text
        die(f"{message} (see --help)")


# ----------------------------------------------------------------------------- reading runs

def read_run(folder):
    """A run folder -> dict(folder, config (a dict, or None without config.json), reward and acc:
    lists of (step, value), in step order)."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isdir(folder):
        die(f"run folder {folder} does not exist; pass folders that scgrpo.py wrote (--out)")
    if not os.path.isfile(path):
        die(f"{folder} holds no metrics.jsonl, so it is no scgrpo.py run folder; pass the folder given as --out")
    lines = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                lines.append(json.loads(line))
                int(lines[-1]["step"])
            except (ValueError, KeyError, TypeError):
                die(f"{path} line {n} is not a metrics record (JSON with a step); was the file cut short?")
    # a step's last line wins, as after a resume scgrpo.py keeps only one line per step
    reward = dict((m["step"], m["reward_mean"]) for m in lines if "reward_mean" in m)
    acc = dict((m["step"], m["eval_greedy_acc"]) for m in lines if "eval_greedy_acc" in m)
    if not reward and not acc:
        die(f"{path} has no training step and no evaluation yet; plot it once the run has logged one")
    config = None
    if os.path.isfile(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    return dict(folder=folder, config=config, reward=sorted(reward.items()), acc=sorted(acc.items()))


def describe(run):
    """What names a run: its config, or for a folder without one, what its name says."""
    if run["config"] is not None:
        return run["config"]
    name = os.path.basename(os.path.normpath(run["folder"]))
    arm = re.fullmatch(r"(.+)-s(\d+)", name)  # compare.py's <arm>-s<seed>
    return {"run": arm.group(1), "seed": int(arm.group(2))} if arm else {"run": name}


def fmt(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings(runs):
    """Group runs that differ only in their seed -> (title, [dict(label, runs)]). A field all runs
    share goes in the title; otherwise each setting is labelled with its algorithm and every field
    where it differs from the usual value (the commonest over the settings, ties to the first)."""
    configs = [describe(r) for r in runs]
    groups = {}  # a setting's fields (seed and out left out) -> its runs, in the order given
    for run, config in zip(runs, configs):
        key = tuple(sorted((k, json.dumps(v)) for k, v in config.items() if k not in IGNORED))
        groups.setdefault(key, []).append((run, config))
    fields = sorted({k for c in configs for k in c if k not in IGNORED})
    kinds = [dict(key) for key in groups]
    varying = [k for k in fields if len({s.get(k) for s in kinds}) > 1]
    usual = {}
    for k in varying:
        values = [s.get(k) for s in kinds]
        usual[k] = max(values, key=lambda v: (values.count(v), -values.index(v)))
    shared = [configs[0][k] for k in ("run", "algo", "model", "task") if k in configs[0] and k not in varying]
    out = []
    for key, members in groups.items():
        s, config = dict(key), members[0][1]
        named = ["algo"] if "algo" in varying else []  # always name the algorithm when it varies
        parts = [fmt(config[k]) for k in ("run",) if k in varying]
        parts += [fmt(config["algo"])] if named else []
        parts += [f"{k} {fmt(config[k])}" for k in varying
                  if k not in ("run", "algo") and s.get(k) != usual[k] and k in config]
        seeds = [c["seed"] for _, c in members if "seed" in c]
        label = ", ".join(parts) or (shared[0] if shared else "run")
        if seeds:
            label += f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
        out.append(dict(label=label, runs=[r for r, _ in members]))
    return " / ".join(map(fmt, shared)), out


def smoothed(values, window):
    """The mean of the `window` values centred on each one (fewer at the ends)."""
    half = window // 2
    return [sum(values[max(0, i - half):i + half + 1]) / len(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def curves(run_dirs, smooth=1, mean=False, labels=None):
    """The series the figure draws, one dict per line: label (None for a setting's second and
    later runs, so the legend names each setting once), colour (an index; a setting's runs share
    one), kind ("reward" or "acc"), steps, values; a reward line also has `raw`, the values before
    smoothing (smooth: the window; 1 draws them as logged). mean=True: one line per setting, the
    mean over its runs (each smoothed first) at the steps all of them logged, with `low` and `high`,
    the min and max over the runs. labels: {folder: label} to name the settings instead of the
    configs (compare.py names its arms). -> (title, series)."""
    runs = [read_run(d) for d in run_dirs]
    title, groups = settings(runs)
    if labels:  # one setting per label, in the order the labels first appear
        by_label = {}
        for run in runs:
            by_label.setdefault(labels[run["folder"]], []).append(run)
        groups = [dict(label=label, runs=members) for label, members in by_label.items()]
    if not title:  # nothing shared in the configs: name the folder the runs are in, if one
        parents = {os.path.dirname(os.path.normpath(d)) for d in run_dirs}
        title = parents.pop() if len(parents) == 1 else ""
    series = []
    for colour, group in enumerate(groups):
        for kind in ("reward", "acc"):
            lines = []
            for run in group["runs"]:
                if run[kind]:
                    steps, values = map(list, zip(*run[kind]))
                    line = dict(label=None, colour=colour, kind=kind, steps=steps, values=values)
                    if kind == "reward":
                        line["raw"], line["values"] = values, smoothed(values, smooth)
                    lines.append(line)
            if lines and mean:
                at = [dict(zip(x["steps"], x["values"])) for x in lines]
                steps = sorted(set.intersection(*(set(a) for a in at)))
                per_step = [[a[s] for a in at] for s in steps]
                lines = [dict(label=None, colour=colour, kind=kind, steps=steps,
                              values=[sum(x) / len(x) for x in per_step],
                              low=[min(x) for x in per_step], high=[max(x) for x in per_step])]
            if lines:
                lines[0]["label"] = group["label"]
            series += lines
    return title, series


# ----------------------------------------------------------------------------- drawing

def draw(title, series, path, smooth=1):
    """Two panels side by side, training reward and held-out greedy accuracy; the legend on the
    second; under the title, a line saying how the lines were made (smoothing, mean over seeds)."""
    try:
        import matplotlib
    except ImportError:
        die(f"plotting needs matplotlib: pip install {MATPLOTLIB}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120, sharex=True)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    dashes = ["-", "--", "-.", ":"]  # runs that coincide (same seed, same updates) stay visible
    for line in series:
        colour = palette[line["colour"] % len(palette)]
        style = dashes[line["colour"] % len(dashes)]
        ax = ax_r if line["kind"] == "reward" else ax_a
        if "raw" in line and smooth > 1:  # the values as logged, faint, under their running mean
            ax.plot(line["steps"], line["raw"], color=colour, alpha=0.2, lw=0.8)
        # markers on the evaluations (few, and each a measurement), none on the per-step reward
        marker = "o" if line["kind"] == "acc" and len(line["steps"]) <= 40 else None
        ax.plot(line["steps"], line["values"], color=colour, ls=style, lw=1.6, marker=marker, ms=4,
                label=line["label"] if line["kind"] == "acc" else None)
        if "low" in line:
            ax.fill_between(line["steps"], line["low"], line["high"], color=colour, alpha=0.15, lw=0)
    for ax, name in ((ax_r, "training reward (share of sampled answers correct)"),
                     (ax_a, "held-out greedy accuracy")):
        ax.set(xlabel="training step", ylabel=name, ylim=(-0.02, 1.02))
        ax.set_title(name.split(" (")[0])
        ax.grid(alpha=0.3)
    evaluated = sorted({s for line in series if line["kind"] == "acc" for s in line["steps"]})
    if 2 <= len(evaluated) <= 12:  # a tick at each evaluation (the panels share the x axis)
        ax_a.set_xticks(evaluated)
    else:
        ax_a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if any(s["label"] for s in series):
        ax_a.legend(loc="best", fontsize=8)
    how = (["mean over seeds, min..max shaded"] if any("low" in s for s in series) else []) + \
        ([f"reward: running mean of {smooth} steps" + (" (faint: as logged)" if not any("low" in s for s in series)
                                                      else "")] if smooth > 1 else [])
    fig.suptitle(title + ("\n" if title and how else "") + "; ".join(how), fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main():
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run folders (each with metrics.jsonl)")
    ap.add_argument("-o", "--out", default="curve.png", help="the picture to write (.png, .pdf or .svg) "
                    "(default: curve.png)")
    ap.add_argument("--smooth", type=int, default=1, help="draw the training reward as the mean of this "
                    "many logged steps (odd; 1: the raw values) (default: 1)")
    ap.add_argument("--mean", action=argparse.BooleanOptionalAction, default=False,
                    help="one line per setting: the mean over its seeds, min..max shaded (default: one "
                    "line per run)")
    args = ap.parse_args()
    if args.smooth < 1 or args.smooth % 2 == 0:
        die(f"--smooth {args.smooth}: use an odd number of steps, 1 or more (1 draws the raw values)")
    if os.path.splitext(args.out)[1].lower() not in (".png", ".pdf", ".svg"):
        die(f"-o {args.out}: name a .png, .pdf or .svg file")
    title, series = curves(args.runs, args.smooth, args.mean)
    draw(title, series, args.out, args.smooth)
    print(f"curves of {len(args.runs)} run{'s' * (len(args.runs) > 1)}: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
