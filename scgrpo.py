"""
SC-GRPO: Self-Conditioned GRPO (Shan et al., arXiv 2606.18810) in one readable file.

For each question x we sample a group of G answers and grade them with a rule-based verifier
(reward 1 if the final number is right). GRPO turns the rewards into one advantage per answer,
Eq. (1), and gives every token of the answer that same credit. SC-GRPO keeps the advantage but
reweights the tokens: it shows the same model one of its own *verified* answers tau in the system
prompt (the teacher, Eq. 4), re-scores the sampled answer in that context, and measures at every
position how far the next-token distribution moved, D_t = KL(teacher || student). Tokens where
seeing a correct solution changes the model's mind are the decisions that mattered; f(D) =
D / (D + c), with c the P75 of D over the step's active tokens (both routes below, pooled), turns
D into a weight in [0, 1) on that token's clipped GRPO term. Groups with no correct answer get a
small "diversity" advantage instead, Eq. (5): the teacher holds one of their own wrong answers o_r,
and an answer goes up or down as its mean f(D) lies above or below its group's (note 15).

Words used below. n_c, a group's number of correct answers, picks its route: partial (2 <= n_c
< G: tau drawn from the other correct answers), fallback (n_c = 1: plain GRPO, weight 1),
solve-none (n_c = 0: Eq. 5, the reference o_r drawn from the group), skip (n_c = G). Each other
answer o_i of a solve-none group is scored over its first L_i = min(|o_i|, |o_r|) tokens: s_i is
the mean f(D) there. An answer's active tokens are those the teacher scores: all, or the first
L_i. Baselines: --algo grpo (every weight 1), --algo dapo (GRPO with DAPO's upper clip 0.28,
groups of equal reward dropped and refilled, a token-level loss mean, a length penalty near the
cap). The tiny default model reads digits only: its teacher prompt is just reference;question (no
system prompt, no guide text); the SmolLM2 preset runs the full teacher prompt of Eq. (4).

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
15. Eq. (5) as written. The paper reads a high s_i as "unlike o_r"; on the untrained SmolLM2 a
    copy of o_r outscores 96% of its group (docs/eq5.md). --eq5-score unlike: by token match.

Every line below runs as written unless --fast is on (the real-model presets turn it on): then
three steps, each marked `if cfg.fast:`, call machinery/speed.py for the same numbers, faster
(tests hold the two equal). machinery/ holds the rest: flags, data, models, the run folder.

Run it (--help lists every flag and the presets; --resume RUN continues a run; --algo grpo, dapo):
    python scgrpo.py                                        # tiny model, offline, CPU
    python scgrpo.py --model SmolLM2-135M --task addition   # real model, offline, CPU, ~8 min
    python scgrpo.py --model Qwen2.5-0.5B --task gsm8k      # sized for one 24 GB GPU; never run
    python scgrpo.py --eval-only --model runs/<run>/final   # score a model, no training
"""
import difflib
import math
import random
import re
from dataclasses import dataclass, field, replace
from decimal import Decimal

import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_
from tqdm import tqdm

from machinery import speed  # the fast equals of three plain steps below (--fast)
from machinery.batching import (decode, distinct, join, left_pad, micro_batches, pack,
                                select_groups, take_rows)
from machinery.cli import parse_config  # flags -> Config: preset, then explicit flags; checks
from machinery.credit import credit_examples  # the answers shown on the credit page
from machinery.models import TINY_TEMPLATE, autocast, no_grad_model, training
from machinery.runs import Phases, Run, UpdateLog, kl_metrics, step_metrics  # the run folder, logs
from machinery.tasks import Batcher, last_boxed
# Bookkeeping: left_pad(token lists) -> ids, mask (B, P), padded on the left so every prompt ends
# in the last column; decode -> texts; pack(rollout, rows[, n]) -> ids, mask (b, L) of those answers
# (their first n tokens); distinct(keys) -> (distinct keys, each key's index among them); join,
# select_groups, take_rows: concatenate or pick rows; autocast: bf16 if --dtype asks.

