"""
Does Eq. (5) favour short answers? The diversity advantage of a solve-none group scores each
answer by its mean f(D) over its first L_i = min(|o_i|, |o_r|) tokens (scgrpo.make_batch). This
samples batches of training questions (in file order) from the untrained model, on the CPU in
fp32, routes and scores them with scgrpo.py's own functions as a training step does (sc_credit:
D, f(D), Eq. 5), and relates each solve-none answer's advantage alpha * A_div to its length |o_i|
(tokens, EOS included).

    python tools/eq5_length.py                          # SmolLM2-135M on addition, 16 batches: ~7 min
    python tools/eq5_length.py --batches 16 --out docs/ablation/eq5_length.json   # what docs/ holds

It prints the correlation of advantage and length, and the mean length of the answers that
Eq. (5) pushes up (advantage > 0) against those it pushes down; --out keeps every pair as JSON.

On the same answers and the same f(D) (c from the step, as training has it) it also computes
Eq. (5) under variants of the paper's window, to see which one removes the length correlation:
    paper           s_i = mean f(D) over t <= L_i = min(|o_i|, |o_r|)
    group_window    s_i = mean f(D) over t <= the group's shortest answer (o_r included)
    no_first_eos    the paper's window without the first position and without o_i's EOS
    no_std          the paper's s_i, A = alpha (s_i - mean s) with no division by the std
Each reports the pooled Pearson correlation of advantage and length, and the within-group one
(both centred on their group's mean first); and the mean f(D) per answer position and at EOS.
"""
import argparse
import dataclasses
import json
import os
import random
import statistics
import sys

import torch
from tqdm import tqdm

VARIANTS = ("paper", "group_window", "no_first_eos", "no_std")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import machinery  # noqa: E402
from machinery import cli, models, tasks  # noqa: E402
import scgrpo as S  # noqa: E402


def routed_batch(ro, rng):
    """The routes and Batch of a rollout as scgrpo.train_step makes them (references drawn from rng)."""
    group_routes = S.route_groups(ro.correct)
    refs = [S.pick_references(c, r, rng) for c, r in zip(ro.correct.bool().tolist(), group_routes)]
    return group_routes, S.make_batch(ro, group_routes, S.group_advantages(ro.correct), refs)


def teacher_and_eq5(model, tok, cfg, ro, batch):
    """D, f(D) and Eq. (5) on a Batch, as scgrpo.train_step computes them. -> (Batch, the teacher's metrics)"""
    return S.sc_credit(model, cfg, ro, dataclasses.replace(batch, teacher_prompt=S.teacher_prompts(tok, ro, batch)))


