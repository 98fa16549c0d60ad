"""
What does Eq. (5) reward? In a solve-none group the teacher holds one of the group's own wrong
answers, o_r, and every other answer o_i gets s_i = mean f(D_it) over its first L_i =
min(|o_i|, |o_r|) tokens, D = KL(teacher || student); Eq. (5) pushes up the answers with the
highest s_i. The paper reads a high s_i as "unlike o_r". But a teacher that holds o_r can copy
it: where o_i repeats o_r the teacher may be far surer than the student, so D, and s_i, may be
highest for near-copies. This tool measures which way s_i points, on real answers.

It samples training batches at the study's config (8 questions x 8 answers a step, the SmolLM2
preset's length and temperature), routes and scores them with scgrpo.py's own functions as a
training step does (sc_credit: c is the step's P75), and for each solve-none answer relates
s_i to how much o_i resembles o_r:

    lcp        the share of o_i's window (its first L_i tokens) that is a common prefix with o_r
    edit       1 - (token edit distance of the two windows) / L_i: 1 = the same first L_i tokens
    ngram      the share of the 3-grams of o_i's window that occur anywhere in o_r
    length     |o_i| in tokens, EOS included

as Spearman correlations, pooled over all answers and within groups (the mean of each group's
own correlation), each with a 95% bootstrap interval over groups. Three controls are scored
against the same o_r with the step's c, each placed among its group's real answers (the share of
them whose s_i is below the control's):

    copy       o_i an exact copy of o_r
    half       o_r with its last half replaced by the last half of another answer of the group
    other      an answer the model sampled to another question of the step

    python tools/eq5_mechanism.py --batches 16 --out docs/eq5/base.json                  # the untrained model
    python tools/eq5_mechanism.py --model runs/<run>/final --batches 60 --out docs/eq5/trained.json
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machinery  # noqa: E402
from machinery import cli, models, tasks  # noqa: E402
from eq5_length import ranks, routed_batch, teacher_and_eq5  # noqa: E402
import scgrpo as S  # noqa: E402

MEASURES = ("lcp", "edit", "ngram", "length")
CONTROLS = ("copy", "half", "other")


def common_prefix(a, b):
    """Length of the longest common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def edit_distance(a, b):
    """Levenshtein distance between two token lists (insert, delete, substitute: cost 1 each)."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


def resemblance(o_i, o_r):
    """How much answer o_i (token ids) repeats the reference o_r, over o_i's window L_i."""
    L = min(len(o_i), len(o_r))
    grams = [tuple(o_i[t:t + 3]) for t in range(L - 2)]
    in_ref = {tuple(o_r[t:t + 3]) for t in range(len(o_r) - 2)}
    return dict(lcp=common_prefix(o_i, o_r) / L, edit=1 - edit_distance(o_i[:L], o_r[:L]) / L,
                ngram=sum(g in in_ref for g in grams) / len(grams) if grams else None,
                length=len(o_i))


def spearman(xs, ys):
    """Spearman's rank correlation (ties share their mean rank); None if either side is constant."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(ranks(xs), ranks(ys))


def pooled_and_within(groups, key):
    """(pooled Spearman of s and `key` over all answers, mean of the groups' own Spearman)."""
    pairs = [(a["s"], a[key]) for g in groups for a in g["answers"] if a[key] is not None]
    own = [spearman(*zip(*[(a["s"], a[key]) for a in g["answers"] if a[key] is not None]))
           for g in groups if sum(a[key] is not None for a in g["answers"]) >= 3]
    own = [x for x in own if x is not None]
    return (spearman(*zip(*pairs)) if len(pairs) >= 3 else None), (statistics.mean(own) if own else None)


def bootstrap(groups, statistic, n=2000, seed=0):
    """95% percentile interval of statistic(groups) with the groups resampled (None values dropped)."""
    rng = random.Random(seed)
    values = sorted(v for v in (statistic(rng.choices(groups, k=len(groups))) for _ in range(n)) if v is not None)
    return (values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]) if values else (None, None)


def control_answers(ro, b, r, G):
    """The three controls for solve-none group b with reference row r -> {name: token ids}."""
    ids = lambda row: ro.ids[row, :int(ro.mask[row].sum())].tolist()  # noqa: E731
    o_r, other_i = ids(r), next(b * G + i for i in range(G) if b * G + i != r)
    half = len(o_r) // 2
    donor = ids(other_i)
    other_b = (b + 1) % len(ro.problems)  # another question of the step, its first answer
    return dict(copy=o_r, half=o_r[:half] + donor[half:] if len(donor) > half else o_r[:half] + o_r[-1:],
                other=ids(other_b * G))


def score(model, cfg, ro, b, r, answers, c, tok):
    """s = mean f(D) over each answer's window min(|answer|, |o_r|), D against the teacher that
    holds o_r (scgrpo.teacher_kl, as training computes it), f with the step's c. answers: {name:
    token ids} -> {name: s}."""
    G, names = cfg.group_size, list(answers)
    L_r = int(ro.mask[r].sum())
    window = [min(len(answers[k]), L_r) for k in names]
    ids = torch.zeros(len(names), max(window), dtype=torch.long)
    mask = torch.zeros(len(names), max(window), dtype=torch.bool)
    for n, k in enumerate(names):
        ids[n, :window[n]], mask[n, :window[n]] = torch.tensor(answers[k][:window[n]]), True
    rows = torch.full((len(names),), b * G)  # the student prompt is question b's
    prompts = [S.encode_prompt(tok, ro.problems[b]["question"], ro.texts[r])]
    # no kept sampler states: these answers were not sampled, so the student side is a forward too
    d, _, _ = S.teacher_kl(model, cfg, dataclasses.replace(ro, fast_states=None), rows, prompts,
                           torch.zeros(len(names), dtype=torch.long), ids, mask)
    D = torch.zeros(mask.shape).masked_scatter(mask, d)
    f = (D / (D + c)) * mask
    return {k: float(f[n].sum()) / window[n] for n, k in enumerate(names)}


