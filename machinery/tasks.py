"""
Tasks: the questions and their gold answers, in GSM8K's schema ({'question', 'answer'}, the
answer ending in '#### N'). Two offline tasks built in code (arith for the tiny model, addition
for SmolLM2), GSM8K-schema files (--data), GSM8K itself from the hub, and the order in which a
run draws its training questions.
"""
import json
import os
import random
import re
import socket

import torch

from machinery import die
from machinery.models import gguf_path

def make_arith():
    """Single-digit addition: question 'a+b=', answer a + b in 0..18 (one or two tokens).
    The whole space is 100 questions; the test split holds out 20 of them."""
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"}
            for a in range(10) for b in range(10)]
    random.Random(1234).shuffle(rows)  # a fixed split, whatever --seed is
    return rows[20:], rows[:20]


ADDITION_PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]  # 8,100 ordered pairs


def addition_rows(pairs):
    """Sums (a, b) -> rows in GSM8K's schema, asked 'What is a + b?'."""
    return [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in pairs]


def make_addition():
    """Two-digit sums in words, 'What is 47 + 38?' (a, b in 10..99), in GSM8K's schema: a task
    the real SmolLM2-135M-Instruct can learn (greedy accuracy 10% before training). 2,200
    distinct questions in a fixed order: the first 200 are held out for evaluation."""
    rows = addition_rows(random.Random(1234).sample(ADDITION_PAIRS, 2200))
    return rows[200:], rows[:200]


def make_addition_confirm(n=1000):
    """The confirmatory study's held-out set (docs/confirm/PLAN.md): n more sums in the training
    wording, drawn by a fixed shuffle (seed 2606) from the 5,900 pairs that make_addition never
    uses, so disjoint from its training and test questions."""
    used = set(random.Random(1234).sample(ADDITION_PAIRS, 2200))
    unused = [p for p in ADDITION_PAIRS if p not in used]                          # 5,900
    return addition_rows(random.Random(2606).sample(unused, n))


# The verifier's readers: scgrpo.extract_answer finds an answer's number with these
NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")  # no nested quantifiers: linear time


def normalize_number(s):
    """The first number in s: '$1,234.00' -> '1234', '-3.50%' -> '-3.5'; None if there is none."""
    m = NUMBER.search(s.replace("$", ""))
    if m is None:
        return None
    num = m.group(0).replace(",", "")
    num = num.rstrip("0").rstrip(".") if "." in num else num
    return "0" if num in ("-0", "") else num


def last_boxed(text):
    """Content of the last \\boxed{...}, with nested braces; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


TASKS = {"arith": make_arith, "addition": make_addition}  # offline; gsm8k comes from the hub


def read_jsonl(path):
    """Rows of a GSM8K-schema file; a bad line names its file and line number."""
    if not os.path.isfile(path):
        die(f"data file {path} not found; --data needs a folder with train.jsonl and test.jsonl")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                die(f"{path} line {n} is not valid JSON; each line must be one object")
            if row is None:
                continue
            if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                    and isinstance(row.get("answer"), str)):
                die(f"{path} line {n} lacks a string 'question' and 'answer'")
            # a digit after the last '####': exactly when scgrpo.verify can read a gold number
            if "####" not in row["answer"] or not re.search("[0-9]",
                                                            row["answer"].rsplit("####", 1)[-1]):
                die(f"{path} line {n}: the answer does not end in '#### N' (GSM8K schema)")
            rows.append(row)
    if not rows:
        die(f"{path} holds no rows")
    return rows


def go_offline_unless_hub_reachable(cfg):
    """Without network, huggingface_hub retries for about a minute before failing. If the hub
    is needed and cannot be reached in 3 s, use the local cache only, so a missing model or
    dataset fails at once with our one-line message (a cached one still loads)."""
    local_model = cfg.model == "tiny" or os.path.isdir(cfg.model) or gguf_path(cfg.model)
    needs_hub = not local_model or (cfg.task == "gsm8k" and not cfg.data)
    if needs_hub and not os.environ.get("HF_HUB_OFFLINE"):
        url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        host = url.split("://")[-1].split("/")[0].split(":")[0]
        try:
            socket.create_connection((host, 443), timeout=3).close()
        except OSError:
            os.environ["HF_HUB_OFFLINE"] = "1"


def load_task(cfg):
    """-> (train_rows, test_rows), each row {'question', 'answer'}."""
    if cfg.data:
        if not os.path.isdir(cfg.data):
            die(f"--data folder {cfg.data} not found; pass a folder with train.jsonl and "
                "test.jsonl")
        return tuple(read_jsonl(os.path.join(cfg.data, f"{s}.jsonl")) for s in ("train", "test"))
    if cfg.task in TASKS:
        return TASKS[cfg.task]()
    try:
        import datasets
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as e:
        die(f"could not load openai/gsm8k from the hub ({type(e).__name__}); offline, pass "
            "--data FOLDER with train.jsonl/test.jsonl, or use --task arith")
    return [dict(r) for r in ds["train"]], [dict(r) for r in ds["test"]]


class Batcher:
    """Walks the training rows in a seeded random order, epoch after epoch. (epoch, pos) is
    its whole state, so a resumed run draws exactly the questions it would have drawn."""

    def __init__(self, rows, seed, epoch=0, pos=0):
        self.rows, self.seed, self.epoch, self.pos = rows, seed, epoch, pos

    def take(self, k):
        """The next k rows (task dicts) of the order."""
        n, out = len(self.rows), []
        while len(out) < k:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            got = torch.randperm(n, generator=g)[self.pos:self.pos + k - len(out)].tolist()
            out, self.pos = out + got, self.pos + len(got)
            if self.pos >= n:
                self.epoch, self.pos = self.epoch + 1, 0
        return [self.rows[i] for i in out]
