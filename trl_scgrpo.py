"""
SC-GRPO on TRL's GRPOTrainer, for runs that outgrow one GPU: accelerate or DeepSpeed across
GPUs and processes, vLLM for generation. Every piece of SC-GRPO comes from scgrpo.py (routing,
references, the teacher prompt, the per-token KL, f(D), Eq. (5)), so this file and the tutorial
cannot disagree; what is here is the plumbing between TRL's batch and those functions.

How it plugs in. TRL samples the answers and scores them with the reward functions. Then, for
the whole generation batch (every process's answers, gathered):
  1. Eq. (1) advantages and routes by n_c (scgrpo.group_advantages, route_groups), references
     drawn by a random stream that is the same on every process (scgrpo.make_batch);
  2. the teacher pass and the weights (scgrpo.sc_credit): the same model with a reference in its
     system prompt re-scores each routed answer; D per token, f(D) with c over the batch's
     active tokens, and the diversity advantage of Eq. (5) in solve-none groups;
  3. TRL gets per-token advantages A_i * f(D_it), shape (B, T). Its clipped loss accepts them,
     and because f >= 0, min(rho A f, clip(rho) A f) = f * min(rho A, clip(rho) A): J_SC exactly,
     with TRL's loss code untouched.
Differences from TRL's own GRPO advantages, on purpose: the population std without TRL's +1e-4
(Eq. (1) as in scgrpo.py), and an answer counts as correct when its summed reward is > 0.5.
Every process runs the teacher on the whole generation batch (each needs all of f(D) for c and
Eq. (5)), then keeps its own rows: simple, and N processes do N times the teacher's work.

The teacher's prompt is the dataset's own conversation with the guide and the reference joined
to its system message (or a new one), rendered with the trainer's chat_template_kwargs: teacher
and student differ only by the reference. An answer that TRL masked as truncated
(mask_truncated_completions) or that no reward function could score (NaN) is never correct and
never a reference, and gets advantage 0. D is measured once per generation batch: with
num_iterations > 1, or steps_per_generation above the gradient accumulation, the later steps on
that batch reuse weights f(D) measured under the policy that sampled it (as scgrpo.py does for
its PPO epochs). A PEFT model, or one whose logits are not its LM head applied to the final
hidden state (soft-capping), gets the plain teacher of scgrpo.py (full logits, F.kl_div; more
memory), and so does a model sharded by FSDP2 or ZeRO-3; the rest get the fast one.

Supported settings, and refused ones (one line at construction): DDP, FSDP2 and DeepSpeed ZeRO-3
run (each tested on two CPU processes), and ZeRO-1/2 (never run). Under FSDP2 and ZeRO-3 the
LM head's weight is a shard outside a forward pass, so the teacher scores through model(...)
itself, whose hooks gather each module's parameters in turn: the plain teacher, at the memory of
full logits (docs/trl.md). FSDP1 is refused (the teacher would run the unwrapped module, whose
parameters are flat shards; use FSDP2). Refused too: loss_type 'luspo' (a mean over every padded
position), use_liger_kernel (one advantage per answer), top_entropy_quantile < 1 (it masks tokens
after c was set over them), scale_rewards other than 'group' and multi_objective_aggregation
other than 'sum_then_normalize' (Eq. (1) over summed rewards replaces both). loss_type other
than 'grpo' (the paper's per-sequence mean) runs, with a one-line note.

Run it (the same dataset format as scgrpo.py's tasks; `--help` for every flag):
    python trl_scgrpo.py --model tiny --task arith --steps 30                 # CPU, a minute
    python trl_scgrpo.py --model SmolLM2-135M --task addition --steps 4      # CPU, a few minutes
    torchrun --standalone --nproc_per_node 2 trl_scgrpo.py --steps 3   # two CPU processes
    accelerate launch --num_processes 8 trl_scgrpo.py --model Qwen3-1.7B --task gsm8k --use-vllm
    accelerate launch --config_file examples/accelerate_fsdp2.yaml trl_scgrpo.py --bf16 ...  # FSDP2
    accelerate launch --config_file examples/accelerate_zero3.yaml trl_scgrpo.py --bf16 ... # ZeRO-3
"""
import argparse
import json
import os
import random
import sys
import warnings
from dataclasses import replace