def summarise(groups):
    """The correlations with their intervals, and where each control falls among the real answers."""
    out = {"groups": len(groups), "answers": sum(len(g["answers"]) for g in groups), "correlations": {}}
    for key in MEASURES:
        pooled, within = pooled_and_within(groups, key)
        out["correlations"][key] = dict(
            pooled=pooled, pooled_ci=bootstrap(groups, lambda gs: pooled_and_within(gs, key)[0]),
            within=within, within_ci=bootstrap(groups, lambda gs: pooled_and_within(gs, key)[1]))
    out["controls"] = {}
    for name in CONTROLS:
        def place(gs):
            return statistics.mean(sum(a["s"] < g["controls"][name] for a in g["answers"]) / len(g["answers"])
                                   for g in gs)

        def lift(gs):
            return statistics.mean(g["controls"][name] - statistics.mean(a["s"] for a in g["answers"]) for g in gs)
        out["controls"][name] = dict(share_below=place(groups), share_below_ci=bootstrap(groups, place),
                                     s_minus_group_mean=lift(groups), s_minus_group_mean_ci=bootstrap(groups, lift),
                                     top_of_group=sum(g["controls"][name] > max(a["s"] for a in g["answers"])
                                                      for g in groups) / len(groups))
    out["mean_s"] = statistics.mean(a["s"] for g in groups for a in g["answers"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M", help="the untrained model, or a run's final/ folder")
    ap.add_argument("--task", default="addition", help="the study's task (tiny: arith)")
    ap.add_argument("--batches", type=int, default=16, help="training batches of --prompts-per-step questions")
    ap.add_argument("--prompts-per-step", type=int, default=8, help="questions a batch (the study's 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write every group's answers and controls to this JSON file")
    args = ap.parse_args()
    if args.batches < 1 or args.prompts_per_step < 2:
        machinery.die("--batches must be >= 1 and --prompts-per-step >= 2 (the 'other' control needs a second question)")
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--eval-only", "--model", args.model, "--task", args.task,
                                                    "--prompts-per-step", str(args.prompts_per_step),
                                                    "--seed", str(args.seed), "--dtype", "fp32",
                                                    "--out", os.path.join("runs", "eq5-mechanism-unused")])
    cfg = dataclasses.replace(cfg, algo="scgrpo", eval_only=False)
    torch.manual_seed(cfg.seed)
    if os.path.isdir(args.model):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(args.model)
    else:
        model, tok = models.load_model(cfg.model, cfg.seed)
    model.eval()
    model.autocast_dtype = None
    train_rows, eos = tasks.load_task(cfg)[0], models.stop_ids(model, tok)
    B, G = cfg.prompts_per_step, cfg.group_size
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    order = tasks.Batcher(train_rows, cfg.seed)
    groups, consistency = [], 0.0
    for k in tqdm(range(args.batches), desc="batches"):
        ro = S.sample_groups(model, tok, cfg, order.take(B), G, cfg.temperature, gen, eos)
        group_routes, batch = routed_batch(ro, rng)
        if "solve_none" not in group_routes:
            continue
        batch, stats = teacher_and_eq5(model, tok, cfg, ro, batch)
        c = stats["c"]
        for b in [b for b, route in enumerate(group_routes) if route == "solve_none"]:
            members = [m for m in range(len(batch.route)) if int(batch.row[m]) // G == b]
            r = int(batch.ref_row[members[0]])
            o_r = ro.ids[r, :int(ro.mask[r].sum())].tolist()
            answers = []
            for m in members:
                row = int(batch.row[m])
                o_i = ro.ids[row, :int(ro.mask[row].sum())].tolist()
                L_i = int(batch.active[m].sum())
                answers.append(dict(i=row % G, s=float(batch.weights[m, :L_i].sum()) / L_i, adv=float(batch.adv[m]),
                                    **resemblance(o_i, o_r), text=ro.texts[row]))
            # the same scoring outside the step must give the step's own s_i (a check of score())
            again = score(model, cfg, ro, b, r, {a["i"]: ro.ids[b * G + a["i"], :int(ro.mask[b * G + a["i"]].sum())]
                                                 .tolist() for a in answers}, c, tok)
            consistency = max(consistency, max(abs(again[a["i"]] - a["s"]) for a in answers))
            groups.append(dict(batch=k, group=b, question=ro.problems[b]["question"], r=r % G, ref_len=len(o_r),
                               reference=ro.texts[r], c=c, answers=answers,
                               controls=score(model, cfg, ro, b, r, control_answers(ro, b, r, G), c, tok)))
    if len(groups) < 3:
        machinery.die(f"only {len(groups)} solve-none groups in {args.batches} batches; use more --batches")
    res = dict(model=args.model, seed=cfg.seed, batches=args.batches, prompts_per_step=B, group_size=G,
               temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
               max_abs_difference_of_rescored_s=consistency, **summarise(groups))
    print(json.dumps(res, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({**res, "per_group": groups}, f, indent=1)


if __name__ == "__main__":
    main()
