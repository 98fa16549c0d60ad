"""
SC-GRPO, Self-Conditioned GRPO (Shan et al., arXiv 2606.18810): one file, read top to bottom.

GRPO samples G answers to each question, rewards those a rule-based verifier accepts, and gives
every token of answer o_i one advantage A_i, Eq. (1). SC-GRPO shows the same model one of its own
verified answers tau (the teacher, Eq. 4) and weights each token's clipped GRPO term by
f(D) = D / (D + c), D = KL(teacher || student) at that token (§5.1). A group's route, by n_c, its
number of correct answers:
    2 <= n_c < G   partial     tau: a verified answer other than o_i; A_i of Eq. (1), times f(D)
    n_c = 1        fallback    plain GRPO, weight 1 (taught, such groups collapsed the entropy)
    n_c = 0        solve-none  tau = o_r, one of its own answers; alpha * A_div_i of Eq. (5), x f(D)
    n_c = G        skip        every advantage is 0: no gradient
Indices: b a question (B a step); n a Rollout row, answer n % G to question n // G; m a Batch row,
one of the M answers that get a gradient. --algo grpo is GRPO: every weight 1, no teacher.
Where we interpret the paper (docs/notes.md says why): 1. c over all the step's active tokens, both
routes. 2. D measured once a step, not per PPO epoch. 3. o_r gets no gradient. 4. Solve-none tokens
past L_i = min(|o_i|, |o_r|) weigh 0 (1/|o_i| stays). 5. Eq. (5) over the G - 1 answers but o_r.
6. o_r under the same guide text. 7. Population std; a skipped group counts in B. 8. Log-probs and
KL at softmax(z / T). 9. No reference KL, a constant lr, gradient norm clipped at 1.0. 10. Our
guide wording. 11. A non-finite D weighs 0. 12. Eq. (5) as written (docs/eq5.md: its direction).
Seams (variants/): main(Config=, step=), teacher_prompts, Batch.weights/.norm, update(loss_of=).
Run: python scgrpo.py (tiny model, CPU, ~2 min); --model SmolLM2-135M --task addition (CPU,
~8 min); --model Qwen2.5-0.5B --task gsm8k (one GPU). --fast (on in the real-model presets) swaps
three plain steps, marked `if cfg.fast:`, for their equals in machinery/speed.py.
"""
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
from machinery.batching import decode, distinct, left_pad, micro_batches, pack, take_rows
from machinery.cli import parse_config  # flags -> Config: preset, then explicit flags; checks
from machinery.credit import credit_examples  # the answers shown on the credit page
from machinery.models import TINY_TEMPLATE, autocast, no_grad_model, training
from machinery.metrics import Phases, UpdateLog, kl_metrics, step_metrics  # what a step logs
from machinery.runs import Run  # the run folder: logs, checkpoints, resume
from machinery.tasks import Batcher, last_boxed
# Bookkeeping: left_pad(token lists) -> ids, mask (B, P), each prompt ending in the last column;
# pack(rollout, rows[, n]) -> ids, mask (b, L) of those answers (their first n tokens).

# Config -------------------------------------------------------------------------------------------

def setting(default, help, choices=None, rule=None):
    """A Config field: its default, its --help text (unit, why this default), allowed values, and
    a rule (test(value, cfg), the rule in words) that machinery/cli.py checks before a run."""
    return field(default=default, metadata={"help": help, "choices": choices, "rule": rule})


