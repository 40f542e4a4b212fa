"""Reliability through the CLI (issue 15): wrong checkpoints and inputs refused before any
work, runaway numbers stopped with a clear message, signals honoured from the first
moment, saving after an iteration whose every step was skipped."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, WORKERS, run_cli

pytestmark = pytest.mark.slow


def ppo_args(tiny, name, *extra):
    out, task, common = tiny
    return ["ppo", "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}", f"run.name={name}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_eval_prompts=8",
            "logging.sample_table_interval=0", *common, *extra]


def env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}


@pytest.mark.parametrize("extra, message", [
    # an SFT checkpoint where the reward model belongs
    (["ppo.reward_checkpoint={out}/sft-tiny/checkpoints"],
     "is a language model (LM head), but this role needs a value model"),
    # a tokenizer other than the checkpoints'
    (["tokenizer.path={out}/other_tok.model"], "tokenizer"),
    # sequences longer than the position table
    (["rollout.max_new_tokens=60"], "data.max_prompt_len + rollout.max_new_tokens = 76 tokens "
                                    "exceeds the model's max_position_embeddings=64"),
    # (empty data, an unwritable run directory and field ranges: test_reliability.py)
])
def test_bad_inputs_fail_before_any_work(tiny_checkpoints, extra, message):
    out = tiny_checkpoints[0]
    if not (out / "other_tok.model").exists():
        from megarlhf.data.synthetic import corpus_lines
        from megarlhf.data.tokenizer import train_sentencepiece
        import random
        text = out / "other_corpus.txt"
        text.write_text("\n".join(corpus_lines(random.Random(5), 300)))
        train_sentencepiece([str(text)], str(out / "other_tok"), vocab_size=60)
    args = [a.format(out=out) for a in ppo_args(tiny_checkpoints, "bad", *extra)]
    proc = run_cli(*args, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (out / "bad" / "checkpoints").exists()


@pytest.mark.extended
def test_nan_rewards_stop_the_run_and_saving_after_skipped_steps_works(tiny_checkpoints):
    out = tiny_checkpoints[0]
    nan = ["ppo.reward_checkpoint=null", "rollout.rewards.fn=rewards:nan_reward",
           # a NaN is a failed call: scored NaN here, so that it reaches the trainer's guards
           "rollout.rewards.on_error=penalty", "rollout.rewards.error_score=.nan",
           "ppo.critic_init=sft", "ppo.num_iterations=4", "checkpoint.save_interval=1",
           # the NaN scores allowed (else they stop iteration 1: test_run_guards), so that
           # the skipped-step guards are what stops the run
           "run.allow_nonfinite=[objective/*, rollout/*, rollout_corr/*]"]
    e = env(PYTHONPATH=WORKERS)
    # the guard: 4 skipped steps per iteration, 10 in a row stop the run in iteration 3
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli",
                           *ppo_args(tiny_checkpoints, "nan", *nan)], capture_output=True,
                          text=True, env=e, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "actor: 10 optimizer steps in a row were skipped" in proc.stderr
    assert "32 of 32 rewards are not finite" in proc.stdout
    # iterations 1 and 2 skipped every step and were still saved
    assert (out / "nan" / "checkpoints" / "latest").read_text() == "iter_000002"
    # with the guard off the run finishes, saving after each all-skipped iteration
    proc = subprocess.run([sys.executable, "-m", "megarlhf.cli",
                           *ppo_args(tiny_checkpoints, "nan_off", *nan,
                                     "ppo.num_iterations=2",
                                     "optimizer.max_consecutive_skipped_steps=0",
                                     "optimizer.max_skipped_fraction=1")],
                          capture_output=True, text=True, env=e, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "nan_off" / "checkpoints" / "latest").read_text() == "iter_000002"


@pytest.mark.parametrize("sig", [signal.SIGUSR1,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.extended)])
def test_a_signal_during_start_up_checkpoints_at_the_first_safe_point(tiny_checkpoints, sig):
    """Sent while the process is still importing and building models: the run goes on to its
    first safe point, checkpoints, leaves the requeue marker and exits 0; the same command
    then resumes."""
    out = tiny_checkpoints[0]
    name = f"sig{int(sig)}"
    argv = [sys.executable, "-m", "megarlhf.cli",
            *ppo_args(tiny_checkpoints, name, "ppo.num_iterations=3")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=ROOT)
    time.sleep(1.0)  # imports: long before any model exists
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr
    assert (out / name / "PREEMPTED").read_text().endswith("iter_000001")
    assert "prompt rows kept" in stdout  # what PPO dropped from the prompts, reported
    if sig == signal.SIGINT:
        assert "Ctrl-C: checkpointing at the next safe point" in stdout
        return  # the resume after a preemption: the SIGUSR1 case
    resumed = run_cli(*ppo_args(tiny_checkpoints, name, "ppo.num_iterations=3"))
    assert "resumed iter_000001 at iteration 1" in resumed.stdout


def test_signalling_torchrun_workers_checkpoints_every_rank(tiny_checkpoints):
    """The local torchrun way the help and docs/launching.md give: SIGUSR1 to torchrun's children (the
    workers), not to torchrun. Both ranks agree on one safe point, checkpoint, and exit 0."""
    out = tiny_checkpoints[0]
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--standalone", "-m", "megarlhf.cli",
            *ppo_args(tiny_checkpoints, "torchrun_sig", "ppo.num_iterations=30",
                      "parallel.tensor_model_parallel_size=2")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), cwd=ROOT)
    metrics = out / "torchrun_sig" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:  # iteration 1 done
            break
        time.sleep(0.2)
    if proc.poll() is not None:  # ended before the signal (a failed start?): say why
        output, _ = proc.communicate()
        pytest.fail(f"torchrun ended ({proc.returncode}) before iteration 1:\n{output[-3000:]}")
    subprocess.run(["pkill", "-USR1", "-P", str(proc.pid)], check=True)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    tag = (out / "torchrun_sig" / "PREEMPTED").read_text().rsplit("/", 1)[-1]
    assert (out / "torchrun_sig" / "checkpoints" / "latest").read_text() == tag
    assert int(tag.split("_")[1]) < 30
    # start-up lines are the job's, printed once however many ranks run it
    for line in ("[megarlhf] speed-ups:", "prompts.jsonl: 256 of 256 prompt rows kept",
                 "[ppo] actor ", "[ppo] rollout TP="):
        assert output.count(line) == 1, (line, output.count(line))
