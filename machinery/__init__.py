"""
The machinery around scgrpo.py: everything a run needs that is not the method, one file per role.
scgrpo.py imports these; none of them imports scgrpo.py (what they need of it comes in as
arguments), so a reader of the method can skip this folder whole.

  cli.py       command line -> Config: presets, flag checks (bad input: one line, exit 2)
  tasks.py     the offline tasks, GSM8K-schema files, the hub dataset, the question order
  models.py    device and precision, the built-in tiny model, GGUF files, hub models
  runs.py      the run folder: metrics and samples, checkpoints, resume, Ctrl-C
  metrics.py   what a step logs: the teacher's numbers, the update's, the seconds of each phase
  tracking.py  --report-to: the same numbers to TensorBoard, W&B or Trackio (opt-in)
  credit.py    the token-credit page (which tokens SC-GRPO weighted, shaded by f(D))
  batching.py  token lists <-> padded tensors: left padding, decoding, joining rollouts
  speed.py     the fast equals of scgrpo.py's plain lines (--fast), held equal by the tests
"""
import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys


def die(msg):
    """Bad input costs one line and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def at_least(low):
    """An argparse type for the tools' flags: an integer >= low, named in the error (argparse adds
    the flag and the value)."""
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


def cpu_info():
    """The first CPU's /proc/cpuinfo fields (Linux; elsewhere empty): its name and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0]
    except OSError:
        first_cpu = ""
    info = dict(line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in info.items()}


def machine():
    """One line naming the CPU (its bf16 instruction sets) and torch this runs on: the same run
    re-done on another CPU of the same kind can take another path from its second step, and bf16
    speed differs between CPU kinds, so studies and benchmarks say where they ran."""
    info = cpu_info()
    flags = info.get("flags", "").split()
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]  # the bf16 kernels
    name = info.get("model name", platform.processor() or platform.machine())
    return (f"{name} ({' '.join(bf16) or 'no bf16 flags'}), {os.cpu_count()} cores, "
            f"torch {importlib.metadata.version('torch')}\n")


def machine_kind(device="cpu"):
    """A short name for the machine a measurement ran on: the GPU's model on CUDA (h100, h200, ...),
    else the CPU's kind (epyc, xeon), or 'cpu' for another one."""
    if str(device).startswith("cuda"):
        import torch
        words = torch.cuda.get_device_name().lower().replace("nvidia", "").split()
        return words[0] if words else "gpu"
    name = cpu_info().get("model name", "").lower()
    return "epyc" if "epyc" in name else "xeon" if "xeon" in name else "cpu"


def bench_output(what, ext, device="cpu"):
    """Where a measuring tool (bench.py, profile_step.py, bf16_drift.py) writes by default:
    docs/bench/<date>_<machine>_<commit>_<what>.<ext>, so that a name says when, where and on which
    code it ran (the commit with '-dirty' when the checkout has uncommitted changes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = ["git", "-C", root]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "nocommit"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    name = f"{datetime.date.today()}_{machine_kind(device)}_{commit}{'-dirty' if dirty else ''}"
    return os.path.join(root, "docs", "bench", f"{name}_{what}.{ext}")


class Tee:
    """sys.stdout that also writes to a file, the first line being the command that ran: a tool's
    output kept exactly as it printed it."""

    def __init__(self, path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file, self.stdout = open(path, "w", encoding="utf-8"), sys.stdout
        self.file.write(f"`python {' '.join(sys.argv)}` ({datetime.date.today()}; "
                        f"{machine().strip()})\n\n")

    def write(self, text):
        self.stdout.write(text)
        self.file.write(text)

    def flush(self):
        self.stdout.flush()
        self.file.flush()