@dataclass
class Config:
    """The settings of an SC-GRPO (or GRPO) run; the model's PRESETS, then flags, beat defaults."""
    model: str = setting("tiny", "tiny (built in), SmolLM2-135M, a .gguf, Qwen2.5-0.5B, a hub id")
    task: str = setting("arith", "gsm8k (hub), or offline: arith (a+b=), addition (sums in words)",
                        ("gsm8k", "arith", "addition"))
    data: str = setting("", "local folder with train.jsonl / test.jsonl in GSM8K's schema")
    algo: str = setting("scgrpo", "the method, or GRPO (every weight 1)", ("scgrpo", "grpo"))
    steps: int = setting(200, "training steps (each ppo_epochs optimizer updates)")
    prompts_per_step: int = setting(8, "questions per update; paper: 8")
    group_size: int = setting(8, "G answers per question; paper: 8")
    max_new_tokens: int = setting(512, "answer length cap; the paper allows 12,288 on an 8B model")
    temperature: float = setting(1.0, "sampling temperature, also used to score log-probs and KL")
    lr: float = setting(1e-6, "AdamW learning rate; paper: 1e-6")
    weight_decay: float = setting(0.0, "AdamW weight decay; RL fine-tuning usually uses none")
    epsilon: float = setting(0.2, "PPO clip range: the ratio is clipped to [1 - eps, 1 + eps]")
    ppo_epochs: int = setting(1, "mu: optimizer steps per sampled batch; >1 keeps old log-probs")
    micro_batch: int = setting(8, "answers per forward/backward; gradients are accumulated")
    max_grad_norm: float = setting(1.0, "gradient clipping; paper silent, 1.0 the common default")
    grad_checkpoint: bool = setting(False, "recompute layers in backward: less memory, slower")
    c_min: float = setting(1e-4, "floor of c in f(D) = D / (D + c); paper: 1e-4")
    kl_quantile: float = setting(0.75, "c = quantile of D over active tokens; paper: P75")
    alpha_div: float = setting(0.1, "scale of the solve-none advantage, Eq. (5); paper: 0.1")
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
# the guide text, our wording (note 10); a solve-none o_r, a wrong answer, gets it too (note 6)
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

# Sampling by level: tokens (sample) -> answers (sample_answers) -> groups (sample_groups) ---------

@dataclass
class Rollout:
    """G graded answers to each of B questions; row n of the (N, L) tensors, N = B * G, is
    answer n % G to question n // G. hidden and lse: see speed.teacher_kl (--fast only)."""
    problems: list                # B task dicts {'question', 'answer'}
    prompts: list                 # B student prompts, token-id lists
    ids: torch.Tensor             # (N, L) answer tokens, padding after the end
    mask: torch.Tensor            # (N, L) bool, True up to and including the first EOS
    texts: list                   # N decoded answers
    correct: torch.Tensor         # (B, G) the reward r: 1.0 where the verifier accepts the answer
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
    """n answers to each prompt, token by token: each step runs the whole sequence (no KV cache)
    and draws from softmax(logits / T), the distribution the loss scores (no top-k or top-p);
    T = 0 is greedy. -> ids (N, L) padded with pad_id, mask (N, L) True up to the first EOS."""
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
    """n answers to each prompt: sample(), or speed.sample with --fast. -> ids, mask (N, L), and
    the student's states (speed.teacher_kl reuses them: --fast, keep_states, fp32) or None, None."""
    fp32 = getattr(model, "autocast_dtype", None) is None  # bf16 passes round apart: not kept
    args = (no_grad_model(model), prompts, n, cfg.max_new_tokens, temperature, eos_ids, pad_id, gen)
    if cfg.fast:  # speed.sample in place of sample(): a KV cache and inverse-CDF draws
        return speed.sample(*args, keep_states=keep_states and fp32)
    return (*sample(*args), None, None)


