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
    n_c = G        skip        every advantage is 0: no gradient   (--algo grpo: 'grpo' or 'skip')
Indices: b a question (B a step), i and j answers in its group (G), t a token, n a Rollout row
(answer n % G to question n // G), m a Batch row (one of the M answers that get a gradient).
Seams, each a function a fork passes to main() in place of ours (variants/README.md): context=
teacher_prompts (each answer's teacher prompt, Eq. 4), credit=sc_credit (per-token weights f(D),
advantages of Eq. 5), loss_of=micro_batch_loss (a micro-batch's -J_SC), route=route_groups.
Where we read the paper, a comment says "our reading" (docs/notes.md says why): at GUIDE,
group_advantages, make_batch, answer_logprobs, sc_weights, diversity_advantages, train_step, train.
Run: python scgrpo.py (tiny model, CPU, ~2 min); --model SmolLM2-135M --task addition (CPU,
~8 min); --model Qwen2.5-0.5B --task gsm8k (one GPU). --fast (on in the real-model presets) swaps
three plain steps, each marked `if cfg.fast:`, for their equals in machinery/speed.py.
"""
import math
import random
from dataclasses import dataclass, replace
from decimal import Decimal
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_
from tqdm import tqdm

from machinery import speed  # the fast equals of three plain steps below (--fast)
from machinery.batching import decode, distinct, left_pad, micro_batches, pack, take_rows
from machinery.cli import parse_config, setting  # flags -> Config; setting: a field with --help
from machinery.credit import credit_examples  # the answers shown on the credit page
from machinery.models import TINY_TEMPLATE, autocast, no_grad_model, training
from machinery.metrics import Phases, UpdateLog, kl_metrics, step_metrics  # what a step logs
from machinery.runs import Run  # the run folder: logs, checkpoints, resume
from machinery.tasks import NUMBER, Batcher, last_boxed, normalize_number  # reading numbers

# Config -------------------------------------------------------------------------------------------

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
# normalize_number(s): the first number in s, as digits ('$1,234.00' -> '1234', '-3.50%' -> '-3.5')

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
    # both digit strings (NUMBER), which Decimal reads exactly: 18.00 = 18, 10**9 + 1 != 10**9
    return want is not None and got is not None and Decimal(got) == Decimal(want)

# Prompts: the student's, and the teacher's with a reference answer in it --------------------------

SYSTEM_PROMPT = ("Solve the math problem step by step. Give the final answer as a number in "
                 "\\boxed{}.")
# The guide text, our wording (App. E.1 does not publish the paper's). Our reading: a solve-none
# o_r, a wrong answer, goes in under the same words, so that s_i measures what the weights measure.
GUIDE = ("\n\nBelow is a solution to this problem that was checked and is correct. Use it to "
         "guide your reasoning, then write your own complete solution.\n\nChecked solution:\n")


def encode_prompt(tok, question, reference=None):
    """Token ids of the chat prompt. Student: system prompt + question. Teacher (Eq. 4, App. E.1):
    the same, with the guide and the reference added to the system message. One function."""
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
    """G graded answers to each of B questions: row n (of N) is answer n % G to question n // G."""
    problems: list                # B task dicts {'question', 'answer'}
    prompts: list                 # B student prompts, token-id lists
    ids: torch.Tensor             # (N, L) answer tokens, padding after the end
    mask: torch.Tensor            # (N, L) bool, True up to and including the first EOS
    texts: list                   # N decoded answers
    correct: torch.Tensor         # (B, G) the reward r: 1.0 where the verifier accepts the answer
    fast_states: tuple = None     # --fast only: the sampler's states, which the teacher reuses

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


def sample_answers(model, cfg, prompts, n, temperature, eos_ids, pad_id, gen):
    """n answers to each prompt: sample(), or speed.sample (--fast). -> ids, mask (N, L), states"""
    args = (no_grad_model(model), prompts, n, cfg.max_new_tokens, temperature, eos_ids, pad_id, gen)
    if cfg.fast:  # speed.sample in place of sample(): a KV cache, inverse-CDF draws, states kept
        return speed.sample(*args)
    return (*sample(*args), None)


def sample_groups(model, tok, cfg, problems, G, temperature, gen, eos_ids):
    """A group of G answers to each question, decoded and verified. -> Rollout"""
    prompts = [encode_prompt(tok, p["question"]) for p in problems]
    ids, mask, fast_states = sample_answers(model, cfg, prompts, G, temperature, eos_ids,
                                            tok.pad_token_id, gen)
    texts = decode(tok, ids, mask)
    correct = torch.tensor([verify(t, problems[n // G]["answer"]) for n, t in enumerate(texts)])
    return Rollout(problems=problems, prompts=prompts, ids=ids, mask=mask, texts=texts,
                   correct=correct.view(-1, G).float(), fast_states=fast_states)

# Group advantages, routes and references ----------------------------------------------------------

def group_advantages(rewards):
    """Group-relative advantages. rewards (B, G) -> (B, G); a group whose rewards are all
    equal gets exactly 0, not NaN. Our reading: the population std (divide by G)."""
    mean = rewards.mean(1, keepdim=True)                                           # (B, 1)
    std = rewards.std(1, keepdim=True, unbiased=False)                             # (B, 1)
    # Eq. (1): A_i = (r_i - mean(r)) / std(r)  -- one scalar per answer, shared by its tokens
    return torch.where(std > 0, (rewards - mean) / std.clamp_min(1e-12), torch.zeros_like(rewards))


def route_groups(rewards):
    """SC-GRPO's route of each group, by n_c (the header's table): rewards (B, G) -> B str, one
    per group. Fallback, not taught: the paper's ablation teaching n_c = 1 saw entropy collapse."""
    G = rewards.shape[1]
    return [{0: "solve_none", 1: "fallback", G: "skip"}.get(int((group > 0.5).sum()), "partial")
            for group in rewards]


def grpo_routes(rewards):
    """GRPO's routes (--algo grpo): 'skip' where all rewards are equal, else 'grpo' (weight 1)."""
    return ["skip" if bool((group == group[0]).all()) else "grpo" for group in rewards]


def pick_references(correct, route, rng):
    """Each answer's reference in one group: G indices j within the group, or None. partial: one
    verified answer, never itself; solve_none: one o_r for all, o_r's own None. Each uniform."""
    G = len(correct)
    if route == "partial":
        good = [j for j in range(G) if correct[j]]
        return [rng.choice([j for j in good if j != i]) for i in range(G)]
    if route == "solve_none":
        o_r = rng.choice(range(G))                                         # the index of o_r
        return [None if i == o_r else o_r for i in range(G)]
    return [None] * G


@dataclass
class Batch:
    """The M answers that get a gradient this step, in rollout order (skipped groups and each
    solve-none o_r left out). Every per-answer quantity is a row, so a micro-batch is a slice,
    batch[i:j]. make_batch sets kl 0, weights 1, adv Eq. (1); each seam returns a changed copy."""
    row: torch.Tensor         # (M,) long, the answer's row n in the rollout
    question: torch.Tensor    # (M,) long, its question b in the rollout: n // G
    ref_row: torch.Tensor     # (M,) long, the rollout row of its reference (tau or o_r); -1: none
    route: list               # M str, the route of its group
    adv: torch.Tensor         # (M,) A_i of Eq. (1), or alpha * A_div_i of Eq. (5) if solve-none
    active: torch.Tensor      # (M, L) bool, the tokens a teacher scores and f(D) weighs
    loss_scale: torch.Tensor  # (M,) each of its tokens' factor in J: 1 / (B G |o_i|)
    kl: torch.Tensor          # (M, L) D_it; 0 where not scored
    weights: torch.Tensor     # (M, L) f(D_it); 1 on each answer token for GRPO and 'fallback'
    teacher_prompt: list = None  # M token-id lists, None for no teacher: the context seam's

    @property
    def scored(self):         # (R,) the rows a teacher scores: those with a teacher prompt
        return torch.tensor([m for m, c in enumerate(self.teacher_prompt) if c is not None]).long()

    def __getitem__(self, k):  # a slice or index list k -> the Batch of those rows
        return take_rows(self, torch.arange(len(self.route))[k])


def make_batch(ro, group_routes, adv, refs):
    """One row per answer that gets a gradient: its advantage, reference, active tokens, unit
    weights, factor in J. group_routes: B str; adv (B, G); refs: each group's pick_references."""
    G, lengths = ro.G, ro.lengths                                                  # (B, G)
    row, ref_row, route, n_active = [], [], [], []
    for b, (group_route, group_refs) in enumerate(zip(group_routes, refs)):
        if group_route == "skip":
            continue
        for i, j in enumerate(group_refs):
            if group_route == "solve_none" and j is None:
                continue  # our reading: o_r, the reference itself, gets advantage 0, no gradient
            L_i = int(lengths[b, i])
            if group_route == "solve_none":  # our reading: only the first L_i = min(|o_i|, |o_r|)
                L_i = min(L_i, int(lengths[b, j]))  # tokens are active; those after weigh 0
            row.append(b * G + i)
            ref_row.append(-1 if j is None else b * G + j)
            route.append(group_route)
            n_active.append(L_i)
    row = torch.tensor(row, dtype=torch.long)                                       # (M,)
    mask = ro.mask[row]                                                             # (M, L)
    active = (torch.arange(mask.shape[1]) < torch.tensor(n_active)[:, None]).to(mask.device)
    # J (§5.1) = 1/B sum_b 1/G sum_i 1/|o_i| sum_t ...: 1 / (B G |o_i|) on each token of o_i, with
    # the whole |o_i| also where only L_i weigh; our reading: a skipped group still counts in B
    loss_scale = (1.0 / (len(group_routes) * G * lengths.view(-1)[row].double())).float()  # (M,)
    return Batch(row=row, question=row // G, ref_row=torch.tensor(ref_row, dtype=torch.long),
                 route=route, adv=adv.reshape(-1)[row], active=active, loss_scale=loss_scale,
                 kl=torch.zeros(mask.shape, device=mask.device), weights=mask.float(),
                 teacher_prompt=[None] * len(route))

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
    # our reading: every log-prob and KL is of softmax(z / T), the distribution that sampled
    lp = F.log_softmax(logits / cfg.temperature, -1).gather(-1, ids[..., None])   # (b, L, 1)
    return lp.squeeze(-1).masked_fill(~mask, 0.0), mask

# The self-conditioned teacher: its prompts, D per token, f(D) with c, Eq. (5) ---------------------

def teacher_prompts(tok, ro, batch):
    """The context seam, SC-GRPO's: each row's teacher prompt (Eq. 4, its reference as tau), or None
    for no reference. One prompt object per reference (--fast prefills it once). -> M entries"""
    prompts = {j: encode_prompt(tok, ro.problems[j // ro.G]["question"], ro.texts[j])
               for j in batch.ref_row.unique().tolist() if j >= 0}
    return [prompts.get(j) for j in batch.ref_row.tolist()]


@torch.no_grad()
def teacher_kl(model, cfg, ro, rows, prompts, prompt_of, ids, active):
    """D_it = KL(teacher || student) at the n active tokens of answers `rows` (b,), the teacher (the
    same model, Eq. 4) after prompts[prompt_of] (b,); ids, active (b, L). -> D, and log p_teacher
    and log p_student of each sampled token (a fork's credit may want them), each (n,)"""
    model = no_grad_model(model)  # --dtype bf16: the bf16 weights (no gradient flows here)
    if cfg.fast:  # speed.teacher_kl in place of the six statements below
        return speed.teacher_kl(model, ro, rows, prompts, prompt_of, ids, active, cfg.temperature)
    student = forward_answers(model, [ro.prompts[b] for b in (rows // ro.G).tolist()], ids, active)
    teacher = forward_answers(model, [prompts[k] for k in prompt_of.tolist()], ids, active)
    log_s, log_t = (F.log_softmax(z / cfg.temperature, -1) for z in (student, teacher))  # (b, L, V)
    # D_t (§5.1) = KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)); kl_div(in, tgt)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)       # (b, L)
    logp_t, logp_s = (lp.gather(-1, ids[..., None]).squeeze(-1) for lp in (log_t, log_s))
    return kl[active], logp_t[active], logp_s[active]


@torch.no_grad()
def teacher_pass(model, cfg, ro, batch):
    """The teacher scores the active tokens of every row with a teacher prompt, in micro-batches.
    -> D, log p_teacher(o_t), log p_student(o_t), each (M, L), 0 elsewhere"""
    out = torch.zeros((3, *batch.kl.shape), device=batch.kl.device)               # (3, M, L)
    # by question and reference only so that --fast prefills each shared prompt once
    order = sorted(batch.scored.tolist(), key=lambda m: (int(batch.question[m]),
                                                         int(batch.ref_row[m])))
    for k in range(0, len(order), cfg.micro_batch):
        chunk = torch.tensor(order[k:k + cfg.micro_batch])                         # Batch rows
        ids, active = pack(ro, batch.row[chunk], batch.active[chunk])              # (b, L')
        own = [batch.teacher_prompt[m] for m in chunk.tolist()]  # a prompt object rows share:
        prompts, prompt_of = distinct(own, ids.device, key=id)    # --fast prefills it once
        got = torch.stack(teacher_kl(model, cfg, ro, batch.row[chunk], prompts, prompt_of, ids,
                                     active))                                      # (3, n)
        back = out.new_zeros(3, *active.shape).masked_scatter(active, got)         # (3, b, L')
        out[:, chunk, :active.shape[1]] = back  # pack cut the rows to their longest: L' <= L
    return out.unbind()


def sc_weights(kl, active, c_min=1e-4, q=0.75):
    """f(D) = D / (D + c), c = max(quantile_q(D over active tokens), c_min). kl, active (...) ->
    weights (...) in [0, 1), 0 off the active tokens, and c. Our readings: c over every active token
    of the step (no micro-batch changes it); a non-finite D weighs 0 and stays out of c."""
    kl = kl.clamp_min(0.0)  # D >= 0, but rounding can put a teacher ~ student token a hair below
    active = active & torch.isfinite(kl)
    d = kl[active]
    c = max(float(torch.quantile(d.float(), q)) if d.numel() else 0.0, c_min)
    # f(D) (§5.1) = D / (D + c): more than half the gradient where D > c (the P75, or c_min)
    return torch.where(active, kl / (kl + c), torch.zeros_like(kl)).detach(), c


def weigh_tokens(cfg, batch, kl):
    """f(D) on the active tokens of every answer the teacher scored, D = kl (M, L); other rows
    keep their weights. -> (batch with kl and weights; the teacher's metrics)"""
    scored = batch.scored                                                          # (R,)
    if not len(scored):
        return batch, {}
    active = batch.active[scored]                                                  # (R, L)
    w, c = sc_weights(kl[scored], active, cfg.c_min, cfg.kl_quantile)              # (R, L)
    weights = batch.weights.index_put((scored,), w)  # a copy, f(D) in the scored rows (M, L)
    return replace(batch, kl=kl, weights=weights), kl_metrics(kl[scored], active, w, c)


def window_means(batch):
    """s_i (§5.1) = 1/L_i sum_{t <= L_i} f(D_it): each answer's mean weight over its window."""
    return batch.weights.sum(1).cpu() / batch.active.sum(1).cpu()                 # (M,)


def diversity_advantages(s, alpha=0.1, eps=1e-6):
    """Eq. (5) for one solve-none group: s (G-1,) the scores s_i of its answers other than o_r
    (our reading: o_r has no score, so the mean and std leave it out). -> alpha * A_div (G-1,)"""
    # Eq. (5): A_div_i = (s_i - mean) / (std + eps): a high mean f(D) against o_r is pushed up, as
    # the paper writes it; it reads that as "unlike o_r" (docs/eq5.md measures whether it is)
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


def sc_credit(model, cfg, ro, batch):
    """The credit seam, SC-GRPO's: the teacher's D -> f(D) -> Eq. (5). A batch with no teacher
    prompt (GRPO) comes back as it was. -> (batch with kl, weights and adv; metrics)"""
    kl, _, _ = teacher_pass(model, cfg, ro, batch)  # the two log-probs are there for forks
    batch, metrics = weigh_tokens(cfg, batch, kl)                                  # f(D)
    # Eq. (5) reads the weights: a weight multiplied in before this line changes s_i, after it not
    batch = replace(batch, adv=solve_none_advantages(batch, window_means(batch), cfg.alpha_div))
    return batch, metrics

# The loss: the clipped GRPO objective, each token weighted by f(D) --------------------------------

def policy_loss(logp, old_logp, adv, weights, loss_scale, mask, eps_low, eps_high):
    """-J_SC and the number of tokens whose ratio is outside the clip range. logp, old_logp,
    weights, mask (b, L), weights 0 off the answer; adv, loss_scale (b,). With weights 1: GRPO."""
    # padding: rho = 1 there, so a NaN cannot leak into the gradient, and weight 0, so no loss
    logp, old_logp = logp.masked_fill(~mask, 0.0), old_logp.masked_fill(~mask, 0.0)
    ratio = torch.exp(logp - old_logp)                                             # rho (b, L)
    a = adv[:, None]                                                               # (b, 1)
    term = torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)       # (b, L)
    # J_SC (§5.1) = sum_i sum_t f(D_it) min(rho A_i, clip(rho) A_i) / (B G |o_i|)
    per_token = weights * term * loss_scale[:, None]                               # (b, L)
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & mask
    return -per_token.sum(), int(clipped.sum())


def micro_batch_loss(model, cfg, ro, mb, old_logp=None):
    """The loss seam, SC-GRPO's: the micro-batch mb's (a Batch of b rows) share of -J_SC, and its
    clipped-token count. old_logp (b, L): the log-probs before the step's first update, or None.
    pack cut the answers to the micro-batch's longest (L'); the weights are the rollout's L wide."""
    logp, mask = answer_logprobs(model, cfg, ro, mb)                               # (b, L)
    old_logp = logp.detach() if old_logp is None else old_logp  # mu = 1: rho = 1, the clip idle
    return policy_loss(logp, old_logp, mb.adv.to(logp.device), mb.weights[:, :mask.shape[1]],
                       mb.loss_scale.to(logp.device), mask, cfg.epsilon, cfg.epsilon)

# One training step: sample -> reward -> advantages -> teacher and weights -> clipped update -------

def update(model, optimizer, cfg, ro, batch, loss_of=micro_batch_loss):
    """ppo_epochs AdamW steps on the loss, its gradient accumulated over micro-batches. -> (the
    epoch's loss, clip_frac, grad_norm, grad_norm_none, update_size (a dict, UpdateLog); stepped)"""
    # the rows in the order they run, and slices of <= micro_batch rows: the n_none solve-none
    # answers first, in slices of their own, so that grad_norm_none measures Eq. (5)'s part
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
                log.micro_batch(loss, n_clipped, last_solve_none=sl.stop == n_none)  # log.loss +=
            log.grad_norm = float(clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
            # a non-finite step (log.loss: the epoch's summed loss) is skipped, never applied
            if not (math.isfinite(log.loss) and math.isfinite(log.grad_norm)):
                break
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stepped = True
    optimizer.zero_grad(set_to_none=True)
    return log.metrics(tokens=int(ro.lengths.view(-1)[batch.row].sum())), stepped


def train_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no,
               route=route_groups, context=teacher_prompts, credit=sc_credit,
               loss_of=micro_batch_loss):
    """Training step step_no: sample and verify -> Eq. (1), routes, references -> teacher prompts
    (context) -> weights, advantages (credit) -> clipped update (loss_of). -> (metrics, examples)"""
    clock = Phases(next(model.parameters()).device)  # seconds and CUDA memory per phase
    ro = sample_groups(model, tok, cfg, batcher.take(cfg.prompts_per_step), cfg.group_size,
                       cfg.temperature, gen, eos_ids)
    clock.lap("sample")
    adv = group_advantages(ro.correct)                                             # (B, G)
    group_routes = route(ro.correct)                                               # B routes
    refs = [pick_references(ok, r, rng) for ok, r in zip(ro.correct.bool().tolist(), group_routes)]
    batch = make_batch(ro, group_routes, adv, refs)                                # M rows
    batch = replace(batch, teacher_prompt=context(tok, ro, batch))  # the teachers', Eq. (4)
    # our reading: D is measured once a step, by the weights that sampled, not per PPO epoch
    batch, credit_metrics = credit(model, cfg, ro, batch)      # f(D) and Eq. (5)
    clock.lap("teacher")
    upd, stepped = update(model, optimizer, cfg, ro, batch, loss_of)
    clock.lap("update")
    return (step_metrics(ro, group_routes, batch, clock, upd, credit_metrics, stepped),
            credit_examples(tok, ro, batch, credit))

# Evaluation: greedy accuracy, Avg@k and Pass@k ----------------------------------------------------

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
    """Greedy accuracy on `problems`, and Avg@k / Pass@k (k = cfg.eval_k) at the training T, from
    its own generator. -> (metrics, per question: greedy text, correct, length, answer, k hits)"""
    device, k = next(model.parameters()).device, cfg.eval_k
    gen = torch.Generator(device).manual_seed(cfg.seed + 7919)  # its own stream: any fixed offset
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
    """Train, evaluate and save. resume: a checkpoint folder or ""; step: train_step, its seams."""
    # One seed for everything. With one CPU thread (OMP_NUM_THREADS=1) a run repeats bit for bit;
    # with more, or on a GPU, reductions may split differently, and runs drift apart slowly.
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the tiny model's initial weights come from this stream
    run = Run(cfg, resume)  # loads the data and the model (fp32 weights; resume: the checkpoint's)
    model, tok = run.model, run.tok
    # AdamW on every weight; our reading of what the paper leaves unsaid: a constant learning
    # rate, PyTorch's betas (0.9, 0.999), no reference-model KL, the gradient norm clipped at 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)                            # which answer is whose reference
    gen = torch.Generator(run.device).manual_seed(cfg.seed)  # the sampler's draws
    batcher = Batcher(run.train_set, cfg.seed)               # questions: a seeded order per epoch
    start = run.begin(optimizer, rng, gen, batcher)  # 1, or after resume the next step (restored)
    if start == 1:
        run.log_eval(0, *evaluate(model, tok, run.eval_set, cfg, run.eos_ids))
    bar = tqdm(range(start, cfg.steps + 1), "train", cfg.steps, initial=start - 1, disable=None)
    for step_no in bar:
        m, examples = step(model, optimizer, tok, cfg, batcher, rng, gen, run.eos_ids, step_no)
        run.log_step(bar, {"step": step_no, **m}, examples)  # may stop: --max-bad-steps NaN steps
        if step_no % cfg.eval_every == 0 or step_no == cfg.steps:
            run.log_eval(step_no, *evaluate(model, tok, run.eval_set, cfg, run.eos_ids))
        run.checkpoint(bar, step_no)  # every --save-every steps, at the end, and after a Ctrl-C
    run.finish(bar)


def main(argv=None, Config=Config, step=train_step, **seams):
    """The command line. A fork passes its Config (its flags) and its seams (context=, credit=,
    loss_of=, route=) for train_step, or its own step."""
    cfg, resume = parse_config(Config, PRESETS, argv)
    if cfg.eval_only:
        torch.manual_seed(cfg.seed)  # the tiny model's initial weights; no optimizer, no training
        return Run(cfg).save_eval(evaluate)  # evaluate() on the model and test set -> eval.json
    if cfg.algo == "grpo":  # --algo grpo: GRPO's routes draw no reference, so every weight is 1
        seams = {"route": grpo_routes, **seams}
    train(cfg, resume, partial(step, **seams))


if __name__ == "__main__":
    main()
