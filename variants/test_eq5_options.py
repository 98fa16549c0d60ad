"""variants/eq5_options.py: with no flag it is scgrpo.py; each option by hand; its flags' checks."""
import dataclasses
import functools
import random

import pytest
import torch

from machinery import models
from machinery import tasks
from variants import eq5_options
import scgrpo as S
from conftest import bad_input_test
from test_scgrpo import REF_G, REF_MAX_NEW, REF_T, REF_TABLE, draw_references, fixed_rollout, project_step

STEP = functools.partial(S.train_step, credit=eq5_options.eq5_credit)  # as its main() runs it


@pytest.mark.parametrize("policy", ["step", "skip"])
def test_a_step_whose_only_gradient_is_eq5_is_skipped_only_when_asked(policy, monkeypatch):
    """variants/eq5_options.py --eq5-only-step skip: a step whose every group is solve-none applies
    no update (weights and AdamW's state untouched, not counted as non-finite); a step with a
    reward-carrying group still updates. step (the paper's, scgrpo.py's): the Eq. (5)-only step
    updates, grad_norm_none = grad_norm."""
    model, tok = models.make_tiny(0)
    cfg = eq5_options.Config(algo="scgrpo", group_size=REF_G, prompts_per_step=len(REF_TABLE), micro_batch=3,
                             max_new_tokens=REF_MAX_NEW, temperature=REF_T, eq5_only_step=policy)
    step = STEP if policy == "skip" else S.train_step
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
                    torch.Generator().manual_seed(0), [0], 1)
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert m["eq5_only"] is all_wrong and m["nonfinite"] is False
        if all_wrong and policy == "skip":
            assert not moved and m["answers_updated"] == 0 and opt.state == {}
        else:
            assert moved and m["answers_updated"] > 0
        if all_wrong and policy == "step":
            assert m["groups_none"] == len(REF_TABLE) and m["grad_norm_none"] == pytest.approx(m["grad_norm"], rel=1e-6)


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
        if int(batch.ref_row[0]) == 0:
            break
    adv = S.solve_none_advantages(batch, eq5_options.unlike_scores(ro, batch), alpha=0.1)
    s = torch.tensor([0.0, 0.5, 1.0])  # answers 1 (a copy), 2 (half), 3 (nothing shared)
    torch.testing.assert_close(adv, 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6))
    no_weight = dataclasses.replace(batch, weights=torch.zeros(3, 4))  # f(D) = 0: the paper's s_i all 0
    assert S.solve_none_advantages(batch, S.window_means(no_weight), alpha=0.1).abs().max() == 0


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
        batch = dataclasses.replace(batch, active=eq5_options.group_window(ro, batch))
    r = int(batch.ref_row[0])  # o_r, every member's reference
    members = [i for i in range(G) if i != r]
    assert batch.row.tolist() == members
    want_n = [2] * 3 if window == "group" else [min(lengths[i], lengths[r]) for i in members]
    assert batch.active.sum(1).tolist() == want_n and not (batch.active & ~ro.mask[batch.row]).any()
    f = torch.tensor([[0.1, 0.5, 0.3, 0.2, 0.4]] * G)[members] * torch.tensor([[1.0], [2.0], [3.0]])
    f = torch.where(batch.active, f, torch.zeros_like(f))  # 0 past each window
    adv = S.solve_none_advantages(batch, S.window_means(dataclasses.replace(batch, weights=f)), alpha=0.1)
    s = torch.tensor([float(f[k, :n].sum()) / n for k, n in enumerate(want_n)])
    torch.testing.assert_close(adv, 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6))


def test_eq5_options_with_no_flag_are_scgrpo_py(monkeypatch):
    """variants/eq5_options.py's credit with its options off is scgrpo.py's: on REF_TABLE (a
    partial, a solve-none, a fallback and a skipped group) the same Batch reaches the update, and the
    same metrics and gradients come out."""
    got = {name: project_step("scgrpo", monkeypatch, lr=0.03, epochs=1, **variant)
           for name, variant in (("scgrpo", {}), ("eq5_options", dict(Config=eq5_options.Config, step=STEP)))}
    (_, batch_a, m_a, g_a), (_, batch_b, m_b, g_b) = got["scgrpo"], got["eq5_options"]
    for f in dataclasses.fields(batch_a):
        a, b = getattr(batch_a, f.name), getattr(batch_b, f.name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f.name
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith("t_")}  # noqa: E731
    assert drop(m_a) == drop(m_b) and m_a["groups_none"] == 1
    assert all(torch.equal(a, b) for a, b in zip(g_a[0], g_b[0]))


# The options' own flags are checked by the same rules as scgrpo.py's (choices).
test_bad_input_exits_2_with_one_line_and_writes_nothing = bad_input_test(eq5_options.main, [
    (["--eq5-score", "copy"], "--eq5-score: invalid choice: 'copy'"),
    (["--eq5-window", "all"], "--eq5-window: invalid choice: 'all'"),
    (["--eq5-only-step", "never"], "--eq5-only-step: invalid choice: 'never'"),
])
