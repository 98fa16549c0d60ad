"""variants/dapo.py: its update against the plain reference step, its dynamic sampling and filter,
its overlong penalty and token-level loss by hand, its flags' checks, its run."""
import pytest
import torch

from machinery import tasks
from variants import dapo
import scgrpo as S
from conftest import bad_input_test, check_step_lines, run_ok
from test_scgrpo import check_against_reference, loss_inputs

DAPO = dict(Config=dapo.Config, step=dapo.dapo_step, max_rounds=1, eps_high=0.28, token_level=True)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_update_equals_the_plain_reference_step(fast, monkeypatch):
    """DAPO's step on REF_TABLE against the plain reference: GRPO's credit on the groups of unequal
    rewards, the token-level loss, clip-higher at 0.28, both paths."""
    check_against_reference("dapo", monkeypatch, fast=fast, **DAPO)


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


def test_overlong_penalty_hand_computed():
    got = dapo.overlong_penalty(torch.tensor([10, 12, 13, 14, 16]), max_len=16, buffer=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))


def test_dapo_token_level_loss_is_independent_of_micro_batch_split(monkeypatch):
    logp, old, adv, lengths, mask = loss_inputs(seed=5, B=7)
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
    for micro_batch in (1, 4, 20):  # variants/dapo.py's own scale and clip-higher, split any way
        check_against_reference("dapo", monkeypatch, micro_batch, **DAPO)


def test_tiny_dapo_run_completes(tmp_path):
    train, _ = run_ok(str(tmp_path / "run"), "--steps", "30", "--eval-every", "30", "--eval-k", "0",
                      "--eval-n", "10", program="variants/dapo.py")
    assert len(train) == 30 and all(1 <= x["sample_rounds"] <= 3 for x in train)
    check_step_lines(train, "dapo", 16, 16)


# DAPO's own flags are checked by the same rules as scgrpo.py's (its Config's rule).
test_bad_input_exits_2_with_one_line_and_writes_nothing = bad_input_test(dapo.main, [
    (["--max-rounds", "0"], "--max-rounds 0 is out of range: it must be at least 1"),
    (["--epsilon-high", "-0.1"], "--epsilon-high -0.1 is out of range: it must be > 0"),
    (["--overlong-buffer", "-2"], "--overlong-buffer -2 is out of range: it must be -1, or 0 to"),
    (["--overlong-buffer", "2"], "--overlong-buffer 2 is out of range"),  # the tiny cap is 2
    (["--algo", "scgrpo"], "--algo: invalid choice: 'scgrpo'"),
    (["--lr", "0"], "--lr 0.0 is out of range: it must be > 0"),  # scgrpo.py's checks too
])