# Config -------------------------------------------------------------------------------------------

def setting(default, help, choices=None):
    """A Config field: its default, its --help text (unit, why this default), allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    """Every setting of a run, saved with it; PRESETS, then the flags given, beat these defaults."""
    model: str = setting("tiny", "tiny (built in), SmolLM2-135M, a .gguf, Qwen2.5-0.5B, a hub id")
    task: str = setting("arith", "gsm8k (hub), or offline: arith (a+b=), addition (sums in words)",
                        ("gsm8k", "arith", "addition"))
    data: str = setting("", "local folder with train.jsonl / test.jsonl in GSM8K's schema")
    algo: str = setting("scgrpo", "the method or a baseline", ("scgrpo", "grpo", "dapo"))
    steps: int = setting(200, "training steps (each ppo_epochs optimizer updates)")
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
    dtype: str = setting("auto", "bf16 (fp32 master weights, bf16 passes), fp32, or auto: bf16 on "
                         "cuda and on a bf16 CPU with --fast", ("auto", "bf16", "fp32"))
    out: str = setting("", "run folder; default runs/<model>-<task>-<algo>-s<seed>-<time>")
    fast: bool = setting(False, "machinery/speed.py in place of 3 plain steps: same math, faster")
    eq5_only_step: str = setting("step", "skip (not the paper's): no update when Eq. (5) is a "
                                 "step's only gradient", ("step", "skip"))
    eq5_window: str = setting("paper", "group (not the paper's): Eq. (5) scores every answer over "
                              "the group's shortest one", ("paper", "group"))
    eq5_score: str = setting("kl", "unlike (not the paper's): Eq. (5) pushes up the answers least "
                             "like o_r by token match, not those of highest f(D)", ("kl", "unlike"))
    log_update_size: bool = setting(False, "log ||delta theta|| / ||theta|| (holds a weight copy)")
    report_to: str = setting("none", "a tracker too", ("none", "tensorboard", "wandb", "trackio"))
    eval_only: bool = setting(False, "evaluate --model (a hub id, .gguf or folder) and stop")


# tiny: a CPU, minutes, the plain lines; SmolLM2-135M-Instruct: 2 CPU cores; hub models: a GPU
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
    box = last_boxed(text)  # the content of the last \boxed{...}, nested braces and all
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
    # both are digit strings (NUMBER), which Decimal reads exactly: 18.00 = 18, 10**9 + 1 != 10**9
    return Decimal(got) == Decimal(want)

# Prompts: the student's, and the teacher's with a reference answer in it --------------------------

SYSTEM_PROMPT = ("Solve the math problem step by step. Give the final answer as a number in "
                 "\\boxed{}.")
# the guide text, our wording (note 11); a solve-none o_r, a wrong answer, gets it too (note 6)
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
    """G graded answers to each of B questions; row j of the (N, L) tensors, N = B * G, is
    answer j % G to question j // G. hidden and lse: see speed.teacher_kl (--fast only)."""
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
    def G(self):                  # answers per question, read from the rollout in one place
        return self.correct.shape[1]

    @property
    def lengths(self):            # (B, G) |o_i|: answer lengths in tokens, EOS included
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
    """sample(), or speed.sample with --fast. -> ids, mask (N, L), and the student's states
    (speed.teacher_kl reuses them: --fast, keep_states, fp32) or None, None."""
    fp32 = getattr(model, "autocast_dtype", None) is None  # bf16 passes round apart: not kept
    args = (no_grad_model(model), prompts, n, cfg.max_new_tokens, temperature, eos_ids, pad_id, gen)
    if cfg.fast:  # speed.sample in place of sample(): a KV cache and inverse-CDF draws
        return speed.sample(*args, keep_states=keep_states and fp32)
    return (*sample(*args), None, None)


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong shaping: 0 up to max_len - buffer, then linearly down to -1 at
    max_len. lengths (any shape) -> penalties (same shape)."""
    return ((max_len - buffer - lengths.float()) / buffer).clamp(-1.0, 0.0)


def rollout(model, tok, cfg, problems, gen, eos_ids):
    """Sample G answers to each question and grade them. -> Rollout"""
    G = cfg.group_size
    prompts = [encode_prompt(tok, p["question"]) for p in problems]
    ids, mask, hidden, lse = sample_answers(model, cfg, prompts, G, cfg.temperature, eos_ids,
                                            tok.pad_token_id, gen, keep_states=cfg.algo == "scgrpo")
    texts = decode(tok, ids, mask)
    correct = torch.tensor([verify(t, problems[j // G]["answer"]) for j, t in enumerate(texts)])
    correct = correct.view(-1, G).float()                                          # (B, G)
    reward = correct.clone()                                                       # (B, G)
    if cfg.algo == "dapo" and cfg.overlong_buffer:
        lengths = mask.sum(1).cpu().view(-1, G)
        reward += overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    return Rollout(problems=problems, prompts=prompts, ids=ids, mask=mask, texts=texts,
                   correct=correct, reward=reward, hidden=hidden, lse=lse)

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
    for group in rewards:                                                          # (G,)
        n_c = int((group > 0.5).sum())
        if algo != "scgrpo":
            routes.append("skip" if bool((group == group[0]).all()) else "grpo")
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
        r = rng.choice([i for i in range(G) if usable[i]])                        # o_r's index
        return [None if i == r else r for i in range(G)]
    return [None] * G


@dataclass
class Batch:
    """The M answers that get a gradient this step, in rollout order (skipped groups and each
    solve-none reference o_r left out; measure_kl and update visit them in their own orders).
    Every per-answer quantity is a row, so a micro-batch is a slice, batch[i:j]. make_batch sets
    kl 0, weights 1, adv Eq. (1); self_condition returns a copy with kl, f(D), Eq. (5) set."""
    row: torch.Tensor       # (M,) long, the answer's row in the rollout
    question: torch.Tensor  # (M,) long, its question b in the rollout: row // G
    ref: torch.Tensor       # (M,) long, the rollout row of its reference (tau or o_r); -1: none
    route: list             # M routes: 'grpo', 'partial', 'solve_none' or 'fallback'
    adv: torch.Tensor       # (M,) A_i of Eq. (1), or alpha * A_div_i of Eq. (5) if solve-none
    n_active: torch.Tensor  # (M,) its active tokens: all |o_i|, or L_i if solve-none (note 4)
    kl: torch.Tensor        # (M, L) D_it; 0 where not scored
    weights: torch.Tensor   # (M, L) f(D_it); 1 on each answer token for GRPO, DAPO, 'fallback'

    @property
    def scored(self):       # (R,) the rows whose answer a teacher scores: those with a reference
        return (self.ref >= 0).nonzero().squeeze(1)

    def __getitem__(self, k):  # a slice or index list k -> the Batch of those rows
        return take_rows(self, torch.arange(len(self.route))[k])


def make_batch(ro, routes, adv, rng, usable=None, window="paper"):
    """One row per answer that gets a gradient: its advantage, unit weights, and on SC-GRPO's
    routes its reference and active length. ro: Rollout; routes: B str; adv, usable (B, G).
    -> Batch (kl still 0: self_condition measures it)"""
    G, lengths = ro.G, ro.lengths                                                  # (B, G)
    row, ref, route, n_active = [], [], [], []
    for b, group_route in enumerate(routes):
        if group_route == "skip":
            continue
        ok = None if usable is None else usable[b].tolist()
        for i, j in enumerate(pick_references(ro.correct[b].bool().tolist(), group_route, rng, ok)):
            if group_route == "solve_none" and j is None:
                continue  # o_r, the solve-none reference itself: advantage 0, no gradient (note 3)
            L_i = int(lengths[b, i])  # active tokens: the whole answer, or if solve-none ...
            if group_route == "solve_none":  # ... its first L_i = min(|o_i|, |o_r|) (note 4);
                # --eq5-window group (not the paper's): the group's shortest answer, o_r included
                L_i = int(lengths[b].min()) if window == "group" else min(L_i, int(lengths[b, j]))
            row.append(b * G + i)
            ref.append(-1 if j is None else b * G + j)
            route.append(group_route)
            n_active.append(L_i)
    row = torch.tensor(row, dtype=torch.long)                                       # (M,)
    mask = ro.mask[row]                                                             # (M, L)
    return Batch(row=row, question=row // G, ref=torch.tensor(ref, dtype=torch.long), route=route,
                 adv=adv.reshape(-1)[row], n_active=torch.tensor(n_active, dtype=torch.long),
                 kl=torch.zeros(mask.shape, device=mask.device), weights=mask.float())

# Scoring answers: the plain forward behind the update's log-probs and the teacher's KL ------------

def forward_answers(model, prompts, ids, mask):
    """The plain forward that scores answers: each row is its prompt (b prompts, left-padded),
    then its answer ids, mask (b, L). -> fp32 logits (b, L, V) that predict each answer token"""
    p_ids, p_mask = left_pad(prompts, 0, ids.device)                               # (b, P)
    attn = torch.cat([p_mask, mask.long()], 1)                                     # (b, P+L)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with autocast(model):
        logits = model(input_ids=torch.cat([p_ids, ids], 1), attention_mask=attn,
                       position_ids=pos).logits                                    # (b, P+L, V)
    return logits[:, p_ids.shape[1] - 1:-1].float()                                # (b, L, V)


def answer_logprobs(model, cfg, ro, mb):
    """log pi_theta(o_t | s_t) of the answers of the micro-batch mb (a Batch of b rows), with
    gradient, each after its question's student prompt. -> logp (b, L), 0 outside; mask (b, L)"""
    ids, mask = pack(ro, mb.row)                                                   # (b, L)
    questions = mb.question.tolist()
    if cfg.fast:  # speed.answer_logprobs in place of the three lines below
        return speed.answer_logprobs(model, ro.prompts, questions, ids, mask, cfg.temperature,
                                     cfg.grad_checkpoint), mask
    logits = forward_answers(model, [ro.prompts[b] for b in questions], ids, mask)  # (b, L, V)
    lp = F.log_softmax(logits / cfg.temperature, -1).gather(-1, ids[..., None])   # (b, L, 1)
    return lp.squeeze(-1).masked_fill(~mask, 0.0), mask

