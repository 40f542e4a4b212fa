"""Bounded staleness (issue 41): batch i sampled by policy version max(0, i - k).

- The schedule itself (``rollout.schedule.StaleSchedule``) against the formula, for
  several k and run lengths, with a checkpoint round trip at every iteration and a
  resume under a smaller k;
- end to end (the CLI, GRPO, one update per batch): the recorded versions of every
  trained token give the stated staleness at each iteration; the batches sampled ahead
  really are an older policy's (the sampler's log-probs differ from the trainer's, and
  the decoupled loss - the default at k > 0 - weights them); a rerun is identical; and a
  run killed with SIGKILL in iteration 3 and resumed equals the uninterrupted one exactly
  (the waiting batches come from the checkpoint: sampled again by the resumed actor they
  would be less stale, and the metrics would differ).
"""

import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, run_cli
from megarlhf.rollout.experience import Sampled
from megarlhf.rollout.generate import Generation
from megarlhf.rollout.schedule import StaleSchedule, sampling_version, staleness_metrics


# ------------------------------------------------------------------ the schedule alone

def _batch(batch: int, version: int) -> Sampled:
    """A one-row batch whose tokens name the batch and whose versions the sampler's."""
    mask = torch.tensor([[1, 1, 0]])
    gen = Generation(prompt_tokens_BP=torch.tensor([[batch]]), prompt_mask_BP=torch.ones(1, 1),
                     response_tokens_BT=torch.tensor([[batch, batch, 0]]), response_mask_BT=mask,
                     logprobs_BT=torch.zeros(1, 3), finished_B=torch.tensor([True]),
                     versions_BT=mask * version)
    return Sampled(gen, torch.tensor([True]), torch.tensor([float(batch)]),
                   {"timing/rollout": 0.0}, {"computed": 3, "padding": 1})


def _run(k: int, n: int, resume_at: int | None = None, resume_k: int | None = None):
    """(every (batch, version) sampled, in order; every (batch, trained-by) taken)."""
    calls, taken = [], []

    def sample(batch, version):
        calls.append((batch, version))
        return _batch(batch, version)

    sched = StaleSchedule(k, n, sample, log=lambda _: None)
    for it in range(n):
        if it == resume_at:  # a new process, from the checkpoint saved after it iterations
            state = sched.state_dict()
            sched = StaleSchedule(resume_k if resume_k is not None else k, n, sample,
                                  log=lambda _: None)
            sched.load_state_dict(state, start=it)
        got = sched.take(it)
        assert int(got.gen.response_tokens_BT[0, 0]) == it
        taken.append((it, int(got.gen.versions_BT.max())))
    return calls, taken


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_batch_i_is_sampled_by_version_i_minus_k(k, n):
    """Each batch sampled once, by max(0, i - k), in batch order; trained at iteration i;
    a resume from the checkpoint of any iteration gives the same batches."""
    calls, taken = _run(k, n)
    assert calls == [(i, max(0, i - k)) for i in range(n)]
    assert taken == [(i, sampling_version(i, k)) for i in range(n)]
    for at in range(1, n):
        assert _run(k, n, resume_at=at) == (calls, taken)


def test_a_resume_under_a_smaller_k_resamples_what_it_cannot_train():
    """Saved at k=3 after iteration 2 (waiting: batches 2 and 3 by version 0, batch 4 by
    version 1) and resumed at k=2: batch 2 (2 old at iteration 2) is kept; batches 3 and 4
    (3 old) are dropped and sampled again by the resumed actor (version 2), and batch 5 by
    version 3 as the k=2 schedule says."""
    calls, taken = _run(3, 6, resume_at=2, resume_k=2)
    assert calls[:5] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 1)]
    assert calls[5:] == [(3, 2), (4, 2), (5, 3)]
    assert taken[2:] == [(2, 0), (3, 2), (4, 2), (5, 3)]


