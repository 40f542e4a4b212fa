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

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, run_cli
from megarlhf.rollout.experience import Sampled
from megarlhf.inference.generate import Generation
from megarlhf.rollout.schedule import StaleSchedule, sampling_version, staleness_metrics


# ------------------------------------------------------------------ the schedule alone

def _batch(batch: int, version: int) -> Sampled:
    """A one-row batch whose tokens name the batch and whose versions the sampler's."""
    mask = torch.tensor([[1, 1, 0]])
    gen = Generation(prompt_tokens_BP=torch.tensor([[batch]]), prompt_mask_BP=torch.ones(1, 1),
                     response_tokens_BT=torch.tensor([[batch, batch, 0]]), fed_mask_BT=mask,
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


def test_a_waiting_batch_saved_before_the_mask_was_renamed_still_loads():
    """Issue 56: Generation's mask of the tokens fed is ``fed_mask_BT`` (it was
    ``response_mask_BT``, the name an experience batch gives its trained tokens): a
    checkpoint's waiting batch written under the old name loads with the mask in place."""
    state = _batch(3, 0).gen.state_dict()
    state["response_mask_BT"] = state.pop("fed_mask_BT")
    back = Generation.from_state(state)
    assert torch.equal(back.fed_mask_BT, _batch(3, 0).gen.fed_mask_BT)


# ------------------------------------------------------------------ end to end

def _cli(setup, name, k, extra=()):
    out, task, common = setup
    return ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints/step_0000006",
            f"roles.reference.checkpoint={out}/sft-tiny/checkpoints/step_0000003",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", *common,
            f"run.name={name}", f"ppo.max_staleness={k}", "ppo.advantage_estimator=grpo",
            "ppo.group_size=2", "ppo.kl.init_coef=0", "ppo.kl.controller=fixed",
            "ppo.kl.loss_coef=0.1", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=16",
            "ppo.micro_batch_size=8", "ppo.num_iterations=4", "ppo.ppo_epochs=1",
            "optimizer.lr=3e-4", "checkpoint.save_interval=1", "checkpoint.keep_last=2",
            "ppo.eval_interval=4", "ppo.num_eval_prompts=8", "logging.sample_table_interval=0",
            *extra]


_MADE: set[str] = set()  # the run directories this session wrote


def _fresh(tiny, name: str) -> str:
    """``name``'s run directory removed, the first time this session uses it: a run left
    by an earlier session (MEGARLHF_TINY_DIR keeps them; tests/mutants.py shares one)
    would be resumed, not run."""
    if name not in _MADE:
        shutil.rmtree(tiny[0] / name, ignore_errors=True)
        _MADE.add(name)
    return name


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
    run_cli(*_cli(tiny_checkpoints, _fresh(tiny_checkpoints, "async_full"), k))
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
    argv = [sys.executable, os.path.join(WORKERS, "halt_at.py"), "update of the actor", "3",
            "KILL", *_cli(tiny_checkpoints, _fresh(tiny_checkpoints, "async_killed"), k)]
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


# ------------------------------------------------------------------ split placement

SPLIT = ["rollout.placement.mode=split", "rollout.placement.ranks=1", "rollout.placement.weight_checksum=true"]


def _split_run(tiny, name, k, extra=(), iterations=4):
    """A 2-process job: training rank 0, rollout rank 1."""
    return _cli(tiny, name, k, [*SPLIT, f"ppo.num_iterations={iterations}", *extra])


def _actor_scores(tiny, name) -> str:
    """Per-token log-probs of fixed sequences under the run's final actor (megarlhf score)."""
    out, task, _ = tiny
    seqs = out / "async_seqs.jsonl"
    seqs.write_text('{"tokens": [3, 7, 9, 11, 4]}\n{"tokens": [5, 6, 7]}\n')
    dest = out / f"score_{name}.jsonl"
    run_cli("score", "--config", "configs/sft_tiny.yaml", "--input", str(seqs), "--output",
            str(dest), "--ckpt-role", "actor", f"checkpoint.load={out}/{name}/checkpoints",
            f"tokenizer.path={task['tokenizer']}")
    return dest.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.extended), 1])
