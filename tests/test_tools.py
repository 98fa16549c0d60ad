"""The studies' and benchmarks' tools (tools/): bench.py, compare.py, power.py, plot.py and the
Eq. (5) studies, against hand-computed cases and their own runs."""
import importlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

import machinery
from machinery import cli
from machinery import tasks
import scgrpo as S
from conftest import HERE, ONE_THREAD, SUBPROCESS_TIMEOUT, needs, read_metrics, run, run_ok, train_lines


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
    ro = S.Rollout([{}, {}], [[1], [1]], ids, mask, [""] * 6, torch.zeros(2, 3))
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
    configs = {"scgrpo.py": S.Config, **{f"variants/{name}.py": importlib.import_module(f"variants.{name}").Config
                                         for name in ("dapo", "distill", "eq5_options", "opsd", "rlsd")}}
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
