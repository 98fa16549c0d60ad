"""
On-policy self-distillation with the gold solution (§6.2, the paper's "Oracle" demonstration) as a
fork of scgrpo.py: no reward in the loss. The teacher is Eq. (3)'s, the same model under
stop-gradient given privileged context c, here the question's gold solution (gold_context) in the
place where scgrpo.py's teacher holds a verified answer of the group. The loss is Eq. (2): a
divergence from the teacher to the student at each token of each sampled answer, averaged over the
answer's tokens, then over the step's answers, right or wrong (the verifier only reports).
  --divergence jsd: the Jensen-Shannon divergence, KL(t || m) / 2 + KL(s || m) / 2 with m the mean
    of the two distributions, as OPSD's public code computes it by default (generalized_jsd_loss
    at beta 0.5 in opsd_trainer.py of github.com/siyan-zhao/OPSD, read at commit 590ec26);
  --divergence forward: KL(teacher || student), the D of §5.1.
The loss needs the student's whole distribution with its gradient, so the update's forward is the
plain one (forward_answers), whatever --fast says; sampling and evaluation keep the fast path.
    python variants/opsd.py --model SmolLM2-135M --task addition
"""
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402
from machinery.metrics import Phases, step_metrics  # noqa: E402
from variants.distill import divergence, student_logprobs, teacher_logprobs  # noqa: E402


@dataclass
class Config(S.Config):
    """The settings of an OPSD run with the gold solution: scgrpo.py's and the divergence."""
    algo: str = S.setting("opsd", "on-policy self-distillation, the gold solution as the teacher's "
                          "context", ("opsd",))
    divergence: str = S.setting("jsd", "Eq. (2)'s divergence: jsd (OPSD's) or forward KL(teacher "
                                "|| student)", ("jsd", "forward"))


def gold_context(problem, tiny):
    """The privileged context c: the gold solution without its final '#### N' line (GSM8K's
    reasoning, addition's 'a + b = c'); the tiny model reads only digits and '+=;', so for it the
    answer's number (arith has no other solution)."""
    solution, _, number = problem["answer"].rpartition("####")
    return number.strip() if tiny or not solution.strip() else solution.strip()


def opsd_loss(prompts):
    """update's loss_of: Eq. (2) of a micro-batch. prompts: the teacher prompt of each question."""
    def loss_of(model, cfg, ro, mb, old_logp=None):
        log_s, _, ids, mask = student_logprobs(model, cfg, ro, mb)                # (b, L, V)
        log_t = teacher_logprobs(model, cfg, [prompts[b] for b in mb.question.tolist()], ids, mask)
        div = divergence(log_t, log_s, cfg.divergence) * mask                      # (b, L)
        # Eq. (2): the mean over o_i's tokens, then over the step's B G answers (mb.norm)
        return (div.sum(1) * mb.norm.to(div.device)).sum(), 0
    return loss_of


def opsd_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids):
    """scgrpo.train_step with every answer distilled toward the gold teacher and no reward term."""
    clock = Phases(next(model.parameters()).device)
    ro = S.sample_groups(model, tok, cfg, batcher.take(cfg.prompts_per_step), cfg.group_size,
                         cfg.temperature, gen, eos_ids)
    clock.lap("sample")
    routes = ["grpo"] * len(ro.problems)  # every group trains, whatever its rewards
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), [[None] * ro.G] * len(routes))
    tiny = tok.chat_template == S.TINY_TEMPLATE
    # Eq. (3): the teacher's prompt holds the question's gold solution
    prompts = [S.encode_prompt(tok, p["question"], gold_context(p, tiny)) for p in ro.problems]
    clock.lap("teacher")  # the teacher's passes run inside the update, one per micro-batch
    upd, stepped = S.update(model, optimizer, cfg, ro, batch, loss_of=opsd_loss(prompts))
    clock.lap("update")
    return step_metrics(ro, routes, batch, clock, **upd, eq5_only=False,
                        nonfinite=bool(batch.route) and not stepped), []


if __name__ == "__main__":
    S.main(Config=Config, step=opsd_step)
