r"""
Speed and memory of one training step: our GRPO, our SC-GRPO (and DAPO, variants/dapo.py), and
TRL's GRPOTrainer, with the same model, prompts, group size, answer length, temperature and reward.

    python tools/bench.py --model random:qwen-tiny                    # TRL too: needs requirements/bench.txt
    python tools/bench.py --model random:qwen2.5-0.5b --prompts-per-step 1 --group-size 8 --max-new-tokens 128 \
        --impls scgrpo
    python tools/bench.py --model SmolLM2-135M --data data/addition --prompts-per-step 4 --max-new-tokens 64 \
        --micro-batch 16 --impls scgrpo scgrpo@bf16                                 # bf16 vs fp32 on a CPU
    python tools/bench.py --model SmolLM2-135M --data data/addition --prompts-per-step 4 --max-new-tokens 64 \
        --micro-batch 16 --decode-attention-cost            # bf16 sampling with each decode attention
    python tools/bench.py --model SmolLM2-135M --data data/addition --prompts-per-step 8 --max-new-tokens 64 \
        --micro-batch 16 --shared-kv-cost       # teacher and update with and without repeat_kv's copies
    python tools/bench.py --gpu-check                  # on a lent GPU: the CUDA-only paths, pass/fail, < 5 min
    python tools/bench.py --gpu-check --small --device cpu    # the same script at toy sizes, on a CPU (a test)

The models are random, so the GSM8K verifier would give every answer 0 and no update would run.
The benchmark therefore grades with a coin flip fixed by the answer's text (crc32 % 2) for all
implementations: groups hold both outcomes and every step really updates. Each implementation
runs in its own process (peak memory is per process): `--steps` timed steps after one warm-up.
Peak memory is the process's peak RSS on CPU, torch.cuda.max_memory_allocated on GPU.
`--model random:ARCH` builds a random-weight model of a published shape (SHAPES) with Qwen's
151,936-entry vocabulary and a character-level tokenizer, in a temporary folder: the real sizes,
offline. Without --data the questions are the built-in addition task's.
"""
import argparse
import atexit
import dataclasses
import functools
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
import machinery  # noqa: E402
from machinery import at_least, batching, metrics, models, runs, speed, tasks  # noqa: E402
import scgrpo as S  # noqa: E402
from variants import dapo  # noqa: E402


SHAPES = {  # Qwen2 shapes as published in each model's config.json
    "qwen-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
}


