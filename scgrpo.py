"""
SC-GRPO: Self-Conditioned GRPO (Shan et al., arXiv 2606.18810) in one readable file.

For each question x we sample a group of G answers and grade them with a rule-based verifier
(reward 1 if the final number is right). GRPO turns the rewards into one advantage per answer,
Eq. (1), and gives every token of the answer that same credit. SC-GRPO keeps the advantage but
reweights the tokens: it shows the same model one of its own *verified* answers tau in the system
prompt (the teacher, Eq. 4), re-scores the sampled answer in that context, and measures at every
position how far the next-token distribution moved, D_t = KL(teacher || student). Tokens where
seeing a correct solution changes the model's mind are the decisions that mattered; f(D) =
D / (D + c) turns D into a weight in [0, 1) on that token's clipped GRPO term. Groups with no
correct answer get a small diversity advantage instead, Eq. (5).

This file is the method, in the order the data flows. plumbing.py holds the machinery (flags,
data, models, the run folder, checkpoints, the credit page); speed.py the fast equals of plain
lines here (KV-cache sampler, shared prefills, blocked LM head): --fast, default on.

Where this file simplifies or interprets the paper (docs/notes.md says why, at length):
 1. c = max(P75(D), c_min) is taken over the active tokens of the whole step, not per micro-batch.
 2. D is measured once per step with the weights that sampled (fp32: student side from the sampler).
 3. Solve-none groups: the reference o_r itself gets advantage 0 and no gradient.
 4. Solve-none groups: tokens past L_i = min(|o_i|, |o_r|) get weight 0 (s_i never saw them).
 5. Solve-none groups: Eq. (5)'s mean and std run over the G-1 answers other than o_r.
 6. Solve-none groups: o_r goes into the teacher prompt under the same guide text as a verified one.
 7. Eq. (1) and (5) use the population std; a skipped (all-equal) group still counts in the 1/B.
 8. DAPO's dynamic sampling drops groups whose shaped rewards are all equal.
 9. Log-probs and KL use the sampling distribution softmax(z / temperature).
10. No reference-model KL (beta = 0), a constant learning rate, gradient clipping at 1.0.
11. The teacher's guide instruction is our own wording (the paper does not publish it).
12. DAPO refills its batch for at most --dapo-max-rounds = 3 sampling rounds per step.
13. DAPO's overlong buffer defaults to max_new_tokens // 4 for real models (0 for tiny).
14. A token whose D is not finite gets weight 0 and is left out of c, with a warning.

Run it:
    python scgrpo.py                                        # tiny model, offline, CPU, ~2 min
    python scgrpo.py --model SmolLM2-135M --task addition   # real model, offline, CPU, ~8 min
    python scgrpo.py --model Qwen2.5-0.5B --task gsm8k      # one 24 GB GPU
    python scgrpo.py --algo grpo                            # the baseline (or dapo)
    python scgrpo.py --resume runs/<run-folder>             # continue a run
"""
import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

import speed
from plumbing import (TINY_TEMPLATE, Phases, Run, autocast, credit_examples, decode, distinct,
                      extract_answer, join, left_pad, normalize_number, parse_config)

# -----------------------------------------------------------------------------
# Config


def opt(default, help):
    """A Config field: default and --help text (unit, and why this default) in one place."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every setting of a run, saved with it. The model's preset (plumbing.PRESETS) replaces
    some of these defaults; a flag given on the command line beats both."""
    model: str = opt("tiny", "tiny (built in), SmolLM2-135M, a .gguf, Qwen2.5-0.5B, a hub id")
    task: str = opt("arith", "gsm8k, or offline: arith (a+b=) or addition (sums in words)")
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
    grad_checkpoint: bool = opt(False, "recompute layers in backward: less memory, slower")
    c_min: float = opt(1e-4, "floor of c in f(D) = D / (D + c); paper: 1e-4")
    kl_quantile: float = opt(0.75, "c = quantile of D over active tokens; paper: P75")
    alpha_div: float = opt(0.1, "scale of the solve-none advantage, Eq. (5); paper: 0.1")
    overlong_buffer: int = opt(0, "dapo: length penalty in the last N tokens of the cap; 0 off")
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
    dtype: str = opt("auto", "bf16 autocast (weights stay fp32), fp32, or auto: bf16 on cuda")
    out: str = opt("", "run folder; default runs/<model>-<task>-<algo>-s<seed>-<time>")
    fast: bool = opt(True, "speed.py's fast equals of this file's plain lines; false: plain")