def sample_groups(model, tok, cfg, problems, n, temperature, gen, eos_ids, keep_states=False):
    """A group of n answers to each question, decoded and verified. -> Rollout (G = n)"""
    prompts = [encode_prompt(tok, p["question"]) for p in problems]
    ids, mask, hidden, lse = sample_answers(model, cfg, prompts, n, temperature, eos_ids,
                                            tok.pad_token_id, gen, keep_states)
    texts = decode(tok, ids, mask)
    correct = torch.tensor([verify(t, problems[j // n]["answer"]) for j, t in enumerate(texts)])
    return Rollout(problems=problems, prompts=prompts, ids=ids, mask=mask, texts=texts,
                   correct=correct.view(-1, n).float(), hidden=hidden, lse=lse)

# Group advantages, routes and references ----------------------------------------------------------

def group_advantages(rewards):
    """Group-relative advantages. rewards (B, G) -> (B, G); a group whose rewards are all
    equal gets exactly 0, not NaN."""
    mean = rewards.mean(1, keepdim=True)                                           # (B, 1)
    std = rewards.std(1, keepdim=True, unbiased=False)                             # (B, 1)
    # Eq. (1): A_i = (r_i - mean(r)) / std(r)  -- one scalar per answer, shared by its tokens
    return torch.where(std > 0, (rewards - mean) / std.clamp_min(1e-12), torch.zeros_like(rewards))


def route_groups(rewards, algo):
    """Each group's route from its rewards (B, G) -> B str. scgrpo: by n_c, the header's table
    (the paper's ablation teaching n_c = 1 groups saw entropy collapse). grpo: 'skip' or 'grpo'."""
    G, routes = rewards.shape[1], []
    for group in rewards:                                                          # (G,)
        n_c = int((group > 0.5).sum())
        if algo == "grpo":
            routes.append("skip" if bool((group == group[0]).all()) else "grpo")
        else:
            routes.append({0: "solve_none", 1: "fallback", G: "skip"}.get(n_c, "partial"))
    return routes


def pick_references(correct, route, rng):
    """Reference tau for each answer of one group: list of G indices or None.
    partial: uniform over the group's verified answers, never the answer itself.
    solve_none: one answer o_r drawn uniformly serves every other answer; o_r itself gets None."""
    G = len(correct)
    if route == "partial":
        good = [j for j in range(G) if correct[j]]
        return [rng.choice([j for j in good if j != i]) for i in range(G)]
    if route == "solve_none":
        r = rng.choice(range(G))                                                   # o_r's index
        return [None if i == r else r for i in range(G)]
    return [None] * G


@dataclass
class Batch:
    """The M answers that get a gradient this step, in rollout order (skipped groups and each
    solve-none o_r left out). Every per-answer quantity is a row, so a micro-batch is a slice,
    batch[i:j]. make_batch sets kl 0, weights 1, adv Eq. (1); the teacher returns copies."""
    row: torch.Tensor       # (M,) long, the answer's row n in the rollout
    question: torch.Tensor  # (M,) long, its question b in the rollout: n // G
    ref: torch.Tensor       # (M,) long, the rollout row of its reference (tau or o_r); -1: none
    route: list             # M routes: 'grpo', 'partial', 'solve_none' or 'fallback'
    adv: torch.Tensor       # (M,) A_i of Eq. (1), or alpha * A_div_i of Eq. (5) if solve-none
    n_active: torch.Tensor  # (M,) its active tokens: all |o_i|, or L_i if solve-none (note 4)
    norm: torch.Tensor      # (M,) J's normaliser of each of its tokens: 1 / (B G |o_i|)
    kl: torch.Tensor        # (M, L) D_it; 0 where not scored
    weights: torch.Tensor   # (M, L) f(D_it); 1 on each answer token for GRPO and 'fallback'

    @property
    def scored(self):       # (R,) the rows whose answer a teacher scores: those with a reference
        return (self.ref >= 0).nonzero().squeeze(1)

    def __getitem__(self, k):  # a slice or index list k -> the Batch of those rows
        return take_rows(self, torch.arange(len(self.route))[k])


def make_batch(ro, routes, adv, refs):
    """One row per answer that gets a gradient: its advantage, unit weights, the normaliser of
    J and, on SC-GRPO's routes, its reference and active length. ro: Rollout; routes: B str;
    adv (B, G); refs: each group's G references (pick_references). -> Batch (kl still 0)"""
    G, lengths = ro.G, ro.lengths                                                  # (B, G)
    row, ref, route, n_active = [], [], [], []
    for b, (group_route, group_refs) in enumerate(zip(routes, refs)):
        if group_route == "skip":
            continue
        for i, j in enumerate(group_refs):
            if group_route == "solve_none" and j is None:
                continue  # o_r, the solve-none reference itself: advantage 0, no gradient (note 3)
            L_i = int(lengths[b, i])  # active tokens: the whole answer, or if solve-none its
            if group_route == "solve_none":  # first L_i = min(|o_i|, |o_r|) (note 4)
                L_i = min(L_i, int(lengths[b, j]))
            row.append(b * G + i)
            ref.append(-1 if j is None else b * G + j)
            route.append(group_route)
            n_active.append(L_i)
    row = torch.tensor(row, dtype=torch.long)                                       # (M,)
    mask = ro.mask[row]                                                             # (M, L)
    # J (§5.1) = 1/B sum_b 1/G sum_i 1/|o_i| sum_t ...: 1 / (B G |o_i|) on each token of o_i, with
    # the whole |o_i| also where only L_i weigh (note 4); a skipped group still counts in B (note 7)
    norm = (1.0 / (len(routes) * G * lengths.view(-1)[row].double())).float()      # (M,)
    return Batch(row=row, question=row // G, ref=torch.tensor(ref, dtype=torch.long), route=route,
                 adv=adv.reshape(-1)[row], n_active=torch.tensor(n_active, dtype=torch.long),
                 norm=norm, kl=torch.zeros(mask.shape, device=mask.device), weights=mask.float())

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

# The self-conditioned teacher: its prompts, D per token, f(D) with c, Eq. (5) ---------------------

def teacher_prompts(tok, ro, batch):
    """Eq. (4)'s prompt for each reference the batch uses: {rollout row j: token ids of its
    question with answer j as tau}. A fork's teacher (a gold solution, other wording) goes here."""
    return {j: encode_prompt(tok, ro.problems[j // ro.G]["question"], ro.texts[j])
            for j in batch.ref.unique().tolist() if j >= 0}


@torch.no_grad()
def teacher_kl(model, cfg, ro, rows, prompts, prompt_of, ids, active):
    """D_it = KL(teacher || student) at the n active tokens of the answers `rows` (b,): the teacher
    (the same model, a reference in its prompt, Eq. 4) scores the same tokens. prompts: the
    distinct teacher prompts, prompt_of (b,) each answer's; ids, active (b, L). -> D (n,)"""
    model = no_grad_model(model)  # --dtype bf16: the bf16 weights (no gradient flows here)
    if cfg.fast:  # speed.teacher_kl in place of the four statements below
        return speed.teacher_kl(model, ro, rows, prompts, prompt_of, ids, active, cfg.temperature)
    student = forward_answers(model, [ro.prompts[b] for b in (rows // ro.G).tolist()], ids, active)
    teacher = forward_answers(model, [prompts[k] for k in prompt_of.tolist()], ids, active)
    log_s, log_t = (F.log_softmax(z / cfg.temperature, -1) for z in (student, teacher))  # (b, L, V)
    # D_t (§5.1) = KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)); kl_div(in, tgt)
    return F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)[active]


@torch.no_grad()
def measure_kl(model, cfg, ro, batch, prompts):
    """D at the active tokens of every answer with a reference (prompts: teacher_prompts), sorted
    by question and reference so that --fast prefills a prompt once. -> kl (M, L), 0 elsewhere"""
    kl = torch.zeros_like(batch.kl)                                                # (M, L)
    order = sorted(batch.scored.tolist(), key=lambda m: (int(batch.question[m]), int(batch.ref[m])))
    for chunk in torch.tensor(order, dtype=torch.long).split(cfg.micro_batch):    # Batch rows
        ids, active = pack(ro, batch.row[chunk], batch.n_active[chunk])            # (b, L)
        refs, prompt_of = distinct(batch.ref[chunk].tolist(), ids.device)  # their references
        d = teacher_kl(model, cfg, ro, batch.row[chunk], [prompts[j] for j in refs], prompt_of,
                       ids, active)                                                # (n,)
        back = torch.zeros(active.shape, device=kl.device).masked_scatter(active, d)  # (b, L)
        kl[chunk, :active.shape[1]] = back  # pack cut the rows to their longest answer: <= L wide
    return kl


def sc_weights(kl, active, c_min=1e-4, q=0.75):
    """f(D) = D / (D + c), c = max(quantile_q(D over active tokens), c_min). kl, active (...) ->
    weights (...) in [0, 1), 0 off the active tokens, and c. A non-finite D weighs 0 (note 11)."""
    kl = kl.clamp_min(0.0)  # D >= 0, but rounding can put a teacher ~ student token a hair below
    active = active & torch.isfinite(kl)
    d = kl[active]
    c = max(float(torch.quantile(d.float(), q)) if d.numel() else 0.0, c_min)
    # f(D) (§5.1) = D / (D + c): more than half the gradient where D > c (the P75, or c_min)
    return torch.where(active, kl / (kl + c), torch.zeros_like(kl)).detach(), c


@torch.no_grad()
def self_condition(model, cfg, ro, batch, prompts):
    """SC-GRPO's teacher: D (measure_kl), f(D) with c over the step's active tokens (note 1); a
    batch without references (GRPO) comes back as it was. -> (batch with kl, weights; metrics)"""
    scored = batch.scored                                                          # (R,)
    if not len(scored):
        return batch, {}
    kl = measure_kl(model, cfg, ro, batch, prompts)                                # (M, L)
    active = (torch.arange(kl.shape[1]) < batch.n_active[scored, None]).to(kl.device)  # (R, L)
    w, c = sc_weights(kl[scored], active, cfg.c_min, cfg.kl_quantile)              # (R, L)
    weights = batch.weights.index_put((scored,), w)  # a copy, f(D) in the scored rows (M, L)
    return replace(batch, kl=kl, weights=weights), kl_metrics(kl[scored], active, w, c)


def window_means(batch):
    """s_i (§5.1) = 1/L_i sum_{t <= L_i} f(D_it): each answer's mean weight over its window."""
    return batch.weights.sum(1).cpu() / batch.n_active                             # (M,)


def diversity_advantages(s, alpha=0.1, eps=1e-6):
    """Eq. (5) for one solve-none group: s (G-1,) the scores s_i of its answers other than o_r
    (note 5). -> alpha * A_div (G-1,). Unlike Eq. (1) the paper adds eps to the std here."""
    # Eq. (5): A_div_i = (s_i - mean(s)) / (std(s) + eps) over the G-1 answers, times alpha
    return alpha * (s - s.mean()) / (s.std(unbiased=False) + eps)


def solve_none_advantages(batch, s, alpha):
    """Eq. (5) in every solve-none group of the batch from each answer's score s (M,).
    -> adv (M,): batch.adv with each solve-none answer's entry replaced by alpha * A_div_i"""
    none = torch.tensor([r == "solve_none" for r in batch.route], dtype=torch.bool)  # (M,)
    adv = batch.adv.clone()
    for b in batch.question[none].unique().tolist():
        members = none & (batch.question == b)  # question b's answers here: all but o_r
        adv[members] = diversity_advantages(s[members], alpha)
    return adv

# The loss: the clipped GRPO objective, each token weighted by f(D) --------------------------------

def policy_loss(logp, old_logp, adv, weights, norm, mask, eps_low, eps_high):
    """-J_SC and the number of tokens whose ratio is outside the clip range. logp, old_logp,
    weights, mask (b, L), weights 0 off the answer; adv, norm (b,). With weights 1: GRPO."""
    # padding: rho = 1 there, so a NaN cannot leak into the gradient, and weight 0, so no loss
    logp, old_logp = logp.masked_fill(~mask, 0.0), old_logp.masked_fill(~mask, 0.0)
    ratio = torch.exp(logp - old_logp)                                             # rho (b, L)
    a = adv[:, None]                                                               # (b, 1)
    term = torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)       # (b, L)
    # J_SC (§5.1) = sum_i sum_t f(D_it) min(rho A_i, clip(rho) A_i) / (B G |o_i|)
    per_token = weights * term * norm[:, None]                                     # (b, L)
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & mask
    return -per_token.sum(), int(clipped.sum())


def micro_batch_loss(model, cfg, ro, mb, old_logp=None):
    """The loss of the micro-batch mb (a Batch of b rows), -J_SC's share, and its clipped-token
    count. update's loss_of: a fork that changes the loss replaces this function."""
    logp, mask = answer_logprobs(model, cfg, ro, mb)                               # (b, L)
    old_logp = logp.detach() if old_logp is None else old_logp  # mu = 1: rho = 1, the clip idle
    # pack cut mask to this micro-batch's longest answer; the weights are the rollout's L wide
    return policy_loss(logp, old_logp, mb.adv.to(logp.device), mb.weights[:, :mask.shape[1]],
                       mb.norm.to(logp.device), mask, cfg.epsilon, cfg.epsilon)

# One training step: sample -> reward -> advantages -> (SC-GRPO) teacher -> clipped update ---------

def update(model, optimizer, cfg, ro, batch, loss_of=micro_batch_loss):
    """ppo_epochs AdamW steps on the loss, its gradient accumulated over micro-batches.
    -> (loss, clip_frac, grad_norm, grad_norm_none and update_size as a dict; stepped)"""
    # solve-none answers first, in micro-batches of their own: grad_norm_none is Eq. (5)'s part
    order, slices, n_none = micro_batches(batch, ro, cfg.micro_batch)
    batch = batch[order]
    old = None  # mu > 1: the log-probs before any step (this same pass), frozen for every epoch
    if cfg.ppo_epochs > 1:
        with torch.no_grad():
            old = [answer_logprobs(model, cfg, ro, batch[sl])[0] for sl in slices]
    log, stepped = UpdateLog(model, cfg.log_update_size), False
    with training(model, optimizer, cfg.grad_checkpoint):  # and bf16 autocast if --dtype bf16
        for _ in range(cfg.ppo_epochs if slices else 0):
            log.new_epoch()
            for k, sl in enumerate(slices):
                loss, n_clipped = loss_of(model, cfg, ro, batch[sl], old[k] if old else None)
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


def train_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids):
    """One update: sample and verify -> Eq. (1), routes, references -> (SC-GRPO) D, f(D) and
    Eq. (5) -> clipped update. -> (metrics, credit-page examples)"""
    clock = Phases(next(model.parameters()).device)  # seconds and CUDA memory per phase
    ro = sample_groups(model, tok, cfg, batcher.take(cfg.prompts_per_step), cfg.group_size,
                       cfg.temperature, gen, eos_ids, keep_states=cfg.algo == "scgrpo")
    clock.lap("sample")
    adv = group_advantages(ro.correct)                                             # (B, G)
    routes = route_groups(ro.correct, cfg.algo)                                    # B routes
    refs = [pick_references(ok, r, rng) for ok, r in zip(ro.correct.bool().tolist(), routes)]
    batch = make_batch(ro, routes, adv, refs)                                      # M rows
    batch, sc_stats = self_condition(model, cfg, ro, batch, teacher_prompts(tok, ro, batch))
    # Eq. (5) in the solve-none groups, from each answer's mean f(D) over its window
    batch = replace(batch, adv=solve_none_advantages(batch, window_means(batch), cfg.alpha_div))
    clock.lap("teacher")
    upd, stepped = update(model, optimizer, cfg, ro, batch)
    clock.lap("update")
    eq5_only = set(batch.route) == {"solve_none"}  # Eq. (5) is the step's only gradient
    metrics = step_metrics(ro, routes, batch, clock, **upd, **sc_stats, eq5_only=eq5_only,
                           nonfinite=bool(batch.route) and not stepped)
    return metrics, credit_examples(tok, ro, batch)

# Evaluation: greedy accuracy, Avg@k and Pass@k ----------------------------------------------------

EVAL_SEED_OFFSET = 7919  # evaluation samples from its own stream, seed + this (any fixed offset)


def eval_groups(model, tok, problems, cfg, eos_ids, n, temperature, gen):
    """sample_groups in calls of at most a step's rows. -> texts, correct, lengths (Q n each)"""
    rows = max(cfg.eval_batch, cfg.prompts_per_step * cfg.group_size)  # a sampler call's rows
    q = max(1, min(cfg.eval_batch, rows // n))  # questions per call: at most that many rows
    texts, correct, lengths = [], [], []
    for i in tqdm(range(0, len(problems), q), desc="eval", leave=False, disable=None):
        ro = sample_groups(model, tok, cfg, problems[i:i + q], n, temperature, gen, eos_ids)
        texts, lengths = texts + ro.texts, lengths + ro.mask.sum(1).tolist()
        correct += ro.correct.view(-1).bool().tolist()
    return texts, correct, lengths


@torch.no_grad()
def evaluate(model, tok, problems, cfg, eos_ids):
    """Greedy accuracy on `problems`, and Avg@k / Pass@k (k = cfg.eval_k) at the training
    temperature, from its own generator (the training stream never moves). -> (metrics, per
    question: greedy text, correct, length, extracted number; with k, its correct samples)"""
    device, k = next(model.parameters()).device, cfg.eval_k
    gen = torch.Generator(device).manual_seed(cfg.seed + EVAL_SEED_OFFSET)
    texts, greedy, lengths = eval_groups(model, tok, problems, cfg, eos_ids, 1, 0.0, gen)
    per_question = dict(text=texts, correct=greedy, length=lengths,
                        answer=[extract_answer(t) for t in texts])
    out = {"eval_greedy_acc": sum(greedy) / len(greedy)}
    if k:
        _, k_correct, _ = eval_groups(model, tok, problems, cfg, eos_ids, k, cfg.temperature, gen)
        hits = torch.tensor(k_correct).view(-1, k)                                 # (Q, k)
        # Avg@k: the mean reward of k samples; Pass@k: the share of questions solved by any
        out["eval_avg_at_k"] = float(hits.float().mean())
        out["eval_pass_at_k"] = float(hits.any(1).float().mean())
        per_question["k_correct"] = hits.sum(1).tolist()
    return out, per_question

# The training loop --------------------------------------------------------------------------------

def train(cfg, resume="", step=train_step):
    """Train, evaluate and save. resume: a checkpoint folder, or ""; step: a fork's own step."""
    # One seed for everything. With one CPU thread (OMP_NUM_THREADS=1) a run repeats bit for bit;
    # with more, or on a GPU, reductions may split differently, and runs drift apart slowly.
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the tiny model's initial weights come from this stream
    run = Run(cfg, resume)  # loads the data and the model (fp32 weights; resume: the checkpoint's)
    model, tok = run.model, run.tok
    # AdamW on every weight at a constant learning rate (note 9), PyTorch's betas (0.9, 0.999)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)                            # which answer is whose reference
    gen = torch.Generator(run.device).manual_seed(cfg.seed)  # the sampler's draws
    batcher = Batcher(run.train_set, cfg.seed)               # questions: a seeded order per epoch
    start = run.begin(optimizer, rng, gen, batcher)  # 1, or after resume the next step (restored)
    if start == 1:
        run.log_eval(0, *evaluate(model, tok, run.eval_set, cfg, run.eos_ids))
    bar = tqdm(range(start, cfg.steps + 1), desc="train", initial=start - 1, total=cfg.steps,
               disable=None)
    for i in bar:
        m, credit = step(model, optimizer, tok, cfg, batcher, rng, gen, run.eos_ids)
        run.log_step(bar, {"step": i, **m}, credit)  # may stop: --max-bad-steps NaN steps
        if i % cfg.eval_every == 0 or i == cfg.steps:
            run.log_eval(i, *evaluate(model, tok, run.eval_set, cfg, run.eos_ids))
        run.checkpoint(bar, i)  # every --save-every steps, at the end, and after a Ctrl-C
    run.finish(bar)


def main(argv=None, Config=Config, step=train_step):
    """The command line. A fork passes its own Config (its flags) and step."""
    cfg, resume = parse_config(Config, PRESETS, argv)
    if not cfg.eval_only:
        return train(cfg, resume, step)
    torch.manual_seed(cfg.seed)  # the tiny model's initial weights; no optimizer, no training
    Run(cfg).save_eval(evaluate)  # evaluate() on the model and test set Run loads -> eval.json


if __name__ == "__main__":
    main()
