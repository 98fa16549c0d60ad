"""
The fast paths of scgrpo.py. Each function here computes what plain PyTorch lines in scgrpo.py
compute, in less time or memory; its docstring quotes them, scgrpo.py runs them unless --fast is
on, and tests/test_fast_path.py holds the two equal. Nothing here changes the method. scgrpo.py
calls three, each in place of the plain lines of its namesake there:
  sample            a KV cache and inverse-CDF draws (plainly: the whole sequence re-run each
                    step, multinomial); in fp32 it keeps the student's states for the teacher
  answer_logprobs   the update's log-probs (plainly: log_softmax(full logits).gather)
  teacher_kl        D and both sides' log-probs (plainly: two full forwards, F.kl_div), the
                    student's side from the sampler's states when it kept them
built from: Preallocated (the sampler's KV cache, each token written in place), shared_prefix_
hidden (the prompts' common beginning prefilled once, each distinct prompt once, then the
answers), completion_hidden (one forward per answer), head_logprobs, head_kl and head_lse (the LM
head one vocabulary block at a time: no (tokens, V) matrix), mm (a product with the head in the
weights' precision: in bf16 each logit rounded as the plain lines' bf16 head rounds it).
"""
import math
import os

import torch

from transformers.cache_utils import DynamicLayer

from machinery.batching import distinct, left_pad
from machinery.models import autocast


def sample_tokens(logits, temperature, gen):
    """Exact sampling from softmax(logits / T) by inverse CDF (7x faster than multinomial at a
    151,936 vocabulary; plainly: torch.multinomial(softmax(logits / T), 1)). logits (N, V)
    fp32, overwritten -> tokens (N,) and lse (N,) = log sum_v exp(logits_v / T), the
    log-normaliser SC-GRPO's KL reuses. T == 0: greedy, lse None."""
    if temperature == 0:
        return logits.argmax(-1), None
    z = logits.div_(temperature)
    m = z.amax(-1, keepdim=True)                                                   # (N, 1)
    cdf = z.sub_(m).exp_().cumsum_(-1)  # unnormalised, in place                   # (N, V)
    total = cdf[:, -1:]                                                            # (N, 1)
    u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device) * total     # (N, 1)
    tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    return tok, (m + total.log()).squeeze(1)


@torch.no_grad()
def sample(model, prompts, n, max_new, temperature, eos_ids, pad_id, gen, keep_states=None):
    """n answers per prompt. Each prompt is prefilled once and its KV cache copied n times;
    rows that emitted EOS leave the batch. -> comp_ids (B*n, L) padded with pad_id, resp_mask
    (B*n, L) True up to and including the first EOS (never inferred from pad_id, which may
    equal EOS), and if keep_states the student's states for the teacher's KL: (final hidden
    state (B*n, L, H), log-normaliser (B*n, L)), else None. keep_states None: kept when sampling
    (T > 0) in fp32 (in bf16, decoding and a full forward round apart: the teacher re-scores).
    The distribution is exactly softmax(logits / T), the one the loss scores: the model's
    generation_config (top-k, top-p, repetition penalty) is never read."""
    device, fp32 = next(model.parameters()).device, next(model.parameters()).dtype == torch.float32
    if keep_states is None:
        keep_states = temperature > 0 and fp32 and getattr(model, "autocast_dtype", None) is None
    base, head = model.base_model, model.get_output_embeddings()
    out, attn, pos = prefill(model, prompts, pad_id)                               # (B, P)
    cache = out.cache
    cache.layers = [preallocated(layer, n, max_new) for layer in cache.layers]  # n copies, room
    h = out.last_hidden_state[:, -1].float().repeat_interleave(n, 0)               # (N, H)
    attn = attn.repeat_interleave(n, 0)                                            # (N, P)
    pos = pos[:, -1:].repeat_interleave(n, 0)                                      # (N, 1)
    N, H = h.shape
    comp_ids = torch.full((N, max_new), pad_id, dtype=torch.long, device=device)
    resp_mask = torch.zeros((N, max_new), dtype=torch.bool, device=device)
    if keep_states:
        hidden = torch.zeros((N, max_new, H), device=device)
        lse = torch.zeros((N, max_new), device=device)
    eos = torch.tensor(eos_ids, device=device)
    alive = torch.arange(N, device=device)                               # rows still sampling
    # One logits buffer for all steps: on a CPU a fresh (N, V) tensor each step is page-faulted
    # anew (64 x 32 tokens at V = 151,936: 1.39 s, with the buffer 0.77 s).
    logits = torch.empty(N, head.weight.shape[0], device=device)                   # (N, V)
    for t in range(max_new):
        z = head_logits(h, head.weight, logits[:len(alive)])                       # (n_alive, V)
        tok, lse_t = sample_tokens(z, temperature, gen)                           # (n_alive,)
        comp_ids[alive, t], resp_mask[alive, t] = tok, True
        if keep_states:
            hidden[alive, t], lse[alive, t] = h, lse_t
        done = torch.isin(tok, eos)
        if t == max_new - 1 or bool(done.all()):
            break
        if bool(done.any()):  # finished rows stop costing work
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            alive, tok, attn, pos = alive[keep], tok[keep], attn[keep], pos[keep]
        attn, pos = torch.cat([attn, attn.new_ones(len(alive), 1)], 1), pos + 1
        with autocast(model):
            out = base(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                       cache=cache, use_cache=True)
        h = out.last_hidden_state[:, -1].float()
    L = max(1, int(resp_mask.sum(1).max()))
    if not keep_states:
        return comp_ids[:, :L], resp_mask[:, :L], None
    return comp_ids[:, :L], resp_mask[:, :L], (hidden[:, :L], lse[:, :L])


