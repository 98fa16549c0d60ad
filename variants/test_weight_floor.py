"""variants/weight_floor.py against scgrpo.py's own credit on the same step, by hand."""
import functools

import torch

import scgrpo as S
from test_scgrpo import project_step
from variants import weight_floor as wf


def test_the_floor_goes_on_after_eq5_on_the_scored_tokens(monkeypatch):
    """On REF_TABLE (every route), w = 0.25 + 0.75 f(D) on each scored row's active tokens, 0
    elsewhere; rows with no teacher keep weight 1; Eq. (5)'s advantages are SC-GRPO's."""
    step = functools.partial(S.train_step, credit=wf.floored_credit)
    _, got, _, _ = project_step("weight-floor", monkeypatch, lr=0.0, Config=wf.Config, step=step,
                                weight_floor=0.25)
    _, sc, _, _ = project_step("scgrpo", monkeypatch, lr=0.0)
    rows, rest = sc.scored, [m for m in range(len(sc.route)) if m not in sc.scored.tolist()]
    want = (0.25 + 0.75 * sc.weights[rows]) * sc.active[rows]
    torch.testing.assert_close(got.weights[rows], want)
    assert torch.equal(got.weights[rest], sc.weights[rest]) and torch.equal(got.adv, sc.adv)
