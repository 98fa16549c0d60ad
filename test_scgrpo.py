"""Tests of the story, scgrpo.py: the verifier, the advantages, the routes and references, the
teacher's D, f(D) and c, Eq. (5), the loss, the update against a plain reference step written a
second time, evaluation, and the tiny model's end-to-end run. Each compares against a reference
that could disagree: a naive loop, a PyTorch built-in, a hand-computed case. The plain reference
step (REF_TABLE, reference_credit, reference_update) is imported by the variants' tests too.

    python -m pytest -q test_scgrpo.py      # these alone; README's command runs every file
"""
import dataclasses
import functools
import json
import math
import os
import random
import time

import pytest
import torch
import torch.nn.functional as F

from machinery import batching
from machinery import models
from machinery import speed
from machinery import tasks
import scgrpo as S
from conftest import SHARED, check_step_lines, pad_rows, run_ok


def draw_references(ro, routes, rng):
    """Each group's references, as train_step draws them (pick_references)."""
    return [S.pick_references(c, r, rng) for c, r in zip(ro.correct.bool().tolist(), routes)]


def with_teacher(model, tok, cfg, ro, batch):
    """SC-GRPO's context and credit seams on a Batch, as train_step runs them: the teacher's prompts,
    then D, f(D) and Eq. (5). -> (Batch, the teacher's metrics)"""
    return S.sc_credit(model, cfg, ro, dataclasses.replace(batch, teacher_prompt=S.teacher_prompts(tok, ro, batch)))


def taught_step(model, tok, cfg, verdicts, routes):
    """Answers to two arith questions sampled at T = 1 (seed 3), the verifier's verdicts replaced by
    `verdicts` (B, G), routed by `routes`, through with_teacher. -> (Rollout, Batch, metrics)"""
    ro = S.sample_groups(model, tok, cfg, tasks.make_arith()[0][:2], cfg.group_size, 1.0,
                         torch.Generator().manual_seed(3), [0])
    ro.correct = torch.tensor(verdicts)
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), draw_references(ro, routes, random.Random(0)))
    return (ro, *with_teacher(model, tok, cfg, ro, batch))


# The plain reference step -------------------------------------------------------------------------
# One whole update written a second time, as plainly as possible, from ../shared/PAPER_NOTES.md
# and the readings marked "our reading" in scgrpo.py. It shares nothing with the code it checks but
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
                if routes[b] == "solve_none":  # only the first L_i = min(|o_i|, |o_r|) tokens
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
        if routes[b] == "solve_none":  # Eq. (5) over the G - 1 answers other than o_r
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


def reference_update(model, tok, questions, answers, adv, weights, n_groups, opt, epochs, eps=0.2,
                     eps_high=None, token_level=False):
    """ppo_epochs optimizer steps of the clipped objective, plainly, one answer at a time.
    GRPO / SC-GRPO: J = 1/B sum_groups 1/G sum_i 1/|o_i| sum_t f(D_it) min(rho A, clip(rho) A);
    token_level (DAPO): the sum over every token / their number; eps_high: the clip's upper side
    (default eps). -> gradients of each epoch, tokens clipped in each"""
    eps_high = eps if eps_high is None else eps_high
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
            if token_level:
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
    verdicts, and (--fast, fp32) the student's states from one plain forward per answer."""
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
    return S.Rollout(rows, prompts, ids, mask, tok.batch_decode(
        [o for o in answers], skip_special_tokens=True), correct, (hidden, lse) if cfg.fast else None)


def project_step(algo, monkeypatch, lr, micro_batch=3, epochs=2, seed=0, fast=True, Config=S.Config, step=None,
                 model=None, **settings):
    """One training step of scgrpo.py (or of a variant: its Config and step) on REF_TABLE (its sampler
    replaced by the fixed rollout), optimised by plain SGD with no gradient clipping. step: train_step,
    with GRPO's routes for algo 'grpo' as scgrpo.main gives them; model: the tiny model at seed 0, or
    one given. -> (the rollout and the Batch the update received, metrics, gradients of each epoch)"""
    model, tok = model or models.make_tiny(0)
    step = step or (functools.partial(S.train_step, route=S.grpo_routes) if algo == "grpo" else S.train_step)
    cfg = Config(algo=algo, group_size=REF_G, prompts_per_step=len(REF_TABLE), micro_batch=micro_batch,
                 max_new_tokens=REF_MAX_NEW, temperature=REF_T, ppo_epochs=epochs,
                 max_grad_norm=1e9, fast=fast, **settings)
    rows = [{"question": q, "answer": "#### 0"} for q, _, _ in REF_TABLE]
    monkeypatch.setattr(S, "sample_groups", lambda model, tok, cfg, rows, *a, **k: fixed_rollout(
        model, tok, cfg, rows))
    seen, real_update = [], S.update
    monkeypatch.setattr(S, "update", lambda *a, **k: (seen.append(a), real_update(*a, **k))[1])
    opt = RecordingSGD(model.parameters(), lr)
    metrics, _ = step(model, opt, tok, cfg, tasks.Batcher(rows, seed), random.Random(seed),
                      torch.Generator().manual_seed(0), [0], 1)
    ro, batch = seen[0][3], seen[0][4]
    return ro, batch, metrics, opt.seen