def test_split_placement_equals_colocated(tiny_checkpoints, k):
    """1 training + 1 rollout process against 1 colocated process, 4 iterations: every
    metric equal (not only to 1e-6: the same weights, prompts and per-prompt seeds give
    the same samples) and the final actors score equally; the weights the rollout rank
    held after each sync had the sender's SHA-256 (rollout.placement.weight_checksum: a mismatch
    stops the run), and at k = 0 its log-probs are the trainer's."""
    from conftest import torchrun
    out = tiny_checkpoints[0]
    colocated = _fresh(tiny_checkpoints, f"async_coloc_k{k}")
    split = _fresh(tiny_checkpoints, f"async_split_k{k}")
    run_cli(*_cli(tiny_checkpoints, colocated, k))
    proc = torchrun(_split_run(tiny_checkpoints, split, k), 2)
    assert "placement split: training ranks 0..0 (1), rollout ranks 1..1 (1)" in proc.stdout
    one, two = _records(out, colocated), _records(out, split)
    assert sorted(one) == sorted(two) == [0, 1, 2, 3, 4]
    _same(one, two, (0, 1, 2, 3, 4))
    for step in (1, 2, 3, 4):  # the weights of each version sent once; none needed last at k=1
        synced = two[step]["perf/weight_sync_bytes"] > 0 and two[step]["timing/weight_sync"] > 0
        assert synced == (k == 0 or step < 4), (step, two[step])
        assert two[step]["rollout/staleness_max"] == min(step - 1, k)
    if k == 0:
        assert all(two[s]["rollout/logprob_diff_max"] < 1e-6 for s in (1, 2, 3, 4))
    assert _actor_scores(tiny_checkpoints, colocated) == _actor_scores(tiny_checkpoints, split)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("side, phase, count", [("training", "update of the actor", 3),
                                                ("rollout", "generation", 4)])
def test_split_job_killed_on_either_side_resumes_exactly(tiny_checkpoints, side, phase, count):
    """k = 1: the training rank killed in iteration 3's update, or the rollout rank in
    iteration 3's generation (its 4th: batches 0 and 1 at the start, then one per
    iteration); torchrun ends the job, and the same command resumes from iteration 2's
    checkpoint - the batch sampled ahead comes from it, the rollout rank gets the resumed
    actor's weights - and gives the uninterrupted split run's metrics exactly."""
    from conftest import torchrun
    out = tiny_checkpoints[0]
    full, name = "async_split_k1", _fresh(tiny_checkpoints, f"async_split_killed_{side}")
    if full not in _MADE:  # (test_split_placement_equals_colocated[1] ran it)
        torchrun(_split_run(tiny_checkpoints, _fresh(tiny_checkpoints, full), 1), 2)
    killed = torchrun(os.path.join(WORKERS, "halt_at.py"), 2, phase, str(count), "KILL",
                      "ppo", *_split_run(tiny_checkpoints, name, 1)[1:], check=False)
    assert killed.returncode != 0 and "sends itself SIGKILL" in killed.stdout, \
        killed.stdout[-2000:] + killed.stderr[-2000:]
    latest = out / name / "checkpoints" / "latest"
    assert latest.read_text().strip() == "iter_000002"
    resumed = torchrun(_split_run(tiny_checkpoints, name, 1), 2)
    assert "resumed iter_000002" in resumed.stdout
    assert "sampled again" not in resumed.stdout
    _same(_records(out, full), _records(out, name), (0, 1, 2, 3, 4))


