"""
Token lists <-> padded tensors: the bookkeeping between a batch of prompts or answers of
different lengths and the (rows, columns) tensors the model reads.
"""
import dataclasses

import torch


def left_pad(seqs, pad_id, device):
    """B token lists -> ids (B, P) left-padded with pad_id, mask (B, P): every prompt ends in the
    last column, so the next token of each row is predicted at the same position."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s):], mask[i, P - len(s):] = torch.tensor(s, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


def decode(tok, comp_ids, resp_mask):
    """Answers (N, L) with their mask -> N strings, special tokens (EOS) dropped."""
    return tok.batch_decode([c[m].tolist() for c, m in zip(comp_ids, resp_mask)],
                            skip_special_tokens=True)


def distinct(keys, device):
    """-> (the distinct keys in first-seen order, the index of each key among them (n,))."""
    uniq = list(dict.fromkeys(keys))
    return uniq, torch.tensor([uniq.index(k) for k in keys], device=device)


def join(parts):
    """One batch from several of the same dataclass (DAPO's refill rounds): list fields
    concatenated, tensor fields right-padded along dim 1 to the longest and stacked along dim 0
    (so answers (N, L) line up; padding is 0 / False)."""
    if len(parts) == 1:
        return parts[0]
    joined = {}
    for f in dataclasses.fields(parts[0]):
        values = [getattr(p, f.name) for p in parts]
        if isinstance(values[0], list):
            joined[f.name] = sum(values, [])
        elif isinstance(values[0], torch.Tensor):
            n = max(v.shape[1] for v in values)
            joined[f.name] = torch.cat([torch.nn.functional.pad(v, (0, n - v.shape[1]))
                                        if v.dim() == 2 else v for v in values])
        else:
            assert all(v is None for v in values), f"join: {f.name} is set in some parts only"
            joined[f.name] = None
    return type(parts[0])(**joined)


def select_groups(ro, groups):
    """The rollout (any dataclass of the same layout) of the questions `groups` only: fields of
    B entries (one per question) keep entries `groups`; fields of N = B * G (one per answer)
    keep those questions' answers. None stays None."""
    B, G = ro.correct.shape
    rows = [b * G + i for b in groups for i in range(G)]
    return type(ro)(**{f.name: pick(v, groups if v is None or len(v) == B else rows)
                       for f in dataclasses.fields(ro) for v in [getattr(ro, f.name)]})


def pack(ro, rows, n_tokens=None):
    """Answers `rows` (b,) of a rollout, cut to the longest: ids, mask (b, L) with padding 0.
    With n_tokens (b,), only the first n_tokens of each answer."""
    mask = ro.mask[rows]                                                            # (b, L)
    if n_tokens is not None:
        mask &= torch.arange(mask.shape[1], device=mask.device) < n_tokens.to(mask.device)[:, None]
    L = max(1, int(mask.sum(1).max()))
    mask = mask[:, :L]
    return ro.ids[rows, :L].masked_fill(~mask, 0), mask


def take_rows(batch, k):
    """The rows k (a long tensor of indices) of a dataclass of per-row fields: tensors indexed
    along dim 0, lists picked entry by entry."""
    return type(batch)(**{f.name: pick(v, k.tolist()) for f in dataclasses.fields(batch)
                          for v in [getattr(batch, f.name)]})


def pick(v, idx):
    """Entries idx (a list of ints) of a list or of a tensor along dim 0; None stays None."""
    if v is None or isinstance(v, list):
        return v if v is None else [v[i] for i in idx]
    return v[torch.tensor(idx, dtype=torch.long, device=v.device)]


def micro_batches(batch, ro, size):
    """The order and the slices in which scgrpo.update runs a Batch: its solve-none answers first,
    cut where they end, so that the gradient norm after them is Eq. (5)'s part alone
    (grad_norm_none, which compare.py reads); within each part the longest prompts first (a
    memory problem shows in the first micro-batch), a question's answers side by side, the
    longest first. -> (order (M,) of row indices, slices of at most `size` rows, n_none)"""
    lengths = ro.lengths.view(-1)[batch.row]                                        # (M,)
    questions = batch.question.tolist()
    order = sorted(range(len(batch.route)), key=lambda m: (batch.route[m] != "solve_none",
                   -len(ro.prompts[questions[m]]), questions[m], -int(lengths[m])))
    n_none = batch.route.count("solve_none")
    slices = [slice(s, min(s + size, n_none)) for s in range(0, n_none, size)]
    slices += [slice(s, s + size) for s in range(n_none, len(order), size)]
    return order, slices, n_none