# The self-conditioned teacher, in three steps: D per token, f(D) with c, Eq. (5) ------------------

@torch.no_grad()
def teacher_kl(model, cfg, ro, rows, teacher_prompts, prompt_of, ids, active):
    """D_it = KL(teacher || student) at the n active tokens of the answers `rows` (b,): the teacher
    (the same model, a reference in its prompt, Eq. 4) scores the same tokens. teacher_prompts:
    the distinct ones, prompt_of (b,) each answer's; ids, active (b, L). -> D (n,), row by row"""
    model = no_grad_model(model)  # --dtype bf16: the bf16 weights (no gradient flows here)
    if cfg.fast:  # speed.teacher_kl in place of the five statements below
        return speed.teacher_kl(model, ro, rows, teacher_prompts, prompt_of, ids, active,
                                cfg.temperature)
    student = forward_answers(model, [ro.prompts[b] for b in (rows // ro.G).tolist()], ids, active)
    teacher = forward_answers(model, [teacher_prompts[k] for k in prompt_of.tolist()], ids, active)
    T = cfg.temperature
    log_s, log_t = F.log_softmax(student / T, -1), F.log_softmax(teacher / T, -1)  # (b, L, V)
    # D_t = KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)); kl_div(in, target)
    return F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)[active]


@torch.no_grad()
def measure_kl(model, tok, cfg, ro, batch, encode=encode_prompt):
    """Step 1: D at the active tokens of every answer with a reference, by micro-batches of
    answers sorted by question and reference (a teacher prompt is then prefilled once for
    several answers, on --fast; the plain teacher_kl expands prompt_of to one per answer); encode
    builds the teacher prompt (Eq. 4). -> kl (M, L), 0 where not scored"""
    kl = torch.zeros_like(batch.kl)                                                # (M, L)
    order = sorted(batch.scored.tolist(), key=lambda m: (int(batch.question[m]), int(batch.ref[m])))
    for mb in torch.tensor(order, dtype=torch.long).split(cfg.micro_batch):
        ids, active = pack(ro, batch.row[mb], batch.n_active[mb])                  # (b, L)
        refs, prompt_of = distinct(batch.ref[mb].tolist(), ids.device)  # the rows of its references
        # Eq. (4): the teacher prompt holds the reference answer tau = o_j of the same question
        prompts = [encode(tok, ro.problems[j // ro.G]["question"], ro.texts[j]) for j in refs]
        d = teacher_kl(model, cfg, ro, batch.row[mb], prompts, prompt_of, ids, active)  # (n,)
        back = torch.zeros(active.shape, device=kl.device).masked_scatter(active, d)  # (b, L)
        kl[mb, :active.shape[1]] = back  # pack cut the rows to their longest answer: <= L wide
    return kl


def sc_weights(kl, active, c_min=1e-4, q=0.75):
    """Step 2: f(D) = D / (D + c), c = max(quantile_q(D over active tokens), c_min).
    kl, active (...) -> weights (...) in [0, 1), 0 off the active tokens; and c. No gradient.
    A non-finite D would make c, hence every weight, NaN: such a token is left out (note 14)."""
    kl = kl.clamp_min(0.0)  # D >= 0, but rounding can put a teacher ~ student token a hair below
    active = active & torch.isfinite(kl)
    d = kl[active]
    c = max(float(torch.quantile(d.float(), q)) if d.numel() else 0.0, c_min)
    # f(D) = D / (D + c): tokens above the q-quantile keep more than half their gradient
    return torch.where(active, kl / (kl + c), torch.zeros_like(kl)).detach(), c


def diversity_advantages(s, alpha=0.1, eps=1e-6):
    """Eq. (5) for one solve-none group: s (G-1,) the scores s_i of its answers other than o_r
    (note 5). -> alpha * A_div (G-1,). Unlike Eq. (1) the paper adds eps to the std here."""
    # Eq. (5): A_div_i = (s_i - mean(s)) / (std(s) + eps) over the G-1 answers, times alpha
    return alpha * (s - s.mean()) / (s.std(unbiased=False) + eps)


def unlikeness(ro, i, r, L):
    """--eq5-score unlike (not the paper's): 1 - difflib's match ratio of the first L tokens of
    answers i and o_r (rollout rows): 0 for a copy, 1 for no token in common (docs/eq5.md)."""
    match = difflib.SequenceMatcher(None, ro.ids[i, :L].tolist(), ro.ids[r, :L].tolist(), False)
    return 1.0 - match.ratio()


def solve_none_advantages(ro, batch, weights, alpha, score="kl"):
    """Step 3: Eq. (5) in every solve-none group of the batch, from the weights f(D) (M, L),
    which are 0 past each answer's window L_i (its active tokens).
    -> adv (M,): batch.adv with each solve-none answer's entry replaced by alpha * A_div_i"""
    adv, none = batch.adv.clone(), torch.tensor([r == "solve_none" for r in batch.route])
    # s_i = 1/L_i sum_{t <= L_i} f(D_it): the mean weight over o_i's window
    s = weights.sum(1).cpu() / batch.n_active                                      # (M,)
    if score == "unlike":  # not the paper's: how little of o_i's window o_r shares
        s = torch.tensor([unlikeness(ro, int(i), int(r), int(L)) if is_none else 0.0
                          for i, r, L, is_none in zip(batch.row, batch.ref, batch.n_active, none)])
    for b in batch.question[none].unique().tolist():
        members = none & (batch.question == b)  # question b's answers here: all but o_r
        adv[members] = diversity_advantages(s[members], alpha)
    return adv


@torch.no_grad()
def self_condition(model, tok, cfg, ro, batch, encode=encode_prompt):
    """SC-GRPO's addition to a step: D (measure_kl), f(D) with c over all of the step's active
    tokens (sc_weights, note 1), Eq. (5) (solve_none_advantages). Nothing to do for a batch
    without references (GRPO, DAPO). -> (a copy of batch with kl, weights and adv set, metrics)"""
    scored = batch.scored                                                          # (R,)
    if not len(scored):
        return batch, {}
    kl = measure_kl(model, tok, cfg, ro, batch, encode)                            # (M, L)
    active = (torch.arange(kl.shape[1]) < batch.n_active[scored, None]).to(kl.device)  # (R, L)
    w, c = sc_weights(kl[scored], active, cfg.c_min, cfg.kl_quantile)              # (R, L)
    weights = batch.weights.index_put((scored,), w)  # a copy, f(D) in the scored rows (M, L)
    adv = solve_none_advantages(ro, batch, weights, cfg.alpha_div, cfg.eq5_score)  # (M,)
    # D's quantiles, c, mean f(D) (warns on a non-finite D)
    return replace(batch, kl=kl, weights=weights, adv=adv), kl_metrics(kl[scored], active, w, c)

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


def loss_scale(cfg, ro, batch):
    """Each answer's normaliser in J (M,): GRPO's 1/G sum_i 1/|o_i|, averaged over the step's B
    questions, is 1/(B G |o_i|) per token; DAPO's token-level mean is 1/(tokens in the batch)."""
    lengths = ro.lengths.view(-1)[batch.row].double()                              # (M,) |o_i|
    if cfg.algo == "dapo":
        return torch.full(lengths.shape, 1.0 / max(1, int(lengths.sum())))
    return (1.0 / (len(ro.problems) * ro.G * lengths)).float()

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
    """ppo_epochs AdamW steps on -J_SC, the gradient accumulated over micro-batches.
    -> (loss, clip_frac, grad_norm, grad_norm_none and update_size as a dict; stepped)"""
    eps_high = cfg.epsilon_high or (DAPO_EPS_HIGH if cfg.algo == "dapo" else cfg.epsilon)
    per_answer = loss_scale(cfg, ro, batch)                                        # (M,)
    # solve-none answers first, in micro-batches of their own: grad_norm_none is Eq. (5)'s part
    order, mbs, n_none = micro_batches(batch, ro, cfg.micro_batch)
    batch, per_answer = batch[order], per_answer[order]
    old = None  # mu > 1: the log-probs before any step (this same pass), frozen for every epoch
    if cfg.ppo_epochs > 1:
        with torch.no_grad():
            old = [answer_logprobs(model, cfg, ro, batch[sl])[0] for sl in mbs]
    log, stepped = UpdateLog(model, cfg.log_update_size), False
    with training(model, optimizer, cfg.grad_checkpoint):  # and bf16 autocast if --dtype bf16
        for _ in range(cfg.ppo_epochs if mbs else 0):
            log.new_epoch()
            for k, sl in enumerate(mbs):
                mb = batch[sl]
                logp, mask = answer_logprobs(model, cfg, ro, mb)                   # (b, L)
                loss, n_clipped = policy_loss(
                    logp, old[k] if old else logp.detach(),  # mu = 1: rho = 1, the clip idle
                    # pack cut mask to this micro-batch's longest answer; weights are L wide
                    adv=mb.adv.to(logp.device), weights=mb.weights[:, :mask.shape[1]],
                    scale=mask * per_answer[sl, None].to(logp.device), mask=mask,
                    eps_low=cfg.epsilon, eps_high=eps_high)
                loss.backward()
                log.micro_batch(loss, n_clipped, last_solve_none=sl.stop == n_none)
            log.grad_norm = float(clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
            if not (math.isfinite(log.loss) and math.isfinite(log.grad_norm)):
                break  # a non-finite step is skipped, never applied
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stepped = True
    optimizer.zero_grad(set_to_none=True)
    return log.metrics(tokens=int(ro.lengths.view(-1)[batch.row].sum())), stepped


def train_step(model, optimizer, tok, cfg, train_set, batcher, rng, gen, eos_ids):
    """One update: sample and grade -> advantages and routes -> references -> (SC-GRPO) D, f(D)
    and Eq. (5) -> clipped update. -> (metrics, credit-view examples)"""
    clock = Phases(next(model.parameters()).device)  # seconds and CUDA memory per phase
    ro, sampled, rounds = sample_groups(model, tok, cfg, train_set, batcher, gen, eos_ids)
    clock.lap("sample")
    adv = group_advantages(ro.reward)                                              # (B, G)
    routes = route_groups(ro.reward, cfg.algo)                                     # B routes
    batch = make_batch(ro, routes, adv, rng, window=cfg.eq5_window)  # references, windows L_i
    batch, sc_stats = self_condition(model, tok, cfg, ro, batch)  # SC-GRPO: kl, weights, Eq. (5)
    clock.lap("teacher")
    eq5_only = bool(batch.route) and set(batch.route) == {"solve_none"}  # no reward gradient
    trained = batch[:0] if eq5_only and cfg.eq5_only_step == "skip" else batch  # not the paper's
    upd, stepped = update(model, optimizer, cfg, ro, trained)
    clock.lap("update")
    metrics = step_metrics(cfg, sampled, ro, routes, trained, clock, rounds, **upd, **sc_stats,
                           eq5_only=eq5_only, nonfinite=bool(trained.route) and not stepped)
    return metrics, credit_examples(tok, ro, batch)

# Evaluation: greedy accuracy, Avg@k and Pass@k ----------------------------------------------------

EVAL_SEED_OFFSET = 7919  # evaluation samples from its own stream, seed + this (any fixed offset)


def avg_and_pass_at_k(correct):
    """correct (Q, k) bool -> (Avg@k: mean reward of k samples, Pass@k: share of questions
    solved by at least one of the k)."""
    return float(correct.float().mean()), float(correct.any(1).float().mean())


def answer_and_verify(model, tok, problems, cfg, eos_ids, n, temperature, gen):
    """n answers to each problem, graded. -> (texts, correct, lengths), len(problems) * n each"""
    rows = max(cfg.eval_batch, cfg.prompts_per_step * cfg.group_size)  # a sampler call's rows
    q = max(1, min(cfg.eval_batch, rows // n))  # questions per call: at most that many rows
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
    temperature, from its own generator (the training stream never moves). -> (metrics, per
    question: greedy text, correct, length, extracted number; with k, its correct samples)"""
    device, k = next(model.parameters()).device, cfg.eval_k
    gen = torch.Generator(device).manual_seed(cfg.seed + EVAL_SEED_OFFSET)
    texts, greedy, lengths = answer_and_verify(model, tok, problems, cfg, eos_ids, 1, 0.0, gen)
    per_question = dict(text=texts, correct=greedy, length=lengths,
                        answer=[extract_answer(t) for t in texts])
    out = {"eval_greedy_acc": sum(greedy) / len(greedy)}
    if k:
        _, k_correct, _ = answer_and_verify(model, tok, problems, cfg, eos_ids, k,
                                            cfg.temperature, gen)
        hits = torch.tensor(k_correct).view(-1, k)                                 # (Q, k)
        out["eval_avg_at_k"], out["eval_pass_at_k"] = avg_and_pass_at_k(hits)
        per_question["k_correct"] = hits.sum(1).tolist()
    return out, per_question

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


def main(argv=None):
    cfg, resume = parse_config(Config, PRESETS, argv)
    if not cfg.eval_only:
        return train(cfg, resume)
    torch.manual_seed(cfg.seed)  # the tiny model's initial weights; no optimizer, no training
    Run(cfg).save_eval(evaluate)  # evaluate() on the model and test set Run loads -> eval.json


if __name__ == "__main__":
    main()
