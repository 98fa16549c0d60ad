"""variants/opsd.py: its gradient against a plain loop over the vocabulary with either teacher (the
policy before training, OPSD's default, or the current one), a teacher given the student's own
prompt, the gold context, its flags' checks, its run."""
import json
import math

import pytest
import torch

from machinery import models
from variants import opsd
import scgrpo as S
from conftest import assert_same_gradients, bad_input_test, plain_divergence, read_metrics
from test_scgrpo import REF_G, REF_TABLE, project_step, ref_logprobs

OPSD = dict(Config=opsd.Config, step=opsd.opsd_step)


def trained_tiny():
    """The tiny model at seed 0 as training would have moved it: each weight shifted a little, so the
    policy being trained differs from the initial one (--model tiny --seed 0, opsd.initial_policy)."""
    model, tok = models.make_tiny(0)
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
    return model, tok


def plain_opsd_gradients(student, teacher, tok, divergence):
    """One update of Eq. (2) on REF_TABLE, plainly: every answer of every group, right or wrong, its
    divergence from the teacher (the gold context '0' of every REF_TABLE question in its prompt) by
    its definition, averaged over the answer's tokens, then over the B G answers; the teacher a
    model of its own or the student itself, under stop-gradient. -> each parameter's gradient"""
    questions, answers = [x[0] for x in REF_TABLE], [x[1] for x in REF_TABLE]
    G, B = REF_G, len(REF_TABLE)
    total = 0.0
    for b in range(B):
        gold = S.encode_prompt(tok, questions[b], reference="0")
        for o in answers[b]:
            log_s = ref_logprobs(student, S.encode_prompt(tok, questions[b]), o)   # (|o|, V), grad
            with torch.no_grad():
                log_t = ref_logprobs(teacher, gold, o)
            total = total + sum(plain_divergence(log_t[t], log_s[t], divergence) for t in range(len(o))) / (
                len(o) * B * G)
    return torch.autograd.grad(total, list(student.parameters()), allow_unused=True)


@pytest.mark.parametrize("divergence", ["jsd", "forward"])
@pytest.mark.parametrize("teacher", ["initial", "current"])
def test_gradient_equals_a_plain_full_vocabulary_loop(teacher, divergence, monkeypatch):
    """One update on REF_TABLE of a policy that has moved from its initial weights, against
    plain_opsd_gradients with the teacher the flag names: every parameter's gradient within 1e-3 in
    relative norm. With the wrong teacher (the other one) the gradients differ by more than that."""
    ro, batch, m, got = project_step("opsd", monkeypatch, lr=0.0, epochs=1, model=trained_tiny(), **OPSD,
                                     divergence=divergence, opsd_teacher=teacher)
    assert m["answers_updated"] == len(REF_TABLE) * REF_G  # every answer, right or wrong
    student, tok = trained_tiny()
    initial = models.make_tiny(0)[0]
    want = plain_opsd_gradients(student, initial if teacher == "initial" else student, tok, divergence)
    assert_same_gradients(got[0], want)
    other = plain_opsd_gradients(student, student if teacher == "initial" else initial, tok, divergence)
    with pytest.raises(AssertionError):
        assert_same_gradients(got[0], other)


def test_the_initial_policy_is_loaded_from_the_models_name_and_kept_frozen():
    """opsd.initial_policy: --model tiny at --seed, as a run (or a resumed one) would load it, never
    the weights it is handed; loaded once, without gradients, and the random streams untouched."""
    cfg, (moved, _) = opsd.Config(seed=0), trained_tiny()
    state = torch.get_rng_state()
    frozen = opsd.initial_policy(cfg, moved)
    assert torch.equal(torch.get_rng_state(), state) and opsd.initial_policy(cfg, moved) is frozen
    for a, b, c in zip(frozen.parameters(), models.make_tiny(0)[0].parameters(), moved.parameters()):
        assert torch.equal(a, b) and not torch.equal(a, c) and not a.requires_grad


def test_a_teacher_given_the_students_own_prompt_changes_nothing(monkeypatch):
    """With the student's own prompt as the teacher's (the context dropped from encode_prompt) and
    the teacher the current policy, the teacher is the student: OPSD's loss and gradient vanish
    (JSD to fp32 rounding: its mixture is computed in logs)."""
    real = S.encode_prompt
    monkeypatch.setattr(S, "encode_prompt", lambda tok, q, reference=None: real(tok, q))
    _, _, m, grads = project_step("opsd", monkeypatch, lr=0.0, epochs=1, **OPSD, opsd_teacher="current")
    assert abs(m["loss"]) < 1e-6 and max(float(g.abs().max()) for g in grads[0]) < 1e-6


def test_the_gold_context_is_the_solution_without_its_final_line():
    """gold_context by hand: GSM8K's reasoning without '#### N', the number alone for the tiny model
    (which reads digits only) or where there is no reasoning."""
    problem = {"question": "q", "answer": "She has 3 + 4 = 7 apples.\n#### 7"}
    assert opsd.gold_context(problem, tiny=False) == "She has 3 + 4 = 7 apples."
    assert opsd.gold_context(problem, tiny=True) == "7"
    assert opsd.gold_context({"question": "q", "answer": "#### 12"}, tiny=False) == "12"


def test_its_run_names_its_program_and_its_teacher(tmp_path):
    """variants/opsd.py's command line in this process, with each teacher: two steps, finite losses,
    a run folder whose config names its program and its teacher."""
    for teacher in ("initial", "current"):
        folder = tmp_path / teacher
        opsd.main(["--steps", "2", "--eval-every", "2", "--eval-n", "4", "--eval-k", "0", "--out", str(folder),
                   "--opsd-teacher", teacher])
        lines = [x for x in read_metrics(str(folder)) if "reward_mean" in x]
        assert len(lines) == 2 and all(math.isfinite(x["loss"]) for x in lines)
        config = json.loads((folder / "config.json").read_text())
        assert config["program"] == "variants/opsd.py" and config["opsd_teacher"] == teacher


# OPSD's own flags are checked by the same rules as scgrpo.py's (choices).
test_bad_input_exits_2_with_one_line_and_writes_nothing = bad_input_test(opsd.main, [
    (["--divergence", "reverse"], "--divergence: invalid choice: 'reverse'"),
    (["--opsd-teacher", "gold"], "--opsd-teacher: invalid choice: 'gold'"),
])
