"""variants/rlsd.py: its weight and its lambda schedule by hand, its gradient against a plain loop
with either teacher, a teacher given the student's own prompt, its flags' checks, its run."""
import json
import math

import pytest
import torch

from machinery import models
from variants import rlsd
import scgrpo as S
from conftest import assert_same_gradients, bad_input_test, read_metrics
from test_scgrpo import REF_G, REF_TABLE, grpo_credit, project_step, ref_logprobs, references_drawn

RLSD = dict(Config=rlsd.Config, step=rlsd.rlsd_step)


@pytest.mark.parametrize("lam", [0.5, 0.2])
def test_rlsd_weight_hand_computed(lam):
    """RLSD's weight (1 - lam) + lam clip(exp(sign(A) Delta), 0.8, 1.2) on Delta = 0.1, -0.3, 0.5:
    for A > 0, exp gives 1.10517 (inside), 0.74082 -> 0.8, 1.64872 -> 1.2; for A < 0 (the sign
    flips Delta) 0.90484, 1.34986 -> 1.2, 0.60653 -> 0.8; 0 off the answer. At lam 0.2 the blend
    keeps 0.8 of 1 and 0.2 of the clipped ratio (a blend with lam on the wrong term gives 0.2 + 0.8 w)."""
    delta = torch.tensor([[0.1, -0.3, 0.5, 7.0]] * 2)
    mask = torch.tensor([[True, True, True, False]] * 2)
    w = rlsd.rlsd_weights(delta, torch.tensor([2.0, -0.5]), mask, eps_w=0.2, lam=lam)
    clipped = torch.tensor([[math.exp(0.1), 0.8, 1.2, 0.0], [math.exp(-0.1), 1.2, 0.8, 0.0]])
    want = (1 - lam) + lam * clipped
    want[:, 3] = 0.0
    torch.testing.assert_close(w, want)


def test_lambda_falls_linearly_over_the_optimizer_steps_then_stays_0():
    """lambda = 0.5 (1 - min(steps / 50, 1)) by hand at 0, 25, 50 and 60 optimizer steps: 0.5, 0.25,
    0, 0; with decay 0 it never falls; another starting value scales it."""
    cfg = rlsd.Config()
    assert [rlsd.blend(cfg, k) for k in (0, 25, 50, 60)] == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert rlsd.blend(rlsd.Config(rlsd_lambda_decay_steps=0), 60) == 0.5
    assert rlsd.blend(rlsd.Config(rlsd_lambda=0.8, rlsd_lambda_decay_steps=10), 4) == pytest.approx(0.48)


