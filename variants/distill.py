"""
RQ1 of the paper (§7.1, Table 2) as a fork of scgrpo.py: the self-conditioned teacher's KL added as
a loss, L = L_GRPO + beta * L_distill, where SC-GRPO uses it as a weight. The paper finds all five
of its settings below SC-GRPO, and App. A says why: with several verified references, a loss pulls
the student toward their mixture, a target that no single verified answer follows.
  - Routes and references are SC-GRPO's: each answer of a partial group gets a verified answer of
    its group as tau, in the teacher's prompt of Eq. (4). A solve-none group has no verified answer
    to distil from, and GRPO gives it no gradient: it is skipped (Eq. 5 is a weight's, not here).
  - L_GRPO is scgrpo.py's clipped objective with every weight 1.
  - L_distill = sum_i 1/(B G |o_i|) sum_t Div(teacher_t, student_t) over the answers with a teacher:
    each answer's tokens averaged, then the answers (as J is, Eq. 2), the teacher under
    stop-gradient (Eq. 4), the gradient through the student. --divergence forward:
    KL(teacher || student), the D of §5.1; reverse: KL(student || teacher); bidirectional:
    mix * forward + (1 - mix) * reverse.
  - beta: fixed (--beta 0.1), or warmed up linearly from --beta-start 0.03 at the first
    training step to --beta at the last (the paper's 0.03 -> 0.1), counted in training steps.
Seams: the route (solve-none groups skipped), the credit (every weight 1) and the loss; the
teacher's context is SC-GRPO's. L_distill needs the student's whole distribution with its
gradient, so the update's forward is the plain one (forward_answers), whatever --fast says;
sampling and evaluation keep the fast path.
    python variants/distill.py --model SmolLM2-135M --task addition --divergence reverse
"""
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402


@dataclass
class Config(S.Config):
    """The settings of RQ1's run, SC-GRPO's teacher as a loss: scgrpo.py's and four below."""
    algo: str = S.setting("distill", "GRPO plus beta times a distillation loss toward SC-GRPO's "
                          "teacher", ("distill",))
    divergence: str = S.setting("forward", "L_distill per token: forward KL(teacher || student), "
                                "reverse, or bidirectional",
                                ("forward", "reverse", "bidirectional"))
    beta: float = S.setting(0.1, "weight of L_distill (with --beta-start, its value at the last "
                            "step); paper: 0.1", rule=(lambda v, cfg: v >= 0, ">= 0"))
    beta_start: float = S.setting(-1.0, "warm-up: beta rises linearly from this at the first step "
                                  "to --beta at the last; paper: 0.03; -1: beta fixed",
                                  rule=(lambda v, cfg: v == -1 or v >= 0, "-1, or >= 0"))
    mix: float = S.setting(0.5, "bidirectional: the forward KL's share; the reverse gets 1 - mix",
                           rule=(lambda v, cfg: 0 <= v <= 1, "in [0, 1]"))


def skip_solve_none(rewards):
    """The route seam: SC-GRPO's routes, a solve-none group skipped (no verified answer in it)."""
    return ["skip" if r == "solve_none" else r for r in S.route_groups(rewards)]


def unit_credit(model, cfg, ro, batch):
    """The credit seam of a method whose teacher acts in the loss: every weight 1, Eq. (1)."""
    return batch, {}


def divergence(log_t, log_s, kind, mix=0.5):
    """Per-token divergence of teacher t and student s from their log-probabilities (..., V) ->
    (...): forward KL(t || s) = sum_v p_t (log p_t - log p_s); reverse KL(s || t); bidirectional
    mix KL(t || s) + (1 - mix) KL(s || t); jsd: (KL(t || m) + KL(s || m)) / 2, m = (p_t + p_s)/2."""
    def kl(log_p, log_q):  # KL(p || q); kl_div(input, target) = sum target (log target - input)
        return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    if kind == "forward":
        return kl(log_t, log_s)
    if kind == "reverse":
        return kl(log_s, log_t)
    if kind == "bidirectional":
        return mix * kl(log_t, log_s) + (1 - mix) * kl(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_t, log_s]), 0) - math.log(2)         # jsd
    return 0.5 * kl(log_t, log_m) + 0.5 * kl(log_s, log_m)


