"""PPO with first-class roles through the CLI: an actor of 4 layers x 64, a reward model and
critic of 2 layers x 32 (their own checkpoint, their own size), each role at its own layout
on 2 processes, against the same run with every role at TP=1 PP=1 in one process; then a
resume at yet another layout; and the start-up errors a user meets."""

import json
import os

import pytest

from conftest import run_cli, torchrun
from megarlhf.data.synthetic import write_task
from megarlhf.engine.metrics import read_metrics

pytestmark = pytest.mark.slow

KEYS = ("objective/score", "objective/kl", "ppo/policy/loss", "ppo/val/loss",
        "ppo/policy/approxkl", "ppo/policy/clipfrac", "objective/entropy",
        "ppo/val/explained_var", "rollout/response_len_mean")
MIXED = ["roles.actor.parallel.tensor_model_parallel_size=2",
         "roles.critic.parallel.tensor_model_parallel_size=1",
         "roles.critic.parallel.pipeline_model_parallel_size=2",
         "roles.reference.parallel.tensor_model_parallel_size=1"]
OTHER = ["roles.actor.parallel.pipeline_model_parallel_size=2",
         "roles.critic.parallel.tensor_model_parallel_size=2",
         "roles.critic.parallel.pipeline_model_parallel_size=1",
         "roles.reward.parallel.pipeline_model_parallel_size=1",  # DP=2
         "rollout.tensor_parallel_size=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_roles")
    task = write_task(str(out / "task"), seed=0)
    common = [f"tokenizer.path={task['tokenizer']}", f"run.output_dir={out}",
              "logging.progress_bar=false", "logging.tensorboard=false"]
    run_cli("sft", "configs/sft_tiny.yaml", f"data.train_path={task['sft']}", "model.num_layers=4",
            "train.max_steps=6", "checkpoint.save_interval=0", *common)
    run_cli("rm", "configs/rm_tiny.yaml", f"data.train_path={task['prefs']}", "model.num_layers=2",
            "model.hidden_size=32", "train.max_steps=6", "checkpoint.save_interval=0", *common)
    # No model block: every role's model comes from its checkpoint.
    ppo = ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
           f"data.eval_path={task['eval_prompts']}", "ppo.num_eval_prompts=16",
           f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
           f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.eval_interval=100",
           "logging.sample_table_interval=0", "checkpoint.save_interval=3",
           "checkpoint.keep_last=2", *common]
    run_cli(*ppo, "run.name=single", "ppo.num_iterations=5")
    return out, ppo


def metrics(out, name):
    return {r["step"]: r for r in read_metrics(os.path.join(out, name)) if "objective/kl" in r}


def assert_same(ref, got, steps):
    for step in steps:
        for key in KEYS:
            a, b = ref[step][key], got[step][key]
            assert abs(a - b) <= 1e-5 + 1e-4 * abs(a), (step, key, a, b)
        # TRL's value clipfrac counts (V_clipped - R)^2 > (V - R)^2, which inside the clip
        # range compares two roundings of one number: a token or two may flip when the
        # critic's layout changes the summation order.
        a, b = ref[step]["ppo/val/clipfrac"], got[step]["ppo/val/clipfrac"]
        assert abs(a - b) <= 0.02, (step, "ppo/val/clipfrac", a, b)


@pytest.mark.extended
def test_roles_at_their_own_layouts_follow_one_process_then_resume_elsewhere(setup):
    out, ppo = setup
    ref = metrics(out, "single")
    assert sorted(ref) == [1, 2, 3, 4, 5]
    proc = torchrun(ppo + ["run.name=mixed", "ppo.num_iterations=3", *MIXED], 2)
    for line in ("actor     lm    llama 4x64", "TP=2 PP=1", "critic    value llama 2x32",
                 "TP=1 PP=2", "reward    value llama 2x32"):
        assert line in proc.stdout, line
    got = metrics(out, "mixed")
    assert sorted(got) == [1, 2, 3]
    assert_same(ref, got, [1, 2, 3])
    # Resume the 2-process run from its iteration-3 checkpoint with every role elsewhere.
    proc = torchrun(ppo + ["run.name=mixed", "ppo.num_iterations=5", *OTHER], 2)
    assert "resumed iter_000003 at iteration 3" in proc.stdout
    got = metrics(out, "mixed")
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert_same(ref, got, [4, 5])
    meta = json.load(open(out / "mixed" / "checkpoints" / "iter_000005" / "megarlhf_meta.json"))
    assert meta["roles"]["critic"]["model"]["hidden_size"] == 32
    assert meta["roles"]["actor"]["model"]["num_layers"] == 4
    assert "actor TP=1 PP=2 DP=1; critic TP=2 PP=1 DP=1" in meta["layout"]


def test_config_show_prints_the_resolved_roles(setup):
    out, ppo = setup
    shown = run_cli("config", "show", *ppo[1:], *MIXED, "--world-size", "2")
    resolved = shown.stdout.split("# resolved roles at world size 2")[1]
    assert "critic:" in resolved and "hidden_size: 32" in resolved
    assert "pipeline_model_parallel_size: 2" in resolved


@pytest.mark.parametrize("extra, message", [
    (["ppo.sft_checkpoint={out}/rm-tiny/checkpoints"],
     "roles.actor: the checkpoint {out}/rm-tiny/checkpoints/step_0000006 (role 'reward') is a "
     "value model (scalar head), but this role needs a language model"),
    (["roles.reward.parallel.tensor_model_parallel_size=3"],
     "roles.reward.parallel.tensor_model_parallel_size=3 is invalid"),
    (["roles.critic.model.hidden_size=64"],
     "roles.critic: roles.critic.model.hidden_size=64 but the checkpoint"),
    # configs/demo/ppo.yaml writes init_kl_coef 0.3: GRPO does not put the KL in the reward
    (["ppo.advantage_estimator=grpo", "ppo.group_size=2", "ppo.kl.controller=fixed"],
     "ppo.kl.init_coef=0.3 has no effect: the KL is not in the reward"),
])
def test_bad_role_inputs_fail_at_start_up(setup, extra, message):
    out, ppo = setup
    args = [a.format(out=out) for a in ppo + extra] + ["run.name=bad"]
    proc = run_cli(*args, check=False)
    assert proc.returncode == 2 and message.format(out=out) in proc.stderr, proc.stderr[-2000:]
    assert not os.path.exists(out / "bad" / "metrics.jsonl")  # no work started


def test_update_at_the_old_policy_is_a_no_op_at_mixed_layouts(setup):
    """One epoch, one mini-batch: the first update happens at the old policy, so the ratio
    is 1 everywhere - approx-KL 0 and clip fraction 0 - with every role at its own layout."""
    out, ppo = setup
    torchrun(ppo + ["run.name=noop", "ppo.num_iterations=1", "ppo.ppo_epochs=1",
                    "ppo.mini_batch_size=32", "ppo.micro_batch_size=8", *MIXED], 2)
    first = metrics(out, "noop")[1]
    assert abs(first["ppo/policy/approxkl"]) < 1e-7 and first["ppo/policy/clipfrac"] == 0.0
    assert first["rollout/logprob_diff_max"] < 1e-5  # sampler and trainer agree
