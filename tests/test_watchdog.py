"""The watchdog, in a real 2-process PPO: one rank stopped (SIGSTOP: wedged, as a lost
node looks to the others) or killed (SIGKILL) in each of four phases; the live rank exits
non-zero within ``parallel.timeout_minutes`` plus 30 s naming the phase, the missing rank
and its host, leaves ``STALLED`` for the Slurm launcher, and the same command then resumes
from the last checkpoint."""

import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import ROOT
from test_run_guards import DEADLINE_S, alive, ppo, ranks

pytestmark = pytest.mark.slow


# rank 1 halts as it enters the phase (tests/workers/halt_in_phase.py); rank 0 is caught
# waiting for it in the same phase - or, for sampling (two rollout replicas of TP=1 that
# generate on their own), in the gathering that follows
PHASES = {"sampling": "generation", "experience": "forward pass of the reward",
          "update": "update of the actor", "save": "checkpoint save"}
CAUGHT = {**PHASES, "sampling": "gathering the generations"}


# one kill in the fast tier; every phase and both signals in the extended
FAST_HALTS = {("update", "KILL")}


@pytest.mark.parametrize("where, sig", [
    pytest.param(w, s, marks=() if (w, s) in FAST_HALTS else pytest.mark.extended)
    for w in PHASES for s in ("STOP", "KILL")])
def test_a_halted_rank_is_named_and_the_run_resumes(tiny_checkpoints, where, sig):
    """One rank of a 2-process PPO stopped (SIGSTOP: wedged, as a lost node looks) or
    killed (SIGKILL: gone) in each of four phases: the live rank exits non-zero within the
    deadline plus 30 s naming the phase and the missing rank, leaves STALLED for
    slurm/launch.sh and `latest` on a complete checkpoint, and the same command then
    resumes from it."""
    from conftest import WORKERS
    out = tiny_checkpoints[0]
    name = f"halt-{where}-{sig}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log_path = out / f"{name}.log"
    log = open(log_path, "w+")  # a pipe nobody reads would fill and block
    cmd = ppo(tiny_checkpoints, name, 40)
    worker = cmd.index("megarlhf.cli") - 1  # torchrun's "-m megarlhf.cli" -> the worker
    cmd[worker:worker + 2] = [os.path.join(WORKERS, "halt_in_phase.py"), PHASES[where], sig]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
    pids, deadline = {}, time.time() + 300
    while "sends itself" not in log_path.read_text() and time.time() < deadline \
            and launcher.poll() is None:
        pids = ranks(launcher) or pids
        time.sleep(0.1)
    halted = time.time()
    assert 0 in pids and launcher.poll() is None, log_path.read_text()[-3000:]
    while alive(pids[0]) and time.time() - halted < DEADLINE_S + 60:
        time.sleep(0.2)
    took = time.time() - halted
    if sig == "STOP":
        os.kill(pids[1], signal.SIGKILL)  # torchrun would, after its own grace period
    launcher.wait(timeout=120)
    err = log_path.read_text()
    assert launcher.returncode != 0
    assert took < DEADLINE_S + 30, took
    host = socket.gethostname()
    missing = f"rank(s) 1 (host {host}) stopped sending heartbeats" if sig == "STOP" else \
        f"lost its connection to rank(s) 1 (host {host}), whose heartbeat stopped,"
    assert missing in err and f"during phase '{CAUGHT[where]}'" in err, err[-3000:]
    run = out / name
    assert "rank 0 " in (run / "STALLED").read_text()
    # the last complete checkpoint is `latest` (a save the halt interrupted never became
    # it); the same command, again, resumes from it and runs one more iteration (once per
    # phase: a killed rank leaves the checkpoints as a stopped one does)
    last = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / last / "megarlhf_meta.json").exists()
    if sig == "KILL":
        return
    again = subprocess.run(ppo(tiny_checkpoints, name, int(last[len("iter_"):]) + 1),
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[ppo] resumed {last}" in again.stdout, again.stdout[-2000:]
