"""
How far --dtype bf16 moves what SC-GRPO computes, against --dtype fp32 on the same answers.

One fp32 rollout of the SmolLM2 preset (real answers, real teacher prompts) is scored twice: in
fp32, and on the bf16 path (the bf16 weight copy for the teacher's D, bf16 autocast with one set
of casts per optimizer step for the update's log-probs). The verdicts are fixed at 3 correct of
8 in every group, so every answer has a partial-route reference and a D at every token. Written:
the quantiles of |D_bf16 - D_fp32|, of |f(D)| differences, of |log-prob| differences, and the
fp32 quantities' own scale beside them; under autocast_only, the same differences for the bf16
path without the weight copy (autocast over fp32 weights in every pass, as before issue 39).

    python tools/bf16_drift.py --questions 4    # docs/bench/<date>_<machine>_<commit>_bf16_drift.json
"""
import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
import scgrpo as S  # noqa: E402
from bench import partial_batch  # noqa: E402  (every group 'partial', references from seed 0)
from machinery import at_least, bench_output, cli, die, machine, models, tasks  # noqa: E402


def quantiles(x):
    q = torch.quantile(x.double(), torch.tensor([0.5, 0.95, 0.99], dtype=torch.double)).tolist()
    return dict(median=q[0], p95=q[1], p99=q[2], max=float(x.max()), n=int(x.numel()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M", help="a model the SmolLM2 preset runs")
    ap.add_argument("--questions", type=at_least(1), default=4, help="training questions, 8 answers each")
    ap.add_argument("--out", default="", help="JSON file to write; default docs/bench/<date>_<machine>_"
                    "<commit>_bf16_drift.json")
    args = ap.parse_args(argv)
    args.out = args.out or bench_output("bf16_drift", "json")
    if not args.out.endswith(".json"):
        die(f"--out {args.out}: give a .json file name")
    flags = ["--model", args.model, "--task", "addition", "--algo", "scgrpo", "--dtype", "fp32"]
    cfg, _ = cli.parse_config(S.Config, S.PRESETS, flags)  # the preset's config; no run folder
    torch.manual_seed(cfg.seed)
    model, tok = models.load_model(cfg.model, cfg.seed)
    model.eval()
    models.set_precision(model, False)
    train, _ = tasks.load_task(cfg)
    G = cfg.group_size
    ro = S.sample_groups(model, tok, cfg, train[:args.questions], G, cfg.temperature, torch.Generator().manual_seed(0),
                         models.stop_ids(model, tok))
    ro.correct = torch.tensor([[1.0] * 3 + [0.0] * (G - 3)] * args.questions)
    batch = partial_batch(ro)
    batch = dataclasses.replace(batch, teacher_prompt=S.teacher_prompts(tok, ro, batch))
    scored = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # training() needs one; it never steps here
    for name, bf16, copy in (("fp32", False, False), ("bf16", True, True), ("autocast", True, False)):
        models.set_precision(model, bf16, weights_copy=copy)  # autocast: the bf16 path before the copy
        states = ro if not bf16 else dataclasses.replace(ro, fast_states=None)  # as a bf16 run:
        b, _ = S.sc_credit(model, cfg, states, batch)  # its sampler keeps no states
        with models.training(model, opt, grad_checkpoint=False), torch.no_grad():
            logp, mask = S.answer_logprobs(model, cfg, ro, b)
        scored[name] = (b.kl[b.active], b.weights[b.active], logp[mask])
    (d32, w32, lp32), (d16, w16, lp16) = scored["fp32"], scored["bf16"]
    res = dict(model=cfg.model, questions=args.questions, answers=len(batch.row), machine=machine().strip(),
               D_fp32=quantiles(d32), D_abs_diff=quantiles((d16 - d32).abs()),
               fD_fp32=quantiles(w32), fD_abs_diff=quantiles((w16 - w32).abs()),
               logprob_fp32_abs=quantiles(lp32.abs()), logprob_abs_diff=quantiles((lp16 - lp32).abs()),
               autocast_only={k: quantiles((a - b).abs()) for k, a, b in zip(
                   ("D_abs_diff", "fD_abs_diff", "logprob_abs_diff"), scored["autocast"], scored["fp32"])})
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
