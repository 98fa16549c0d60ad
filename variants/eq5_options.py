"""
Three options for SC-GRPO's solve-none groups that are not the paper's, as a fork of scgrpo.py.
Each is off by default, so with no flag this runs scgrpo.py's SC-GRPO exactly.
  --eq5-window group  Eq. (5) scores every answer over its group's shortest answer, o_r included,
                      not over L_i = min(|o_i|, |o_r|) (group_window): one window for the group.
  --eq5-score unlike  s_i is how little of its window o_i shares with o_r's, one minus difflib's
                      token-match ratio (unlikeness), not its mean f(D). The paper reads a high
                      s_i as "unlike o_r"; on the untrained SmolLM2 a copy of o_r outscores 96%
                      of its group by mean f(D) (docs/eq5.md). This option says "unlike" directly.
  --eq5-only-step skip  a step whose only gradient is Eq. (5)'s (every routed group solve-none)
                      applies no update: the paper's nudge never moves the model alone.
The studies that ran them: docs/paper_regime.md (window, skip), docs/eq5.md (unlike).
    python variants/eq5_options.py --model SmolLM2-135M --task addition --eq5-score unlike
"""
import difflib
import os
import sys
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402
from machinery.credit import credit_examples  # noqa: E402
from machinery.metrics import Phases, step_metrics  # noqa: E402


@dataclass
class Config(S.Config):
    """The settings of an SC-GRPO run with the Eq. (5) options: scgrpo.py's, and three below."""
    algo: str = S.setting("scgrpo", "SC-GRPO: the options act on its solve-none groups",
                          ("scgrpo",))
    eq5_window: str = S.setting("paper", "group (not the paper's): Eq. (5) scores every answer "
                                "over the group's shortest one", ("paper", "group"))
    eq5_score: str = S.setting("kl", "unlike (not the paper's): Eq. (5) pushes up the answers "
                               "least like o_r by token match, not those of highest f(D)",
                               ("kl", "unlike"))
    eq5_only_step: str = S.setting("step", "skip (not the paper's): no update when Eq. (5) is a "
                                   "step's only gradient", ("step", "skip"))


def group_window(ro, batch):
    """--eq5-window group: each solve-none answer's active tokens, the group's shortest answer's
    length. -> n_active (M,)"""
    shortest = ro.lengths.min(1).values[batch.question]                            # (M,)
    none = torch.tensor([r == "solve_none" for r in batch.route], dtype=torch.bool)
    return torch.where(none, shortest, batch.n_active)


def unlikeness(ro, i, r, L):
    """1 - difflib's match ratio of the first L tokens of answers i and o_r (rollout rows): 0 for
    a copy, 1 for no token in common."""
    match = difflib.SequenceMatcher(None, ro.ids[i, :L].tolist(), ro.ids[r, :L].tolist(), False)
    return 1.0 - match.ratio()


def unlike_scores(ro, batch):
    """--eq5-score unlike: s_i = unlikeness of o_i's window to o_r's, for the solve-none answers
    (0 elsewhere, where Eq. (5) does not read it). -> (M,)"""
    return torch.tensor([unlikeness(ro, int(i), int(r), int(L)) if route == "solve_none" else 0.0
                         for i, r, L, route in zip(batch.row, batch.ref, batch.n_active,
                                                   batch.route)])


def eq5_options_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids):
    """scgrpo.train_step, with the three options where they act (marked 'option')."""
    clock = Phases(next(model.parameters()).device)
    ro = S.sample_groups(model, tok, cfg, batcher.take(cfg.prompts_per_step), cfg.group_size,
                         cfg.temperature, gen, eos_ids, keep_states=True)
    clock.lap("sample")
    routes = S.route_groups(ro.correct, "scgrpo")
    refs = [S.pick_references(c, r, rng) for c, r in zip(ro.correct.bool().tolist(), routes)]
    batch = S.make_batch(ro, routes, S.group_advantages(ro.correct), refs)
    if cfg.eq5_window == "group":  # option: one window for the whole group
        batch = replace(batch, n_active=group_window(ro, batch))
    batch, sc_stats = S.self_condition(model, cfg, ro, batch, S.teacher_prompts(tok, ro, batch))
    s = unlike_scores(ro, batch) if cfg.eq5_score == "unlike" else S.window_means(batch)  # option
    batch = replace(batch, adv=S.solve_none_advantages(batch, s, cfg.alpha_div))
    clock.lap("teacher")
    eq5_only = set(batch.route) == {"solve_none"}
    trained = batch[:0] if eq5_only and cfg.eq5_only_step == "skip" else batch  # option
    upd, stepped = S.update(model, optimizer, cfg, ro, trained)
    clock.lap("update")
    metrics = step_metrics(ro, routes, trained, clock, **upd, **sc_stats, eq5_only=eq5_only,
                           nonfinite=bool(trained.route) and not stepped)
    return metrics, credit_examples(tok, ro, batch)


if __name__ == "__main__":
    S.main(Config=Config, step=eq5_options_step)
