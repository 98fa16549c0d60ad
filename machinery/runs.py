"""
A run's folder and its life: the model and data it trains on, metrics.jsonl and samples.jsonl,
the credit pages, checkpoints (atomic), resume (bit for bit, with one thread), Ctrl-C (finish
the step, save, exit) and the seconds and CUDA memory of each phase of a step.

    runs/<name>/config.json      the resolved Config            metrics.jsonl   a line per step
    runs/<name>/samples.jsonl    evaluation answers             credit_<step>.html
    runs/<name>/ckpt/            the last checkpoint (model, tokenizer, run_config.json,
                                 state.pt: optimizer, random streams, data order, step)
    runs/<name>/final/           the trained model, loadable with from_pretrained
"""
import ctypes
import dataclasses
import inspect
import json
import os
import shutil
import signal
import sys
import time

import torch
from tqdm import tqdm

from machinery import die, tracking
from machinery.credit import write_credit_html
from machinery.metrics import peak_memory_gb
from machinery.models import (CPU_MAX_PARAMS, cuda_status, load_model, logits_are_head_of_hidden,
                              pick_device, resolve_dtype, set_precision, share_kv_heads,
                              stop_ids, widen_decode_attention)
from machinery.tasks import go_offline_unless_hub_reachable, load_task


def set_up_passes(model, device, bf16, fast):
    """What a run sets up for its passes once the model is on its device: bf16's weight copy and
    autocast (set_precision), and on the fast path a CPU's freed memory kept, its attention over
    shared key/value heads without copies and, on the CPU kind measured, bf16 decoding's attention
    in fp32. bench.py and profile_step.py call it too."""
    if fast:
        keep_freed_memory(device)  # a CPU's large buffers reused, not page-faulted anew
    set_precision(model, bf16)  # bf16: autocast in the update, bf16 weights elsewhere
    if fast:
        share_kv_heads(model)  # a CPU's attention reads shared key/value heads without copies
        widen_decode_attention(model)  # bf16 without AMX: decoding's attention in fp32


def keep_freed_memory(device):
    """On a CPU with glibc: keep freed memory in the process for the next allocation. By default
    glibc maps each large block (over 128 KB to 32 MB) on its own and unmaps it when freed, so a
    step's large buffers (the embedding's gradient, AdamW's temporaries, activations) are
    page-faulted anew at every step: hundreds of thousands of fresh pages a SmolLM2 update, about a
    tenth of its time (docs/speed.md). Changes no number, only where memory comes from.
    -> True if set (elsewhere, or on another allocator, it does nothing)."""
    if device.type != "cpu":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc and musl have it; macOS has not
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    # no block from mmap (each would be unmapped on free); the heap's top trimmed only past 2 GB
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


