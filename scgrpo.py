"""
SC-GRPO: Self-Conditioned GRPO (Shan et al., arXiv 2606.18810) in one readable file.

For each question x we sample a group of G answers and grade them with a rule-based verifier
(reward 1 if the final number is right). GRPO turns the rewards into one advantage per answer,
Eq. (1), and gives every token of the answer that same credit. SC-GRPO keeps the advantage but
reweights the tokens: it shows the same model one of its own *verified* answers tau in the system
prompt (the teacher, Eq. 4), re-scores the sampled answer in that context, and measures at every
position how far the next-token distribution moved, D_t = KL(teacher || student). Tokens where
seeing a correct solution changes the model's mind are the decisions that mattered; f(D) =
D / (D + c), with c the P75 of D over the step's scored tokens, turns D into a weight in [0, 1)
on that token's clipped GRPO term. Groups with no correct answer get a small diversity
advantage instead, Eq. (5): the answers that differ most from one of their own wrong answers
(highest mean f(D) against it) are pushed up, the ones that repeat it down.

Words used below. n_c: the number of correct answers in a group; it picks the group's route:
partial (2 <= n_c < G), fallback (n_c = 1: plain GRPO), solve-none (n_c = 0), skip (n_c = G).
A solve-none group has one answer drawn as its reference o_r; every other answer o_i is scored
against it over its first L_i = min(|o_i|, |o_r|) tokens, and s_i is the mean f(D) there. The
active tokens of an answer are those the teacher scores: all, or the first L_i if solve-none.

Where this file simplifies or interprets the paper (docs/notes.md says why, at length):
 1. c = max(P75(D), c_min) is taken over the active tokens of the whole step, not per micro-batch.
 2. D is measured once per step with the weights that sampled.
 3. Solve-none groups: the reference o_r itself gets advantage 0 and no gradient.
 4. Solve-none groups: tokens past L_i get weight 0 (s_i never saw them); 1/|o_i| stays.
 5. Solve-none groups: Eq. (5)'s mean and std run over the G-1 answers other than o_r.
 6. Solve-none groups: o_r goes into the teacher prompt under the same guide text as a verified one.
 7. Eq. (1) and (5) use the population std; a skipped (all-equal) group still counts in the 1/B.
 8. DAPO's dynamic sampling drops groups whose shaped rewards are all equal.
 9. Log-probs and KL use the sampling distribution softmax(z / temperature).
10. No reference-model KL (beta = 0), a constant learning rate, gradient clipping at 1.0.
11. The teacher's guide instruction is our own wording (the paper does not publish it).
12. DAPO refills its batch for at most --dapo-max-rounds = 3 sampling rounds per step.
13. DAPO's overlong buffer is max_new_tokens // 4 for real models unless given (cli.py), 0 tiny.
14. A token whose D is not finite gets weight 0 and is left out of c, with a warning.

Every line below runs as written unless --fast is on (the real-model presets turn it on): then
three steps, each marked `if cfg.fast:`, call machinery/speed.py for the same numbers, faster
(tests hold the two equal). machinery/ holds the rest: flags, data, models, the run folder.

Run it (--help lists every flag and the presets; --resume RUN continues a run; --algo grpo, dapo):
    python scgrpo.py                                        # tiny model, offline, CPU
    python scgrpo.py --model SmolLM2-135M --task addition   # real model, offline, CPU, ~8 min
    python scgrpo.py --model Qwen2.5-0.5B --task gsm8k      # one 24 GB GPU
    python scgrpo.py --eval-only --model runs/<run>/final   # score a model, no training
"""
import math
import random
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from machinery import speed  # the fast equals of three plain steps below (--fast)
from machinery.batching import decode, distinct, join, left_pad, pack, select_groups, take_rows
from machinery.cli import parse_config  # flags -> Config: preset, then explicit flags; checks
from machinery.credit import credit_examples  # the answers shown on the credit page
from machinery.models import TINY_TEMPLATE, autocast
from machinery.runs import (Phases, Run, gradient_norm, kl_metrics, relative_change,
                            step_metrics)  # the run folder and what it logs
from machinery.tasks import Batcher
# Bookkeeping helpers: left_pad(token lists, pad_id, device) -> ids, mask (B, P), padded on the
# left so every prompt ends in the last column; decode(tok, ids, mask) -> N texts; pack(rollout,
# rows[, n]) -> ids, mask (b, L) of those answers (or their first n tokens); distinct(keys, device)
# -> (the distinct keys, each key's index among them); join(rollouts), select_groups(rollout,
# groups), take_rows(batch, rows): concatenate or pick rows; autocast(model): bf16 if --dtype
# asked for it, else a no-op. Batcher, Phases, Run: see where train() and train_step() use them.

# Config -------------------------------------------------------------------------------------------

