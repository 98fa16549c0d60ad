"""
The machinery around scgrpo.py: everything a run needs that is not the method, one file per role.
scgrpo.py imports these; none of them imports scgrpo.py (what they need of it comes in as
arguments), so a reader of the method can skip this folder whole.

  cli.py       command line -> Config: presets, flag checks (bad input: one line, exit 2)
  tasks.py     the offline tasks, GSM8K-schema files, the hub dataset, the question order
  models.py    device and precision, the built-in tiny model, GGUF files, hub models
  runs.py      the run folder: metrics and samples, checkpoints, resume, Ctrl-C, phase timings
  tracking.py  --report-to: the same numbers to TensorBoard, W&B or Trackio (opt-in)
  credit.py    the token-credit page (which tokens SC-GRPO weighted, shaded by f(D))
  batching.py  token lists <-> padded tensors: left padding, decoding, joining rollouts
  speed.py     the fast equals of scgrpo.py's plain lines (--fast), held equal by the tests
"""
import argparse
import importlib.metadata
import os
import platform
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
