"""Mutants that must die: small, plausible bugs planted in a scratch copy of the
repository, each run against the tests that claim to catch it.

    .venv/bin/python tests/mutants.py [--jobs 2] [--only NAME ...] [--list]

For each mutant the script copies the repository (tracked files) into a scratch folder,
replaces one line (the text must occur exactly once), checks that Python imports
``megarlhf`` from the copy, and runs the mutant's tests there with pytest. A mutant is
killed when a test fails (pytest exit code 1); it survives when they pass, and an error
that is not a test failure (a mutant that does not import, a collection error) is
reported as such, not counted as a kill. Before any mutant, the same tests run on the
unmutated copy and must pass, so a kill means the mutation, not a broken test. The tiny
SFT policy and reward model are trained once, by the unmutated code, and shared
(``MEGARLHF_TINY_DIR``); the PPO reference tests run only the cases a mutant names
(``MEGARLHF_TRACE_CASES``).

Prints a table (mutant, killing test, seconds) and exits 1 when a mutant survives.
``scripts/test.sh`` runs it after the suite; tests/README.md holds the last table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
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


def ref(test: str, case: str = "gae_k1") -> str:
    return f"{REF}::{test}[{case}]"


MUTANTS = [
    Mutant("kl_arguments_swapped", "the KL penalty's arguments swapped (KL of the reference "
           "from the policy): the reward pays for moving away from the reference",
           "megarlhf/algos/targets.py",
           "kl_per_token(logprobs_BT, ref_logprobs_BT, mask, kl_estimator)",
           "kl_per_token(ref_logprobs_BT, logprobs_BT, mask, kl_estimator)",
           (ref("test_experience_against_plain_loops"),)),
    Mutant("loss_old_is_current", "the policy loss's old log-probs replaced by the current "
           "ones: the ratio is always 1 and nothing is clipped",
           "megarlhf/engine/steps.py",
           'logprobs_BT, batch["old_logprobs"], batch["advantages"], mask,',
           'logprobs_BT, logprobs_BT.detach(), batch["advantages"], mask,',
           (ref("test_every_micro_batch_loss_against_a_loop"),
            ref("test_the_policy_moves_and_the_clip_bites"))),
    Mutant("gae_bootstrap_dropped", "GAE without the next state's value (delta = r - V)",
           "megarlhf/algos/advantages.py",
           "delta = rewards[:, t] + gamma * next_value - values[:, t]",
           "delta = rewards[:, t] - values[:, t]",
           (ref("test_experience_against_plain_loops"),)),
    Mutant("score_on_first_token", "the score added at the first response token instead of "
           "the last", "megarlhf/algos/rewards.py",
           "rewards[rows, last[rows]] += scores[rows]", "rewards[rows, 0] += scores[rows]",
           (ref("test_experience_against_plain_loops"),)),
    Mutant("response_mask_shifted", "the response mask shifted one token to the right",
           "megarlhf/rollout/experience.py", "mask = gen.model_mask_BT().float()",
           "mask = torch.roll(gen.model_mask_BT().float(), 1, dims=1)",
           (ref("test_trained_tokens_and_scores_follow_the_rules"),)),
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
    Mutant("ema_update_skipped", "the EMA actor never updated", "megarlhf/stages/ppo.py",
           "                ema.update(actor.parameters)", "                pass",
           (ref("test_ema_actor_follows_a_loop_over_the_steps"),)),
    Mutant("critic_not_stepped", "the critic's gradients computed but never applied",
           "megarlhf/stages/ppo.py",
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
           "megarlhf/rollout/experience.py", "if self.cfg.rollout.recompute_logprobs:",
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
           "megarlhf/stages/ppo.py",
           '                objects={"rollout_queue": session.rollouts.state_dict(),',
           '                objects={"rollout_queue_": session.rollouts.state_dict(),',
           ("tests/test_async.py::"
            "test_stale_grpo_follows_the_schedule_and_resumes_exactly_after_sigkill",), ()),
    Mutant("split_weights_sent_once", "rollout.placement=split: the weights are sent to the "
           "rollout ranks at the first request only, so they sample every later batch with "
           "the initial actor",
           "megarlhf/rollout/remote.py",
           "        sync = version != self.held",
           "        sync = self.held is None",
           ("tests/test_async.py::test_split_placement_equals_colocated[1]",), ()),
    Mutant("partial_versions_not_recorded", "rollout.partial: the tokens sampled after an "
           "in-flight update keep the version the batch started with",
           "megarlhf/rollout/remote.py",
           "                gen.versions_BT > 0, inflight.version or 0, version)",
           "                gen.versions_BT > 99, inflight.version or 0, version)",
           ("tests/test_async.py::"
            "test_partial_rollouts_switch_weights_mid_batch_with_each_tokens_version",), ()),
    Mutant("partial_kv_not_recomputed", "rollout.partial_kv=recompute: the old weights' keys "
           "and values are kept after new weights arrive mid-generation",
           "megarlhf/rollout/generate.py",
           "            if ctx is not None and recompute_kv:",
           "            if ctx is not None and recompute_kv and False:",
           ("tests/test_rollout.py::test_partial_rollout_tokens_carry_their_version_and_"
            "behaviour_logprob[recompute-static]",), ()),
    Mutant("reward_timeout_not_enforced", "rollout.reward_timeout_s: a reward call that hangs "
           "is waited for, however long",
           "megarlhf/rollout/verifiers.py",
           "            for worker in [w for w in busy.values() if now - w.started >= self.timeout_s]:",
           "            for worker in [w for w in busy.values() if now - w.started >= 1e9]:",
           ("tests/test_verifiers.py::test_worker_pool_outlives_every_misbehaving_call",), ()),
    Mutant("observations_trained", "multi-turn: the environment's tokens (observations) in "
           "the loss mask, trained as if the model had written them",
           "megarlhf/rollout/generate.py",
           "        return self.response_mask_BT * (1 - self.observation_BT.to(self.response_mask_BT.dtype))",
           "        return self.response_mask_BT",
           ("tests/test_multiturn.py::test_episode_tokens_are_the_turns_as_sampled_and_as_"
            "the_template_renders",), ()),
    Mutant("gae_bootstraps_across_observations", "GAE takes the value after a model turn "
           "from the observation's (masked) token instead of the next model token's",
           "megarlhf/algos/advantages.py",
           "        next_value = torch.where(here > 0, values[:, t], next_value)",
           "        next_value = values[:, t]",
           ("tests/test_multiturn.py::test_gae_and_returns_skip_the_environments_tokens",), ()),
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


def run_tests(copy: str, tiny: str, tests, cases, basetemp: str
              ) -> tuple[int, str, float]:
    env = env_for(copy, tiny, cases)
    where = subprocess.run([sys.executable, "-c", "import megarlhf; print(megarlhf.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True)
    if not where.stdout.strip().startswith(copy):
        raise SystemExit(f"megarlhf imports from {where.stdout.strip() or where.stderr!r}, "
                         f"not from the scratch copy {copy}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p",
                           "no:cacheprovider", f"--basetemp={basetemp}", "-n", "0", *tests],
                          cwd=copy, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def first_failure(output: str) -> str:
    found = re.search(r"^FAILED (\S+)", output, re.M)
    return found.group(1).split("::", 1)[-1] if found else "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once")
    parser.add_argument("--only", nargs="*", default=None, help="mutant names")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", default=None, help="scratch folder to keep (default: a "
                        "temporary one, removed at the end)")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28s} {m.path}: {m.what}")
        return 0
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    scratch = args.keep or tempfile.mkdtemp(prefix="megarlhf-mutants-")
    os.makedirs(scratch, exist_ok=True)
    files = tracked_files()
    tiny = os.path.join(scratch, "tiny")
    try:
        # The unmutated copy: the targeted tests pass, and the shared inputs get built.
        clean = os.path.join(scratch, "clean")
        make_copy(clean, files)
        tests = sorted({t for m in chosen for t in m.tests})
        cases = sorted({c for m in chosen for c in m.cases})
        start = time.perf_counter()
        code, output, seconds = run_tests(clean, tiny, tests, cases,
                                          os.path.join(scratch, "tmp-clean"))
        if code != 0:
            print(output[-6000:])
            print(f"mutants: the unmutated code fails its mutants' tests (exit {code}): fix "
                  "that first")
            return 2
        print(f"mutants: unmutated copy passes {len(tests)} tests ({seconds:.0f} s)",
              flush=True)

        def one(m: Mutant):
            copy = os.path.join(scratch, m.name)
            make_copy(copy, files)
            mutate(copy, m)
            code, output, seconds = run_tests(copy, tiny, m.tests, m.cases,
                                              os.path.join(scratch, f"tmp-{m.name}"))
            shutil.rmtree(copy, ignore_errors=True)
            if code == 1:
                return m, "killed", first_failure(output), seconds, output
            verdict = "SURVIVED" if code == 0 else f"error (pytest exit {code})"
            return m, verdict, "-", seconds, output

        rows = []
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for m, verdict, killer, seconds, output in pool.map(one, chosen):
                rows.append((m, verdict, killer, seconds))
                print(f"  {m.name:28s} {verdict:8s} {seconds:5.1f} s  {killer}", flush=True)
                if verdict != "killed":
                    print(output[-3000:])
        total = time.perf_counter() - start
        print("\n| mutant | what | killed by | s |\n|---|---|---|---|")
        for m, verdict, killer, seconds in rows:
            mark = killer if verdict == "killed" else f"**{verdict}**"
            print(f"| `{m.name}` | {m.what} | `{mark}` | {seconds:.0f} |")
        alive = [m.name for m, verdict, _, _ in rows if verdict != "killed"]
        print(f"\nmutants: {len(rows) - len(alive)} of {len(rows)} killed in {total:.0f} s"
              + (f"; not killed: {', '.join(alive)}" if alive else ""))
        return 1 if alive else 0
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