def setting(default, help, choices=None):
    """A Config field: its default, its --help text (unit, and why this default), the values
    it may take (an enumerated flag)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    """Every setting of a run, saved with it; PRESETS, then the flags given, beat these defaults."""
    model: str = setting("tiny", "tiny (built in), SmolLM2-135M, a .gguf, Qwen2.5-0.5B, a hub id")
    task: str = setting("arith", "gsm8k (hub), or offline: arith (a+b=), addition (sums in words)",
                        ("gsm8k", "arith", "addition"))
    data: str = setting("", "local folder with train.jsonl / test.jsonl in GSM8K's schema")
    algo: str = setting("scgrpo", "the method or a baseline", ("scgrpo", "grpo", "dapo"))
    steps: int = setting(200, "optimizer updates (x ppo_epochs)")
    prompts_per_step: int = setting(8, "questions per update; paper: 8")
    group_size: int = setting(8, "G answers per question; paper: 8")
    max_new_tokens: int = setting(512, "answer length cap; the paper allows 12,288 on an 8B model")
    temperature: float = setting(1.0, "sampling temperature, also used to score log-probs and KL")
    lr: float = setting(1e-6, "AdamW learning rate; paper: 1e-6")
    weight_decay: float = setting(0.0, "AdamW weight decay; RL fine-tuning usually uses none")
    epsilon: float = setting(0.2, "PPO clip range; also the upper one unless --epsilon-high, dapo")
    epsilon_high: float = setting(0.0, "upper clip; 0 means = epsilon (dapo: 0.28, clip-higher)")
    ppo_epochs: int = setting(1, "mu: optimizer steps per sampled batch; >1 keeps old log-probs")
    micro_batch: int = setting(8, "answers per forward/backward; gradients are accumulated")
    max_grad_norm: float = setting(1.0, "gradient clipping; paper silent, 1.0 the common default")
    grad_checkpoint: bool = setting(False, "recompute layers in backward: less memory, slower")
    c_min: float = setting(1e-4, "floor of c in f(D) = D / (D + c); paper: 1e-4")
    kl_quantile: float = setting(0.75, "c = quantile of D over active tokens; paper: P75")
    alpha_div: float = setting(0.1, "scale of the solve-none advantage, Eq. (5); paper: 0.1")
    overlong_buffer: int = setting(0, "dapo: length penalty in the last N tokens of the cap; 0 off")
    dapo_max_rounds: int = setting(3, "dapo: sampling rounds per step to refill dropped groups")
    eval_every: int = setting(25, "steps between evaluations (also at step 0 and at the end)")
    eval_n: int = setting(200, "test questions in the fixed evaluation subset")
    eval_k: int = setting(8, "samples per question for Avg@k / Pass@k; 0 disables; paper: 8")
    eval_batch: int = setting(64, "questions per evaluation batch")
    save_every: int = setting(100, "steps between checkpoints (also at the end and on Ctrl-C)")
    log_every: int = setting(1, "steps between printed log lines (metrics.jsonl gets every step)")
    max_bad_steps: int = setting(5, "consecutive non-finite steps before the run stops")
    seed: int = setting(0, "seeds python, torch, the sampler, the references and the data order")
    device: str = setting("auto", "auto picks cuda > mps > cpu", ("auto", "cpu", "cuda", "mps"))
    dtype: str = setting("auto", "bf16 autocast (weights stay fp32), fp32, or auto: bf16 on cuda",
                         ("auto", "bf16", "fp32"))
    out: str = setting("", "run folder; default runs/<model>-<task>-<algo>-s<seed>-<time>")
    fast: bool = setting(False, "machinery/speed.py in place of 3 plain steps: same math, faster")
    eq5_only_step: str = setting("step", "skip (not the paper's): no update when Eq. (5) is a "
                                 "step's only gradient", ("step", "skip"))
    eq5_window: str = setting("paper", "group (not the paper's): Eq. (5) scores every answer over "
                              "the group's shortest one", ("paper", "group"))
    log_update_size: bool = setting(False, "log ||delta theta|| / ||theta|| (holds a weight copy)")
    report_to: str = setting("none", "a tracker too", ("none", "tensorboard", "wandb", "trackio"))
    eval_only: bool = setting(False, "evaluate --model (a hub id, .gguf or folder) and stop")


# tiny: learns on a CPU in minutes, on the plain lines. SmolLM2-135M-Instruct: --task addition on
# 2 CPU cores; other (hub) models: one 24 GB GPU. Both run --fast: 5.3x per SmolLM2 step here.
PRESETS = {
    "tiny": dict(steps=2000, prompts_per_step=16, group_size=16, max_new_tokens=2, lr=3e-4,
                 micro_batch=256, eval_every=250, eval_n=100, eval_batch=100, save_every=500,
                 log_every=250),
    "SmolLM2-135M": dict(steps=12, prompts_per_step=4, group_size=8, max_new_tokens=64,
                         temperature=0.8, lr=2e-5, micro_batch=16, eval_every=4, eval_n=100,
                         eval_k=0, eval_batch=100, save_every=4, fast=True),
    "hub": dict(steps=200, prompts_per_step=8, group_size=8, max_new_tokens=512, lr=1e-6,
                grad_checkpoint=True, micro_batch=8, eval_every=25, eval_n=200, eval_batch=64,
                save_every=50, fast=True),
}

# The verifier (the questions and gold answers come from machinery/tasks.py) -----------------------

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
    """The first number in s: '$1,234.00' -> '1234', '-3.50%' -> '-3.5'; None if there is none."""
    m = NUMBER.search(s.replace("$", ""))
    if m is None:
        return None
    num = m.group(0).replace(",", "")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return "0" if num in ("-0", "") else num


def extract_answer(text):
    """The final answer of a completion: the last \\boxed{}, else the number after the last
    '####', else after the last 'answer is', else the last number in the text. Never raises."""
    box = last_boxed(text)
    if box is not None:
        return normalize_number(box)
    for k, marker in ((text.rfind("####"), "####"), (text.lower().rfind("answer is"), "answer is")):
        number = normalize_number(text[k + len(marker):]) if k >= 0 else None
        if number is not None:
            return number
    nums = NUMBER.findall(text.replace("$", ""))
    return normalize_number(nums[-1]) if nums else None


def verify(completion, gold):
    """Rule-based reward: True if the completion's final number (extract_answer) equals the
    gold answer (a GSM8K `answer` field ending in '#### N', or a bare number)."""
    want, got = normalize_number(gold.rsplit("####", 1)[-1]), extract_answer(completion)
    if want is None or got is None:
        return False
    # both are digit strings (NUMBER), which float() always reads (a huge one as inf)
    return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-9)

# Prompts: the student's, and the teacher's with a reference answer in it --------------------------

SYSTEM_PROMPT = ("Solve the math problem step by step. Give the final answer as a number in "
                 "\\boxed{}.")
GUIDE = ("\n\nBelow is a solution to this problem that was checked and is correct. Use it to "
         "guide your reasoning, then write your own complete solution.\n\nChecked solution:\n")


def encode_prompt(tok, question, reference=None):
    """Token ids of the chat prompt. Student: system prompt + question. Teacher, Eq. (4) and
    App. E.1: the same system prompt + guide instruction + reference, all in the system
    message, then the same question. One function, so the only difference is visible here."""
    tiny = tok.chat_template == TINY_TEMPLATE  # the tiny model reads digits only
    system = "" if tiny else SYSTEM_PROMPT
    if reference is not None:
        # Eq. (4): teacher(. | s_t, tau) = pi_theta(. | x, tau, o_<t): tau joins the system message
        system += reference if tiny else GUIDE + reference
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    return tok(text, add_special_tokens=False)["input_ids"]

# Sampling: G answers per question, graded into a Rollout ------------------------------------------

@dataclass
class Rollout:
    """G graded answers to each of B questions; row n of the (N, L) tensors, N = B * G, is
    answer n % G to question n // G. hidden and lse: see speed.teacher_kl (--fast only)."""
    problems: list                # B task dicts {'question', 'answer'}
    prompts: list                 # B student prompts, token-id lists
    ids: torch.Tensor             # (N, L) answer tokens, padding after the end
    mask: torch.Tensor            # (N, L) bool, True up to and including the first EOS
    texts: list                   # N decoded answers
    correct: torch.Tensor         # (B, G) 1.0 where the verifier accepts the answer
    reward: torch.Tensor          # (B, G) correct, plus DAPO's overlong penalty
    hidden: torch.Tensor = None   # (N, L, H) the student's final hidden states
    lse: torch.Tensor = None      # (N, L) the student's log sum_v exp(z_v / T)

    @property
    def lengths(self):            # (B, G) answer lengths in tokens, EOS included
        return self.mask.sum(1).cpu().view(self.correct.shape)


