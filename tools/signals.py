"""
One sampled answer, the per-token signal of each method beside the others (docs/variants.md):
SC-GRPO's weight f(D) (D against the teacher that holds a verified answer of the group), the
distillation loss's per-token forward KL against that same teacher (variants/distill.py: it is D
itself, unsquashed), RLSD's weight against the teacher that holds the gold solution
(variants/rlsd.py), and OPSD's per-token JSD against that gold teacher (variants/opsd.py). Each is
computed by the function its method trains with, on the same sampled batch.

    python tools/signals.py --out docs/signals_smollm2.html     # SmolLM2, its preset's first batch

It writes the page (machinery/credit.py), a JSON file of the values beside it, and prints which
answer it shows: the longest answer of the first partial group (the route where all four apply).
"""
import argparse
import dataclasses
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import scgrpo as S  # noqa: E402
from machinery import cli, credit, models, runs, tasks  # noqa: E402
from variants import distill, opsd, rlsd  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M", help="a model the SmolLM2 preset runs")
    ap.add_argument("--seed", type=int, default=100, help="the sampler's and references' seed")
    ap.add_argument("--out", required=True, help="the page to write (.html); the values go beside it (.json)")
    args = ap.parse_args()
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, ["--model", args.model, "--task", "addition", "--dtype",
                                                    "fp32", "--seed", str(args.seed), "--out", "/tmp/unused"])
    torch.manual_seed(cfg.seed)
    model, tok = models.load_model(cfg.model, cfg.seed)
    runs.set_up_passes(model.eval(), torch.device("cpu"), False, cfg.fast)
    eos, rng = models.stop_ids(model, tok), random.Random(cfg.seed)
    batcher, gen = tasks.Batcher(tasks.load_task(cfg)[0], cfg.seed), torch.Generator().manual_seed(cfg.seed)
    while True:  # batches of the preset's run until one has a partial group
        ro = S.sample_groups(model, tok, cfg, batcher.take(cfg.prompts_per_step), cfg.group_size,
                             cfg.temperature, gen, eos)
        group_routes = S.route_groups(ro.correct)
        if "partial" in group_routes:
            break
    refs = [S.pick_references(ok, r, rng) for ok, r in zip(ro.correct.bool().tolist(), group_routes)]
    batch = S.make_batch(ro, group_routes, S.group_advantages(ro.correct), refs)
    batch = dataclasses.replace(batch, teacher_prompt=S.teacher_prompts(tok, ro, batch))
    batch, stats = S.sc_credit(model, cfg, ro, batch)
    b = group_routes.index("partial")
    m = max((k for k in range(len(batch.route)) if int(batch.question[k]) == b),
            key=lambda k: int(ro.mask[int(batch.row[k])].sum()))
    one = batch[[m]]
    ids, mask = S.pack(ro, one.row)                                                # (1, L)
    self_prompt = [S.encode_prompt(tok, ro.problems[b]["question"], ro.texts[int(one.ref_row[0])])]
    gold_text = opsd.gold_context(ro.problems[b], False)
    gold_prompt = [S.encode_prompt(tok, ro.problems[b]["question"], gold_text)]
    with torch.no_grad():
        log_s = distill.teacher_logprobs(model, cfg, [ro.prompts[b]], ids, mask)  # the student (1, L, V)
        log_self = distill.teacher_logprobs(model, cfg, self_prompt, ids, mask)
        log_gold = distill.teacher_logprobs(model, cfg, gold_prompt, ids, mask)
    delta = (log_gold - log_s).gather(-1, ids[..., None]).squeeze(-1)               # (1, L)
    w_rlsd = rlsd.rlsd_weights(delta, one.adv, mask, 0.2, 0.5)
    kl_self = distill.divergence(log_self, log_s, "forward")
    jsd_gold = distill.divergence(log_gold, log_s, "jsd")
    L = int(mask.sum())
    values = {"f(D)": one.weights[0, :L].tolist(), "D": one.kl[0, :L].tolist(),
              "distill, forward KL": kl_self[0, :L].tolist(), "RLSD weight": w_rlsd[0, :L].tolist(),
              "OPSD, JSD": jsd_gold[0, :L].tolist()}
    top = max(max(values["distill, forward KL"]), 1e-9)
    signals = [dict(credit.F_OF_D, values=values["f(D)"], hover="D", hover_values=values["D"]),
               dict(name="distill: forward KL to the same teacher (nats)", lo=0.0, hi=top,
                    values=values["distill, forward KL"]),
               dict(name="RLSD's weight, gold teacher, lambda 0.5", lo=0.9, hi=1.1, center=1.0,
                    values=values["RLSD weight"]),
               dict(name="OPSD: JSD to the gold teacher (nats, max ln 2)", lo=0.0, hi=0.6931,
                    values=values["OPSD, JSD"])]
    example = dict(question=ro.problems[b]["question"], route="partial", adv=float(one.adv[0]),
                   reward=float(ro.correct.view(-1)[int(one.row[0])]), signals=signals,
                   tokens=[tok.decode([t]) for t in ids[0, :L].tolist()],
                   context=f"verified answer (SC-GRPO, distill): {ro.texts[int(one.ref_row[0])]}\n\n"
                           f"gold solution (RLSD, OPSD): {gold_text}")
    note = (f"SmolLM2-135M-Instruct before training, seed {cfg.seed}; c = {stats['c']:.4f} (the P75 of D "
            "over the step's active tokens). RLSD: below 1 blue, above 1 orange.")
    credit.write_credit_html(args.out, "One answer, four methods' per-token signals", [example], note)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(dict(question=example["question"], tokens=example["tokens"], adv=example["adv"],
                       c=stats["c"], context=example["context"], **values), f, indent=1)
    print(f"question {b} of the batch, answer row {int(one.row[0])}: {L} tokens, advantage {example['adv']:+.3f}")


if __name__ == "__main__":
    main()