def prefill(model, prompts, pad_id):
    """The prompts, left-padded (B, P) so each ends in the last column, through the body once with
    its KV cache kept. -> (the body's output, attention mask (B, P), positions (B, P))"""
    ids, attn = left_pad(prompts, pad_id, next(model.parameters()).device)         # (B, P)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                       # (B, P)
    with autocast(model):
        out = model.base_model(input_ids=ids, attention_mask=attn, position_ids=pos,
                               use_cache=True)
    return out, attn, pos


class Preallocated(DynamicLayer):
    """One layer of the sampler's KV cache: a DynamicLayer (its keys and values (rows, heads,
    tokens, head dim)) whose prompt rows are repeated `repeats` times and which keeps room for
    `room` more tokens, so each step writes its token in place. DynamicLayer's own update grows
    by torch.cat, copying the whole cache at every step (0.34 GB a step for 32 SmolLM2-135M
    answers of 64 tokens). keys and values are views of the first rows and tokens in use."""

    def __init__(self, layer, repeats, room):
        super().__init__()
        self.lazy_initialization(layer.keys, layer.values)
        k, v = layer.keys, layer.values                                     # (B, heads, P, d)
        B, heads, P, d = k.shape
        self.k_buf = k.new_empty(B * repeats, heads, P + room, d)
        self.v_buf = v.new_empty(B * repeats, heads, P + room, d)
        self.k_buf[:, :, :P] = k.repeat_interleave(repeats, 0)
        self.v_buf[:, :, :P] = v.repeat_interleave(repeats, 0)
        self.in_use(B * repeats, P)

    def in_use(self, rows, used):
        """keys and values: views of the first `rows` rows and `used` tokens of the buffers."""
        self.rows, self.used = rows, used
        self.keys, self.values = self.k_buf[:rows, :, :used], self.v_buf[:rows, :, :used]

    def update(self, key_states, value_states, *args, **kwargs):
        t = self.used + key_states.shape[-2]
        if t > self.k_buf.shape[2]:
            raise ValueError(f"the sampler's KV cache holds {self.k_buf.shape[2]} tokens; {t} "
                             "asked")
        self.k_buf[:self.rows, :, self.used:t] = key_states
        self.v_buf[:self.rows, :, self.used:t] = value_states
        self.in_use(self.rows, t)
        return self.keys, self.values

    def batch_select_indices(self, indices):
        """Keep rows `indices` (a long tensor, in any order), moved to the front of the buffers."""
        self.k_buf[:len(indices), :, :self.used] = self.keys[indices]
        self.v_buf[:len(indices), :, :self.used] = self.values[indices]
        self.in_use(len(indices), self.used)

    def crop(self, *args):  # the sampler's cache only grows and drops rows; nothing else is kept
        raise NotImplementedError("speed.Preallocated serves the sampler only")

    reorder_cache = reset = crop


