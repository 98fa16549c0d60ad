"""
Where one SC-GRPO step of the fast path spends its time, by operator: torch.profiler over the
three phases of a step (sampling, the teacher, the update) on one batch of the SmolLM2 preset's
shape, after one untimed warm-up of each. For each phase: its wall time, the share of the matrix
products (aten::mm and the attention kernels) and the operators that take the most time; for
the update, how many of its (answer, position) cells are padding. With --kv-cat, the sampling
phase is also profiled with transformers' DynamicLayer (torch.cat at every step) in place of
speed.Preallocated.

    python tools/profile_step.py        # writes docs/bench/<date>_<machine>_<commit>_profile_...txt too
"""
import argparse
import dataclasses
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machinery import at_least, bench_output, machine, models, runs, speed, tasks  # noqa: E402
import scgrpo as S  # noqa: E402
from bench import partial_batch  # noqa: E402  (every group 'partial', references from seed 0)

MATMUL = ("aten::mm", "aten::bmm", "aten::addmm")


def profiled(name, fn, lines):
    """fn() once untimed, then once under the profiler: its wall time and top operators."""
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.time()
        out = fn()
        wall = time.time() - t0
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    mm = sum(e.self_cpu_time_total for e in ops if e.key in MATMUL or "attention" in e.key) / 1e6
    lines.append(f"\n## {name}: {wall:.2f} s wall, {total:.2f} s of operators, matrix products "
                 f"and attention {mm:.2f} s ({mm / total:.0%})\n")
    lines.append(ops.table(sort_by="self_cpu_time_total", row_limit=12))
    print(lines[-2].strip(), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--prompts-per-step", type=at_least(1), default=4)
    ap.add_argument("--group-size", type=at_least(2), default=8)
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64)
    ap.add_argument("--micro-batch", type=at_least(1), default=16)
    ap.add_argument("--kv-cat", action="store_true", help="also profile sampling with torch.cat")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: as a --dtype bf16 run (the bf16 weight copy, autocast in the update)")
    ap.add_argument("--out", default="", help="write the report here as well; default docs/bench/<date>_"
                    "<machine>_<commit>_profile_<model>_<dtype>_<N>q.txt; '-': print only")
    args = ap.parse_args()
    model, tok = models.load_model(args.model, 0)
    runs.set_up_passes(model, next(model.parameters()).device, args.dtype == "bf16", fast=True)
    cfg = S.Config(model=args.model, fast=True, algo="scgrpo", group_size=args.group_size,
                   max_new_tokens=args.max_new_tokens, temperature=0.8,
                   micro_batch=args.micro_batch)
    problems = tasks.TASKS["addition"]()[0][:args.prompts_per_step]
    eos = models.stop_ids(model.eval(), tok)
    lines = [f"# profile of one step, {args.model}, {len(problems)} x {cfg.group_size} answers, "
             f"{cfg.max_new_tokens}-token cap, micro-batch {cfg.micro_batch}, {args.dtype} fast path\n",
             f"{machine().strip()}, {torch.get_num_threads()} thread(s)"]
    sample = lambda: S.sample_groups(model, tok, cfg, problems, cfg.group_size, cfg.temperature,  # noqa: E731
                                     torch.Generator().manual_seed(0), eos)
    ro = profiled("sampling (speed.Preallocated KV cache)", sample, lines)
    if args.kv_cat:
        real = speed.preallocated
        speed.preallocated = lambda layer, n, room: (layer.batch_repeat_interleave(n), layer)[1]
        profiled("sampling (transformers' DynamicLayer, torch.cat)", sample, lines)
        speed.preallocated = real
    G = cfg.group_size  # three answers of each group taken as correct: every group has a teacher
    ro.correct = torch.tensor([[1.0] * 3 + [0.0] * (G - 3)] * len(problems))
    batch = partial_batch(ro)
    batch = dataclasses.replace(batch, teacher_prompt=S.teacher_prompts(tok, ro, batch))
    batch = profiled("teacher", lambda: S.sc_credit(model, cfg, ro, batch), lines)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: every pass sees one model
    order, slices, _ = S.micro_batches(batch, ro, cfg.micro_batch)
    rows = batch.row[torch.tensor(order)]
    cells = sum((sl.stop - sl.start) * int(ro.lengths.view(-1)[rows[sl]].max()) for sl in slices)
    tokens = int(ro.lengths.view(-1)[rows].sum())
    profiled("update", lambda: S.update(model, optimizer, cfg, ro, batch), lines)
    lines.append(f"\nupdate: {tokens} answer tokens in {cells} (answer, position) cells of its "
                 f"{len(slices)} micro-batches: {1 - tokens / cells:.1%} padding")
    print(lines[-1].strip())
    if args.out != "-":
        model = "".join(c if c.isalnum() else "_" for c in args.model.lower().replace("-135m", "")).strip("_")
        out = args.out or bench_output(f"profile_{model}_{args.dtype}_{args.prompts_per_step}q", "txt")
        with open(out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
