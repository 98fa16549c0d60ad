"""
On-policy self-distillation with the gold solution (§6.2, the paper's "Oracle" demonstration) as a
fork of scgrpo.py: no reward in the loss. The teacher is Eq. (3)'s, the same model under
stop-gradient given privileged context c, here the question's gold solution (gold_context) in the
place where scgrpo.py's teacher holds a verified answer of the group. The loss is Eq. (2): a
divergence from the teacher to the student at each token of each sampled answer, averaged over the
answer's tokens, then over the step's answers, right or wrong (the verifier only reports).
Where this departs from OPSD's public code (opsd_trainer.py of github.com/siyan-zhao/OPSD, read
at commit 590ec26), or could surprise:
  - the average: per answer, then over answers, as Eq. (2) writes it; OPSD's code averages over
    the pooled tokens of a micro-batch (longer answers weigh more there);
  - the gold solution is cut before its final '#### N' line (gold_context): GSM8K's reasoning,
    addition's 'a + b = c'; the tiny model, which reads digits only, gets the number;
  - --opsd-teacher initial (the default, as OPSD's README recommends and its run script does):
    the teacher is the policy before training, a frozen copy loaded again from --model (so a
    resumed run gets the same one); current: the policy being trained, under stop-gradient
    (the one exploratory run of docs/variants.md used it);
  - --divergence jsd: the Jensen-Shannon divergence, KL(t || m) / 2 + KL(s || m) / 2 with m the
    mean of the two distributions, as OPSD's generalized_jsd_loss at beta 0.5 computes it by
    default; forward: KL(teacher || student), the D of §5.1.
Seams: the route (every group trains), the teacher's context (the gold solution, one per question),
the credit (weights 1, unused) and the loss. The loss needs the student's whole distribution with
its gradient, so the update's forward is the plain one (forward_answers), whatever --fast says;
sampling and evaluation keep the fast path.
    python variants/opsd.py --model SmolLM2-135M --task addition
"""
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402
from machinery.models import load_model, set_precision  # noqa: E402  (the initial policy)
from variants.distill import (divergence, student_logprobs, teacher_logprobs,  # noqa: E402
                              unit_credit)


@dataclass
class Config(S.Config):
    """The settings of an OPSD run with the gold solution: scgrpo.py's and two below."""
    algo: str = S.setting("opsd", "on-policy self-distillation, the gold solution as the teacher's "
                          "context", ("opsd",))
    divergence: str = S.setting("jsd", "Eq. (2)'s divergence: jsd (OPSD's) or forward KL(teacher "
                                "|| student)", ("jsd", "forward"))
    opsd_teacher: str = S.setting("initial", "the teacher's weights: initial, the policy before "
                                  "training (OPSD's recommendation), or current", ("initial",
                                                                                   "current"))


def every_group(rewards):
    """The route seam: every group trains, whatever its rewards (no advantage in the loss)."""
    return ["grpo"] * len(rewards)


def gold_context(problem, tiny):
    """The privileged context c: the gold solution without its final '#### N' line (GSM8K's
    reasoning, addition's 'a + b = c'); the tiny model reads only digits and '+=;', so for it the
    answer's number (arith has no other solution)."""
    solution, _, number = problem["answer"].rpartition("####")
    return number.strip() if tiny or not solution.strip() else solution.strip()


def gold_prompts(tok, ro, batch):
    """The context seam, a gold teacher's (Eq. 3): each row's question with its gold solution in
    the teacher's prompt, one prompt per question, shared by its answers."""
    tiny = tok.chat_template == S.TINY_TEMPLATE
    gold = [S.encode_prompt(tok, p["question"], gold_context(p, tiny)) for p in ro.problems]
    return [gold[b] for b in batch.question.tolist()]


INITIAL = {}  # (model, seed) -> the policy before training, loaded once a process


def initial_policy(cfg, model):
    """The policy before training: --model loaded again (the tiny model from --seed, as the run's
    was), on the model's device and in its precision, and never trained."""
    if (cfg.model, cfg.seed) not in INITIAL:
        with torch.random.fork_rng(devices=[]):  # the run's random streams do not move
            frozen, _ = load_model(cfg.model, cfg.seed)
        frozen.to(next(model.parameters()).device).eval().requires_grad_(False)
        set_precision(frozen, getattr(model, "autocast_dtype", None) is not None)
        INITIAL[cfg.model, cfg.seed] = frozen
    return INITIAL[cfg.model, cfg.seed]


def opsd_loss(teacher):
    """The loss seam: Eq. (2) of a micro-batch, its teacher (a model) after mb.teacher_prompt."""
    def loss_of(model, cfg, ro, mb, old_logp=None):
        log_s, _, ids, mask = student_logprobs(model, cfg, ro, mb)                # (b, L, V)
        log_t = teacher_logprobs(teacher, cfg, mb.teacher_prompt, ids, mask)      # (b, L, V)
        div = divergence(log_t, log_s, cfg.divergence) * mask                      # (b, L)
        # Eq. (2): the mean over o_i's tokens, then over the step's B G answers (mb.loss_scale)
        return (div.sum(1) * mb.loss_scale.to(div.device)).sum(), 0
    return loss_of


def opsd_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no):
    """scgrpo.train_step with every answer distilled toward the gold teacher and no reward term."""
    teacher = model if cfg.opsd_teacher == "current" else initial_policy(cfg, model)
    metrics, _ = S.train_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no,
                              route=every_group, context=gold_prompts, credit=unit_credit,
                              loss_of=opsd_loss(teacher))
    return metrics, []  # no token weight to show on the credit page


def main(argv=None):
    """scgrpo.py's command line with this file's settings and seams (the tests call it too)."""
    S.main(argv, Config=Config, step=opsd_step)


if __name__ == "__main__":
    main()