def references_drawn(batch):
    """{(b, i): j}: the reference j (an index within the group) that answer i of REF_TABLE's question
    b drew in the code under test, always of its own question (the draws are random; the rule they
    must obey is reference_credit's to check)."""
    drawn = [(int(n), int(j)) for n, j in zip(batch.row, batch.ref_row) if j >= 0]
    assert all(n // REF_G == j // REF_G for n, j in drawn)  # the same question
    return {divmod(n, REF_G): j % REF_G for n, j in drawn}


def by_answer(ro, batch):
    """{(question, i): batch row index} for the answers the update received."""
    G = ro.correct.shape[1]
    return {(ro.problems[int(n) // G]["question"], int(n) % G): m for m, n in enumerate(batch.row)}


def check_against_reference(algo, monkeypatch, micro_batch=3, fast=True, eps_high=None, token_level=False,
                            **variant):
    """A training step on REF_TABLE against the plain reference: the answers that get a gradient,
    their advantages and per-token weights, c, the clip count, and every parameter's gradient
    in both PPO epochs (the second one after an SGD step large enough that the clip acts).
    algo 'scgrpo': SC-GRPO's credit; else GRPO's (Eq. 1, weight 1, groups of equal rewards
    skipped); variant: a variant's Config, step and settings (project_step), eps_high and
    token_level its loss's (reference_update).
    Tolerances: weights 1e-4 absolute, advantages 1e-3 relative (Eq. 5 divides by the spread
    of s, which magnifies D's fp32 rounding), gradients 1e-3 in relative norm (measured: 5e-5)."""
    lr = 0.03  # measured: 7-16 of 29-44 tokens outside the clip range in the second epoch
    ro, batch, metrics, got_grads = project_step(algo, monkeypatch, lr, micro_batch, fast=fast, **variant)
    at = by_answer(ro, batch)
    model, tok = models.make_tiny(0)  # the same weights, a fresh copy
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    G = REF_G
    if algo == "scgrpo":
        refs = references_drawn(batch)
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
        n_groups = len(REF_TABLE)  # a skipped group still counts in B (token_level: unused)
    assert sorted(at) == sorted((questions[b], i) for b, i in weights)
    for (b, i), w in weights.items():
        m = at[questions[b], i]
        assert float(batch.adv[m]) == pytest.approx(adv[b, i], rel=1e-3, abs=1e-6), (b, i)
        torch.testing.assert_close(batch.weights[m, :len(w)], w, rtol=0, atol=1e-4)
        assert (batch.weights[m, len(w):] == 0).all()
    opt = RecordingSGD(model.parameters(), lr)
    want_grads, n_clipped = reference_update(model, tok, questions, answers, adv, weights, n_groups, opt,
                                             epochs=2, eps_high=eps_high, token_level=token_level)
    n_tokens = sum(len(w) for w in weights.values())
    assert n_clipped[0] == 0 and 0 < n_clipped[1] < n_tokens  # pi_theta has moved in epoch 2
    assert metrics["clip_frac"] == pytest.approx(n_clipped[1] / n_tokens)
    for epoch in range(2):
        for (p, _), got, want in zip(model.named_parameters(), got_grads[epoch], want_grads[epoch]):
            err = float((got - want).norm() / want.norm())
            assert err < 1e-3, (algo, epoch, p, err)



# The verifier -------------------------------------------------------------------------------------
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


# Eq. (1), routes and references -------------------------------------------------------------------
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
    assert S.route_groups(rows) == ["solve_none", "fallback", "partial", "partial", "partial", "partial", "skip"]
    assert S.grpo_routes(rows) == ["skip"] + ["grpo"] * (G - 1) + ["skip"]
    shaped = torch.tensor([[-0.5, -0.5, -0.5], [0.0, -0.5, 0.0], [1.0, 1.0, 1.0]])  # any reward: equal skipped
    assert S.grpo_routes(shaped) == ["skip", "grpo", "skip"]


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


def test_solve_none_reference_is_drawn_uniformly_from_the_group():
    """o_r is one answer drawn uniformly: over 1,600 groups of 8 each index is o_r about 200 times
    (binomial std 13; every count within 6 std)."""
    rng, counts = random.Random(0), [0] * 8
    for _ in range(1600):
        counts[S.pick_references([False] * 8, "solve_none", rng).index(None)] += 1
    assert all(abs(c - 200) < 6 * 13.2 for c in counts), counts


# The teacher: its prompt, D, f(D) and c, Eq. (5) --------------------------------------------------
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


def test_prompt_builder_takes_any_model_output_as_reference(tiny):
    _, tok = tiny
    for ref in ["", "\\boxed{" * 1000, "#### 1\n#### 2", "\u0663\u00e9\U0001F600 {{", "9" * 100_000]:
        ids = S.encode_prompt(tok, "3+4=", reference=ref)
        assert ids[-4:] == tok("3+4=")["input_ids"]  # the question still closes the prompt


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


def test_teacher_d_equals_one_teacher_forward_per_answer(tiny):
    """The shared-prefill teacher pass gives the D of the plain computation: each answer run
    after its own teacher prompt, full forward, KL against the sampler's student states."""
    model, tok = tiny
    cfg = S.Config(fast=True, algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=3)
    ro, batch, stats = taught_step(model, tok, cfg, [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]],
                                   ["partial", "solve_none"])
    assert len(batch.route) == 7
    head = model.get_output_embeddings()
    plain = {}
    for m in range(7):
        n, j = int(batch.row[m]), int(batch.ref_row[m])
        length, ref_length = int(ro.mask[n].sum()), int(ro.mask[j].sum())
        ids = ro.ids[n, :length]
        prompt = S.encode_prompt(tok, ro.problems[n // 4]["question"], reference=ro.texts[j])
        with torch.no_grad():
            h_t = speed.completion_hidden(model, [prompt], ids[None], torch.ones(1, length, dtype=torch.bool))
            hidden, lse = ro.fast_states
            want = speed.head_kl(h_t, hidden[n, :length], lse[n, :length], head, cfg.temperature)
        kl, weights = batch.kl[m, :length], batch.weights[m, :length]
        active = batch.active[m, :length]  # solve-none answers past L_i are not scored
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
    (o_r,) = {int(batch.ref_row[m]) for m in none}
    assert o_r // 4 == 1 and o_r not in batch.row.tolist()
    s = torch.stack([batch.weights[m, :len(plain[m])].sum() / len(plain[m]) for m in none])
    want_adv = 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(batch.adv[none], want_adv, rtol=1e-3, atol=1e-6)
    assert none == [4, 5, 6]  # the partial group keeps Eq. (1): rewards 1, 1, 0, 1
    torch.testing.assert_close(batch.adv[:4], torch.tensor([1, 1, -3, 1]) / 3 ** 0.5)


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


def test_c_is_the_quantile_the_flag_names(tiny):
    """--kl-quantile reaches sc_weights: with 0.5, c is the median of the step's active D (from the
    batch's own kl), not the paper's P75."""
    model, tok = tiny
    for q in (0.5, 0.75):
        cfg = S.Config(fast=True, algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=16, kl_quantile=q)
        _, batch, stats = taught_step(model, tok, cfg, [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]],
                                      ["partial", "partial"])
        assert stats["c"] == pytest.approx(float(torch.quantile(batch.kl[batch.active], q)), rel=1e-6)


def test_nonfinite_kl_gets_weight_zero_is_left_out_of_c_and_is_said(tiny, monkeypatch, capsys):
    w, c = S.sc_weights(torch.tensor([0.1, float("nan"), 0.3]), torch.tensor([True, True, True]), q=0.5)
    assert c == pytest.approx(0.2) and w.tolist() == pytest.approx([0.1 / 0.3, 0.0, 0.3 / 0.5])  # c: median of 0.1, 0.3
    model, tok = tiny
    real = S.teacher_kl

    def one_nan(*a):
        d, logp_t, logp_s = real(*a)
        d[0] = float("nan")
        return d, logp_t, logp_s
    monkeypatch.setattr(S, "teacher_kl", one_nan)
    cfg = S.Config(fast=True, algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=16)
    _, batch, stats = taught_step(model, tok, cfg, [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]],
                                  ["partial", "partial"])
    assert stats["kl_nonfinite"] == 1 and math.isfinite(stats["c"]) and math.isfinite(stats["kl_p95"])
    assert torch.isfinite(batch.weights).all() and (batch.weights[batch.kl.isnan()] == 0).all()
    assert "1 non-finite KL values" in capsys.readouterr().out


def test_diversity_advantage_hand_computed():
    """Eq. (5) of one group by hand: scores 0.3, 0.6, 0.1 have mean 1/3 and population std
    sqrt((1 + 64 + 49) / 3) / 30 = 0.20548; the advantages are 0.1 (s_i - 1/3) / (that + 1e-6)."""
    adv = S.diversity_advantages(torch.tensor([0.3, 0.6, 0.1]), alpha=0.1, eps=1e-6)
    std = math.sqrt((1 + 64 + 49) / 3) / 30
    torch.testing.assert_close(adv, 0.1 * torch.tensor([-1 / 30, 8 / 30, -7 / 30]) / (std + 1e-6))


# The loss -----------------------------------------------------------------------------------------
def naive_grpo_loss(logp, old_logp, adv, lengths, n_seq, eps, weights=None):
    """The paper's GRPO objective written as plain loops (negated); with weights, J_SC."""
    total = 0.0
    for i in range(len(adv)):
        for t in range(lengths[i]):
            rho = torch.exp(logp[i, t] - old_logp[i, t])
            w = 1.0 if weights is None else weights[i, t]
            total = total + w * torch.min(rho * adv[i], rho.clamp(1 - eps, 1 + eps) * adv[i]) / lengths[i]
    return -total / n_seq


def loss_inputs(seed=0, B=5, L=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None] < lengths[:, None]
    logp = (-torch.rand(B, L, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(B, L, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    return logp, old, adv, lengths, mask


def test_sc_loss_with_unit_weights_equals_grpo_and_gradients_match():
    logp, old, adv, lengths, mask = loss_inputs()
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
    logp, old, adv, lengths, mask = loss_inputs(seed=3)
    with torch.no_grad():
        old[~mask] = float("nan")  # garbage in padding must not leak
    weights = torch.rand(logp.shape)  # even where a weight is not 0 in the padding
    loss, _ = S.policy_loss(logp, old, adv, weights, torch.ones(len(adv)), mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and (grad[~mask] == 0).all() and (grad[mask] != 0).any()
    # and the real tokens get the weighted loop's gradient (scale 1: n_seq = 1, lengths 1 each)
    ref = naive_grpo_loss(logp, old, adv, lengths.tolist(), 1, 0.2, weights * lengths[:, None])
    torch.testing.assert_close(grad, torch.autograd.grad(ref, logp)[0])


def test_clip_count_hand_computed():
    ratio = torch.tensor([[1.0, 1.1, 1.3, 0.7], [0.85, 1.25, 2.0, 0.1]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    _, n = S.policy_loss(ratio.log(), torch.zeros(2, 4), torch.ones(2), mask.float(), torch.ones(2), mask, 0.2, 0.28)
    assert n == 3  # 1.3 and 0.7 in row 0, 2.0 in row 1 (1.25 < 1.28; 0.1 is padding)


# The update against the plain reference step ------------------------------------------------------
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
@pytest.mark.parametrize("algo", ["scgrpo", "grpo"])
def test_update_equals_the_plain_reference_step(algo, fast, monkeypatch):
    """Both paths of scgrpo.py: --fast (speed.py, on in the real-model presets) and the plain lines
    (what the tiny default runs)."""
    check_against_reference(algo, monkeypatch, fast=fast)


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
    _, adv, weights, _ = reference_credit(model, tok, questions, answers, correct, references_drawn(batch))
    norms = []
    for keep in (lambda b: b == 1, lambda b: True):  # group 1 is the solve-none one
        grads, _ = reference_update(model, tok, questions, answers, adv, {k: w for k, w in weights.items()
                                    if keep(k[0])}, len(REF_TABLE), RecordingSGD(model.parameters(), 0.0),
                                    epochs=1)
        norms.append(float(torch.cat([g.flatten() for g in grads[0]]).norm()))
    assert metrics["grad_norm_none"] == pytest.approx(norms[0], rel=1e-3) and 0 < norms[0] < norms[1]
    assert metrics["grad_norm"] == pytest.approx(norms[1], rel=1e-3)
    assert metrics["update_size"] == pytest.approx(lr * metrics["grad_norm"] / theta_0, rel=1e-5)
    assert metrics["eq5_only"] is False


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
                        torch.Generator().manual_seed(0), [0], 1, route=S.grpo_routes)
    moved = float(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm())
    assert m["grad_norm"] > 100 * 1e-3 and moved == pytest.approx(1e-3, rel=1e-3)  # fp32 differences


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
                            torch.Generator().manual_seed(0), [0], 1, route=S.grpo_routes)
        assert m["answers_updated"] > 0 and len(steps) == mu
        # the second epoch's ratios are pi_theta / frozen pi_old, no longer 1: the clip acts
        assert (m["clip_frac"] > 0) == (mu == 2), m["clip_frac"]
        params[mu] = [p.detach().clone() for p in model.parameters()]
        if mu == 2:  # weights before the second step == weights after the mu = 1 run
            for a, b in zip(steps[1], params[1]):
                torch.testing.assert_close(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(params[1], params[2]))


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
                            torch.Generator().manual_seed(seed), [0], 1, route=S.grpo_routes)
        if m["answers_updated"]:
            break
    assert m["answers_updated"] > 0 and m["nonfinite"] is True
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# Evaluation ---------------------------------------------------------------------------------------
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


# The tiny model end to end ------------------------------------------------------------------------
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
