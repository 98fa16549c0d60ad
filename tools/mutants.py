"""
Mutation check: does the test suite fail when the math is wrong?

Each mutant below is one deliberate one-line error, the kind a fork makes when it edits the
method: a sign, a KL direction, a quantile, a normaliser, a wire to the wrong answer. For each,
the project is copied to a temporary folder, the line is replaced there (the original files are
never touched), and the whole suite (every file pytest.ini names: test_scgrpo.py, tests/, the
variants' tests) runs with -x: the mutant is killed when some test fails, and the first failing
test is named. A mutant may also name tests (file::test) that were once too weak to notice such an
error; those run alone on the mutant as well, and must fail too.

    python tools/mutants.py            # every mutant, two at a time (one thread each)
    python tools/mutants.py --list     # the mutants, numbered
    python tools/mutants.py 3 7        # only these

It exits 1 if a mutant survives or no longer applies (a line moved: update its text here).
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (what the error is, file, the text as written, the text as mutated, weak tests that must fail)
MUTANTS = [
    ("Eq. (1): advantage sign flipped", "scgrpo.py",
     "(rewards - mean) / std.clamp_min(1e-12)", "(mean - rewards) / std.clamp_min(1e-12)", []),
    ("Eq. (1): sample std instead of the population std", "scgrpo.py",
     "std = rewards.std(1, keepdim=True, unbiased=False)",
     "std = rewards.std(1, keepdim=True, unbiased=True)", []),
    ("KL direction: KL(student || teacher), fast path", "machinery/speed.py",
     "d, lse_t, lse_s = head_kl(h_t, h_s, lse_s, head, temperature, normalisers=True)",
     "d, lse_t, lse_s = head_kl(h_s, h_t, head_lse(h_t, head, temperature), head, temperature, normalisers=True)",
     ["tests/test_fast_path.py::test_kl_floor_with_the_students_own_prompt_as_teacher[fp32]"]),
    ("KL direction: KL(student || teacher), plain path", "scgrpo.py",
     "F.kl_div(log_s, log_t, log_target=True", "F.kl_div(log_t, log_s, log_target=True", []),
    ("KL formula: the log-normaliser term's sign", "machinery/speed.py",
     "d = (dot + (lse_s - lse_t)).clamp_min_(0.0)",
     "d = (dot - (lse_s - lse_t)).clamp_min_(0.0)", []),
    ("f(D) = c / (D + c) instead of D / (D + c)", "scgrpo.py",
     "return torch.where(active, kl / (kl + c), torch.zeros_like(kl)).detach(), c",
     "return torch.where(active, c / (kl + c), torch.zeros_like(kl)).detach(), c",
     ["test_scgrpo.py::test_teacher_d_equals_one_teacher_forward_per_answer"]),
    ("c from the median instead of --kl-quantile (P75)", "scgrpo.py",
     "torch.quantile(d.float(), q)) if", "torch.quantile(d.float(), 0.5)) if",
     ["test_scgrpo.py::test_tiny_scgrpo_run_writes_sc_metrics_and_credit_page",
      "tests/test_trl.py::test_trl_trainer_runs_and_logs_sc_metrics[tiny]",
      "tests/test_runs.py::test_smollm2_runs_each_algorithm_and_saves_a_model_that_reloads[scgrpo]"]),
    ("the weights never reach the loss", "scgrpo.py",
     "per_token = weights * term * loss_scale[:, None]", "per_token = term * loss_scale[:, None]",
     ["test_scgrpo.py::test_sc_loss_with_unit_weights_equals_grpo_and_gradients_match",
      "test_scgrpo.py::test_loss_gives_exactly_zero_gradient_to_padding"]),
    ("Eq. (5): sign of the diversity advantage", "scgrpo.py",
     "return alpha * (s - s.mean())", "return alpha * (s.mean() - s)", []),
    ("Eq. (5): each solve-none answer its own reference instead of o_r", "scgrpo.py",
     "return [None if i == o_r else o_r for i in range(G)]", "return [None if i == o_r else i for i in range(G)]",
     ["test_scgrpo.py::test_teacher_d_equals_one_teacher_forward_per_answer"]),
    ("routing: n_c = 1 skipped instead of plain GRPO", "scgrpo.py",
     '{0: "solve_none", 1: "fallback", G: "skip"}', '{0: "solve_none", 1: "skip", G: "skip"}', []),
    ("routing: n_c = 0 skipped instead of Eq. (5)", "scgrpo.py",
     '{0: "solve_none", 1: "fallback", G: "skip"}', '{0: "skip", 1: "fallback", G: "skip"}', []),
    ("reference: an answer may be its own reference", "scgrpo.py",
     "rng.choice([j for j in good if j != i])", "rng.choice(good)", []),
    ("solve-none: the L_i = min(|o_i|, |o_r|) cut dropped", "scgrpo.py",
     "L_i = min(L_i, int(lengths[b, j]))", "L_i = min(L_i, int(lengths[b, i]))", []),
    ("GRPO: the 1/|o_i| normaliser dropped", "scgrpo.py",
     "loss_scale = (1.0 / (len(group_routes) * G * lengths.view(-1)[row].double())).float()",
     "loss_scale = (1.0 / (len(group_routes) * G * torch.ones(len(row), dtype=torch.double))).float()", []),
    ("DAPO: per-answer instead of token-level normaliser", "variants/dapo.py",
     "1.0 / max(1, int(lengths.sum())))", "1.0 / max(1, len(lengths)))",
     ["variants/test_dapo.py::test_dapo_token_level_loss_is_independent_of_micro_batch_split"]),
    ("clip: max instead of min", "scgrpo.py",
     "term = torch.min(ratio * a,", "term = torch.max(ratio * a,", []),
    ("clip range: the upper bound ignores epsilon_high", "scgrpo.py",
     "ratio.clamp(1 - eps_low, 1 + eps_high) * a", "ratio.clamp(1 - eps_low, 1 + eps_low) * a", []),
    ("DAPO: clip-higher off (eps_high = eps)", "variants/dapo.py",
     "mask, cfg.epsilon, cfg.epsilon_high)", "mask, cfg.epsilon, cfg.epsilon)",
     ["variants/test_dapo.py::test_dapo_token_level_loss_is_independent_of_micro_batch_split"]),
    ("PPO epochs: old log-probs recomputed every epoch", "scgrpo.py",
     "loss_of(model, cfg, ro, batch[sl], old[k] if old else None)", "loss_of(model, cfg, ro, batch[sl], None)",
     ["test_scgrpo.py::test_ppo_epochs_reuse_frozen_old_logprobs"]),
    ("temperature missing from the update's log-probs, fast path", "machinery/speed.py",
     "lp = head_logprobs(model.get_output_embeddings(), h, comp_ids[resp_mask], temperature,",
     "lp = head_logprobs(model.get_output_embeddings(), h, comp_ids[resp_mask], 1.0,", []),
    ("temperature missing from the update's log-probs, plain path", "scgrpo.py",
     "lp = F.log_softmax(logits / cfg.temperature, -1)", "lp = F.log_softmax(logits, -1)", []),
    ("plain sampler: temperature ignored", "scgrpo.py",
     "F.softmax(z / temperature, -1)", "F.softmax(z, -1)", []),
    ("Eq. (4): the teacher prompt without the reference", "scgrpo.py",
     "system += reference if tiny else GUIDE + reference", 'system += "" if tiny else GUIDE', []),
    ("verifier: equal within 1% instead of equal", "scgrpo.py",
     "and Decimal(got) == Decimal(want)", "and abs(Decimal(got) - Decimal(want)) <= abs(Decimal(want)) / 100",
     []),
    ("DAPO dynamic sampling keeps groups of equal rewards", "variants/dapo.py",
     'if route != "skip"])', 'if route != "drop"])', ["variants/test_dapo.py::test_tiny_dapo_run_completes"]),
    ("TRL: per-token advantages without f(D)", "trl_scgrpo.py",
     "per_token[batch.row] = batch.adv[:, None].to(per_token.device) * batch.weights",
     "per_token[batch.row] = batch.adv[:, None].to(per_token.device) * (batch.weights > 0)",
     ["tests/test_trl.py::test_trl_trainer_equals_the_plain_reference_step"]),
    ("teacher KL without the temperature on the teacher's side, fast path", "machinery/speed.py",
     "a = h_t.float() / temperature", "a = h_t.float()",
     ["tests/test_fast_path.py::test_kl_floor_with_the_students_own_prompt_as_teacher[bf16]"]),
    ("teacher prompt holds the next group's question", "scgrpo.py",
     'prompts = {j: encode_prompt(tok, ro.problems[j // ro.G]["question"], ro.texts[j])',
     'prompts = {j: encode_prompt(tok, ro.problems[(j // ro.G + 1) % len(ro.problems)]["question"], ro.texts[j])',
     ["tests/test_fast_path.py::test_kl_floor_with_the_students_own_prompt_as_teacher[bf16]"]),
    ("Eq. (5)'s gradient norm read after every micro-batch, not after the solve-none ones",
     "scgrpo.py", "last_solve_none=sl.stop == n_none)", "last_solve_none=sl.stop == len(order))",
     ["test_scgrpo.py::test_step_diagnostics_split_the_gradient_and_measure_the_update"]),
    ("solve-none answers no longer first in the update", "machinery/batching.py",
     'key=lambda m: (batch.route[m] != "solve_none",', "key=lambda m: (",
     ["test_scgrpo.py::test_step_diagnostics_split_the_gradient_and_measure_the_update"]),
    ("--eq5-only-step skip drops every step, not only Eq. (5)-only ones", "variants/eq5_options.py",
     'if cfg.eq5_only_step == "skip" and set(batch.route) == {"solve_none"}:', 'if cfg.eq5_only_step == "skip":',
     ["variants/test_eq5_options.py::test_a_step_whose_only_gradient_is_eq5_is_skipped_only_when_asked[skip]"]),
    ("--eq5-window group: active lengths of the paper's window", "variants/eq5_options.py",
     "return torch.where(none[:, None].to(window.device), window, batch.active)",
     "return torch.where(none[:, None].to(window.device), batch.active, batch.active)",
     ["variants/test_eq5_options.py::test_eq5_window_option_by_hand[group]"]),
    ("the scgrpo-lr arm's lr x mean f(D) instead of / mean f(D)", "tools/compare.py",
     "factor = round(1 / statistics.mean(w), 1)", "factor = round(statistics.mean(w), 1)", []),
    ("GRPO's updated groups counted as answers, not groups", "tools/compare.py",
     'return {"grpo": sum(max(0, n) for n in beyond) // G, **groups}',
     'return {"grpo": sum(max(0, n) for n in beyond), **groups}', []),
    ("a study's interrupted run re-run from scratch, its checkpoint ignored", "tools/compare.py",
     "            if find_checkpoint(out):", '            if find_checkpoint(os.path.join(out, "final")):',
     ["tests/test_tools.py::test_a_killed_study_resumes_its_run_to_the_numbers_of_one_never_stopped"]),
    ("a run read back only with its model folder, not from a report's small files", "tools/compare.py",
     "for f in SMALL_FILES[:3])", 'for f in (*SMALL_FILES[:3], "final/config.json"))',
     ["tests/test_tools.py::test_compare_study_derives_the_matched_lr_and_counts_routes_from_the_runs"]),
    ("a report's run_logs without the cached base-model evaluation", "tools/compare.py",
     '"moved.json", "base_eval.json",', '"moved.json",',
     ["tests/test_tools.py::test_compare_study_derives_the_matched_lr_and_counts_routes_from_the_runs"]),
    ("a report's run_logs without the line saying where each run ran", "tools/compare.py",
     '"machine.txt", "questions.jsonl",', '"questions.jsonl",',
     ["tests/test_tools.py::test_compare_study_derives_the_matched_lr_and_counts_routes_from_the_runs"]),
    # five errors that once passed the whole suite, each a line a fork could get wrong unnoticed
    ("gradient clipping off (clip_grad_norm_ given infinity)", "scgrpo.py",
     "float(clip_grad_norm_(model.parameters(), cfg.max_grad_norm))",
     'float(clip_grad_norm_(model.parameters(), float("inf")))',
     ["test_scgrpo.py::test_gradient_clipping_scales_the_applied_step_to_max_grad_norm"]),
    ("DAPO's filter reads the verdicts, not the shaped reward", "variants/dapo.py",
     "S.grpo_routes(shaped_reward(new, cfg))", "S.grpo_routes(new.correct)",
     ["variants/test_dapo.py::test_dapo_filter_reads_the_shaped_reward_not_the_verdicts"]),
    ("--kl-quantile never reaches sc_weights", "scgrpo.py",
     "sc_weights(kl[scored], active, cfg.c_min, cfg.kl_quantile)", "sc_weights(kl[scored], active, cfg.c_min)",
     ["test_scgrpo.py::test_c_is_the_quantile_the_flag_names"]),
    ("greedy evaluation sampled at the training temperature", "scgrpo.py",
     "eval_groups(model, tok, problems, cfg, eos_ids, 1, 0.0, gen)",
     "eval_groups(model, tok, problems, cfg, eos_ids, 1, cfg.temperature, gen)",
     ["test_scgrpo.py::test_greedy_evaluation_decodes_at_temperature_zero"]),
    ("the solve-none reference o_r always the group's first answer", "scgrpo.py",
     "o_r = rng.choice(range(G))", "o_r = 0",
     ["test_scgrpo.py::test_solve_none_reference_is_drawn_uniformly_from_the_group"]),
    ("--eq5-score unlike scores likeness", "variants/eq5_options.py",
     "return 1.0 - match.ratio()", "return match.ratio()", ["variants/test_eq5_options.py::test_eq5_unlike_option_scores_by_token_match"]),
    ("the confirmatory sign-flip test counts only patterns beyond the observed sum", "tools/compare.py",
     ">= observed - tie", "> observed + tie",
     ["tests/test_tools.py::test_confirmatory_statistics_against_tables_and_hand_computed_cases"]),
    ("the paired-t interval from the population std", "tools/compare.py",
     "statistics.stdev(diffs) / math.sqrt(n)", "statistics.pstdev(diffs) / math.sqrt(n)",
     ["tests/test_tools.py::test_confirmatory_statistics_against_tables_and_hand_computed_cases",
      "tests/test_tools.py::test_confirmatory_analysis_on_the_exploratory_runs_read_as_committed"]),
    ("per-question results: every question written as wrong", "scgrpo.py",
     "per_question = dict(text=texts, correct=greedy,", "per_question = dict(text=texts, correct=[0] * len(greedy),",
     ["tests/test_runs.py::test_eval_only_scores_the_tiny_model_and_a_saved_run_as_training_did"]),
    ("--dtype bf16: an optimizer step keeps the casts of the old weights", "machinery/models.py",
     "register_step_post_hook(lambda *args: torch.clear_autocast_cache())",
     "register_step_post_hook(lambda *args: None)", ["tests/test_fast_path.py::test_bf16_update_casts_the_weights_once_per_optimizer_step"]),
    ("--dtype bf16: the bf16 weight copy never follows the optimizer", "machinery/models.py",
     "    if version != copy.synced:", "    if copy.synced is None:",
     ["tests/test_fast_path.py::test_bf16_weight_copy_follows_every_optimizer_step"]),
    ("the sampler's preallocated KV cache writes each token one place early", "machinery/speed.py",
     "self.k_buf[:self.rows, :, self.used:t] = key_states",
     "self.k_buf[:self.rows, :, self.used - 1:t - 1] = key_states",
     ["tests/test_fast_path.py::test_preallocated_kv_cache_layer_equals_hf_dynamic_layer"]),
    ("the sampler's KV cache keeps the first rows, not the unfinished ones", "machinery/speed.py",
     "self.k_buf[:len(indices), :, :self.used] = self.keys[indices]",
     "self.k_buf[:len(indices), :, :self.used] = self.keys[:len(indices)]",
     ["tests/test_fast_path.py::test_preallocated_kv_cache_layer_equals_hf_dynamic_layer"]),
    ("the GGUF cache keeps bf16-rounded weights", "machinery/models.py",
     "        model.save_pretrained(tmp)", "        deepcopy(model).bfloat16().save_pretrained(tmp)",
     ["tests/test_runs.py::test_gguf_cache_holds_the_weights_the_gguf_file_gives"]),
    ("--dtype bf16's teacher: the re-scored student's logits at T = 1", "machinery/speed.py",
     "d, lse_t, lse_s = rounded_head_kl(a, h_s.float() / temperature, head.weight, block)",
     "d, lse_t, lse_s = rounded_head_kl(a, h_s.float(), head.weight, block)",
     ["tests/test_fast_path.py::test_bf16_d_and_logprobs_follow_the_fp32_plain_lines_within_bf16_rounding"]),
    ("the bf16 learning check passes a mean loss larger than its margin", "tools/compare.py",
     "{'passes' if mean >= margin - 1e-9 else 'fails'}", "{'passes' if mean >= 2 * margin else 'fails'}",
     ["tests/test_tools.py::test_bf16_check_reads_the_confirmatory_sums_paired_by_seed_against_a_hand_computed_case"]),
    ("f(D) of a D rounded below 0: a negative weight", "scgrpo.py",
     "kl = kl.clamp_min(0.0)", "kl = kl.clamp_min(-1.0)", ["test_scgrpo.py::test_sc_weights_hand_computed"]),
    ("--dtype bf16's teacher: the student's log-normaliser with the wrong sign", "machinery/speed.py",
     "return (acc / s_t - lse_t + lse_s).clamp_min_(0.0), lse_t, lse_s",
     "return (acc / s_t - lse_t - lse_s).clamp_min_(0.0), lse_t, lse_s",
     ["tests/test_fast_path.py::test_bf16_d_and_logprobs_follow_the_fp32_plain_lines_within_bf16_rounding"]),
    ("--dtype bf16's update: the head's gradient for W one vocabulary row off",
     "machinery/speed.py", "grad_w[j:j + ctx.block] -= mm(q.T, h, ctx.dtype)",
     "grad_w[j:j + ctx.block] -= mm(q.T, h, ctx.dtype).roll(1, 0)",
     ["tests/test_fast_path.py::test_blocked_logprobs_in_bf16_equal_the_bf16_head_and_follow_fp32_gradients"]),
    ("bf16 decode attention in fp32: the key/value heads taken in the wrong order",
     "machinery/models.py", "query.float(), key.float(), value.float(),",
     "query.float(), key.flip(1).float(), value.flip(1).float(),",
     ["tests/test_fast_path.py::test_decode_attention_in_fp32_is_softmax_attention_to_bf16_rounding"]),
    ("bf16 decode attention in fp32: turned on for an AMX CPU too", "machinery/models.py",
     'measured = "avx512_bf16" in flags and "amx_bf16" not in flags',
     'measured = "avx512_bf16" in flags',
     ["tests/test_fast_path.py::test_decode_attention_in_fp32_is_softmax_attention_to_bf16_rounding"]),
    ("--dtype auto: bf16 on a bf16 CPU's plain lines too (not only where the check passed)",
     "machinery/models.py", 'return "bf16" if on_bf16_cpu and fast else "fp32"',
     'return "bf16" if on_bf16_cpu else "fp32"',
     ["tests/test_runs.py::test_dtype_auto_follows_the_check_and_a_run_keeps_what_it_became"]),
    ("--dtype auto: what it became not saved (a run resumed on another CPU changes precision)",
     "machinery/runs.py", "self.cfg = cfg = dataclasses.replace(cfg, dtype=",
     "cfg = dataclasses.replace(cfg, dtype=",
     ["tests/test_runs.py::test_dtype_auto_follows_the_check_and_a_run_keeps_what_it_became"]),
    ("shared key/value heads: the padding mask dropped",
     "machinery/models.py", "query, key, value, attn_mask=attention_mask, dropout_p=dropout,",
     "query, key, value, attn_mask=None, dropout_p=dropout,",
     ["tests/test_fast_path.py::test_shared_kv_attention_is_softmax_attention_without_copies"]),
    ("shared key/value heads: the output's heads and tokens mixed (reshaped, not transposed)",
     "machinery/models.py", "return out.transpose(1, 2).contiguous(), None",
     "return out.reshape(out.shape[0], out.shape[2], out.shape[1], -1), None",
     ["tests/test_fast_path.py::test_shared_kv_attention_is_softmax_attention_without_copies"]),
    # the variants' seams and the docs (issue 50)
    ("a variant's own flag rules never checked", "machinery/cli.py",
     'if f.metadata.get("rule")]', 'if f.metadata.get("rule") and False]',
     ["variants/test_dapo.py::test_bad_input_exits_2_with_one_line_and_writes_nothing[--max-rounds 0]"]),
    ("a variant's run resumed by scgrpo.py, not refused", "machinery/cli.py",
     "if set(saved) - ours or (program and program != program_of(Config)):", "if False:",
     ["tests/test_runs.py::test_a_variants_run_resumes_through_its_own_file_and_evaluates_through_scgrpo_py"]),
    ("DAPO's overlong penalty never applied", "variants/dapo.py",
     "return ro.correct + overlong_penalty(ro.lengths, cfg.max_new_tokens, buffer)",
     "return ro.correct + 0 * overlong_penalty(ro.lengths, cfg.max_new_tokens, buffer)",
     ["variants/test_dapo.py::test_dapo_filter_reads_the_shaped_reward_not_the_verdicts"]),
    ("a variant arm's fingerprint leaves out its file", "tools/compare.py",
     'names += [program(arm)] if program(arm) != "scgrpo.py" else []', "names += []",
     ["tests/test_tools.py::test_compare_runs_each_arm_through_its_program_and_fingerprints_that_file"]),
    ("TRL: a solve-none reference o_r drawn among unusable answers too", "trl_scgrpo.py",
     "candidates = [i for i in range(len(correct)) if usable[i]]", "candidates = list(range(len(correct)))",
     ["tests/test_trl.py::test_trl_references_skip_answers_that_are_not_usable"]),
    ("a README link to a page that is not there", "README.md",
     "[docs/speed.md](docs/speed.md)", "[docs/speed.md](docs/speeds.md)",
     ["tests/test_docs.py::test_docs_links_resolve_the_index_lists_every_page_and_readme_fits_a_page"]),
    # the paper's comparators (issue 51)
    ("distill: the divergence's direction reversed (reverse KL where forward is asked)", "variants/distill.py",
     "        return kl(log_t, log_s)\n", "        return kl(log_s, log_t)\n",
     ["variants/test_distill.py::test_divergences_hand_computed", "variants/test_distill.py::test_gradient_equals_a_plain_full_vocabulary_loop[forward]"]),
    ("distill: L_distill never reaches the loss", "variants/distill.py",
     "loss, seen[0] = loss + beta * l_distill,", "loss, seen[0] = loss + 0 * l_distill,",
     ["variants/test_distill.py::test_gradient_equals_a_plain_full_vocabulary_loop[reverse]"]),
    ("OPSD: a teacher that does not see its context", "variants/opsd.py",
     'gold = [S.encode_prompt(tok, p["question"], gold_context(p, tiny)) for p in ro.problems]',
     'gold = [S.encode_prompt(tok, p["question"]) for p in ro.problems]',
     ["variants/test_opsd.py::test_gradient_equals_a_plain_full_vocabulary_loop[initial-jsd]"]),
    ("RLSD: the gold teacher's context replaced by SC-GRPO's (no reference in GRPO's routes)", "variants/rlsd.py",
     "context=gold_prompts if gold else S.teacher_prompts,", "context=S.teacher_prompts,",
     ["variants/test_rlsd.py::test_gradient_equals_a_plain_full_vocabulary_loop[gold-plain]"]),
    ("RLSD: the weight blind to the sign of A", "variants/rlsd.py",
     "torch.exp(adv.sign()[:, None] * delta)", "torch.exp(delta)", ["variants/test_rlsd.py::test_rlsd_weight_hand_computed"]),
    ("RLSD: the weight not clipped", "variants/rlsd.py",
     "torch.exp(adv.sign()[:, None] * delta).clamp(1 - eps_w, 1 + eps_w)", "torch.exp(adv.sign()[:, None] * delta)",
     ["variants/test_rlsd.py::test_rlsd_weight_hand_computed"]),
    # the static-shape sampler (issue 52)
    ("static sampler: a finished row keeps writing its tokens", "machinery/static_sampler.py",
     "comp_ids[:, t] = torch.where(alive, tok, comp_ids[:, t])", "comp_ids[:, t] = tok",
     ["tests/test_fast_path.py::test_static_sampler_equals_the_fast_sampler"]),
    ("static sampler: a new token's own slot never marked in the mask", "machinery/static_sampler.py",
     "attn[:, P + t] = (~done).long()", "attn[:, P + t] = 0", ["tests/test_fast_path.py::test_static_sampler_equals_the_fast_sampler"]),
    # the seams and the comparators as their sources run them (issue 56)
    ("--algo grpo runs SC-GRPO's routes (the route seam never set)", "scgrpo.py",
     'seams = {"route": grpo_routes, **seams}', "seams = dict(seams)",
     ["test_scgrpo.py::test_tiny_grpo_run_learns_and_saves_a_model"]),
    ("the teacher pass gives the student's log-probs as the teacher's, plain path", "scgrpo.py",
     "for lp in (log_t, log_s))", "for lp in (log_s, log_s))",
     ["variants/test_rlsd.py::test_gradient_equals_a_plain_full_vocabulary_loop[gold-plain]"]),
    ("the teacher pass's log-probs normalised by the other side, fast path", "machinery/speed.py",
     "return d, z_t - lse_t, z_s - lse_s", "return d, z_t - lse_s, z_s - lse_t",
     ["variants/test_rlsd.py::test_gradient_equals_a_plain_full_vocabulary_loop[gold-fast]",
      "tests/test_fast_path.py::test_the_teacher_pass_gives_the_plain_lines_log_probs"]),
    ("the context seam's prompts one row off", "scgrpo.py",
     "return [prompts.get(j) for j in batch.ref_row.tolist()]",
     "return [prompts.get(j) for j in batch.ref_row.roll(1).tolist()]", []),
    ("distill: beta counts optimizer steps (ppo_epochs a training step)", "variants/distill.py",
     "min((step_no - 1) / max(1, cfg.steps - 1), 1.0)", "min((step_no - 1) * cfg.ppo_epochs / max(1, cfg.steps - 1), 1.0)",
     ["variants/test_distill.py::test_beta_counts_training_steps",
      "variants/test_distill.py::test_its_run_logs_beta_and_l_distill_and_names_its_program"]),
    ("OPSD: the teacher always the current policy, never the initial one", "variants/opsd.py",
     'teacher = model if cfg.opsd_teacher == "current" else initial_policy(cfg, model)', "teacher = model",
     ["variants/test_opsd.py::test_gradient_equals_a_plain_full_vocabulary_loop[initial-jsd]"]),
    ("OPSD: the initial policy from the weights it is handed, not from --model", "variants/opsd.py",
     "frozen, _ = load_model(cfg.model, cfg.seed)", "frozen = __import__('copy').deepcopy(model)",
     ["variants/test_opsd.py::test_the_initial_policy_is_loaded_from_the_models_name_and_kept_frozen"]),
    ("RLSD: lambda's decay twice as slow", "variants/rlsd.py",
     "(1 - min(steps / decay, 1.0))", "(1 - min(steps / decay / 2, 1.0))",
     ["variants/test_rlsd.py::test_lambda_falls_linearly_over_the_optimizer_steps_then_stays_0"]),
    ("RLSD: the blend with lambda on the wrong term", "variants/rlsd.py",
     "return ((1 - lam) + lam * w) * mask", "return (lam + (1 - lam) * w) * mask",
     ["variants/test_rlsd.py::test_rlsd_weight_hand_computed[0.2]"]),
]


def apply(folder, file, old, new):
    """Replace the one occurrence of `old` in folder/file; False if it is not there exactly once."""
    path = os.path.join(folder, file)
    with open(path, encoding="utf-8") as f:
        src = f.read()
    if src.count(old) != 1:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(src.replace(old, new))
    return True


def pytest(folder, *args, stop_early=True, timeout=3600):
    """Run pytest in folder with one thread -> (passed?, the failing tests' names). The whole
    suite takes 15-20 minutes on a loaded 2-core machine; past the timeout the run counts as a
    pass (the mutant is reported as surviving, never as killed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *(["-x"] if stop_early else []), *args], cwd=folder, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"note: pytest {' '.join(args)[:80]} timed out after {timeout} s", file=sys.stderr)
        return True, []
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+::.+?)(?: - .*)?$", r.stdout, re.M)
    return r.returncode == 0, failed or ([] if r.returncode == 0 else [f"exit {r.returncode}"])