def ranks(xs):
    """Ranks 0..n-1, ties sharing their mean rank (for Spearman's correlation)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def variant_advantages(w, lengths, variant, alpha=0.1, eps=1e-6):
    """Eq. (5) of one solve-none group under a variant. w (n, L): f(D) of the n answers other
    than o_r, zero past each one's L_i; lengths (n + 1,): theirs, then o_r's last. -> (n,)"""
    n, own, ref = w.shape[0], lengths[:-1], lengths[-1]
    window = torch.minimum(own, ref)                                               # L_i (n,)
    t = torch.arange(w.shape[1])[None, :]                                          # (1, L)
    if variant == "group_window":
        keep = t < int(lengths.min())
    elif variant == "no_first_eos":
        eos_inside = (own <= ref)[:, None] & (t == own[:, None] - 1)   # o_i's EOS in its window
        keep = (t >= 1) & (t < window[:, None]) & ~eos_inside
    else:
        keep = t < window[:, None]
    keep = keep.expand(n, -1)
    s = (w * keep).sum(1) / keep.sum(1).clamp_min(1)                               # (n,)
    if variant == "no_std":
        return alpha * (s - s.mean())
    return alpha * (s - s.mean()) / (s.std(unbiased=False) + eps)


def centred_correlation(groups):
    """Pearson correlation of (advantage, length) pairs after subtracting each group's means."""
    xs, ys = [], []
    for pairs in groups:
        ma, ml = statistics.mean(a for a, _ in pairs), statistics.mean(n for _, n in pairs)
        xs += [a - ma for a, _ in pairs]
        ys += [n - ml for _, n in pairs]
    return statistics.correlation(xs, ys) if len(set(xs)) > 1 and len(set(ys)) > 1 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M")
    ap.add_argument("--task", default="addition")
    ap.add_argument("--batches", type=int, default=16, help="training batches of the preset's size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the (advantage, length) pairs to this JSON file")
    args = ap.parse_args()
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--model", args.model, "--task", args.task, "--seed", str(args.seed)])
    torch.manual_seed(cfg.seed)
    model, tok = models.load_model(cfg.model, cfg.seed)
    model.eval()
    train_rows, eos = tasks.load_task(cfg)[0], models.stop_ids(model, tok)
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    B, pairs, none_groups = cfg.prompts_per_step, [], 0
    by_variant, position_f, eos_f = {v: [] for v in VARIANTS}, {}, []  # per group: its pairs
    if args.batches * B > len(train_rows):
        machinery.die(f"--batches {args.batches} needs {args.batches * B} training questions; {cfg.task} has "
              f"{len(train_rows)}: use --batches {len(train_rows) // B} or fewer")
    for k in tqdm(range(args.batches), desc="batches"):
        ro = S.sample_groups(model, tok, cfg, train_rows[k * B:(k + 1) * B], cfg.group_size, cfg.temperature,
                             gen, eos)
        group_routes, batch = routed_batch(ro, rng)
        if not bool((batch.ref_row >= 0).any()):
            continue
        batch, _ = teacher_and_eq5(model, tok, cfg, ro, batch)
        none_groups += group_routes.count("solve_none")
        lengths = ro.lengths.view(-1)
        pairs += [(float(batch.adv[m]), int(lengths[batch.row[m]])) for m, route in enumerate(batch.route)
                  if route == "solve_none"]
        G = cfg.group_size
        for b in sorted({int(batch.row[m]) // G for m, route in enumerate(batch.route) if route == "solve_none"}):
            members = [m for m in range(len(batch.route)) if int(batch.row[m]) // G == b]
            r = int(batch.ref_row[members[0]])  # o_r's row, every member's reference
            lens = torch.tensor([int(lengths[batch.row[m]]) for m in members] + [int(lengths[r])])
            w = batch.weights[members].cpu()
            for t in range(w.shape[1]):  # f(D) per position, and at EOS where it lies in the window
                inside = [i for i in range(len(members)) if t < min(int(lens[i]), int(lens[-1]))]
                position_f[t] = position_f.get(t, []) + [float(w[i, t]) for i in inside]
            eos_f.extend(float(w[i, lens[i] - 1]) for i in range(len(members)) if lens[i] <= lens[-1])
            for v in VARIANTS:
                adv_v = variant_advantages(w, lens, v, cfg.alpha_div)
                by_variant[v].append([(float(a), int(n)) for a, n in zip(adv_v, lens[:-1])])
    if len(pairs) < 2 or len({a for a, _ in pairs}) < 2:
        machinery.die(f"only {len(pairs)} solve-none answers with distinct advantages in {args.batches} batches; "
              "use more --batches")
    adv, length = [a for a, _ in pairs], [n for _, n in pairs]
    up = [n for a, n in pairs if a > 0]
    down = [n for a, n in pairs if a < 0]
    res = dict(model=cfg.model, task=cfg.task, seed=cfg.seed, batches=args.batches, none_groups=none_groups,
               answers=len(pairs), pearson=statistics.correlation(adv, length),
               spearman=statistics.correlation(ranks(adv), ranks(length)),
               mean_len_pushed_up=statistics.mean(up) if up else None,
               mean_len_pushed_down=statistics.mean(down) if down else None,
               n_up=len(up), n_down=len(down),
               variants={v: dict(pearson=statistics.correlation(*zip(*[p for g in gs for p in g]))
                                 if len({a for g in gs for a, _ in g}) > 1 else None,
                                 within_group=centred_correlation(gs))
                         for v, gs in by_variant.items()},
               mean_f_by_position={t: statistics.mean(f) for t, f in sorted(position_f.items()) if f},
               answers_by_position={t: len(f) for t, f in sorted(position_f.items()) if f},
               mean_f_at_eos=statistics.mean(eos_f) if eos_f else None, eos_in_window=len(eos_f))
    print(json.dumps(res, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({**res, "pairs": pairs, "variant_pairs": by_variant}, f)


if __name__ == "__main__":
    main()