@torch.no_grad()
def teacher_logprobs(model, cfg, prompts, ids, mask):
    """log softmax(z / T) of the teacher at each answer token (b, L, V): the same model after its
    own prompt (b prompts), under stop-gradient (Eq. 4)."""
    return F.log_softmax(S.forward_answers(S.no_grad_model(model), prompts, ids, mask)
                         / cfg.temperature, -1)


def student_logprobs(model, cfg, ro, mb):
    """The plain forward of scgrpo.answer_logprobs, its whole distribution kept: log softmax(z / T)
    (b, L, V) with gradient, the log-probs of the answer's own tokens (b, L), 0 outside, mask."""
    ids, mask = S.pack(ro, mb.row)                                                 # (b, L)
    logits = S.forward_answers(model, [ro.prompts[b] for b in mb.question.tolist()], ids, mask)
    log_s = F.log_softmax(logits / cfg.temperature, -1)                           # (b, L, V)
    return log_s, log_s.gather(-1, ids[..., None]).squeeze(-1).masked_fill(~mask, 0.0), ids, mask


def distill_loss(beta, seen):
    """The loss seam: L_GRPO (weights 1) + beta L_distill of a micro-batch, the teacher's prompt of
    each answer in mb.teacher_prompt; seen: L_distill's parts, for the log."""
    def loss_of(model, cfg, ro, mb, old_logp=None):
        log_s, logp, ids, mask = student_logprobs(model, cfg, ro, mb)
        old_logp = logp.detach() if old_logp is None else old_logp  # mu = 1: rho = 1
        scale = mb.loss_scale.to(logp.device)                                      # (b,)
        loss, n_clipped = S.policy_loss(logp, old_logp, mb.adv.to(logp.device),
                                        mb.weights[:, :mask.shape[1]], scale, mask, cfg.epsilon,
                                        cfg.epsilon)
        taught = mb.scored.to(logp.device)                                         # (r,)
        if len(taught):
            log_t = teacher_logprobs(model, cfg, [mb.teacher_prompt[k] for k in taught.tolist()],
                                     ids[taught], mask[taught])                   # (r, L, V)
            div = divergence(log_t, log_s[taught], cfg.divergence, cfg.mix) * mask[taught]
            l_distill = (div.sum(1) * scale[taught]).sum()  # normalised as J: 1/(B G |o_i|)
            loss, seen[0] = loss + beta * l_distill, seen[0] + float(l_distill)
        return loss, n_clipped
    return loss_of


def optimizer_steps(optimizer):
    """Optimizer steps taken so far: AdamW keeps the count with its state (restored on resume)."""
    state = next(iter(optimizer.state.values()), None)
    return int(state["step"]) if state else 0


def beta_at(cfg, step_no):
    """beta at training step step_no (1..steps): --beta, or warmed up linearly from --beta-start at
    the first step to --beta at the last, counted in training steps (not optimizer steps)."""
    start = cfg.beta if cfg.beta_start < 0 else cfg.beta_start  # the warm-up, or a fixed beta
    return start + (cfg.beta - start) * min((step_no - 1) / max(1, cfg.steps - 1), 1.0)


def distill_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no):
    """scgrpo.train_step with the teacher's KL moved from the weights into the loss."""
    beta = beta_at(cfg, step_no)
    seen = [0.0]  # L_distill, summed over the update's micro-batches
    metrics, _ = S.train_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no,
                              route=skip_solve_none, credit=unit_credit,
                              loss_of=distill_loss(beta, seen))
    metrics.update(beta=beta, distill_loss=seen[0] / cfg.ppo_epochs)
    return metrics, []  # no token weight to show on the credit page


def main(argv=None):
    """scgrpo.py's command line with this file's settings and seams (the tests call it too)."""
    S.main(argv, Config=Config, step=distill_step)


if __name__ == "__main__":
    main()