def plain_rlsd_gradients(batch, teacher):
    """One update of GRPO with RLSD's weight on REF_TABLE at lambda 0.5, plainly: one forward per
    answer over the full vocabulary (ref_logprobs), loops over answers and tokens. gold: every group
    of unequal rewards taught by the gold context '0' of every REF_TABLE question; self: SC-GRPO's
    partial groups taught by the reference the code under test drew (its draws are random), its
    fallback group weight 1, its solve-none group skipped. -> each parameter's gradient"""
    model, tok = models.make_tiny(0)
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    G, B = REF_G, len(REF_TABLE)
    adv, keep = grpo_credit(correct)  # Eq. (1); keep: groups of unequal rewards
    ref_of = references_drawn(batch)
    total = 0.0
    for b in range(B):
        if not keep[b] or sum(correct[b]) == 0:  # equal rewards (solve-none too): no gradient
            continue
        for i, o in enumerate(answers[b]):
            log_s = ref_logprobs(model, S.encode_prompt(tok, questions[b]), o)     # (|o|, V), grad
            chosen = log_s.gather(-1, torch.tensor(o)[:, None]).squeeze(-1)
            w = torch.ones(len(o))
            context = "0" if teacher == "gold" else None
            if teacher == "self" and (b, i) in ref_of:
                context = tok.decode(answers[b][ref_of[b, i]], skip_special_tokens=True)
            if context is not None:  # Delta_t = log p_teacher(o_t) - log p_student(o_t), no gradient
                with torch.no_grad():
                    log_t = ref_logprobs(model, S.encode_prompt(tok, questions[b], reference=context), o)
                    delta = log_t.gather(-1, torch.tensor(o)[:, None]).squeeze(-1) - chosen
                w = 0.5 + 0.5 * torch.exp(math.copysign(1.0, adv[b, i]) * delta).clamp(0.8, 1.2)
            ratio = torch.exp(chosen - chosen.detach())  # mu = 1: rho = 1, its gradient that of log p
            total = total - sum(w[t] * ratio[t] * adv[b, i] for t in range(len(o))) / (len(o) * B * G)
    return torch.autograd.grad(total, list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("teacher", ["gold", "self"])
def test_gradient_equals_a_plain_full_vocabulary_loop(teacher, fast, monkeypatch):
    """One update on REF_TABLE (a partial, a solve-none, a fallback and a skipped group) against
    plain_rlsd_gradients: every parameter's gradient within 1e-3 in relative norm, the log-ratio
    from the teacher pass's log-probabilities on either path."""
    ro, batch, m, got = project_step("rlsd", monkeypatch, lr=0.0, epochs=1, fast=fast, **RLSD, teacher=teacher)
    assert m["rlsd_lambda"] == 0.5 and m["answers_updated"] == 2 * REF_G  # the partial and fallback groups
    assert_same_gradients(got[0], plain_rlsd_gradients(batch, teacher))


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_a_teacher_given_the_students_own_prompt_changes_nothing(fast, monkeypatch):
    """With the student's own prompt as the teacher's (the context dropped from encode_prompt), the
    teacher is the student: RLSD's weights are 1 on every answer token, exactly on the plain lines
    (both sides the same forward) and to fp32 rounding on the fast path (the student's side from the
    sampler's states), and 0 off the answers."""
    real = S.encode_prompt
    monkeypatch.setattr(S, "encode_prompt", lambda tok, q, reference=None: real(tok, q))
    ro, batch, m, grads = project_step("rlsd", monkeypatch, lr=0.0, epochs=1, fast=fast, **RLSD)
    answer = ro.mask[batch.row][:, :batch.weights.shape[1]]
    tolerance = 0.0 if not fast else 1e-6
    assert (batch.weights[answer] - 1.0).abs().max() <= tolerance and (batch.weights[~answer] == 0).all()


def test_its_run_logs_lambda_by_the_optimizer_steps_and_names_its_program(tmp_path):
    """variants/rlsd.py's command line in this process, lambda decaying over 2 optimizer steps: the
    logged lambda follows the AdamW steps taken before each step (0.5, 0.25, 0 when each step updates,
    as the gold teacher's do here), the weight's mean near 1; --teacher self's run too; each run
    folder's config names its program."""
    for teacher in ("gold", "self"):
        folder = tmp_path / teacher
        rlsd.main(["--steps", "3", "--eval-every", "3", "--eval-n", "4", "--eval-k", "0", "--out", str(folder),
                   "--teacher", teacher, "--rlsd-lambda-decay-steps", "2"])
        lines = [x for x in read_metrics(str(folder)) if "reward_mean" in x]
        assert len(lines) == 3 and all(math.isfinite(x["loss"]) for x in lines)
        steps_before = [sum(y["answers_updated"] > 0 for y in lines[:k]) for k in range(3)]  # AdamW's
        assert [x["rlsd_lambda"] for x in lines] == pytest.approx([0.5 * (1 - min(n / 2, 1)) for n in steps_before])
        assert teacher == "self" or steps_before == [0, 1, 2]  # gold: every step updated here
        assert all(abs(x["rlsd_weight_mean"] - 1) <= 0.1 for x in lines if "rlsd_weight_mean" in x)
        assert json.loads((folder / "config.json").read_text())["program"] == "variants/rlsd.py"


# RLSD's own flags are checked by the same rules as scgrpo.py's (its Config's rule).
test_bad_input_exits_2_with_one_line_and_writes_nothing = bad_input_test(rlsd.main, [
    (["--rlsd-eps-w", "1"], "--rlsd-eps-w 1.0 is out of range: it must be in [0, 1)"),
    (["--rlsd-lambda", "2"], "--rlsd-lambda 2.0 is out of range: it must be in [0, 1]"),
    (["--rlsd-lambda-decay-steps", "-1"], "--rlsd-lambda-decay-steps -1 is out of range"),
    (["--teacher", "other"], "--teacher: invalid choice: 'other'"),
])
