"""
The command line: flags -> scgrpo.Config, with the model's preset between the defaults and the
flags, and every check that needs no model, so that bad input costs one line and exit code 2
before anything loads or is written.
"""
import argparse
import dataclasses
import json
import math
import os
import time

import torch

from machinery import die, tracking
from machinery.models import gguf_path
from machinery.runs import find_checkpoint, program_of


def setting(default, help, choices=None, rule=None):
    """A Config field: its default, its --help text (unit, why this default), allowed values, and
    a rule (test(value, cfg), the rule in words) that check_config checks before a run."""
    metadata = {"help": help, "choices": choices, "rule": rule}
    return dataclasses.field(default=default, metadata=metadata)


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, instead of usage + error
        die(f"{message} (see --help)")


def preset_table(Config, presets):
    """--help's epilog: each setting a preset changes, per preset, beside Config's default."""
    names = sorted({k for p in presets.values() for k in p},
                   key=[f.name for f in dataclasses.fields(Config)].index)
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    cols = [(f"--model {n}" if n != "hub" else "other models", p) for n, p in presets.items()]
    rows = [["setting", *(c for c, _ in cols)]]
    rows += [["--" + n.replace("_", "-"), *(str(p.get(n, defaults[n])) for _, p in cols)]
             for n in names]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip()
                      for r in rows)
    return ("The model picks a preset that replaces some defaults; a flag given beats both.\n"
            "A flag's --help default above is the one for the default model (tiny).\n" + table +
            "\nUnless given, --micro-batch is at most the batch (prompts x group).")


def parse_config(Config, presets, argv=None):
    """CLI -> (Config, checkpoint folder to resume from or ""). Precedence: explicit flag >
    the model's preset (presets[model], else presets['hub']; for --eval-only of a saved run, the
    run's config) > Config default. --resume reuses the run's saved config; only --steps may
    change (to train longer)."""
    ap = ArgParser(description=Config.__doc__.split("\n\n")[0].replace("\n    ", " "),
                   epilog=preset_table(Config, presets), allow_abbrev=False,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        shown = presets["tiny"].get(f.name, f.default)
        note = f" (default {shown})" if shown != "" else ""
        kw = dict(default=None, choices=f.metadata["choices"],
                  help=(f.metadata["help"] + note).replace("%", "%%"))
        if isinstance(f.default, bool):  # --fast / --no-fast; a value after it is an error
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = type(f.default)
        ap.add_argument("--" + f.name.replace("_", "-"), **kw)
    ap.add_argument("--resume", default="", help="run folder (or its ckpt/) to continue")
    args = ap.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k != "resume"}
    if args.resume:
        if set(given) - {"steps"}:
            flag = sorted(set(given) - {"steps"})[0].replace("_", "-")
            die(f"--resume uses the run's saved config; only --steps may be given with it, "
                f"not --{flag}")
        ckpt = find_checkpoint(args.resume)
        if ckpt is None:
            die(f"--resume {args.resume}: no checkpoint found (looked for state.pt in it, ckpt/ "
                "and ckpt.old/)")
        with open(os.path.join(ckpt, "run_config.json")) as f:
            saved = json.load(f)
        program, ours = saved.pop("program", None), {f.name for f in dataclasses.fields(Config)}
        if set(saved) - ours or (program and program != program_of(Config)):
            made_by = f"python {program}" if program else "the variant file that made it"
            die(f"--resume {args.resume}: the run was made by {program or 'a variant'}, whose "
                f"settings this file lacks; resume it with {made_by} --resume {args.resume}")
        cfg = Config(**{**saved, **given})
        check_config(cfg, resuming=True)
        return cfg, ckpt
    preset = presets.get(given.get("model", "tiny"), presets["hub"])
    if given.get("eval_only"):  # a saved run's final/ or ckpt/: its own task, lengths, ...
        preset = saved_run_config(given.get("model", ""), Config) or preset
    cfg = Config(**{**preset, **given})
    # Preset values that depend on other flags; explicit flags are left alone (checked later).
    if "micro_batch" not in given:
        cfg.micro_batch = min(cfg.micro_batch, cfg.prompts_per_step * cfg.group_size)
    if not cfg.out:
        name = os.path.basename(cfg.model.rstrip("/"))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        what = "eval" if cfg.eval_only else cfg.algo
        cfg.out = os.path.join("runs", f"{name}-{cfg.task}-{what}-s{cfg.seed}-{stamp}")
    check_config(cfg)
    return cfg, ""


