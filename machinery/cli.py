"""
The command line: flags -> scgrpo.Config, with the model's preset between the defaults and the
flags, and every check that needs no model, so that bad input costs one line and exit code 2
before anything loads or is written.
"""
import argparse
import dataclasses
import json
import os
import time

import torch

from machinery import die
from machinery.models import gguf_path
from machinery.runs import find_checkpoint
from machinery.tasks import TASKS


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, instead of usage + error
        die(f"{message} (see --help)")


def parse_config(Config, presets, argv=None):
    """CLI -> (Config, checkpoint folder to resume from or ""). Precedence: explicit flag >
    the model's preset (presets[model], else presets['hub']) > Config default. --resume reuses
    the run's saved config; only --steps may change (to train longer)."""
    ap = ArgParser(description="SC-GRPO / GRPO / DAPO on GSM8K or offline arithmetic.")
    for f in dataclasses.fields(Config):
        kind = type(f.default) if not isinstance(f.default, bool) else (
            lambda v: v.lower() in ("1", "true", "yes", "on"))
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                        help=f"{f.metadata['help']} (default {f.default!r}, or the preset's)")
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
            cfg = Config(**{**json.load(f), **given})
        check_config(cfg)
        return cfg, ckpt
    cfg = Config(**{**presets.get(given.get("model", "tiny"), presets["hub"]), **given})
    # Preset values that depend on other flags; explicit flags are left alone (checked later).
    if "micro_batch" not in given:
        cfg.micro_batch = min(cfg.micro_batch, cfg.prompts_per_step * cfg.group_size)
    if "overlong_buffer" not in given and cfg.model != "tiny":  # DAPO shapes the last quarter
        cfg.overlong_buffer = cfg.max_new_tokens // 4
    if not cfg.out:
        name = os.path.basename(cfg.model.rstrip("/"))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg.out = os.path.join("runs", f"{name}-{cfg.task}-{cfg.algo}-s{cfg.seed}-{stamp}")
    check_config(cfg)
    return cfg, ""


def check_config(cfg):
    """Every flag check that needs no model, so a typo costs seconds."""
    if cfg.task not in ("gsm8k", *TASKS):
        die(f"unknown --task {cfg.task!r}; use gsm8k, arith or addition")
    if cfg.algo not in ("scgrpo", "grpo", "dapo"):
        die(f"unknown --algo {cfg.algo!r}; use scgrpo, grpo or dapo")
    for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch", "ppo_epochs",
                 "eval_every", "save_every", "log_every", "eval_batch", "max_bad_steps"):
        if getattr(cfg, name) < 1:
            die(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    if cfg.group_size < 2:
        die(f"--group-size must be at least 2 (advantages compare answers within a group), "
            f"got {cfg.group_size}")
    if cfg.micro_batch > cfg.prompts_per_step * cfg.group_size:
        die(f"--micro-batch {cfg.micro_batch} is larger than the batch "
            f"({cfg.prompts_per_step} x {cfg.group_size}); lower it")
    if cfg.algo == "dapo" and not 0 <= cfg.overlong_buffer < cfg.max_new_tokens:
        die(f"--overlong-buffer must be in [0, --max-new-tokens), got {cfg.overlong_buffer}")
    if cfg.temperature <= 0:
        die("--temperature must be > 0 for training (greedy decoding is for evaluation only)")
    if not 0 < cfg.kl_quantile < 1:
        die(f"--kl-quantile must be in (0, 1), got {cfg.kl_quantile}")
    if cfg.eval_n < 1 or cfg.eval_k < 0:
        die("--eval-n must be positive and --eval-k non-negative")
    gguf_path(cfg.model)  # a missing weights package or a non-GGUF file fails here, at once
    if cfg.dtype not in ("auto", "bf16", "fp32"):
        die(f"unknown --dtype {cfg.dtype!r}; use auto, bf16 or fp32")
    if cfg.device not in ("auto", "cpu", "cuda", "mps"):
        die(f"unknown --device {cfg.device!r}; use auto, cpu, cuda or mps")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        die("--device cuda was asked for but no CUDA GPU is visible; use --device cpu or auto")
    if cfg.device == "mps" and not torch.backends.mps.is_available():
        die("--device mps was asked for but MPS is not available; use --device cpu or auto")
