"""
What a training step logs besides its loss: the teacher's numbers (kl_metrics), the update's
(UpdateLog: gradient norms, the solve-none part, the relative update size), the step's line of
metrics.jsonl (step_metrics), and the seconds and CUDA memory of each phase (Phases).
"""
import time

import torch
from tqdm import tqdm


def peak_memory_gb(device):
    """Peak memory allocated on a CUDA device since the last call, in GiB (None off CUDA)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def kl_metrics(kl, active, weights, c):
    """scgrpo.weigh_tokens's numbers for metrics.jsonl: the P50, P75 and P95 of D and the mean
    f(D) over the active tokens whose D is finite, c, and how many were not (with a warning)."""
    nonfinite = active & ~torch.isfinite(kl)
    if nonfinite.any():
        tqdm.write(f"warning: {int(nonfinite.sum())} non-finite KL values get weight 0")
    active = active & ~nonfinite
    q = torch.tensor([0.5, 0.75, 0.95], device=kl.device)
    p50, p75, p95 = torch.quantile(kl[active].float(), q).tolist()
    return dict(kl_p50=p50, kl_p75=p75, kl_p95=p95, c=c, weight_mean=float(weights[active].mean()),
                kl_nonfinite=int(nonfinite.sum()))


def gradient_norm(model):
    """The L2 norm of every parameter's accumulated gradient, as clip_grad_norm_ measures it."""
    grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def relative_change(model, before):
    """||theta - before|| / ||before|| over all parameters (--log-update-size); None without."""
    if before is None:
        return None
    moved = sum(float((p.detach().float() - b.float()).pow(2).sum())
                for p, b in zip(model.parameters(), before))
    return (moved / sum(float(b.float().pow(2).sum()) for b in before)) ** 0.5


class UpdateLog:
    """What scgrpo.update reports besides the step it applies: the loss and clipped tokens of its
    last epoch, the gradient norm that clip_grad_norm_ measured (grad_norm), the norm of the
    gradient after the solve-none micro-batches alone (grad_norm_none: Eq. (5)'s part), and with
    --log-update-size ||delta theta|| / ||theta||, for which it keeps a copy of the weights."""

    def __init__(self, model, keep_weights):
        self.model, self.grad_norm, self.norm_none = model, 0.0, 0.0
        self.before = [p.detach().clone() for p in model.parameters()] if keep_weights else None
        self.new_epoch()

    def new_epoch(self):
        self.loss, self.clipped = 0.0, 0

    def micro_batch(self, loss, n_clipped, last_solve_none):
        self.loss, self.clipped = self.loss + loss.item(), self.clipped + n_clipped
        if last_solve_none:  # the gradient so far is the solve-none answers' alone
            self.norm_none = gradient_norm(self.model)

    def metrics(self, tokens):
        return dict(loss=self.loss, clip_frac=self.clipped / max(1, tokens),
                    grad_norm=self.grad_norm, grad_norm_none=self.norm_none,
                    update_size=relative_change(self.model, self.before))


def step_metrics(sampled, group_routes, batch, clock, update, credit, stepped):
    """A training step's line of metrics.jsonl (docs/metrics.md): reward and length of every answer
    sampled (a Rollout), the groups of each route, the answers updated (a Batch), the update's
    numbers (scgrpo.update's dict) and the credit seam's, whether Eq. (5) was the step's only
    gradient (every group that trained solve-none), whether the update was skipped as non-finite,
    and the seconds and CUDA memory of each phase."""
    trained = {r for r in group_routes if r != "skip"}
    return dict(reward_mean=float(sampled.correct.mean()),
                len_mean=float(sampled.lengths.float().mean()),
                groups_skipped=group_routes.count("skip"),
                groups_partial=group_routes.count("partial"),
                groups_none=group_routes.count("solve_none"),
                groups_fallback=group_routes.count("fallback"), answers_updated=len(batch.route),
                **{k: v for k, v in {**update, **credit}.items() if v is not None},
                eq5_only=trained == {"solve_none"}, nonfinite=bool(batch.route) and not stepped,
                **clock.seconds, **clock.memory)


class Phases:
    """Seconds and, on CUDA, peak GiB allocated in each phase of a step: lap(name) ends the
    phase `name` -> seconds['t_name'], memory['mem_name_gb']."""

    def __init__(self, device):
        self.device, self.start, self.seconds, self.memory = device, time.time(), {}, {}
        peak_memory_gb(device)  # start counting the first phase's peak

    def lap(self, name):
        now = time.time()
        self.seconds[f"t_{name}"], self.start = now - self.start, now
        peak = peak_memory_gb(self.device)
        if peak is not None:
            self.memory[f"mem_{name}_gb"] = peak