import torch
from accelerate.utils import gather_object, is_peft_model
from trl import GRPOConfig, GRPOTrainer

from machinery import die
from machinery.cli import ArgParser, check_config
from machinery.models import TINY_TEMPLATE, load_model, logits_are_head_of_hidden, set_precision
from machinery.tasks import load_task
import scgrpo as S


def refusal(args, fsdp_version=None):
    """The first setting this trainer cannot honour, as one line with its fix; None if none.
    args: a GRPOConfig; fsdp_version: 1 or 2 when the launcher shards parameters with FSDP."""
    if fsdp_version == 1:
        return ("FSDP1 (fsdp_version 1) is not supported: the teacher would score through the "
                "unwrapped module, whose flat parameters are shards outside the FSDP wrapper; "
                "set fsdp_version: 2 (FSDP2) or use DeepSpeed ZeRO-3")
    if args.loss_type == "luspo":
        return ("loss_type='luspo' averages over every padded position, which would scale the "
                "per-token advantages by 1/T; use 'grpo' (the paper's), 'dr_grpo', 'bnpo' or 'dapo'")
    if args.use_liger_kernel:
        return ("use_liger_kernel=True takes one advantage per answer, SC-GRPO gives one per "
                "token; set use_liger_kernel=False")
    if args.top_entropy_quantile < 1:
        return (f"top_entropy_quantile={args.top_entropy_quantile} masks tokens after c was set "
                "over them; set it to 1.0")
    if args.scale_rewards != "group":
        return (f"scale_rewards={args.scale_rewards!r} is not used: SC-GRPO's Eq. (1) scales by "
                "each group's std; set scale_rewards='group'")
    if args.multi_objective_aggregation != "sum_then_normalize":
        return (f"multi_objective_aggregation={args.multi_objective_aggregation!r} is not used: "
                "SC-GRPO sums the reward functions, then Eq. (1); set 'sum_then_normalize'")
    return None


def teacher_conversation(conversation, reference, tiny=False):
    """Eq. (4) on a dataset's own prompt: the guide and the reference join its system message
    (or a new one); every other message is kept. A plain-text prompt gets them in front."""
    extra = reference if tiny else S.GUIDE + reference  # the tiny model reads digits only
    if isinstance(conversation, str):
        return extra.lstrip() + "\n\n" + conversation
    messages = [dict(m) for m in conversation]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] += extra
    else:
        messages.insert(0, {"role": "system", "content": extra.lstrip()})
    return messages


def usable_references(correct, route, rng, usable):
    """scgrpo.pick_references, except in a solve-none group: its reference o_r is drawn among its
    usable answers only (an emptied answer has no text to condition on), and an unusable answer
    gets no reference, so no row and no score in Eq. (5) (an empty one would score 0 / 0)."""
    if route != "solve_none":  # a partial group's references are correct, hence usable
        return S.pick_references(correct, route, rng)
    candidates = [i for i in range(len(correct)) if usable[i]]
    r = rng.choice(candidates) if candidates else None
    return [None if i == r or not usable[i] else r for i in range(len(correct))]


def text_of(completion):
    """The answer text of a TRL completion: a string, or the content of its chat messages."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def make_dataset(rows, tok):
    """TRL rows from scgrpo task rows: the student prompt of scgrpo.encode_prompt as a chat
    (the system prompt and the question), and the gold answer for the reward."""
    tiny = tok.chat_template == TINY_TEMPLATE
    system = [] if tiny else [{"role": "system", "content": S.SYSTEM_PROMPT}]
    return [{"prompt": system + [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
            for r in rows]


def correctness(completions, answer, **kwargs):
    """The reward: scgrpo's rule-based verifier, 1.0 or 0.0."""
    return [float(S.verify(text_of(c), a)) for c, a in zip(completions, answer)]


class SCGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose advantages are SC-GRPO's: A_i * f(D_it) per token, and alpha * A_div_i
    of Eq. (5) in groups with no correct answer. c_min, kl_quantile, alpha_div as in scgrpo.py;
    teacher_micro_batch: answers per teacher forward pass."""

    def __init__(self, *args, c_min=1e-4, kl_quantile=0.75, alpha_div=0.1, teacher_micro_batch=8,
                 **kwargs):
        super().__init__(*args, **kwargs)
        state = self.accelerator.state
        plugin = getattr(state, "deepspeed_plugin", None)
        zero3 = bool(self.is_deepspeed_enabled and plugin and plugin.zero_stage == 3)
        fsdp_version = state.fsdp_plugin.fsdp_version if self.is_fsdp_enabled else None
        why = refusal(self.args, fsdp_version)
        if why:
            raise ValueError(f"SCGRPOTrainer: {why}")
        if self.args.loss_type != "grpo":
            warnings.warn(f"SCGRPOTrainer: loss_type={self.args.loss_type!r} normalises the loss "
                          "differently from the paper's per-sequence mean ('grpo')", stacklevel=2)
        model = self.accelerator.unwrap_model(self.model)
        # The fast teacher (machinery/speed.py) calls the inner model and reads the head's
        # weight; a PEFT model or soft-capped logits get the plain teacher (full logits through
        # the model). So do FSDP2 and ZeRO-3: there, outside the model's own forward, the head's
        # weight is a shard (FSDP2: a DTensor of 1/N of its rows; ZeRO-3: an empty tensor), and
        # the inner model runs without its root's hooks. The plain teacher calls model(...)
        # only, whose hooks gather each module's parameters in turn, the same calls on every
        # process.
        self.sharded = zero3 or fsdp_version == 2
        fast = not self.sharded and not is_peft_model(model) and logits_are_head_of_hidden(model)
        self.sc_cfg = S.Config(algo="scgrpo", group_size=self.num_generations, c_min=c_min,
                               kl_quantile=kl_quantile, alpha_div=alpha_div, fast=fast,
                               temperature=self.args.temperature, micro_batch=teacher_micro_batch)
        self.sc_rng = random.Random(self.args.seed)  # the same on every process: same references

    def encode_teacher(self, tok, conversation, reference):
        """Token ids of the teacher prompt: teacher_conversation rendered as TRL renders the
        student's prompt (the chat template with the trainer's chat_template_kwargs)."""
        prompt = teacher_conversation(conversation, reference, tok.chat_template == TINY_TEMPLATE)
        if not isinstance(prompt, str):
            prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                             **self.chat_template_kwargs)
        return tok(prompt, add_special_tokens=False)["input_ids"]

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # (N_global, functions) for every process's answers; one summed reward per answer, and
        # whether any reward function could score it at all
        self._sc_reward = (rewards * self.reward_weights.to(rewards.device)).nansum(1)
        self._sc_scored = ~torch.isnan(rewards).all(1)
        return rewards

    def rollout(self, inputs, out):
        """The whole generation batch (all processes) as a scgrpo.Rollout (no sampler states, so
        the teacher's pass re-scores the student), its summed rewards (B, G) and which answers
        are usable (B, G)."""
        def unpadded(ids, mask):
            return [i[m.bool()].tolist() for i, m in zip(ids, mask)]
        G, device = self.num_generations, out["completion_ids"].device
        conversations = gather_object([x["prompt"] for x in inputs])
        prompts = gather_object(unpadded(out["prompt_ids"], out["prompt_mask"]))
        answers = gather_object(unpadded(out["completion_ids"], out["completion_mask"]))
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(a, dtype=torch.long) for a in answers],
                                              batch_first=True)                    # (N, L)
        mask = torch.arange(ids.shape[1]) < torch.tensor([len(a) for a in answers])[:, None]
        reward = self._sc_reward.float().cpu().view(-1, G)                         # (B, G)
        # usable: scored by some reward function and not emptied by mask_truncated_completions
        usable = self._sc_scored.cpu().view(-1, G) & (mask.sum(1) > 0).view(-1, G)   # (B, G)
        texts = self.processing_class.batch_decode(answers, skip_special_tokens=True)
        reward = torch.where(usable, reward, torch.zeros_like(reward))  # unusable: a wrong answer
        ro = S.Rollout(problems=[{"question": c, "answer": ""} for c in conversations[::G]],
                       prompts=prompts[::G], ids=ids.to(device), mask=mask.to(device), texts=texts,
                       correct=(reward > 0.5).float())
        return ro, reward, usable

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation keeps TRL's advantages (they are not used)
            return out
        ro, reward, usable = self.rollout(inputs, out)
        adv = S.group_advantages(reward)                                           # Eq. (1)
        group_routes = S.route_groups(reward)
        refs = [usable_references(c, route, self.sc_rng, ok) for c, route, ok in
                zip(ro.correct.bool().tolist(), group_routes, usable.tolist())]
        batch = S.make_batch(ro, group_routes, adv, refs)
        model = self.accelerator.unwrap_model(self.model)
        stats = {}
        if bool((batch.ref_row >= 0).any()):
            training = model.training
            model.eval()  # under activation checkpointing HF drops the KV cache in train mode
            set_precision(model, self.args.bf16, weights_copy=False)  # TRL's bf16: autocast
            tok, G = self.processing_class, ro.G
            prompts = {j: self.encode_teacher(tok, ro.problems[j // G]["question"], ro.texts[j])
                       for j in batch.ref_row.unique().tolist() if j >= 0}  # Eq. (4), TRL's chat
            batch = replace(batch, teacher_prompt=[prompts.get(j) for j in batch.ref_row.tolist()])
            batch, stats = S.sc_credit(model, self.sc_cfg, ro, batch)  # D, f(D), Eq. (5)
            model.train(training)
        per_token = torch.zeros(ro.ids.shape, device=ro.ids.device)               # (N, L)
        per_token[batch.row] = batch.adv[:, None].to(per_token.device) * batch.weights
        per_token[~usable.view(-1).to(per_token.device)] = 0.0  # no signal from those answers
        B, C = out["completion_ids"].shape  # this process's rows, padded to C columns
        start = self.accelerator.process_index * B
        per_token = torch.nn.functional.pad(per_token, (0, max(0, C - per_token.shape[1])))
        out["advantages"] = per_token[start:start + B, :C]
        metrics = self._metrics["train"]
        for route in ("partial", "solve_none", "fallback", "skip"):  # sc/groups_none: solve-none
            metrics[f"sc/groups_{route.removeprefix('solve_')}"].append(group_routes.count(route))
        for key, value in stats.items():
            metrics[f"sc/{key}"].append(value)
        return out


def parse_args(argv=None):
    """The command line -> (args, scgrpo Config of the same settings, checked by scgrpo's own
    check_config: one line and exit code 2 for bad input, before anything loads)."""
    tiny = S.PRESETS["tiny"]
    ap = ArgParser(description="SC-GRPO with TRL's GRPOTrainer.", allow_abbrev=False)
    ap.add_argument("--model", default="tiny", help="as scgrpo.py: tiny, SmolLM2-135M, a hub id "
                    "(default tiny)")
    ap.add_argument("--task", default="arith", choices=("gsm8k", "arith", "addition"),
                    help="as scgrpo.py (default arith)")
    ap.add_argument("--data", default="", help="as scgrpo.py: a folder with train.jsonl")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    ap.add_argument("--prompts-per-step", type=int, default=8,
                    help="questions per step, over all processes (default 8)")
    ap.add_argument("--group-size", type=int, default=8, help="G answers per question (default 8)")
    for name, kind in (("max-new-tokens", int), ("temperature", float), ("lr", float)):
        key = name.replace("-", "_")
        ap.add_argument(f"--{name}", type=kind, default=None,
                        help=f"default: the model's scgrpo.py preset (tiny: {tiny.get(key, 1.0)})")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                    help="bf16 mixed precision, on a GPU (default off)")
    ap.add_argument("--use-vllm", action=argparse.BooleanOptionalAction, default=False,
                    help="generate with vLLM, TRL's option (default off)")
    ap.add_argument("--report-to", default="none",
                    choices=("none", "tensorboard", "wandb", "trackio"),
                    help="TRL's report_to: where its logs go besides log_history.json "
                    "(default none)")
    ap.add_argument("--out", default="runs/trl-scgrpo", help="TRL's output folder "
                    "(default runs/trl-scgrpo)")
    ap.add_argument("--seed", type=int, default=0, help="seeds TRL and the reference choices "
                    "(default 0)")
    args = ap.parse_args(argv)
    preset = S.PRESETS.get(args.model, S.PRESETS["hub"])
    given = {k: getattr(args, k) for k in ("max_new_tokens", "temperature", "lr")
             if getattr(args, k) is not None}  # an explicit 0 is checked, not replaced
    answers = args.prompts_per_step * args.group_size
    cfg = S.Config(**{**preset, **given, **dict(
        model=args.model, task=args.task, data=args.data, steps=args.steps,
        prompts_per_step=args.prompts_per_step, group_size=args.group_size, seed=args.seed,
        report_to=args.report_to, out=args.out, fast=False,
        micro_batch=max(1, min(preset["micro_batch"], answers)))})  # TRL micro-batches on its own
    check_config(cfg, resuming=True)  # TRL may reuse its output folder (no metrics.jsonl there)
    return args, cfg


def main(argv=None):
    args, cfg = parse_args(argv)
    from accelerate import PartialState
    from datasets import Dataset
    answers = args.prompts_per_step * args.group_size
    processes = PartialState(cpu=not torch.cuda.is_available()).num_processes
    if answers % processes:
        die(f"--prompts-per-step x --group-size ({answers}) must split evenly over {processes} "
            "processes")
    model, tok = load_model(cfg.model, args.seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    config = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, seed=args.seed, report_to=args.report_to,
        per_device_train_batch_size=answers // processes, num_generations=args.group_size,
        max_completion_length=cfg.max_new_tokens, top_p=1.0, top_k=0,
        temperature=cfg.temperature, beta=0.0, num_iterations=1,
        learning_rate=cfg.lr, loss_type="grpo", max_grad_norm=1.0, bf16=args.bf16,
        use_vllm=args.use_vllm, save_strategy="no", logging_steps=1,
        use_cpu=not torch.cuda.is_available(),  # several CPU processes need accelerate's cpu mode
        chat_template_kwargs={"enable_thinking": False})
    rows = make_dataset(load_task(cfg)[0], tok)
    try:
        trainer = SCGRPOTrainer(model=model, processing_class=tok, reward_funcs=[correctness],
                                args=config, train_dataset=Dataset.from_list(rows))
    except ValueError as e:  # a setting SC-GRPO cannot honour: one line, exit 2
        die(str(e))
    trainer.train()
    trainer.save_model(args.out)
    if trainer.accelerator.is_main_process:  # TRL's logs, sc/* included
        with open(os.path.join(args.out, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f, indent=1)
        print(f"done: model and log_history.json in {args.out}")
    if torch.distributed.is_initialized():
        trainer.accelerator.wait_for_everyone()  # every process has saved and logged
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the interpreter's teardown: freeing DDP's gloo group there can deadlock (seen with
        # torch 2.13 on a CPU: its worker thread waits for the GIL that the freeing thread holds).
        os._exit(0)


if __name__ == "__main__":
    main()
