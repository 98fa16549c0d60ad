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


def distinct(items, device, key=None):
    """-> (the distinct items in first-seen order, the index of each item among them (n,)). key:
    what makes two items the same (default: their value; id: the same object)."""
    key = key or (lambda x: x)
    first = {}
    for x in items:
        first.setdefault(key(x), x)
    keys = list(first)
    return list(first.values()), torch.tensor([keys.index(key(x)) for x in items], device=device)


def join(parts):
    """One batch from several of the same dataclass (DAPO's refill rounds): list fields
    concatenated, tensor fields right-padded along dim 1 to the longest and stacked along dim 0
    (so answers (N, L) line up; padding is 0 / False), tuples of tensors joined entry by entry."""
    if len(parts) == 1:
        return parts[0]
    return type(parts[0])(**{f.name: join_values([getattr(p, f.name) for p in parts])
                             for f in dataclasses.fields(parts[0])})


def join_values(values):
    """join's rule for one field's values, one per part."""
    if isinstance(values[0], list):
        return sum(values, [])
    if isinstance(values[0], tuple):
        return tuple(join_values(list(v)) for v in zip(*values))
    if isinstance(values[0], torch.Tensor):
        if values[0].dim() < 2:
            return torch.cat(values)
        n = max(v.shape[1] for v in values)
        pad = [(0, 0) * (v.dim() - 2) + (0, n - v.shape[1]) for v in values]
        return torch.cat([torch.nn.functional.pad(v, p) for v, p in zip(values, pad)])
    assert all(v is None for v in values), "join: a field is set in some parts only"
    return None


def select_groups(ro, groups):
    """The rollout (any dataclass of the same layout) of the questions `groups` only: fields of
    B entries (one per question) keep entries `groups`; fields of N = B * G (one per answer)
    keep those questions' answers. None stays None."""
    B, G = ro.correct.shape
    rows = [b * G + i for b in groups for i in range(G)]
    return type(ro)(**{f.name: pick(v, groups if v is None or len(v) == B else rows)
                       for f in dataclasses.fields(ro) for v in [getattr(ro, f.name)]})


def pack(ro, rows, active=None):
    """Answers `rows` (b,) of a rollout, cut to the longest: ids, mask (b, L) with padding 0.
    With active (b, L'), only each answer's active tokens (and cut to the longest of those)."""
    mask = ro.mask[rows]                                                            # (b, L)
    if active is not None:
        mask &= active.to(mask.device)
    L = max(1, int(mask.sum(1).max()))
    mask = mask[:, :L]
    return ro.ids[rows, :L].masked_fill(~mask, 0), mask


def take_rows(batch, k):
    """The rows k (a long tensor of indices) of a dataclass of per-row fields: tensors indexed
    along dim 0, lists picked entry by entry."""
    return type(batch)(**{f.name: pick(v, k.tolist()) for f in dataclasses.fields(batch)
                          for v in [getattr(batch, f.name)]})


def pick(v, idx):
    """Entries idx (a list of ints) of a list or of a tensor along dim 0 (of a tuple's each);
    None stays None."""
    if v is None or isinstance(v, list):
        return v if v is None else [v[i] for i in idx]
    if isinstance(v, tuple):
        return tuple(pick(x, idx) for x in v)
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
