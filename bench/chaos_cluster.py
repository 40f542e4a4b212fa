"""Chaos across the two-node Slurm cluster: the ``cluster`` stage of ``bench/chaos.py``
(root, network namespaces and Debian's slurmctld/slurmd/slurm-client/munge; it brings
``scripts/local_cluster.sh``'s two nodes up and down itself).

One PPO run (an EMA actor, 2 nodes x 1 process, every role data-parallel across the
nodes, a checkpoint every iteration), launched with ``megarlhf launch --slurm``, is hit in
turn by every way Slurm restarts a job:
- ``requeue``: an operator's ``scontrol requeue`` - Slurm signals the batch script, the
  tasks checkpoint, the job starts again;
- ``preempt``: SIGUSR1 to the batch script (Slurm's ``--signal=B:USR1`` before a
  preemption or the time limit) - the tasks checkpoint and the job requeues itself;
- ``crash``: SIGKILL of every task at once (no checkpoint, no marker, the run's lock left
  behind) - the job ends, and a fresh ``sbatch`` of the same command follows;
- ``cancel``: a user's ``scancel`` - then a fresh ``sbatch``;
- ``node``: one node dies with everything on it (``local_cluster.sh die``; node 1 - the
  batch script's, rank 0's and the lock holder's host - and node 2 in turn): the other
  side's watchdog ends its rank, Slurm requeues the job for the node's failure, the node
  comes back (``mend``) and the job resumes.
Nothing is cleared by hand. At the end every metric and the final weights must equal the
same run's left alone on the same cluster, bitwise, and no fault may lose more than one
checkpoint interval.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from chaos_check import ROOT, cli, compare, latest, steps

CLUSTER = os.path.join(ROOT, "scripts", "local_cluster.sh")
KINDS = ("requeue", "preempt", "crash", "cancel", "node")
DEADLINE_MIN = 0.15  # parallel.timeout_minutes: a lost node is noticed within 9 s


def submit(args: list, name: str, launch: list) -> str:
    out = cli("launch", *args, *launch, f"run.name={name}", "--slurm").stdout
    return out.split("submitted job ")[1].split(";")[0]


def queued(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                          text=True).stdout.strip()


def node_tasks(node: int) -> list[int]:
    """The megarlhf processes running on node ``node`` (in its network namespace)."""
    pids = subprocess.run(["ip", "netns", "pids", f"mrl-node{node}"], capture_output=True,
                          text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            if b"megarlhf.cli" in open(f"/proc/{pid}/cmdline", "rb").read():
                out.append(int(pid))
        except OSError:
            pass
    return out


def read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else ""


def resumes(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"\[ppo\] resumed iter_(\d+)", log)]


def finish(job: str, log_path: str, n: int, run: str, timeout: float = 900) -> None:
    """Until ``job`` has left the queue with the run's last iteration checkpointed (squeue
    shows nothing for a moment between a requeue and the held job)."""
    deadline, out_since = time.time() + timeout, None
    while time.time() < deadline:
        if queued(job):
            out_since = None
        else:
            out_since = out_since or time.time()
            if latest(run) == n and "[ppo] done" in read(log_path):
                return
            if time.time() - out_since > 30:
                raise AssertionError(f"job {job} left the queue unfinished:\n"
                                     + read(log_path)[-3000:])
        time.sleep(1)
    raise AssertionError(f"job {job} did not finish in {timeout} s")


def soak(args, out: str, task: dict, ppo: list, rng) -> dict:
    """``ppo``: the stage's command (``chaos.stage_args``); returns what ``chaos.soak``
    returns."""
    state = os.path.join(out, "cluster-state")
    up = subprocess.run(["bash", CLUSTER, "up", state, "2"], capture_output=True, text=True,
                        timeout=180)
    if up.returncode != 0:
        raise SystemExit(f"the local cluster did not start:\n{up.stdout}\n{up.stderr}")
    try:
        return _soak(args, out, task, ppo, state, rng)
    finally:
        subprocess.run(["bash", CLUSTER, "down", state], timeout=120)


def _soak(args, out: str, task: dict, ppo: list, state: str, rng) -> dict:
    n = args.iterations
    logs = os.path.join(out, "logs")
    launch = [f"launch.log_dir={logs}", "launch.gpus_per_node=0", "launch.cpus_per_task=1",
              f"launch.python={os.path.join(ROOT, '.venv', 'bin', 'python')}",
              "launch.nodes=2", "launch.tasks_per_node=1",
              f"parallel.timeout_minutes={DEADLINE_MIN}"]
    log_of = lambda name, job: os.path.join(logs, f"megarlhf-ppo-{name}-{job}.out")  # noqa: E731
    start = time.time()
    ref = submit(ppo, "cluster-reference", launch)
    finish(ref, log_of("cluster-reference", ref), n, os.path.join(out, "cluster-reference"))
    ref_seconds = time.time() - start
    run = os.path.join(out, "cluster-chaos")
    lost, log, hits = [], [], {}
    start = time.time()
    job = submit(ppo, "cluster-chaos", launch)
    for k in range(args.faults):
        seen = len(steps(run))
        until = time.time() + 600
        while len(steps(run)) < seen + 2 and latest(run) < n and time.time() < until:
            time.sleep(0.5)  # the restarted job trains again
        time.sleep(rng.uniform(0.0, 6.0))
        if latest(run) == n:
            break
        kind = KINDS[k % len(KINDS)]
        hits[kind] = hits.get(kind, 0) + 1
        path, before = log_of("cluster-chaos", job), latest(run)
        resumed_before = len(resumes(read(path)))
        if kind == "requeue":
            subprocess.run(["scontrol", "requeue", job], check=True)
            how = "scontrol requeue"
        elif kind == "preempt":
            subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
            how = "SIGUSR1 to the batch script"
        elif kind in ("crash", "cancel"):
            if kind == "crash":
                tasks = node_tasks(1) + node_tasks(2)
                for pid in tasks:
                    os.kill(pid, 9)
                how = f"SIGKILL of {len(tasks)} task(s) at once"
            else:
                subprocess.run(["scancel", job], check=True)
                how = "scancel"
            until = time.time() + 120
            while queued(job) and time.time() < until:
                time.sleep(0.5)
            job = submit(ppo, "cluster-chaos", launch)
            path, resumed_before = log_of("cluster-chaos", job), 0
            how += f", then a fresh sbatch (job {job})"
        else:
            node = 1 + (hits[kind] - 1) % 2
            subprocess.run(["bash", CLUSTER, "die", state, str(node)], check=True)
            ctld, until = os.path.join(state, "log", "slurmctld.log"), time.time() + 180
            line = f"requeue job JobId={job} due to failure of node node{node}"
            while line not in read(ctld) and time.time() < until:
                time.sleep(1)
            subprocess.run(["bash", CLUSTER, "mend", state, str(node)], check=True)
            how = f"node{node} died ({'requeued for it' if line in read(ctld) else 'NOT requeued'})"
        # the most the run reached before it resumed, and the checkpoint it resumed from
        reached, until = max(steps(run), default=0), time.time() + 600
        while len(resumes(read(path))) <= resumed_before and time.time() < until \
                and latest(run) < n:
            reached = max(reached, max(steps(run), default=0))
            time.sleep(0.2)
        got = resumes(read(path))[resumed_before:]
        kept = got[0] if got else latest(run)
        lost.append(max(0, reached - kept))
        log.append(f"cluster fault {k + 1} ({kind}): {how}; checkpoint {before} -> {kept}, "
                   f"metrics reached {reached}, lost {lost[-1]}")
        print(log[-1], flush=True)
    finish(job, log_of("cluster-chaos", job), n, run)
    chaos_seconds = time.time() - start
    return compare("cluster", out, task, "actor", n, lost, log, KINDS, hits, ref_seconds,
                   chaos_seconds)
