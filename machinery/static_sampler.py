"""
The fast sampler with every shape fixed: the decoding step a CUDA graph or torch.compile can
capture once and replay for every token. It draws from the same distribution as speed.sample
(inverse-CDF draws from softmax(z / T), the same EOS rule, the same outputs and kept states), but:

  speed.sample                                   sample_static
  finished rows leave the batch                  they stay, masked: their tokens are padding
  the attention mask grows by torch.cat          a (N, P + max_new) mask written in place
  keys and values of the tokens so far           transformers' StaticCache: P + max_new slots
  checks for all rows done at every token        every `check_every` tokens

So its shapes, and the work of a step, stay those of the whole batch to the end: on a CPU,
dropping rows is the cheaper trade (docs/speed.md). Nothing here is CUDA-only; what a GPU
would add (the graph capture) has not run on a GPU and is not here. The tests hold its tokens,
masks and states to speed.sample's.
"""
import torch

from transformers.cache_utils import StaticCache

from machinery.models import autocast
from machinery.speed import head_logits, prefill, sample_tokens


def static_cache(model, prompts_cache, n, length):
    """A StaticCache of B * n rows and `length` slots holding the prefilled prompts' keys and
    values (prompts_cache: the prefill's cache, B rows of P slots), each row repeated n times."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    for layer, prompt in zip(cache.layers, prompts_cache.layers):
        k, v = prompt.keys.repeat_interleave(n, 0), prompt.values.repeat_interleave(n, 0)
        layer.lazy_initialization(k, v)  # allocates (B n, heads, length, d)
        layer.keys[:, :, :k.shape[2]], layer.values[:, :, :k.shape[2]] = k, v
        layer.cumulative_length.fill_(k.shape[2])
    return cache


def decode_step(model, cache, tok, attn, pos):
    """One token for every row: the model's final hidden state (N, H) after tokens tok (N,) at
    positions pos (N, 1), attending to the slots attn (N, P + max_new) marks. The shapes never
    change from one call to the next."""
    with autocast(model):
        out = model.base_model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                               cache=cache, use_cache=True)
    return out.last_hidden_state[:, -1].float()


@torch.no_grad()
def sample_static(model, prompts, n, max_new, temperature, eos_ids, pad_id, gen, keep_states=False,
                  check_every=8, step=decode_step):
    """speed.sample's answers with static shapes. Arguments and results as speed.sample's; step:
    the one-token step (decode_step, or a compiled copy of it). A finished row keeps running on
    padding, its tokens thrown away, and its draws still consume the generator: with T > 0 the
    samples equal speed.sample's up to the first row's EOS, after which the draws differ."""
    device, head = next(model.parameters()).device, model.get_output_embeddings()
    out, prompt_attn, pos = prefill(model, prompts, pad_id)                        # (B, P)
    B, P = prompt_attn.shape
    N, length = B * n, P + max_new
    cache = static_cache(model, out.cache, n, length)
    attn = torch.zeros((N, length), dtype=torch.long, device=device)               # in place
    attn[:, :P] = prompt_attn.repeat_interleave(n, 0)
    pos = pos[:, -1:].repeat_interleave(n, 0)                                      # (N, 1)
    h = out.last_hidden_state[:, -1].float().repeat_interleave(n, 0)               # (N, H)
    comp_ids = torch.full((N, max_new), pad_id, dtype=torch.long, device=device)
    resp_mask = torch.zeros((N, max_new), dtype=torch.bool, device=device)
    hidden = torch.zeros((N, max_new, h.shape[1]), device=device) if keep_states else None
    lse = torch.zeros((N, max_new), device=device) if keep_states else None
    eos = torch.tensor(eos_ids, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)                         # (N,)
    logits = torch.empty(N, head.weight.shape[0], device=device)                   # (N, V)
    for t in range(max_new):
        tok, lse_t = sample_tokens(head_logits(h, head.weight, logits), temperature, gen)
        alive = ~done                                                              # (N,)
        comp_ids[:, t] = torch.where(alive, tok, comp_ids[:, t])
        resp_mask[:, t] = alive
        if keep_states:
            hidden[:, t] = torch.where(alive[:, None], h, hidden[:, t])
            lse[:, t] = torch.where(alive, lse_t, lse[:, t])
        done |= torch.isin(tok, eos)
        if t == max_new - 1 or (t % check_every == check_every - 1 and bool(done.all())):
            break
        attn[:, P + t] = (~done).long()  # a finished row's later slots stay unmarked
        pos = pos + 1
        h = step(model, cache, tok.masked_fill(done, pad_id), attn, pos)
    L = max(1, int(resp_mask.sum(1).max()))
    if not keep_states:
        return comp_ids[:, :L], resp_mask[:, :L], None
    return comp_ids[:, :L], resp_mask[:, :L], (hidden[:, :L], lse[:, :L])