# -----------------------------------------------------------------------------
# Task and verifier: the tasks are in plumbing.py (arith, addition; GSM8K from the hub)

def verify(completion, gold):
    """Rule-based reward: True if the completion's final number equals the gold answer (a GSM8K
    `answer` field ending in '#### N', or a bare number). The final number is the last
    \\boxed{}, else what follows the last '####' or 'answer is', else the last number
    (plumbing.extract_answer); '$1,234.00' reads as 1234."""
    want = normalize_number(gold.rsplit("####", 1)[-1])
    got = extract_answer(completion)
    if want is None or got is None:
        return False
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-9)
    except (ValueError, OverflowError):
        return False

# -----------------------------------------------------------------------------
# Prompts: the student's, and the teacher's with a reference answer in it

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

# -----------------------------------------------------------------------------
# Sampling: G answers per question, graded into a Rollout


@dataclass
class Rollout:
    """G graded answers to each of B questions; row n of the (N, L) tensors, N = B * G, is
    answer n % G to question n // G. With --fast, hidden and lse are the student's next-token
    distribution, log_softmax(hidden @ W.T / T) = hidden @ W.T / T - lse, for the teacher's KL."""
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


@torch.no_grad()
def sample(model, prompts, n, max_new, temperature, eos_ids, pad_id, gen):
    """n answers to each prompt, plainly: every step runs the whole sequence so far through the
    model (no KV cache) and draws the next token from softmax(logits / T), the distribution the
    loss scores (no top-k / top-p); T = 0 is greedy. -> ids (N, L) padded with pad_id, mask
    (N, L) True up to and including the first EOS."""
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
            tok = z.argmax(-1)
        else:
            tok = torch.multinomial(F.softmax(z / temperature, -1), 1, generator=gen).squeeze(1)
        ids = torch.cat([ids, tok.masked_fill(done, pad_id)[:, None]], 1)
        attn = torch.cat([attn, (~done).long()[:, None]], 1)  # finished rows add padding only
        done |= torch.isin(tok, torch.tensor(eos_ids, device=device))
        if bool(done.all()):
            break
    mask = attn[:, P:].bool()                                                      # (N, L)
    L = max(1, int(mask.sum(1).max()))
    return ids[:, P:P + L], mask[:, :L]