class Run:
    """Everything a training run holds besides the algorithm: its data, model and tokenizer
    (from the Config, or from a checkpoint to resume), and, once begin() has them, the
    optimizer and random streams it saves and restores, and its log files."""

    def __init__(self, cfg, ckpt=""):
        go_offline_unless_hub_reachable(cfg)
        self.cfg, self.ckpt, (self.train_set, test_set) = cfg, ckpt, load_task(cfg)
        self.eval_set = test_set[:cfg.eval_n]
        self.metrics_path = os.path.join(cfg.out, "metrics.jsonl")
        self.device = device = pick_device(cfg.device)
        if ckpt:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
            # Fresh copies of the loaded weights: kept in the loader's buffers, some CPU kernels
            # took other paths than on a fresh model's, and a resumed run drifted in the last bits
            # (measured: from step 25 of a tiny run resumed at 15, once the update split its
            # micro-batches at the solve-none answers); in fresh buffers it repeats bit for bit.
            for p in self.model.parameters():
                p.data = p.data.clone()
            self.tok = AutoTokenizer.from_pretrained(ckpt)
        else:
            self.model, self.tok = load_model(cfg.model, cfg.seed)
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if device.type == "cpu" and cfg.device == "auto" and self.n_params > CPU_MAX_PARAMS:
            die(f"{self.n_params / 1e6:.0f}M parameters would train on the CPU ({cuda_status()}), "
                "which takes days at this preset; fix CUDA, or pass --device cpu to run it anyway")
        self.model.to(device).eval()  # no dropout: eval and train mode compute the same function
        if cfg.fast and not logits_are_head_of_hidden(self.model):
            die(f"model {cfg.model!r} computes its logits from more than its LM head (soft-capping "
                "or a logit scale), which the fast paths leave out; run it with --no-fast")
        # auto made bf16 or fp32 where the device is known; config.json and checkpoints keep it
        self.cfg = cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, device, cfg.fast))
        self.bf16 = cfg.dtype == "bf16"
        set_up_passes(self.model, device, self.bf16, cfg.fast)
        if cfg.grad_checkpoint:
            self.model.activation_checkpointing_enable({"use_reentrant": False})
        self.eos_ids = stop_ids(self.model, self.tok)
        try:  # only now: a model that fails to load or is refused leaves no folder behind
            os.makedirs(cfg.out, exist_ok=True)
        except OSError as e:
            die(f"--out {cfg.out} could not be made ({e.strerror}); pick another folder")

    def begin(self, optimizer, rng, gen, batcher):
        """Take the run's optimizer and random streams (checkpoints save them), restore them
        when resuming, write config.json and open the logs. -> the first step to run."""
        cfg = self.cfg
        self.optimizer, self.rng, self.gen, self.batcher = optimizer, rng, gen, batcher
        self.start, self.bad, self.credit = 1, 0, []
        if self.ckpt:
            self.resume(self.ckpt)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(saved_config(cfg), f, indent=2)
        print("config:", json.dumps(dataclasses.asdict(cfg)))
        print(f"model {cfg.model}: {self.n_params / 1e6:.1f}M parameters on {self.device} "
              f"({'bf16' if self.bf16 else 'fp32'}; {cuda_status()}) | train "
              f"{len(self.train_set)} | eval {len(self.eval_set)} | out {cfg.out}")
        self.tracker = tracking.make_tracker(cfg.report_to, cfg.out, os.path.basename(cfg.out),
                                             dataclasses.asdict(cfg))
        self.metrics_f = open(self.metrics_path, "a", buffering=1)
        self.samples_f = open(os.path.join(cfg.out, "samples.jsonl"), "a", buffering=1)
        self.stop = catch_ctrl_c()  # first Ctrl-C: finish the step, save, exit; second: abort
        peak_memory_gb(self.device)  # CUDA: count the first evaluation's peak from here
        self.step_start = time.time()
        return self.start

    def resume(self, ckpt):
        # map_location: a checkpoint written on a GPU resumes on a CPU and the other way round
        st = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(st["optimizer"])  # moves its state to the parameters' device
        self.rng.setstate(st["python_rng"])
        torch.set_rng_state(st["torch_rng"])
        if st.get("sampler_device", "cpu") == self.gen.device.type:
            self.gen.set_state(st["sampler_rng"])
        else:  # a CUDA generator's state does not fit a CPU one: a new, still seeded stream
            self.gen.manual_seed(self.cfg.seed + st["step"])
            print(f"note: resumed on {self.gen.device.type}, saved on {st['sampler_device']}: "
                  "the sampler's random stream restarts (seeded), so samples differ from there")
        self.batcher.epoch, self.batcher.pos = st["batcher"]
        self.start, self.bad = st["step"] + 1, st["bad_steps"]
        for path in (self.metrics_path, os.path.join(self.cfg.out, "questions.jsonl")):
            keep = []  # drop the lines of steps past the checkpoint: they are re-run
            if os.path.exists(path):
                with open(path) as f:
                    keep = [ln for ln in f if json.loads(ln)["step"] <= st["step"]]
            with open(path + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(path + ".tmp", path)
        print(f"resuming {self.cfg.out} from step {st['step']} ({ckpt})")

    def log(self, record):
        self.metrics_f.write(json.dumps(record) + "\n")
        self.metrics_f.flush()
        self.tracker.log(record, record["step"])  # --report-to: the same numbers, the same step

    def log_step(self, bar, m, credit=None):
        """Log a training step (metrics.jsonl, the bar, every --log-every steps a line); keep the
        step's credit examples (if any) for the next evaluation's credit page; count non-finite
        steps and stop, saved, after --max-bad-steps of them in a row."""
        self.credit = credit or self.credit
        cfg, step = self.cfg, m["step"]
        m["seconds"] = time.time() - self.step_start  # the whole step, since the last one ended
        self.bad = self.bad + 1 if m["nonfinite"] else 0
        self.log(m)
        self.step_start = time.time()  # evaluations and checkpoints count to the next step
        bar.set_postfix(reward=f"{m['reward_mean']:.3f}")
        if step % cfg.log_every == 0 or step == cfg.steps:
            tqdm.write(log_line(step, cfg, m))
        if m["nonfinite"]:
            tqdm.write(f"warning: step {step} had a non-finite loss or gradient norm; "
                       f"skipped ({self.bad} in a row)")
            if self.bad >= cfg.max_bad_steps:
                self.save(step)
                self.tracker.close()
                die(f"{self.bad} non-finite steps in a row; stopped. Last good state saved in "
                    f"{cfg.out}/ckpt; try a lower --lr")

    def checkpoint(self, bar, step):
        """Save every --save-every steps, at the end, and after a Ctrl-C (then exit 130)."""
        cfg = self.cfg
        if step % cfg.save_every == 0 or step == cfg.steps or self.stop["asked"]:
            self.save(step)
        if self.stop["asked"] and step < cfg.steps:
            bar.close()
            self.tracker.close()
            print(f"\ninterrupted: checkpoint of step {step} saved. Resume with:\n"
                  f"  python {os.path.basename(sys.argv[0])} --resume {cfg.out}")
            sys.exit(130)

    def log_eval(self, step, res, per_question):
        """Log an evaluation's metrics, its per-question results (questions.jsonl), its first
        answers (samples.jsonl) and the credit page of the last answers a teacher scored (none
        without a teacher)."""
        cfg, credit, peak = self.cfg, self.credit, peak_memory_gb(self.device)  # CUDA: eval's peak
        res = {**res, **({} if peak is None else {"mem_eval_gb": peak})}
        self.log({"step": step, **res})
        write_questions(os.path.join(cfg.out, "questions.jsonl"), {"step": step}, per_question)
        for s in first_answers(self.eval_set, per_question):
            self.samples_f.write(json.dumps({"step": step, **s}) + "\n")
        if credit:
            write_credit_html(os.path.join(cfg.out, f"credit_{step}.html"),
                              f"Token credit at step {step}", credit)
        tqdm.write(f"eval step {step} | {eval_line(cfg, res)}")

    def save_eval(self, evaluate):
        """--eval-only: evaluate(model, tok, test set, cfg, eos ids) -> (metrics, per question),
        written to <out>/eval.json (with the first answers) and <out>/questions.jsonl, printed."""
        cfg, path = self.cfg, os.path.join(self.cfg.out, "eval.json")
        res, per_question = evaluate(self.model, self.tok, self.eval_set, cfg, self.eos_ids)
        record = dict(model=cfg.model, task=cfg.task, data=cfg.data, eval_n=len(self.eval_set),
                      eval_k=cfg.eval_k, temperature=cfg.temperature, seed=cfg.seed, **res,
                      samples=first_answers(self.eval_set, per_question))
        write_questions(os.path.join(cfg.out, "questions.jsonl"), {}, per_question)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=2)
        os.replace(path + ".tmp", path)
        print(f"eval {cfg.model} on {len(self.eval_set)} {cfg.task} questions | "
              f"{eval_line(cfg, res)} | {path}")

    def save(self, step):
        state = dict(optimizer=self.optimizer.state_dict(), python_rng=self.rng.getstate(),
                     torch_rng=torch.get_rng_state(), sampler_rng=self.gen.get_state(),
                     sampler_device=self.gen.device.type,
                     batcher=(self.batcher.epoch, self.batcher.pos), step=step, bad_steps=self.bad)
        save_checkpoint(os.path.join(self.cfg.out, "ckpt"), self.model, self.tok, self.cfg, state)

    def finish(self, bar):
        bar.close()
        self.stop["restore"]()
        save_checkpoint(os.path.join(self.cfg.out, "final"), self.model, self.tok, self.cfg, None)
        self.metrics_f.close()
        self.samples_f.close()
        self.tracker.close()
        print(f"done: final model in {self.cfg.out}/final, metrics in {self.metrics_path}")


