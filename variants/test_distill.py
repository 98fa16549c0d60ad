"""variants/distill.py: its divergences by hand, its gradient against a plain loop over the
vocabulary, a teacher given the student's own prompt, beta's clock in training steps, its flags'
checks, its run."""
import json
import math

import pytest
import torch

from machinery import models
from variants import distill
import scgrpo as S
from conftest import assert_same_gradients, bad_input_test, plain_divergence, run_ok
from test_scgrpo import REF_G, REF_TABLE, grpo_credit, project_step, ref_logprobs, references_drawn

DISTILL = dict(Config=distill.Config, step=distill.distill_step)


def test_divergences_hand_computed():
    """distill.divergence on a two-token example by hand: p = (0.5, 0.5), q = (0.9, 0.1):
    KL(p || q) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.51083, KL(q || p) = 0.9 ln 1.8 + 0.1 ln 0.2
    = 0.36806; bidirectional mixes them; JSD(p, p) = 0, JSD is symmetric, below ln 2, and near
    ln 2 for distributions with (almost) disjoint supports."""
    log_p, log_q = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.9, 0.1]).log()
    assert float(distill.divergence(log_p, log_q, "forward")) == pytest.approx(0.5108256, abs=1e-6)
    assert float(distill.divergence(log_p, log_q, "reverse")) == pytest.approx(0.3680642, abs=1e-6)
    assert float(distill.divergence(log_p, log_q, "bidirectional", mix=0.25)) == pytest.approx(
        0.25 * 0.5108256 + 0.75 * 0.3680642, abs=1e-6)
    m = torch.tensor([0.7, 0.3])  # JSD by hand: the mean's KL from each side, halves
    want = 0.5 * (0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)) + 0.5 * (
        0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3))
    assert float(distill.divergence(log_p, log_q, "jsd")) == pytest.approx(want, abs=1e-6)
    assert float(distill.divergence(log_q, log_p, "jsd")) == pytest.approx(want, abs=1e-6)
    assert float(distill.divergence(log_p, log_p, "jsd")) == 0.0 and float(m.sum()) == pytest.approx(1.0)
    far = torch.tensor([1 - 1e-6, 1e-6]).log(), torch.tensor([1e-6, 1 - 1e-6]).log()
    assert math.log(2) - 1e-4 < float(distill.divergence(*far, "jsd")) <= math.log(2)