@pytest.mark.extended
@pytest.mark.slow
def test_a_stopped_rollout_rank_is_named_within_the_deadline(tiny_checkpoints):
    """The rollout rank wedged (SIGSTOP) in its 4th generation while the training rank
    trains: the training rank exits non-zero within parallel.timeout_minutes plus 30 s,
    naming job rank 1; nothing hangs."""
    import time
    from test_run_guards import alive, ranks
    out = tiny_checkpoints[0]
    name, deadline_s = _fresh(tiny_checkpoints, "async_split_stopped"), 9.0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           os.path.join(WORKERS, "halt_at.py"), "generation", "4", "STOP", "ppo",
           *_split_run(tiny_checkpoints, name, 1, [f"parallel.timeout_minutes={deadline_s / 60}"])[1:]]
    log_path = out / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        pids, until = {}, time.time() + 300
        while "sends itself" not in log_path.read_text() and time.time() < until \
                and launcher.poll() is None:
            pids = ranks(launcher) or pids
            time.sleep(0.1)
        halted = time.time()
        assert 0 in pids and 1 in pids and launcher.poll() is None, log_path.read_text()[-3000:]
        while alive(pids[0]) and time.time() - halted < deadline_s + 60:
            time.sleep(0.2)
        took = time.time() - halted
        os.kill(pids[1], signal.SIGKILL)  # torchrun would, after its own grace period
        launcher.wait(timeout=120)
    text = log_path.read_text()
    assert launcher.returncode != 0
    assert took < deadline_s + 30, took
    assert "rank(s) 1 (rollout rank 0" in text, text[-3000:]  # (its host, once it told it)
    assert "stopped sending heartbeats" in text and "rank 0 (training rank 0, host" in text


