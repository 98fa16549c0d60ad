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
The studies that ran them: docs/paper_regime.md (window, skip), docs/eq5.md (unlike). One seam,
the credit: the teacher's D and f(D) are scgrpo.py's, then each option where it acts.
    python variants/eq5_options.py --model SmolLM2-135M --task addition --eq5-score unlike
"""
import difflib
import os
import sys
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402


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
    """--eq5-window group: each solve-none answer's active tokens, the first as many as its group's
    shortest answer has. -> active (M, L)"""
    shortest = ro.lengths.min(1).values[batch.question]                            # (M,)
    cols = torch.arange(batch.active.shape[1])
    window = (cols < shortest[:, None]).to(batch.active.device)                    # (M, L)
    none = torch.tensor([r == "solve_none" for r in batch.route], dtype=torch.bool)
    return torch.where(none[:, None].to(window.device), window, batch.active)


def unlikeness(ro, i, r, L):
    """1 - difflib's match ratio of the first L tokens of answers i and o_r (rollout rows): 0 for
    a copy, 1 for no token in common."""
    match = difflib.SequenceMatcher(None, ro.ids[i, :L].tolist(), ro.ids[r, :L].tolist(), False)
    return 1.0 - match.ratio()


def unlike_scores(ro, batch):
    """--eq5-score unlike: s_i = unlikeness of o_i's window to o_r's, for the solve-none answers
    (0 elsewhere, where Eq. (5) does not read it). -> (M,)"""
    return torch.tensor([unlikeness(ro, int(i), int(r), int(L)) if route == "solve_none" else 0.0
                         for i, r, L, route in zip(batch.row, batch.ref_row, batch.active.sum(1),
                                                   batch.route)])


def eq5_credit(model, cfg, ro, batch):
    """The credit seam: scgrpo.sc_credit, with the three options where they act ('option')."""
    if cfg.eq5_window == "group":  # option: one window for the whole group
        batch = replace(batch, active=group_window(ro, batch))
    kl, _, _ = S.teacher_pass(model, cfg, ro, batch)
    batch, metrics = S.weigh_tokens(cfg, batch, kl)                                # f(D)
    s = unlike_scores(ro, batch) if cfg.eq5_score == "unlike" else S.window_means(batch)  # option
    batch = replace(batch, adv=S.solve_none_advantages(batch, s, cfg.alpha_div))
    if cfg.eq5_only_step == "skip" and set(batch.route) == {"solve_none"}:  # option: Eq. (5) is
        batch = batch[:0]  # the step's only gradient, so no answer trains and nothing is applied
    return batch, metrics


def main(argv=None):
    """scgrpo.py's command line with this file's settings and seams (the tests call it too)."""
    S.main(argv, Config=Config, credit=eq5_credit)


if __name__ == "__main__":
    main()