def plain_distill_gradients(batch, cfg, beta=0.1):
    """One update of L_GRPO + beta L_distill on REF_TABLE, plainly: one forward per answer over the
    full vocabulary (ref_logprobs), loops over answers and tokens, GRPO's term with weight 1 on the
    groups SC-GRPO routes but solve-none, and toward the reference the code under test drew (its
    draws are random) the divergence by its definition, normalised as J. -> each parameter's gradient"""
    model, tok = models.make_tiny(0)
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    G, B = REF_G, len(REF_TABLE)
    adv, keep = grpo_credit(correct)  # Eq. (1); keep: groups of unequal rewards
    ref_of = references_drawn(batch)
    total = 0.0
    for b in range(B):
        if not (keep[b] and sum(correct[b]) > 0):  # skipped: equal rewards, or solve-none
            continue
        for i, o in enumerate(answers[b]):
            log_s = ref_logprobs(model, S.encode_prompt(tok, questions[b]), o)     # (|o|, V), grad
            chosen = log_s.gather(-1, torch.tensor(o)[:, None]).squeeze(-1)
            ratio = torch.exp(chosen - chosen.detach())  # mu = 1: rho = 1, its gradient that of log p
            total = total - sum(ratio[t] * adv[b, i] for t in range(len(o))) / (len(o) * B * G)
            if (b, i) in ref_of:  # + beta L_distill toward the drawn reference, Eq. (4)'s teacher
                tau = tok.decode(answers[b][ref_of[b, i]], skip_special_tokens=True)
                with torch.no_grad():
                    log_t = ref_logprobs(model, S.encode_prompt(tok, questions[b], reference=tau), o)
                total = total + beta * sum(plain_divergence(log_t[t], log_s[t], cfg.divergence, cfg.mix)
                                           for t in range(len(o))) / (len(o) * B * G)
    return torch.autograd.grad(total, list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize("settings", [dict(divergence="forward"), dict(divergence="reverse"),
                                      dict(divergence="bidirectional", mix=0.3)],
                         ids=["forward", "reverse", "bidirectional"])
def test_gradient_equals_a_plain_full_vocabulary_loop(settings, monkeypatch):
    """One update on REF_TABLE (a partial, a solve-none, a fallback and a skipped group) against
    plain_distill_gradients: every parameter's gradient within 1e-3 in relative norm."""
    ro, batch, metrics, got = project_step("distill", monkeypatch, lr=0.0, epochs=1, **DISTILL, **settings)
    assert metrics["answers_updated"] > 0 and metrics["groups_none"] == 0  # solve-none: skipped
    assert_same_gradients(got[0], plain_distill_gradients(batch, distill.Config(**settings)))


def test_a_teacher_given_the_students_own_prompt_changes_nothing(monkeypatch):
    """With the student's own prompt as the teacher's (the context dropped from encode_prompt), the
    teacher is the student: the update is GRPO's, its divergence exactly 0."""
    real = S.encode_prompt
    monkeypatch.setattr(S, "encode_prompt", lambda tok, q, reference=None: real(tok, q))
    m = project_step("distill", monkeypatch, lr=0.0, epochs=1, **DISTILL)[2]
    grpo = project_step("grpo", monkeypatch, lr=0.0, epochs=1)[2]
    assert m["distill_loss"] == 0.0 and m["loss"] == pytest.approx(grpo["loss"], rel=1e-5)


def test_beta_counts_training_steps():
    """The warm-up by hand: 0.03 at step 1, 0.1 at the last, linear between (step 6 of 12: 0.03 +
    0.07 * 5 / 11), whatever --ppo-epochs is; a fixed beta stays."""
    warm = distill.Config(steps=12, beta_start=0.03, ppo_epochs=2)
    got = [distill.beta_at(warm, k) for k in (1, 6, 7, 12)]
    assert got == pytest.approx([0.03, 0.03 + 0.07 * 5 / 11, 0.03 + 0.07 * 6 / 11, 0.1])
    assert distill.beta_at(distill.Config(steps=12), 5) == 0.1


def test_its_run_logs_beta_and_l_distill_and_names_its_program(tmp_path):
    """variants/distill.py in a process of its own, beta warmed up 0.03 -> 0.1 over 3 steps of two
    PPO epochs each (6 optimizer steps): the logged beta follows the training steps."""
    out = str(tmp_path / "distill")
    train, evals = run_ok(out, "--steps", "3", "--eval-every", "3", "--eval-n", "4", "--eval-k", "0",
                          "--beta-start", "0.03", "--ppo-epochs", "2", program="variants/distill.py")
    assert [round(x["beta"], 6) for x in train] == [0.03, 0.065, 0.1] and len(evals) == 2
    assert all(math.isfinite(x["loss"]) and x["distill_loss"] >= 0 for x in train)
    assert json.loads((tmp_path / "distill" / "config.json").read_text())["program"] == "variants/distill.py"


# distill's own flags are checked by the same rules as scgrpo.py's (its Config's rule).
test_bad_input_exits_2_with_one_line_and_writes_nothing = bad_input_test(distill.main, [
    (["--beta", "-0.1"], "--beta -0.1 is out of range: it must be >= 0"),
    (["--beta-start", "-0.5"], "--beta-start -0.5 is out of range: it must be -1, or >= 0"),
    (["--mix", "1.5"], "--mix 1.5 is out of range: it must be in [0, 1]"),
])
