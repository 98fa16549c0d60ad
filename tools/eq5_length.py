"""
Does Eq. (5) favour short answers? The diversity advantage of a solve-none group scores each
answer by its mean f(D) over its first L_i = min(|o_i|, |o_r|) tokens (note 5 of scgrpo.py's
docstring). This samples batches of training questions (in file order) from the untrained
model, on the CPU in fp32, routes and scores them with scgrpo.py's own functions as a training
step does (self_condition), and relates each solve-none answer's advantage alpha * A_div to its
length |o_i| (tokens, EOS included).

    python tools/eq5_length.py                          # SmolLM2-135M on addition, 16 batches: ~7 min
    python tools/eq5_length.py --batches 16 --out docs/ablation/eq5_length.json   # what docs/ holds

It prints the correlation of advantage and length, and the mean length of the answers that
Eq. (5) pushes up (advantage > 0) against those it pushes down; --out keeps every pair as JSON.
"""
import argparse
import json
import os
import random
import statistics
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import machinery  # noqa: E402
from machinery import cli, models, tasks  # noqa: E402
import scgrpo as S  # noqa: E402


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
    if args.batches * B > len(train_rows):
        machinery.die(f"--batches {args.batches} needs {args.batches * B} training questions; {cfg.task} has "
              f"{len(train_rows)}: use --batches {len(train_rows) // B} or fewer")
    for k in tqdm(range(args.batches), desc="batches"):
        ro = S.rollout(model, tok, cfg, train_rows[k * B:(k + 1) * B], gen, eos)
        routes = S.route_groups(ro.reward, "scgrpo")
        batch = S.make_batch(ro, routes, S.group_advantages(ro.reward), rng)
        if not bool((batch.ref >= 0).any()):
            continue
        S.self_condition(model, tok, cfg, ro, batch)
        none_groups += routes.count("solve_none")
        lengths = ro.lengths.view(-1)
        pairs += [(float(batch.adv[m]), int(lengths[batch.row[m]])) for m, route in enumerate(batch.route)
                  if route == "solve_none"]
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
               n_up=len(up), n_down=len(down))
    print(json.dumps(res, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({**res, "pairs": pairs}, f)


if __name__ == "__main__":
    main()