def write_random_model(arch, folder, vocab_size=151936):
    """A Qwen2 of a SHAPES shape with random weights and Qwen's vocabulary size, saved with a
    character-level ChatML tokenizer over that vocabulary (every id decodes to something).
    For speed and memory at the real size: it learns nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    if arch not in SHAPES:
        machinery.die(f"--model random:{arch}: unknown shape; use one of {', '.join(SHAPES)}")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {w: i for i, w in enumerate(specials + chars)}
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = models.char_tokenizer(vocab, template, eos="<|im_end|>", pad="<|endoftext|>", specials=specials[:2])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                         rope_theta=1e6, max_position_embeddings=32768, bos_token_id=0,
                                         eos_token_id=2, pad_token_id=0, **SHAPES[arch]))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def coin_reward(completion, gold):
    return zlib.crc32(completion.encode("utf-8", "replace")) % 2 == 1


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def spread(values):
    """-> (median, min, max) of a list of timings."""
    return statistics.median(values), min(values), max(values)


def run_ours(args, impl):
    """One of our implementations: "scgrpo", or "scgrpo@bf16" under bf16 ("dapo": variants/dapo.py's
    step). The path users run: the SmolLM2 and hub presets run --fast, so bench does too; --plain times
    scgrpo.py's plain lines. -> per phase the (median, min, max) over the timed steps, and the tokens
    each phase handled."""
    S.verify = coin_reward  # the same reward as TRL's below
    algo, _, dtype = impl.partition("@")
    taught = []  # the teacher prompts each step builds, for its token counts

    def counted(*a):  # scgrpo.teacher_prompts, keeping what it returns
        return taught.append(S.teacher_prompts(*a)) or taught[-1]
    route = dict(route=S.grpo_routes) if algo == "grpo" else {}  # as scgrpo.main does
    Config, train_step = ((dapo.Config, dapo.dapo_step) if algo == "dapo" else
                          (S.Config, functools.partial(S.train_step, context=counted, **route)))
    cfg = Config(model=args.model, task="gsm8k" if args.data else "addition", data=args.data or "",
                 algo=algo, prompts_per_step=args.prompts_per_step, fast=not args.plain,
                 group_size=args.group_size, max_new_tokens=args.max_new_tokens, micro_batch=args.micro_batch,
                 grad_checkpoint=args.grad_checkpoint, lr=1e-6, seed=0, device=args.device)
    device = models.pick_device(cfg.device)
    train_rows, _ = tasks.load_task(cfg)
    model, tok = models.load_model(cfg.model, cfg.seed)
    model.to(device).eval()
    runs.set_up_passes(model, device, dtype == "bf16", cfg.fast)  # as a run does (runs.Run)
    if cfg.grad_checkpoint:
        model.activation_checkpointing_enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    batcher, rng, gen = tasks.Batcher(train_rows, 0), random.Random(0), torch.Generator(device).manual_seed(0)
    sampled, real_sample_groups = [], S.sample_groups
    S.sample_groups = lambda *a, **k: sampled.append(real_sample_groups(*a, **k)) or sampled[-1]  # token counts
    rows = []
    for step in range(args.steps + 1):
        sampled.clear()
        taught.clear()
        t0 = time.time()
        m, _ = train_step(model, opt, tok, cfg, batcher, rng, gen, models.stop_ids(model, tok), step + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:  # step 0 is the warm-up
            rows.append(dict(total=time.time() - t0, generate=m["t_sample"], teacher=m["t_teacher"],
                             update=m["t_update"], reward=m["reward_mean"], updated=m["answers_updated"],
                             tokens=step_tokens(sampled, taught)))
    timings = {k: spread([r[k] for r in rows]) for k in ("total", "generate", "teacher", "update")}
    tokens = {k: statistics.mean(r["tokens"][k] for r in rows) for k in rows[0]["tokens"]}
    tokens["rescored"] = bool(tokens["rescored"])
    return dict(impl=impl, path="plain" if args.plain else "fast", **timings, tokens=tokens,
                per_token=flops_per_token(model.config), params=sum(p.numel() for p in model.parameters()),
                reward=statistics.mean(r["reward"] for r in rows), updated=min(r["updated"] for r in rows),
                peak_gib=peak_memory_gib(device))


def step_tokens(rollouts, teacher_prompts):
    """What one step had to compute, in tokens, from what it sampled (Rollouts) and the teacher
    prompts it built (each answer's, None for none): its prompts (each prefilled once), the answers'
    tokens, the sampler's decoding steps (each reads every weight once), and the teacher's distinct
    prompts (their common beginning once, prefix_tokens). A bf16 run re-scores the student too
    (flop_floors)."""
    return dict(prompts=sum(len(p) for ro in rollouts for p in ro.prompts),
                answers=sum(int(ro.mask.sum()) for ro in rollouts),
                decode_steps=sum(int(ro.mask.sum(1).max()) for ro in rollouts),
                teacher_prompts=sum(prefix_tokens(distinct_prompts(t)) for t in teacher_prompts),
                rescored=all(ro.fast_states is None for ro in rollouts))


def distinct_prompts(prompts):
    """The distinct prompt objects of a step's teacher prompts (one per reference), Nones left out."""
    return list({id(p): p for p in prompts if p is not None}.values())


def flops_per_token(c):
    """FLOPs per token of a model of config c: 2 per parameter for the body's forward (attention's
    own FLOPs left out: small at these lengths), 2 H V for the LM head. -> (body, head)"""
    H, V = c.hidden_size, c.vocab_size
    per_layer = 2 * H * H + 2 * H * (H // c.num_attention_heads) * c.num_key_value_heads + 3 * H * c.intermediate_size
    return 2 * per_layer * c.num_hidden_layers, 2 * H * V


def flop_floors(per_token, tokens, gflops, weight_bytes=0, gbps=math.inf):
    """The least time each phase could take at `gflops` (GFLOP/s of a large matmul here), from the
    FLOPs per token of body and head (flops_per_token), 3x forward for forward plus backward.
    Generation: prompts once, each answer token through body and head. Teacher: its distinct
    prompts through the body and the answers through body and head, and when the sampler kept no
    states (bf16) the student's prompts and answers again. Update: prompts and answers forward
    and backward. Generation is also bound by memory: each decoding step reads every weight
    (weight_bytes) once, at gbps GB/s; its floor is the larger of the two. -> {phase: seconds}"""
    body, head = per_token
    p, a = tokens["prompts"], tokens["answers"]
    teacher = tokens.get("teacher_prompts", 0) * body + a * (body + head)
    teacher += (p * body + a * (body + head)) * tokens.get("rescored", False)
    flops = dict(generate=p * body + a * (body + head), teacher=teacher,
                 update=3 * ((p + a) * body + a * head))
    floors = {k: v / (gflops * 1e9) for k, v in flops.items()}
    reads = tokens.get("decode_steps", 0) * weight_bytes / (gbps * 1e9)
    return dict(floors, generate=max(floors["generate"], reads))


def copy_gbps(device, n=2 ** 27):
    """GB/s of copying one n-element fp32 tensor into another (bytes read plus written): the memory
    bandwidth the generation floor assumes."""
    a, b = torch.empty(n, device=device), torch.ones(n, device=device)
    a.copy_(b)
    t0, reps = time.time(), 5
    for _ in range(reps):
        a.copy_(b)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * 4 * n * reps / (time.time() - t0) / 1e9


def matmul_gflops(dtype, device, n=2048, h=576, f=1536):
    """GFLOP/s of an (n, h) x (h, f) matmul in `dtype` on this device with its threads: the rate
    the floors assume (the body's matmuls have about these shapes for SmolLM2). 20 repeats, or as
    many as start within a second: bf16 on a CPU without bf16 instructions runs near 1 GFLOP/s,
    where one repeat takes about 4 s and 20 took 76 s."""
    a, b = torch.randn(n, h, dtype=dtype, device=device), torch.randn(h, f, dtype=dtype, device=device)
    a @ b
    t0, reps = time.time(), 0
    while reps < 20 and (reps == 0 or time.time() - t0 < 1.0):
        a @ b
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n * h * f * reps / (time.time() - t0) / 1e9


def run_trl(args, sc=False, bf16=False):
    """TRL's GRPOTrainer, or with sc=True our SCGRPOTrainer subclass of it (trl_scgrpo.py); bf16:
    TRL's own bf16 mixed precision (bf16=True). Only whole steps are timed: TRL logs no phases."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    train_rows, _ = tasks.load_task(S.Config(task="gsm8k" if args.data else "addition", data=args.data or ""))
    prompts = [[{"role": "system", "content": S.SYSTEM_PROMPT}, {"role": "user", "content": r["question"]}]
               for r in train_rows[:args.prompts_per_step * (args.steps + 2)]]
    rewards_seen = []

    def reward_fn(completions, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [float(coin_reward(t, "")) for t in texts]
        rewards_seen.extend(out)
        return out

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.time())

    device = models.pick_device(args.device)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.micro_batch, num_generations=args.group_size,
        gradient_accumulation_steps=args.prompts_per_step * args.group_size // args.micro_batch,
        gradient_checkpointing=args.grad_checkpoint, max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, loss_type="grpo", learning_rate=1e-6, max_steps=args.steps + 1, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=device.type == "cpu", bf16=bf16,
        chat_template_kwargs={"enable_thinking": False}, seed=0, shuffle_dataset=False)
    Trainer = GRPOTrainer
    if sc:
        from trl_scgrpo import SCGRPOTrainer as Trainer
    model, tok = models.load_model(args.model, 0)  # as ours load it: a name such as SmolLM2-135M, or a folder
    trainer = Trainer(model=model, reward_funcs=[reward_fn], args=config,
                      train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                      processing_class=tok, callbacks=[Clock()])
    t0 = time.time()
    trainer.train()
    steps = [b - a for a, b in zip([t0] + stamps, stamps)][1:]  # drop the warm-up step
    return dict(impl=("trl-scgrpo" if sc else "trl") + ("@bf16" if bf16 else ""), path="TRL", total=spread(steps),
                generate=None, teacher=None, update=None, tokens=None, reward=statistics.mean(rewards_seen),
                updated=None, peak_gib=peak_memory_gib(device))


def partial_batch(ro):
    """The Batch of `ro` with every group routed 'partial', its references drawn from seed 0 as
    scgrpo.train_step draws them."""
    rng, routes = random.Random(0), ["partial"] * len(ro.problems)
    refs = [S.pick_references(c, r, rng) for c, r in zip(ro.correct.bool().tolist(), routes)]
    return S.make_batch(ro, routes, S.group_advantages(ro.correct), refs)


def partial_teacher_pass(model, tok, cfg, ro, own_prompt=False):
    """scgrpo.sc_credit on partial_batch(ro). own_prompt: the teacher gets the student's own
    prompt, so D measures only the rounding between the two passes (the KL floor). -> its metrics"""
    batch = partial_batch(ro)
    prompts = S.teacher_prompts(tok, ro, batch)
    if own_prompt:
        prompts = [ro.prompts[b] for b in batch.question.tolist()]
    return S.sc_credit(model, cfg, ro, dataclasses.replace(batch, teacher_prompt=prompts))[1]


def gpu_check(args):
    """The paths of scgrpo.py that only a GPU takes, as one pass/fail table: for every attention
    kernel, left-padded batches give finite states and the teacher given the student's own
    prompt gives D at rounding level (P95 < 1e-3 nats), in bf16 and fp32; then one step of the
    hub preset at the real Qwen2.5-0.5B shape (random weights, offline: a character tokenizer,
    answers run to the 512-token cap) with peak memory per phase and sampling tokens/s."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import Qwen2Config, Qwen2ForCausalLM
    device = models.pick_device(args.device)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    real = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    config = Qwen2Config(vocab_size=4096 if args.small else 151936, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         **(small if args.small else real))
    torch.manual_seed(0)
    model, tok = Qwen2ForCausalLM(config).to(device).eval(), models.make_tiny(0)[1]
    rows, report = tasks.make_arith()[0], []  # (check, measured, pass)
    kernels = [("eager", None), ("sdpa math", SDPBackend.MATH), ("sdpa flash", SDPBackend.FLASH_ATTENTION)]
    if device.type == "cuda":
        kernels += [("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)]
    for name, backend in kernels:
        model.set_attn_implementation("eager" if backend is None else "sdpa")
        for dtype in (torch.bfloat16, None):
            model.autocast_dtype, label = dtype, f"{name}, {'bf16' if dtype else 'fp32'}"
            try:
                with sdpa_kernel(backend) if backend is not None else models.nullcontext():
                    prompts = [tok(r["question"] * k)["input_ids"] for k, r in zip((1, 6, 2), rows)]
                    comp, mask, (h, lse) = speed.sample(model, prompts, 2, 8, 1.0, [0], 0,
                                                        torch.Generator(device).manual_seed(0), keep_states=True)
                    with torch.no_grad():
                        h_full = speed.completion_hidden(model, [p for p in prompts for _ in (0, 1)], comp, mask)
                    finite = bool(torch.isfinite(h).all() and torch.isfinite(lse[mask]).all()
                                  and torch.isfinite(h_full).all())
                    report.append((f"padding, {label}: states finite", str(finite), finite))
                    cfg = S.Config(algo="scgrpo", group_size=4, max_new_tokens=16, micro_batch=8)
                    ro = S.sample_groups(model, tok, cfg, rows[:4], 4, 1.0, torch.Generator(device).manual_seed(0),
                                         [0])
                    ro.correct = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 4)
                    stats = partial_teacher_pass(model, tok, cfg, ro, own_prompt=True)
                    ok = stats["kl_p95"] < 1e-3 and stats["kl_nonfinite"] == 0
                    report.append((f"KL floor, {label}: P95 of D < 1e-3", f"{stats['kl_p95']:.2e}", ok))
            except RuntimeError as e:  # a kernel that refuses masked or fp32 input is not used by HF
                report.append((f"{label}", "kernel refused: " + str(e).splitlines()[0][:60], None))
    model.set_attn_implementation("sdpa")
    cfg = S.Config(**{**S.PRESETS["hub"], "max_new_tokens": 16 if args.small else 512, "lr": 1e-6})
    models.set_precision(model, models.resolve_dtype("auto", device, cfg.fast) == "bf16")  # as a run
    if cfg.grad_checkpoint:
        model.activation_checkpointing_enable({"use_reentrant": False})
    S.verify = coin_reward
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    m, _ = S.train_step(model, opt, tok, cfg, tasks.Batcher(rows, 0), random.Random(0),
                        torch.Generator(device).manual_seed(0), [0], 1)
    tokens = m["len_mean"] * cfg.prompts_per_step * cfg.group_size
    report.append(("one hub-preset step: finite loss", f"{m['loss']:.3g} in {m['t_sample'] + m['t_teacher'] + m['t_update']:.1f} s",
                   math.isfinite(m["loss"])))
    report.append(("sampling tokens/s", f"{tokens / m['t_sample']:.0f} ({tokens:.0f} tokens)", None))
    metrics.peak_memory_gb(device)
    S.evaluate(model, tok, rows[:cfg.eval_batch], S.Config(**{**vars(cfg), "eval_k": 8}), [0])
    mem_eval = metrics.peak_memory_gb(device)
    if device.type == "cuda":
        phases = {k: m[k] for k in ("mem_sample_gb", "mem_teacher_gb", "mem_update_gb")}
        report += [(f"peak {k[4:-3]} GiB", f"{v:.2f}", None) for k, v in phases.items()]
        report.append(("evaluation peak <= a training step's peak", f"{mem_eval:.2f} GiB",
                       mem_eval <= max(phases.values()) * 1.05))
    # the decoding loop: today's sampler against the static-shape one, 64 rows of one prompt to the
    # cap (no stop token), bf16 weights as a run sets them up; the sampled tokens must match
    from machinery.static_sampler import sample_static
    copy, prompt = models.no_grad_model(model), [tok(rows[0]["question"])["input_ids"]]
    for cap in (8, 16) if args.small else (256, 512):
        got = {}
        for name, sampler in (("speed.sample", speed.sample), ("static, eager", sample_static)):
            sampler(copy, prompt, 64, 4, 1.0, [], 0, torch.Generator(device).manual_seed(0))  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            (ids, _, _), seconds = timed(sampler, copy, prompt, 64, cap, 1.0, [], 0,
                                            torch.Generator(device).manual_seed(0))
            got[name] = ids
            report.append((f"sampling, {name}, 64 rows x {cap} tokens: tokens/s",
                           f"{64 * cap / seconds:.0f}", None))
        same = float((got["speed.sample"] == got["static, eager"]).float().mean())
        report.append((f"static sampler, {cap} tokens: share of tokens as today's (no stop: all)",
                       f"{same:.4f}", None))
    print(f"\ngpu-check on {device} ({models.cuda_status()}), torch {torch.__version__}, "
          f"{'toy' if args.small else 'Qwen2.5-0.5B'} shape\n")
    print("| check | measured | result |\n|---|---|---|")
    for check, measured, ok in report:
        print(f"| {check} | {measured} | {'-' if ok is None else 'PASS' if ok else 'FAIL'} |")
    failed = [c for c, _, ok in report if ok is False]
    print(f"\n{len(failed)} failed" + (": " + "; ".join(failed) if failed else ""))
    return 1 if failed else 0


def first_questions(args, tok):
    """The first --prompts-per-step training questions (--data's, or the addition task's) and their
    encoded prompts: the one batch rescore_cost, decode_attention_cost and shared_kv_cost time."""
    rows = tasks.load_task(S.Config(task="gsm8k" if args.data else "addition", data=args.data or ""))[0]
    rows = rows[:args.prompts_per_step]
    return rows, [S.encode_prompt(tok, r["question"]) for r in rows]


def partial_rollout(args, model, tok, cfg, keep_states):
    """The first questions' answers, sampled as a --fast run samples them (seed 0, temperature
    0.8), with 3 of each group's answers taken as correct: the batch rescore_cost and
    shared_kv_cost time. keep_states: the sampler's hidden states and normalisers kept."""
    rows, prompts = first_questions(args, tok)
    ids, mask, states = speed.sample(models.no_grad_model(model), prompts, cfg.group_size, cfg.max_new_tokens,
                                     0.8, models.stop_ids(model, tok), tok.pad_token_id or 0,
                                     torch.Generator().manual_seed(0), keep_states=keep_states)
    reward = torch.tensor([[1.0] * 3 + [0.0] * (cfg.group_size - 3)] * len(rows))
    return S.Rollout(rows, prompts, ids, mask, batching.decode(tok, ids, mask), reward, states)


def rescore_cost(args):
    """Under --dtype bf16 the teacher pass re-scores the student instead of reading the
    sampler's states (speed.sample keeps none in bf16). The teacher phase both ways on one batch, on the path a
    --dtype bf16 run takes (the bf16 weight copy; the fast path unless --plain): 4 questions x 8
    answers, 3 of them taken as correct (partial-solve groups), the median of 3 timings."""
    model, tok = models.load_model(args.model, 0)
    models.set_precision(model.eval(), True)
    models.widen_decode_attention(model)  # its sampler as a --fast run's
    cfg = S.Config(algo="scgrpo", group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                   temperature=0.8, micro_batch=args.micro_batch, fast=not args.plain)
    ro = partial_rollout(args, model, tok, cfg, keep_states=True)
    rollouts = {"sampler states": ro, "re-scored": dataclasses.replace(ro, fast_states=None)}
    times = {k: [] for k in rollouts}
    for _ in range(3):
        for name, ro in rollouts.items():
            t0 = time.time()
            partial_teacher_pass(model, tok, cfg, ro)
            times[name].append(time.time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"teacher phase under --dtype bf16 ({'plain lines' if args.plain else 'fast path'}), "
          f"{args.model_name}, {len(ro.problems)} x {cfg.group_size} answers, "
          f"{int(ro.mask.sum())} tokens: " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()))
    print(f"re-scored / sampler states: {med['re-scored'] / med['sampler states']:.2f}")
    for name, ro in rollouts.items():  # the KL floor: the teacher given the student's own prompt
        st = partial_teacher_pass(model, tok, cfg, ro, own_prompt=True)
        print(f"KL floor under bf16, student from {name}: P50 {st['kl_p50']:.2e}, P95 {st['kl_p95']:.2e}")


def decode_attention_cost(args):
    """Under --dtype bf16 on a CPU, the sampler's attention at its decoding steps (one query token)
    in torch's bf16 kernel, or on fp32 copies of its inputs (models.widen_decode_attention, which
    a --fast run turns on where the CPU has no AMX). The sampling phase both ways on one batch,
    alternating, the median of 3 timings; no stop token, so both run every decoding step."""
    model, tok = models.load_model(args.model, 0)
    runs.set_up_passes(model.eval(), torch.device("cpu"), True, fast=True)  # as a --fast run does
    copy = models.no_grad_model(model)
    rows, prompts = first_questions(args, tok)
    ways = {"bf16 kernel": models.SHARED_KV, "fp32 at decoding steps": models.DECODE_IN_FP32}
    times, ids = {k: [] for k in ways}, {}
    for _ in range(3):
        for name, attention in ways.items():
            copy.set_attn_implementation(attention)
            t0 = time.time()
            ids[name] = speed.sample(copy, prompts, args.group_size, args.max_new_tokens, 0.8, [],
                                     tok.pad_token_id or 0, torch.Generator().manual_seed(0))[0]
            times[name].append(time.time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    a, b = ids.values()
    print(f"sampling under --dtype bf16 (fast path), {args.model}, {len(rows)} x {args.group_size} answers "
          f"x {args.max_new_tokens} tokens: " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()))
    print(f"fp32 at decoding steps / bf16 kernel: {med['fp32 at decoding steps'] / med['bf16 kernel']:.2f}")
    print(f"same seed, same tokens: first token {(a[:, 0] == b[:, 0]).float().mean():.3f}, "
          f"all tokens {(a == b).float().mean():.3f} (a different draw changes the rest of its answer)")


def shared_kv_cost(args):
    """A --fast run on a CPU attends with models.shared_kv_attention (the kernel reads the shared
    key/value heads) where transformers' SDPA copies them (repeat_kv). The teacher pass and the
    update both ways on one batch, in fp32 and bf16: 3 of each group's answers taken as correct
    (partial-solve groups, SC-GRPO), lr 0 so every repeat sees the same weights; after one untimed
    round, the median of 3 alternating timings, and the largest difference in the update's loss."""
    rows_out = []
    for bf16 in (False, True):
        model, tok = models.load_model(args.model, 0)
        runs.set_up_passes(model.eval(), torch.device("cpu"), bf16, fast=True)  # as a --fast run does
        cfg = S.Config(algo="scgrpo", group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                       temperature=0.8, micro_batch=args.micro_batch, fast=True, lr=0.0)
        ro = partial_rollout(args, model, tok, cfg, keep_states=not bf16)  # bf16 runs re-score
        batch = partial_batch(ro)
        batch = dataclasses.replace(batch, teacher_prompt=S.teacher_prompts(tok, ro, batch))
        batch, _ = S.sc_credit(model, cfg, ro, batch)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        ways = {"repeat_kv copies": "sdpa", "shared heads": models.SHARED_KV}
        times, losses = {(k, p): [] for k in ways for p in ("teacher", "update")}, {k: [] for k in ways}
        for r in range(4):
            for name, attention in (ways.items() if r % 2 else reversed(ways.items())):
                models.attend_with(model, attention)
                t0 = time.time()
                partial_teacher_pass(model, tok, cfg, ro)
                t1 = time.time()
                losses[name].append(S.update(model, opt, cfg, ro, batch)[0]["loss"])
                if r:  # round 0 is the warm-up
                    times[name, "teacher"].append(t1 - t0)
                    times[name, "update"].append(time.time() - t1)
        med = {k: statistics.median(v) for k, v in times.items()}
        diff = max(abs(a - b) for a, b in zip(*losses.values()))
        rows_out.append(f"| {'bf16' if bf16 else 'fp32'} | {int(ro.mask.sum())} | "
                        + " | ".join(f"{med[k, p]:.2f}" for p in ("teacher", "update") for k in ways)
                        + f" | {med['shared heads', 'teacher'] / med['repeat_kv copies', 'teacher']:.3f} | "
                        f"{med['shared heads', 'update'] / med['repeat_kv copies', 'update']:.3f} | {diff:.1e} |")
    print(f"\n{machinery.machine().strip()}, {torch.get_num_threads()} threads; {args.model_name}, "
          f"{args.prompts_per_step} x {args.group_size} answers x {args.max_new_tokens} tokens, micro-batch "
          f"{args.micro_batch}, fast path; seconds, median of 3\n")
    print("| dtype | answer tokens | teacher, copies | teacher, shared | update, copies | update, shared | "
          "teacher shared/copies | update shared/copies | max loss difference |\n|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows_out))


def logprob_cost(args):
    """The teacher pass returns, beside D, the teacher's and the student's log-probability of each
    sampled token (for a fork's credit). On the fast path they cost what speed.teacher_kl adds for
    them: a row of the LM head per token and two dot products a token (the normalisers come from
    head_kl anyway); on the plain lines, two gathers from log-softmaxes already there. Timed on one
    batch, fp32 (student from the sampler's states) and bf16 (re-scored): the whole teacher pass
    (scgrpo.teacher_pass) and those added lines alone on tensors of the same size, alternating,
    after one untimed round, the median of 5; 3 of each group's answers taken as correct."""
    rows_out = []
    for bf16 in (False, True):
        model, tok = models.load_model(args.model, 0)
        runs.set_up_passes(model.eval(), torch.device("cpu"), bf16, fast=True)  # as a --fast run does
        cfg = S.Config(algo="scgrpo", group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                       temperature=0.8, micro_batch=args.micro_batch, fast=True)
        ro = partial_rollout(args, model, tok, cfg, keep_states=not bf16)  # bf16 runs re-score
        batch = partial_batch(ro)
        batch = dataclasses.replace(batch, teacher_prompt=S.teacher_prompts(tok, ro, batch))
        head = models.no_grad_model(model).get_output_embeddings()
        ids = ro.ids[batch.row][batch.active]                                      # (n,)
        h = torch.randn(len(ids), head.weight.shape[1])                            # (n, H)

        def added():  # speed.teacher_kl's lines for the log-probs, on the same sizes
            w = head.weight[ids]
            return [speed.target_logits(h / 0.8, w) - 1.0 for _ in (0, 1)]
        times = {"teacher pass": [], "log-prob lines": []}
        for r in range(6):
            for name, fn in times.items():
                t0 = time.time()
                S.teacher_pass(model, cfg, ro, batch) if name == "teacher pass" else added()
                if r:
                    fn.append(time.time() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows_out.append(f"| {'bf16' if bf16 else 'fp32'} | {len(ids)} | {med['teacher pass']:.3f} | "
                        f"{med['log-prob lines'] * 1e3:.2f} | {med['log-prob lines'] / med['teacher pass']:.4f} |")
    print(f"\n{machinery.machine().strip()}, {torch.get_num_threads()} threads; {args.model_name}, "
          f"{args.prompts_per_step} x {args.group_size} answers x {args.max_new_tokens} tokens, micro-batch "
          f"{args.micro_batch}, fast path; median of 5\n")
    print("| dtype | scored tokens | teacher pass (s) | the log-prob lines (ms) | their share |\n|---|---|---|---|---|")
    print("\n".join(rows_out))


def timed(fn, *a, **k):
    """fn(*a, **k) -> (its result, seconds)."""
    t0 = time.time()
    out = fn(*a, **k)
    return out, time.time() - t0


def prefix_tokens(prompts):
    """Tokens a pass computes for prompts that share their beginning (speed.shared_prefix_hidden):
    the common prefix once, then the rest of each distinct prompt."""
    prompts = [list(p) for p in {tuple(p): None for p in prompts}]
    common = len(os.path.commonprefix(prompts))
    return common + sum(len(p) - common for p in prompts)


def teacher_tokens(args):
    """What the teacher's pass computes on one batch of the preset's shape (3 answers of each group
    taken as correct, so every group is partial, as the benchmark's coin does about as often), in
    tokens and FLOPs: its distinct prompts (each holds the guide and a reference answer), the
    answers, and under bf16 the student re-scored. bench's teacher floor counted the answers alone
    until commit 9d13b83; this says how far that undercounted, and what SC-GRPO / GRPO the FLOPs
    predict with each count (flop_floors, FLOPs rather than seconds)."""
    model, tok = models.load_model(args.model, 0)
    runs.set_up_passes(model.eval(), torch.device("cpu"), False, fast=True)
    body, head = flops_per_token(model.config)
    cfg = S.Config(algo="scgrpo", group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                   temperature=0.8, fast=True)
    ro = partial_rollout(args, model, tok, cfg, keep_states=False)
    teacher_prompts = distinct_prompts(S.teacher_prompts(tok, ro, partial_batch(ro)))
    t_prompts = prefix_tokens(teacher_prompts)
    tokens = dict(prompts=prefix_tokens(ro.prompts), answers=int(ro.mask.sum()))
    flops = lambda **more: flop_floors((body, head), dict(tokens, **more), 1e-9)  # noqa: E731 (1e-9: FLOPs)
    floor, fp32, bf16 = (flops()["teacher"], flops(teacher_prompts=t_prompts)["teacher"],
                         flops(teacher_prompts=t_prompts, rescored=True)["teacher"])
    grpo = flops()["generate"] + flops()["update"]
    print(f"\n{args.model_name}, {len(ro.problems)} x {cfg.group_size} answers x {args.max_new_tokens} tokens: "
          f"{tokens['answers']} answer tokens; {len(teacher_prompts)} distinct teacher prompts, "
          f"{t_prompts} tokens to prefill (their common beginning once); student prompts {tokens['prompts']}\n")
    print("| teacher FLOPs counted | / the answers' alone | SC-GRPO / GRPO by FLOPs |\n|---|---|---|")
    for name, teacher in (("the answers only (bench's floor until 9d13b83)", floor),
                          ("+ teacher prompts (fp32 run)", fp32),
                          ("+ the student re-scored (bf16 run)", bf16)):
        print(f"| {name} | {teacher / floor:.3f} | {(grpo + teacher) / grpo:.3f} |")


def compile_cost(args):
    """Does torch.compile pay on this machine, its compile time included? Over the sampler calls of
    one SmolLM2 preset run (12 training batches of --prompts-per-step x G answers, then its 4
    greedy evaluations of 100 questions, each to --max-new-tokens), in fp32 and bf16 set up as a
    --fast run: speed.sample (today's), the static-shape sampler (static_sampler.sample_static)
    eager, and with its one-token step compiled by inductor. Then the teacher's pass of each
    training batch (3 answers a group taken as correct) eager and with the model's body compiled
    (dynamic shapes: every batch's prompts differ). Prints each way's seconds: the first call, the
    rest, the total."""
    from machinery.static_sampler import decode_step, sample_static
    train, test = tasks.load_task(S.Config(task="addition"))
    batcher = tasks.Batcher(train, 0)  # the preset run's order (seed 0)
    batches = [batcher.take(args.prompts_per_step) for _ in range(12)]
    rows = []
    for bf16 in (False, True):
        torch._dynamo.reset()
        model, tok = models.load_model(args.model, 0)
        runs.set_up_passes(model.eval(), torch.device("cpu"), bf16, fast=True)
        copy, eos, pad = models.no_grad_model(model), models.stop_ids(model, tok), tok.pad_token_id or 0
        calls = [([S.encode_prompt(tok, r["question"]) for r in b], args.group_size, 0.8) for b in batches]
        calls += [([S.encode_prompt(tok, r["question"]) for r in test[:100]], 1, 0.0)] * 4
        step = torch.compile(decode_step)
        ways = {"speed.sample": speed.sample, "static, eager": sample_static,
                "static, compiled step": lambda *a, **k: sample_static(*a, step=step, **k)}
        sampled = {}
        for name, sampler in ways.items():
            runs_ = [timed(sampler, copy, p, n, args.max_new_tokens, T, eos, pad,
                           torch.Generator().manual_seed(0)) for p, n, T in calls]
            rows.append((bf16, "sampling", name, [t for _, t in runs_]))
            sampled.setdefault("answers", [out for out, _ in runs_[:12]])  # speed.sample's
        cfg = S.Config(algo="scgrpo", group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                       temperature=0.8, micro_batch=args.micro_batch, fast=True)
        ros = []
        for (p, n, _), (ids, mask, _), b in zip(calls, sampled["answers"], batches):
            correct = torch.tensor([[1.0] * 3 + [0.0] * (n - 3)] * len(p))
            ros.append(S.Rollout(b, p, ids, mask, batching.decode(tok, ids, mask), correct))
        for name in ("eager", "compiled body"):
            if name == "compiled body":
                copy.base_model.forward = torch.compile(copy.base_model.forward, dynamic=True)
            times = [timed(partial_teacher_pass, model, tok, cfg, ro)[1] for ro in ros]
            rows.append((bf16, "teacher", name, times))
    print(f"\n{machinery.machine().strip()}, {torch.get_num_threads()} threads; {args.model_name}, "
          f"{args.prompts_per_step} x {args.group_size} answers x {args.max_new_tokens} tokens; seconds\n")
    print("| dtype | phase | way | first call | the other calls (median) | total, compile included |")
    print("|---|---|---|---|---|---|")
    for bf16, phase, name, times in rows:
        print(f"| {'bf16' if bf16 else 'fp32'} | {phase} | {name} | {times[0]:.2f} | "
              f"{statistics.median(times[1:]):.2f} | {sum(times):.2f} |")


OURS = ("grpo", "scgrpo", "dapo")
IMPLS = [*OURS, *(f"{a}@bf16" for a in OURS), "trl", "trl@bf16", "trl-scgrpo"]


def die(msg):
    """Bad input costs one line and exit code 2, never a traceback (nothing is written before)."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


RENAMED = {"--prompts": "--prompts-per-step", "--group": "--group-size", "--max-new": "--max-new-tokens"}


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not the usage text
        old = [f"{a} is now {b}, as in scgrpo.py" for a, b in RENAMED.items() if a in message.split()]
        die(f"{message} ({'; '.join(old) or 'see --help'})")


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default after its help (none for a flag without one)."""

    def _get_help_string(self, action):
        if isinstance(action.default, list):  # as typed on the command line, not a Python list
            return f"{action.help} (default: {' '.join(action.default)})"
        return action.help if action.default is None else super()._get_help_string(action)


def output_name(args):
    """What a run measures, for its output file's name: the check, or the model and the shape."""
    if args.gpu_check:
        return "gpu_check" + ("_small" if args.small else "")
    what = next((k for k in ("rescore_cost", "decode_attention_cost", "shared_kv_cost", "compile_cost",
                             "teacher_tokens", "logprob_cost") if getattr(args, k)), "bench")
    model = "".join(c if c.isalnum() else "_" for c in args.model.lower().replace("-135m", "")).strip("_")
    return f"{what.replace('_cost', '')}_{model}_{args.prompts_per_step}q"


def check_args(args):
    """What the parser cannot check alone, before any model folder or process exists."""
    if args.gpu_check:
        return  # --gpu-check builds its own model and batch; the other flags but --device don't apply
    if not args.model:
        die("--model is needed (random:ARCH, SmolLM2-135M or a model folder), or pass --gpu-check")
    arch = args.model.split(":", 1)[1] if args.model.startswith("random:") else None
    if arch is not None and arch not in SHAPES:
        die(f"--model random:{arch}: unknown shape; use one of {', '.join('random:' + a for a in SHAPES)}")
    if arch is None and args.model != "SmolLM2-135M" and not os.path.isfile(os.path.join(args.model, "config.json")):
        die(f"--model {args.model}: no model folder there (no config.json); use random:ARCH, SmolLM2-135M or a "
            "folder written by save_pretrained")
    if args.data and not all(os.path.isfile(os.path.join(args.data, f"{n}.jsonl")) for n in ("train", "test")):
        die(f"--data {args.data}: needs train.jsonl and test.jsonl there (GSM8K schema); leave it out for the "
            "built-in addition task")
    answers = args.prompts_per_step * args.group_size
    if answers % args.micro_batch:
        die(f"--micro-batch {args.micro_batch} does not divide --prompts-per-step x --group-size = {answers} (TRL "
            "accumulates whole micro-batches); use a divisor of it")
    if len(set(args.impls)) < len(args.impls):
        die(f"--impls {' '.join(args.impls)} names one twice; name each once")


def main():
    # allow_abbrev=False: a flag is its full name (a prefix such as --group is an error, not --group-size)
    ap = Parser(description=__doc__, formatter_class=Help, allow_abbrev=False)
    ap.add_argument("--model", help="random:ARCH (a random model of a SHAPES shape), SmolLM2-135M or a folder")
    ap.add_argument("--data", help="folder with train.jsonl/test.jsonl (GSM8K schema); without it, the addition task")
    ap.add_argument("--gpu-check", action=argparse.BooleanOptionalAction, default=False,
                    help="check the GPU-only paths (see gpu_check)")
    ap.add_argument("--small", action=argparse.BooleanOptionalAction, default=False,
                    help="--gpu-check at toy sizes (to test it on a CPU)")
    ap.add_argument("--plain", action=argparse.BooleanOptionalAction, default=False,
                    help="time scgrpo.py's plain lines (--no-fast) instead of the fast path the real-model presets run")
    ap.add_argument("--rescore-cost", action=argparse.BooleanOptionalAction, default=False,
                    help="bf16: teacher phase with and without re-scoring the student (see rescore_cost)")
    ap.add_argument("--decode-attention-cost", action=argparse.BooleanOptionalAction, default=False,
                    help="bf16 on a CPU: sampling with each decode attention (see decode_attention_cost)")
    ap.add_argument("--teacher-tokens", action=argparse.BooleanOptionalAction, default=False,
                    help="what the teacher's pass computes on one batch, against bench's floor "
                    "(see teacher_tokens)")
    ap.add_argument("--compile-cost", action=argparse.BooleanOptionalAction, default=False,
                    help="a CPU: sampling and the teacher eager and under torch.compile over one "
                    "preset run's calls (see compile_cost)")
    ap.add_argument("--logprob-cost", action=argparse.BooleanOptionalAction, default=False,
                    help="a CPU: the teacher pass against its lines for the log-probs (see logprob_cost)")
    ap.add_argument("--shared-kv-cost", action=argparse.BooleanOptionalAction, default=False,
                    help="a CPU: teacher and update with and without repeat_kv's copies (see shared_kv_cost)")
    # the same names as scgrpo.py's flags for the same settings
    ap.add_argument("--prompts-per-step", metavar="N", type=at_least(1), default=8, help="prompts per step")
    ap.add_argument("--group-size", metavar="N", type=at_least(2), default=8, help="answers per prompt (G)")
    ap.add_argument("--max-new-tokens", metavar="N", type=at_least(1), default=32, help="answer length cap (tokens)")
    ap.add_argument("--steps", metavar="N", type=at_least(1), default=3, help="timed steps after one warm-up step")
    ap.add_argument("--micro-batch", metavar="N", type=at_least(1), default=64,
                    help="answers per forward/backward (divides prompts-per-step x group-size)")
    ap.add_argument("--grad-checkpoint", action=argparse.BooleanOptionalAction, default=False,
                    help="recompute layers in backward (all implementations)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=["grpo", "scgrpo", "trl"], metavar="IMPL",
                    help=f"what to run, each in its own process: {', '.join(IMPLS)} (@bf16: ours under bf16 "
                    "autocast)")
    ap.add_argument("--out", default="", help="also write what this prints to this file; default "
                    "docs/bench/<date>_<machine>_<commit>_<what>.md; '-': print only")
    ap.add_argument("--only", default="", help=argparse.SUPPRESS)  # internal: run one impl, print JSON
    args = ap.parse_args()
    check_args(args)
    args.model_name = args.model  # as given (random:ARCH is replaced by its folder below)
    if not args.only and args.out != "-":  # the top process keeps what it prints
        sys.stdout = machinery.Tee(args.out or machinery.bench_output(output_name(args), "md", models.pick_device(
            args.device)))
    if args.gpu_check:
        sys.exit(gpu_check(args))
    if args.model.startswith("random:"):  # built once here; the subprocesses read the folder
        folder = tempfile.mkdtemp(prefix="bench-model-")
        write_random_model(args.model.split(":", 1)[1], folder)
        atexit.register(shutil.rmtree, folder, True)
        sys.argv[sys.argv.index(args.model)] = args.model = folder
    if args.rescore_cost:
        return rescore_cost(args)
    if args.decode_attention_cost:
        return decode_attention_cost(args)
    if args.shared_kv_cost:
        return shared_kv_cost(args)
    if args.logprob_cost:
        return logprob_cost(args)
    if args.compile_cost:
        return compile_cost(args)
    if args.teacher_tokens:
        return teacher_tokens(args)
    if args.only:
        run = (run_trl(args, sc=args.only.startswith("trl-scgrpo"), bf16=args.only.endswith("@bf16"))
               if args.only.startswith("trl") else run_ours(args, args.only))
        print("RESULT " + json.dumps(run))
        return
    results = {}
    for impl in args.impls:
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--only", impl]
        r = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            sys.exit(f"error: {impl} failed:\n{r.stderr[-3000:]}")
        results[impl] = json.loads(line[0][len("RESULT "):])
        print(f"{impl}: {results[impl]}", file=sys.stderr)
    report(args, results)


def report(args, results):
    """The benchmark's table: per implementation the median and range of the timed steps, each phase
    beside its FLOP floor on this machine, and the ratios the issues ask for."""
    device = models.pick_device(args.device)
    rate = {"fp32": matmul_gflops(torch.float32, device), "bf16": matmul_gflops(torch.bfloat16, device)}
    gbps = copy_gbps(device)
    cell = lambda t: "-" if t is None else f"{t[0]:.2f} ({t[1]:.2f}-{t[2]:.2f})"  # noqa: E731
    print(f"\n{machinery.machine().strip()}, {torch.get_num_threads()} threads; matmul rate here: "
          f"{rate['fp32']:.0f} GFLOP/s fp32, {rate['bf16']:.0f} bf16; memory {gbps:.1f} GB/s (generation's floor: "
          "the larger of its FLOPs and its weight reads, every weight once a decoding step)")
    print(f"{args.prompts_per_step} prompts x {args.group_size} answers x {args.max_new_tokens} new tokens, micro-batch "
          f"{args.micro_batch}, grad checkpoint {args.grad_checkpoint}, model {args.model_name}, {args.steps} timed "
          "steps\n")
    print("| impl | path | s/step: median (min-max) | generate (floor) | teacher (floor) | update (floor) | "
          "peak GiB | reward mean |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results.values():
        bf16 = r["impl"].endswith("@bf16")
        floors = (flop_floors(r["per_token"], r["tokens"], rate["bf16" if bf16 else "fp32"],
                              r.get("params", 0) * (2 if bf16 else 4), gbps) if r["tokens"] else {})
        floors = {k: v for k, v in floors.items() if k != "teacher" or r["impl"].startswith("scgrpo")}
        phases = [cell(r[k]) + (f" ({floors[k]:.2f})" if k in floors else "") for k in ("generate", "teacher", "update")]
        print(f"| {r['impl']} | {r['path']} | {cell(r['total'])} | " + " | ".join(phases)
              + f" | {r['peak_gib']:.2f} | {r['reward']:.2f} |")
    med = {k: r["total"][0] for k, r in results.items()}
    pairs = [("grpo", "trl"), ("scgrpo", "trl"), ("scgrpo", "grpo"), ("trl-scgrpo", "trl"), ("trl@bf16", "trl"),
             ("scgrpo@bf16", "trl"), ("scgrpo@bf16", "trl@bf16"), ("scgrpo@bf16", "scgrpo"),
             ("grpo@bf16", "grpo"), ("dapo@bf16", "dapo")]
    print()
    for a, b in pairs:
        if a in med and b in med:
            print(f"{a} / {b} (median step): {med[a] / med[b]:.3f}")
    if "scgrpo" in results and "grpo" in results and results["scgrpo"]["tokens"]:
        f = {k: flop_floors(results[k]["per_token"], results[k]["tokens"], 1.0) for k in ("scgrpo", "grpo")}
        grpo = f["grpo"]["generate"] + f["grpo"]["update"]  # GRPO runs no teacher
        print(f"scgrpo / grpo by FLOPs alone: {sum(f['scgrpo'].values()) / grpo:.3f}")


if __name__ == "__main__":
    main()
