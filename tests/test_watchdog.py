"""The watchdog (issue 38): one rank of a 2-process PPO is stopped (SIGSTOP, as a wedged
process or a lost node looks to the others) at different moments; the live rank exits
non-zero within ``parallel.timeout_minutes`` plus 30 s, naming the phase it was in and the
silent rank, leaves ``STALLED`` for the Slurm launcher, and the same command then resumes
from the last checkpoint."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port

pytestmark = pytest.mark.slow
DEADLINE_S = 9.0  # parallel.timeout_minutes=0.15


def ppo(tiny, name, iterations):
    out, task, common = tiny
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            f"--master-port={free_port()}", "-m", "megarlhf.cli", "ppo",
            "configs/demo/ppo.yaml", f"data.train_path={task['prompts']}",
            f"data.eval_path={task['eval_prompts']}", f"run.name={name}",
            f"ppo.sft_checkpoint={out}/sft-tiny/checkpoints",
            f"ppo.reward_checkpoint={out}/rm-tiny/checkpoints", "ppo.num_eval_prompts=8",
            "logging.sample_table_interval=0", "checkpoint.save_interval=1",
            f"ppo.num_iterations={iterations}", "parallel.tensor_model_parallel_size=2",
            f"parallel.timeout_minutes={DEADLINE_S / 60}", *common]


def ranks(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of torchrun's workers."""
    kids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                          text=True).stdout.split()
    out = {}
    for pid in kids:
        try:
            environ = open(f"/proc/{pid}/environ").read().split("\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith("RANK="):
                out[int(item[5:])] = int(pid)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("moment", ["first_metrics", "second_checkpoint"])
def test_a_stopped_rank_is_named_and_the_run_resumes(tiny_checkpoints, moment):
    out = tiny_checkpoints[0]
    name = f"stall-{moment}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = open(out / f"{name}.log", "w+")  # a pipe nobody reads would fill and block
    launcher = subprocess.Popen(ppo(tiny_checkpoints, name, 40), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    run = out / name
    wanted = {"first_metrics": lambda: (run / "metrics.jsonl").exists()
              and "objective/kl" in (run / "metrics.jsonl").read_text(),
              "second_checkpoint": lambda: (run / "checkpoints" / "iter_000002").exists()}
    deadline = time.time() + 300
    while not wanted[moment]() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    assert launcher.poll() is None, (out / f"{name}.log").read_text()[-3000:]
    pids = ranks(launcher)
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.time()
    while alive(pids[0]) and time.time() - stopped < DEADLINE_S + 60:
        time.sleep(0.2)
    took = time.time() - stopped
    os.kill(pids[1], signal.SIGKILL)  # torchrun would, after its own grace period
    launcher.wait(timeout=120)
    err = (out / f"{name}.log").read_text()
    assert launcher.returncode != 0
    assert took < DEADLINE_S + 30, took
    assert "rank(s) 1 stopped sending heartbeats" in err and "during phase '" in err, err[-3000:]
    assert "rank 0 waited" in (run / "STALLED").read_text()
    # the same command, again: resumes from the last complete checkpoint (a save the stop
    # interrupted never became `latest`)
    latest = run / "checkpoints" / "latest"
    last = latest.read_text().strip() if latest.exists() else None
    assert moment != "second_checkpoint" or last is not None
    again = subprocess.run(ppo(tiny_checkpoints, name, 4), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    if last is not None:
        assert f"[ppo] resumed {last}" in again.stdout, again.stdout[-2000:]
