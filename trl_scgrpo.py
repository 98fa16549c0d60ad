"""
SC-GRPO on TRL's GRPOTrainer, for runs that outgrow one GPU: accelerate or DeepSpeed across
GPUs and processes, vLLM for generation. Every piece of SC-GRPO comes from scgrpo.py (routing,
references, the teacher prompt, the per-token KL, f(D), Eq. (5)), so this file and the tutorial
cannot disagree; what is here is the plumbing between TRL's batch and those functions.

How it plugs in. TRL samples the answers and scores them with the reward functions. Then, for
the whole generation batch (every process's answers, gathered):
  1. Eq. (1) advantages and routes by n_c (scgrpo.group_advantages, route_groups), references
     drawn by a random stream that is the same on every process (scgrpo.make_batch);
  2. the teacher pass (scgrpo.self_condition): the same model with a reference in its system
     prompt re-scores each routed answer; D per token, f(D) with c over the batch's active
     tokens, and the diversity advantage of Eq. (5) in solve-none groups;
  3. TRL gets per-token advantages A_i * f(D_it), shape (B, T). Its clipped loss accepts them,
     and because f >= 0, min(rho A f, clip(rho) A f) = f * min(rho A, clip(rho) A): J_SC exactly,
     with TRL's loss code untouched.
Differences from TRL's own GRPO advantages, on purpose: the population std without TRL's +1e-4
(Eq. (1) as in scgrpo.py), and an answer counts as correct when its summed reward is > 0.5.
Every process runs the teacher on the whole generation batch (each needs all of f(D) for c and
Eq. (5)), then keeps its own rows: simple, and N processes do N times the teacher's work.

Run it (the same dataset format as scgrpo.py's tasks; `--help` for every flag):
    python trl_scgrpo.py --model tiny --task arith --steps 30                 # CPU, a minute
    python trl_scgrpo.py --model SmolLM2-135M --task addition --steps 4      # CPU, a few minutes
    accelerate launch --num_processes 8 trl_scgrpo.py --model Qwen3-1.7B --task gsm8k --use-vllm
"""
import argparse
import json
import os
import random

import torch
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer

import plumbing as P
import scgrpo as S