def rollout(model, tok, cfg, rows, gen, eos_ids):
    """Sample G answers to each row's question and grade them. -> Rollout"""
    G = cfg.group_size
    prompts = [encode_prompt(tok, r["question"]) for r in rows]
    # speed.sample: a KV cache, inverse-CDF draws and, in fp32, the student's states (note 2)
    keep = cfg.algo == "scgrpo" and getattr(model, "autocast_dtype", None) is None
    args = (model, prompts, G, cfg.max_new_tokens, cfg.temperature, eos_ids, tok.pad_token_id, gen)
    ids, mask, hidden, lse = speed.sample(*args, keep_states=keep) if cfg.fast else (
        *sample(*args), None, None)
    texts = decode(tok, ids, mask)
    correct = torch.tensor([verify(t, rows[n // G]["answer"]) for n, t in enumerate(texts)])
    correct = correct.view(-1, G).float()                                          # (B, G)
    reward = correct.clone()                                                       # (B, G)
    if cfg.algo == "dapo" and cfg.overlong_buffer:
        lengths = mask.sum(1).cpu().view(-1, G)
        reward += overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    return Rollout(rows, prompts, ids, mask, texts, correct, reward, hidden, lse)


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


def pick_references(correct, route, rng, usable=None):
    """Reference tau for each answer of one group: list of G indices or None.
    partial: uniform over the group's verified answers, never the answer itself.
    none: one answer o_r drawn uniformly serves every other answer; o_r itself gets None.
    usable (G bools, default all): answers that may be a reference at all (TRL: not truncated)."""
    G, usable = len(correct), usable or [True] * len(correct)
    if route == "partial":
        good = [j for j in range(G) if correct[j] and usable[j]]
        return [rng.choice([j for j in good if j != i]) for i in range(G)]
    if route == "none":
        r = rng.choice([i for i in range(G) if usable[i]])
        return [None if i == r else r for i in range(G)]
    return [None] * G


def overlong_penalty(lengths, max_len, buffer):
    """DAPO's soft overlong shaping: 0 up to max_len - buffer, then linearly down to -1 at
    max_len. lengths (any shape) -> penalties (same shape)."""
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
    weights: torch.Tensor   # (M, L) f(D_it); 1 on each answer token for GRPO, DAPO, 'fallback'

    def __getitem__(self, k):
        k = torch.arange(len(self.route))[k]
        return Batch(self.row[k], self.ref[k], [self.route[i] for i in k.tolist()], self.adv[k],
                     self.n_active[k], self.kl[k], self.weights[k])


def make_batch(ro, routes, adv, rng, usable=None):
    """One row per answer that gets a gradient: its advantage, unit weights and, on SC-GRPO's
    routes, its reference. ro: Rollout; routes: B str; adv, usable (B, G) as above. -> Batch"""
    G = ro.correct.shape[1]
    row, ref, route = [], [], []
    for b, r in enumerate(routes):
        if r == "skip":
            continue
        ok = None if usable is None else usable[b].tolist()
        for i, j in enumerate(pick_references(ro.correct[b].bool().tolist(), r, rng, ok)):
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

# -----------------------------------------------------------------------------
# The self-conditioned teacher: per-token KL D, weights f(D), diversity advantage


@torch.no_grad()
def teacher_kl(model, cfg, ro, rows, teacher_prompts, prompt_of, ids, mask):
    """D_it = KL(teacher || student) at each active token (n of them) of the answers `rows` (b,)
    of rollout ro: the teacher, the same model with a reference in its prompt (Eq. 4), scores
    the same answer tokens. teacher_prompts: the distinct ones; prompt_of (b,): each answer's;
    ids, mask (b, L): the answers, mask True on active tokens. -> D (n,)"""
    G, T, head = cfg.group_size, cfg.temperature, model.get_output_embeddings()
    if not cfg.fast:  # plainly: student and teacher forwards, log-softmax over the vocabulary
        student = forward_answers(model, [ro.prompts[g] for g in (rows // G).tolist()], ids, mask)
        teacher = forward_answers(model, [teacher_prompts[k] for k in prompt_of.tolist()], ids,
                                  mask)
        log_s, log_t = F.log_softmax(student / T, -1), F.log_softmax(teacher / T, -1)  # (b, L, V)
        # D_t = KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)); kl_div(in, target)
        return F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)[mask]
    # speed.py: the same D with one prefill per distinct prompt and no (n, V) matrix
    if ro.hidden is not None:  # fp32: the student's side from the sampler's states (n, H), (n,)
        L = mask.shape[1]
        h_s, lse_s = ro.hidden[rows, :L][mask], ro.lse[rows, :L][mask]
    else:  # bf16 (note 2): a full forward of the student's prompt + answer, as the teacher gets
        groups, of = distinct((rows // G).tolist(), ids.device)
        h_s = speed.shared_prefix_hidden(model, [ro.prompts[g] for g in groups], of, ids, mask)
        lse_s = speed.head_lse(h_s, head, T)
    h_t = speed.shared_prefix_hidden(model, teacher_prompts, prompt_of, ids, mask)  # (n, H)
    return speed.head_kl(h_t, h_s, lse_s, head, T)


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
def self_condition(model, tok, cfg, ro, batch, encode=encode_prompt):
    """SC-GRPO's addition, for the answers with a reference: the per-token KL D against the
    teacher (a forward per micro-batch; encode builds its prompt, Eq. 4), f(D), and Eq. (5)
    in solve-none groups. Fills batch.n_active, kl, weights and adv; -> metrics."""
    G, device = cfg.group_size, ro.mask.device
    lengths = ro.lengths.view(-1)                                                  # (N,)
    # Active tokens: all of a partial-solve answer, the first L_i = min(|o_i|, |o_r|) in a
    # solve-none one (note 4).
    none = torch.tensor([r == "none" for r in batch.route], dtype=torch.bool)      # (M,)
    L_i = torch.minimum(lengths[batch.row], lengths[batch.ref.clamp(min=0)])
    batch.n_active = torch.where(none, L_i, lengths[batch.row])                    # (M,)
    # D in micro-batches, answers with the same reference side by side (few teacher prompts)
    routed = (batch.ref >= 0).nonzero().squeeze(1)                                 # (R,)
    order = sorted(routed.tolist(), key=lambda m: (int(batch.row[m]) // G, int(batch.ref[m])))
    for mb in torch.tensor(order, dtype=torch.long).split(cfg.micro_batch):
        ids, mask = pack(ro, batch.row[mb], batch.n_active[mb])                    # (b, L)
        refs, prompt_of = distinct(batch.ref[mb].tolist(), device)
        # Eq. (4): the teacher prompt holds the reference answer tau = o_j
        prompts = [encode(tok, ro.rows[j // G]["question"], reference=ro.texts[j])
                   for j in refs]
        d = teacher_kl(model, cfg, ro, batch.row[mb], prompts, prompt_of, ids, mask)  # (n,)
        L = mask.shape[1]
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
        members = (batch.row // G == b).nonzero().squeeze(1)  # batch rows: b's answers but o_r
        i = batch.row[members] % G  # their places in the group; r below: o_r's place
        w = torch.zeros(G, int(lengths[batch.row[members]].max()))                 # (G, L_b)
        w[i] = batch.weights[members, :w.shape[1]].cpu()
        r = int(batch.ref[members[0]]) % G  # every member's reference is o_r
        batch.adv[members] = diversity_advantages(w, ro.lengths[b], r, cfg.alpha_div)[i]
    q = torch.tensor([0.5, 0.75, 0.95], device=device)
    p50, p75, p95 = torch.quantile(kl[active].float(), q).tolist()
    return dict(kl_p50=p50, kl_p75=p75, kl_p95=p95, c=c, weight_mean=float(weights[active].mean()),
                kl_nonfinite=int(nonfinite.sum()))

# -----------------------------------------------------------------------------
# The loss: the clipped GRPO objective, each token weighted by f(D)


def policy_loss(logp, old_logp, adv, weights, scale, mask, eps_low, eps_high):
    """-J_SC and the number of tokens whose ratio is outside the clip range. logp, old_logp,
    weights, scale, mask (b, L); adv (b,). With weights = 1: GRPO (scale = 1/(B G |o_i|)
    per group) or DAPO (scale = 1/total tokens)."""
    # Zero the padding first: a NaN there would otherwise leak into the gradient through where().
    logp, old_logp = logp.masked_fill(~mask, 0.0), old_logp.masked_fill(~mask, 0.0)
    ratio = torch.exp(logp - old_logp)                                             # rho (b, L)
    a = adv[:, None]                                                               # (b, 1)
    term = torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)       # (b, L)
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

    def logprobs(mb):  # -> log pi_theta(o_t | s_t) (b, L), 0 outside the answers; mask (b, L)
        ids, mask = pack(ro, mb.row)                                               # (b, L)
        groups = (mb.row // G).tolist()
        if not cfg.fast:  # plainly: log_softmax(model(prompt + answer).logits / T).gather(...)
            logits = forward_answers(model, [ro.prompts[g] for g in groups], ids, mask)
            lp = F.log_softmax(logits / cfg.temperature, -1).gather(-1, ids[..., None])
            return lp.squeeze(-1).masked_fill(~mask, 0.0), mask
        # speed.py: one prefill per group (none under activation checkpointing, which drops the
        # KV cache), then the LM head in vocabulary blocks with no (n, V) matrix
        keys, prompt_of = distinct(groups, device)
        h = (speed.completion_hidden(model, [ro.prompts[g] for g in groups], ids, mask)
             if cfg.grad_checkpoint else  # (n, H)
             speed.shared_prefix_hidden(model, [ro.prompts[g] for g in keys], prompt_of, ids, mask))
        lp = speed.head_logprobs(head, h, ids[mask], cfg.temperature)              # (n,)
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
            loss, n_clipped = policy_loss(  # mu = 1: old = logp.detach(), so rho = 1 (no clip)
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
    clock = Phases(next(model.parameters()).device)  # seconds and CUDA memory per phase
    ro, sampled, rounds = sample_groups(model, tok, cfg, train_rows, batcher, gen, eos_ids)
    clock.lap("sample")
    adv = group_advantages(ro.reward)                                              # (B, G)
    routes = route_groups(ro.reward, cfg.algo)
    batch = make_batch(ro, routes, adv, rng)
    routed = (batch.ref >= 0).nonzero().squeeze(1).tolist()
    sc_stats = self_condition(model, tok, cfg, ro, batch) if routed else {}
    clock.lap("teacher")
    loss, clip_frac, grad_norm, stepped = update(model, opt, cfg, ro, batch)
    clock.lap("update")
    metrics = dict(
        reward_mean=float(sampled.correct.mean()), loss=loss, grad_norm=grad_norm,
        clip_frac=clip_frac, len_mean=float(sampled.lengths.float().mean()),
        groups_skipped=routes.count("skip"), groups_partial=routes.count("partial"),
        groups_none=routes.count("none"), groups_fallback=routes.count("fallback"),
        answers_updated=len(batch.route), **sc_stats, nonfinite=bool(batch.route) and not stepped,
        **clock.seconds)
    if cfg.algo == "dapo":
        metrics.update(sample_rounds=rounds, groups_dropped=len(sampled.rows) - len(ro.rows))
    metrics.update(clock.memory)
    return metrics, credit_examples(tok, cfg, ro, batch, routed)

# -----------------------------------------------------------------------------
# The training loop


def train(cfg, resume=""):
    """Train, evaluate and save. Set-up, logs, checkpoints, resume and Ctrl-C live in
    plumbing.Run; nothing runs at import. resume: a checkpoint folder from parse_config, or ""."""
    run = Run(cfg, resume)
    if run.start == 1:
        run.log_eval(0, *evaluate(run.model, run.tok, run.eval_rows, cfg, run.eos_ids))
    credit, bar = [], tqdm(range(run.start, cfg.steps + 1), desc="train", initial=run.start - 1,
                           total=cfg.steps, disable=None)
    for step in bar:
        t0 = time.time()
        m, new_credit = train_step(run.model, run.opt, run.tok, cfg, run.train_rows, run.batcher,
                                   run.rng, run.gen, run.eos_ids)
        credit = new_credit or credit
        run.log_step(bar, {"step": step, **m, "seconds": time.time() - t0})  # stops on NaN runs
        if step % cfg.eval_every == 0 or step == cfg.steps:
            run.log_eval(step, *evaluate(run.model, run.tok, run.eval_rows, cfg, run.eos_ids),
                         credit if cfg.algo == "scgrpo" else None)
        run.checkpoint(bar, step)  # every --save-every steps, at the end, and after a Ctrl-C
    bar.close()
    run.finish()
    return cfg

# -----------------------------------------------------------------------------
# Evaluation: greedy accuracy, Avg@k and Pass@k


def avg_and_pass_at_k(correct):
    """correct (Q, k) bool -> (Avg@k: mean reward of k samples, Pass@k: share of questions
    solved by at least one of the k)."""
    return float(correct.float().mean()), float(correct.any(1).float().mean())


@torch.no_grad()
def evaluate(model, tok, rows, cfg, eos_ids):
    """Greedy accuracy on `rows`, and Avg@k / Pass@k (k = cfg.eval_k) at the training
    temperature. Its own generator: evaluating never shifts the training random stream.
    -> (metrics, the first 4 greedy answers)"""
    device, k = next(model.parameters()).device, cfg.eval_k
    clock = Phases(device)
    gen = torch.Generator(device).manual_seed(cfg.seed + 7919)
    greedy, sampled, shown = [], [], []
    # at most max(eval_batch, a step's answers) rows per sampler call: no more memory than training
    max_rows = max(cfg.eval_batch, cfg.prompts_per_step * cfg.group_size)
    for n, temp, into in ((1, 0.0, greedy), (k, cfg.temperature, sampled)):
        q = max(1, min(cfg.eval_batch, max_rows // max(n, 1)))  # questions per call
        for i in tqdm(range(0, len(rows) if n else 0, q), desc="eval", leave=False, disable=None):
            batch = rows[i:i + q]
            prompts = [encode_prompt(tok, r["question"]) for r in batch]
            args = (model, prompts, n, cfg.max_new_tokens, temp, eos_ids, tok.pad_token_id, gen)
            ids, mask = speed.sample(*args)[:2] if cfg.fast else sample(*args)
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
    clock.lap("eval")
    return {**out, **clock.memory}, shown


def main(argv=None):
    cfg, resume = parse_config(Config, argv)
    train(cfg, resume)


if __name__ == "__main__":
    main()
