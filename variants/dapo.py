"""
DAPO (Yu et al., arXiv 2503.14476), the paper's strongest baseline, as a fork of scgrpo.py: GRPO
(no teacher, every weight 1) with four changes, each a piece of this file.
  1. Clip-higher: the ratio is clipped to [1 - eps, 1 + eps_high], eps_high 0.28 (dapo_loss). It
     acts only with --ppo-epochs > 1: at the default 1 the ratio is exactly 1, as in GRPO.
  2. Dynamic sampling: groups whose rewards are all equal give no gradient, so they are dropped
     and new questions sampled in their place (sample_with_refill).
  3. A token-level loss: each token's term over the number of tokens in the batch, in place of
     scgrpo's 1 / (B G |o_i|) (the Batch's loss_scale, set in dapo_step).
  4. Overlong shaping: a penalty from 0 down to -1 over the last --overlong-buffer tokens of the
     length cap (shaped_reward). DAPO's paper has it; the SC-GRPO paper does not say its DAPO
     baseline used it: our choice.
Where this departs from DAPO's paper: the reward is 0/1 (DAPO's is -1/1), so the penalty weighs
the whole gap between right and wrong, not half of it; the filter reads the shaped reward, so it
keeps exactly the groups with a non-zero advantage (an all-wrong group of unequal lengths keeps its
length signal), where DAPO filters on accuracy; the batch is refilled for at most --max-rounds
sampling rounds a step (DAPO refills until full), so a step after the last round trains on fewer
groups. The rest is scgrpo.py's; SC-GRPO's teacher flags (--c-min, ...) have no effect here.
    python variants/dapo.py --model SmolLM2-135M --task addition
"""
import os
import sys
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scgrpo.py
import scgrpo as S  # noqa: E402
from machinery.batching import join, select_groups  # noqa: E402  (several rollouts as one)
from machinery.metrics import Phases, step_metrics  # noqa: E402


@dataclass
class Config(S.Config):
    """The settings of a DAPO run: scgrpo.py's, and DAPO's three after --algo."""
    algo: str = S.setting("dapo", "DAPO: GRPO with the four changes of variants/dapo.py", ("dapo",))
    epsilon_high: float = S.setting(0.28, "upper clip range (clip-higher); DAPO: 0.28",
                                    rule=(lambda v, cfg: v > 0, "> 0"))
    max_rounds: int = S.setting(3, "sampling rounds a step to refill the dropped groups",
                                rule=(lambda v, cfg: v >= 1, "at least 1"))
    overlong_buffer: int = S.setting(
        -1, "length penalty over the last N tokens of --max-new-tokens; 0 off; -1: a quarter of "
        "it, off for the tiny model (its answer is a number of one or two tokens)",
        rule=(lambda v, cfg: -1 <= v < cfg.max_new_tokens, "-1, or 0 to --max-new-tokens - 1"))


def overlong_penalty(lengths, max_len, buffer):
    """0 up to max_len - buffer tokens, then linearly down to -1 at max_len. lengths (any
    shape) -> penalties (same shape)."""
    return ((max_len - buffer - lengths.float()) / buffer).clamp(-1.0, 0.0)


def shaped_reward(ro, cfg):
    """Change 4: r = correct + the overlong penalty. -> (B, G)"""
    buffer = cfg.overlong_buffer
    if buffer == -1:
        buffer = 0 if cfg.model == "tiny" else cfg.max_new_tokens // 4
    if not buffer:
        return ro.correct
    return ro.correct + overlong_penalty(ro.lengths, cfg.max_new_tokens, buffer)


def sample_with_refill(model, tok, cfg, batcher, gen, eos_ids):
    """Change 2: prompts_per_step groups whose shaped rewards are not all equal, from at most
    max_rounds rounds of sampling. -> (the Rollout to train on, every group sampled, rounds)"""
    kept, sampled, n_kept, rounds = [], [], 0, 0
    while n_kept < cfg.prompts_per_step and rounds < cfg.max_rounds:
        rounds += 1
        new = S.sample_groups(model, tok, cfg, batcher.take(cfg.prompts_per_step - n_kept),
                              cfg.group_size, cfg.temperature, gen, eos_ids)
        sampled.append(new)
        routes = S.grpo_routes(shaped_reward(new, cfg))  # 'skip': all rewards equal
        new = select_groups(new, [b for b, route in enumerate(routes) if route != "skip"])
        kept.append(new)
        n_kept += len(new.problems)
    return join(kept), join(sampled), rounds


def dapo_loss(model, cfg, ro, mb, old_logp=None):
    """Change 1: scgrpo.micro_batch_loss, its upper clip at 1 + epsilon_high."""
    logp, mask = S.answer_logprobs(model, cfg, ro, mb)                            # (b, L)
    old_logp = logp.detach() if old_logp is None else old_logp
    return S.policy_loss(logp, old_logp, mb.adv.to(logp.device), mb.weights[:, :mask.shape[1]],
                         mb.loss_scale.to(logp.device), mask, cfg.epsilon, cfg.epsilon_high)


def dapo_step(model, optimizer, tok, cfg, batcher, rng, gen, eos_ids, step_no):
    """scgrpo.train_step with DAPO's four changes and no teacher. -> (metrics, [])"""
    clock = Phases(next(model.parameters()).device)
    ro, sampled, rounds = sample_with_refill(model, tok, cfg, batcher, gen, eos_ids)
    clock.lap("sample")
    reward = shaped_reward(ro, cfg)                                                # (B, G)
    routes = S.grpo_routes(reward)  # 'grpo' for every group kept
    batch = S.make_batch(ro, routes, S.group_advantages(reward), [[None] * ro.G] * len(routes))
    # change 3: every token of the batch weighs the same, 1 / (the batch's tokens)
    lengths = ro.lengths.view(-1)[batch.row]                                       # (M,)
    batch = replace(batch, loss_scale=torch.full(lengths.shape, 1.0 / max(1, int(lengths.sum()))))
    clock.lap("teacher")  # none: the phase is kept so that every run logs the same columns
    upd, stepped = S.update(model, optimizer, cfg, ro, batch, loss_of=dapo_loss)
    clock.lap("update")
    metrics = step_metrics(sampled, routes, batch, clock, upd, {}, stepped)
    metrics.update(sample_rounds=rounds, groups_dropped=len(sampled.problems) - len(ro.problems))
    return metrics, []


def main(argv=None):
    """scgrpo.py's command line with this file's settings and seams (the tests call it too)."""
    S.main(argv, Config=Config, step=dapo_step)


if __name__ == "__main__":
    main()