def first_answers(problems, per_question, n=4):
    """The first n greedy answers of an evaluation, whole, for samples.jsonl and eval.json."""
    return [dict(question=p["question"], completion=t, reward=float(ok))
            for p, t, ok in zip(problems[:n], per_question["text"], per_question["correct"])]


def write_questions(path, head, per_question):
    """Append one evaluation's per-question results to `path` as one JSON line: `head` (its
    step, or the set evaluated), then a list per field, entry q for question q of the set:
    correct (0/1), length (tokens, EOS included), answer (the number extract_answer read, or
    null), and k_correct (of the k samples) when Avg@k ran. The texts stay out (samples.jsonl)."""
    fields = {k: [int(x) for x in v] if k in ("correct", "length", "k_correct") else v
              for k, v in per_question.items() if k != "text"}
    with open(path, "a") as f:
        f.write(json.dumps({**head, **fields}) + "\n")


def eval_line(cfg, res):
    k = (f" | avg@{cfg.eval_k} {res['eval_avg_at_k']:.3f} | pass@{cfg.eval_k} "
         f"{res['eval_pass_at_k']:.3f}" if cfg.eval_k else "")
    return f"greedy acc {res['eval_greedy_acc']:.3f}{k}"


def log_line(step, cfg, m):
    kl = f" | kl_p75 {m['kl_p75']:.4f}" if "kl_p75" in m else ""
    return (f"step {step}/{cfg.steps} | reward {m['reward_mean']:.3f}{kl} | "
            f"len {m['len_mean']:.1f} | skip {m['groups_skipped']} | loss {m['loss']:+.4f} | "
            f"{m['seconds']:.2f} s")


