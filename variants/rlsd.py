"""
An RLSD-style token weight in place of SC-GRPO's f(D), as a fork of scgrpo.py. RLSD's public code
(rlsd_trainer.py of github.com/siyan-zhao/OPSD, read at commit 87d7566) keeps GRPO's sequence
advantage A for the sign of the update and reweights each token by how much a teacher with
privileged context prefers the sampled token:
    Delta_t = sg(log p_teacher(o_t) - log p_student(o_t))          one sampled token's log-ratio
    w_t = clip(exp(sign(A) Delta_t), 1 - eps_w, 1 + eps_w)           in [0.8, 1.2] at eps_w 0.2
    A_t = A ((1 - lambda) + lambda w_t),  lambda = 0.5 (1 - min(optimizer steps / 50, 1))
Against SC-GRPO: the teacher holds the gold solution (SC-GRPO: one of the group's own verified
answers); the signal is one token's log-ratio (SC-GRPO: the KL over the whole vocabulary); the
weight follows the sign of A and stays near 1 (SC-GRPO's f(D) is sign-blind, in [0, 1)); the
blend decays over training, counted in optimizer steps as RLSD's code counts them. --teacher self
keeps SC-GRPO's teacher and routing (a verified answer of the group in partial groups, fallback
groups weight 1) and changes only the weight, so the two settings separate "which teacher" from
"which weight". Either way solve-none groups follow GRPO (no gradient): there is no Eq. (5).
The gold solution is cut before its final '#### N' line (variants/opsd.py's gold_context), and the
loss is scgrpo.py's J (each answer's tokens averaged, then the answers), where RLSD's code
averages the pooled tokens of a batch. Seams: the route, the teacher's context (--teacher gold) and
the credit; the teacher pass is scgrpo.py's, whose log-probs of the sampled tokens give Delta.
    python variants/rlsd.py --model SmolLM2-135M --task addition --teacher self
"""
import os
import sys
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402
from variants.distill import optimizer_steps, skip_solve_none  # noqa: E402
from variants.opsd import gold_prompts  # noqa: E402


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


def blend(cfg, steps):
    """lambda after `steps` optimizer steps: rlsd_lambda, falling linearly to 0 at the decay."""
    decay = cfg.rlsd_lambda_decay_steps
    return cfg.rlsd_lambda * (1 - min(steps / decay, 1.0)) if decay else cfg.rlsd_lambda


def rlsd_weights(delta, adv, mask, eps_w, lam):
    """RLSD's blended weight of each token: (1 - lam) + lam clip(exp(sign(A) Delta), 1 -+ eps_w),
    0 off the answer. delta, mask (b, L); adv (b,) -> (b, L), no gradient."""
    w = torch.exp(adv.sign()[:, None] * delta).clamp(1 - eps_w, 1 + eps_w)         # (b, L)
    return ((1 - lam) + lam * w) * mask


def rlsd_credit(cfg, lam):
    """The credit seam: RLSD's weight at blend lam on every answer a teacher scores."""
    def credit(model, cfg, ro, batch):
        _, logp_t, logp_s = S.teacher_pass(model, cfg, ro, batch)                 # (M, L) each
        rows = batch.scored                                                        # (R,)
        w = rlsd_weights((logp_t - logp_s)[rows], batch.adv[rows].to(logp_t.device),
                         batch.active[rows], cfg.rlsd_eps_w, lam)                 # (R, L)
        weights = batch.weights.index_put((rows,), w.to(batch.weights.device))
        metrics = dict(rlsd_lambda=lam)
        if len(rows):  # the mean weight over the taught answers' tokens
            metrics["rlsd_weight_mean"] = float(weights[rows][batch.active[rows]].mean())
        return replace(batch, weights=weights), metrics
    # the credit page: below 1 blue, above orange
    spread = lam * cfg.rlsd_eps_w
    credit.signal = dict(name="RLSD's weight", lo=1 - spread, hi=1 + spread, center=1.0)
    return credit


def rlsd_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no):
    """scgrpo.train_step with RLSD's weight in place of f(D), its lambda from the optimizer."""
    gold = cfg.teacher == "gold"  # gold: GRPO's routes, every group of unequal rewards taught
    return S.train_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no,
                        route=S.grpo_routes if gold else skip_solve_none,
                        context=gold_prompts if gold else S.teacher_prompts,
                        credit=rlsd_credit(cfg, blend(cfg, optimizer_steps(optimizer))))


def main(argv=None):
    """scgrpo.py's command line with this file's settings and seams (the tests call it too)."""
    S.main(argv, Config=Config, step=rlsd_step)


if __name__ == "__main__":
    main()