def saved_run_config(path, Config):
    """The Config a run saved beside its model folder (ckpt/run_config.json, or the run's
    config.json above final/), minus where it ran, what it was, which algorithm trained it and
    any setting this Config lacks (a variant's); {} for any other model."""
    for cand in (os.path.join(path, "run_config.json"),
                 os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")):
        if os.path.isdir(path) and os.path.isfile(cand):
            with open(cand) as f:
                saved = json.load(f)
            if "algo" in saved:  # a run's config, not a model's
                ours = {f.name for f in dataclasses.fields(Config)}
                return {k: v for k, v in saved.items() if k in ours and k not in (
                    "model", "out", "eval_only", "report_to", "algo")}
    return {}


# What each numeric setting must be, checked for every run: (setting, test, the rule in words).
RANGES = [
    ("group_size", lambda v: v >= 2, "at least 2 (advantages compare answers within a group)"),
    ("lr", lambda v: v > 0, "> 0"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("temperature", lambda v: v > 0, "> 0 (greedy decoding is for evaluation only)"),
    ("epsilon", lambda v: 0 < v < 1, "in (0, 1) (the ratio is clipped below at 1 - epsilon)"),
    ("max_grad_norm", lambda v: v > 0, "> 0 (0 would zero every gradient)"),
    ("c_min", lambda v: v > 0, "> 0 (f(D) = D / (D + c) needs c > 0)"),
    ("kl_quantile", lambda v: 0 < v < 1, "in (0, 1)"),
    ("alpha_div", lambda v: v >= 0, ">= 0 (0 turns Eq. (5) off)"),
    ("eval_k", lambda v: v >= 0, ">= 0 (0 turns Avg@k and Pass@k off)"),
    ("seed", lambda v: v >= 0, ">= 0"),
]
POSITIVE = ("steps", "prompts_per_step", "max_new_tokens", "micro_batch", "ppo_epochs",
            "eval_every", "eval_n", "eval_batch", "save_every", "log_every", "max_bad_steps")


def check_config(cfg, resuming=False):
    """Every flag check that needs no model, so a typo costs seconds and writes nothing."""
    for f in dataclasses.fields(cfg):
        flag, v, choices = "--" + f.name.replace("_", "-"), getattr(cfg, f.name), f.metadata.get(
            "choices")
        if choices and v not in choices:
            die(f"{flag} {v!r} is not one of {', '.join(choices)}")
        if isinstance(v, float) and not math.isfinite(v):
            die(f"{flag} must be a finite number, got {v}")
        if f.name in POSITIVE and v < 1:
            die(f"{flag} must be a positive integer, got {v}")
    # scgrpo.py's ranges here, and those a variant's Config gives its own fields (setting's rule)
    rules = RANGES + [(f.name, lambda v, test=f.metadata["rule"][0]: test(v, cfg),
                       f.metadata["rule"][1]) for f in dataclasses.fields(cfg)
                      if f.metadata.get("rule")]
    for name, ok, rule in rules:
        if not ok(getattr(cfg, name)):
            flag = "--" + name.replace("_", "-")
            die(f"{flag} {getattr(cfg, name)} is out of range: it must be {rule}")
    if cfg.micro_batch > cfg.prompts_per_step * cfg.group_size:
        die(f"--micro-batch {cfg.micro_batch} is larger than the batch "
            f"({cfg.prompts_per_step} x {cfg.group_size}); lower it")
    gguf_path(cfg.model)  # a missing weights package or a non-GGUF file fails here, at once
    if cfg.device == "cuda" and not torch.cuda.is_available():
        die("--device cuda was asked for but no CUDA GPU is visible; use --device cpu or auto")
    if cfg.device == "mps" and not torch.backends.mps.is_available():
        die("--device mps was asked for but MPS is not available; use --device cpu or auto")
    tracking.check(cfg.report_to)  # the tracker's package is installed
    check_out_folder(cfg, resuming)


def check_out_folder(cfg, resuming):
    """--out can be written, and holds no run (or evaluation) that this one would overwrite;
    nothing is created here: the folder is made once the model has loaded."""
    out = os.path.abspath(cfg.out)
    if os.path.exists(out) and not os.path.isdir(out):
        die(f"--out {cfg.out} is a file; pick a folder")
    parent = out
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        die(f"--out {cfg.out} is not writable (no write permission in {parent}); pick another "
            "folder")
    held = os.path.join(out, "eval.json" if cfg.eval_only else "metrics.jsonl")
    if os.path.exists(held) and not resuming:
        if cfg.eval_only:
            die(f"--out {cfg.out} already holds {os.path.basename(held)}; pick a new --out")
        die(f"--out {cfg.out} already holds a run; continue it with --resume {cfg.out} or pick a "
            "new --out")
