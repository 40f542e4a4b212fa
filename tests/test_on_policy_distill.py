"""On-policy distillation (``ppo.teacher``): a frozen teacher of its own checkpoint and
layout scores the student's sampled tokens, and the reverse KL to it joins the rewards or
the loss. The arithmetic against a loop; the runs against one process and against a
teacher that is the student itself."""

import os

import pytest
import torch

from conftest import run_cli, tiny_ppo_args, torchrun
from megarlhf import algos
from megarlhf.engine.metrics import read_metrics

pytestmark = pytest.mark.slow


def _targets(estimator, **kw):
    mask = torch.tensor([[1, 1, 1, 0.], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    gen = torch.Generator().manual_seed(0)
    common = dict(logprobs_BT=-torch.rand(4, 4, generator=gen) * mask,
                  ref_logprobs_BT=-torch.rand(4, 4, generator=gen) * mask,
                  values_BT=torch.rand(4, 4, generator=gen), scores_B=torch.tensor(
                      [1.0, -0.5, 0.25, 2.0]), mask_BT=mask, kl_estimator="k1", kl_coef=0.1,
                  clip_reward_value=None, whiten_rewards=False, whiten_unbiased=True,
                  estimator=estimator, gamma=1.0, lam=0.95, group_size=4,
                  whiten_advantages=False, group_norm="sequence")
    common.update(kw)
    return common, mask


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp", "grpo", "rloo"])
def test_the_teachers_kl_in_the_reward_equals_a_loop(estimator):
    """k1 = log p_student - log p_teacher per token, coef x it off each token's reward
    (GAE, REINFORCE++) or, summed, off the score (GRPO, RLOO): the same targets as a batch
    whose rewards or scores a loop shaped so. Catches the teacher's KL with the wrong sign,
    on padding, or missing from an estimator."""
    common, mask = _targets(estimator)
    teacher = -torch.rand(4, 4, generator=torch.Generator().manual_seed(1)) * mask
    got = algos.learning_targets(teacher_logprobs_BT=teacher, teacher_coef=0.5, **common)
    kl = torch.zeros(4, 4)
    for b in range(4):
        for t in range(4):
            if mask[b, t]:
                kl[b, t] = common["logprobs_BT"][b, t] - teacher[b, t]
    assert torch.allclose(got["teacher_kl_BT"], kl)
    if estimator in ("grpo", "rloo"):
        want = algos.learning_targets(**{**common, "scores_B": common["scores_B"]
                                         - 0.5 * kl.sum(dim=1)})
        assert torch.allclose(got["advantages_BT"], want["advantages_BT"])
    else:
        plain = algos.learning_targets(**common)
        assert torch.allclose(got["rewards_BT"], plain["rewards_BT"] - 0.5 * kl)
        assert not torch.allclose(got["advantages_BT"], plain["advantages_BT"])
    # reported, not in the reward, when the loss takes it
    off = algos.learning_targets(teacher_logprobs_BT=teacher, teacher_coef=0.0, **common)
    assert torch.equal(off["rewards_BT"], algos.learning_targets(**common)["rewards_BT"])
    assert torch.allclose(off["teacher_kl_BT"], kl)


def _rows(out, name):
    return {r["step"]: r for r in read_metrics(os.path.join(out, name))
            if "objective/teacher_kl" in r}


def test_a_teacher_that_is_the_student_teaches_nothing(tiny_checkpoints, tmp_path):
    """The teacher is the student's own checkpoint at the student's layout, the task's
    reward off (pure distillation), the KL in the loss: at the first iteration the reverse
    KL is 0 exactly, and the update at the old policy is a no-op (approx-KL 0, nothing
    clipped). Catches the teacher scoring other tokens or positions than the student."""
    out, _, _ = tiny_checkpoints
    args = tiny_ppo_args(tiny_checkpoints, tmp_path, "self",
                         f"roles.teacher.checkpoint={out}/sft-tiny/checkpoints/step_0000006",
                         "ppo.teacher.coef=0.5", "ppo.teacher.task_reward=false",
                         "ppo.teacher.kl_in=loss", "ppo.reward_checkpoint=null",
                         "ppo.advantage_estimator=grpo", "ppo.group_size=4",
                         "ppo.kl.in_reward=true", "ppo.missing_stop_penalty=null",
                         "ppo.num_iterations=1", "ppo.ppo_epochs=1", "ppo.mini_batch_size=32")
    run_cli(*args)
    first = _rows(tmp_path, "self")[1]
    assert first["objective/teacher_kl"] == 0.0 and first["objective/score"] == 0.0
    assert abs(first["ppo/policy/approxkl"]) < 1e-7 and first["ppo/policy/clipfrac"] == 0.0
    assert first["ppo/policy/teacher_loss"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.extended
def test_a_teacher_at_tp2_scores_as_in_one_process(tiny_checkpoints, tmp_path):
    """The teacher (the SFT policy's earlier checkpoint: another model than the student)
    at TP=2 while the student trains at TP=1 x DP=2: the first iteration's reverse KL to it
    and its score equal one process's, and the KL is not 0. Catches the teacher's pass at
    its own layout reading other rows or another vocabulary split."""
    out, _, _ = tiny_checkpoints
    common = [f"roles.teacher.checkpoint={out}/sft-tiny/checkpoints/step_0000003",
              "ppo.teacher.coef=0.2", "ppo.num_iterations=1"]
    run_cli(*tiny_ppo_args(tiny_checkpoints, tmp_path, "one", *common))
    torchrun(tiny_ppo_args(tiny_checkpoints, tmp_path, "two", *common,
                           "roles.teacher.parallel.tensor_model_parallel_size=2"), 2)
    one, two = _rows(tmp_path, "one")[1], _rows(tmp_path, "two")[1]
    assert one["objective/teacher_kl"] != 0.0
    for key in ("objective/teacher_kl", "objective/score", "objective/kl"):
        assert abs(one[key] - two[key]) <= 1e-5 + 1e-5 * abs(one[key]), key