@torch.no_grad()
def sample(model, prompts, n, max_new, temperature, eos_ids, pad_id, gen):
    """n answers to each prompt, plainly: each step runs the whole sequence so far (no KV cache)
    and draws the next token from softmax(logits / T), the distribution the loss scores (no top-k
    or top-p); T = 0 is greedy. -> ids (N, L) padded with pad_id, mask (N, L) True to 1st EOS."""
    device = next(model.parameters()).device
    ids, attn = left_pad([p for p in prompts for _ in range(n)], pad_id, device)   # (N, P)
    N, P = ids.shape
    done = torch.zeros(N, dtype=torch.bool, device=device)                         # (N,)
    for _ in range(max_new):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        with autocast(model):
            logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        z = logits[:, -1].float()                                                  # (N, V)
        if temperature == 0:
            nxt = z.argmax(-1)                                                     # (N,)
        else:
            nxt = torch.multinomial(F.softmax(z / temperature, -1), 1, generator=gen).squeeze(1)
        ids = torch.cat([ids, nxt.masked_fill(done, pad_id)[:, None]], 1)
        attn = torch.cat([attn, (~done).long()[:, None]], 1)  # finished rows add padding only
        done |= torch.isin(nxt, torch.tensor(eos_ids, device=device))
        if bool(done.all()):
            break
    mask = attn[:, P:].bool()                                                      # (N, L)
    L = max(1, int(mask.sum(1).max()))
    return ids[:, P:P + L], mask[:, :L]


def sample_answers(model, cfg, prompts, n, temperature, eos_ids, pad_id, gen, keep_states=False):
    """n answers to each prompt by sample(), or speed.sample with --fast. -> ids, mask (N, L),
    and the student's states for speed.teacher_kl (--fast, keep_states, fp32) or None, None."""
    args = (model, prompts, n, cfg.max_new_tokens, temperature, eos_ids, pad_id, gen)
    if cfg.fast:  # speed.sample in place of sample(): a KV cache and inverse-CDF draws
        fp32 = getattr(model, "autocast_dtype", None) is None  # bf16: the teacher re-runs them
        return speed.sample(*args, keep_states=keep_states and fp32)
    return (*sample(*args), None, None)