def preallocated(layer, repeats, room):
    """A layer of the sampler's cache, its rows repeated: a plain DynamicLayer becomes a
    Preallocated one; any other kind (a sliding window, ...) keeps its own rules and grows as
    transformers grows it."""
    if type(layer) is not DynamicLayer:
        layer.batch_repeat_interleave(repeats)
        return layer
    return Preallocated(layer, repeats, room)


def head_logits(h, weight, out):
    """h @ W.T into the fp32 buffer out: in fp32, or with bf16 weights (--dtype bf16's copy) a bf16
    matmul, its result rounded to bf16 and then widened (the sampler's softmax runs in fp32)."""
    if weight.dtype == out.dtype:
        return torch.matmul(h, weight.T, out=out)
    return out.copy_(h.to(weight.dtype) @ weight.T)


def mm(a, b, dtype=None):
    """a @ b, returned in a's precision (fp32, or float64 in gradcheck). With dtype bf16 (or b
    already in bf16: the --dtype bf16 weight copy) a bf16 matmul: fp32 accumulation, its result
    rounded to bf16 and then widened, as the plain lines' bf16 LM head rounds its logits (a CPU
    has no bf16 matmul with an fp32 result in this torch; docs/speed.md)."""
    low = dtype or (b.dtype if b.dtype == torch.bfloat16 else None)
    if low is None or low == a.dtype:
        return a @ b.to(a.dtype)
    return (a.to(low) @ b.to(low)).to(a.dtype)


def target_logits(a, w, dtype=None):
    """a_k . w_k for each row k (N,): one logit per row as mm computes it, in a's precision, or with
    dtype (or bf16 w) from bf16 inputs, the sum rounded to bf16."""
    low = dtype or (w.dtype if w.dtype == torch.bfloat16 else None)
    if low is None:
        return (a * w.to(a.dtype)).sum(-1)
    return (a.to(low).to(a.dtype) * w.to(low).to(a.dtype)).sum(-1).to(low).to(a.dtype)


def completion_hidden(model, prompts, comp_ids, resp_mask):
    """The final hidden states that predict each answer token, one row per answer with its
    own prompt: model.base_model(prompt + answer) -> (n_active, H), in row order. Plainly,
    model(...).logits[:, P-1:-1] = this @ W.T, where W is the LM head's weight."""
    p_ids, p_mask = left_pad(prompts, 0, comp_ids.device)                          # (B, P)
    ids = torch.cat([p_ids, comp_ids], 1)                                          # (B, P+L)
    attn = torch.cat([p_mask, resp_mask.long()], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with autocast(model):
        h = model.base_model(input_ids=ids, attention_mask=attn, position_ids=pos,
                             use_cache=False).last_hidden_state
    return h[:, p_ids.shape[1] - 1:-1][resp_mask].float()  # (n, H), fp32 in (mm may go bf16)


def shared_prefix_hidden(model, prompts, prompt_of, comp_ids, resp_mask):
    """completion_hidden(model, [prompts[k] for k in prompt_of], comp_ids, resp_mask), up to
    rounding, computing every shared token once: the beginning all prompts have in common
    (chat template, system prompt, guide) is prefilled once, then the rest of each distinct
    prompt, then the answers, each stage reading the KV cache of the one before (gradients
    flow back through the cache copies). prompts: u distinct token lists; prompt_of (b,)."""
    device = comp_ids.device
    n = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)  # each keeps >= 1
    ctx = dict(cache=None, mask=torch.zeros((1, 0), dtype=torch.long, device=device),
               last_pos=torch.full((1,), -1, device=device))
    if n:  # stage 1: the common beginning, one row
        run_after(model, ctx, torch.tensor([prompts[0][:n]], device=device),
                  torch.ones((1, n), device=device))
    # stage 2: the rest of each distinct prompt, left-padded so each ends in the last column
    ids, mask = left_pad([p[n:] for p in prompts], 0, device)                      # (u, R)
    zeros = torch.zeros(len(prompts), dtype=torch.long, device=device)
    h = run_after(model, ctx, ids, mask, rows=zeros)[prompt_of, -1:]   # (b, 1, H): answer token 0
    if comp_ids.shape[1] > 1:  # stage 3: answer tokens 0..L-2 predict tokens 1..L-1
        rest = run_after(model, ctx, comp_ids[:, :-1], resp_mask[:, :-1], rows=prompt_of)
        h = torch.cat([h, rest], 1)                                                # (b, L, H)
    return h[resp_mask].float()