def suite_order(mutated):
    """Every test file, those beside the mutated file first: the verdict is the same in any order
    (a mutant is killed when some test fails), but -x stops sooner when the nearest tests run
    first. A variant's tests sit beside it; the rest's in tests/ (the machinery's in test_runs.py)."""
    files = ["test_scgrpo.py", *sorted(f"tests/{n}" for n in os.listdir(os.path.join(ROOT, "tests"))
                                       if n.startswith("test_")),
             *sorted(f"variants/{n}" for n in os.listdir(os.path.join(ROOT, "variants"))
                     if n.startswith("test_"))]
    folder, name = os.path.split(mutated)
    near = {"machinery/speed.py": "tests/test_fast_path.py",
            "machinery/static_sampler.py": "tests/test_fast_path.py",
            "tools/compare.py": "tests/test_tools.py", "trl_scgrpo.py": "tests/test_trl.py",
            "README.md": "tests/test_docs.py", "scgrpo.py": "test_scgrpo.py"}.get(
        mutated, f"variants/test_{name}" if folder == "variants" else "tests/test_runs.py")
    return sorted(files, key=lambda f: f != near)  # a stable sort: the rest keep their order


def check(k):
    """Mutant k -> (k, applied, killed by (first failing test or ''), named weak tests that
    passed, seconds)."""
    t0 = time.time()
    what, file, old, new, weak = MUTANTS[k]
    with tempfile.TemporaryDirectory(prefix=f"mutant{k}-") as tmp:
        folder = os.path.join(tmp, "repo")
        shutil.copytree(ROOT, folder, ignore=shutil.ignore_patterns(
            ".git", ".ci", "runs", "__pycache__", ".pytest_cache"))  # pictures too: the docs test links them
        if not apply(folder, file, old, new):
            return k, False, "", [], time.time() - t0
        passed, failed = pytest(folder, *suite_order(file))
        survivors = []
        if weak:  # all named tests in one run, without -x: each must fail on its own
            _, weak_failed = pytest(folder, *weak, stop_early=False)
            survivors = [t for t in weak if not any(f == t or f.startswith(t + "[") for f in weak_failed)]
        return k, True, "" if passed else failed[0], survivors, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description="Run the test suite against deliberate errors.")
    ap.add_argument("only", nargs="*", type=int, help="mutant numbers (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--jobs", type=int, default=2, help="mutants at a time (default 2)")
    args = ap.parse_args()
    if args.list:
        for k, (what, file, *_ , weak) in enumerate(MUTANTS):
            print(f"{k:2d} {file}: {what}" + (f"  (also: {', '.join(weak)})" if weak else ""))
        return
    # the mutants with named tests take longest: start them first
    todo = sorted(args.only or range(len(MUTANTS)), key=lambda k: -len(MUTANTS[k][4]))
    t0, bad = time.time(), 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for k, applied, killer, survivors, seconds in pool.map(check, todo):
            what = MUTANTS[k][0]
            if not applied:
                verdict = "DOES NOT APPLY (the line changed: update it)"
            else:
                verdict = f"killed by {killer}" if killer else "SURVIVED"
            weak = MUTANTS[k][4]
            if applied and weak:
                verdict += (f"; also by {len(weak) - len(survivors)}/{len(weak)} named tests"
                            + (f", NOT by {', '.join(survivors)}" if survivors else ""))
            bad += not (applied and killer and not survivors)  # each mutant counted once
            print(f"{k:2d} {what}: {verdict} ({seconds:.0f} s)", flush=True)
    n = len(todo)
    print(f"{n - bad}/{n} mutants caught, each by the suite and by every test it names, in "
          f"{time.time() - t0:.0f} s")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
