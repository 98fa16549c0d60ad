"""
An RLSD-style token weight in place of SC-GRPO's f(D), as a fork of scgrpo.py. RLSD's public code
(rlsd_trainer.py of github.com/siyan-zhao/OPSD, read at commit 87d7566) keeps GRPO's sequence
advantage A for the sign of the update and reweights each token by how much a teacher with
privileged context prefers the sampled token:
    Delta_t = sg(log p_teacher(o_t) - log p_student(o_t))          one sampled token's log-ratio
    w_t = clip(exp(sign(A) Delta_t), 1 - eps_w, 1 + eps_w)           in [0.8, 1.2] at eps_w 0.2
    A_t = A ((1 - lambda) + lambda w_t),  lambda = 0.5 (1 - min(steps taken / 50, 1))
Against SC-GRPO: the teacher holds the gold solution (SC-GRPO: one of the group's own verified
answers); the signal is one token's log-ratio (SC-GRPO: the KL over the whole vocabulary); the
weight follows the sign of A and stays near 1 (SC-GRPO's f(D) is sign-blind, in [0, 1)); the
blend decays over training. --teacher self keeps SC-GRPO's teacher and routing (a verified answer
of the group in partial groups, fallback groups weight 1) and changes only the weight, so the
two settings separate "which teacher" from "which weight". Either way solve-none groups follow
GRPO (no gradient): there is no Eq. (5). The teacher's and the student's log-probs come from the
plain forward (forward_answers) whatever --fast says; sampling and the update keep the fast path.
    python variants/rlsd.py --model SmolLM2-135M --task addition --teacher self
"""
import os
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402
from machinery.credit import credit_examples  # noqa: E402
from machinery.metrics import Phases, step_metrics  # noqa: E402
from variants.distill import optimizer_steps  # noqa: E402
from variants.opsd import gold_context  # noqa: E402


@dataclass
class Config(S.Config):
    """The settings of a run with RLSD's weight: scgrpo.py's and four below (RLSD's defaults)."""
    algo: str = S.setting("rlsd", "GRPO with RLSD's per-token weight", ("rlsd",))
    teacher: str = S.setting("gold", "the teacher's context: gold, the gold solution (RLSD's); "
                             "self, a verified answer of the group, routed as SC-GRPO",
                             ("gold", "self"))
    rlsd_eps_w: float = S.setting(0.2, "w_t is clipped to [1 - eps_w, 1 + eps_w]; RLSD: 0.2",
                                  rule=(lambda v, cfg: 0 <= v < 1, "in [0, 1)"))
    rlsd_lambda: float = S.setting(0.5, "the blend at the first step, A_t = A ((1 - lambda) + "
                                   "lambda w_t); RLSD: 0.5", rule=(lambda v, cfg: 0 <= v <= 1,
                                                                   "in [0, 1]"))
    rlsd_lambda_decay_steps: int = S.setting(
        50, "lambda falls linearly to 0 over this many optimizer steps, 0: never; RLSD: 50 (a "
        "12-step run ends with lambda at or above 0.38)", rule=(lambda v, cfg: v >= 0, ">= 0"))


def rlsd_weights(delta, adv, mask, eps_w, lam):
    """RLSD's blended weight of each token: (1 - lam) + lam clip(exp(sign(A) Delta), 1 -+ eps_w),
    0 off the answer. delta, mask (b, L); adv (b,) -> (b, L), no gradient."""
    w = torch.exp(adv.sign()[:, None] * delta).clamp(1 - eps_w, 1 + eps_w)         # (b, L)
    return ((1 - lam) + lam * w) * mask


@torch.no_grad()
def token_logprobs(model, cfg, prompts, ids, mask):
    """log softmax(z / T) of each answer's own tokens after the given prompts (b,): plain lines,
    under stop-gradient. -> (b, L)"""
    logits = S.forward_answers(S.no_grad_model(model), prompts, ids, mask)         # (b, L, V)
    return F.log_softmax(logits / cfg.temperature, -1).gather(-1, ids[..., None]).squeeze(-1)


def rlsd_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids):
    """scgrpo.train_step with RLSD's weight in Batch.weights in place of f(D)."""
    clock = Phases(next(model.parameters()).device)
    ro = S.sample_groups(model, tok, cfg, batcher.take(cfg.prompts_per_step), cfg.group_size,
                         cfg.temperature, gen, eos_ids)
    clock.lap("sample")
    if cfg.teacher == "gold":  # GRPO's routes: every group of unequal rewards has a teacher
        routes, refs = S.route_groups(ro.correct, "grpo"), [[None] * ro.G] * len(ro.problems)
    else:  # SC-GRPO's routes and references; a solve-none group follows GRPO: no gradient
        routes = ["skip" if r == "solve_none" else r for r in S.route_groups(ro.correct, "scgrpo")]
        refs = [S.pick_references(c, r, rng) for c, r in zip(ro.correct.bool().tolist(), routes)]
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), refs)
    if cfg.teacher == "gold":
        tiny = tok.chat_template == S.TINY_TEMPLATE
        gold = [S.encode_prompt(tok, p["question"], gold_context(p, tiny)) for p in ro.problems]
        taught, teacher_of = torch.arange(len(batch.route)), [gold[b] for b in batch.question]
        context = [gold_context(ro.problems[b], tiny) for b in batch.question.tolist()]
    else:
        prompts, taught = S.teacher_prompts(tok, ro, batch), batch.scored
        teacher_of = [prompts[int(j)] if j >= 0 else None for j in batch.ref]
        context = [ro.texts[int(j)] if j >= 0 else "" for j in batch.ref]
    steps = optimizer_steps(optimizer)  # before this step's: RLSD's global step
    decay = cfg.rlsd_lambda_decay_steps
    lam = cfg.rlsd_lambda * (1 - min(steps / decay, 1.0)) if decay else cfg.rlsd_lambda
    weights = batch.weights.clone()                                                # (M, L)
    for rows in taught.split(cfg.micro_batch) if len(taught) else []:
        ids, mask = S.pack(ro, batch.row[rows])                                    # (b, L)
        student = token_logprobs(model, cfg, [ro.prompts[b] for b in batch.question[rows]], ids,
                                 mask)                                             # (b, L)
        teacher = token_logprobs(model, cfg, [teacher_of[m] for m in rows.tolist()], ids, mask)
        w = rlsd_weights(teacher - student, batch.adv[rows].to(ids.device), mask, cfg.rlsd_eps_w,
                         lam)
        weights[rows, :mask.shape[1]] = w.to(weights.device)
    batch = replace(batch, weights=weights)
    clock.lap("teacher")
    upd, stepped = S.update(model, optimizer, cfg, ro, batch)
    clock.lap("update")
    metrics = step_metrics(ro, routes, batch, clock, **upd, eq5_only=False,
                           nonfinite=bool(batch.route) and not stepped)
    active = weights[taught][ro.mask[batch.row[taught]]]  # the taught answers' tokens
    metrics["rlsd_lambda"] = lam
    if active.numel():
        metrics["rlsd_weight_mean"] = float(active.mean())
    signal = dict(name="RLSD's weight", lo=1 - lam * cfg.rlsd_eps_w, hi=1 + lam * cfg.rlsd_eps_w,
                  center=1.0)  # the credit page: below 1 blue, above orange
    return metrics, credit_examples(tok, ro, batch, taught.tolist(), signal, context)


if __name__ == "__main__":
    S.main(Config=Config, step=rlsd_step)
