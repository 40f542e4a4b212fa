"""Mutants that must die: small, plausible bugs planted in a scratch copy of the
repository, each run against the tests that claim to catch it.

    .venv/bin/python tests/mutants.py [--fast] [--passed OUTCOMES.json] [--jobs 2]
                                      [--only NAME ...] [--list]

For each mutant the script copies the repository (tracked files) into a scratch folder,
replaces one line (the text must occur exactly once), checks that Python imports
``megarlhf`` from the copy, and runs the mutant's tests there with pytest. Each test's
outcome is read back (tests/conftest.py labels a failure ``check`` when the test's own
check failed, ``crash`` when anything else raised): a mutant is **killed** when a check
fails; a crash (the mutated code raised, a command exited non-zero, a fixture broke, a
time-out) is reported as **CRASHED**, an error of pytest's as **ERROR**, and passing tests
as **SURVIVED** - none of them is a kill.

A kill must mean the mutation, not a broken test: the unmutated code must pass every
killing test. ``--passed`` names the outcomes of the suite's own run on this tree
(scripts/test.sh passes them): the killing tests that passed there are not run again; any
other runs once on the unmutated copy first. The tiny SFT policy and reward model (and the
policy's checkpoints converted to Hugging Face) are made once, by the unmutated code, and
shared (``MEGARLHF_TINY_DIR``); the PPO reference tests run only the cases a mutant names
(``MEGARLHF_TRACE_CASES``).

``--fast`` runs the fast subset (the fast tier of scripts/test.sh); without it, all of
them (``scripts/test.sh --all``). Prints a table (mutant, killing test, tier, seconds)
and exits 1 unless every mutant run was killed; tests/README.md holds the last table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = "tests/test_ppo_reference.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in words
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids
    cases: tuple[str, ...] = ("gae_k1",)  # the PPO reference cases they need
    fast: bool = False  # in the fast tier's subset (scripts/test.sh without --all)


def ref(test: str, case: str = "gae_k1") -> str:
    return f"{REF}::{test}[{case}]"


def fast(m: "Mutant") -> "Mutant":
    """``m`` in the fast subset: its killing tests are fast-tier tests and it dies in
    seconds (scripts/test.sh without --all runs only these)."""
    return dataclasses.replace(m, fast=True)


MUTANTS = [
    fast(Mutant("kl_arguments_swapped", "the KL penalty's arguments swapped (KL of the reference "
           "from the policy): the reward pays for moving away from the reference",
           "megarlhf/algos/targets.py",
           "kl_per_token(logprobs_BT, ref_logprobs_BT, mask, kl_estimator)",
           "kl_per_token(ref_logprobs_BT, logprobs_BT, mask, kl_estimator)",
           (ref("test_experience_against_plain_loops"),))),
    fast(Mutant("loss_old_is_current", "the policy loss's old log-probs replaced by the current "
           "ones: the ratio is always 1 and nothing is clipped",
           "megarlhf/engine/steps.py",
           'logprobs_BT, batch["old_logprobs"], batch["advantages"], mask,',
           'logprobs_BT, logprobs_BT.detach(), batch["advantages"], mask,',
           (ref("test_every_micro_batch_loss_against_a_loop"),
            ref("test_the_policy_moves_and_the_clip_bites")))),
    Mutant("gae_bootstrap_dropped", "GAE without the next state's value (delta = r - V)",
           "megarlhf/algos/advantages.py",
           "delta = rewards[:, t] + gamma * next_value - values[:, t]",
           "delta = rewards[:, t] - values[:, t]",
           (ref("test_experience_against_plain_loops"),)),
    Mutant("score_on_first_token", "the score added at the first response token instead of "
           "the last", "megarlhf/algos/rewards.py",
           "rewards[rows, last[rows]] += scores[rows]", "rewards[rows, 0] += scores[rows]",
           (ref("test_experience_against_plain_loops"),)),
    fast(Mutant("response_mask_shifted", "the response mask shifted one token to the right",
           "megarlhf/rollout/experience.py", "mask = gen.model_mask_BT().float()",
           "mask = torch.roll(gen.model_mask_BT().float(), 1, dims=1)",
           (ref("test_trained_tokens_and_scores_follow_the_rules"),))),
    Mutant("value_clip_sign_flipped", "the clipped value moves away from the new value",
           "megarlhf/algos/losses.py",
           "clipped = old_values_BT + (values_BT - old_values_BT).clamp(",
           "clipped = old_values_BT - (values_BT - old_values_BT).clamp(",
           (ref("test_every_micro_batch_loss_against_a_loop", "gae_abs_nostop"),
            ref("test_each_step_lowers_its_mini_batch_loss", "gae_abs_nostop")),
           ("gae_abs_nostop",)),
    Mutant("reference_is_the_actor", "the reference's log-probs scored with the current "
           "actor's weights", "megarlhf/rollout/scoring.py",
           "scored = self.score(self.reference, gen, rows)",
           "scored = self.score(self.actor, gen, rows)",
           (ref("test_logprobs_against_transformers"),)),
    Mutant("ema_update_skipped", "the EMA actor never updated", "megarlhf/ppo/learner.py",
           "                    ema.update(actor.parameters)", "                    pass",
           (ref("test_ema_actor_follows_a_loop_over_the_steps"),)),
    Mutant("critic_not_stepped", "the critic's gradients computed but never applied",
           "megarlhf/ppo/learner.py",
           "ok, _ = step_together([role.trained for role, _ in learners])",
           "ok, _ = step_together([role.trained for role, _ in learners if role is actor])",
           (ref("test_each_step_lowers_its_mini_batch_loss"),)),
    # beyond the list
    Mutant("advantages_not_whitened", "GAE/RLOO advantages not whitened over the batch",
           "megarlhf/algos/advantages.py", 'if whiten and estimator in ("gae", "rloo"):',
           "if False:", (ref("test_experience_against_plain_loops"),)),
    Mutant("k3_reversed", "k3 with the ratio inverted (a KL in the other direction)",
           "megarlhf/algos/kl.py", "kl = torch.expm1(log_r) - log_r",
           "kl = torch.expm1(-log_r) + log_r",
           (ref("test_experience_against_plain_loops", "gae_k3_nostop"),), ("gae_k3_nostop",)),
    Mutant("grpo_population_std", "GRPO's group std without Bessel's correction",
           "megarlhf/algos/advantages.py",
           "centred = centred / (groups.std(dim=1, keepdim=True) + eps)",
           "centred = centred / (groups.std(dim=1, keepdim=True, unbiased=False) + eps)",
           (ref("test_experience_against_plain_loops", "grpo_sequence"),), ("grpo_sequence",)),
    Mutant("clip_upper_bound_doubled", "the ratio clipped at 1 + 2 eps above",
           "megarlhf/algos/losses.py", "ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)",
           "ratio.clamp(1.0 - clip_eps, 1.0 + 2 * clip_eps)",
           (ref("test_every_micro_batch_loss_against_a_loop"),)),
    Mutant("behaviour_weight_inverted", "the decoupled loss's behaviour weight inverted",
           "megarlhf/algos/losses.py",
           "torch.exp(proximal_logprobs_BT - behavior_logprobs_BT)",
           "torch.exp(behavior_logprobs_BT - proximal_logprobs_BT)",
           (ref("test_every_micro_batch_loss_against_a_loop", "decoupled"),), ("decoupled",)),
    Mutant("missing_stop_rule_skipped", "responses without a stop token keep their score",
           "megarlhf/algos/rewards.py", "    if missing_stop_penalty is not None:",
           "    if False:",
           (ref("test_trained_tokens_and_scores_follow_the_rules", "gae_k3_nostop"),),
           ("gae_k3_nostop",)),
    Mutant("entropy_bonus_sign", "the entropy bonus with the wrong sign (entropy penalised)", "megarlhf/engine/steps.py", "total = total + ent_total",
           "total = total - ent_total",
           (ref("test_every_micro_batch_loss_against_a_loop", "gae_k2"),), ("gae_k2",)),
    Mutant("bypass_ignored", "rollout.recompute_logprobs=false still recomputes",
           "megarlhf/rollout/experience.py", "if self.rollout.recompute_logprobs:",
           "if True:", (ref("test_old_logprobs_are_the_ones_the_mode_promises", "bypass"),),
           ("bypass",)),
    Mutant("old_logprobs_from_sampler", "rollout.recompute_logprobs=true, but the old "
           "log-probs are the sampler's (they agree to 1e-7 on CPU)",
           "megarlhf/rollout/experience.py",
           "            old_lp = actor_lp * mask",
           "            old_lp = actor_lp * mask * 0 + rollout_lp",
           ("tests/test_experience.py::test_old_logprobs_are_the_actors_recomputation",), ()),
    Mutant("r2_routing_not_gathered", "rollout.routing_replay=r2 replays each rank's own "
           "record only: rows scored by another data-parallel replica, and layers of other "
           "pipeline stages, replay placeholder experts",
           "megarlhf/models/moe.py",
           "        if size > 1:  # one rank of the group set each entry; the others hold -1",
           "        if False:  # one rank of the group set each entry; the others hold -1",
           ("tests/test_moe.py::test_r2_replays_the_old_log_prob_pass_in_the_updates",), ()),
    Mutant("packed_attention_crosses_samples", "packed micro-batches attend causally across "
           "the whole row: a sample sees the samples packed before it",
           "megarlhf/models/spec.py",
           "        bounds = packed_seq_params.cu_seqlens_q.tolist()",
           "        bounds = [0, query.shape[0]]",
           ("tests/test_packing.py::test_packed_passes_equal_the_single_process_padded_ones"
            "[llama-tp1-pp1-vpp1-dp1]",), ()),
    Mutant("cp_gradient_not_scaled", "context parallelism: the gather of the outputs hands "
           "each rank its positions' gradient without the CP factor, so the weights used "
           "before the gather learn at 1/CP of the rate",
           "megarlhf/parallel/context.py",
           "        return grad.index_select(0, ctx.own) * ctx.group.size(), None, None",
           "        return grad.index_select(0, ctx.own), None, None",
           ("tests/test_context_parallel.py::test_sft_and_ppo_at_cp2_follow_one_process",), ()),
    Mutant("cp_moe_losses_not_scaled", "context parallelism with a mixture of experts: the "
           "routers' load-balancing loss reaches megatron at its configured coefficient, so "
           "its gradient is 1/CP of one process's",
           "megarlhf/models/moe.py",
           "        moe_aux_loss_coeff=moe.aux_loss_coeff * cp,",
           "        moe_aux_loss_coeff=moe.aux_loss_coeff,",
           ("tests/test_context_parallel.py::"
            "test_a_mixture_of_experts_at_cp2_ep2_follows_one_process",), ()),
    Mutant("cp_moe_replays_rank0", "context parallelism with a mixture of experts: every CP "
           "rank replays the routing of CP rank 0's positions of a packed row",
           "megarlhf/engine/steps.py",
           "                .index_select(2, parts[rank])",
           "                .index_select(2, parts[0])",
           ("tests/test_context_parallel.py::"
            "test_a_mixture_of_experts_at_cp2_ep2_follows_one_process",), ()),
    Mutant("lora_qkv_parts_swapped", "LoRA: the k_proj and v_proj adapters' outputs land "
           "in each other's rows of the fused linear_qkv",
           "megarlhf/models/lora.py",
           "        return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)",
           "        return torch.cat([q, v, k], dim=-1).reshape(*lead, -1)",
           ("tests/test_lora.py::test_logprobs_and_adapter_gradients_equal_peft[tp1]",), ()),
    Mutant("lora_tp_grad_not_summed", "LoRA at TP > 1: a column-parallel adapter's A and its "
           "input get only this rank's share of the gradient (no sum over TP)",
           "megarlhf/models/lora.py",
           "            h = mappings.copy_to_tensor_model_parallel_region(self._hidden(x, part),",
           "            h = (lambda h, group: h)(self._hidden(x, part),",
           ("tests/test_lora.py::test_logprobs_and_adapter_gradients_equal_peft[tp2]",), ()),
    Mutant("paged_shared_block_freed_early", "the paged KV cache gives a block back to the "
           "pool when one of the slots sharing it (a GRPO group's twins) lets go, while "
           "another still reads it",
           "megarlhf/inference/paged_kv.py",
           "            if self.refs[block] == 0:",
           "            if self.refs[block] >= 0:",
           ("tests/test_decode_paths.py::test_the_paged_cache_samples_what_the_static_batch_does"
            "[small-seeded-llama-tp1]",), ()),
    Mutant("packed_reward_off_by_one", "a packed reward-model micro-batch reads each "
           "sequence's reward one token before its last",
           "megarlhf/stages/rm.py",
           "    batch = pack_rows(rows, [[len(row) - 1] for row in rows], pad_id=pad_id)",
           "    batch = pack_rows(rows, [[len(row) - 2] for row in rows], pad_id=pad_id)",
           ("tests/test_packing.py::test_packed_supervised_losses_equal_the_padded_ones"
            "[rm-llama-tp1-pp1-vpp1-dp1]",), ()),
    Mutant("stale_batches_not_checkpointed", "ppo.max_staleness > 0: the batches sampled "
           "ahead are not saved with the checkpoint, so a resume samples them again with "
           "the resumed (newer) actor",
           "megarlhf/ppo/session.py",
           '                "objects": {"rollout_queue": self.rollouts.state_dict(),',
           '                "objects": {"rollout_queue_": self.rollouts.state_dict(),',
           ("tests/test_async.py::"
            "test_stale_grpo_follows_the_schedule_and_resumes_exactly_after_sigkill",), ()),
    Mutant("split_weights_sent_once", "rollout.placement.mode=split: the weights are sent to the "
           "rollout ranks at the first request only, so they sample every later batch with "
           "the initial actor",
           "megarlhf/rollout/remote.py",
           "        sync = version != self.held",
           "        sync = self.held is None",
           ("tests/test_async.py::test_split_placement_equals_colocated[1]",), ()),
    Mutant("partial_versions_not_recorded", "rollout.placement.partial: the tokens sampled after an "
           "in-flight update keep the version the batch started with",
           "megarlhf/rollout/remote.py",
           "                gen.versions_BT > 0, inflight.version or 0, version)",
           "                gen.versions_BT > 99, inflight.version or 0, version)",
           ("tests/test_async.py::"
            "test_partial_rollouts_switch_weights_mid_batch_with_each_tokens_version",), ()),
    Mutant("partial_kv_not_recomputed", "rollout.placement.partial_kv=recompute: the old weights' keys "
           "and values are kept after new weights arrive mid-generation",
           "megarlhf/inference/generate.py",
           "                if feed.ctx is not None and recompute_kv:",
           "                if feed.ctx is not None and recompute_kv and False:",
           ("tests/test_rollout.py::test_partial_rollout_tokens_carry_their_version_and_"
            "behaviour_logprob[recompute-static]",), ()),
    Mutant("reward_timeout_not_enforced", "rollout.rewards.timeout_s: a reward call that hangs "
           "is waited for, however long",
           "megarlhf/rewards/verifiers.py",
           "            for worker in [w for w in busy.values() if now - w.started >= self.timeout_s]:",
           "            for worker in [w for w in busy.values() if now - w.started >= 1e9]:",
           ("tests/test_verifiers.py::test_worker_pool_outlives_every_misbehaving_call",), ()),
    Mutant("observations_trained", "multi-turn: the environment's tokens (observations) in "
           "the loss mask, trained as if the model had written them",
           "megarlhf/inference/generate.py",
           "        return self.fed_mask_BT * (1 - self.observation_BT.to(self.fed_mask_BT.dtype))",
           "        return self.fed_mask_BT",
           ("tests/test_multiturn.py::test_episode_tokens_are_the_turns_as_sampled_and_as_"
            "the_template_renders",), ()),
    # the oracles across iterations and of the settings no case used before
    Mutant("kl_controller_error_unclipped", "the adaptive KL controller's proportional "
           "error not clipped to +-0.2", "megarlhf/algos/kl.py",
           "proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)",
           "proportional_error = current_kl / self.target - 1.0",
           (ref("test_what_one_iteration_hands_the_next", "three_iterations"),),
           ("three_iterations",)),
    Mutant("warmup_trains_the_actor", "ppo.critic_warmup_iterations: the actor trained "
           "in the critic's warm-up too", "megarlhf/ppo/session.py",
           "train_critic_only = it < ppo.critic_warmup_iterations",
           "train_critic_only = False",
           (ref("test_each_step_lowers_its_mini_batch_loss", "three_iterations"),),
           ("three_iterations",)),
    Mutant("epoch_wraps_in_the_old_order", "a batch that crosses the end of an epoch "
           "goes on in the ending epoch's order: some prompts twice in the next epoch, "
           "some never (the bug the three-iteration trace found)",
           "megarlhf/ppo/session.py",
           "        epoch, at = divmod(position, len(prompts))",
           "        epoch, at = it * size // len(prompts), position % len(prompts)",
           (ref("test_what_one_iteration_hands_the_next", "three_iterations"),),
           ("three_iterations",)),
    fast(Mutant("sampler_ignores_temperature", "rollout.temperature: the sampler draws and "
                "scores at temperature 1", "megarlhf/inference/generate.py",
                "scaled = logits_BV / params.temperature if params.temperature != 1.0 "
                "else logits_BV",
                "scaled = logits_BV",
                (ref("test_logprobs_against_transformers", "gae_temperature_top"),),
                ("gae_temperature_top",))),
    Mutant("is_weights_not_truncated", "ppo.correction.is_cap: the importance weights "
           "not truncated at the cap", "megarlhf/algos/mismatch.py",
           "weights = torch.where(valid, r.clamp(max=is_cap), weights)",
           "weights = torch.where(valid, r, weights)",
           (ref("test_experience_against_plain_loops", "three_iterations"),),
           ("three_iterations",)),
    Mutant("turn_rewards_dropped", "multi-turn: the earlier turns' rewards left out of the "
           "per-token rewards (GAE, REINFORCE++)", "megarlhf/algos/targets.py",
           "        rewards = rewards + turns", "        rewards = rewards",
           ("tests/test_multiturn.py::test_multi_turn_experience_against_plain_loops[gae]",),
           ()),
    fast(Mutant("gae_bootstraps_across_observations", "GAE takes the value after a model turn "
           "from the observation's (masked) token instead of the next model token's",
           "megarlhf/algos/advantages.py",
           "        next_value = torch.where(here > 0, values[:, t], next_value)",
           "        next_value = values[:, t]",
           ("tests/test_multiturn.py::test_gae_and_returns_skip_the_environments_tokens",), ())),
    Mutant("ptx_scale_without_the_policy_count", "PPO-ptx: the pretraining NLL scaled by "
           "ptx_coef over its tokens only, so against the policy loss's sum it weighs "
           "1 / (policy tokens) of ptx_coef", "megarlhf/ppo/learner.py",
           "scale = torch.tensor(self.coef * policy_count / max(tokens, 1))",
           "scale = torch.tensor(self.coef / max(tokens, 1))",
           (ref("test_ptx_rows_and_loss_against_loops", "ptx_stop_ids"),), ("ptx_stop_ids",)),
    Mutant("dynamic_sampling_keeps_ties", "ppo.dynamic_sampling: a group whose scores all tie "
           "counted as informative (nothing dropped, no refill)", "megarlhf/algos/rewards.py",
           "return spread.max(dim=1).values > spread.min(dim=1).values",
           "return spread.max(dim=1).values >= spread.min(dim=1).values",
           (ref("test_dynamic_sampling_keeps_what_a_loop_keeps", "rloo_dynamic"),),
           ("rloo_dynamic",)),
    Mutant("stop_token_ids_ignored_in_scoring", "rollout.stop_token_ids: a response that ends "
           "at one is scored as missing its stop (only EOS counts)",
           "megarlhf/rollout/sampling.py",
           "stops = sorted(set(self.stop_token_ids) | {self.eos_id})", "stops = [self.eos_id]",
           (ref("test_trained_tokens_and_scores_follow_the_rules", "ptx_stop_ids"),),
           ("ptx_stop_ids",)),
    Mutant("checksum_not_compared", "checkpoint.checksums: a file of the recorded size is "
           "taken as written without comparing its SHA-256 (a byte changed in place passes)",
           "megarlhf/engine/checkpoint.py",
           '    if file_digest(path) != want["sha256"]:',
           '    if False and file_digest(path) != want["sha256"]:',
           ("tests/test_run_guards.py::"
            "test_a_checkpoint_changed_after_its_save_is_named_and_passed_over",
            "tests/test_offline.py::test_cache_equals_recomputation_and_refuses_what_is_stale"),
           ()),
    Mutant("records_prefix_not_compared", "checkpoint.checksums: a resume takes the run's "
           "metrics.jsonl without comparing the SHA-256 of the rows its checkpoint recorded "
           "(a row changed in place is appended to in silence)",
           "megarlhf/engine/checkpoint.py",
           '    if h.hexdigest() != want["sha256"]:',
           '    if False and h.hexdigest() != want["sha256"]:',
           ("tests/test_run_guards.py::"
            "test_a_metrics_file_changed_after_a_save_stops_the_resume",),
           ()),
    Mutant("window_dropped_in_the_decode_cache", "model.sliding_window: the static KV "
           "cache's decode step attends over every cached column (the window applied in the "
           "prefill and training only)",
           "megarlhf/inference/static_kv.py",
           "        if outside is not None:  # the query's column is col in every row",
           "        if False:  # the query's column is col in every row",
           ("tests/test_convert.py::test_greedy_generation_matches_transformers[phi3]",),
           ()),
    Mutant("all_heads_norm_not_reduced_over_tp", "model.qk_layernorm_all_heads (OLMo 2/3): "
           "each TP rank normalises its own heads' queries and keys, the mean square not "
           "summed over the TP group",
           "megarlhf/models/post_norm.py",
           "        if self.tp_group is not None and self.tp_group.size() > 1:",
           "        if False:",
           ("tests/test_convert.py::test_logprobs_match_transformers[tp2-olmo3]",),
           ()),
    Mutant("gemma_norm_not_offset", "model.norm_zero_centered (Gemma 3): the RMSNorm "
           "scales by its stored weight instead of 1 + weight",
           "megarlhf/models/post_norm.py",
           "    return (normed * (1.0 + weight.float())).to(x.dtype)",
           "    return (normed * weight.float()).to(x.dtype)",
           ("tests/test_convert.py::test_logprobs_match_transformers[tp1-gemma3]",),
           ()),
    Mutant("sink_dropped_from_the_softmax", "model.attention_sinks (gpt-oss): the sink key "
           "scores 0 instead of its head's sink",
           "megarlhf/models/spec.py",
           "    sink_key[..., -1] = 1",
           "    sink_key[..., -1] = 0",
           ("tests/test_convert.py::test_logprobs_match_transformers[tp1-gpt_oss]",),
           ()),
    Mutant("agent_retry_recorded_twice", "rollout.agent: a retried request is sampled after "
           "the turn it repeats instead of replacing it",
           "megarlhf/rollout/agents.py",
           "            restore(ep, st, st.snapshot)  # a retry: the last turn sampled again",
           "            pass  # a retry: the last turn sampled again",
           ("tests/test_agents.py::"
            "test_openai_clients_agents_that_misbehave_and_what_is_trained",),
           ()),
    Mutant("agent_reply_keeps_its_stop_token", "rollout.agent: a chat reply's text decoded "
           "with its stop token, so the turn is rendered otherwise than the model wrote it",
           "megarlhf/rollout/agents.py",
           "            text = self.owner.tokenizer.decode(sampled[:-1] if stopped else sampled)",
           "            text = self.owner.tokenizer.decode(sampled)",
           ("tests/test_agents.py::test_an_agent_plays_the_episodes_an_environment_plays",),
           ()),
    Mutant("judge_reads_the_first_match", "rollout.judge: the score read at the pattern's "
           "first match in the verdict, not its last",
           "megarlhf/rollout/judge.py",
           "        word = matches[-1].group(1)",
           "        word = matches[0].group(1)",
           ("tests/test_judge.py::test_the_judges_scores_equal_a_plain_loop",),
           ()),
    Mutant("sync_deadline_dropped", "rollout.placement.sync_timeout_minutes: a rollout rank "
           "waits for the weights with no deadline of its own",
           "megarlhf/rollout/remote.py",
           "                            deadline_s=cfg.rollout.placement.sync_timeout_minutes * 60,",
           "                            deadline_s=None,",
           ("tests/test_async.py::"
            "test_a_hung_weight_sync_ends_at_its_own_deadline_naming_the_other_side",), ()),
]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def make_copy(dest: str, files: list[str]) -> None:
    for rel in files:
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):  # deleted in the work tree
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def mutate(copy: str, m: Mutant) -> None:
    path = os.path.join(copy, m.path)
    text = open(path).read()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"mutant {m.name}: {m.path} holds {count} copies of {m.old!r} "
                         "(expected exactly 1): update tests/mutants.py")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def env_for(copy: str, tiny: str, cases) -> dict:
    return {**os.environ, "PYTHONPATH": copy, "MEGARLHF_TINY_DIR": tiny,
            "MEGARLHF_TRACE_CASES": ",".join(cases), "OMP_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1"}


def imports_from(copy: str, env: dict) -> None:
    where = subprocess.run([sys.executable, "-c", "import megarlhf; print(megarlhf.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True)
    if not where.stdout.strip().startswith(copy):
        raise SystemExit(f"megarlhf imports from {where.stdout.strip() or where.stderr!r}, "
                         f"not from the scratch copy {copy}")


def build_shared(clean: str, tiny: str) -> float:
    """The tiny SFT policy and reward model, and the policy's two checkpoints converted to
    Hugging Face, made once by the unmutated copy for every mutant's run (seconds)."""
    env = env_for(clean, tiny, ())
    imports_from(clean, env)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import conftest; conftest.build_tiny(conftest."
                    f"os.environ['MEGARLHF_TINY_DIR']); [conftest.tiny_hf(conftest.os.environ"
                    "['MEGARLHF_TINY_DIR'], s) for s in (3, 6)]"],
                   cwd=os.path.join(clean, "tests"), env=env, check=True)
    return time.perf_counter() - start