def test_staleness_metrics_read_the_trained_tokens_and_refuse_older_ones():
    versions = torch.tensor([[3, 3, 9], [2, 2, 2]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # the 9 is padding
    assert staleness_metrics(versions, mask, 4, 2) == {"rollout/staleness_mean": 4 / 3,
                                                       "rollout/staleness_max": 2.0}
    with pytest.raises(RuntimeError, match="versions \\[2, 3\\].*max_staleness=1"):
        staleness_metrics(versions, mask, 4, 1)


def test_a_waiting_batch_survives_the_checkpoint_format():
    """Saved as the checkpoint saves objects and read back with weights_only."""
    import io
    sched = StaleSchedule(2, 5, _batch, log=lambda _: None)
    sched.take(0)
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    back = StaleSchedule(2, 5, _batch, log=lambda _: None)
    back.load_state_dict(torch.load(buf, weights_only=True), start=1)
    assert sorted(back.waiting) == [1, 2]
    for b in (1, 2):
        a, c = sched.waiting[b], back.waiting[b]
        for name in ("response_tokens_BT", "versions_BT", "logprobs_BT"):
            assert torch.equal(getattr(a.gen, name), getattr(c.gen, name))
        assert a.metrics == c.metrics and a.padding == c.padding


# ------------------------------------------------------------------ end to end

def _cli(setup, name, k, extra=()):
    out, task, common = setup
    return ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
            f"roles.reference.checkpoint={out}/sft-tiny/checkpoints/step_0000003",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", *common,
            f"run.name={name}", f"ppo.max_staleness={k}", "ppo.advantage_estimator=grpo",
            "ppo.group_size=2", "ppo.init_kl_coef=0", "ppo.kl_controller=fixed",
            "ppo.kl_loss_coef=0.1", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=16",
            "ppo.micro_batch_size=8", "ppo.num_iterations=4", "ppo.ppo_epochs=1",
            "optimizer.lr=3e-4", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
            "ppo.eval_interval=4", "ppo.num_eval_prompts=8", "logging.sample_table_interval=0",
            *extra]


def _records(out, name):
    from megarlhf.engine.metrics import read_metrics
    return {r["step"]: r for r in read_metrics(os.path.join(out, name))}


def _same(one: dict, two: dict, steps) -> None:
    for step in steps:
        for key, value in one[step].items():
            if not key.startswith(("timing/", "perf/", "memory/")):
                assert two[step][key] == value, (step, key, value, two[step][key])


@pytest.mark.slow
def test_stale_grpo_follows_the_schedule_and_resumes_exactly_after_sigkill(tiny_checkpoints):
    out = tiny_checkpoints[0]
    k = 2
    run_cli(*_cli(tiny_checkpoints, "async_full", k))
    got = _records(out, "async_full")
    assert sorted(got) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # iteration it trains batch it, sampled by max(0, it - k)
        age = min(step - 1, k)
        assert got[step]["rollout/staleness_mean"] == got[step]["rollout/staleness_max"] == age
    # Batch 0 is the trainer's own policy: sampler and trainer log-probs agree to rounding,
    # and the decoupled loss (the default at k > 0) weights its tokens by 1. Later batches
    # are an older actor's: they disagree, and the weights move off 1.
    assert got[1]["rollout/logprob_diff_mean"] < 1e-5
    assert abs(got[1]["ppo/policy/behavior_weight"] - 1.0) < 1e-5
    for step in (2, 3, 4):
        assert got[step]["rollout/logprob_diff_mean"] > 1e-3, (step, got[step])
        assert abs(got[step]["ppo/policy/behavior_weight"] - 1.0) > 1e-4, (step, got[step])
    # at the old policy (batch 0, one update per batch) the update is a no-op
    assert got[1]["ppo/policy/approxkl"] == 0.0 and got[1]["ppo/policy/clipfrac"] == 0.0

    # killed in iteration 3's update, after the checkpoint of iteration 2
    argv = [sys.executable, os.path.join(WORKERS, "kill_after_saves.py"), "2",
            "update of the actor", *_cli(tiny_checkpoints, "async_killed", k)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    latest = out / "async_killed" / "checkpoints" / "latest"
    assert latest.read_text().strip() == "iter_000002"
    resumed = run_cli(*_cli(tiny_checkpoints, "async_killed", k))
    assert "resumed iter_000002" in resumed.stdout
    assert "sampled again" not in resumed.stdout and "not the uninterrupted" not in resumed.stdout
    again = _records(out, "async_killed")
    assert sorted(again) == [0, 1, 2, 3, 4]
    _same(got, again, (0, 1, 2, 3, 4))  # a rerun, then the resume: the same run