def catch_ctrl_c():
    """First Ctrl-C sets stop['asked'] (the loop saves and exits after the step); a second one
    aborts. stop['restore']() puts the previous handler back."""
    stop = {"asked": False}

    def on_sigint(signum, frame):
        stop["asked"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.signal(signal.SIGINT, on_sigint)
    stop["restore"] = lambda: signal.signal(signal.SIGINT, previous)
    return stop


def program_of(Config):
    """The file that defines the Config class, relative to the repository: scgrpo.py, or a
    variant's file (variants/), which --resume of its runs must run again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.relpath(inspect.getsourcefile(Config), root).replace(os.sep, "/")


def saved_config(cfg):
    """What config.json and a checkpoint's run_config.json hold: the program, then the Config."""
    return {"program": program_of(type(cfg)), **dataclasses.asdict(cfg)}


def save_checkpoint(folder, model, tok, cfg, state):
    """Atomic: written to folder.tmp, then renamed; a crash mid-write leaves the previous
    checkpoint whole (as folder or folder.old)."""
    tmp, old = folder + ".tmp", folder + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "run_config.json"), "w") as f:
        json.dump(saved_config(cfg), f, indent=2)
    if state is not None:
        torch.save(state, os.path.join(tmp, "state.pt"))
    if os.path.exists(folder):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path):
    """The last complete checkpoint under a run folder (or the checkpoint folder itself)."""
    for cand in (path, os.path.join(path, "ckpt"), os.path.join(path, "ckpt.old")):
        if os.path.isfile(os.path.join(cand, "state.pt")):
            return cand
    return None