def _hang_at(tiny, name: str, hangs_in: str, setting: str) -> tuple[str, str]:
    """A 2-process split job (k = 0, one iteration) whose process entering ``hangs_in``
    first hangs alive (tests/workers/halt_at.py HANG), with ``setting`` at 3 s and
    parallel.timeout_minutes at 18 s: (the job's output from the hang on, STALLED)."""
    import time
    out = tiny[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           os.path.join(WORKERS, "halt_at.py"), hangs_in, "1", "HANG",
           "ppo", *_split_run(tiny, _fresh(tiny, name), 0, [
               "parallel.timeout_minutes=0.3", f"{setting}=0.05"], iterations=1)[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "sends itself SIGHANG" in text, text[-3000:]
    assert time.time() - start < 120 and "stopped sending heartbeats" not in text, text[-3000:]
    return text[text.index("sends itself SIGHANG"):], (out / name / "STALLED").read_text()


@pytest.mark.slow
def test_a_hung_weight_sync_ends_at_its_own_deadline_naming_the_other_side(tiny_checkpoints):
    """rollout.placement.sync_timeout_minutes (issue 60): the training rank hangs alive as
    it starts the first weight sync (its main thread asleep, its heartbeats going on, so
    the watchdog's stall check never fires); the rollout rank, waiting for the weights,
    ends at the sync's own deadline (3 s), well before parallel.timeout_minutes (18 s),
    with the watchdog's kind of message naming its phase, the setting and the training
    side's rank that still sends heartbeats; it leaves STALLED and the job exits
    non-zero."""
    text, stalled = _hang_at(tiny_checkpoints, "split_sync_deadline",
                             "weight sync to the rollout ranks",
                             "rollout.placement.sync_timeout_minutes")
    message = ("in phase 'weight sync from the training ranks', past its deadline of 3 s "
               "(rollout.placement.sync_timeout_minutes), waiting on the training side - "
               "rank(s) 0 (training rank 0, host")
    assert message in text and "which still sends heartbeats" in text, text[-3000:]
    assert "rank 1 (rollout rank 0" in text and message in stalled


@pytest.mark.slow
def test_a_hung_rollout_ends_the_wait_at_the_request_deadline(tiny_checkpoints):
    """rollout.placement.request_timeout_minutes: the rollout rank hangs alive in its
    first generation; the training rank, waiting for the samples, ends at the request's
    deadline (3 s) naming its phase, the setting and the rollout rank that still sends
    heartbeats, and leaves STALLED."""
    text, stalled = _hang_at(tiny_checkpoints, "split_request_deadline", "generation",
                             "rollout.placement.request_timeout_minutes")
    message = ("in phase 'waiting for the rollout ranks' samples', past its deadline of 3 s "
               "(rollout.placement.request_timeout_minutes), waiting on the rollout side - "
               "rank(s) 1 (rollout rank 0, host")
    assert message in text and "which still sends heartbeats" in text, text[-3000:]
    assert "rank 0 (training rank 0" in text and message in stalled


def test_the_plan_of_a_split_job_puts_the_kv_cache_on_the_rollout_ranks():
    """megarlhf plan, 16 processes, the last 4 sampling: 12 training ranks at the roles'
    layouts (DP 3), none of them with a rollout KV cache; 4 rollout ranks holding one
    TP=4 replica's weights in every phase and the KV cache of all 192 samples - 4 times a
    colocated rank's, whose 4 replicas share them. A batch the training ranks cannot split
    into padded micro-batches (256 samples over DP 3) is refused, as the run refuses it."""
    from megarlhf.config import load_config
    from megarlhf.memory.plan import plan_ppo
    sizes = ["ppo.rollout_batch_size=192", "ppo.mini_batch_size=48"]
    split_at = ["rollout.placement.mode=split", "rollout.placement.ranks=4"]
    split = plan_ppo(load_config("configs/plan_8b.yaml", [*split_at, *sizes]), 16)
    colocated = plan_ppo(load_config("configs/plan_8b.yaml", sizes), 16)
    assert split.world == 12 and split.rollout_ranks == 4 and len(split.ranks) == 16
    assert split.specs["actor"].layout.dp(split.world) == 3
    kv = ("inference", "kv_cache")
    assert all(rank["rollout"].get(kv, 0.0) == 0.0 for rank in split.ranks[:12])
    assert all(rank["rollout"][kv] == 4 * colocated.ranks[0]["rollout"][kv]
               for rank in split.ranks[12:])
    params = colocated.ranks[0]["rollout"][("inference", "params")]
    assert all(rank[p][("inference", "params")] == params
               for rank in split.ranks[12:] for p in rank)
    assert not any(("actor", "params") in rank["train"] for rank in split.ranks[12:])
    padded = ["ppo.max_tokens_per_micro_batch=null"]  # packed, shares by token count take it
    with pytest.raises(ValueError, match=r"ppo.mini_batch_size \(64\) is not divisible by "
                                         r"the data-parallel size \(3\)"):
        plan_ppo(load_config("configs/plan_8b.yaml", [*split_at, *padded]), 16)


@pytest.mark.extended
@pytest.mark.slow
def test_continuous_batching_trains_the_static_batchs_samples(tiny_checkpoints):
    """GRPO at k = 1, 16 samples through 3 decode slots (rollout.decode_slots) against one
    static batch, 3 iterations: the same responses (scores, lengths, stops exactly), every
    other metric to rounding, fewer idle decode slots."""
    out = tiny_checkpoints[0]
    static = _fresh(tiny_checkpoints, "async_static")
    slots = _fresh(tiny_checkpoints, "async_slots")
    run_cli(*_cli(tiny_checkpoints, static, 1, ["ppo.num_iterations=3"]))
    run_cli(*_cli(tiny_checkpoints, slots, 1, ["ppo.num_iterations=3", "rollout.decode_slots=3"]))
    one, two = _records(out, static), _records(out, slots)
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key, value in one[step].items():
            if key.startswith(("timing/", "perf/", "memory/")) or key == "rollout/idle_decode_slots":
                continue
            if key in ("objective/score", "rollout/response_len_mean", "rollout/eos_fraction"):
                assert two[step][key] == value, (step, key)
            else:
                assert abs(two[step][key] - value) <= 1e-5 + 1e-4 * abs(value), (step, key)
        assert two[step]["rollout/idle_decode_slots"] < one[step]["rollout/idle_decode_slots"]


@pytest.mark.extended
@pytest.mark.slow
def test_a_preemption_signal_to_the_rollout_rank_checkpoints_and_resumes(tiny_checkpoints):
    """SIGUSR1 (Slurm's preemption signal) to the rollout process only, in its second
    generation (batch 1, sampled in the first iteration at k = 1): it reports it with the
    batch, the training process checkpoints at the end of that iteration, leaves PREEMPTED, tells the rollout process
    to stop, and the job exits 0; the same command resumes and ends as the uninterrupted
    split run."""
    from conftest import torchrun
    out = tiny_checkpoints[0]
    full, name = "async_split_k1", _fresh(tiny_checkpoints, "async_split_preempted")
    if full not in _MADE:
        torchrun(_split_run(tiny_checkpoints, _fresh(tiny_checkpoints, full), 1), 2)
    first = torchrun(os.path.join(WORKERS, "halt_at.py"), 2, "generation", "2", "USR1",
                     "ppo", *_split_run(tiny_checkpoints, name, 1)[1:])
    assert "sends itself SIGUSR1" in first.stdout
    assert "[preempt] checkpoint" in first.stdout, first.stdout[-2000:]
    marker = (out / name / "PREEMPTED").read_text()
    assert marker.endswith("iter_000001"), marker
    resumed = torchrun(_split_run(tiny_checkpoints, name, 1), 2)
    assert "resumed iter_000001" in resumed.stdout
    _same(_records(out, full), _records(out, name), (0, 1, 2, 3, 4))


# ------------------------------------------------------------------ partial rollouts

@pytest.mark.slow
def test_partial_rollouts_switch_weights_mid_batch_with_each_tokens_version(tiny_checkpoints):
    """rollout.placement.partial at k = 1, the rollout process taking each update at decode step 2
    (tests/workers/partial_at.py fixes the step; in a run it depends on timing): every
    update after the first batch is taken in flight (rollout/inflight_updates), the share
    of tokens sampled after it is 1 - the batch's mean staleness (their age is 0, the
    others' 1), and no sync is sent twice. The batch waiting in the checkpoint of
    iteration 2 - batch 2, sampled by version 1, then 2 - against `megarlhf score` of the
    actors of iterations 1 and 2: its first two tokens of each row carry version 1 and
    version 1's log-probs, the rest version 2 and version 2's (within 1e-5: the keys and
    values recomputed). Catches versions recorded at the start of the batch only, weights
    taken but not used, and a push that is never taken."""
    from conftest import torchrun
    out, task, _ = tiny_checkpoints
    name = _fresh(tiny_checkpoints, "async_partial")
    args = _split_run(tiny_checkpoints, name, 1, ["rollout.placement.partial=true",
                                                  "checkpoint.keep_last=3"], iterations=3)
    torchrun(os.path.join(WORKERS, "partial_at.py"), 2, "2", *args)
    runs = _records(out, name)
    assert sorted(runs) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        m = runs[step]
        # the updates of iterations 1 and 2 are taken by batches 2 and 3 (there is no
        # batch 3 to take iteration 3's)
        assert m["rollout/inflight_updates"] == (1.0 if step < 3 else 0.0), (step, m)
        if step == 1:
            assert m["rollout/partial_tokens"] == 0.0 and m["rollout/staleness_max"] == 0
        else:
            assert 0 < m["rollout/partial_tokens"] < 1, (step, m)
            assert abs(m["rollout/staleness_mean"] - (1 - m["rollout/partial_tokens"])) < 1e-9
    queue = torch.load(out / name / "checkpoints" / "iter_000002" / "rollout_queue.pt",
                       weights_only=True)
    gen = queue["batches"]["2"]["gen"]
    mask = gen["fed_mask_BT"].bool()
    rows, versions, behaviour = [], [], []
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        prompt = gen["prompt_tokens_BP"][b][gen["prompt_mask_BP"][b].bool()].tolist()
        rows.append((len(prompt), prompt + gen["response_tokens_BT"][b, :n].tolist()))
        versions.append(gen["versions_BT"][b, :n])
        behaviour.append(gen["logprobs_BT"][b, :n])
        assert versions[-1].tolist() == [1] * min(n, 2) + [2] * max(0, n - 2), versions[-1]
    seqs = out / "partial_seqs.jsonl"
    seqs.write_text("".join(json.dumps({"tokens": seq}) + "\n" for _, seq in rows))
    scored = {}
    for version in (1, 2):
        dest = out / f"score_partial_v{version}.jsonl"
        run_cli("score", "--config", "configs/sft_tiny.yaml", "--input", str(seqs), "--output",
                str(dest), "--ckpt-role", "actor",
                f"checkpoint.load={out}/{name}/checkpoints/iter_00000{version}",
                f"tokenizer.path={task['tokenizer']}")
        scored[version] = [json.loads(line)["logprobs"] for line in dest.read_text().splitlines()]
    switched = 0
    for b, (p, _) in enumerate(rows):
        n = len(versions[b])
        for version in (1, 2):
            ref = torch.tensor(scored[version][b][p - 1:p - 1 + n])
            at = versions[b] == version
            assert torch.allclose(behaviour[b][at], ref[at], rtol=0, atol=1e-5), (b, version)
            if version == 2 and at.any():
                switched += 1
                assert (ref[at] - torch.tensor(scored[1][b][p - 1:p - 1 + n])[at]).abs().max() \
                    > 1e-4  # the versions are told apart
    assert switched > 0


@pytest.mark.extended
@pytest.mark.slow
def test_split_placement_at_rollout_tp2_equals_colocated_and_switches_in_step(tiny_checkpoints):
    """Rollout TP = 2 under split: 2 training processes (the actor data-parallel, its
    inference copy at TP = 2) and 2 rollout processes (one replica at TP = 2, each rank
    sent its half of every layer by the training rank of the same TP rank), k = 1, against
    2 colocated processes at the same rollout TP: every metric equal. Then with partial
    rollouts taken at decode step 2: the two TP ranks of the replica agree on the step
    (else their forward passes mix versions, or one waits forever in the other's
    collective), and tokens after it carry the new version."""
    from conftest import torchrun
    out = tiny_checkpoints[0]
    tp2 = ["rollout.tensor_parallel_size=2", "ppo.num_iterations=3"]
    split = ["rollout.placement.mode=split", "rollout.placement.ranks=2", "rollout.placement.weight_checksum=true"]
    colocated = _fresh(tiny_checkpoints, "async_coloc_tp2")
    torchrun(_cli(tiny_checkpoints, colocated, 1, tp2), 2)
    name = _fresh(tiny_checkpoints, "async_split_tp2")
    proc = torchrun(_cli(tiny_checkpoints, name, 1, [*tp2, *split]), 4)
    assert "placement split: training ranks 0..1 (2), rollout ranks 2..3 (2)" in proc.stdout
    one, two = _records(out, colocated), _records(out, name)
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    _same(one, two, (0, 1, 2, 3))
    partial = _fresh(tiny_checkpoints, "async_partial_tp2")
    torchrun(os.path.join(WORKERS, "partial_at.py"), 4, "2",
             *_cli(tiny_checkpoints, partial, 1, [*tp2, *split, "rollout.placement.partial=true"]))
    got = _records(out, partial)
    assert [got[s]["rollout/inflight_updates"] for s in (1, 2, 3)] == [1.0, 1.0, 0.0]
    assert all(0 < got[s]["rollout/partial_tokens"] < 1 for s in (2, 3)), got
