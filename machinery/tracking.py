"""
Opt-in experiment tracking: the numbers a run writes to metrics.jsonl, also sent to TensorBoard,
Weights & Biases or Trackio (`--report-to`). The training loop calls three things:

    tracking.check(report_to)                      # at the input checks: is the package there?
    tracker = tracking.make_tracker(report_to, out_dir, run_name, config_dict)
    tracker.log(record, step)                      # each line written to metrics.jsonl
    tracker.close()                                # at the end (also on Ctrl-C)

`none` (the default) returns a tracker that does nothing and imports nothing. A chosen package is
imported only then; if it is missing, one line with a pinned install command and exit code 2
(requirements/track.txt pins all three).

What each one writes, and where:
- tensorboard: event files in <out_dir>/tensorboard (`tensorboard --logdir <out_dir>`);
- wandb: the run in <out_dir>/wandb; online by default, `WANDB_MODE=offline` keeps it on disk
  (`wandb sync` uploads it later); the project is $WANDB_PROJECT, else "scgrpo";
- trackio: Trackio's local database ($TRACKIO_DIR, else under $HF_HOME), project "scgrpo"
  (`trackio show --project scgrpo`).

The keys are metrics.jsonl's own (reward_mean, kl_p75, eval_greedy_acc, ...; docs/metrics.md),
so a curve in a dashboard and a line in the file are named alike. Only numbers go out: booleans
(`nonfinite`) as 0/1, anything else (text, lists, None) is left out. Steps are metrics.jsonl's:
an evaluation line shares its step with the training step before it, and the trackers show both
at that step. After --resume the steps past the checkpoint are logged again: TensorBoard shows
both, W&B drops the repeated ones (it takes steps in increasing order only).
"""
import importlib
import importlib.util
import json
import os

from machinery import die

CHOICES = ("none", "tensorboard", "wandb", "trackio")
# the versions the tests ran with (requirements/track.txt holds the same pins)
PINS = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb==0.31.0",
        "trackio": "trackio==0.43.0"}


def check(report_to):
    """Stop at the door (before a run folder is made) if `report_to` is unknown or its package is
    not installed. Looks the package up without importing it: importing wandb takes a second."""
    if report_to not in CHOICES:
        die(f"--report-to {report_to!r} is not one of {', '.join(CHOICES)}")
    if report_to != "none":
        try:
            found = importlib.util.find_spec(report_to) is not None
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            found = False
        if not found:
            missing(report_to)


def missing(report_to):
    die(f"--report-to {report_to} needs the {report_to} package: pip install {PINS[report_to]}")


def load(report_to):
    """Import the tracker's package, or stop with the install hint."""
    try:
        return importlib.import_module(report_to)
    except ImportError:
        missing(report_to)


def numbers(record):
    """The numeric fields of a metrics.jsonl record, as floats, without `step`."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float))}  # bool is an int: 0.0 / 1.0


class NoTracker:
    """--report-to none: every call does nothing."""

    def log(self, record, step):
        pass

    def close(self):
        pass


class TensorBoard:
    def __init__(self, out_dir, run_name, config):
        load("tensorboard")  # torch's writer needs the tensorboard package; say so in our words
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))
        # the resolved config once, as text (TensorBoard's TEXT tab), so the run is self-describing
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, record, step):
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, step)  # stored as float32, TensorBoard's scalar type

    def close(self):
        self.writer.close()  # flushes the event file


class WandB:
    def __init__(self, out_dir, run_name, config):
        self.wandb = wandb = load("wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "scgrpo", name=run_name,
                              dir=out_dir, config=config)

    def log(self, record, step):
        self.run.log(numbers(record), step=step)

    def close(self):
        self.run.finish()
        self.wandb.teardown()  # waits for W&B's writer process: the run file is whole after this


class Trackio:
    def __init__(self, out_dir, run_name, config):
        self.trackio = load("trackio")
        self.trackio.init(project="scgrpo", name=run_name, config=config)

    def log(self, record, step):
        self.trackio.log(numbers(record), step=step)

    def close(self):
        self.trackio.finish()


def make_tracker(report_to, out_dir, run_name, config):
    """-> an object with log(record: dict, step: int) and close(). out_dir: the run folder (it must
    exist); run_name: the name the dashboard shows; config: the run's resolved config (a dict of
    plain values, e.g. dataclasses.asdict(cfg))."""
    check(report_to)
    kinds = {"none": NoTracker, "tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}
    if report_to == "none":
        return NoTracker()
    return kinds[report_to](out_dir, run_name, config)
