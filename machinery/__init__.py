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
import sys


def die(msg):
    """Bad input costs one line and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
