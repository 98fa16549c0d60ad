"""
Speed and memory of one training step: our GRPO, our SC-GRPO, and TRL's GRPOTrainer, with the
same model, prompts, group size, answer length, temperature and reward.

    python ../shared/tools/make_offline_model.py --arch qwen-tiny --out /tmp/qwen-tiny
    python bench.py --model /tmp/qwen-tiny --data ../shared/data/gsm8k            # needs requirements-bench.txt
    python bench.py --model /tmp/qwen05 --data ../shared/data/gsm8k --prompts 1 --group 8 --max-new 128 --impls scgrpo

The models are random, so the GSM8K verifier would give every answer 0 and no update would run.
The benchmark therefore grades with a coin flip fixed by the answer's text (crc32 % 2) for all
implementations: groups hold both outcomes and every step really updates. Each implementation
runs in its own process (peak memory is per process): `--steps` timed steps after one warm-up.
Peak memory is the process's peak RSS on CPU, torch.cuda.max_memory_allocated on GPU.
"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import torch

import scgrpo as S


def coin_reward(completion, gold):
    return zlib.crc32(completion.encode("utf-8", "replace")) % 2 == 1


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_ours(args, algo):
    S.verify = coin_reward  # the same reward as TRL's below
    cfg = S.Config(model=args.model, task="gsm8k", data=args.data, algo=algo, prompts_per_step=args.prompts,
                   group_size=args.group, max_new_tokens=args.max_new, micro_batch=args.micro_batch,
                   grad_checkpoint=args.grad_checkpoint, lr=1e-6, seed=0, device=args.device)
    device = S.pick_device(cfg.device)
    train_rows, _ = S.load_task(cfg)
    model, tok = S.load_model(cfg.model, cfg.seed)
    model.to(device).eval()
    if cfg.grad_checkpoint:
        model.activation_checkpointing_enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    batcher, rng, gen = S.Batcher(len(train_rows), 0), random.Random(0), torch.Generator(device).manual_seed(0)
    rows = []
    for step in range(args.steps + 1):
        t0 = time.time()
        m, _ = S.train_step(model, opt, tok, cfg, train_rows, batcher, rng, gen, S.stop_ids(model, tok))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:  # step 0 is the warm-up
            rows.append(dict(total=time.time() - t0, generate=m["t_sample"], teacher=m["t_teacher"],
                             update=m["t_update"], reward=m["reward_mean"], updated=m["answers_updated"]))
    med = {k: statistics.median(r[k] for r in rows) for k in ("total", "generate", "teacher", "update")}
    return dict(impl=algo, **med, reward=statistics.mean(r["reward"] for r in rows),
                updated=min(r["updated"] for r in rows), peak_gib=peak_memory_gib(device))


def run_trl(args):
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    train_rows, _ = S.load_task(S.Config(task="gsm8k", data=args.data))
    prompts = [[{"role": "system", "content": S.SYSTEM_PROMPT}, {"role": "user", "content": r["question"]}]
               for r in train_rows[:args.prompts * (args.steps + 2)]]
    rewards_seen = []

    def reward_fn(completions, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [float(coin_reward(t, "")) for t in texts]
        rewards_seen.extend(out)
        return out

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.time())

    device = S.pick_device(args.device)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.micro_batch, num_generations=args.group,
        gradient_accumulation_steps=args.prompts * args.group // args.micro_batch,
        gradient_checkpointing=args.grad_checkpoint, max_completion_length=args.max_new, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, loss_type="grpo", learning_rate=1e-6, max_steps=args.steps + 1, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=device.type == "cpu", bf16=device.type == "cuda",
        chat_template_kwargs={"enable_thinking": False}, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=args.model, reward_funcs=[reward_fn], args=config,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=AutoTokenizer.from_pretrained(args.model), callbacks=[Clock()])
    t0 = time.time()
    trainer.train()
    steps = [b - a for a, b in zip([t0] + stamps, stamps)][1:]  # drop the warm-up step
    return dict(impl="trl", total=statistics.median(steps), generate=None, teacher=None, update=None,
                reward=statistics.mean(rewards_seen), updated=None, peak_gib=peak_memory_gib(device))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local model folder (e.g. from make_offline_model.py)")
    ap.add_argument("--data", required=True, help="folder with train.jsonl/test.jsonl (GSM8K schema)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="answers per prompt (G)")
    ap.add_argument("--max-new", type=int, default=32, help="answer length cap")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--micro-batch", type=int, default=64, help="answers per forward/backward (divides prompts x group)")
    ap.add_argument("--grad-checkpoint", action="store_true", help="recompute layers in backward (both implementations)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--impls", nargs="+", default=["grpo", "scgrpo", "trl"], help="what to run")
    ap.add_argument("--only", default="", help=argparse.SUPPRESS)  # internal: run one impl, print JSON
    args = ap.parse_args()
    if args.only:
        print("RESULT " + json.dumps(run_trl(args) if args.only == "trl" else run_ours(args, args.only)))
        return
    results = {}
    for impl in args.impls:
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--only", impl]
        r = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            sys.exit(f"error: {impl} failed:\n{r.stderr[-3000:]}")
        results[impl] = json.loads(line[0][len("RESULT "):])
        print(f"{impl}: {results[impl]}", file=sys.stderr)
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"\n{args.prompts} prompts x {args.group} answers x {args.max_new} new tokens, micro-batch {args.micro_batch}, "
          f"grad checkpoint {args.grad_checkpoint}, model {args.model}\n")
    print("| impl | s/step (median) | generate | teacher + KL | update | peak GiB | reward mean |")
    print("|---|---|---|---|---|---|---|")
    for r in results.values():
        print(f"| {r['impl']} | {fmt(r['total'])} | {fmt(r['generate'])} | {fmt(r['teacher'])} | {fmt(r['update'])} "
              f"| {r['peak_gib']:.2f} | {r['reward']:.2f} |")
    if "grpo" in results and "trl" in results:
        print(f"\nours/TRL (GRPO step): {results['grpo']['total'] / results['trl']['total']:.3f}")
    if "grpo" in results and "scgrpo" in results:
        print(f"SC-GRPO/GRPO step: {results['scgrpo']['total'] / results['grpo']['total']:.3f}")


if __name__ == "__main__":
    main()