def question_of(prompt):
    """The question text of a TRL prompt: a string, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    return [m for m in prompt if m["role"] == "user"][-1]["content"]


def text_of(completion):
    """The answer text of a TRL completion: a string, or the content of its chat messages."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def make_dataset(rows, tok):
    """TRL rows from scgrpo task rows: the student prompt of scgrpo.encode_prompt as a chat
    (the system prompt and the question), and the gold answer for the reward."""
    tiny = tok.chat_template == P.TINY_TEMPLATE
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
        self.sc_cfg = S.Config(algo="scgrpo", group_size=self.num_generations, c_min=c_min,
                               kl_quantile=kl_quantile, alpha_div=alpha_div,
                               temperature=self.args.temperature, micro_batch=teacher_micro_batch)
        self.sc_rng = random.Random(self.args.seed)  # the same on every process: same references

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # (N_global, functions) for every process's answers; one summed reward per answer
        self._sc_reward = (rewards * self.reward_weights.to(rewards.device)).nansum(1)
        return rewards

    def rollout(self, inputs, out):
        """The whole generation batch (all processes) as a scgrpo.Rollout; no sampler states,
        so self_condition re-scores the student in the teacher's pass."""
        def unpadded(ids, mask):
            return [i[m.bool()].tolist() for i, m in zip(ids, mask)]
        G, device = self.num_generations, out["completion_ids"].device
        questions = gather_object([question_of(x["prompt"]) for x in inputs])
        prompts = gather_object(unpadded(out["prompt_ids"], out["prompt_mask"]))
        answers = gather_object(unpadded(out["completion_ids"], out["completion_mask"]))
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(a, dtype=torch.long) for a in answers],
                                              batch_first=True)                    # (N, L)
        mask = torch.arange(ids.shape[1]) < torch.tensor([len(a) for a in answers])[:, None]
        reward = self._sc_reward.float().cpu().view(-1, G)                         # (B, G)
        texts = self.processing_class.batch_decode(answers, skip_special_tokens=True)
        return S.Rollout([{"question": q, "answer": ""} for q in questions[::G]], prompts[::G],
                         ids.to(device), mask.to(device), texts, (reward > 0.5).float(), reward)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation keeps TRL's advantages (they are not used)
            return out
        ro = self.rollout(inputs, out)
        adv = S.group_advantages(ro.reward)                                        # Eq. (1)
        routes = S.route_groups(ro.reward, "scgrpo")
        batch = S.make_batch(ro, routes, adv, self.sc_rng)
        model = self.accelerator.unwrap_model(self.model)
        stats = {}
        if bool((batch.ref >= 0).any()):
            training = model.training
            model.eval()  # under activation checkpointing HF drops the KV cache in train mode
            model.autocast_dtype = torch.bfloat16 if self.args.bf16 else None
            stats = S.self_condition(model, self.processing_class, self.sc_cfg, ro, batch)
            model.train(training)
        per_token = torch.zeros(ro.ids.shape, device=ro.ids.device)               # (N, L)
        per_token[batch.row] = batch.adv[:, None].to(per_token.device) * batch.weights
        B, C = out["completion_ids"].shape  # this process's rows, padded to C columns
        start = self.accelerator.process_index * B
        per_token = torch.nn.functional.pad(per_token, (0, max(0, C - per_token.shape[1])))
        out["advantages"] = per_token[start:start + B, :C]
        metrics = self._metrics["train"]
        for route in ("partial", "none", "fallback", "skip"):
            metrics[f"sc/groups_{route}"].append(routes.count(route))
        for key, value in stats.items():
            metrics[f"sc/{key}"].append(value)
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="SC-GRPO with TRL's GRPOTrainer.")
    ap.add_argument("--model", default="tiny", help="as scgrpo.py: tiny, SmolLM2-135M, a hub id")
    ap.add_argument("--task", default="arith", help="as scgrpo.py: arith, addition or gsm8k")
    ap.add_argument("--data", default="", help="as scgrpo.py: a folder with train.jsonl")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps")
    ap.add_argument("--prompts-per-step", type=int, default=8, help="questions per step, in all")
    ap.add_argument("--group-size", type=int, default=8, help="G answers per question")
    ap.add_argument("--max-new-tokens", type=int, help="answer cap; default: scgrpo's preset")
    ap.add_argument("--temperature", type=float, help="default: scgrpo's preset")
    ap.add_argument("--lr", type=float, help="default: scgrpo's preset")
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (a GPU)")
    ap.add_argument("--use-vllm", action="store_true", help="generate with vLLM (TRL's option)")
    ap.add_argument("--out", default="runs/trl-scgrpo", help="TRL's output folder")
    ap.add_argument("--seed", type=int, default=0, help="seeds TRL and the reference choices")
    args = ap.parse_args(argv)
    from accelerate import PartialState
    from datasets import Dataset
    answers, processes = args.prompts_per_step * args.group_size, PartialState().num_processes
    if answers % processes:
        P.die(f"--prompts-per-step x --group-size ({answers}) must split evenly over {processes} "
              "processes")
    preset = P.PRESETS.get(args.model, P.PRESETS["hub"])
    cfg = S.Config(model=args.model, task=args.task, data=args.data)
    P.check_config(cfg)
    model, tok = P.load_model(cfg.model, args.seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    config = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, seed=args.seed, report_to="none",
        per_device_train_batch_size=answers // processes, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens or preset["max_new_tokens"], top_p=1.0, top_k=0,
        temperature=args.temperature or preset.get("temperature", 1.0), beta=0.0, num_iterations=1,
        learning_rate=args.lr or preset["lr"], loss_type="grpo", max_grad_norm=1.0, bf16=args.bf16,
        use_vllm=args.use_vllm, save_strategy="no", logging_steps=1,
        chat_template_kwargs={"enable_thinking": False})
    rows = make_dataset(P.load_task(cfg)[0], tok)
    trainer = SCGRPOTrainer(model=model, processing_class=tok, reward_funcs=[correctness],
                            args=config, train_dataset=Dataset.from_list(rows))
    trainer.train()
    trainer.save_model(args.out)
    with open(os.path.join(args.out, "log_history.json"), "w") as f:  # TRL's logs, sc/* included
        json.dump(trainer.state.log_history, f, indent=1)
    print(f"done: model and log_history.json in {args.out}")


if __name__ == "__main__":
    main()