def run_tests(copy: str, tiny: str, tests, cases, basetemp: str
              ) -> tuple[int, dict[str, str], str, float]:
    """pytest's exit code, each test's outcome (tests/conftest.py's ``outcomes``: passed,
    skipped, check or crash), the output and the seconds."""
    env = env_for(copy, tiny, cases)
    imports_from(copy, env)
    report = basetemp + "-outcomes.json"
    env["MEGARLHF_OUTCOMES"] = report
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p",
                           "no:cacheprovider", f"--basetemp={basetemp}", "-n", "0", *tests],
                          cwd=copy, env=env, capture_output=True, text=True)
    seen = json.load(open(report)) if os.path.exists(report) else {}
    return proc.returncode, seen, proc.stdout + proc.stderr, time.perf_counter() - start


def verdict(code: int, seen: dict[str, str]) -> tuple[str, str]:
    """(verdict, the test that decided it): killed when a test's own check failed; a crash
    (the mutated code raised, a command it ran exited non-zero, a fixture broke) and an
    error of pytest's (collection, usage) are reported as what they are, never as kills."""
    checks = [t for t, o in seen.items() if o == "check"]
    crashes = [t for t, o in seen.items() if o == "crash"]
    if checks:
        return "killed", checks[0].split("::", 1)[-1]
    if crashes:
        return "CRASHED", crashes[0].split("::", 1)[-1]
    if code == 0 and seen:
        return "SURVIVED", "-"
    return f"ERROR (pytest exit {code})", "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once")
    parser.add_argument("--only", nargs="*", default=None, help="mutant names")
    parser.add_argument("--fast", action="store_true",
                        help="only the fast subset (the fast tier of scripts/test.sh)")
    parser.add_argument("--passed", default=None, metavar="OUTCOMES.json",
                        help="the suite's outcomes (MEGARLHF_OUTCOMES of the pytest run on "
                        "this tree): the killing tests that passed there are not run again "
                        "on the unmutated copy")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", default=None, help="scratch folder to keep (default: a "
                        "temporary one, removed at the end)")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:34s} {'fast' if m.fast else 'ext.'} {m.path}: {m.what}")
        return 0
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    chosen = [m for m in MUTANTS if (args.only is None or m.name in args.only)
              and (m.fast or not args.fast)]
    scratch = args.keep or tempfile.mkdtemp(prefix="megarlhf-mutants-")
    os.makedirs(scratch, exist_ok=True)
    files = tracked_files()
    tiny = os.path.join(scratch, "tiny")
    try:
        clean = os.path.join(scratch, "clean")
        make_copy(clean, files)
        start = time.perf_counter()
        seconds = build_shared(clean, tiny)
        print(f"mutants: the tiny models built by the unmutated copy ({seconds:.0f} s)",
              flush=True)
        # The unmutated copy must pass every killing test, so that a kill means the
        # mutation: the suite's own run on this tree says so for the tests it ran; the
        # others run here.
        tests = sorted({t for m in chosen for t in m.tests})
        passed = json.load(open(args.passed)) if args.passed else {}
        unproven = [t for t in tests if passed.get(t) != "passed"]
        if unproven:
            cases = sorted({c for m in chosen for c in m.cases})
            code, seen, output, seconds = run_tests(clean, tiny, unproven, cases,
                                                    os.path.join(scratch, "tmp-clean"))
            if code != 0:
                print(output[-6000:])
                print(f"mutants: the unmutated code fails its mutants' tests (exit {code}): "
                      "fix that first")
                return 2
        print(f"mutants: the unmutated code passes the {len(tests)} killing tests "
              f"({len(tests) - len(unproven)} in the suite's run, {len(unproven)} run here)",
              flush=True)

        def one(m: Mutant):
            copy = os.path.join(scratch, m.name)
            make_copy(copy, files)
            mutate(copy, m)
            code, seen, output, seconds = run_tests(copy, tiny, m.tests, m.cases,
                                                    os.path.join(scratch, f"tmp-{m.name}"))
            shutil.rmtree(copy, ignore_errors=True)
            return (m, *verdict(code, seen), seconds, output)

        rows = []
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for m, result, killer, seconds, output in pool.map(one, chosen):
                rows.append((m, result, killer, seconds))
                print(f"  {m.name:34s} {result:8s} {seconds:5.1f} s  {killer}", flush=True)
                if result != "killed":
                    print(output[-3000:])
        total = time.perf_counter() - start
        print("\n| mutant | what | killed by | tier | s |\n|---|---|---|---|---|")
        for m, result, killer, seconds in rows:
            mark = f"`{killer}`" if result == "killed" else f"**{result}** `{killer}`"
            print(f"| `{m.name}` | {m.what} | {mark} | {'fast' if m.fast else 'extended'} "
                  f"| {seconds:.0f} |")
        alive = [f"{m.name} ({result})" for m, result, _, _ in rows if result != "killed"]
        print(f"\nmutants: {len(rows) - len(alive)} of {len(rows)} killed in {total:.0f} s"
              + (f"; not killed: {', '.join(alive)}" if alive else ""))
        return 1 if alive else 0
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