def run_after(model, ctx, ids, mask, rows=None):
    """Run ids (b, n) with mask (b, n) after a cached context ctx (its cache, mask (r, c) and
    last position (r,)), whose rows are first copied to the new rows' order (rows (b,) indexes
    ctx). Positions continue from the context. Updates ctx; -> final hidden states (b, n, H)."""
    if rows is not None:
        if ctx["cache"] is not None:
            ctx["cache"].batch_select_indices(rows)
        ctx["mask"], ctx["last_pos"] = ctx["mask"][rows], ctx["last_pos"][rows]
    attn = torch.cat([ctx["mask"], mask.long()], 1)                                # (b, c+n)
    pos = (ctx["last_pos"][:, None] + mask.long().cumsum(1)).clamp(min=0)          # (b, n)
    with autocast(model):
        out = model.base_model(input_ids=ids, attention_mask=attn, position_ids=pos,
                               cache=ctx["cache"], use_cache=True)
    ctx.update(cache=out.cache, mask=attn, last_pos=pos[:, -1])
    return out.last_hidden_state


def vocab_block(n_rows, device):
    """Vocabulary entries (rows of the LM head's weight W) per block, so that an (n_rows,
    block) fp32 buffer is 2 MB on a CPU (it stays in cache, and W is read once per pass: 2x
    faster at V = 151,936) and 256 MB on a GPU."""
    return max(128, (2 ** 26 if device.type == "cuda" else 2 ** 19) // max(1, n_rows))


def fold_block_(m, s, z):
    """One step of an online softmax over vocabulary blocks: fold logits z (n, block) into the
    running max m and sum s = sum_v exp(z_v - m), both (n,). Overwrites z with exp(z - new m).
    -> (new m, new s, decay = exp(m - new m), the factor that rescaled the sums so far)."""
    new_m = torch.maximum(m, z.amax(-1))
    decay = torch.exp(m - new_m)
    return new_m, s * decay + z.sub_(new_m[:, None]).exp_().sum(-1), decay


class HeadLogprobs(torch.autograd.Function):
    """log p(target) = log_softmax(h @ W.T / T).gather(-1, target) per row, with the LM head W
    applied one block of vocabulary entries at a time in both passes: no (N, V) matrix, and
    only h and the log-normaliser kept for backward. With z = h W^T / T and p = softmax(z):
        d log p(t) / d z_v = 1[v = t] - p_v,  so, with g the incoming gradient (N,),
        grad h = g/T (W_t - sum_v p_v W_v),   grad W_v = sum_n g_n/T (1[v = t_n] - p_nv) h_n.
    dtype bf16 (--dtype bf16's update): every product with W a bf16 matmul (mm), each logit
    rounded to bf16 as autocast's LM head rounds it; the softmax's sums and the gradients' sums
    over blocks stay fp32, and grad W is fp32 for the fp32 master weights."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, block, dtype):
        lse = head_lse(h, weight, temperature, block, dtype)                       # (N,)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.block, ctx.dtype = temperature, block, dtype
        return target_logits(h / temperature, weight[targets], dtype) - lse       # (N,)

    @staticmethod
    def backward(ctx, g):
        h, weight, targets, lse = ctx.saved_tensors
        a, g_t = h / ctx.temperature, g / ctx.temperature                          # (N, H), (N,)
        grad_h = g_t[:, None] * weight[targets]                                    # 1[v = t] terms
        grad_w = torch.zeros_like(weight).index_add_(0, targets, g_t[:, None] * h)
        for j in range(0, weight.shape[0], ctx.block):
            w = weight[j:j + ctx.block]                                            # (block, H)
            q = mm(a, w.T, ctx.dtype).sub_(lse[:, None]).exp_().mul_(g_t[:, None])  # g/T p
            grad_h -= mm(q, w, ctx.dtype)
            grad_w[j:j + ctx.block] -= mm(q.T, h, ctx.dtype)
        return grad_h, grad_w, None, None, None, None


@torch.no_grad()
def head_lse(h, head, temperature, block=None, dtype=None):
    """torch.logsumexp(h @ W.T / T, -1) without the (N, V) logits. head: the LM head or its
    weight W (V, H); h (N, H) -> (N,), in fp32 or wider. bf16 weights or dtype: bf16 logits (mm)."""
    a = h.to(torch.promote_types(h.dtype, torch.float32)) / temperature  # float64 in gradcheck
    weight = getattr(head, "weight", head)
    m, s = a.new_full((a.shape[0],), -math.inf), a.new_zeros(a.shape[0])
    block = block or vocab_block(a.shape[0], a.device)
    for j in range(0, weight.shape[0], block):
        m, s, _ = fold_block_(m, s, mm(a, weight[j:j + block].T, dtype))          # (N, block)
    return m + s.log()


def head_logprobs(head, h, targets, temperature, block=None, dtype=None):
    """log_softmax(head(h) / T).gather(-1, targets) without the (N, V) logits (HeadLogprobs).
    h (N, H) fp32, targets (N,) -> (N,) fp32. dtype bf16: the products with W in bf16."""
    block = block or vocab_block(h.shape[0], h.device)
    return HeadLogprobs.apply(h, head.weight, targets, temperature, block, dtype)


@torch.no_grad()
def head_kl(h_t, h_s, lse_s, head, temperature, block=None, normalisers=False):
    """D = KL(softmax(z_t) || softmax(z_s)) per row, z = h @ W.T / T; plainly
        (softmax(z_t) * (log_softmax(z_t) - log_softmax(z_s))).sum(-1),
    here over the vocabulary in blocks with no (n, V) matrix. h_t, h_s (n, H); lse_s (n,) =
    log sum_v exp z_s(v), computed by the sampler. -> (n,). Because z is linear in h,
        D = sum_v p_t(v) (z_t(v) - z_s(v)) - lse_t + lse_s
          = (sum_v p_t(v) W_v) . (h_t - h_s) / T - lse_t + lse_s,
    so only the teacher's logits are needed; lse_t and the p_t-weighted mean of W's rows are
    carried along the blocks as an online softmax (fold_block_). lse_s None (the student
    re-scored, as under bf16): the first line, both sides' logits in each block, both
    normalisers from them; with bf16 weights each logit is rounded to bf16 (mm), and the first
    line stays the KL of the two rounded distributions, where the second would not.
    normalisers: -> (D, lse_t, lse_s), the log-normalisers of both sides too."""
    n, H = h_t.shape
    a = h_t.float() / temperature
    block = block or vocab_block(n, a.device)
    if lse_s is None:
        d, lse_t, lse_s = rounded_head_kl(a, h_s.float() / temperature, head.weight, block)
        return (d, lse_t, lse_s) if normalisers else d
    m, s = a.new_full((n,), -math.inf), a.new_zeros(n)                           # max, sum e
    w_sum = a.new_zeros(n, H)                                        # sum_v exp(z_t(v) - m) W_v
    for j in range(0, head.weight.shape[0], block):
        w = head.weight[j:j + block].float()                                       # (block, H)
        e = a @ w.T                                                                # (n, block)
        m, s, decay = fold_block_(m, s, e)                                         # e: exp(z - m)
        w_sum = w_sum * decay[:, None] + e @ w
    lse_t = m + s.log()
    dot = ((w_sum / s[:, None]) * (h_t.float() - h_s.float())).sum(-1) / temperature
    d = (dot + (lse_s - lse_t)).clamp_min_(0.0)  # clamp rounding below 0
    return (d, lse_t, lse_s) if normalisers else d


def rounded_head_kl(a_t, a_s, weight, block):
    """head_kl's first line, in blocks: a_t, a_s = h_t / T, h_s / T (n, H) fp32 -> D, lse_t,
    lse_s (n,) each."""
    m_t, s_t = a_t.new_full((len(a_t),), -math.inf), a_t.new_zeros(len(a_t))
    m_s, s_s, acc = m_t.clone(), s_t.clone(), s_t.clone()  # acc: sum_v e_t(v) (z_t(v) - z_s(v))
    for j in range(0, weight.shape[0], block):
        w = weight[j:j + block].T                                                  # (H, block)
        z_t, z_s = mm(a_t, w), mm(a_s, w)                                          # (n, block)
        diff = z_t - z_s
        m_t, s_t, decay = fold_block_(m_t, s_t, z_t)                               # z_t: e_t
        acc = acc * decay + (z_t * diff).sum(-1)
        m_s, s_s, _ = fold_block_(m_s, s_s, z_s)
    lse_t, lse_s = m_t + s_t.log(), m_s + s_s.log()
    return (acc / s_t - lse_t + lse_s).clamp_min_(0.0), lse_t, lse_s


def answer_logprobs(model, prompts, groups, comp_ids, resp_mask, temperature, checkpointing):
    """scgrpo.answer_logprobs's plain lines,
        log_softmax(model(prompt + answer).logits / T).gather(-1, answer ids),
    with one prefill per group (none under activation checkpointing, which drops the KV cache)
    and the LM head in vocabulary blocks with no (n, V) matrix. prompts: every group's;
    groups (b,): each answer's group. -> (b, L), 0 outside resp_mask."""
    keys, prompt_of = distinct(groups, comp_ids.device)
    if checkpointing:
        h = completion_hidden(model, [prompts[g] for g in groups], comp_ids, resp_mask)
    else:
        h = shared_prefix_hidden(model, [prompts[g] for g in keys], prompt_of, comp_ids, resp_mask)
    lp = head_logprobs(model.get_output_embeddings(), h, comp_ids[resp_mask], temperature,
                       dtype=getattr(model, "autocast_dtype", None))  # bf16: a bf16 head  (n,)
    return torch.zeros(resp_mask.shape, device=comp_ids.device).masked_scatter(resp_mask, lp)


@torch.no_grad()
def teacher_kl(model, ro, rows, teacher_prompts, prompt_of, comp_ids, resp_mask, temperature):
    """scgrpo.teacher_kl's plain lines (a student and a teacher forward, F.kl_div over the
    vocabulary, each sampled token's log-probability on both sides), with one prefill per
    distinct prompt and no (n, V) matrix. In fp32 the student's side comes from the states the
    sampler kept (ro.fast_states: the same weights computed them, D once a step); under bf16 it is
    a full forward of the student's prompt and answer, as the teacher gets. Arguments as
    scgrpo.teacher_kl's. -> D, log p_teacher(o_t), log p_student(o_t), each (n,)"""
    G, head = ro.correct.shape[1], model.get_output_embeddings()
    if ro.fast_states is not None:  # the student's states (n, H) and log-normalisers (n,)
        L, (hidden, lse) = resp_mask.shape[1], ro.fast_states
        h_s, lse_s = hidden[rows, :L][resp_mask], lse[rows, :L][resp_mask]
    else:
        groups, of = distinct((rows // G).tolist(), comp_ids.device)
        h_s = shared_prefix_hidden(model, [ro.prompts[g] for g in groups], of, comp_ids,
                                   resp_mask)
        lse_s = None  # head_kl takes it from the same (under bf16, rounded) logits as D
    h_t = shared_prefix_hidden(model, teacher_prompts, prompt_of, comp_ids, resp_mask)  # (n, H)
    d, lse_t, lse_s = head_kl(h_t, h_s, lse_s, head, temperature, normalisers=True)
    w = head.weight[comp_ids[resp_mask]]  # log p(o_t) = z(o_t) - log sum_v exp z(v), both sides
    z_t, z_s = (target_logits(h.float() / temperature, w) for h in (h_t, h_s))
    return d, z_t - lse_t, z_s - lse_s