def rollout(model, tok, cfg, problems, gen, eos_ids):
    """Sample G answers to each question and grade them. -> Rollout"""
    G = cfg.group_size
    prompts = [encode_prompt(tok, p["question"]) for p in problems]
    ids, mask, hidden, lse = sample_answers(model, cfg, prompts, G, cfg.temperature, eos_ids,
                                            tok.pad_token_id, gen, cfg.algo == "scgrpo")
    texts = decode(tok, ids, mask)
    correct = torch.tensor([verify(t, problems[n // G]["answer"]) for n, t in enumerate(texts)])
    correct = correct.view(-1, G).float()                                          # (B, G)
    reward = correct.clone()                                                       # (B, G)
    if cfg.algo == "dapo" and cfg.overlong_buffer:
        lengths = mask.sum(1).cpu().view(-1, G)
        reward += overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    return Rollout(problems, prompts, ids, mask, texts, correct, reward, hidden, lse)


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong shaping: 0 up to max_len - buffer, then linearly down to -1 at
    max_len. lengths (any shape) -> penalties (same shape)."""
    return ((max_len - buffer - lengths.float()) / buffer).clamp(-1.0, 0.0)

# Group advantages and routing ---------------------------------------------------------------------

def group_advantages(rewards):
    """Group-relative advantages. rewards (B, G) -> (B, G); a group whose rewards are all
    equal gets exactly 0, not NaN."""
    mean = rewards.mean(1, keepdim=True)                                           # (B, 1)
    std = rewards.std(1, keepdim=True, unbiased=False)                             # (B, 1)
    # Eq. (1): A_i = (r_i - mean(r)) / std(r)  -- one scalar per answer, shared by its tokens
    return torch.where(std > 0, (rewards - mean) / std.clamp_min(1e-12), torch.zeros_like(rewards))


def route_groups(rewards, algo):
    """Route of each group from its rewards (B, G) -> list of B str.
    grpo/dapo: 'skip' if all rewards are equal (zero advantage), else 'grpo'.
    scgrpo, by n_c, the number of correct answers:
      2 <= n_c < G  'partial'     teacher-weighted, a verified answer as reference
      n_c = 0       'solve_none'  diversity advantage, Eq. (5)
      n_c = 1       'fallback'    plain GRPO (no second verified answer; paper: entropy collapse)
      n_c = G       'skip'        zero advantage"""
    G, routes = rewards.shape[1], []
    for r in rewards:
        n_c = int((r > 0.5).sum())
        if algo != "scgrpo":
            routes.append("skip" if bool((r == r[0]).all()) else "grpo")
        else:
            routes.append({0: "solve_none", 1: "fallback", G: "skip"}.get(n_c, "partial"))
    return routes


def pick_references(correct, route, rng, usable=None):
    """Reference tau for each answer of one group: list of G indices or None.
    partial: uniform over the group's verified answers, never the answer itself.
    solve_none: one answer o_r drawn uniformly serves every other answer; o_r itself gets None.
    usable (G bools, default all): answers that may be a reference (trl_scgrpo.py passes it)."""
    G, usable = len(correct), usable or [True] * len(correct)
    if route == "partial":
        good = [j for j in range(G) if correct[j] and usable[j]]
        return [rng.choice([j for j in good if j != i]) for i in range(G)]
    if route == "solve_none":
        r = rng.choice([i for i in range(G) if usable[i]])
        return [None if i == r else r for i in range(G)]
    return [None] * G


@dataclass
class Batch:
    """The M answers that get a gradient this step, in rollout order (skipped groups and each
    solve-none reference o_r left out). Every per-answer quantity is a row here, so a
    micro-batch is a slice: batch[i:j]."""
    row: torch.Tensor       # (M,) long, the answer's row in the rollout (question = row // G)
    ref: torch.Tensor       # (M,) long, the rollout row of its reference tau; -1: no teacher
    route: list             # M routes: 'grpo', 'partial', 'solve_none' or 'fallback'
    adv: torch.Tensor       # (M,) A_i of Eq. (1), or alpha * A_div_i of Eq. (5) if solve-none
    n_active: torch.Tensor  # (M,) its active tokens: all, or L_i if solve-none (note 4)
    kl: torch.Tensor        # (M, L) D_it; 0 where not scored
    weights: torch.Tensor   # (M, L) f(D_it); 1 on each answer token for GRPO, DAPO, 'fallback'

    def __getitem__(self, k):  # a slice or index list k -> the Batch of those rows
        return take_rows(self, torch.arange(len(self.route))[k])


def make_batch(ro, routes, adv, rng, usable=None, window="paper"):
    """One row per answer that gets a gradient: its advantage, unit weights, and on SC-GRPO's
    routes its reference and active length. ro: Rollout; routes: B str; adv, usable (B, G).
    -> Batch (kl still 0: self_condition fills it)"""
    G, lengths = ro.correct.shape[1], ro.lengths.view(-1).tolist()
    row, ref, route, n_active = [], [], [], []
    for b, r in enumerate(routes):
        if r == "skip":
            continue
        ok = None if usable is None else usable[b].tolist()
        for i, j in enumerate(pick_references(ro.correct[b].bool().tolist(), r, rng, ok)):
            if r == "solve_none" and j is None:
                continue  # o_r, the solve-none reference itself: advantage 0, no gradient (note 3)
            row.append(b * G + i)
            ref.append(-1 if j is None else b * G + j)
            route.append(r)
            # active tokens: all of the answer, or its first L_i = min(|o_i|, |o_r|) (note 4);
            # --eq5-window group (not the paper's): the group's shortest answer, o_r included
            n = lengths[b * G + i]
            if r == "solve_none":
                n = min(lengths[b * G:(b + 1) * G] if window == "group" else (n, lengths[b*G + j]))
            n_active.append(n)
    row = torch.tensor(row, dtype=torch.long)                                       # (M,)
    mask = ro.mask[row]                                                             # (M, L)
    return Batch(row, torch.tensor(ref, dtype=torch.long), route, adv.reshape(-1)[row],
                 torch.tensor(n_active, dtype=torch.long), torch.zeros(mask.shape,
                 device=mask.device), mask.float())

# Scoring answers: the plain forward behind the update's log-probs and the teacher's KL ------------

def forward_answers(model, prompts, ids, mask):
    """The plain forward that scores answers: each row is its prompt (b prompts, left-padded)
    followed by its answer ids, mask (b, L). -> logits (b, L, V) at the positions that predict
    each answer token, in fp32."""
    p_ids, p_mask = left_pad(prompts, 0, ids.device)                               # (b, P)
    attn = torch.cat([p_mask, mask.long()], 1)                                     # (b, P+L)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with autocast(model):
        logits = model(input_ids=torch.cat([p_ids, ids], 1), attention_mask=attn,
                       position_ids=pos).logits                                    # (b, P+L, V)
    return logits[:, p_ids.shape[1] - 1:-1].float()                                # (b, L, V)


def answer_logprobs(model, cfg, ro, rows):
    """log pi_theta(o_t | s_t) of the answers `rows` (b,) under the current weights, with
    gradient. -> logp (b, L), 0 outside the answers; mask (b, L)"""
    ids, mask = pack(ro, rows)                                                     # (b, L)
    groups = (rows // cfg.group_size).tolist()
    if cfg.fast:  # speed.answer_logprobs in place of the three lines below
        return speed.answer_logprobs(model, ro.prompts, groups, ids, mask, cfg.temperature,
                                     cfg.grad_checkpoint), mask
    logits = forward_answers(model, [ro.prompts[g] for g in groups], ids, mask)   # (b, L, V)
    lp = F.log_softmax(logits / cfg.temperature, -1).gather(-1, ids[..., None])   # (b, L, 1)
    return lp.squeeze(-1).masked_fill(~mask, 0.0), mask

# The self-conditioned teacher, in three steps: D per token, f(D) with c, Eq. (5) ------------------

@torch.no_grad()
def teacher_kl(model, cfg, ro, rows, teacher_prompts, prompt_of, ids, mask):
    """D_it = KL(teacher || student) at the n active tokens of the answers `rows` (b,): the teacher
    (the same model, a reference in its prompt, Eq. 4) scores the same tokens. teacher_prompts:
    the distinct ones, prompt_of (b,) each answer's; ids, mask (b, L) True if active. -> D (n,)"""
    if cfg.fast:  # speed.teacher_kl in place of the five statements below
        return speed.teacher_kl(model, ro, rows, teacher_prompts, prompt_of, ids, mask,
                                cfg.temperature)
    student = forward_answers(model, [ro.prompts[g] for g in (rows // cfg.group_size).tolist()],
                              ids, mask)                                           # (b, L, V)
    teacher = forward_answers(model, [teacher_prompts[k] for k in prompt_of.tolist()], ids, mask)
    T = cfg.temperature
    log_s, log_t = F.log_softmax(student / T, -1), F.log_softmax(teacher / T, -1)  # (b, L, V)
    # D_t = KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)); kl_div(in, target)
    return F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)[mask]


@torch.no_grad()
def teacher_kls(model, tok, cfg, ro, batch, encode=encode_prompt):
    """Step 1: D on the active tokens of each answer with a reference, by micro-batches of shared
    references; encode builds the teacher prompt (Eq. 4). -> kl (M, L), 0 where not scored"""
    G, kl = cfg.group_size, torch.zeros_like(batch.kl)                             # (M, L)
    scored = (batch.ref >= 0).nonzero().squeeze(1)  # (R,) the rows a teacher scores
    order = sorted(scored.tolist(), key=lambda m: (int(batch.row[m]) // G, int(batch.ref[m])))
    for mb in torch.tensor(order, dtype=torch.long).split(cfg.micro_batch):
        ids, mask = pack(ro, batch.row[mb], batch.n_active[mb])                    # (b, L)
        refs, prompt_of = distinct(batch.ref[mb].tolist(), ids.device)
        # Eq. (4): the teacher prompt holds the reference answer tau = o_j
        prompts = [encode(tok, ro.problems[j // G]["question"], ro.texts[j]) for j in refs]
        d = teacher_kl(model, cfg, ro, batch.row[mb], prompts, prompt_of, ids, mask)  # (n,)
        kl[mb, :mask.shape[1]] = torch.zeros(mask.shape, device=kl.device).masked_scatter(mask, d)
    return kl


def sc_weights(kl, active, c_min=1e-4, q=0.75):
    """Step 2: f(D) = D / (D + c), c = max(quantile_q(D over active tokens), c_min).
    kl, active (...) -> weights (...) in [0, 1), 0 off the active tokens; and c. No gradient.
    A non-finite D would make c, hence every weight, NaN: such a token is left out (note 14)."""
    active = active & torch.isfinite(kl)
    d = kl[active]
    c = max(float(torch.quantile(d.float(), q)) if d.numel() else 0.0, c_min)
    # f(D) = D / (D + c): tokens above the q-quantile keep more than half their gradient
    return torch.where(active, kl / (kl + c), torch.zeros_like(kl)).detach(), c


def diversity_advantages(weights, lengths, r, alpha=0.1, eps=1e-6):
    """Eq. (5) for one solve-none group. weights (G, L) = f(D) of each answer against the
    reference o_r, zero past L_i = min(|o_i|, |o_r|); lengths (G,).
    s_i = 1/L_i sum_{t<=L_i} f(D_it);  A_div_i = (s_i - mean(s)) / (std(s) + eps), over i != r
    (note 5); returns alpha * A_div (G,), with 0 for o_r itself (note 3)."""
    G = weights.shape[0]
    others = torch.tensor([i != r for i in range(G)])
    L_i = torch.minimum(lengths, lengths[r]).clamp_min(1).float()                  # (G,)
    s = weights.sum(1) / L_i                                                       # (G,)
    s_o = s[others]                                                                # (G-1,)
    adv = torch.zeros(G)
    # Eq. (5): A_div_i = (s_i - mean(s)) / (std(s) + eps), scaled by alpha
    adv[others] = alpha * (s_o - s_o.mean()) / (s_o.std(unbiased=False) + eps)
    return adv


def solve_none_advantages(ro, batch, weights, alpha, window="paper"):
    """Step 3: Eq. (5) in every solve-none group of the batch, from the weights f(D) (M, L).
    -> adv (M,): batch.adv with each solve-none answer's entry replaced by alpha * A_div_i"""
    G, adv = ro.correct.shape[1], batch.adv.clone()
    groups = (batch.row // G).tolist()                                             # (M,)
    for b in sorted({g for g, route in zip(groups, batch.route) if route == "solve_none"}):
        members = (batch.row // G == b).nonzero().squeeze(1)  # b's answers here: all but o_r
        places = batch.row[members] % G                       # their indices i in the group
        r = int(batch.ref[members[0]]) % G                    # o_r's index: all members' reference
        f = torch.zeros(G, int(ro.lengths.view(-1)[batch.row[members]].max()))    # (G, L_b)
        f[places] = weights[members, :f.shape[1]].cpu()
        n = ro.lengths[b]                                                          # (G,)
        n = n.clamp_max(int(n.min())) if window == "group" else n  # as make_batch's window
        adv[members] = diversity_advantages(f, n, r, alpha)[places]
    return adv


@torch.no_grad()
def self_condition(model, tok, cfg, ro, batch, encode=encode_prompt):
    """SC-GRPO's addition: D (teacher_kls), f(D) with c over all of the step's active tokens
    (sc_weights, note 1), Eq. (5). Fills batch.kl, .weights and .adv; -> metrics."""
    scored = (batch.ref >= 0).nonzero().squeeze(1)  # (R,) the rows a teacher scores
    batch.kl = teacher_kls(model, tok, cfg, ro, batch, encode)                     # (M, L)
    kl = batch.kl[scored]                                                          # (R, L)
    active = (torch.arange(kl.shape[1]) < batch.n_active[scored, None]).to(kl.device)
    weights, c = sc_weights(kl, active, cfg.c_min, cfg.kl_quantile)                # (R, L)
    batch.weights[scored] = weights
    batch.adv = solve_none_advantages(ro, batch, batch.weights, cfg.alpha_div, cfg.eq5_window)
    return kl_metrics(kl, active, weights, c)  # D's quantiles, c, mean f(D); warns on NaN D

# The loss: the clipped GRPO objective, each token weighted by f(D) --------------------------------

DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher: the upper clip range when --epsilon-high is not set


def policy_loss(logp, old_logp, adv, weights, scale, mask, eps_low, eps_high):
    """-J_SC and the number of tokens whose ratio is outside the clip range. logp, old_logp,
    weights, scale, mask (b, L); adv (b,). With weights = 1: GRPO (scale = 1/(B G |o_i|)
    per answer) or DAPO (scale = 1/total tokens)."""
    # Zero the padding first: a NaN there would otherwise leak into the gradient through where().
    logp, old_logp = logp.masked_fill(~mask, 0.0), old_logp.masked_fill(~mask, 0.0)
    ratio = torch.exp(logp - old_logp)                                             # rho (b, L)
    a = adv[:, None]                                                               # (b, 1)
    term = torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)       # (b, L)
    # J_SC = sum_i sum_t scale_it * f(D_it) * min(rho A, clip(rho) A); weights = 1: GRPO, DAPO
    per_token = torch.where(mask, weights * term * scale, torch.zeros_like(term))
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & mask
    return -per_token.sum(), int(clipped.sum())

# One training step: sample -> reward -> advantages -> (SC-GRPO) teacher -> clipped update ---------

def sample_groups(model, tok, cfg, train_set, batcher, gen, eos_ids):
    """prompts_per_step groups. DAPO's dynamic sampling drops groups whose rewards are all
    equal (note 8) and refills the batch, for at most dapo_max_rounds rounds.
    -> (Rollout to train on, Rollout of every group sampled, rounds)"""
    kept, sampled, n_kept, rounds = [], [], 0, 0
    max_rounds = cfg.dapo_max_rounds if cfg.algo == "dapo" else 1
    while n_kept < cfg.prompts_per_step and rounds < max_rounds:
        rounds += 1
        problems = [train_set[i] for i in batcher.take(cfg.prompts_per_step - n_kept)]
        new = rollout(model, tok, cfg, problems, gen, eos_ids)
        sampled.append(new)
        if cfg.algo == "dapo":  # keep exactly the groups route_groups would not skip
            new = select_groups(new, [b for b, route in enumerate(route_groups(new.reward, "dapo"))
                                      if route != "skip"])
        kept.append(new)
        n_kept += len(new.problems)
    return join(kept), join(sampled), rounds


def update(model, optimizer, cfg, ro, batch):
    """ppo_epochs AdamW steps on the clipped objective, gradients accumulated over micro-batches.
    -> (dict of loss, clip_frac, grad_norm, grad_norm_none, update_size; stepped)"""
    device, G, B = ro.mask.device, cfg.group_size, len(ro.problems)
    lengths = ro.lengths.view(-1)[batch.row]                                       # (M,)
    total_tokens = int(lengths.sum())
    # The objective's normaliser, per token: GRPO 1/G sum_i 1/|o_i|, averaged over the B
    # groups; DAPO one token-level mean over the whole batch.
    scale = (torch.full((len(lengths),), 1.0 / max(1, total_tokens)) if cfg.algo == "dapo"
             else (1.0 / (B * G * lengths.double())).float())                     # (M,)
    # Solve-none answers first (the gradient norm after them is Eq. (5)'s part), then longest
    # prompts first (a memory problem shows at once), a group's answers side by side.
    group, n_none = (batch.row // G).tolist(), batch.route.count("solve_none")     # (M,), 1
    order = sorted(range(len(group)), key=lambda m: (
        batch.route[m] != "solve_none", -len(ro.prompts[group[m]]), group[m], -int(lengths[m])))
    batch, scale = batch[order], scale[order]
    mbs = [slice(s, min(s + cfg.micro_batch, n_none)) for s in range(0, n_none, cfg.micro_batch)]
    mbs += [slice(s, s + cfg.micro_batch) for s in range(n_none, len(order), cfg.micro_batch)]
    eps_high = cfg.epsilon_high or (DAPO_EPS_HIGH if cfg.algo == "dapo" else cfg.epsilon)
    old = []
    if cfg.ppo_epochs > 1:  # old log-probs, frozen for all epochs
        with torch.no_grad():
            old = [answer_logprobs(model, cfg, ro, batch[s].row)[0] for s in mbs]
    loss_sum, clip_sum, grad_norm, norm_none, stepped = 0.0, 0.0, 0.0, 0.0, False
    before = [p.detach().clone() for p in model.parameters()] if cfg.log_update_size else None
    model.train(cfg.grad_checkpoint)  # HF checkpoints layers only in train mode; no dropout
    for _ in range(cfg.ppo_epochs if len(order) else 0):
        loss_sum, clip_sum = 0.0, 0.0
        for k, s in enumerate(mbs):
            mb = batch[s]
            logp, mask = answer_logprobs(model, cfg, ro, mb.row)                   # (b, L)
            L = mask.shape[1]
            # mu = 1: the old log-probs are these, detached, so rho = 1 (no clipping)
            loss, n_clipped = policy_loss(
                logp, old_logp=old[k] if old else logp.detach(), adv=mb.adv.to(device),
                weights=mb.weights[:, :L],  # the batch is as wide as the rollout; this mb is L
                scale=mask * scale[s, None].to(device), mask=mask, eps_low=cfg.epsilon,
                eps_high=eps_high)
            loss.backward()
            loss_sum, clip_sum = loss_sum + loss.item(), clip_sum + n_clipped
            # after the last solve-none micro-batch the gradient is Eq. (5)'s alone
            norm_none = gradient_norm(model) if s.stop == n_none else norm_none
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
            break  # a non-finite step is skipped, never applied
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stepped = True
    optimizer.zero_grad(set_to_none=True)
    model.eval()  # the sampler needs eval mode: HF turns the KV cache off under checkpointing
    return dict(loss=loss_sum, clip_frac=clip_sum / max(1, total_tokens), grad_norm=grad_norm,
                grad_norm_none=norm_none, update_size=relative_change(model, before)), stepped


def train_step(model, optimizer, tok, cfg, train_set, batcher, rng, gen, eos_ids):
    """One update: sample -> reward -> advantages and routes -> (SC-GRPO) teacher KL and
    weights -> clipped update. -> (metrics, credit-view examples)"""
    clock = Phases(next(model.parameters()).device)  # seconds and CUDA memory per phase
    ro, sampled, rounds = sample_groups(model, tok, cfg, train_set, batcher, gen, eos_ids)
    clock.lap("sample")
    adv = group_advantages(ro.reward)                                              # (B, G)
    routes = route_groups(ro.reward, cfg.algo)
    batch = make_batch(ro, routes, adv, rng, window=cfg.eq5_window)
    scored = (batch.ref >= 0).nonzero().squeeze(1).tolist()  # rows with a reference
    sc_stats = self_condition(model, tok, cfg, ro, batch) if scored else {}
    clock.lap("teacher")
    eq5_only = bool(batch.route) and set(batch.route) == {"solve_none"}  # no reward gradient
    trained = batch[[]] if eq5_only and cfg.eq5_only_step == "skip" else batch  # not the paper's
    upd, stepped = update(model, optimizer, cfg, ro, trained)
    clock.lap("update")
    metrics = step_metrics(cfg, sampled, ro, routes, trained, clock, rounds, **upd, **sc_stats,
                           eq5_only=eq5_only, nonfinite=bool(trained.route) and not stepped)
    return metrics, credit_examples(tok, cfg, ro, batch, scored)

# The training loop --------------------------------------------------------------------------------

def train(cfg, resume=""):
    """Train, evaluate and save. resume: a checkpoint folder from parse_config, or ""."""
    # One seed for everything. With one CPU thread (OMP_NUM_THREADS=1) a run repeats bit for bit;
    # with more, or on a GPU, reductions may split differently, and runs drift apart slowly.
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the tiny model's initial weights come from this stream
    run = Run(cfg, resume)  # loads the data and the model (fp32 weights; resume: the checkpoint's)
    model, tok = run.model, run.tok
    # AdamW on every weight at a constant learning rate (note 10), PyTorch's betas (0.9, 0.999)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)                            # which answer is whose reference
    gen = torch.Generator(run.device).manual_seed(cfg.seed)  # the sampler's draws
    batcher = Batcher(len(run.train_set), cfg.seed)          # questions: a seeded order per epoch
    start = run.begin(optimizer, rng, gen, batcher)  # 1, or after resume the next step (restored)
    if start == 1:
        run.log_eval(0, *evaluate(model, tok, run.eval_set, cfg, run.eos_ids))
    bar = tqdm(range(start, cfg.steps + 1), desc="train", initial=start - 1, total=cfg.steps,
               disable=None)
    for step in bar:
        m, credit = train_step(model, optimizer, tok, cfg, run.train_set, batcher, rng, gen,
                               run.eos_ids)
        run.log_step(bar, {"step": step, **m}, credit)  # may stop: --max-bad-steps NaN steps
        if step % cfg.eval_every == 0 or step == cfg.steps:
            run.log_eval(step, *evaluate(model, tok, run.eval_set, cfg, run.eos_ids))
        run.checkpoint(bar, step)  # every --save-every steps, at the end, and after a Ctrl-C
    run.finish(bar)

# Evaluation: greedy accuracy, Avg@k and Pass@k ----------------------------------------------------

EVAL_SEED_OFFSET = 7919  # evaluation samples from its own stream, seed + this (any fixed offset)


def avg_and_pass_at_k(correct):
    """correct (Q, k) bool -> (Avg@k: mean reward of k samples, Pass@k: share of questions
    solved by at least one of the k)."""
    return float(correct.float().mean()), float(correct.any(1).float().mean())


def answer_and_verify(model, tok, problems, cfg, eos_ids, n, temperature, gen):
    """n answers to each problem, graded. -> (texts, correct, lengths), len(problems) * n each"""
    # questions per sampler call: at most max(eval_batch, a step's answers) rows, as in training
    q = max(1, min(cfg.eval_batch, max(cfg.eval_batch, cfg.prompts_per_step * cfg.group_size) // n))
    texts, lengths = [], []
    for i in tqdm(range(0, len(problems), q), desc="eval", leave=False, disable=None):
        prompts = [encode_prompt(tok, p["question"]) for p in problems[i:i + q]]
        ids, mask, _, _ = sample_answers(model, cfg, prompts, n, temperature, eos_ids,
                                         tok.pad_token_id, gen)                    # (q n, L)
        texts, lengths = texts + decode(tok, ids, mask), lengths + mask.sum(1).tolist()
    return texts, [verify(t, problems[j // n]["answer"]) for j, t in enumerate(texts)], lengths


@torch.no_grad()
def evaluate(model, tok, problems, cfg, eos_ids):
    """Greedy accuracy on `problems`, and Avg@k / Pass@k (k = cfg.eval_k) at the training
    temperature. Its own generator: evaluating never shifts the training random stream.
    -> (metrics, per question: the greedy answer's text, correct, length, extracted number,
    and with k > 0 how many of its k samples were correct)"""
    device, k = next(model.parameters()).device, cfg.eval_k
    gen = torch.Generator(device).manual_seed(cfg.seed + EVAL_SEED_OFFSET)
    texts, greedy, lengths = answer_and_verify(model, tok, problems, cfg, eos_ids, 1, 0.0, gen)
    per_question = dict(text=texts, correct=greedy, length=lengths,
                        answer=[extract_answer(t) for t in texts])
    out = {"eval_greedy_acc": sum(greedy) / len(greedy)}
    if k:
        _, sampled, _ = answer_and_verify(model, tok, problems, cfg, eos_ids, k, cfg.temperature,
                                          gen)
        hits = torch.tensor(sampled).view(-1, k)                                   # (Q, k)
        out["eval_avg_at_k"], out["eval_pass_at_k"] = avg_and_pass_at_k(hits)
        per_question["k_correct"] = hits.sum(1).tolist()
    return out, per_question


def main(argv=None):
    cfg, resume = parse_config(Config, PRESETS, argv)
    if not cfg.eval_only:
        return train(cfg, resume)
    torch.manual_seed(cfg.seed)  # the tiny model's initial weights; no optimizer, no training
    Run(cfg).save_eval(evaluate)  # evaluate() on the model and test set Run loads -> eval.json


if __name__ == "__main__":
    main()
